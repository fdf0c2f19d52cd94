"""A tiny Mixture-of-Experts decoder of our own, for the engine's contract with a model that has
idle parameters (#50): each block routes every token to its top 2 of a few small experts
(Shazeer et al. 2017), so an expert no token chose gets no gradient in that step, and returns
(hidden, router_logits), as Mixtral-style layers do. The model adds a balance loss over every
block's router logits to the LM loss (Fedus et al. 2021, "Switch Transformers", eq. 4), or
returns the two apart (forward(..., apart=True)) for a loop that back-propagates them apart.

No attention: a token mixes with the one before it through a causal shift, enough to make the
LM loss depend on position. Nothing here knows of ZeRO; tests/test_moe.py drives it."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoEConfig:
    vocab_size: int = 16
    block_size: int = 4
    n_layer: int = 2
    n_embd: int = 8
    n_expert: int = 6
    top_k: int = 2
    balance: float = 0.1  # the balance loss's weight in the sum


class Expert(nn.Module):
    """A small two-layer MLP."""

    def __init__(self, cfg):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 2 * cfg.n_embd)
        self.down = nn.Linear(2 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """x + the weighted sum of each token's top-k experts; returns (x, router_logits)."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.top_k
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.shift = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)  # the token before
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = nn.ModuleList([Expert(cfg) for _ in range(cfg.n_expert)])

    def forward(self, x):
        B, T, C = x.shape
        h = self.norm(x)
        h = h + self.shift(F.pad(h, (0, 0, 1, 0))[:, :T])  # causal: position t reads t-1
        tokens = h.reshape(B * T, C)
        router_logits = self.router(tokens)  # (B*T, n_expert)
        weights, chosen = torch.topk(router_logits.softmax(-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if len(rows):  # an expert no token chose is not called: no gradient reaches it
                out = out.index_add(0, rows, weights[rows, slot, None] * expert(tokens[rows]))
        return x + out.view(B, T, C), router_logits


def balance_loss(router_logits, top_k):
    """n_expert x sum over experts of (the share of routed slots it got) x (its mean router
    probability): 1 when the load is even, larger as it gathers on a few (Switch, eq. 4)."""
    probs = router_logits.softmax(-1)  # (tokens, n_expert)
    n_expert = probs.shape[-1]
    chosen = torch.topk(probs, top_k, dim=-1).indices
    share = F.one_hot(chosen, n_expert).sum(1).float().mean(0) / top_k  # not differentiable
    return n_expert * (share * probs.mean(0)).sum()


class TinyMoE(nn.Module):
    ARCH = "tinymoe"
    CONFIG = MoEConfig

    def __init__(self, cfg=None):
        super().__init__()
        self.config = cfg = cfg or MoEConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList([MoEBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def blocks(self):
        return list(self.layers)

    def forward(self, idx, targets=None, apart=False):
        """(logits, loss): loss = LM loss + balance x the balance loss; apart=True: (logits,
        (lm, balance loss)), for a loop that back-propagates them apart."""
        x = self.wte(idx)
        aux = []
        for block in self.layers:
            x, router_logits = block(x)
            aux.append(balance_loss(router_logits, self.config.top_k))
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        lm = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        aux = torch.stack(aux).mean()
        return logits, ((lm, aux) if apart else lm + self.config.balance * aux)


def moe_batch(step, rank=0, world_size=1, B=1, cfg=MoEConfig()):
    """This rank's slice of step's global batch of world_size * B sequences (x, y)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, cfg.vocab_size, (world_size * B, cfg.block_size + 1), generator=g)
    mine = data[rank * B:(rank + 1) * B]
    return mine[:, :-1], mine[:, 1:]
