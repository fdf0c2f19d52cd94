"""
ZeRO stage 3: shard the parameters too (PyTorch calls it FSDP). Model state per rank: 16Ψ/N.

Rajbhandari et al. 2019, "ZeRO", Sec. 5.3 (P_os+g+p): every rank keeps only 1/N of every
weight, and a block's full weights exist only while that block computes. The model is cut
into units, one per transformer block plus the root (embeddings, final LayerNorm and the tied
LM head), and the life of a unit's weights in one training step is, as the code marks it:

  (1) shard      at construction each rank keeps its 1/N slice of the unit's flat buffer,
                 `shard`, and the full buffer's storage is freed (resized to 0 bytes)
  (2) gather     just before the block's forward, all-gather the shards into that storage
  (3) prefetch   ... and launch the next block's all-gather, to overlap this block's compute
                 (block 0's starts in the model's pre-forward, behind the embeddings)
  (4) free       right after the block's forward
  (5) re-gather  for backward: when the gradients of the block's outputs arrive, the block's
                 backward is next: gather it again (and prefetch the block before it). The
                 last block's re-gather starts at the end of the forward, behind the loss head
  (6) reduce-scatter, free: once the unit's gradients are complete, reduce-scatter them, as
                 stage 2 does (zero.py), and free the full weights
  (7) step       the optimizer updates the fp32 master of the shard; publish copies it into
                 `shard`

The root unit is used first (embeddings) and last (the tied head): it stays gathered from the
model's forward to the end of backward, one unit's worth of memory for one gather less. Its
weights change only at the step, so under gradient accumulation it stays gathered across the
micro-steps too (backward(loss, sync=False), as DDP's no_sync) and is freed after the last:
gathered once a step, not once a micro-step, and never waited for again within the step. Its
memory (GPT-2: wte + wpe + ln_f, 79 MB in bf16) is then held between micro-steps as well,
when no block is gathered; the peak, a block's forward or backward with the root gathered,
is the same. Traffic: 3Ψ per micro-step (a gather in forward, one in backward, a
reduce-scatter), 1.5x stages 0-2, less the root's: its reduce-scatter each micro-step and
one gather a step. Frozen tensors (a LoRA base, quantized or not) are sharded the same way in frozen
buckets, one per dtype (uint8 codes and fp32 scales cannot share a flat buffer): gathered
with their block, never reduced or updated, 2 x their size in traffic per step.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from collectives import all_gather_params
from zero import Bucket, ZeRO, declared_blocks, frozen_tensors


class ShardedBucket(Bucket):
    """A bucket whose full flat buffer exists only while it is gathered; `shard`, this rank's
    slice, is the only copy kept. frozen: no gradient, no optimizer state."""

    def __init__(self, tensors, rank, world_size, dtype, device, frozen=False):
        super().__init__(tensors, rank, world_size, dtype, device, pad=True)
        self.frozen = frozen
        self.shard = self.flat[self.lo:self.hi].clone()  # (1) shard
        self.gathered, self.arriving = True, None  # arriving: an all-gather in flight
        self.free()

    def free(self):
        """Release the full weights but keep the tensor objects: resizing the storage to 0 frees
        the memory, and every view of it (the parameters, and the weights autograd or activation
        checkpointing saved for backward) sees the data again once it is gathered back into the
        same storage. Swapping .data instead would leave saved views on the old tensor, and
        checkpointing's recompute would fail with "recomputed shape [0] vs saved [1024]"."""
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

    def allocate(self):
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())


class BeforeBackward(torch.autograd.Function):
    """The identity on the tensors a block returns, as one autograd node: autograd runs it once
    the gradients of all of them that this backward reaches are in, and before any node inside
    the block, which only these tensors lead to. Its backward calls hook() first: (5)'s moment.
    A hook on one output would not do: a loss over a block's router logits (a Mixture of
    Experts' balance loss) sends theirs before the next block's backward is done."""

    @staticmethod
    def forward(ctx, hook, *tensors):
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def before_backward(out, hook):
    """out (a tensor, or a tuple, list or dict of them) with hook() run just before its producer's
    backward (BeforeBackward), if any of its tensors requires a gradient."""
    leaves, spec = tree_flatten(out)
    trained = [k for k, t in enumerate(leaves) if torch.is_tensor(t) and t.requires_grad]
    if not trained or not torch.is_grad_enabled():
        return out
    passed = BeforeBackward.apply(hook, *[leaves[k] for k in trained])
    for k, t in zip(trained, passed):
        leaves[k] = t
    return tree_unflatten(leaves, spec)


@dataclass
class Unit:
    """What is gathered and freed together: a block's (or the root's) buckets, the trainable
    one first, then one frozen bucket per dtype."""
    buckets: list
    root: bool = False


class ZeRO3(ZeRO):
    """ZeRO stage 3: the stage 0-2 engine of zero.py, with parameters sharded by units."""
    STAGES = (3,)

    def __init__(self, model, stage=3, prefetch=True, **kwargs):
        self.prefetch, self.in_backward, self.keep_root = prefetch, False, False
        super().__init__(model, stage, **kwargs)
        self.frozen = []  # now in the units' frozen buckets, sharded like everything else

    def _make_buckets(self, model, params):
        """(1) shard: one unit per block, then the root. Returns the trainable buckets in the
        order their gradients complete: last block first, the root (the tied embedding's
        gradient comes last) at the end."""
        blocks = declared_blocks(model)  # the model declares them (model.py)
        assert blocks is not None, "ZeRO-3 gathers a block at a time: the model needs blocks()"
        in_blocks = {id(t) for blk in blocks for t in list(blk.parameters()) + list(blk.buffers())}
        self.units = [self._make_unit(blk, lambda t: True) for blk in blocks]
        self.root = self._make_unit(model, lambda t: id(t) not in in_blocks, root=True)
        self.all_units = self.units + [self.root]
        for i, unit in enumerate(self.all_units):  # a name for its collectives (a log, an error)
            for b in unit.buckets:
                b.label = ("root" if unit.root else f"block {i}") + (" frozen" if b.frozen else "")
        model.register_forward_pre_hook(self._pre_model_forward)
        model.register_forward_hook(self._post_model_forward)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: self._pre_forward(i))
            block.register_forward_hook(lambda m, args, out, i=i: self._post_forward(i, out))
        return [u.buckets[0] for u in self.units[::-1] + [self.root]
                if u.buckets and not u.buckets[0].frozen]

    def _make_unit(self, module, keep, root=False):
        trainable = [p for p in module.parameters() if p.requires_grad and keep(p)]
        frozen = frozen_tensors(module, keep)
        buckets = []
        if trainable:
            kind = self.unit_bucket_kind(trainable)
            b = kind(trainable, self.rank, self.world_size, self.dtype, self.device)
            b.grad_shard = torch.zeros(b.hi - b.lo, dtype=self.grad_dtype, device=self.device)
            buckets.append(b)
        for dtype in dict.fromkeys(t.dtype for t in frozen):  # in order of appearance
            same = [t for t in frozen if t.dtype == dtype]
            b = ShardedBucket(same, self.rank, self.world_size, dtype, self.device, frozen=True)
            b.make_segments(self.names, master=None)  # for checkpoints: what this rank owns
            buckets.append(b)
        unit = Unit(buckets, root)
        for b in buckets:
            b.unit = unit
        return unit

    def unit_bucket_kind(self, trainable):
        """The bucket class of a unit's trainable tensors: cut flat into N equal slices here;
        beyond/muon.py's WholeZeRO3 deals them whole into the slices instead."""
        return ShardedBucket

    def _owned_weights(self, b):
        return b.shard

    # -- gather and free ---------------------------------------------------------------------

    def _gather(self, unit, wait=True):
        """(2) gather: launch the all-gathers of the unit's buckets that are neither present nor
        arriving; with wait, block until all of them are present."""
        for b in unit.buckets:
            if not b.gathered and b.arriving is None:
                b.allocate()
                self.gathered_bytes += b.flat.numel() * b.flat.element_size()
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
                b.arriving = self._launch_gather(b)
                b.gathered = b.arriving is None  # one rank: a local copy, already there
        if wait:
            for b in unit.buckets:
                if b.arriving is not None:
                    b.arriving.wait()
                    b.arriving, b.gathered = None, True

    def _launch_gather(self, b):
        """(2) and (5): the all-gather of b's shards into its full buffer (zeropp.py changes
        where it comes from and in what codes). Returns its work handle, None when done."""
        return all_gather_params(b.flat, b.shard, self.traffic, self.world_size,
                                 self.gather_group, label=b.label)

    def _free(self, buckets):
        for b in buckets:
            if b.arriving is not None:  # a prefetch still in flight: let it land first
                b.arriving.wait()
                b.arriving, b.gathered = None, True
            if b.gathered:
                b.free()
                self.gathered_bytes -= b.flat.numel() * b.flat.element_size()

    # -- the lifecycle, driven by module hooks -------------------------------------------------

    def _pre_model_forward(self, model, args):
        self._gather(self.root)  # (2) the root: embeddings first, the tied head last
        if self.prefetch and self.units:
            self._gather(self.units[0], wait=False)  # (3) the first block, behind the embeddings

    def _post_model_forward(self, model, args, out):
        if not torch.is_grad_enabled():
            self._free(self.root.buckets)  # evaluation: no backward will need it
        elif self.prefetch and self.units and not self.in_backward:
            # (5) the last block's backward comes right after the loss head's: its re-gather
            # can start now and overlap the head's backward
            self._gather(self.units[-1], wait=False)

    def _pre_forward(self, i):
        self._gather(self.units[i])  # (2) gather
        if self.prefetch and not self.in_backward and i + 1 < len(self.units):
            self._gather(self.units[i + 1], wait=False)  # (3) prefetch

    def _post_forward(self, i, out):
        """(4) free, and (5)'s hook on what the block returns: a tensor, or a tuple or dict of
        them ((hidden, router_logits)). Returns the outputs the model then reads."""
        if self.in_backward:
            return None  # activation checkpointing's recompute: backward needs the weights next
        self._free(self.units[i].buckets)  # (4) free
        return before_backward(out, lambda i=i: self._pre_backward(i))

    def _pre_backward(self, i):
        """(5) re-gather. The gradients of block i's outputs are complete, so block i+1's backward
        is done: free all of it, including the frozen weights, which only feed input gradients
        and so may be read after the block's own weight gradients are out."""
        self.in_backward = True
        if i + 1 < len(self.units):
            self._free(self.units[i + 1].buckets)
        self._gather(self.units[i])
        if self.prefetch and i > 0:
            self._gather(self.units[i - 1], wait=False)

    def _reduce(self, b):
        super()._reduce(b)  # (6) reduce-scatter, exactly as stage 2
        if not b.unit.root:
            self._free([b])  # (6) ...and free: its gradients are out, the weights' last use

    @contextmanager
    def no_sync(self):
        """Every micro-step but the last (backward(loss, sync=False)): the root stays gathered
        for the next micro-step's forward, as its weights change only at the step."""
        self.keep_root = True
        try:
            with super().no_sync():
                yield
        finally:
            self.keep_root = False

    def finish_backward(self):
        super().finish_backward()
        for unit in self.all_units:  # the root (after the step's last micro-step), and the
            if not (unit.root and self.keep_root):  # first block's frozen weights
                self._free(unit.buckets)
        self.in_backward = False

    @torch.no_grad()
    def publish(self, wait=True):
        """(7) step: the updated fp32 master -> the shard; the next forward gathers it."""
        self._free(self.root.buckets)  # a root kept by a loop stopped mid-step, too
        for b, master in zip(self.buckets, self.master):
            if master.data_ptr() != b.shard.data_ptr():  # in fp32 the shard is the master
                b.shard.copy_(master)

    # -- for checkpoints and measurement -------------------------------------------------------

    def frozen_pieces(self):
        """(name, lo, hi, values) of this rank's pieces of every frozen tensor: its shards."""
        return [(s.name, s.lo, s.hi, b.shard[s.start:s.start + s.hi - s.lo])
                for u in self.all_units for b in u.buckets if b.frozen for s in b.segments]

    def weight_bytes(self):
        """The shards (frozen ones too), plus whatever full unit is gathered right now."""
        every = [b for u in self.all_units for b in u.buckets]
        shards = sum(b.shard.numel() * b.shard.element_size() for b in every)
        return shards + sum(b.flat.untyped_storage().nbytes() for b in every)
