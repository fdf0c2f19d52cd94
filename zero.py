"""
Data parallelism and ZeRO stages 0, 1 and 2, written on raw torch.distributed collectives.
Stage 3, which shards the parameters themselves, extends this engine in zero3.py.

Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
Sec. 5 (ZeRO-DP: P_os, P_os+g, P_os+g+p) and Sec. 7 (their communication volume).
With mixed-precision Adam every parameter costs 2 (16-bit weight) + 2 (16-bit gradient) + 12
(fp32 master weight, Adam's two moments) = 16 bytes, and plain data parallelism keeps all 16
on every one of N ranks. ZeRO partitions the redundant parts:

  stage 0  plain data parallelism: all-reduce the gradients          16Ψ per rank
  stage 1  shard the optimizer side (master + Adam)                  4Ψ + 12Ψ/N
  stage 2  shard the gradients too                                   2Ψ + 14Ψ/N
  stage 3  shard the parameters too (zero3.py; PyTorch calls it FSDP) 16Ψ/N

Stages 0-2 move the same 2Ψ elements per step: a ring all-reduce *is* a reduce-scatter
followed by an all-gather, and stages 1-2 do the two halves at different times, updating only
their own shard in between. So they differ in two places: `_reduce` (which collective runs in
backward) and `publish` (whether the step all-gathers).

Layout. The trainable parameters (the tied embedding / LM head once) are packed, last layer
first, into buckets of about --bucket-mb: one flat tensor each, padded to a multiple of N, the
parameters views into it, so collectives run on contiguous memory. Rank r owns the r-th 1/N of
every bucket. Padding makes every world size legal and stays zero, outside norms, inf checks
and checkpoints. The optimizer steps one 1-D view per (parameter, rank) piece, a `Segment`.

Overlap. A post-accumulate-grad hook counts a bucket's gradients as they land; a complete
bucket's collective is launched asynchronously while backward goes on. Buckets launch strictly
in index order, so all ranks issue the same collectives in the same order.

The step, called by train.py's loop in the lecture's order: `master_grads`, the scaler's
unscale and inf check, `clip_grad_norm_`, `step` (fused AdamW, skipped on the device when any
rank found an inf), `publish`. Norms, the inf flag and the skip stay on the device.
"""
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in / tensor-out collectives; use the new names where they exist
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------------------------
# The collectives, named: the one place that counts traffic, in elements as the ZeRO paper does.
# An all-reduce of n elements moves 2n (a reduce-scatter and an all-gather half), a
# reduce-scatter or all-gather of an n-element buffer n. On one rank: local copies, no traffic.

@dataclass
class Traffic:
    """Elements (and bytes) this rank's collectives moved since the counter was made."""
    all_reduce: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0
    bytes: int = 0

    @property
    def elements(self):
        return self.all_reduce + self.reduce_scatter + self.all_gather


def all_reduce_grads(flat, traffic, world_size, group=None):
    if world_size == 1:
        return None
    traffic.all_reduce += 2 * flat.numel()
    traffic.bytes += 2 * flat.numel() * flat.element_size()
    # SUM and an explicit division elsewhere, never ReduceOp.AVG (not supported on gloo)
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter_grads(shard, flat, traffic, world_size, group=None):
    if world_size == 1:
        shard.copy_(flat)
        return None
    traffic.reduce_scatter += flat.numel()
    traffic.bytes += flat.numel() * flat.element_size()
    # gloo has no native reduce-scatter: it runs an all-reduce and keeps one slice, so on CPU
    # this half costs what a whole all-reduce costs. NCCL's ring does only the reduce half.
    return _reduce_scatter(shard, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather_params(flat, shard, traffic, world_size, group=None):
    if world_size == 1:
        flat.copy_(shard)
        return None
    traffic.all_gather += flat.numel()
    traffic.bytes += flat.numel() * flat.element_size()
    return _all_gather(flat, shard, group=group, async_op=True)


def all_reduce_sum(x, world_size, group=None):
    """A few bytes of control traffic (norms, counts), not counted as model traffic."""
    if world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


# ----------------------------------------------------------------------------------------------
# Layout: buckets and the segments the optimizer steps

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
    """What a module holds but never trains: frozen parameters (LoRA's base) and persistent
    buffers (a quantized base's codes and scales; not nf4's shared 16-value code table)."""
    frozen = [p for p in module.parameters() if not p.requires_grad and keep(p)]
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set and keep(b):
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


# ----------------------------------------------------------------------------------------------

class ZeRO:
    """Owns the trainable parameters' flat buckets, this rank's fp32 master slice and AdamW.
    The model must be on its device, in its working dtype (fp32, bf16 or fp16). Per micro-step
    backward(loss, sync); per step master_grads, clip_grad_norm_, step, publish, zero_grad."""
    STAGES = (0, 1, 2)

    def __init__(self, model, stage, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8,
                 bucket_mb=25.0, rank=0, world_size=1, group=None, fp32_grad_accum=False):
        if stage not in self.STAGES:
            raise ValueError(f"{type(self).__name__} runs ZeRO stages {self.STAGES}, not {stage}")
        self.stage, self.rank, self.world_size, self.group = stage, rank, world_size, group
        self.bucket_mb, self.traffic = bucket_mb, Traffic()
        # NCCL runs a process group's collectives in order on one stream of its own: with a
        # second group, an all-gather (ZeRO-3's prefetch, stage 1-2's publish) need not queue
        # behind a reduce-scatter (FSDP2 uses two streams alike). wait() makes the compute
        # stream wait for it, and the group holds its tensors until then. gloo: one group.
        on_gpus = world_size > 1 and next(model.parameters()).device.type == "cuda"
        self.gather_group = dist.new_group(backend="nccl") if on_gpus else group
        # named_parameters() skips the tied weight's second name; frozen tensors stay out
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names = {}  # model.state_dict()'s name of every tensor (the tied one: its first)
        for n, t in model.state_dict(keep_vars=True).items():
            self.names.setdefault(id(t), n)
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full buffers gathered now / at most
        self.frozen = frozen_tensors(model)  # model state too: counted by state_bytes()
        self.dtype, self.device = named[0][1].dtype, named[0][1].device
        self.psi = sum(p.numel() for _, p in named)  # Ψ, each weight counted once
        self.frozen_numel = sum(t.numel() for t in self.frozen)
        # a 16-bit sum over micro-steps loses the small contributions (Megatron and DeepSpeed's
        # bf16 optimizer accumulate in fp32): the accumulating gradient buffer is fp32
        self.grad_dtype = torch.float32 if fp32_grad_accum else self.dtype
        self.buckets = self._make_buckets(model, [p for _, p in named])
        # where each trainable parameter lives: its bucket, its offset in the flat buffer
        self.where = {id(p): (b, offset) for b in self.buckets
                      for p, offset in zip(b.params, b.offsets)}

        # the fp32 master slice. In fp32 the parameters are the master (no copy): the slice is a
        # view of the flat buffer. In 16 bits it is a separate fp32 tensor (Micikevicius et al.
        # 2018): an update below ~2^-8 of a weight rounds away in bf16 and would be lost.
        self.master = [self._owned_weights(b).float() for b in self.buckets]
        for b, master in zip(self.buckets, self.master):
            b.make_segments(self.names, master)
        self.segments = [s for b in self.buckets for s in b.segments]
        # decay 2-D weights (matmuls, embeddings), not biases or LayerNorm gains
        decay = [s.master for s in self.segments if s.param.dim() >= 2]
        no_decay = [s.master for s in self.segments if s.param.dim() < 2]
        # fused: one multi-tensor kernel for the update; it takes found_inf, so a skipped step
        # is decided on the device (the door torch.amp.GradScaler uses)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=lr, betas=betas, eps=eps, fused=True)
        # Adam's moments now, as fused AdamW makes them: start-up measures what training holds
        for s in self.segments:
            self.opt.state[s.master] = {
                "step": torch.zeros((), dtype=torch.float32, device=self.device),
                "exp_avg": torch.zeros_like(s.master), "exp_avg_sq": torch.zeros_like(s.master)}

        self.sync, self.next_bucket, self.in_flight = True, 0, []
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _make_buckets(self, model, params):
        """Stages 0-2: buckets of about bucket_mb, last layer first; each gets its gradient."""
        cap = max(1, int(self.bucket_mb * 2**20 / params[0].element_size()))
        buckets = []
        for indices in plan_buckets([p.numel() for p in params], cap):
            b = Bucket([params[i] for i in indices], self.rank, self.world_size, self.dtype,
                       self.device, pad=self.stage >= 1)
            if self.stage <= 1:
                b.flat_grad = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
                if self.grad_dtype == self.dtype:  # the parameters' .grad are views into it
                    for p, offset in zip(b.params, b.offsets):
                        p.grad = b.flat_grad[offset:offset + p.numel()].view_as(p)
            else:
                b.grad_shard = torch.zeros(b.hi - b.lo, dtype=self.grad_dtype, device=self.device)
            buckets.append(b)
        return buckets

    def _owned_weights(self, b):
        return b.flat[b.lo:b.hi]

    # -- backward: bucketed, asynchronous gradient reduction ---------------------------------

    def _grad_ready(self, p):  # autograd's hook: p's gradient of this micro-step is complete
        b, offset = self.where[id(p)]
        if b.flat_grad is not None and b.flat_grad.dtype != p.dtype:
            # fp32 accumulation (stages 0-1): add the 16-bit gradient in, free it
            b.flat_grad[offset:offset + p.numel()] += p.grad.reshape(-1)
            p.grad = None
        if not self.sync:
            return  # stages 0-1, not the last micro-step: gradients accumulate locally
        b.ready += 1
        # launch every complete bucket in index order, so all ranks issue the same sequence
        while self.next_bucket < len(self.buckets) and \
                self.buckets[self.next_bucket].ready == len(self.buckets[self.next_bucket].params):
            self._reduce(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _reduce(self, b):
        """Launch bucket b's gradient collective, each gradient divided by N first: the sum over
        ranks is then the mean, and a 16-bit sum of N gradients cannot overflow on the way."""
        N = self.world_size
        if self.stage == 0:  # plain data parallelism: every rank gets the whole sum
            b.flat_grad.div_(N)
            work = all_reduce_grads(b.flat_grad, self.traffic, N, self.group)
            self.in_flight.append((work, None, None))
        elif self.stage == 1:  # ZeRO-1: reduce-scatter; only the owned slice's sum is needed
            b.flat_grad.div_(N)
            reduced = torch.empty_like(b.flat_grad[b.lo:b.hi])
            work = reduce_scatter_grads(reduced, b.flat_grad, self.traffic, N, self.group)
            self.in_flight.append((work, reduced, b.flat_grad[b.lo:b.hi]))
        else:
            # ZeRO-2: the gradients go into a temporary flat buffer, freed after the reduce-
            # scatter: only this rank's slice survives, summed over micro-steps (never 2Ψ held)
            flat = torch.empty_like(b.flat)
            for p, offset in zip(b.params, b.offsets):
                piece = flat[offset:offset + p.numel()]
                if p.grad is None:  # the parameter was unused in this forward
                    piece.zero_()
                else:
                    piece.copy_(p.grad.reshape(-1))
                    p.grad = None
            flat[b.offsets[-1] + b.params[-1].numel():].zero_()  # the padding
            flat.div_(N)
            reduced = torch.empty(b.hi - b.lo, dtype=self.dtype, device=self.device)
            work = reduce_scatter_grads(reduced, flat, self.traffic, N, self.group)
            self.in_flight.append((work, reduced, b.grad_shard))

    def backward(self, loss, sync=True):
        """loss.backward(), the gradient collectives overlapped. sync=False on all but the last
        micro-step of gradient accumulation (stages 0-1 then communicate nothing)."""
        self.sync, self.next_bucket = sync or self.stage >= 2, 0
        for b in self.buckets:
            b.ready = 0
        loss.backward()
        if self.sync:
            while self.next_bucket < len(self.buckets):  # buckets with unused parameters
                self._reduce(self.buckets[self.next_bucket])
                self.next_bucket += 1
            self._land()

    def _land(self):
        """Wait for every collective launched in this backward and put its result in place."""
        for work, reduced, into in self.in_flight:
            if work is not None:
                work.wait()  # always wait before reading a collective's output
            if into is None:
                continue  # an all-reduce: done in place
            if self.stage >= 2:
                into.add_(reduced)  # micro-steps accumulate into the shard (fp32 if asked)
            else:
                into.copy_(reduced)
        self.in_flight = []

    # -- the optimizer step on this rank's slice --------------------------------------------

    @torch.no_grad()
    def master_grads(self):
        """This rank's gradient slice as the fp32 master gradients (a copy of a 16-bit slice, the
        slice itself when fp32), set as each segment's master.grad and returned."""
        for b in self.buckets:
            grad = b.owned_grad().float()
            for s in b.segments:
                s.master.grad = grad[s.start:s.start + s.hi - s.lo]
        return [s.master.grad for s in self.segments]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Global L2 norm of the (unscaled) gradient, a device tensor: each rank sums the squares
        it owns (padding is in no segment), one all-reduce SUM, a square root, one coefficient
        for all (a rank's own norm would be ~1/sqrt(N) of the truth). Stage 0 owns everything."""
        grads = [s.master.grad for s in self.segments]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:  # a rank may own nothing but padding
            sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()  # one kernel per dtype
        norm = all_reduce_sum(sq, self.world_size if self.stage >= 1 else 1, self.group).sqrt()
        if max_norm > 0 and grads:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as clip_grad_norm_ does
            torch._foreach_mul_(grads, coef)
        return norm

    @torch.no_grad()
    def step(self, lr, found_inf=None):
        """AdamW on this rank's fp32 master slice. found_inf (a device tensor, 1.0 when any
        rank's gradient held an inf/NaN) makes the fused kernel skip the whole update: the
        weights, both moments and the step count stay as they were."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.found_inf = found_inf  # read by fused AdamW's step
        self.opt.step()
        for s in self.segments:
            s.master.grad = None

    @torch.no_grad()
    def publish(self):
        """The new fp32 master -> the working weights: stage 0 copies it (each rank updated all
        of it), stages 1-2 all-gather every rank's slice (the second half of the 2Ψ). After a
        skipped step this publishes unchanged weights: skipping would need the inf flag read."""
        works = []
        for b, master in zip(self.buckets, self.master):
            if self.stage == 0:
                if master.data_ptr() != b.flat.data_ptr():  # in fp32 the master is the weight
                    b.flat.copy_(master)
            else:  # a fresh copy: the input of all-gather must not alias its output
                shard = master.to(self.dtype, copy=True)
                works.append(all_gather_params(b.flat, shard, self.traffic, self.world_size,
                                               self.gather_group))
        for work in works:
            if work is not None:
                work.wait()

    def zero_grad(self):
        for b in self.buckets:
            (b.flat_grad if b.flat_grad is not None else b.grad_shard).zero_()

    # -- for checkpoints and measurement ----------------------------------------------------

    def frozen_pieces(self):
        """(name, lo, hi, flat view) of the frozen tensors this rank holds: all, whole."""
        return [(self.names[id(t)], 0, t.numel(), t.detach().view(-1)) for t in self.frozen]

    def weight_bytes(self):
        """The working weights this rank holds: every bucket and frozen tensor, whole."""
        tensors = [b.flat for b in self.buckets] + self.frozen
        return sum(t.numel() * t.element_size() for t in tensors)

    def state_bytes(self):
        """Model-state bytes this rank holds, by summing the tensors actually allocated. Adam's
        scalar step counters (4 bytes each) are left out."""
        nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
        grads = [b.flat_grad if b.flat_grad is not None else b.grad_shard for b in self.buckets]
        master = [] if self.dtype == torch.float32 else self.master
        moments = [s[k] for s in self.opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        out = {"params": self.weight_bytes(), "grads": nbytes(grads),
               "master": nbytes(master), "optimizer": nbytes(moments)}
        out["total"] = sum(out.values())
        return out


def replica_digest(model):
    """sha256 of every parameter: data parallelism's invariant is that all ranks hold bitwise
    the same weights after every step (compare the digests across ranks)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def traffic_formula(psi, stage, world_size, grad_accum=1, frozen=0):
    """Elements each rank sends per optimizer step, as the ZeRO paper counts them: 2Ψ for
    stages 0-2 (stage 2 reduce-scatters on every micro-step: (accum+1)Ψ), 3Ψ per micro-step for
    stage 3 (our root unit skips its backward gather, so we measure a little less). Stage 3
    also gathers `frozen` elements (LoRA's base) twice per micro-step, forward and backward:
    the price of not keeping the base whole on every rank."""
    if world_size == 1:
        return 0
    per_psi = {0: 2, 1: 2, 2: grad_accum + 1, 3: 3 * grad_accum}[stage]
    return per_psi * psi + (stage == 3) * 2 * grad_accum * frozen


def zero_formula(psi, stage, world_size, dtype):
    """The ZeRO paper's model-state bytes per rank for Ψ parameters: 2+2+12 in 16 bits,
    4+4+8 in fp32 (the fp32 weights are the master: no copy)."""
    w = 4 if dtype == torch.float32 else 2  # bytes of a working weight / gradient
    k = 8 if dtype == torch.float32 else 12  # master (16-bit only) + Adam's two moments
    sharded = lambda by_stage: world_size if stage >= by_stage else 1
    opt, grads, params = k * psi / sharded(1), w * psi / sharded(2), w * psi / sharded(3)
    return {"params": params, "grads": grads, "optimizer_side": opt, "total": params + grads + opt}
