"""
Activation memory as a dial: which blocks are checkpointed, which of their tensors are kept,
and where the saved tensors live. model.py's block loop calls run_block(); engine.build sets
the policy and, with --offload-activations, install_offload().

References:
  - Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": keep a segment's input,
    drop the rest, recompute the segment in backward (here a segment is a block: `full`)
  - Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec. 5: recompute only the parts that are cheap to compute and heavy to keep (`selective`)
  - torchtitan: per-op selective checkpointing and checkpointing every k-th block
  - Ren et al. 2021, "ZeRO-Offload"; torchtune's OffloadActivations: saved tensors on the host

The three settings, per block, and what each keeps from forward to backward:

  none       every tensor autograd saves (activations.py prices them term by term)
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
from dataclasses import dataclass

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
    0) and what a checkpointed block keeps. False when nothing is checkpointed."""
    kind: str = "none"
    every: int = 1

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


def policy(value, every=1):
    """A Policy from what older code and files hold: a bool (True = full), a name, a Policy."""
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


def _selective_contexts():
    forward, recompute = create_selective_checkpoint_contexts(_selective)
    if _meter is None:
        return forward, recompute
    return _Both(forward, _CountSaved(_meter)), recompute


def run_block(block, x, i, ckpt):
    """Block i of the model's loop on x, checkpointed as ckpt (a Policy, or a bool) says. Not
    the reentrant variant: it yields no gradients when no input requires grad (frozen
    embeddings under LoRA), and is deprecated as a default."""
    ckpt = policy(ckpt)
    if not ckpt.applies(i):
        return block(x)
    if ckpt.kind == "full":  # keep x, drop everything else, recompute it all in backward
        return checkpoint(block, x, use_reentrant=False)
    return checkpoint(block, x, use_reentrant=False, context_fn=_selective_contexts)


# -- measurement: what a checkpoint keeps (model.saved_activation_bytes) -----------------------

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


@contextmanager
def metering(model, count):
    """During the enclosed forward, count(t) each tensor a checkpoint keeps: the input of every
    checkpointed block (held by the checkpoint itself, not by autograd's saved tensors), and
    under `selective` the outputs of SAVE_OPS."""
    global _meter
    ckpt = policy(model.grad_ckpt)
    blocks = [b for i, b in enumerate(model.blocks()) if ckpt.applies(i)]
    hooks = [b.register_forward_pre_hook(lambda m, args: count(args[0])) for b in blocks]
    _meter = count
    try:
        yield
    finally:
        _meter = None
        for h in hooks:
            h.remove()


# -- --offload-activations: saved tensors in pinned host memory ------------------------------

MIN_OFFLOAD_BYTES = 2**20  # smaller saved tensors stay on the device: a copy costs more


class CudaMover:
    """Device -> pinned host on a side stream, and back, fenced by events. The forward does not
    wait for a copy out: the side stream waits for the compute stream to have written t, and
    record_stream keeps t's memory from being reused until the copy has read it."""

    def __init__(self):
        self.stream = torch.cuda.Stream()

    def on_device(self, t):
        return t.device.type == "cuda"

    def to_host(self, t):
        self.stream.wait_stream(torch.cuda.current_stream())  # t is written
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # contiguous, pinned
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # t's memory is not reused before the copy has read it
            done = torch.cuda.Event()
            done.record(self.stream)
        return host, done

    def to_device(self, host, done, device):
        """Brought back when backward asks for it (no prefetch): the side stream copies, the
        compute stream waits for that copy only."""
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(done)  # the copy out has landed in host memory
            t = host.to(device, non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.stream)
        t.record_stream(torch.cuda.current_stream())
        return t


class Offload:
    """The pack / unpack pair of torch.autograd.graph.saved_tensors_hooks: each tensor autograd
    saves for backward, unless it is small or a weight (ZeRO-3 gathers weights, they are not
    activations), goes to the host at pack and comes back at unpack. mover: CudaMover, or a
    stand-in for tests. Counts what it moved (host_bytes) and kept (kept_bytes)."""

    def __init__(self, model, mover, min_bytes=MIN_OFFLOAD_BYTES):
        self.model, self.mover, self.min_bytes = model, mover, min_bytes
        self.host_bytes = self.kept_bytes = 0

    def pack(self, t):
        nbytes = t.numel() * t.element_size()
        weights = {w.untyped_storage().data_ptr()
                   for w in list(self.model.parameters()) + list(self.model.buffers())}
        if (not self.mover.on_device(t) or nbytes < self.min_bytes
                or t.untyped_storage().data_ptr() in weights):
            self.kept_bytes += nbytes
            return t
        self.host_bytes += nbytes
        return (t.device,) + tuple(self.mover.to_host(t))

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        return self.mover.to_device(host, done, device)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def install_offload(model, device, mover=None, min_bytes=MIN_OFFLOAD_BYTES):
    """--offload-activations: the pack/unpack hooks around every training forward of model,
    installed as forward hooks (model.py stays as it is). On a CPU the activations already live
    in host memory: nothing to do, and the returned line says so. Returns (Offload or None,
    the line to print)."""
    if mover is None and device.type != "cuda":
        return None, ("--offload-activations: a no-op on a CPU (activations already live in "
                      "host memory)")
    off = Offload(model, mover or CudaMover(), min_bytes)
    active = []

    def enter(module, args):
        if module.training and torch.is_grad_enabled():
            active.append(off.hooks())
            active[-1].__enter__()

    def leave(module, args, out):
        if active:
            active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    return off, (f"--offload-activations: saved tensors of {min_bytes // 2**10} KiB or more "
                 "go to pinned host memory")
