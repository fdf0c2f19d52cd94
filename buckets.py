"""
The layout ZeRO works on: parameters packed into flat buckets, and the pieces of them a rank owns.

The trainable parameters (the tied embedding / LM head once) are packed, last layer first, into
buckets of about --bucket-mb: one flat tensor each, padded to a multiple of N ranks, the
parameters views into it, so that collectives run on contiguous memory. Rank r owns the r-th 1/N
of every bucket. Padding makes every world size legal and stays zero, outside norms, inf checks
and checkpoints. The optimizer steps one 1-D view per (parameter, rank) piece, a `Segment`, and a
checkpoint saves each by (parameter name, element range): a layout no world size is built into.
"""
import math
from dataclasses import dataclass

import torch

def plan_buckets(numels, cap):
    """Indices of tensors of sizes `numels` grouped into buckets of at most `cap` elements, last
    tensor first (gradients arrive last layer first); a larger tensor gets a bucket of its own.
    memory.py plans with this very function: its estimate packs what the trainer packs."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        if current and size + numels[i] > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += numels[i]
    return buckets + [current]


def frozen_tensors(module, keep=lambda t: True):
    """What a module holds but never trains: frozen parameters (LoRA's base) and the persistent
    buffers of modules whose buffers are a weight (quant.py's codes and scales, not nf4's shared
    16-value code table). Any other persistent buffer would silently become sharded, cast and
    checkpointed model state: one line says what to do instead."""
    frozen = [p for p in module.parameters() if not p.requires_grad and keep(p)]
    for name, m in module.named_modules():
        for key, b in m._buffers.items():
            if b is None or key in m._non_persistent_buffers_set or not keep(b):
                continue
            if not getattr(m, "BUFFERS_ARE_STATE", False):
                raise ValueError(f"{name}.{key} is a persistent buffer: ZeRO would shard, cast and "
                                 "checkpoint it as model state. Register it with "
                                 "persistent=False if it is recomputed, or make it a frozen "
                                 "nn.Parameter")
            frozen.append(b)
    return frozen


@dataclass
class Segment:
    """The piece [lo, hi) of one flattened parameter that this rank owns: what AdamW steps
    (as `master`, an fp32 view into the master slice) and what a checkpoint saves by name."""
    name: str  # the parameter's name in model.state_dict()
    param: torch.Tensor  # the working parameter
    lo: int
    hi: int
    start: int  # where the piece begins inside its bucket's owned slice
    master: torch.Tensor = None


class Bucket:
    """Tensors packed into one flat buffer (padded to a multiple of N) that they become views
    of. This rank owns [lo, hi): that range's optimizer state (stage 2+: gradient) lives here."""

    def __init__(self, tensors, rank, world_size, dtype, device, pad=True):
        self.params = tensors
        numel = sum(t.numel() for t in tensors)
        self.numel = math.ceil(numel / world_size) * world_size if pad else numel
        shard = self.numel // world_size if pad else self.numel
        self.lo, self.hi = (rank * shard, (rank + 1) * shard) if pad else (0, self.numel)
        self.flat = torch.zeros(self.numel, dtype=dtype, device=device)
        self.offsets, offset = [], 0
        for t in tensors:
            self.flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            t.data = self.flat[offset:offset + t.numel()].view_as(t)  # the tensor is now a view
            self.offsets.append(offset)
            offset += t.numel()
        self.flat_grad = None  # stages 0-1: the full gradient of the bucket
        self.grad_shard = None  # stages 2-3: only this rank's reduced slice of it
        self.segments = []  # the pieces of its parameters this rank owns, in order
        self.ready = 0  # parameters whose gradient has landed in this backward

    def owned_grad(self):  # this rank's reduced gradient slice
        return self.grad_shard if self.grad_shard is not None else self.flat_grad[self.lo:self.hi]

    def make_segments(self, names, master):
        """Cut the owned range into one Segment per tensor that overlaps it; `master` is the
        fp32 copy (or, in fp32, the view) of the owned range, None for frozen tensors."""
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(offset, self.lo), min(offset + p.numel(), self.hi)
            if lo < hi:  # else another rank owns all of this tensor
                start = lo - self.lo
                view = None if master is None else master[start:start + hi - lo]
                self.segments.append(Segment(names[id(p)], p, lo - offset, hi - offset, start,
                                             view))


