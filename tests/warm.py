"""Imported once by the tests' fork server (conftest.py): the first forward, backward and fused
AdamW step of a process pay one-time set-up costs; paid here, every rank forked from the server
starts warm. One thread: the server must stay single-threaded to be safe to fork."""
import torch

from model import GPT, GPTConfig

torch.set_num_threads(1)
_model = GPT(GPTConfig(block_size=8, vocab_size=13, n_layer=1, n_head=2, n_embd=8))
_x = torch.randint(0, 13, (2, 8))
_model(_x, _x)[1].backward()
torch.optim.AdamW(_model.parameters(), fused=True).step()
del _model, _x
