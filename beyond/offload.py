"""
Activations in host memory: the tensors saved for backward go to pinned CPU memory in
forward and come back in backward (--offload-activations, CUDA only).

  - Ren et al. 2021, "ZeRO-Offload"; torchtune's OffloadActivations: saved tensors on the host

The plain idea in one hook pair: torch.autograd.graph.saved_tensors_hooks(pack, unpack),
where pack(t) returns t.to("cpu") and unpack(h) returns h.to(device). It is correct in eager
mode, and it holds everything up: each copy waits for the GPU, then the GPU waits for it.

What the version below adds, each for a reason a GPU shows:
  - the copies run on side streams (out and back), fenced by events: they overlap compute
  - strides are kept: a compiled backward asserts the size and stride of what it saved, and
    q, k, v are strided views of one q|k|v buffer. So a storage moves once, whole, and each
    saved view is rebuilt on it with as_strided (q, k and v share one copy)
  - the bytes in flight are bounded: a forward makes activations ~10x faster than PCIe drains
    them. Past `budget` bytes the compute stream waits for the oldest copy out; only then is
    its device memory let go (torchtune's stash): it is reused by work ordered after the
    copy, so the memory the process reserves falls as well as what it allocates
  - backward prefetches: unpacking block i's tensors starts the copy back of block i-1's
  - the weights (never activations: ZeRO-3 gathers them) are known once per forward
"""
import weakref
from collections import deque

import torch

MIN_OFFLOAD_BYTES = 2**20  # smaller saved tensors stay on the device: a copy costs more
BUDGET_BYTES = 2**28  # bytes of copies out in flight before the forward waits for the oldest


class CudaMover:
    """Device -> pinned host on one side stream, host -> device on another (PCIe moves both
    ways at once), each copy fenced by an event. No record_stream: a tensor that record_stream
    marks stays reserved until its copy lands, however much the allocator needs it."""

    def __init__(self):
        self.out, self.back = torch.cuda.Stream(), torch.cuda.Stream()
        self.ready = {}  # id of a tensor on its way back -> the event of its copy

    def on_device(self, t):
        return t.device.type == "cuda"

    def to_host(self, flat):
        """Start the copy of flat out; the caller keeps flat alive until settle(done)."""
        self.out.wait_stream(torch.cuda.current_stream())  # flat is written
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        with torch.cuda.stream(self.out):
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return host, done

    def settle(self, done):
        """The compute stream waits for this copy out: flat's memory, freed after this call,
        is reused only by work ordered after the copy."""
        torch.cuda.current_stream().wait_event(done)

    def to_device(self, host, done, device):
        """Start the copy back (a prefetch need not be waited for yet). Allocated on the
        compute stream, written on the side stream once the copy out has landed."""
        t = torch.empty(host.shape, dtype=host.dtype, device=device)
        self.back.wait_stream(torch.cuda.current_stream())  # t's block is free of old work
        self.back.wait_event(done)  # this copy out only, not every copy out before it
        with torch.cuda.stream(self.back):
            t.copy_(host, non_blocking=True)
            self.ready[id(t)] = torch.cuda.Event()
            self.ready[id(t)].record()
        t.record_stream(self.back)  # a prefetch never used is not freed under its copy
        return t

    def wait(self, t):
        """The compute stream waits for t's copy back (once; later views need no wait)."""
        ready = self.ready.pop(id(t), None)
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)


class _Stored:
    """One storage in host memory, and the saved views of it still to come back."""

    def __init__(self, host, done, device, block, first):
        self.host, self.done, self.device, self.block = host, done, device, block
        self.first = first  # a weakref to the first view packed: while it lives, so does
        self.users = 1  # the storage, and its address names no other one
        self.back = None  # on the device again (or on its way)


class Offload:
    """The pack / unpack pair of torch.autograd.graph.saved_tensors_hooks: each tensor autograd
    saves for backward, unless its storage is small or a weight, goes to the host at pack and
    comes back at unpack. mover: CudaMover, or a stand-in for tests. Counts what it moved
    (host_bytes) and kept (kept_bytes); observe(t), when set, sees every saved tensor (the
    activation meter: machinery/meter.py)."""

    def __init__(self, model, mover, min_bytes=MIN_OFFLOAD_BYTES, budget=BUDGET_BYTES):
        self.model, self.mover, self.min_bytes, self.budget = model, mover, min_bytes, budget
        self.host_bytes = self.kept_bytes = 0
        self.in_flight, self.in_flight_bytes, self.peak_in_flight = deque(), 0, 0
        self.observe, self.block = None, -1
        self.start_forward()

    def start_forward(self):
        """Once per training forward: the weights' storages (stable under ZeRO-3's gathers,
        which resize a storage in place) and a fresh table of storages moved."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        self.weights = {t.untyped_storage()._cdata for t in tensors}
        self.stored, self.by_block, self.block = {}, {}, -1

    def pack(self, t):
        if self.observe is not None:
            self.observe(t)
        storage = t.untyped_storage()
        key = (storage._cdata, t.dtype)
        entry = self.stored.get(key)
        if entry is not None and entry.first() is not None:  # q after k: moved already
            entry.users += 1
            return entry, t.storage_offset(), t.shape, t.stride()
        nbytes = storage.nbytes()
        if (not self.mover.on_device(t) or nbytes < self.min_bytes
                or storage._cdata in self.weights):
            self.kept_bytes += t.numel() * t.element_size()
            return t
        flat = torch.empty(0, dtype=t.dtype, device=t.device)
        flat.set_(storage, 0, (nbytes // t.element_size(),), (1,))  # the whole storage, 1-D
        host, done = self.mover.to_host(flat)
        entry = _Stored(host, done, t.device, self.block, weakref.ref(t))
        self.stored[key] = entry
        self.by_block.setdefault(self.block, []).append(entry)
        self.host_bytes += nbytes
        self._bound(flat, done, nbytes)
        return entry, t.storage_offset(), t.shape, t.stride()

    def _bound(self, flat, done, nbytes):
        """Keep flat (its device memory) until its copy is settled; past the budget, settle
        the oldest copies now: the forward cannot run ahead of PCIe by more than that."""
        self.in_flight.append((flat, done, nbytes))
        self.in_flight_bytes += nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight_bytes)
        while self.in_flight and self.in_flight_bytes > self.budget:
            self._settle_oldest()

    def _settle_oldest(self):
        _, done, nbytes = self.in_flight.popleft()
        self.mover.settle(done)
        self.in_flight_bytes -= nbytes

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        while self.in_flight:  # backward has begun: what is still on its way out, settled
            self._settle_oldest()
        entry, offset, size, stride = packed
        if entry.back is None:
            self._fetch(entry)
        for e in self.by_block.get(entry.block - 1, ()):  # the block whose backward is next
            if e.back is None and e.users > 0:
                self._fetch(e)
        self.mover.wait(entry.back)
        t = entry.back.as_strided(size, stride, offset)  # the saved view, strides and all
        entry.users -= 1
        if entry.users <= 0:  # the last view of it: the views keep the memory alive
            entry.back = None
        return t

    def _fetch(self, entry):
        entry.back = self.mover.to_device(entry.host, entry.done, entry.device)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def install_offload(model, device, mover=None, min_bytes=MIN_OFFLOAD_BYTES, budget=BUDGET_BYTES):
    """--offload-activations: the pack/unpack hooks around every training forward of model,
    installed as forward hooks (model.py stays as it is), and model.offload for the meter. On
    a CPU the activations already live in host memory: nothing to do, and the returned line
    says so. Returns (Offload or None, the line to print)."""
    if mover is None and device.type != "cuda":
        return None, ("--offload-activations: a no-op on a CPU (activations already live in "
                      "host memory)")
    off = Offload(model, mover or CudaMover(), min_bytes, budget)
    active = []

    def enter(module, args):
        if module.training and torch.is_grad_enabled():
            off.start_forward()
            active.append(off.hooks())
            active[-1].__enter__()

    def leave(module, args, out):
        if active:
            active.pop().__exit__(None, None, None)

    def in_block(i):  # which block's tensors these are: backward prefetches by block
        return lambda module, args: setattr(off, "block", i)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    for i, block in enumerate(model.blocks()):
        block.register_forward_pre_hook(in_block(i))
    model.offload = off
    return off, (f"--offload-activations: saved tensors of {min_bytes // 2**10} KiB or more "
                 f"go to pinned host memory, at most {budget // 2**20} MiB of copies in flight")
