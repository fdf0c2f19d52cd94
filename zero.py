"""
Data parallelism and ZeRO stages 0 to 3, written on raw torch.distributed collectives.

Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
With mixed-precision Adam every parameter costs 2 (16-bit weight) + 2 (16-bit gradient) + 12
(fp32 master weight, Adam's two moments) = 16 bytes, and plain data parallelism keeps all 16
on every one of N ranks. ZeRO partitions the redundant parts:

  stage 0  plain data parallelism: all-reduce the gradients          16Ψ per rank
  stage 1  shard the optimizer side (master + Adam)                  4Ψ + 12Ψ/N
  stage 2  shard the gradients too                                   2Ψ + 14Ψ/N
  stage 3  shard the parameters too (PyTorch calls it FSDP)          16Ψ/N

Stages 0-2 move the same 2Ψ elements per step: a ring all-reduce *is* a reduce-scatter
followed by an all-gather, and stages 1-2 simply do the two halves at different times,
updating only their own shard in between. Stage 3 gathers each unit's parameters just before
its forward, frees them after, gathers them again for its backward and reduce-scatters its
gradients right after: 3Ψ per step, 1.5x data parallelism, for memory that falls as 1/N.
Frozen tensors (a LoRA base, quantized or not) are sharded with their unit as well: gathered
like the rest, never reduced or updated, 2 x their size in traffic per step.

Layout. The trainable parameters (deduplicated by identity: the tied embedding / LM head is
one tensor) are packed, last layer first, into buckets of about --bucket-mb. Each bucket is
one flat tensor padded to a multiple of N, and the parameters become views into it, so every
collective runs on contiguous memory without copies. Rank r owns the r-th 1/N of every
bucket. Padding makes every world size legal and stays zero; it is never counted in norms,
inf checks or checkpoints. The optimizer sees one 1-D view per (parameter, rank) piece, so
weight-decay groups and per-parameter checkpoint metadata come for free.

Overlap. A post-accumulate-grad hook counts the parameters of a bucket as their gradients
land; once a bucket is complete its collective is launched asynchronously while backward
goes on with earlier layers. Buckets are launched strictly in index order, so every rank
issues the same collectives in the same order whatever order autograd finishes them in.
"""
import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in / tensor-out collectives; use the new names where they exist
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ----------------------------------------------------------------------------------------------
# The collectives, named. This is the one place that counts traffic, in elements, the way the
# ZeRO paper counts it: an all-reduce of n elements moves 2n (its reduce-scatter and its
# all-gather halves), a reduce-scatter or all-gather of an n-element buffer moves n.
# On one rank they are local copies and count nothing.

def all_reduce_grads(flat, traffic, world_size, group=None):
    if world_size == 1:
        return None
    traffic["all_reduce"] += 2 * flat.numel()
    traffic["bytes"] += 2 * flat.numel() * flat.element_size()
    # SUM and an explicit division elsewhere, never ReduceOp.AVG (not supported on gloo)
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter_grads(shard, flat, traffic, world_size, group=None):
    if world_size == 1:
        shard.copy_(flat)
        return None
    traffic["reduce_scatter"] += flat.numel()
    traffic["bytes"] += flat.numel() * flat.element_size()
    # gloo has no native reduce-scatter: it runs an all-reduce and keeps one slice, so on CPU
    # this half costs what a whole all-reduce costs. NCCL's ring does only the reduce half.
    return _reduce_scatter(shard, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather_params(flat, shard, traffic, world_size, group=None):
    if world_size == 1:
        flat.copy_(shard)
        return None
    traffic["all_gather"] += flat.numel()
    traffic["bytes"] += flat.numel() * flat.element_size()
    return _all_gather(flat, shard, group=group, async_op=True)


def all_reduce_scalar(x, world_size, group=None):
    """A few bytes of control traffic (norms, counts), not counted as model traffic."""
    if world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def new_traffic():
    return {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "bytes": 0}


# ----------------------------------------------------------------------------------------------

def frozen_tensors(module, keep=lambda t: True):
    """What a module holds but never trains: frozen parameters (LoRA's base) and persistent
    buffers (a quantized base's codes and scales; not nf4's shared 16-value code table)."""
    ts = [p for p in module.parameters() if not p.requires_grad and keep(p)]
    return ts + [b for m in module.modules() for n, b in m._buffers.items()
                 if b is not None and n not in m._non_persistent_buffers_set and keep(b)]


class Bucket:
    """A contiguous group of parameters: one flat buffer, padded to a multiple of N. frozen:
    stage 3 shards frozen tensors too (LoRA's base, a quantized base's codes and scales):
    gathered and freed with their unit, but with no gradient and no optimizer state."""

    def __init__(self, params, stage, rank, world_size, dtype, device, module=None, frozen=False):
        self.params, self.module, self.frozen = params, module, frozen  # module: stage 3's user
        numel = sum(p.numel() for p in params)
        self.numel = math.ceil(numel / world_size) * world_size if stage >= 1 else numel
        shard = self.numel // world_size
        # the range of the flat buffer whose optimizer state (and, stage 2, gradient) this rank owns
        self.lo, self.hi = (rank * shard, (rank + 1) * shard) if stage >= 1 else (0, self.numel)
        self.flat = torch.zeros(self.numel, dtype=dtype, device=device)
        self.offsets, off = [], 0
        for p in params:
            self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[off:off + p.numel()].view_as(p)  # the parameter is now a view
            self.offsets.append(off)
            off += p.numel()
        self.flat_grad = None  # stages 0-1: the full gradient, parameters' .grad are views into it
        self.grad_shard = None  # stages 2-3: only this rank's reduced gradient slice
        self.shard = None  # stage 3: this rank's slice of the weights, the only copy kept
        self.gathered, self.pending = True, None  # stage 3: full weights present / arriving
        if stage == 3:
            self.shard = self.flat[self.lo:self.hi].clone()
            self.free()
        if frozen:
            pass  # nothing to reduce, nothing to update
        elif stage <= 1:
            self.flat_grad = torch.zeros_like(self.flat)
            for p, off in zip(params, self.offsets):
                p.grad = self.flat_grad[off:off + p.numel()].view_as(p)
        else:
            self.grad_shard = torch.zeros(self.hi - self.lo, dtype=dtype, device=device)
        self.ready = 0  # parameters whose gradient has landed in this backward

    def free(self):
        """Release the full weights but keep the tensor objects: resizing the storage to 0 frees
        the memory, and every view of it (the parameters, and the weights autograd or activation
        checkpointing saved for backward) sees the data again once it is gathered back into the
        same storage. Swapping .data instead would leave saved views on the old, full tensor
        (PITFALLS 6: the "recomputed shape [0]" error)."""
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def allocate(self):
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())

    def grad_piece(self):
        """This rank's reduced gradient slice, in the working dtype."""
        return self.grad_shard if self.grad_shard is not None else self.flat_grad[self.lo:self.hi]


class ZeRO:
    """Owns the trainable parameters' flat buffers, this rank's fp32 master slice and AdamW.

    model must already be on its device and in its working dtype (fp32, bf16 or fp16).
    Use: zero.backward(loss, sync) for each micro-step (sync on the last one), then
    zero.step(lr, scaler, grad_clip)."""

    def __init__(self, model, stage, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=25.0,
                 rank=0, world_size=1, group=None, prefetch=True, eps=1e-8):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero {stage}: the ZeRO stages are 0, 1, 2 and 3")
        self.stage, self.rank, self.world_size, self.group = stage, rank, world_size, group
        self.prefetch = prefetch
        self.traffic = new_traffic()
        # deduplicated by identity (named_parameters() already skips the second name of the tied
        # weight); frozen tensors stay out of every gradient buffer and the optimizer (LoRA relies on it)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in named}  # for checkpoints: model.py's name of each tensor
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.frozen = frozen_tensors(model)  # model state too: counted by state_bytes()
        self.dtype, device = named[0][1].dtype, named[0][1].device
        self.psi = sum(p.numel() for _, p in named)  # Ψ, each weight counted once
        self.frozen_numel = sum(t.numel() for t in self.frozen)  # elements ZeRO-3 gathers but never updates

        if stage == 3:
            self._make_units(model, device)
            self.frozen = []  # now in the units' frozen buckets, sharded like everything else
        else:
            # pack last layer first: gradients arrive in reverse order, so bucket 0 is ready first
            self.buckets, group_params, size = [], [], 0
            cap = max(1, int(bucket_mb * 2**20 / named[0][1].element_size()))
            for _, p in reversed(named):
                if group_params and size + p.numel() > cap:
                    self.buckets.append(Bucket(group_params, stage, rank, world_size, self.dtype, device))
                    group_params, size = [], 0
                group_params.append(p)
                size += p.numel()
            self.buckets.append(Bucket(group_params, stage, rank, world_size, self.dtype, device))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}  # tensors hash by id

        # the fp32 master slice. In fp32 the parameters are the master (no copy): the slice is a
        # view of the flat buffer. In 16 bits it is a separate fp32 tensor (Micikevicius et al.
        # 2018): an update below ~2^-9 of a weight rounds away in bf16 and would be lost.
        self.master_pieces = []
        for b in self.buckets:
            piece = b.shard if stage == 3 else b.flat[b.lo:b.hi]
            self.master_pieces.append(piece if self.dtype == torch.float32 else piece.float())
        # one optimizer tensor per (parameter, owned range) piece: segments record where it lives
        decay, no_decay, self.segments = [], [], []
        for bi, b in enumerate(self.buckets):
            for p, off in zip(b.params, b.offsets):
                lo, hi = max(off, b.lo), min(off + p.numel(), b.hi)
                if lo >= hi:
                    continue  # another rank owns all of this parameter
                view = self.master_pieces[bi][lo - b.lo:hi - b.lo]
                self.segments.append((view, bi, lo - b.lo, hi - b.lo, p, lo - off))
                # decay 2-D weights (matmuls, embeddings), not biases or LayerNorm gains
                (decay if p.dim() >= 2 else no_decay).append(view)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
        # allocate Adam's moments now, exactly as AdamW would on its first step, so the
        # model-state bytes measured at start-up are the ones training holds
        for view, *_ in self.segments:
            self.opt.state[view] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(view),
                                    "exp_avg_sq": torch.zeros_like(view)}

        self.sync, self.next_bucket, self.pending = True, 0, []
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    # -- stage 3: units gathered just in time ---------------------------------------------------

    def _make_units(self, model, device):
        """One unit per transformer block, plus the root: embeddings, final LayerNorm and the
        tied head, which the forward uses first and last, so it stays gathered from the model's
        forward until the end of backward (one unit's worth of memory, and no second gather).
        A unit is a list of buckets: its trainable parameters (if any), then its frozen tensors,
        one bucket per dtype (a QLoRA base mixes uint8 codes and fp32 scales): PITFALLS 10,
        frozen weights stay out of gradients and the optimizer but not out of the gathers."""
        args = (3, self.rank, self.world_size, self.dtype, device)
        blocks = list(model.transformer.h)
        in_blocks = {id(t) for blk in blocks for t in list(blk.parameters()) + list(blk.buffers())}

        def unit(module, keep):
            trainable = [p for p in module.parameters() if p.requires_grad and keep(p)]
            frozen = frozen_tensors(module, keep)
            out = [Bucket(trainable, *args, module=module)] if trainable else []
            for dtype in dict.fromkeys(t.dtype for t in frozen):  # in order of appearance
                out.append(Bucket([t for t in frozen if t.dtype == dtype], 3, self.rank, self.world_size, dtype,
                                  device, module=module, frozen=True))
            for b in out:
                b.unit = out  # which unit a bucket belongs to (the root's stay gathered through backward)
            return out

        units = [unit(blk, lambda t: True) for blk in blocks]
        root = unit(model, lambda t: id(t) not in in_blocks)
        # gradients arrive last block first, root last (the tied embedding is the final use)
        self.buckets = [u[0] for u in units[::-1] + [root] if u and not u[0].frozen]
        self.units, self.root, self.all_units = units, root, units + [root]
        self.in_backward, self.gathered_bytes, self.peak_gathered_bytes = False, 0, 0
        model.register_forward_pre_hook(lambda m, a: self._gather(root))
        model.register_forward_hook(lambda m, a, out: None if torch.is_grad_enabled() else self._free(root))
        for i, u in enumerate(units):
            blocks[i].register_forward_pre_hook(lambda m, a, i=i: self._pre_forward(i))
            blocks[i].register_forward_hook(lambda m, a, out, i=i: self._post_forward(i, out))

    def _gather(self, unit, wait=True):
        """Launch the all-gathers of a unit's buckets that are neither present nor arriving;
        with wait, block until all of them are present."""
        for u in unit:
            if not u.gathered and u.pending is None:
                u.allocate()
                self.gathered_bytes += u.flat.numel() * u.flat.element_size()
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
                u.pending = all_gather_params(u.flat, u.shard, self.traffic, self.world_size, self.group) or "done"
        for u in unit if wait else []:
            if u.pending is not None:
                if u.pending != "done":
                    u.pending.wait()
                u.pending, u.gathered = None, True

    def _free(self, unit):
        for u in unit:
            if u.pending is not None:  # a prefetch still in flight: let it land before freeing
                self._gather([u])
            if u.gathered:
                u.free()
                self.gathered_bytes -= u.flat.numel() * u.flat.element_size()

    @contextmanager
    def gathered(self, write_back=False):
        """Stage 3: every unit's full weights present on every rank while inside (a collective:
        all ranks enter), for checkpoints. write_back: copy the frozen tensors, as changed
        inside, back into their shards (restoring a checkpoint). Other stages: nothing to do."""
        if self.stage != 3:
            yield
            return
        for u in self.all_units:
            self._gather(u)
        try:
            yield
        finally:
            for u in self.all_units:
                for b in u:
                    if write_back and b.frozen:
                        b.shard.copy_(b.flat[b.lo:b.hi])
                self._free(u)

    def _pre_forward(self, i):
        self._gather(self.units[i])
        if self.prefetch and not self.in_backward and i + 1 < len(self.units):
            self._gather(self.units[i + 1], wait=False)  # overlap the next unit's gather with compute

    def _post_forward(self, i, out):
        if self.in_backward:
            return  # activation checkpointing's recompute: backward needs the weights next
        self._free(self.units[i])
        if torch.is_grad_enabled() and out.requires_grad:
            # the gradient of the block's output arrives just before the block's backward runs
            out.register_hook(lambda grad, i=i: self._pre_backward(i))

    def _pre_backward(self, i):
        """The gradient of block i's output is complete, so block i+1's backward is done."""
        self.in_backward = True
        if i + 1 < len(self.units):
            self._free(self.units[i + 1])
        self._gather(self.units[i])
        if self.prefetch and i > 0:
            self._gather(self.units[i - 1], wait=False)

    # -- backward: bucketed, asynchronous gradient reduction ---------------------------------

    def _grad_ready(self, p):
        if not self.sync:
            return  # stages 0-1, not the last micro-step: let gradients accumulate locally
        self.bucket_of[id(p)].ready += 1
        # launch every complete bucket in index order, so all ranks issue the same sequence
        while self.next_bucket < len(self.buckets) and \
                self.buckets[self.next_bucket].ready == len(self.buckets[self.next_bucket].params):
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, b):
        N = self.world_size
        if self.stage == 0:
            # divide by N before the 16-bit sum: the sum of N gradients then stays within the
            # range of one, so an fp16 reduction cannot overflow half way (PITFALLS 4)
            if N > 1:
                b.flat_grad.div_(N)
            self.pending.append((all_reduce_grads(b.flat_grad, self.traffic, N, self.group), None))
        elif self.stage == 1:
            b.flat_grad.div_(N)
            out = torch.empty_like(b.flat_grad[b.lo:b.hi])
            work = reduce_scatter_grads(out, b.flat_grad, self.traffic, N, self.group)
            self.pending.append((work, lambda: b.flat_grad[b.lo:b.hi].copy_(out)))
        else:
            # stages 2-3: copy the bucket's gradients into a temporary flat buffer, free the
            # parameters' own .grad, reduce-scatter; only the owner's slice survives backward
            tmp = torch.zeros_like(b.flat)
            for p, off in zip(b.params, b.offsets):
                if p.grad is not None:  # None: the parameter was unused in this forward
                    tmp[off:off + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
            tmp.div_(N)
            out = torch.empty_like(b.grad_shard)
            work = reduce_scatter_grads(out, tmp, self.traffic, N, self.group)
            # with gradient accumulation, stage 2 reduces every micro-step and sums into the
            # slice: memory over traffic, since keeping full gradients until the last
            # micro-step would hold the 2Ψ bytes that stage 2 exists to shard
            self.pending.append((work, lambda: b.grad_shard.add_(out)))
            if self.stage == 3 and b.unit is not self.root:
                # its gradients are out, so its weights were used for the last time; not yet the
                # unit's frozen weights, which only feed input gradients: _pre_backward frees those
                self._free([b])

    def backward(self, loss, sync=True):
        """loss.backward() with the gradient collectives overlapped. sync=False on all but the
        last micro-step of gradient accumulation (stages 0-1 then communicate nothing)."""
        self.sync = sync or self.stage >= 2
        self.next_bucket = 0
        for b in self.buckets:
            b.ready = 0
        loss.backward()
        if not self.sync:
            return
        while self.next_bucket < len(self.buckets):  # buckets with unused parameters
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1
        for work, post in self.pending:  # always wait before reading a collective's output
            if work is not None:
                work.wait()
            if post is not None:
                post()
        self.pending = []
        if self.stage == 3:
            for u in self.all_units:  # the root, and the first block's frozen weights
                self._free(u)
            self.in_backward = False

    # -- the optimizer step on this rank's slice --------------------------------------------

    @torch.no_grad()
    def step(self, lr, scaler, grad_clip=0.0, want_zero_frac=False):
        """Unscale, check for inf/NaN (all ranks agree), clip by the global norm, step AdamW on
        the owned slice, write the new weights back and all-gather them. Returns stats."""
        N = self.world_size
        # the fp32 gradient of the owned slice, transient: it lives only during the step
        grads32 = [b.grad_piece().float() for b in self.buckets]
        for view, bi, lo, hi, _, _ in self.segments:
            view.grad = grads32[bi][lo:hi]
        stats = {}
        if want_zero_frac:  # underflow shows as exact zeros in the 16-bit gradients
            zeros = sum((v.grad == 0).sum() for v, *_ in self.segments)
            counts = torch.stack([zeros.double(), torch.tensor(float(sum(v.numel() for v, *_ in self.segments)),
                                                               dtype=torch.float64, device=zeros.device)])
            counts = all_reduce_scalar(counts, N if self.stage >= 1 else 1, self.group)
            stats["grad_zero_frac"] = (counts[0] / counts[1]).item()
        scaler.unscale_(self.opt)  # in fp32 on the master side; found-inf is all-reduced (MAX)
        stats["grad_norm"] = float("nan")
        if not scaler.found_inf:
            stats["grad_norm"] = self.clip_grad_norm_(grad_clip)
        for g in self.opt.param_groups:
            g["lr"] = lr
        scaler.step(self.opt)  # skips the update when any rank found an inf/NaN
        scaler.update()
        stats["skipped"] = bool(scaler.found_inf)
        for view, *_ in self.segments:
            view.grad = None
        if not stats["skipped"]:
            self._publish_params()
        self.zero_grad()
        return stats

    def clip_grad_norm_(self, max_norm):
        """Global L2 norm of the unscaled gradient: each rank sums the squares of the elements it
        owns (padding is in no segment), one all-reduce SUM, a square root, and every rank scales
        by the same coefficient (PITFALLS 1). Stage 0 ranks own everything: no reduce needed."""
        grads = [v.grad for v, *_ in self.segments]
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
        for g in grads:
            sq += g.pow(2).sum()
        total = all_reduce_scalar(sq, self.world_size if self.stage >= 1 else 1, self.group).sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as clip_grad_norm_ does
            for g in grads:
                g.mul_(coef)
        return total.item()

    def _publish_params(self):
        """Copy the updated fp32 master slice into the 16-bit weights; stages 1-2 all-gather so
        every rank holds the full new parameters again."""
        works = []
        for b, piece in zip(self.buckets, self.master_pieces):
            if self.stage == 3:  # only the shard is kept; the next forward gathers it
                if piece.data_ptr() != b.shard.data_ptr():
                    b.shard.copy_(piece)
            elif self.stage == 0:
                if piece.data_ptr() != b.flat.data_ptr():
                    b.flat.copy_(piece)
            else:
                # a fresh copy: the input of all-gather must not alias its output
                works.append(all_gather_params(b.flat, piece.to(self.dtype, copy=True), self.traffic,
                                               self.world_size, self.group))
        for w in works:
            if w is not None:
                w.wait()

    def zero_grad(self):
        for b in self.buckets:
            (b.flat_grad if b.flat_grad is not None else b.grad_shard).zero_()

    # -- measurement -------------------------------------------------------------------------

    def state_bytes(self):
        """Model-state bytes this rank holds, by summing the tensors actually allocated; "params"
        includes the frozen weights (LoRA's base, quantized or not): whole up to stage 2, shards under 3.
        Adam's scalar step counters (4 bytes each) are left out."""
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        master = [] if self.dtype == torch.float32 else self.master_pieces
        grads = [b.flat_grad if b.flat_grad is not None else b.grad_shard for b in self.buckets]
        moments = [s[k] for s in self.opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        if self.stage == 3:  # shards (frozen ones too), plus whatever full unit is gathered now
            every = [b for u in self.all_units for b in u]
            weights = [b.shard for b in every]
            gathered = sum(b.flat.untyped_storage().nbytes() for b in every)
        else:
            weights, gathered = [b.flat for b in self.buckets], 0
        out = {"params": nbytes(weights) + gathered + nbytes(self.frozen),
               "grads": nbytes(grads), "master": nbytes(master), "optimizer": nbytes(moments)}
        out["total"] = sum(out.values())
        return out

    # -- checkpoints: every (parameter, slice) this rank owns, by model.py's name -----------------

    def shard_state(self):
        """This rank's slices: {name: {"lo", "hi", "master", "exp_avg", "exp_avg_sq"}}, lo/hi
        indexing the flattened parameter. A topology-free layout: any world size and any stage
        can read it back (PITFALLS 13)."""
        out = {}
        for view, _, _, _, p, p_lo in self.segments:
            st = self.opt.state[view]
            out[self.names[id(p)]] = {"lo": p_lo, "hi": p_lo + view.numel(), "master": view.detach().clone(),
                                      "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
        return out

    def adam_step(self):
        return int(next(iter(self.opt.state.values()))["step"].item())

    @torch.no_grad()
    def load_shard_state(self, read, adam_step):
        """Fill this rank's slices from read(name, key, lo, hi) -> fp32 1-D tensor, then publish
        the weights to the working (16-bit) parameters on every rank."""
        for view, _, _, _, p, p_lo in self.segments:
            name, hi = self.names[id(p)], p_lo + view.numel()
            view.copy_(read(name, "master", p_lo, hi))
            st = self.opt.state[view]
            st["exp_avg"].copy_(read(name, "exp_avg", p_lo, hi))
            st["exp_avg_sq"].copy_(read(name, "exp_avg_sq", p_lo, hi))
            st["step"].fill_(adam_step)
        self._publish_params()

    @torch.no_grad()
    def full_state_dict(self, model, kind="master"):
        """Full fp32 tensors with model.py's names, gathered onto rank 0 one bucket at a time
        (under ZeRO-3 no rank ever holds more than one unit beyond its shards). kind: "master"
        (the weights: fp32 master values where they exist; frozen parameters too), "exp_avg"
        or "exp_avg_sq" (Adam's moments, trainable parameters only). None on other ranks."""
        full = {}
        for bi, b in enumerate(self.buckets):
            piece = self.master_pieces[bi].float().clone() if kind == "master" else \
                torch.zeros(b.hi - b.lo, dtype=torch.float32, device=self.master_pieces[bi].device)
            if kind != "master":
                for view, sbi, lo, hi, _, _ in self.segments:
                    if sbi == bi:
                        piece[lo:hi] = self.opt.state[view][kind]
            flat = torch.empty(b.numel, dtype=torch.float32, device=piece.device)
            if self.stage == 0:
                flat.copy_(piece)
            else:
                w = all_gather_params(flat, piece, new_traffic(), self.world_size, self.group)
                if w is not None:
                    w.wait()
            if self.rank == 0:
                for p, off in zip(b.params, b.offsets):
                    full[self.names[id(p)]] = flat[off:off + p.numel()].view(p.shape).clone()
        if kind != "master":
            return full if self.rank == 0 else None
        # model.state_dict() order and names; the tied weight appears under both of its names.
        # Frozen tensors come from the model itself: under stage 3 they too are gathered first
        names = {id(t): n for n, t in model.named_parameters()}
        other = lambda t: t.detach().float().clone() if t.is_floating_point() else t.detach().clone()
        with self.gathered():
            return None if self.rank != 0 else {name: full[names[id(t)]] if names.get(id(t)) in full else other(t)
                                                for name, t in model.state_dict(keep_vars=True).items()}


def traffic_formula(psi, stage, world_size, grad_accum=1, frozen=0):
    """Elements each rank sends per optimizer step, as the ZeRO paper counts them: 2Ψ for
    stages 0-2 (stage 2 reduce-scatters on every micro-step: (accum+1)Ψ), 3Ψ per micro-step for
    stage 3 (our root unit skips its backward gather, so we measure a little less). Stage 3
    also gathers `frozen` elements (LoRA's base) twice per micro-step, forward and backward:
    the price of not keeping the base whole on every rank."""
    if world_size == 1:
        return 0
    return {0: 2, 1: 2, 2: grad_accum + 1, 3: 3 * grad_accum}[stage] * psi + (stage == 3) * 2 * grad_accum * frozen


def zero_formula(psi, stage, world_size, dtype):
    """The ZeRO paper's model-state bytes per rank for Ψ parameters: 2+2+12 in 16 bits,
    4+4+8 in fp32 (the fp32 weights are the master: no copy)."""
    w = 4 if dtype == torch.float32 else 2  # bytes of a working weight / gradient
    k = 8 if dtype == torch.float32 else 12  # master (16-bit only) + Adam's two moments
    N = world_size
    params, grads, opt = w * psi, w * psi, k * psi
    if stage >= 1:
        opt /= N
    if stage >= 2:
        grads /= N
    if stage >= 3:
        params /= N
    return {"params": params, "grads": grads, "optimizer_side": opt, "total": params + grads + opt}
