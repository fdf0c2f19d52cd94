"""
Muon under ZeRO: an optimizer that needs each weight matrix whole, and the layout that gives it.

  - Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks" (the
    update, Newton-Schulz quintic coefficients)
  - Liu et al. 2025, "Muon is Scalable for LLM Training" (Moonlight), Sec. 2: decoupled
    weight decay, and the update scaled by 0.2 * sqrt(max(rows, cols)) so that its RMS matches
    AdamW's: Muon then shares AdamW's learning rate and weight decay
  - nanochat's distributed Muon: ranks own whole matrices, reduce-scatter over stacks of
    same-shape matrices, orthogonalise the owned ones, all-gather

The idea for one matrix W (out, in) with gradient G:

    M = beta * M + (1 - beta) * G               momentum
    U = (1 - beta) * G + beta * M               Nesterov's look-ahead
    O = newton_schulz(U)                        ~ U's orthogonal factor: all singular values ~1
    W = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(out, in)) * O

Every direction of the update gets the same size, the rare ones as much as the common ones.
Embeddings, the head and 1-D parameters (gains, biases) are not such matrices: AdamW steps
them, in the same optimizer.

Why ZeRO's flat sharding breaks it: zero.py cuts every bucket into N equal element ranges,
so a rank owns a piece of a matrix, and the orthogonal factor of a piece is not a piece of
the orthogonal factor. The layout that fixes it, WholeZeRO below (zero.py's engine with one
layout of its own, as zero3.py extends it): the block matrices go into buckets of their own,
those of one shape together (plan_whole), and each matrix is dealt whole into one rank's
slice (deal, DealtBucket); every slice is padded to the longest. "Whole" means one thing
here: a tensor one rank owns all of.
The reduce-scatter then hands each rank its whole matrices, summed over ranks; the rank
orthogonalises and steps them; the all-gather publishes them. The traffic is ZeRO's 2Ψ plus
the padding (none when N divides a shape's number of matrices); the momentum is
sharded by whole matrices, as ZeRO-1/2 shard AdamW's moments by elements. Stage 0 owns every
matrix on every rank.

ZeRO-3 (WholeZeRO3, at the end of this file) deals each unit the same way: zero3.py's
all-gather and reduce-scatter need N equal slices, not which elements a slice holds. So
the lifecycle is unchanged, each rank steps whole matrices, and the optimizer sends nothing
of its own (DeepSpeed's stage 3 all-gathers Muon's momentum; Moonlight gathers the whole
matrix on every rank). It is the third of the designs Megatron-LM#5533 lists: tensors kept
whole in storage, as torchtitan's Owned layout and veScale's RaggedShard. Muon's root (the
embeddings and tied head, AdamW's) stays cut flat, with no padding. The cost is the
padding to each unit's longest slice, measured on GPT-2 124M's shapes (python -m
beyond.muon; tests/test_muon3.py holds the numbers):

  N  optimizer  block padding  root padding  moved / 3Psi  / plain ZeRO-3  NS max/mean
  2  Muon               16.5%            0%         1.007          1.126         1.00
  4  Muon               33.1%            0%         1.121          1.253         1.00
  8  Muon              166.3%            0%         2.031          2.270         1.33
  2  Adafactor          16.5%           96%         1.210          1.353
  4  Adafactor          33.1%          292%         1.737          1.942
  8  Adafactor         166.3%          684%         3.475          3.885

(plain ZeRO-3 moves 0.894 x 3Psi here: the root, a third of GPT-2 124M, skips its re-gather.)

A block's four matrices (4h^2, 4h^2, 3h^2, h^2) split 7h^2 | 5h^2 on two ranks, one a rank
on four; on eight, four ranks hold only gains and biases: a one-block unit is too small to
deal there (a unit of several blocks, or an owner-based step, would fix it). Each unit
starts its deal one rank later, so the Newton-Schulz work spreads over the blocks (Graham's
bound holds within a unit; across units the rotation evens it). Adafactor's lone embedding
makes every slice of the root as long as itself: that padding is the price stated here.

The same layout serves any optimizer whose step reads a tensor whole (not elementwise, as
machinery.guard.elementwise tells):
torch's Adafactor keeps a matrix's row and column statistics, not one per element, and scales
each update by norms over the whole tensor, 1-D ones included. There every trainable tensor
is dealt whole (zero.ZeRO and zero3.ZeRO3 refuse such an optimizer in one line that names
WholeZeRO or WholeZeRO3). Its cost: a tensor larger than the others of its bucket (an
embedding) makes a slice that long on every rank, padding that the reduce-scatter and
all-gather carry too.
"""
import functools
import math
from itertools import accumulate

import torch

import optim
from beyond.zeropp import ZeROpp
from zero import Bucket, ZeRO, declared_blocks, plan_buckets
from zero3 import ShardedBucket, ZeRO3

# Newton-Schulz quintic iteration (Jordan et al. 2024): five steps map singular values from
# (0, 1] to about [0.7, 1.2], cheaper and more robust than the exact polar factor (an SVD)
NS_COEFFICIENTS, NS_STEPS = (3.4445, -4.7750, 2.0315), 5


def newton_schulz(G, steps=NS_STEPS):
    """The orthogonal factor of G (out, in), approximately: U V^T of its SVD U S V^T; of
    each matrix of a stack G (k, out, in) alike, in batched matmuls (k matrices, one kernel).
    In fp32 here (the master's dtype); Jordan et al. run it in bf16 on GPUs."""
    a, b, c = NS_COEFFICIENTS
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values into (0, 1]
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X  # X X^T: the smaller of the two Gram matrices
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def block_matrices(model):
    """ids of the 2-D weights inside the model's blocks() (a matrix optimizer's: not the
    embeddings or the head, which Jordan et al. and Moonlight leave to AdamW). A model without
    blocks() is one line: its nn.Linear weights would take an untied LM head in silence."""
    blocks = declared_blocks(model)
    if blocks is None:
        raise ValueError(f"Muon orthogonalises the matrices inside blocks(): declare "
                         f"{type(model).__name__}.blocks(), its repeated layers in forward order "
                         "(the embeddings, the LM head and 1-D parameters stay AdamW's)")
    modules = [m for blk in blocks for m in blk.modules()]
    return {id(p) for m in modules for p in m.parameters(recurse=False) if p.dim() == 2}


def plan_whole(shapes, cap, world_size):
    """Buckets of tensors kept whole, as lists of indices into shapes: those of one shape
    together (nanochat's stacks), last layer first, N or a multiple of N of them a bucket
    (up to cap elements): a shape's L matrices then need padding only when N does not
    divide L. Each bucket is dealt() whole to the ranks."""
    groups = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(tuple(shape), []).append(i)
    buckets = []
    for indices in groups.values():
        numel = math.prod(shapes[indices[0]])
        per = max(1, cap // (world_size * max(1, numel))) * world_size  # tensors a bucket
        last_first = indices[::-1]
        buckets += [last_first[j:j + per] for j in range(0, len(last_first), per)]
    return buckets


def deal(numels, world_size, first=0):
    """Whole tensors dealt to N ranks in one bucket: the largest first, each to the least
    loaded rank (Graham 1969's LPT: its longest slice within 4/3 of the shortest possible),
    every slice as long as the longest, the rest zero padding. Returns (each tensor's offset
    in the bucket, the bucket's numel). L equal matrices go round robin: L/N each, padded to
    a multiple of N as nanochat pads its stacks. Ties between ranks go to the first from
    `first` on: WholeZeRO3 starts each unit one rank later, so that the largest matrix of
    every block does not land on rank 0 (the Newton-Schulz work spreads over the units)."""
    loads, where = [0] * world_size, [None] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):  # stable: ties in order
        r = min(range(world_size), key=lambda r: (loads[r], (r - first) % world_size))
        where[i], loads[r] = (r, loads[r]), loads[r] + numels[i]
    S = max(loads)
    return [r * S + at for r, at in where], S * world_size


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the param groups marked "matrices" (WholeZeRO's whole block matrices), AdamW
    (torch's fused kernel) for the others. Skips a step on the device where found_inf is 1,
    as AdamW's fused kernel does: nothing waits for the flag."""
    _step_supports_amp_scaling = True
    needs_whole_matrices = True  # WholeZeRO gives each rank whole block matrices

    def __init__(self, groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, momentum=0.95):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, momentum=momentum,
                                      weight_decay=0.0, matrices=False))
        adam = [g for g in self.param_groups if not g["matrices"]]
        self.adam = torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps, fused=True)
        self.adam.param_groups = adam  # the same group dicts: a new lr reaches both
        self.adam.state = self.state  # one state: checkpoints read it by parameter
        self.found_inf = None

    @torch.no_grad()
    def step(self):
        self.adam.found_inf = self.found_inf
        if any(p.grad is not None for g in self.adam.param_groups for p in g["params"]):
            self.adam.step()
        skip = self.found_inf  # a device tensor, 1.0 on a skipped step: read by no one here
        keep = None if skip is None else 1.0 - skip
        for group in (g for g in self.param_groups if g["matrices"]):
            beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            ps = [p for p in group["params"] if p.grad is not None]
            nesterov = []
            for p in ps:
                g = p.grad if skip is None else torch.where(skip > 0, 0.0, p.grad)  # inf * 0
                m = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                m.lerp_(g, (1 - beta) if keep is None else (1 - beta) * keep)
                nesterov.append(g.lerp(m, beta))
            shapes = {}  # the matrices of one shape orthogonalised as one stack
            for i, p in enumerate(ps):
                shapes.setdefault(p.shape, []).append(i)
            for shape, same in shapes.items():
                updates = newton_schulz(torch.stack([nesterov[i] for i in same]))
                updates *= 0.2 * math.sqrt(max(shape))
                for i, update in zip(same, updates):
                    step = lr if keep is None else lr * keep  # 0 on a skipped step
                    if wd:
                        ps[i].mul_(1 - step * wd)
                    ps[i].add_(update * -step)


# ----------------------------------------------------------------------------------------------
# the engine that deals whole tensors

class DealtBucket(Bucket):
    """zero.py's Bucket with its tensors dealt whole into the ranks' slices (deal), not packed
    and cut into N equal pieces: every tensor inside one rank's slice."""

    def layout(self, numels, world_size, pad):
        return deal(numels, world_size)


class WholeZeRO(ZeRO):
    """ZeRO stages 0-2 (zero.py) for an optimizer whose step reads tensors whole. Dealt whole:
    Muon's block matrices (an optimizer that says needs_whole_matrices; the rest stays in flat
    buckets, stepped by its AdamW), or for any other optimizer (Adafactor) every trainable
    tensor. At stage 0 every rank owns every tensor whole already: zero.py's buckets."""
    WHOLE = True  # any optimizer: each gets whole tensors (an elementwise one pays the padding)

    def __init__(self, model, stage, optimizer="adamw", **kwargs):
        cls = getattr(optimizer, "func", optimizer)  # functools.partial(torch.optim.Adafactor, ...)
        muon = optimizer == "muon" or getattr(cls, "needs_whole_matrices", False)
        # Muon's block matrices, stepped in groups of their own; the tensors dealt whole
        self.matrices = block_matrices(model) if muon else set()
        self.dealt = self.matrices if muon else {id(p) for p in model.parameters()}
        super().__init__(model, stage, optimizer=optimizer, **kwargs)

    def make_optimizer(self, optimizer, groups, lr=None, **hyper):
        if optimizer == "muon":
            return MuonAdamW(groups, lr=optim.LR if lr is None else lr, **hyper)
        return super().make_optimizer(optimizer, groups, lr=lr, **hyper)

    def _make_buckets(self, model, params):
        """Stages 1-2: the dealt tensors as plan_whole puts them, in DealtBuckets; the rest in
        zero.py's flat buckets; all in the order they complete (a bucket's first parameter's
        gradient comes last), so Muon's matrix buckets launch while backward goes on."""
        if self.stage == 0:
            return super()._make_buckets(model, params)
        cap = self.bucket_cap(params)
        dealt = [i for i, p in enumerate(params) if id(p) in self.dealt]
        rest = [i for i, p in enumerate(params) if id(p) not in self.dealt]
        plans = [([rest[j] for j in b], Bucket)
                 for b in plan_buckets([params[i].numel() for i in rest], cap) if b]
        plans += [([dealt[j] for j in b], DealtBucket)
                  for b in plan_whole([params[i].shape for i in dealt], cap, self.world_size)]
        plans.sort(key=lambda plan: -min(plan[0]))
        return [self._new_bucket([params[i] for i in indices], kind) for indices, kind in plans]

    def _param_groups(self, optimizer, weight_decay, decay):
        """zero.py's groups, and for Muon the same again with its whole block matrices, marked
        "matrices" (MuonAdamW orthogonalises those, AdamW steps the rest)."""
        groups = super()._param_groups(optimizer, weight_decay, decay)
        if not self.matrices:
            return groups
        seg = {id(s.master): s for s in self.segments}
        matrix = lambda m: seg[id(m)].whole and id(seg[id(m)].param) in self.matrices
        return ([dict(g, params=[m for m in g["params"] if not matrix(m)]) for g in groups]
                + [dict(g, params=[m for m in g["params"] if matrix(m)], matrices=True)
                   for g in groups])


# ----------------------------------------------------------------------------------------------
# ZeRO-3: the same layout inside each unit

class DealtShardedBucket(ShardedBucket):
    """zero3.py's ShardedBucket (the full buffer exists only while gathered) with DealtBucket's
    layout: every tensor whole inside one rank's slice, so that rank's `shard` holds it whole;
    ties dealt from rank `first` on (deal)."""

    def __init__(self, *args, first=0, **kwargs):
        self.first = first
        super().__init__(*args, **kwargs)

    def layout(self, numels, world_size, pad):
        return deal(numels, world_size, self.first)


class WholeZeRO3(WholeZeRO, ZeRO3):
    """ZeRO-3 (zero3.py) for an optimizer whose step reads tensors whole. A unit whose trainable
    tensors include a dealt one (Muon: a block's matrices; Adafactor: every tensor) deals all
    of them whole into the ranks' equal slices of its bucket; the others (Muon's root: the
    embeddings, AdamW's, elementwise) stay cut flat, with no padding. zero3.py's lifecycle is
    unchanged: its all-gather and reduce-scatter need equal slices, not which elements they
    hold. So (6) hands each rank whole gradients, (7) steps whole matrices, and the optimizer
    communicates nothing of its own (no extra gather of momentum, unlike DeepSpeed's stage 3).
    Its cost is the padding to the longest slice in each dealt unit, moved 3x a micro-step."""
    STAGES = (3,)

    def __init__(self, model, stage=3, **kwargs):
        self.made = -1  # units made so far (unit_bucket_kind): the blocks, then the root
        super().__init__(model, stage, **kwargs)

    def _make_buckets(self, model, params):
        return ZeRO3._make_buckets(self, model, params)  # units, not WholeZeRO's buckets

    def unit_bucket_kind(self, trainable):
        self.made += 1
        if any(id(t) in self.dealt for t in trainable):
            return functools.partial(DealtShardedBucket, first=self.made % self.world_size)
        return ShardedBucket


class WholeZeROpp(WholeZeRO3, ZeROpp):
    """ZeRO++ (beyond/zeropp.py) on WholeZeRO3's layout. qwZ quantizes a shard in blocks, hpZ
    keeps 1/k of the full buffer, qgZ sends every rank its slice: each works on equal slices
    of a flat buffer and never asks what they hold, so whole tensors stay whole."""


# ----------------------------------------------------------------------------------------------
# what WholeZeRO3 costs, on a model's own shapes (python -m beyond.muon prints GPT-2 124M's)

def ns_flops(shape):
    """Multiply-adds of newton_schulz on one (out, in) matrix, m <= n its sides: per step
    A = X X^T (m^2 n), A @ A (m^3), (bA + cA^2) X (m^2 n)."""
    m, n = sorted(shape)
    return NS_STEPS * (2 * m * m * n + m ** 3)


def state_of(model, muon=True):
    """The fp32 optimizer state of a tensor stepped whole, in bytes, as a function of the
    tensor. Muon: its momentum, 4 bytes an element of the block matrices; AdamW's two moments,
    8, for the rest. torch's Adafactor: the factored second moment (Shazeer & Stern 2018,
    Sec. 3), a row mean (..., r, 1) and a column mean (..., 1, c) of a matrix (..., r, c),
    one value an element of a 1-D tensor, and no first moment (its beta1 is None)."""
    if muon:
        mats = block_matrices(model)
        return lambda p: (4 if id(p) in mats else 8) * p.numel()
    return lambda p: 4 * (p.numel() // p.shape[-1] + p.numel() // p.shape[-2] if p.dim() > 1
                          else p.numel())


def zero3_cost(model, world_size, muon=True):
    """WholeZeRO3's layout of a model (a meta-device one will do), unit by unit as zero3.py
    cuts it, root first: each as (real numel, padded numel); per rank the Newton-Schulz work
    (Muon's matrices: ns_flops) and the optimizer state bytes (state_of: Muon's, or
    Adafactor's; machinery/footprint.py's estimate). With muon the root (embeddings: AdamW's,
    8 bytes an element) is cut flat, padded to a multiple of N only; else (Adafactor) it is
    dealt too."""
    blocks = [list(blk.parameters()) for blk in declared_blocks(model)]
    in_blocks = {id(p) for params in blocks for p in params}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    mats, N = block_matrices(model) if muon else set(), world_size
    whole = state_of(model, muon)
    units, work, state = [], [0] * N, [0] * N
    for i, params in enumerate([root] + blocks):
        numels = [p.numel() for p in params]
        if params is root and muon:  # zero3.py's flat cut: packed in order
            offsets, numel = [0, *accumulate(numels)][:-1], math.ceil(sum(numels) / N) * N
        else:
            first = (i - 1 if i else len(blocks)) % N  # as WholeZeRO3 makes them
            offsets, numel = deal(numels, N, first)
        units.append((sum(numels), numel))
        S = numel // N
        for p, o, n in zip(params, offsets, numels):
            if params is root and muon:  # AdamW's moments on the pieces each rank holds
                for r in range(o // S, (o + n - 1) // S + 1):
                    state[r] += 8 * (min(o + n, (r + 1) * S) - max(o, r * S))
                continue
            state[o // S] += whole(p)  # dealt: whole on one rank
            if id(p) in mats:
                work[o // S] += ns_flops(p.shape)
    return units, work, state


def cost_table(model, sizes=(2, 4, 8)):
    """Lines of zero3_cost: padding of a block and of the root; the elements moved a
    micro-step (3x the padded units, but the root's skipped re-gather) against 3Psi and
    against plain ZeRO-3 (which skips that re-gather too); the slowest rank's Newton-Schulz
    work against the mean (load balance)."""
    lines = ["N  optimizer  block padding  root padding  moved / 3Psi  / plain ZeRO-3  "
             "NS max/mean"]
    for muon in (True, False):
        for N in sizes:
            units, work, _ = zero3_cost(model, N, muon)
            moved = lambda us: 3 * sum(p for _, p in us) - us[0][1]
            plain = [(n, math.ceil(n / N) * N) for n, _ in units]
            psi = sum(n for n, _ in units)
            (root, root_p), (block, block_p) = units[0], units[1]
            balance = max(work) / (sum(work) / N) if muon else float("nan")
            lines.append(f"{N}  {'muon' if muon else 'adafactor':9}  "
                         f"{block_p / block - 1:12.1%}  {root_p / root - 1:12.1%}  "
                         f"{moved(units) / (3 * psi):12.3f}  {moved(units) / moved(plain):14.3f}"
                         f"  {balance:11.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    from model import GPT, GPTConfig
    with torch.device("meta"):  # shapes only: nothing allocated
        gpt2 = GPT(GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12,
                             n_embd=768))
    print("WholeZeRO3 on GPT-2 124M's shapes")
    print(cost_table(gpt2))
