"""
The GPT-2 language model, from scratch, and nothing else.

References:
  - Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2)
  - karpathy/nanoGPT model.py, whose shape this file follows
  - Chowdhery et al. 2022, "PaLM", appendix B: the FLOPs-per-token formula behind MFU

This file knows nothing about distribution, mixed precision or LoRA: zero.py,
precision.py and lora.py wrap or edit the model from outside. The one switch it
carries is activation checkpointing in the block loop, because only the block loop
knows where a block starts and ends.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    arch: str = "gpt2"      # the architecture's name: checkpoints carry it, resume checks it
    block_size: int = 256   # longest sequence the position embedding covers
    vocab_size: int = 65    # 65 characters for shakespeare_char, 50257 for GPT-2 BPE
    pad_vocab: int = 64     # embedding / head rows rounded up to a multiple of this
    n_layer: int = 6        # transformer blocks
    n_head: int = 6         # attention heads per block
    n_embd: int = 384       # residual stream width
    dropout: float = 0.0    # dropout on attention probabilities and residual branches
    bias: bool = True       # biases in Linear and LayerNorm, as GPT-2 has them

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "pad_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                             f"pick n_embd as a multiple of n_head")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def padded_vocab(self):
        """Rows of the embedding and the LM head. 50257 rows make the head's three matmuls (~27%
        of GPT-2's FLOPs) miss the GPU's tiles; 50304 = 786 x 64 fit them. The padded rows start
        at zero and stay zero: no token id reaches them, and their logits are cut off before the
        loss and sampling, so they get no gradient."""
        return math.ceil(self.vocab_size / self.pad_vocab) * self.pad_vocab


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias. In bf16 / fp16 PyTorch's kernel takes the mean and
    variance in fp32 itself (a 16-bit sum over 768 values would lose digits), so the input is
    not cast: a cast would cost kernels and keep an fp32 copy of it for backward."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        # one fused projection for q, k and v: one matmul instead of three
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        # flash / memory-efficient kernels where the device has them; the causal mask is built in
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        # GPT-2 was trained with the tanh approximation of GELU: pretrained weights need it
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


def cross_entropy(logits, targets, vocab):
    """The mean loss over the real vocabulary: the padded columns are no tokens.
    The softmax in fp32: 16-bit logits over a 50k vocabulary lose the small
    probabilities. A target of -1 is ignored. This keeps an fp32 copy of all the
    logits for backward; beyond/chunked_loss.py does without it."""
    logits = logits[..., :vocab].float().reshape(-1, vocab)  # (B*T, vocab) fp32
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=-1)


class GPT(nn.Module):
    """GPT-2. Besides forward, it declares what the engine needs to know of it, once: its
    blocks() (ZeRO-3's units, --compile's regions, the checkpointed segments; everything else
    is the root) and LINEARS, the layers of a block that lora.py adapts and quant.py quantizes.
    A fork with other layers changes these two, not the engine (README, "Forking")."""

    ARCH = "gpt2"  # the name its GPTConfig carries: checkpoints hold it, resume compares it
    # (path inside a block, the names of its equal output slices): the fused q|k|v is three
    LINEARS = (("attn.c_attn", ("q", "k", "v")), ("attn.c_proj", ("attn_out",)),
               ("mlp.c_fc", ("mlp_fc",)), ("mlp.c_proj", ("mlp_proj",)))

    def __init__(self, config):
        super().__init__()
        if config.arch != self.ARCH:
            raise ValueError(f"arch={config.arch!r}: model.py's GPT builds {self.ARCH!r}")
        self.config = config
        # activation checkpointing (train.py --grad-ckpt): False; True, every block; or a
        # policy from beyond/activation_dial.py (selective, every K-th block)
        self.grad_ckpt = False
        # the loss of the head: this file's plain one, or beyond/chunked_loss.py's
        self.cross_entropy = cross_entropy
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab, bias=False)
        # weight tying (Press & Wolf 2017): the LM head *is* the token embedding, one Parameter
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2*n_layer), since each block adds two
        # branches to the residual stream and its variance would otherwise grow with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        with torch.no_grad():
            self.lm_head.weight[config.vocab_size:] = 0.0  # the padded rows (see padded_vocab)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def blocks(self):
        """The repeated blocks, in forward order."""
        return list(self.transformer.h)

    def num_params(self, non_embedding=True):
        """Parameters counted once each (the tied wte/lm_head is one tensor). Learned position
        embeddings, where the model has them, are left out by default, as the 6N FLOPs formula
        wants (a lookup, no matmul)."""
        n = sum(p.numel() for p in self.parameters())  # .parameters() already deduplicates
        wpe = dict(self.named_modules()).get("transformer.wpe")  # a fork may have none
        if non_embedding and wpe is not None:
            n -= wpe.weight.numel()
        return n

    def forward(self, idx, targets=None):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than "
                             f"block_size={self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        tok, pos = self.transformer.wte(idx), self.transformer.wpe(pos)  # (B, T, C), (T, C)
        x = self.transformer.drop(tok + pos)
        for i, block in enumerate(self.transformer.h):
            if not (self.grad_ckpt and self.training and torch.is_grad_enabled()):
                x = block(x)
            elif self.grad_ckpt is True:
                # Chen et al. 2016: keep only the block's input, recompute the block in
                # backward. Not the reentrant variant: it yields no gradients when no input
                # requires grad (frozen embeddings under LoRA).
                x = checkpoint(block, x, use_reentrant=False)
            else:  # which blocks, which tensors: the policy says
                x = self.grad_ckpt(block, x, i)
        return self.head(x, targets)

    def head(self, x, targets=None):
        """The final LayerNorm, the LM head and the loss: (logits, loss). The padded columns'
        logits are no tokens: cut off (a view), and outside the loss's softmax."""
        x = self.transformer.ln_f(x)
        V = self.config.vocab_size
        if targets is None:
            return self.lm_head(x[:, [-1], :])[..., :V], None  # inference: the last position
        logits = self.lm_head(x)  # (B, T, padded vocab), in the working dtype
        return logits[..., :V], self.cross_entropy(logits, targets, V)

    def stored_shapes(self):
        """Every tensor as files hold it: the embedding with the vocabulary's own rows, not the
        zero rows it is padded with (they are the flat tensor's last elements)."""
        return stored_shapes(self, self.config.vocab_size)

    def load_weights(self, weights):
        return load_weights(self, weights)

    def flops_per_token(self):
        """PaLM appendix B: 6N for the matmuls over parameters (2 forward, 4 backward) plus
        12*L*H*Q*T for attention's two T-long matmuls (QK^T and AV), forward and backward."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        return 6 * self.num_params() + 12 * L * H * Q * T

    def estimate_mfu(self, tokens_per_sec, peak_flops):
        """Model FLOPs utilisation: achieved model FLOP/s over the hardware's peak.
        Recomputation (activation checkpointing) is not counted: MFU counts useful work."""
        if not peak_flops:
            return None
        return self.flops_per_token() * tokens_per_sec / peak_flops

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        return generate(self, idx, max_new_tokens, temperature, top_k, generator,
                        self.config.block_size)


# ----------------------------------------------------------------------------------------------
# the weights as files hold them, and sampling: GPT's, and any model's (a fork's, by default)

def stored_shapes(model, vocab_rows=None):
    """{name: shape} of every tensor as files hold it (checkpoints, exports): parameters and
    persistent buffers, the tied weight once, under its first name. vocab_rows: the rows a
    padded embedding and LM head store (GPT's vocabulary)."""
    shapes, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            shape = list(t.shape)
            if vocab_rows and (name.endswith("wte.weight") or name == "lm_head.weight"):
                shape[0] = vocab_rows
            shapes[name] = shape
    return shapes


@torch.no_grad()
def load_weights(model, weights):
    """Copy a state_dict in: as files hold it (the model's stored_shapes; padded rows keep their
    zeros) or as state_dict() gives it. A ValueError names a tensor that does not fit."""
    shapes = model.stored_shapes() if hasattr(model, "stored_shapes") else stored_shapes(model)
    targets = model.state_dict(keep_vars=True)
    missing, extra = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(targets))
    if missing or extra:
        raise ValueError(f"{missing[0]} is missing" if missing else
                         f"{extra[0]} is not in this model")
    for name, shape in shapes.items():
        source, target = weights[name], targets[name].detach()
        if source.shape != target.shape:
            if list(source.shape) != shape:
                raise ValueError(f"{name} is {list(source.shape)}, this model has {shape}")
            target = target[:shape[0]]
        target.copy_(source)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
             block_size=None):
    """Sample max_new_tokens tokens after the prompt idx (B, T), one at a time, from the logits
    model(idx) gives first; the context cut to block_size."""
    for _ in range(max_new_tokens):
        idx_cond = idx if block_size is None else idx[:, -block_size:]  # what the model sees
        logits = model(idx_cond)[0]
        logits = logits[:, -1, :].float()
        if temperature <= 0:  # greedy
            idx_next = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                # masked_fill_, not logits[mask] = ...: a boolean index_put counts the
                # mask on the host, one sync per generated token on a GPU
                logits.masked_fill_(logits < v[:, [-1]], -float("inf"))
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx
