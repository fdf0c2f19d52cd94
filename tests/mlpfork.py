"""A fork as docs/forking.md says to bring one in: model.py ending in
`from mlpfork import MLPFork as GPT` (tests/test_fork.py writes that edit into a copy of model.py
and runs the commands in a fresh interpreter, where they import the fork at their own import).
Not a GPT: a token-wise MLP language model (each position predicts the next from its own token:
a bigram model with a hidden layer), a config that names its width d_model (no n_embd, no
n_head), LINEARS that are a block's own children ("up", not "mlp.up"), an untied head. It
declares ARCH, CONFIG, blocks(), LINEARS and memory.py's formulas; nothing else (no head(), no
self.grad_ckpt: --compile and --grad-ckpt are one line)."""
from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    d_model: int = 32


class Block(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, 2 * cfg.d_model)
        self.down = nn.Linear(2 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return x + self.down(F.relu(self.up(self.norm(x))))


class MLPFork(nn.Module):
    ARCH = "mlpfork"
    CONFIG = MLPConfig
    LINEARS = (("up", ("up",)), ("down", ("down",)))

    def __init__(self, config):
        super().__init__()
        self.config = config  # no grad_ckpt: its loop checkpoints nothing (--grad-ckpt: one line)
        self.emb = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def blocks(self):
        return list(self.layers)

    def forward(self, idx, targets=None):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# -- memory.py (docs/forking.md, "memory.py for a fork"): a Block is walked child by child (the
# norm, up's input, down's input, which is relu's output too: one tensor); the model's own

def mlpfork(model, f, grad_ckpt):
    """The token ids, the blocks, the head's input, F.cross_entropy's log-softmax (in the
    logits' dtype: no cast), its total weight and the targets."""
    outside = {"token ids (int64)": 8 * f.b * f.s} if f.trainable(model.emb) else {}
    f.live = f.trainable(model.emb)
    blocks = f.blocks(model, grad_ckpt, model.config.d_model, "layers")
    outside.update(f.linear("head", model.head))
    outside.update({"log-softmax": f.values(model.config.vocab_size), "total weight": 4,
                    "targets (int64)": 8 * f.b * f.s})
    return outside, blocks


def kept_block(name, m, f):
    """Selective: up's and down's outputs."""
    return {**f.kept_linear(f"{name}.up", m.up), **f.kept_linear(f"{name}.down", m.down)}


MLPFork.SAVED, Block.KEPT = mlpfork, kept_block
