"""
Guards the activation numbers: what a forward saves for backward, measured, not estimated.

machinery/activations.py predicts these bytes term by term; tests/test_memory.py holds
the two equal to the byte. Exact on any device: it counts tensors, not allocator pages.
"""
from contextlib import contextmanager, nullcontext

import torch


@contextmanager
def saved_activation_bytes(model, out):
    """Add to out[0] the bytes autograd keeps for backward during the enclosed forward.

    Every saved tensor's storage is counted once; the weights are left out.
    Under activation checkpointing autograd saves almost nothing inside a block:
    what the checkpoint itself keeps is counted by kept_by_checkpoints."""
    seen = set()

    def count(t):
        # the weights' addresses now: ZeRO-3 gathers them into fresh memory in each forward
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in weights:
            seen.add(ptr)
            out[0] += t.untyped_storage().nbytes()

    def pack(t):
        count(t)
        return t

    # --offload-activations: its hooks, entered inside these, are the ones autograd calls
    offload = getattr(model, "offload", None)
    if offload is not None:
        offload.observe = count
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                kept_by_checkpoints(model, count):
            yield
    finally:
        if offload is not None:
            offload.observe = None


@contextmanager
def kept_by_checkpoints(model, count):
    """count(t) each tensor a checkpointed block keeps: its input (held by the checkpoint,
    not by autograd's saved tensors) and, under a selective policy, what the policy keeps
    (the policy's own metering(count): beyond/activation_dial.py)."""
    ckpt = getattr(model, "grad_ckpt", False)
    applies = getattr(ckpt, "applies", lambda i: bool(ckpt))
    blocks = [b for i, b in enumerate(model.blocks()) if applies(i)] if ckpt else []
    hooks = [b.register_forward_pre_hook(lambda m, args: count(args[0])) for b in blocks]
    try:
        with ckpt.metering(count) if hasattr(ckpt, "metering") else nullcontext():
            yield
    finally:
        for h in hooks:
            h.remove()


def measure_next_forward(model, done):
    """Meter the next training forward of model, then call done(bytes, moved) once: moved,
    the bytes of them --offload-activations sent to host memory (0 without it).

    Hooks, not a `with` in the loop: the first hook runs before any other forward
    pre-hook (offload's saved-tensor hooks then sit inside the meter's), the last after
    every forward hook, and both remove themselves."""
    state = {"out": [0], "ctx": None}
    offload = getattr(model, "offload", None)
    moved = lambda: offload.host_bytes if offload is not None else 0

    def enter(module, args):
        if module.training and torch.is_grad_enabled():
            state["moved"] = moved()
            state["ctx"] = saved_activation_bytes(model, state["out"])
            state["ctx"].__enter__()

    def leave(module, args, output):
        if state["ctx"] is None:
            return
        state["ctx"].__exit__(None, None, None)
        for h in handles:
            h.remove()
        done(state["out"][0], moved() - state["moved"])

    handles = [model.register_forward_pre_hook(enter, prepend=True),
               model.register_forward_hook(leave)]
