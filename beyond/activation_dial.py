"""
Activation memory as a dial: which blocks are checkpointed, and which of their tensors are kept.

The plain idea is model.py's: with --grad-ckpt (full), every block keeps only its input
and recomputes the rest in backward. Two turns of the dial, when that costs too much time:

  every K-th block   --grad-ckpt-every K: blocks 0, K, 2K, ... only; the others keep all
  selective          keep the matmuls' outputs too; recompute only the cheap ops

A Policy is what train.py's build() puts in model.grad_ckpt; the block loop calls it.
Where the saved tensors live (--offload-activations) is beyond/offload.py.

References:
  - Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": keep a segment's input,
    drop the rest, recompute the segment in backward (here a segment is a block: `full`)
  - Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec. 5: recompute only the parts that are cheap to compute and heavy to keep (`selective`)
  - torchtitan: per-op selective checkpointing and checkpointing every k-th block

The three settings, per block, and what each keeps from forward to backward:

  none       every tensor autograd saves (machinery/activations.py prices them)
  full       the block's input only; backward re-runs the whole block's forward first
  selective  the block's input and the outputs of the ops in SAVE_OPS: the matmuls and fused
             attention. Backward re-runs only the cheap pointwise ops (LayerNorm, GELU,
             dropout, residual adds, the heads' reshapes) to rebuild the inputs of the saved
             matmuls' backward. A matmul costs 2*n*k*m FLOPs for n*m outputs; a pointwise op
             costs a few FLOPs per value: recomputing it is nearly free, keeping it is not.

Korthikanti et al. recompute the attention core (QK^T, softmax, dropout: their 5*a*s/h term).
SDPA's fused kernels keep no a*s*s matrix in the first place, so what is left that is cheap
and heavy is the pointwise work: GELU's input and output alone are 8h of a block's ~16h.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

POLICIES = ("none", "full", "selective")


def _ops(*names):
    """The aten ops of these names that this torch has (cudnn attention is newer than 2.4)."""
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


# Kept under `selective`: every Linear's matmul (mm, addmm; LoRA's A projection too) and the
# fused attention kernels (their output and per-row logsumexp; no a*s*s matrix). Not bmm: it
# is LoRA's r-wide einsum (cheap) and, in SDPA's math kernel (attention dropout), the a*s*s
# scores, which are what Korthikanti et al. recompute.
SAVE_OPS = _ops("mm", "addmm", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu")


@dataclass(frozen=True)
class Policy:
    """--grad-ckpt and --grad-ckpt-every: which blocks are checkpointed (every K-th, from block
    0) and what a checkpointed block keeps. False when nothing is checkpointed. Called by
    model.py's block loop as policy(block, x, i)."""
    kind: str = "none"
    every: int = 1
    # --compile: the blocks whose compiled forward checkpoints itself (compiled())
    inside: set = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in POLICIES or self.every < 1:
            raise ValueError(f"grad_ckpt {self.kind!r} every {self.every}: use one of "
                             f"{', '.join(POLICIES)}, every K >= 1")

    def __bool__(self):
        return self.kind != "none"

    def applies(self, i):
        """Is block i checkpointed?"""
        return self.kind != "none" and i % self.every == 0

    def flags(self):
        """The train.py flags that ask for this policy ("" for none)."""
        if not self:
            return ""
        kind = "" if self.kind == "full" else f" {self.kind}"
        return f"--grad-ckpt{kind}" + (f" --grad-ckpt-every {self.every}" if self.every > 1 else "")


    def __call__(self, block, x, i):
        """Block i of the model's loop on x, checkpointed as this policy says. Not the
        reentrant variant: it yields no gradients when no input requires grad (frozen
        embeddings under LoRA), and is deprecated as a default."""
        if not self.applies(i) or i in self.inside:
            return block(x)
        if self.kind == "full":  # keep x, drop everything else, recompute it all in backward
            return checkpoint(block, x, use_reentrant=False)
        return checkpoint(block, x, use_reentrant=False, context_fn=_selective_contexts)

    def compiled(self, forward, i):
        """--compile: the function to compile as block i's forward. Under `selective` the
        checkpoint goes inside it: dynamo captures it as a higher-order op and the policy sees
        the traced graph's aten.mm. Around a compiled block it would see the kernels' calls,
        aten.mm.out, and keep nothing (torchtitan compiles its checkpointed blocks alike).
        `full` names no ops: its checkpoint stays around the compiled block."""
        if self.kind != "selective" or not self.applies(i):
            return forward
        self.inside.add(i)

        def checkpointed(x):
            return checkpoint(forward, x, use_reentrant=False, context_fn=_compiled_contexts)
        return checkpointed

    @contextmanager
    def metering(self, count):
        """During the enclosed forward, count(t) each tensor a selective block keeps for
        backward beyond its input (machinery/meter.py counts the inputs)."""
        global _meter
        _meter = count if self.kind == "selective" else None
        try:
            yield
        finally:
            _meter = None


def policy(value, every=1):
    """A Policy from model.grad_ckpt's plain values (False; True, model.py's full
    checkpointing of every block), a name, or a Policy."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, bool) or value is None:
        value = "full" if value else "none"
    return Policy(value, every)


def setting(text):
    """"selective/2" -> Policy("selective", 2), as the benches list them; else a ValueError."""
    kind, _, every = text.partition("/")
    return Policy(kind, int(every or 1))


def _selective(ctx, func, *args, **kwargs):
    """The per-op policy: MUST_SAVE keeps the op's output in the checkpoint's cache, and the
    recompute returns it instead of running the op again."""
    return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _compiled_contexts():  # traced by dynamo: no measuring mode (the meter's pack counts)
    return create_selective_checkpoint_contexts(_selective)


def _selective_contexts():
    forward, recompute = create_selective_checkpoint_contexts(_selective)
    if _meter is None:
        return forward, recompute
    return _Both(forward, _CountSaved(_meter)), recompute


# -- measurement: what a selective checkpoint keeps (machinery/meter.py) ----------------------

_meter = None  # while metering: a function counting a tensor kept for backward


class _CountSaved(TorchDispatchMode):
    """Counts the outputs of the ops the selective policy keeps, as they are cached."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVE_OPS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.count(t)
        return out


class _Both:
    """Two context managers as one: the caching mode, then the counter on top of it."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        self.outer.__exit__(*exc)
