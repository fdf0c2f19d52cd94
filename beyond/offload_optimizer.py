"""
ZeRO-Offload: the fp32 master slice and the optimizer state in host memory, the optimizer
step on the CPU (--offload-optimizer). Activations in host memory are beyond/offload.py.

  - Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training"

What lives where, per rank (Sec. 4.1: the 16-bit weights and the forward and backward on
the GPU; the fp32 master, the gradients' fp32 copy and Adam's moments on the CPU):

  device  the 16-bit weights (stage 3: their shards), the gradient buckets      2Ψ + 2Ψ
  host    the fp32 master slice, the optimizer state, the fp32 gradient slice,
          and one 16-bit staging slice (pinned: the copies' source and target)   (12 + 4 + 2)Ψ/N

The stage's sharding is unchanged: each rank offloads the slice it owns (Sec. 4.2, "ZeRO-
Offload ... on top of ZeRO-2"; the same at stages 1 and 3 here). Per step a rank moves its
gradient slice down and its new 16-bit weight slice up (Sec. 4.1: 2 x 2Ψ/N bytes in 16 bits).

The step, as engine methods that train.update calls in its usual order:

  (a) down     the reduced gradient slice of each bucket, device -> pinned host, on a side
               stream. Plain (overlap=False): all buckets after backward, in master_grads.
               Overlapped: each bucket as its reduce-scatter lands, while backward goes on
               (Sec. 4.1's "overlap ... with backward"), its copy fenced by an event
  (b) upcast   on the host: the 16-bit slice -> the fp32 master gradient (exact)
  (c) check    the scaler's inf/NaN check and unscale run on the host gradients; the flag is
               then copied to the process group's device and all-reduced (MAX) there
  (d) clip     each rank's sum of squares on the host, copied to the device, all-reduced
               (SUM) there, one norm and one coefficient for every rank (PITFALLS 33)
  (e) step     the optimizer on the host master (torch's fused CPU AdamW), skipped by the
               flag every rank agreed on
  (f) up       the new master cast to 16 bits on the host, host -> device on the side stream,
               then the all-gather that stages 1-2 run anyway (stage 3: into the shard the
               next forward gathers)

Every number is what the resident engine computes: the upcast, the unscale by 2^-k, the
clip's multiply and the cast back are the same IEEE operations on the CPU as on the device;
tests/test_offload_optimizer.py holds offload on == off bitwise on gloo. On a GPU, the norm's
partial sum is summed on the CPU in another order than on the device: the clip coefficient
may then differ from a resident run's in its last bit (docs/offload-optimizer.md).

--offload-optimizer delayed adds the paper's one-step delayed parameter update (Sec. 4.3, DPU,
DelayedUpdate below): the CPU step overlaps the next forward and backward, and the
arithmetic changes (each gradient is taken at weights one update old).
"""
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import optim
from collectives import all_gather_params, all_reduce_sum
from zero import ZeRO
from zero3 import ZeRO3

HOST = torch.device("cpu")
# the rates memory.py --advise predicts with: torch's fused CPU AdamW, fp32, 1 thread, on this
# repository's AMD EPYC CI host (python -m bench.cpu_adam: 1.1-1.3e9; foreach 0.4e9); a PCIe
# 4.0 x16 link's usual ~25 GB/s each way of pinned copies (its peak is 32)
CPU_ADAM_PER_CORE = 1.2e9  # elements per second a core
PCIE_BYTES_PER_S = 25e9


@dataclass
class HostCopies:
    """Bytes this rank copied between the device and the host since the counter was made: no
    collective (not in collectives.Traffic), but the same step's cost, counted beside it."""
    d2h: int = 0  # device -> host: the gradient slice
    h2d: int = 0  # host -> device: the updated 16-bit weight slice


class OffloadOptimizer:
    """A mixin for the engine: the master slice and the optimizer in host memory. Put before
    the engine class (OffloadZeRO, OffloadZeRO3 below). overlap: copy each bucket's gradient
    down as its reduction lands (else all of them after backward: the plain version)."""

    def __init__(self, model, stage, overlap=True, **kwargs):
        if stage == 0:  # every rank would hold the whole master on its host
            raise ValueError("--offload-optimizer offloads the slice a rank owns: use --zero "
                             "1, 2 or 3 (at stage 0 every rank owns everything)")
        self.overlap, self.accumulating = overlap, False
        self.pin = next(model.parameters()).device.type == "cuda"  # pinned: DMA, async copies
        self.host_copies = HostCopies()
        super().__init__(model, stage, **kwargs)
        # the host buffers, allocated once (pinning is slow): the fp32 gradient slice, and a
        # 16-bit staging slice that carries the gradient down and the new weights up
        self.host_grad = [self._host(m.numel(), torch.float32) for m in self.master]
        low = self.dtype != torch.float32
        self.host_low = [self._host(m.numel(), self.dtype) if low else None
                         for m in self.master]
        self.index = {id(b): i for i, b in enumerate(self.buckets)}
        self.down = {}  # bucket index -> the event its gradient copy records (None on a CPU)
        self.up = {}  # bucket index -> the event of its last weight copy up
        self.stream = torch.cuda.Stream(self.device) if self.pin else None

    def _host(self, numel, dtype):
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=self.pin)

    def _new_master(self, b):
        """(2) The master slice in (pinned) host memory: a copy, in fp32 too, whose weights on
        the device are now only the working copy."""
        owned = self._owned_weights(b)
        master = self._host(owned.numel(), torch.float32)
        master.copy_(owned)  # exact: the fp32 values, or the 16-bit ones the seed replaces
        return master

    # -- (a) down: as each reduction lands (overlapped), or all after backward (plain) ------

    @contextmanager
    def no_sync(self):
        """A micro-step that is not the last: its gradients are not final, nothing goes down."""
        self.accumulating = True
        try:
            with super().no_sync():
                yield
        finally:
            self.accumulating = False

    def _land_one(self, work, send, reduced, into, b):
        super()._land_one(work, send, reduced, into, b)
        if self.overlap and not self.accumulating:
            self._grad_down(self.index[id(b)])  # final: its copy overlaps the rest of backward

    def _grad_down(self, i):
        """Launch the copy of bucket i's reduced gradient slice to the host (16 bits into the
        staging slice, fp32 straight into the fp32 gradient)."""
        src = self.buckets[i].owned_grad()
        dst = self.host_grad[i] if src.dtype == torch.float32 else self.host_low[i]
        self.host_copies.d2h += src.numel() * src.element_size()
        if self.stream is None:  # one device: a plain copy
            dst.copy_(src)
            self.down[i] = None
            return
        # the side stream waits for the reduction's result on the compute stream; the copy is
        # fenced by an event that the host waits for before it reads (never synchronize())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.down[i] = event

    def _prepare_master_grads(self):  # (5) master_grads, in train.py's order: (a) and (b)
        """The host fp32 master gradients, set as each segment's master.grad."""
        for i, b in enumerate(self.buckets):
            if i not in self.down:  # the plain version, or a bucket that never landed
                self._grad_down(i)
        for i, b in enumerate(self.buckets):
            event = self.down.pop(i)
            if event is not None:
                event.synchronize()  # the host reads what the copy wrote: wait for it
                torch.cuda.current_stream(self.device).wait_event(event)  # zero_grad after it
            if self.host_low[i] is not None and b.owned_grad().dtype != torch.float32:
                self.host_grad[i].copy_(self.host_low[i])  # (b) upcast: exact
            for s in b.segments:
                s.master.grad = self.host_grad[i][s.start:s.start + s.hi - s.lo] \
                    .view_as(s.master)

    # -- (c)-(e): norm and flag on the group's device, the step on the host ----------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """(d) The global norm: the squares summed on the host, the sum reduced on the group's
        device (a host tensor on NCCL fails; one never reduced clips each rank by its own)."""
        grads = self.master_grads()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:  # a rank may own nothing but padding
            sq.copy_(torch.stack(torch._foreach_norm(grads)).pow(2).sum())
        norm = all_reduce_norm(sq, self)
        if max_norm > 0 and grads:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
            torch._foreach_mul_(grads, coef.to(HOST))  # one scalar down: the step waits anyway
        return norm

    @torch.no_grad()
    def step(self, lr=None, found_inf=None):
        """(e) The optimizer on the host master; found_inf, agreed on the device, comes down
        (one scalar) for the host optimizer to read."""
        super().step(lr, None if found_inf is None else found_inf.to(HOST))

    # -- (f) up: the new 16-bit slice to the device, then the stage's own publish -----------

    def _staged(self, i):
        """Bucket i's new weights on the host, in the working dtype: the master cast into the
        staging slice (in fp32 the master itself)."""
        if self.host_low[i] is None:
            return self.master[i]
        last = self.up.pop(i, None)
        if last is not None:  # the host is to overwrite the staging slice: the copy that read
            last.synchronize()  # it last must have landed (a publish with no step between)
        return self.host_low[i].copy_(self.master[i])

    def _weights_up(self, i, into=None):
        """Bucket i's new master as working weights on the device: cast on the host into the
        staging slice, copied up on the side stream into `into` (default: a new tensor)."""
        src = self._staged(i)
        into = torch.empty(src.numel(), dtype=self.dtype, device=self.device) \
            if into is None else into
        self.host_copies.h2d += src.numel() * src.element_size()
        if self.stream is None:
            return into.copy_(src)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # `into` is free to be written
        with torch.cuda.stream(self.stream):
            into.copy_(src, non_blocking=True)
            into.record_stream(self.stream)  # made on the compute stream, written on this one
            event = torch.cuda.Event()
            event.record(self.stream)
        compute.wait_event(event)  # the all-gather (or forward) after it reads it landed
        self.up[i] = event
        return into

    @torch.no_grad()
    def publish(self, wait=True):
        """(6) publish, with (f) first: stages 1-2 all-gather the slice that came up, stage 3
        copies it into the shard the next forward gathers."""
        if self.stage == 3:
            for i, b in enumerate(self.buckets):
                self._weights_up(i, into=b.shard)
            return
        for i in self.publish_order:
            b = self.buckets[i]
            shard = self._weights_up(i)
            work = publish_gather(b.flat, shard, self)
            if work is not None:
                self.publishing[i] = (work, shard)  # the shard lives as long as its gather
        if wait:
            self.wait_published()

    # -- measurement -------------------------------------------------------------------------

    def state_bytes(self):
        """The model state on the device (the weights, the gradient buckets): the master and
        the optimizer state are on the host (host_bytes)."""
        out = super().state_bytes()
        out.update(master=0, optimizer=0)
        out["total"] = out["params"] + out["grads"]
        return out

    def host_bytes(self):
        """What this rank holds in host memory: the master, the optimizer state, the fp32
        gradient slice and the 16-bit staging slice."""
        nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors
                                     if t is not None)
        moments = [t for s in self.opt.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0]
        out = {"master": nbytes(self.master), "optimizer": nbytes(moments),
               "grads": nbytes(self.host_grad), "staging": nbytes(self.host_low)}
        out["total"] = sum(out.values())
        return out

    def pcie_formula(self):
        """Bytes per step each way (Sec. 4.1): the gradient slice down in the gradient buffer's
        dtype, the weight slice up in the working dtype, each the padded slice this rank owns."""
        owned = sum(b.hi - b.lo for b in self.buckets)
        grad_bytes = torch.empty((), dtype=self.grad_dtype).element_size()
        weight_bytes = torch.empty((), dtype=self.dtype).element_size()
        return {"d2h": owned * grad_bytes, "h2d": owned * weight_bytes}


def host_threads(model, world_size):
    """The CPU step's threads: on a GPU run the host's cores shared by the ranks of this node,
    so that N ranks do not oversubscribe it (a CPU run's threads are already its compute's)."""
    if next(model.parameters()).device.type != "cuda":
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def all_reduce_norm(sq, zero):
    """sqrt of the sum over ranks of sq, on the group's device (stage 1+ shards the squares)."""
    return all_reduce_sum(sq, zero.world_size, zero.group).sqrt()


def publish_gather(flat, shard, zero):
    return all_gather_params(flat, shard, zero.traffic, zero.world_size, zero.gather_group)


class OffloadZeRO(OffloadOptimizer, ZeRO):
    """ZeRO-1 and 2 with the optimizer in host memory."""


class OffloadZeRO3(OffloadOptimizer, ZeRO3):
    """ZeRO-3 with the optimizer in host memory."""


class DelayedUpdate(OffloadOptimizer):
    """The one-step delayed parameter update (Ren et al. 2021, Sec. 4.3, DPU): the CPU steps
    gradient t in a thread while the device runs forward and backward t+1 on the weights of
    step t-1. It changes the arithmetic: gradient t is taken at weights one update old.

      step t   join the thread of step t-1 (in master_grads: the master now has update t-1);
               snapshot the master as the weights forward t+1 reads; launch the thread that
               steps gradient t; publish the snapshot
    The fp32 gradient slice is double-buffered: the next backward's copies go to the spare
    while the thread reads this one. A save (wait_published() with no buckets) joins first:
    the checkpoint's master then holds update t, one ahead of the weights in use (the
    snapshot). So it saves those too, by (tensor, range) as the master ("in_use": checkpoint.py
    asks checkpoint_keys), and a resume publishes them rather than the master: k + save +
    resume + k == 2k."""
    checkpoint_keys = ("in_use",)  # saved and restored beside each master

    def __init__(self, model, stage, **kwargs):
        super().__init__(model, stage, **kwargs)
        self.spare_grad = [self._host(m.numel(), torch.float32) for m in self.master]
        self.snapshot = [self._host(m.numel(), self.dtype) for m in self.master]
        self.pending = None  # the thread stepping the last gradient
        self.error = None
        self.restored = False  # the snapshot is a checkpoint's: publish it, do not retake it
        self.bucket_of = {id(s): i for i, b in enumerate(self.buckets) for s in b.segments}

    def in_use(self, s):
        """Segment s's piece of the weights in use (the snapshot: between steps one update
        behind its master), flat, in the working dtype."""
        return self.snapshot[self.bucket_of[id(s)]][s.start:s.start + s.hi - s.lo]

    def checkpoint_piece(self, s, key):  # checkpoint.py's "in_use" of segment s, in fp32
        return self.in_use(s).float()

    def restore_checkpoint_pieces(self, key, pieces):
        """A checkpoint's weights in use ("in_use"), [(segment, values)]: the snapshot is the
        master's but for these pieces' stored elements, and the restore's publish sends it."""
        self._join()
        for i in range(len(self.master)):
            self._take_snapshot(i)
        for s, values in pieces:
            self.in_use(s)[:len(values)].copy_(values)
        self.restored = True

    def _join(self):
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        if self.error is not None:
            raise self.error

    def master_grads(self):
        self._join()  # the thread read this step's master.grad views: it is done first
        return super().master_grads()

    def _take_snapshot(self, i):
        last = self.up.pop(i, None)
        if last is not None:  # the last copy up read the snapshot: it must have landed
            last.synchronize()
        self.snapshot[i].copy_(self.master[i])

    def _staged(self, i):
        if self.pending is None and not self.restored:  # no step in flight: the master itself
            self._take_snapshot(i)
        return self.snapshot[i]  # else taken in step(), before the thread began to change it

    @torch.no_grad()
    def step(self, lr=None, found_inf=None):
        self.master_grads()  # zero.py's: finishes the backward, or refuses a step without one
        self._join()
        self.restored = False
        for i in range(len(self.master)):  # the weights of update t-1: forward t+1's
            self._take_snapshot(i)
        for g in self.opt.param_groups if lr is not None else ():
            g["lr"] = lr
        found_inf = None if found_inf is None else found_inf.to(HOST)
        skip = found_inf is not None and optim.skip_on_host(self.opt) and bool(found_inf.item())
        self.opt.found_inf = None if optim.skip_on_host(self.opt) else found_inf
        self.pending = threading.Thread(target=self._host_step, args=(skip,), daemon=True)
        self.pending.start()
        self.zero_grad()  # the device's buffers: the next backward starts from zero
        self.host_grad, self.spare_grad = self.spare_grad, self.host_grad  # the next copies

    def _host_step(self, skip):
        """The thread: the optimizer on the host master (torch's kernels release the GIL)."""
        try:
            with torch.no_grad():
                if not skip:
                    self.opt.step()
                for s in self.segments:
                    s.master.grad = None
        except BaseException as e:  # raised in the main thread at the next join
            self.error = e

    def host_bytes(self):
        """The offloaded bytes, and the second fp32 gradient slice and the weight snapshot."""
        out = super().host_bytes()
        out["grads"] += sum(t.numel() * t.element_size() for t in self.spare_grad)
        out["staging"] += sum(t.numel() * t.element_size() for t in self.snapshot)
        out["total"] = out["master"] + out["optimizer"] + out["grads"] + out["staging"]
        return out

    def wait_published(self, indices=None):
        if indices is None:  # a save or a check reads the master: the thread must be done
            self._join()
        super().wait_published(indices)


ENGINES = {ZeRO: OffloadZeRO, ZeRO3: OffloadZeRO3}  # and those made by offload_engine


def offload_engine(Engine, delayed=False):
    """The offloading version of an engine class (ZeRO, ZeRO3, beyond/muon.py's WholeZeRO),
    made once per class; delayed: with DPU (DelayedUpdate)."""
    key = (Engine, delayed) if delayed else Engine
    if key not in ENGINES:
        mixin = DelayedUpdate if delayed else OffloadOptimizer
        name = ("Delayed" if delayed else "") + "Offload" + Engine.__name__
        ENGINES[key] = type(name, (mixin, Engine), {})
    return ENGINES[key]
