"""A fork of model.py, as a forker would write one: a Llama-style model (RMSNorm, SwiGLU, rotary
position embeddings, no learned positions, an untied head, Llama's names). It subclasses GPT
for its checkpoint shapes, FLOPs and generate (tests/tinyfork.py is a fork that does not), and
declares what the engine reads -- ARCH, LINEARS, blocks(), head(), stored_shapes() (GPT's) --
and its module kinds' activation formulas on the classes themselves (SAVED: what each saves;
KEPT: what a selectively checkpointed block keeps), importing nothing of the estimator. Nothing
of the engine changes (tests/test_fork.py drives it)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from beyond.chunked_loss import cross_entropy
from model import GPT


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019: x / rms(x) * g, no mean, no bias. The statistics in fp32, as
    Llama's own: in fp16 x^2 overflows from |x| = 256, and its backward with it."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


def rotate(x, cos, sin):  # RoPE (Su et al. 2021) on (B, nh, T, hs), halves as in Llama
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        C, self.n_head, self.n_embd = cfg.n_embd, cfg.n_head, cfg.n_embd
        self.qkv_proj = nn.Linear(C, 3 * C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        hs = C // cfg.n_head
        inv_freq = 1.0 / (10000 ** (torch.arange(0, hs, 2).float() / hs))
        angles = torch.outer(torch.arange(cfg.block_size).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
        # recomputed at init: not model state (a persistent buffer would be refused)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv_proj(x).split(C, dim=2))
        q, k = rotate(q, self.cos[:T], self.sin[:T]), rotate(k, self.cos[:T], self.sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLU(nn.Module):  # Shazeer 2020: down(silu(gate(x)) * up(x))

    def __init__(self, cfg):
        super().__init__()
        C = cfg.n_embd
        self.gate_proj = nn.Linear(C, 4 * C, bias=False)
        self.up_proj = nn.Linear(C, 4 * C, bias=False)
        self.down_proj = nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd)
        self.mlp = SwiGLU(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(GPT):
    """GPT's methods (checkpoint shapes, FLOPs, generate) on Llama's layers."""
    ARCH = "llama"
    LINEARS = (("self_attn.qkv_proj", ("q", "k", "v")), ("self_attn.o_proj", ("attn_out",)),
               ("mlp.gate_proj", ("mlp_gate",)), ("mlp.up_proj", ("mlp_up",)),
               ("mlp.down_proj", ("mlp_down",)))

    def __init__(self, config):
        nn.Module.__init__(self)
        self.config, self.grad_ckpt = config, False
        V, C = config.padded_vocab, config.n_embd
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)  # untied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.n_layer) if "o_proj" in name or \
                    "down_proj" in name else 0.02
                torch.nn.init.normal_(p, std=std)
        with torch.no_grad():  # the padded rows: no token reaches them
            self.embed_tokens.weight[config.vocab_size:] = 0.0
            self.lm_head.weight[config.vocab_size:] = 0.0

    def blocks(self):
        return list(self.layers)

    def forward(self, idx, targets=None):
        x = self.embed_tokens(idx)
        for i, block in enumerate(self.layers):  # model.py's loop: True, or a policy
            if not (self.grad_ckpt and self.training and torch.is_grad_enabled()):
                x = block(x)
            elif self.grad_ckpt is True:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = self.grad_ckpt(block, x, i)
        return self.head(x, targets)

    def head(self, x, targets=None):
        x, V = self.norm(x), self.config.vocab_size
        if targets is None:
            return self.lm_head(x[:, [-1], :])[..., :V], None
        logits = self.lm_head(x)
        return logits[..., :V], cross_entropy(logits, targets, V)


# -- memory.py: what each of its module kinds saves for backward --------------------------------

def rms_norm(name, m, f):
    """pow keeps x in fp32 (x itself in fp32, a cast copy else), rsqrt its output r (fp32, one
    per row), x * r keeps both, (x * r) * g keeps x * r in the working dtype when g trains."""
    if not (f.live or f.trainable(m)):
        return {}
    f.live = True
    terms = {f"{name} input (fp32)": f.values(m.weight.numel(), 4),
             f"{name} rsqrt (fp32)": f.values(1, 4)}
    if f.trainable(m):
        terms[f"{name} normalized"] = f.values(m.weight.numel())
    return terms


def attention(name, m, f):
    """qkv_proj, RoPE (its cos and sin buffers, kept whole by the products), SDPA: the rotated
    q and k, v (a view of qkv_proj's output: all of it), the logsumexp, the output."""
    terms = f.linear(f"{name}.qkv_proj", m.qkv_proj)
    attended = f.live
    if attended:
        C = m.n_embd
        terms[f"{name}: cos, sin"] = 2 * m.cos.numel() * f.E
        terms[f"{name}: rotated q, k"] = f.values(2 * C)
        terms[f"{name}: qkv_proj output (v's storage)"] = f.values(3 * C)
        terms[f"{name}: logsumexp (fp32)"] = 4 * f.b * f.s * m.n_head
        terms[f"{name}: output = o_proj input"] = f.values(C)
    proj = f.linear(f"{name}.o_proj", m.o_proj)
    if attended:
        proj.pop(f"{name}.o_proj input", None)
    return {**terms, **proj}


def swiglu(name, m, f):
    """gate and up read the same x (one storage); silu keeps its input, the product both of its
    factors; down_proj keeps the product when it trains or has an adapter."""
    gate = f.linear(f"{name}.gate_proj", m.gate_proj)
    up = f.linear(f"{name}.up_proj", m.up_proj)
    reads_x = f"{name}.gate_proj input" in gate or f"{name}.up_proj input" in up
    terms = {f"{name} input (gate's and up's)": f.values(m.gate_proj.weight.shape[1])} \
        if reads_x else {}
    terms.update({k: v for k, v in {**gate, **up}.items() if "LoRA" in k})
    if f.live:
        H = m.gate_proj.weight.shape[0]
        terms.update({f"{name}: gate output": f.values(H), f"{name}: silu output": f.values(H),
                      f"{name}: up output": f.values(H)})
    terms.update(f.linear(f"{name}.down_proj", m.down_proj))
    return terms


def llama(model, f, grad_ckpt):
    outside = {}
    if f.trainable(model.embed_tokens):
        outside["token ids (int64)"] = 8 * f.b * f.s
    f.live = f.trainable(model.embed_tokens)
    blocks = f.blocks(model, grad_ckpt, model.config.n_embd, "layers")
    outside.update(f.walk("norm", model.norm))
    outside.update(f.linear("lm_head", model.lm_head))
    outside["logits"] = f.values(model.config.padded_vocab)
    outside["logsumexp (fp32), targets (int64)"] = 12 * f.b * f.s
    return outside, blocks


def kept_attention(name, m, f):
    """Selective: qkv_proj's and o_proj's matmul outputs, SDPA's output and logsumexp."""
    return {**f.kept_linear(f"{name}.qkv_proj", m.qkv_proj),
            f"{name}: attention output": f.values(m.n_embd),
            f"{name}: logsumexp (fp32)": 4 * f.b * f.s * m.n_head,
            **f.kept_linear(f"{name}.o_proj", m.o_proj)}


def kept_swiglu(name, m, f):
    """Selective: the three matmuls' outputs; silu and the product are recomputed."""
    return {k: v for path in ("gate_proj", "up_proj", "down_proj")
            for k, v in f.kept_linear(f"{name}.{path}", getattr(m, path)).items()}


# the formulas, on the classes: memory.py finds them there (docs/forking.md)
Llama.SAVED, RMSNorm.SAVED, Attention.SAVED, SwiGLU.SAVED = llama, rms_norm, attention, swiglu
RMSNorm.KEPT, Attention.KEPT, SwiGLU.KEPT = lambda name, m, f: {}, kept_attention, kept_swiglu
