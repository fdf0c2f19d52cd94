"""
Activations in host memory: the tensors saved for backward go to pinned CPU memory in
forward and come back in backward (--offload-activations, CUDA only).

  - Ren et al. 2021, "ZeRO-Offload"; torchtune's OffloadActivations: saved tensors on the host

The plain idea in one hook pair: torch.autograd.graph.saved_tensors_hooks(pack, unpack),
where pack(t) returns t.to("cpu") and unpack(h) returns h.to(device). Offload below is
that, with the copies on a side stream so they overlap compute.
"""
import torch

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
