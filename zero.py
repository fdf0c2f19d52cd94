"""
Data parallelism and ZeRO stages 0, 1 and 2, written on raw torch.distributed collectives.
Stage 3, which shards the parameters themselves, extends this engine in zero3.py.

Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", Sec. 5 (ZeRO-DP: P_os, P_os+g, P_os+g+p) and Sec. 7 (communication volume).

With mixed-precision Adam every parameter costs 16 bytes:
2 (16-bit weight) + 2 (16-bit gradient) + 12 (fp32 master, Adam's two moments).
Plain data parallelism keeps all 16 on every one of N ranks. ZeRO partitions the
redundant parts (another optimizer changes the 12: optim.py's K):

  stage 0  plain data parallelism: all-reduce the gradients      16Ψ per rank
  stage 1  shard the optimizer side (master + Adam's moments)    4Ψ + 12Ψ/N
  stage 2  shard the gradients too                               2Ψ + 14Ψ/N
  stage 3  shard the parameters too (zero3.py; PyTorch: FSDP)    16Ψ/N

Stages 0-2 move the same 2Ψ elements per step. A ring all-reduce *is* a
reduce-scatter followed by an all-gather; stages 1-2 do the two halves at
different times, and update only their own shard in between.

Read this file in four parts:
  0. the table's numbers as functions: zero_formula (bytes), traffic_formula (elements sent)
  1. NaiveZeRO: the idea in one screen, synchronous, after a plain backward
  2. the layout: parameters packed into flat buckets, the pieces a rank owns
  3. ZeRO, the engine train.py runs: the same four steps, overlapped with backward
     and with the next forward, its protocol numbered (1)-(6) on the code lines

The engine expects train.py's loop: backward(loss, sync) per micro-step, then master_grads,
clip_grad_norm_, step and publish. A loop of one's own that calls it in another order is
guarded from outside (machinery/guard.py): what a misuse means there is docs/forking.md's.
"""
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import accumulate

import torch

import optim
from collectives import (Traffic, all_gather_params, all_reduce_grads, all_reduce_sum,
                         gather_group, reduce_scatter_grads)


# ----------------------------------------------------------------------------------------------
# 0. The stage table's numbers, as the paper counts them
#
# The start-up table (machinery/report.py) prints them beside what each rank measures
# holding (ZeRO.state_bytes) and sending (collectives.Traffic); tests/test_zero.py holds
# the two together. The measurement differs by the padding to N slices only.

def zero_formula(psi, stage, world_size, dtype, optimizer="adamw"):
    """The ZeRO paper's model-state bytes per rank for Ψ parameters, (2 + 2 + K)Ψ (Sec. 5.1;
    the table at the top of this file): each term divided by N from the stage that shards it.

    K = 12 in 16 bits with AdamW: an fp32 master (4) and two fp32 moments (8).
    The optimizer's part of K is optim.STATE_BYTES (AdamW 8, SGD and Lion 4).
    In fp32 a weight and a gradient are 4 bytes each, and there is no master copy:
    the fp32 weights are the master."""
    w = 4 if dtype == torch.float32 else 2  # bytes of a working weight / gradient
    k = optim.STATE_BYTES[optimizer.lower()] + (0 if dtype == torch.float32 else 4)  # + master
    sharded = lambda by_stage: world_size if stage >= by_stage else 1
    opt, grads = k * psi / sharded(1), w * psi / sharded(2)
    params = w * psi / sharded(3)
    return {"params": params, "grads": grads, "optimizer_side": opt,
            "total": params + grads + opt}


def traffic_formula(psi, stage, world_size, grad_accum=1, frozen=0):
    """Elements each rank sends per optimizer step, as the ZeRO paper counts them (Sec. 7).

      stages 0-1  2Ψ: a reduce-scatter and an all-gather (an all-reduce is both)
      stage 2     (accum + 1)Ψ: it reduce-scatters on every micro-step
      stage 3     3Ψ per micro-step: gather, re-gather, reduce-scatter

    Our stage 3 measures a little less: the root unit skips its backward gather and,
    kept across the micro-steps, is gathered once a step.
    Stage 3 also gathers `frozen` elements (LoRA's base) twice per micro-step."""
    if world_size == 1:
        return 0
    per_psi = {0: 2, 1: 2, 2: grad_accum + 1, 3: 3 * grad_accum}[stage]
    return per_psi * psi + (stage == 3) * 2 * grad_accum * frozen


# ----------------------------------------------------------------------------------------------
# 1. The idea, plainly

class NaiveZeRO:
    """ZeRO-2 in its plainest form: one flat buffer, one reduce-scatter, one all-gather,
    all after backward, nothing overlapped. Not used by train.py; tests/test_zero.py holds
    it equal to ZeRO below. Use it as model.zero_grad(); loss.backward(); zero.step().

    The trainable parameters, flattened and padded to a multiple of N, are cut into N
    equal slices; rank r owns slice r: its fp32 master and its optimizer state (1/N each).
    One optimizer group: the real engine decays only matrices (optim.py)."""

    def __init__(self, model, world_size=1, rank=0, lr=1e-3, betas=(0.9, 0.95),
                 weight_decay=0.0, traffic=None):
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied weight once
        self.N, self.rank, self.traffic = world_size, rank, traffic or Traffic()
        self.numel = sum(p.numel() for p in self.params)
        self.S = math.ceil(self.numel / world_size)  # a rank's slice: every rank the same
        flat = self._flat([p.detach() for p in self.params])
        # this rank's fp32 master and, made by the optimizer, its state: 1/N of each
        self.master = flat[rank * self.S:(rank + 1) * self.S].float()
        self.opt = torch.optim.AdamW([self.master], lr=lr, betas=betas,
                                     weight_decay=weight_decay, fused=True)

    def _flat(self, tensors):
        """The tensors flattened into one buffer, padded with zeros to N slices of S."""
        flat = tensors[0].new_zeros(self.S * self.N)
        flat[:self.numel] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    @torch.no_grad()
    def step(self):
        """The four steps, after loss.backward()."""
        # 1. flatten every gradient into one buffer; divide by N first, so that the sum
        #    over ranks is the mean (and a 16-bit sum of N gradients cannot overflow)
        flat = self._flat([p.grad for p in self.params]).div_(self.N)
        for p in self.params:
            p.grad = None  # stage 2: the full gradient is not kept past this step
        # 2. reduce-scatter: rank r receives the sum of every rank's slice r
        shard = flat.new_empty(self.S)
        work = reduce_scatter_grads(shard, flat, self.traffic, self.N)
        if work is not None:
            work.wait()
        # 3. the optimizer on this rank's fp32 master slice only
        self.master.grad = shard.float()
        self.opt.step()
        # 4. all-gather every rank's new slice into the full weights, and unflatten
        work = all_gather_params(flat, self.master.to(flat.dtype), self.traffic, self.N)
        if work is not None:
            work.wait()
        offset = 0
        for p in self.params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


# ----------------------------------------------------------------------------------------------
# 2. The layout ZeRO works on
#
# The trainable parameters (a tied weight once), last layer first, in buckets of about
# --bucket-mb: one flat tensor each, padded to N equal slices, the parameters views into it
# (collectives want contiguous memory). Rank r owns slice r of every bucket; the padding
# stays zero, outside norms, inf checks and checkpoints. A checkpoint saves each Segment
# by (name, element range): a layout no world size is built into. (An optimizer that reads a
# tensor whole cannot step such pieces: beyond/muon.py's WholeZeRO deals whole tensors.)

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
    """What a module holds but never trains, as model state: its frozen parameters (LoRA's base)
    and the persistent buffers of modules whose buffers are a weight (BUFFERS_ARE_STATE:
    quant.py's codes and scales). Stages 0-2 keep them whole on every rank, stage 3 shards them."""
    frozen = [p for p in module.parameters() if not p.requires_grad and keep(p)]
    for m in module.modules():
        if getattr(m, "BUFFERS_ARE_STATE", False):
            frozen += [b for key, b in m._buffers.items() if b is not None and keep(b)
                       and key not in m._non_persistent_buffers_set]
    return frozen


@dataclass
class Segment:
    """The piece [lo, hi) of one flattened parameter that this rank owns: what the optimizer
    steps (`master`, an fp32 view into the master slice, in the parameter's own shape when the
    piece is all of it) and what a checkpoint saves by name (`flat`: the same, 1-D)."""
    name: str  # the parameter's name in model.state_dict()
    param: torch.Tensor  # the working parameter
    lo: int
    hi: int
    start: int  # where the piece begins inside its bucket's owned slice
    flat: torch.Tensor = None
    master: torch.Tensor = None  # flat, or flat.view(param.shape) when the piece is whole

    def __post_init__(self):
        if self.flat is not None:
            self.master = self.flat.view(self.param.shape) if self.whole else self.flat

    @property
    def whole(self):  # the piece is all of its tensor: stage 0 always, a slice's inner ones
        return self.lo == 0 and self.hi == self.param.numel()


class Bucket:
    """Tensors packed into one flat buffer (padded to a multiple of N) that they become views
    of. This rank owns [lo, hi): that range's optimizer state (stage 2+: gradient) lives here."""

    def __init__(self, tensors, rank, world_size, dtype, device, pad=True):
        self.params, numels = tensors, [t.numel() for t in tensors]
        self.offsets, self.numel = self.layout(numels, world_size, pad)
        ends = sorted((o, o + n) for o, n in zip(self.offsets, numels))
        self.gaps = [(e, s) for (_, e), (s, _) in zip(ends, ends[1:] + [(self.numel, 0)]) if e < s]
        shard = self.numel // world_size if pad else self.numel
        self.lo, self.hi = (rank * shard, (rank + 1) * shard) if pad else (0, self.numel)
        self.flat = torch.zeros(self.numel, dtype=dtype, device=device)
        for t, offset in zip(tensors, self.offsets):
            self.flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            t.data = self.flat[offset:offset + t.numel()].view_as(t)  # the tensor is now a view
        self.flat_grad = None  # stages 0-1: the full gradient of the bucket
        self.grad_shard = None  # stages 2-3: only this rank's reduced slice of it
        self.segments = []  # the pieces of its parameters this rank owns, in order
        self.ready = 0  # parameters whose gradient has landed in this backward

    def layout(self, numels, world_size, pad):
        """(each tensor's offset in the flat buffer, the buffer's numel): packed in order, and
        with pad, padded to N equal slices (beyond/muon.py's DealtBucket places them otherwise)."""
        total = sum(numels)
        if pad:
            total = math.ceil(total / world_size) * world_size
        return [0, *accumulate(numels)][:-1], total

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


def declared_blocks(model):
    """The model's blocks() (model.py's GPT declares them), or None if it declares none."""
    blocks = getattr(model, "blocks", None)
    return blocks() if callable(blocks) else None


# ----------------------------------------------------------------------------------------------
# 3. The engine
#
# The same four steps as NaiveZeRO, in buckets, overlapped with the compute around them:
#
#   (1) pack       the trainable parameters into flat buckets (the layout above)
#   (2) master     this rank's fp32 master slice, and the optimizer's state for it
#   (3) launch     a bucket whose gradients are all in: its collective, asynchronously,
#                  while backward goes on (stage 0 all-reduce, stages 1-2 reduce-scatter);
#                  buckets in index order, so every rank issues the same sequence
#   (4) land       wait for the oldest collective, put its sum in place; at most
#                  MAX_IN_FLIGHT are in flight
#   (5) step       master gradients, unscale, clip by the global norm, the optimizer:
#                  train.py's loop calls them in the lecture's order
#   (6) publish    fp32 master -> weights: stages 1-2 all-gather each bucket, waited for
#                  in the pre-hook of the first block that reads it (overlapping the
#                  next forward)
#
# Precision on the wire: gradients are reduced in one dtype at every stage,
# --reduce-dtype: the working dtype by default (the paper's 16-bit gradients), or fp32
# (torchtitan's and Megatron's default), twice the bytes and the low bits of a big sum.
#
# Reductions launched and not yet landed, at most. Each holds a bucket's full-size gradient
# temporary (stages 2-3) until it is waited for: two let one bucket's reduction overlap the
# next bucket's backward while a rank never holds more than two buckets of them.
MAX_IN_FLIGHT = 2


class ZeRO:
    """Owns the trainable parameters' flat buckets, this rank's fp32 master slice and its
    optimizer. The model: on its device, in its working dtype, built alike on every rank.

    Per micro-step backward(loss, sync); per step master_grads, clip_grad_norm_, step, publish.
    optimizer: a name, an Optimizer class or a function of the groups (optim.build); lr,
    weight_decay, decay(name, param): for a class or a function only if given
    (optim.param_groups); master_weights: {name: fp32 tensor}, the values the master starts
    from (a master made from 16-bit weights would keep only their 16 bits)."""
    STAGES = (0, 1, 2)

    def __init__(self, model, stage, lr=None, betas=(0.9, 0.95), weight_decay=None, eps=1e-8,
                 bucket_mb=25.0, rank=0, world_size=1, group=None, fp32_grad_accum=False,
                 reduce_dtype=None, optimizer="adamw", decay=None, master_weights=None):
        assert stage in self.STAGES, f"{type(self).__name__} runs stages {self.STAGES}"
        self.stage, self.rank, self.world_size, self.group = stage, rank, world_size, group
        self.optimizer_name = optimizer if isinstance(optimizer, str) else \
            getattr(getattr(optimizer, "func", optimizer), "__name__", "custom")  # a partial's
        self.bucket_mb, self.traffic = bucket_mb, Traffic()
        # named_parameters() skips the tied weight's second name; frozen tensors stay out
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {}  # model.state_dict()'s name of every tensor (the tied one: its first)
        for n, t in model.state_dict(keep_vars=True).items():
            self.names.setdefault(id(t), n)
        self.frozen = frozen_tensors(model)  # model state too: counted by state_bytes()
        self.dtype, self.device = named[0][1].dtype, named[0][1].device
        # all-gathers on a group of their own (collectives.py; stage 0 never all-gathers)
        self.gather_group = gather_group(group, self.device, world_size) if stage else group
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full buffers gathered now / at most
        self.psi = sum(p.numel() for _, p in named)  # Ψ, each weight counted once
        self.frozen_numel = sum(t.numel() for t in self.frozen)
        # a 16-bit sum over micro-steps loses the small contributions (Megatron and DeepSpeed's
        # bf16 optimizer accumulate in fp32): the accumulating gradient buffer is fp32
        self.grad_dtype = torch.float32 if fp32_grad_accum else self.dtype
        # the dtype gradients cross the wire in, the same policy at every stage: the working
        # dtype by default (the ZeRO paper reduces 16-bit gradients, half the bytes of fp32),
        # fp32 as torchtitan and Megatron do by default (a 16-bit sum over many ranks rounds).
        # One rank moves nothing, so nothing is cast there.
        self.reduce_dtype = reduce_dtype or self.dtype
        self.buckets = self._make_buckets(model, [p for _, p in named])  # (1) pack
        for i, b in enumerate(self.buckets):  # a name for its collectives (a log, an error)
            b.label = getattr(b, "label", None) or f"bucket {i}"
        # where each trainable parameter lives: its bucket, its offset in the flat buffer
        self.where = {id(p): (b, offset) for b in self.buckets
                      for p, offset in zip(b.params, b.offsets)}

        # the fp32 master slice. In fp32 the parameters are the master (no copy): the slice is a
        # view of the flat buffer. In 16 bits it is a separate fp32 tensor (Micikevicius et al.
        # 2018): an update below ~2^-8 of a weight rounds away in bf16 and would be lost.
        self.master = [self._new_master(b) for b in self.buckets]  # (2) master
        for b, master in zip(self.buckets, self.master):
            b.make_segments(self.names, master)
        self.segments = [s for b in self.buckets for s in b.segments]
        if master_weights is not None and self.dtype != torch.float32:
            self._seed_master(master_weights)
        # optim.py builds it and makes its state now, by its own code: start-up measures
        # what training holds
        groups = self._param_groups(optimizer, weight_decay, decay)
        self.opt = self.make_optimizer(optimizer, groups, lr=lr, betas=betas, eps=eps)
        if self.segments:  # a rank may own nothing but padding
            optim.init_state(self.opt, [s.master for s in self.segments])

        self.sync, self.next_bucket, self.in_flight = True, 0, []
        self.prepared = False  # master_grads() ran in this step
        self.publishing = {}  # bucket index -> (its publish all-gather, the shard it sends)
        self.publish_order = list(range(len(self.buckets)))
        if self.stage in (1, 2):
            self._order_publish(model)
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)  # -> (3)

    def make_optimizer(self, optimizer, groups, **hyper):
        """optim.build's optimizer over the groups (beyond/muon.py's WholeZeRO adds Muon)."""
        return optim.build(optimizer, groups, **hyper)

    def _param_groups(self, optimizer, weight_decay, decay):
        """optim.param_groups over this rank's masters: for our names, weight decay on what
        decay(name, param) picks (default: matrices and embeddings); the caller's own
        optimizer gets one group and its own settings unless weight_decay or decay is given."""
        return optim.param_groups([(s.name, s.param, s.master) for s in self.segments],
                                  optimizer, weight_decay, decay)

    @torch.no_grad()
    def _seed_master(self, source):
        """(2) The fp32 master from the full-precision source: a master made from 16-bit
        weights keeps only their 16 bits, up to 2^-9 relative lost for good."""
        for s in self.segments:
            if s.name in source:
                values = source[s.name].reshape(-1)[s.lo:s.hi]  # stored rows: no vocab padding
                s.flat[:len(values)].copy_(values)

    def _make_buckets(self, model, params):
        """Stages 0-2: buckets of about bucket_mb, last layer first (the order their gradients
        complete), each with its gradient buffer."""
        return [self._new_bucket([params[i] for i in b], Bucket)
                for b in plan_buckets([p.numel() for p in params], self.bucket_cap(params))]

    def bucket_cap(self, params):
        """--bucket-mb in elements of the working dtype."""
        return max(1, int(self.bucket_mb * 2**20 / params[0].element_size()))

    def _new_bucket(self, tensors, kind):
        """A bucket of `kind` (Bucket, or a subclass that lays tensors out otherwise) and its
        gradient: stages 0-1 the full flat gradient, the parameters' .grad views into it;
        stage 2 only this rank's reduced slice."""
        b = kind(tensors, self.rank, self.world_size, self.dtype, self.device,
                 pad=self.stage >= 1)
        if self.stage <= 1:
            b.flat_grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
            if self.grad_dtype == self.dtype:  # the parameters' .grad are views into it
                for p, offset in zip(b.params, b.offsets):
                    p.grad = b.flat_grad[offset:offset + p.numel()].view_as(p)
        else:
            b.grad_shard = torch.zeros(b.hi - b.lo, dtype=self.grad_dtype, device=self.device)
        return b

    def _owned_weights(self, b):
        return b.flat[b.lo:b.hi]

    def _new_master(self, b):
        """(2) This rank's fp32 master slice of bucket b, on the weights' device: in fp32 a view
        of the weights, else an fp32 copy (beyond/offload_optimizer.py puts it on the host)."""
        return self._owned_weights(b).float()

    # -- backward: bucketed, asynchronous gradient reduction ---------------------------------

    def _grad_ready(self, p):  # autograd's hook: p's gradient of this micro-step is complete
        b, offset = self.where[id(p)]
        if b.flat_grad is not None and b.flat_grad.dtype != self.dtype:
            # fp32 accumulation (stages 0-1): add the 16-bit gradient in, free it
            b.flat_grad[offset:offset + p.numel()] += p.grad.reshape(-1)
            p.grad = None
        if not self.sync:
            return  # stages 0-1, not the last micro-step: gradients accumulate locally
        b.ready += 1
        # launch every complete bucket in index order, so all ranks issue the same sequence
        while self.next_bucket < len(self.buckets) and \
                self.buckets[self.next_bucket].ready == len(self.buckets[self.next_bucket].params):
            self._reduce(self.buckets[self.next_bucket])  # (3) launch
            self.next_bucket += 1

    def _reduce(self, b):
        """Launch bucket b's gradient collective, each gradient divided by N first: the sum over
        ranks is then the mean, and a 16-bit sum of N gradients cannot overflow on the way.
        At most MAX_IN_FLIGHT in flight: the backend keeps each one's buffers until waited."""
        while len(self.in_flight) >= MAX_IN_FLIGHT:
            self._land_one(*self.in_flight.pop(0))  # (4) land the oldest first
        N = self.world_size
        if self.stage <= 1:  # the bucket's accumulated gradient, cast for the wire if asked
            send = b.flat_grad
            if N > 1 and send.dtype != self.reduce_dtype:
                send = send.to(self.reduce_dtype)
        else:
            send = self._grads_to_flat(b)
        if N > 1:
            send.div_(N)
        if self.stage == 0:  # plain data parallelism: every rank gets the whole sum, in place
            work = all_reduce_grads(send, self.traffic, N, self.group, label=b.label)
            into = None if send is b.flat_grad else b.flat_grad
            self.in_flight.append((work, send, send, into, b))
            return
        # ZeRO-1 and 2: reduce-scatter; only this rank's slice of the sum is needed
        reduced = torch.empty(b.hi - b.lo, dtype=send.dtype, device=self.device)
        work = reduce_scatter_grads(reduced, send, self.traffic, N, self.group, label=b.label)
        into = b.flat_grad[b.lo:b.hi] if self.stage == 1 else b.grad_shard
        self.in_flight.append((work, send, reduced, into, b))

    def _grads_to_flat(self, b):
        """ZeRO-2: the bucket's gradients in a temporary flat buffer that lives until its
        reduce-scatter lands (never 2Ψ held); each .grad is released once copied. A parameter
        unused in this backward sends zeros. One multi-tensor copy (torch._foreach_copy_)
        rather than a kernel per parameter."""
        dtype = self.reduce_dtype if self.world_size > 1 else self.dtype
        flat = torch.empty(b.numel, dtype=dtype, device=self.device)
        used = [(p, o) for p, o in zip(b.params, b.offsets) if p.grad is not None]
        unused = [(o, o + p.numel()) for p, o in zip(b.params, b.offsets) if p.grad is None]
        if b.gaps or unused:  # the padding, and parameters unused in this backward
            torch._foreach_zero_([flat[lo:hi] for lo, hi in b.gaps + unused])
        if used:
            torch._foreach_copy_([flat[o:o + p.numel()] for p, o in used],
                                 [p.grad.reshape(-1) for p, _ in used])
        for p, _ in used:
            p.grad = None  # stage 2: the full gradient is not kept past its copy
        return flat

    def backward(self, loss, sync=True):
        """loss.backward(), the gradient collectives overlapped. sync=False on all but the last
        micro-step of gradient accumulation (stages 0-1 then communicate nothing)."""
        with nullcontext() if sync else self.no_sync():
            loss.backward()
            self.finish_backward()

    @contextmanager
    def no_sync(self):
        """Around the backward of every micro-step but the last, as DDP's no_sync: stages 0-1
        accumulate gradients locally and communicate nothing (stages 2-3 reduce each one)."""
        self.sync = self.stage >= 2
        try:
            yield
        finally:
            self.sync = True

    def finish_backward(self):
        """The end of a backward: launch the buckets that never completed (their parameters went
        unused), land every reduction still in flight. Under no_sync at stages 0-1 nothing is
        reduced: the gradients stay local until the last micro-step's backward."""
        if self.sync:
            while self.next_bucket < len(self.buckets):  # buckets with unused parameters
                self._reduce(self.buckets[self.next_bucket])
                self.next_bucket += 1
            while self.in_flight:  # land what is still in flight, oldest first
                self._land_one(*self.in_flight.pop(0))
        self.next_bucket = 0  # the next backward counts afresh
        for b in self.buckets:
            b.ready = 0

    def _land_one(self, work, send, reduced, into, b):
        """Wait for bucket b's launched reduction and put its result in place. `send` is held
        only so that the buffer the backend reads lives exactly as long as the collective."""
        if work is not None:
            work.wait()  # always wait before reading a collective's output
        if into is not None and self.stage >= 2:
            into.add_(reduced)  # micro-steps accumulate into the shard (fp32 if asked)
        elif into is not None:
            into.copy_(reduced)

    # -- the optimizer step on this rank's slice --------------------------------------------

    @torch.no_grad()
    def master_grads(self):  # (5) step, in train.py's order
        """This rank's gradient slice as the fp32 master gradients (a copy of a 16-bit slice, the
        slice itself when fp32), set as each segment's master.grad and returned. Once a step:
        called again, it returns them as they are now (unscaled, clipped)."""
        if not self.prepared:
            self._prepare_master_grads()
            self.prepared = True
        return [s.master.grad for s in self.segments]

    def _prepare_master_grads(self):
        for b in self.buckets:
            grad = b.owned_grad().float()
            for s in b.segments:
                s.master.grad = grad[s.start:s.start + s.hi - s.lo].view_as(s.master)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Global L2 norm of the (unscaled) gradient, a device tensor: each rank sums the squares
        it owns (padding is in no segment), one all-reduce SUM, a square root, one coefficient
        for all (a rank's own norm would be ~1/sqrt(N) of the truth). Stage 0 owns everything."""
        grads = self.master_grads()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:  # a rank may own nothing but padding
            sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()  # one kernel per dtype
        norm = all_reduce_sum(sq, self.world_size if self.stage >= 1 else 1, self.group,
                              label="norm").sqrt()
        if max_norm > 0 and grads:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
            torch._foreach_mul_(grads, coef)
        return norm

    @torch.no_grad()
    def step(self, lr=None, found_inf=None):
        """The optimizer on this rank's fp32 master slice, at lr (None: the optimizer's own);
        then the gradient buffers are zeroed for the next step. found_inf (a device tensor, 1.0
        when any rank's gradient held an inf/NaN) skips the whole update: on the device where
        the optimizer reads it, else by the engine, which then waits for the flag."""
        self.master_grads()  # a loop with no scaler and no clipping: prepared here
        for g in self.opt.param_groups if lr is not None else ():
            g["lr"] = lr
        if found_inf is not None and optim.skip_on_host(self.opt):
            skip = bool(found_inf.item())
        else:
            skip, self.opt.found_inf = False, found_inf  # read by the optimizer's step
        if not skip:
            self.opt.step()
        for s in self.segments:
            s.master.grad = None
        self.zero_grad()  # the next step's gradients start from zero

    @torch.no_grad()
    def publish(self, wait=True):
        """The new fp32 master -> the working weights: stage 0 copies it, stages 1-2 all-gather
        every rank's slice (the second half of the 2Ψ) in the order the next forward reads
        them. wait=False (train.py's loop): each bucket is waited for in the pre-hook of the
        first block that reads it, overlapping the next forward; anything else that reads
        the weights calls wait_published() first."""
        for i in self.publish_order:
            b, master = self.buckets[i], self.master[i]
            if self.stage == 0:
                if master.data_ptr() != b.flat.data_ptr():  # in fp32 the master is the weight
                    b.flat.copy_(master)
                continue
            shard = master.to(self.dtype, copy=True)  # the input must not alias the output
            work = all_gather_params(b.flat, shard, self.traffic, self.world_size,  # (6)
                                     self.gather_group, label=f"{b.label} (publish)")
            if work is not None:
                self.publishing[i] = (work, shard)  # the shard lives as long as its gather
        if wait:
            self.wait_published()

    def wait_published(self, indices=None):
        """Wait for the publish all-gathers of these buckets (default: all still in flight)."""
        for i in list(self.publishing) if indices is None else indices:
            entry = self.publishing.pop(i, None)
            if entry is not None:
                entry[0].wait()

    def _order_publish(self, model):
        """Stages 1-2: which forward first reads each bucket (-1: the root, before any block),
        the publish order that follows, and the pre-hooks that wait for each bucket there.
        Hooks on the blocks and the model, never inside them: a compiled block stays whole.
        A model without blocks() waits for every bucket before its forward."""
        blocks = declared_blocks(model) or []
        block_of = {id(p): i for i, blk in enumerate(blocks) for p in blk.parameters()}
        first = [min(block_of.get(id(p), -1) for p in b.params) for b in self.buckets]
        self.publish_order = sorted(range(len(self.buckets)), key=lambda i: first[i])
        readers = {j: [i for i in self.publish_order if first[i] == j] for j in set(first)}
        model.register_forward_pre_hook(
            lambda m, args: self.wait_published(readers.get(-1, [])))
        for j, blk in enumerate(blocks):
            if j in readers:
                blk.register_forward_pre_hook(
                    lambda m, args, j=j: self.wait_published(readers[j]))

    def zero_grad(self):
        """Zero the gradient buffers (step() does): the next backward starts from zero."""
        for b in self.buckets:
            (b.flat_grad if b.flat_grad is not None else b.grad_shard).zero_()
        self.prepared = False

    # -- for checkpoints and measurement ----------------------------------------------------

    def frozen_pieces(self):
        """(name, lo, hi, flat view) of the frozen tensors this rank holds: all, whole."""
        return [(self.names[id(t)], 0, t.numel(), t.detach().view(-1)) for t in self.frozen]

    def weight_bytes(self):
        """The working weights this rank holds: every bucket and frozen tensor, whole."""
        tensors = [b.flat for b in self.buckets] + self.frozen
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_bytes(self):
        """Model-state bytes this rank holds, by summing the tensors actually allocated. The
        optimizer's scalar step counters (AdamW's: 4 bytes each) are left out."""
        nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
        grads = [b.flat_grad if b.flat_grad is not None else b.grad_shard for b in self.buckets]
        master = [] if self.dtype == torch.float32 else self.master
        moments = [t for s in self.opt.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0]  # scalars: step counts
        out = {"params": self.weight_bytes(), "grads": nbytes(grads),
               "master": nbytes(master), "optimizer": nbytes(moments)}
        out["total"] = sum(out.values())
        return out
