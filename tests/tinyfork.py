"""A fork written from docs/forking.md alone, that is not a GPT and does not subclass one: a
small decoder with a config of its own (n_kv_head: grouped-query attention, a field GPTConfig
lacks), torch's LayerNorm without bias, a squared-ReLU MLP, no position embedding (causal
attention alone tells positions apart), a head tied to the token embedding and no padded
vocabulary. It declares ARCH, CONFIG, blocks(), LINEARS, and what its module kinds save for
backward (SAVED, KEPT); nothing else: num_params, MFU, generate, load_weights and
stored_shapes take the defaults (machinery/declared.py). tests/test_fork.py drives it through
train.py, sample.py, export.py, memory.py and a loop of its own."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class TinyConfig:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # grouped-query attention (Ainslie et al. 2023): K and V heads
    n_embd: int = 32

    def __post_init__(self):
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_embd {self.n_embd}, n_head {self.n_head}, n_kv_head "
                             f"{self.n_kv_head}: each must divide the one before")


class Attention(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.hs = cfg.n_head, cfg.n_kv_head, cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.kv_proj = nn.Linear(cfg.n_embd, 2 * cfg.n_kv_head * self.hs, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q = self.q_proj(x).view(B, T, self.n_head, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k, v = (t.view(B, T, self.n_kv_head, self.hs).transpose(1, 2)  # (B, kvh, T, hs)
                for t in self.kv_proj(x).split(self.n_kv_head * self.hs, dim=2))
        g = self.n_head // self.n_kv_head  # each K/V head serves g query heads
        k, v = (t[:, :, None].expand(B, self.n_kv_head, g, T, self.hs).reshape(B, -1, T, self.hs)
                for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):  # relu(x)^2 (So et al. 2021, "Primer")

    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down(F.relu(self.up(x)).square())


class Layer(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyFork(nn.Module):
    ARCH = "tinyfork"
    CONFIG = TinyConfig
    LINEARS = (("attn.q_proj", ("q",)), ("attn.kv_proj", ("k", "v")),
               ("attn.o_proj", ("attn_out",)), ("mlp.up", ("mlp_up",)),
               ("mlp.down", ("mlp_down",)))

    def __init__(self, config):
        super().__init__()
        self.config, self.grad_ckpt = config, False
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.n_layer)])
        self.norm = nn.LayerNorm(config.n_embd, bias=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight  # tied
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def blocks(self):
        return list(self.layers)

    def forward(self, idx, targets=None):
        x = self.tok(idx)
        for i, layer in enumerate(self.layers):  # model.py's loop: True, or a policy
            if not (self.grad_ckpt and self.training and torch.is_grad_enabled()):
                x = layer(x)
            elif self.grad_ckpt is True:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = self.grad_ckpt(layer, x, i)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


# -- memory.py: what each kind saves for backward (docs/forking.md, "memory.py for a fork") ------

def attention(name, m, f):
    """q_proj and kv_proj read one input; SDPA keeps q (q_proj's output), the repeated k and v,
    its output (o_proj's input: one storage) and a logsumexp per row and head."""
    q, kv = f.linear(f"{name}.q_proj", m.q_proj), f.linear(f"{name}.kv_proj", m.kv_proj)
    terms = {k: v for k, v in {**q, **kv}.items() if "LoRA" in k}
    if f"{name}.q_proj input" in q or f"{name}.kv_proj input" in kv:
        terms[f"{name}: input (q_proj's and kv_proj's)"] = f.values(m.q_proj.weight.shape[1])
    attended = f.live
    if attended:
        C = m.q_proj.weight.shape[0]
        terms.update({f"{name}: q, repeated k and v": f.values(3 * C),
                      f"{name}: logsumexp (fp32)": 4 * f.b * f.s * m.n_head,
                      f"{name}: output = o_proj input": f.values(C)})
    out = f.linear(f"{name}.o_proj", m.o_proj)
    if attended:
        out.pop(f"{name}.o_proj input", None)
    return {**terms, **out}


def mlp(name, m, f):
    """up keeps its input; relu keeps its output, which square reads; down keeps the square."""
    terms = f.linear(f"{name}.up", m.up)
    if f.live:
        terms[f"{name}: relu output"] = f.values(m.up.weight.shape[0])
    return {**terms, **f.linear(f"{name}.down", m.down)}


def tinyfork(model, f, grad_ckpt):
    """The token ids (when the tied embedding trains), the layers, the final norm, the head's
    input, F.cross_entropy's fp32 log-softmax, its total weight and the targets."""
    C, V = model.config.n_embd, model.config.vocab_size
    outside = {"token ids (int64)": 8 * f.b * f.s} if f.trainable(model.tok) else {}
    f.live = f.trainable(model.tok)
    blocks = f.blocks(model, grad_ckpt, C, "layers")
    outside.update(f.walk("norm", model.norm))
    outside.update(f.linear("lm_head", model.lm_head))
    outside.update({"log-softmax (fp32)": 4 * f.b * f.s * V, "total weight (fp32)": 4,
                    "targets (int64)": 8 * f.b * f.s})
    return outside, blocks


def kept_attention(name, m, f):
    """Selective: the three matmuls' outputs, SDPA's output and logsumexp."""
    return {**f.kept_linear(f"{name}.q_proj", m.q_proj),
            **f.kept_linear(f"{name}.kv_proj", m.kv_proj),
            f"{name}: attention output": f.values(m.q_proj.weight.shape[0]),
            f"{name}: logsumexp (fp32)": 4 * f.b * f.s * m.n_head,
            **f.kept_linear(f"{name}.o_proj", m.o_proj)}


def kept_mlp(name, m, f):
    """Selective: up's and down's outputs; relu and the square are recomputed."""
    return {**f.kept_linear(f"{name}.up", m.up), **f.kept_linear(f"{name}.down", m.down)}


TinyFork.SAVED, Attention.SAVED, MLP.SAVED = tinyfork, attention, mlp
Attention.KEPT, MLP.KEPT = kept_attention, kept_mlp
