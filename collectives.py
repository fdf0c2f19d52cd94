"""
The collectives ZeRO runs, named once: the one place that counts traffic, and the one place that
makes a process group.

Traffic is counted in elements, as the ZeRO paper counts it (Rajbhandari et al. 2019, Sec. 7),
and in bytes, which follow the dtype on the wire (--reduce-dtype for gradients). An all-reduce
of n elements moves 2n (a reduce-scatter half and an all-gather half), a reduce-scatter or an
all-gather of an n-element buffer moves n, an all-to-all its n-element input. On one rank
there is nothing to move: local copies.

Bytes are split by link: a collective on a group whose ranks all sit in one node (node_size
consecutive ranks) counts as intra-node, any other as inter-node. node_size 0: one node.

Every collective here is launched asynchronously and returns its work handle (None on one rank).
Two rules come with a handle: wait() before reading the output, and know that the backend keeps
the input and output alive until wait() (NCCL stashes them) -- so a caller that launches many
and waits late holds all of their buffers at once (zero.py bounds that: MAX_IN_FLIGHT).
"""
import time
from dataclasses import dataclass, field

import torch.distributed as dist

# torch 2.13 renamed the tensor-in / tensor-out collectives; use the new names where they exist
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Traffic:
    """Elements (and bytes) this rank's collectives moved since the counter was made."""
    all_reduce: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0
    all_to_all: int = 0  # ZeRO++'s quantized gradients (zeropp.py)
    bytes: int = 0
    bytes_intra: int = 0  # of `bytes`, on groups inside one node
    bytes_inter: int = 0  # ... and on groups that span nodes
    node_size: int = 0  # ranks per node (0: every rank in one node)
    by: dict = field(default_factory=dict)  # "all_gather/inter" -> bytes, and so on
    # copies between the device and the host (beyond/offload_optimizer.py): no collective,
    # not in `bytes`, but the same step's cost, counted beside it
    d2h: int = 0  # bytes device -> host: the gradient slice
    h2d: int = 0  # bytes host -> device: the updated 16-bit weight slice

    @property
    def elements(self):
        return self.all_reduce + self.reduce_scatter + self.all_gather + self.all_to_all

    def count(self, kind, elements, nbytes, group=None):
        """Add one collective: `kind` is the field its elements go to."""
        setattr(self, kind, getattr(self, kind) + elements)
        self.bytes += nbytes
        intra = self.node_size == 0 or len({r // self.node_size for r in _ranks(group)}) == 1
        link = "intra" if intra else "inter"
        setattr(self, "bytes_" + link, getattr(self, "bytes_" + link) + nbytes)
        key = f"{kind}/{link}"
        self.by[key] = self.by.get(key, 0) + nbytes


_group_ranks = {}  # group -> its global ranks, asked once


def _ranks(group):
    group = dist.group.WORLD if group is None else group  # a re-init: a new default group
    if group not in _group_ranks:
        _group_ranks[group] = dist.get_process_group_ranks(group)
    return _group_ranks[group]


def all_reduce_grads(flat, traffic, world_size, group=None):
    if world_size == 1:
        return None
    traffic.count("all_reduce", 2 * flat.numel(), 2 * flat.numel() * flat.element_size(), group)
    # SUM and an explicit division elsewhere, never ReduceOp.AVG (not supported on gloo)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work if recorder is None else recorder.launched("all_reduce", flat, work)


def reduce_scatter_grads(shard, flat, traffic, world_size, group=None):
    if world_size == 1:
        shard.copy_(flat)
        return None
    traffic.count("reduce_scatter", flat.numel(), flat.numel() * flat.element_size(), group)
    # gloo has no native reduce-scatter: it runs an all-reduce and keeps one slice, so on CPU
    # this half costs what a whole all-reduce costs. NCCL's ring does only the reduce half.
    work = _reduce_scatter(shard, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work if recorder is None else recorder.launched("reduce_scatter", flat, work)


def all_gather_params(flat, shard, traffic, world_size, group=None):
    if world_size == 1:
        flat.copy_(shard)
        return None
    traffic.count("all_gather", flat.numel(), flat.numel() * flat.element_size(), group)
    work = _all_gather(flat, shard, group=group, async_op=True)
    return work if recorder is None else recorder.launched("all_gather", flat, work)


def all_gather_object(obj, world_size):
    """Every rank's picklable obj, in rank order (metadata: layouts, ids, errors; not traffic)."""
    out = [obj] * world_size
    if world_size > 1:
        dist.all_gather_object(out, obj)
    return out


def all_to_all(out, inp, traffic, group_size, group=None):
    """Chunk i of inp (inp.numel() / group_size elements) goes to the group's i-th rank, which
    puts it at chunk [this rank] of its out. gloo runs it on CPU tensors of any dtype (int8
    and uint8 codes included, checked on torch 2.13)."""
    if group_size == 1:
        out.copy_(inp)
        return None
    traffic.count("all_to_all", inp.numel(), inp.numel() * inp.element_size(), group)
    work = dist.all_to_all_single(out, inp, group=group, async_op=True)
    return work if recorder is None else recorder.launched("all_to_all", inp, work)


def all_reduce_sum(x, world_size, group=None):
    """A few bytes of control traffic (norms, counts), not counted as model traffic."""
    if world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


# ----------------------------------------------------------------------------------------------
# The gather group. NCCL runs one process group's collectives in order, on one stream of its own.
# With a second group an all-gather (ZeRO-3's prefetch, stage 1-2's publish) need not queue
# behind the reduce-scatters of backward (FSDP2 uses two streams alike). A group is a
# communicator that holds GPU memory and takes about a second to make: one per process, made
# the first time an engine needs it and shared by every engine after that.

_gather_groups = {}  # (the parent group, the default group) -> its gather group


def separate_gather_stream(device):
    """gloo runs every collective on the host; only NCCL gains from a stream of its own."""
    return device.type == "cuda"


def gather_group(group, device, world_size):
    """The group to all-gather on: `group` itself on one rank or on gloo, else a second group
    over the same ranks, made once per process. Every rank must call this at the same point."""
    if world_size == 1 or not separate_gather_stream(device):
        return group
    key = (group, dist.group.WORLD)  # a new default group (a re-init) gets a new gather group
    if key not in _gather_groups:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        backend = "nccl" if device.type == "cuda" else dist.get_backend(group)
        _gather_groups[key] = dist.new_group(ranks=ranks, backend=backend)
    return _gather_groups[key]


# ----------------------------------------------------------------------------------------------
# The collective log (train.py --trace; machinery/timeline.py writes and reads it). Off, the
# recorder is None and a collective pays one test of it: nothing recorded, no clock read, no
# host sync. On, every collective above is one event -- its op, bytes, the step and micro-step
# the caller set, and three host clock times: launched, wait() entered, wait() returned. The
# time inside wait() is communication the compute did not hide (exposed); launched to returned
# bounds the collective itself. Marks (a block's forward or backward ending) put compute
# beside it.

recorder = None  # a Recorder while tracing


class Recorder:
    def __init__(self):
        self.events, self.step, self.micro, self.seq = [], 0, 0, 0

    def mark(self, what, **info):
        self.events.append(dict(kind="mark", what=what, step=self.step, micro=self.micro,
                                t=time.perf_counter(), **info))

    def launched(self, op, tensor, work):
        event = dict(kind="collective", op=op, step=self.step, micro=self.micro, seq=self.seq,
                     numel=tensor.numel(), bytes=tensor.numel() * tensor.element_size(),
                     launch=time.perf_counter(), wait=None, done=None)
        self.seq += 1
        self.events.append(event)
        return work if work is None else Logged(work, event)


class Logged:
    """A work handle that notes when it was waited for (the first wait; later ones return)."""

    def __init__(self, work, event):
        self.work, self.event = work, event

    def wait(self, *args, **kwargs):
        first = self.event["wait"] is None
        if first:
            self.event["wait"] = time.perf_counter()
        out = self.work.wait(*args, **kwargs)
        if first:
            self.event["done"] = time.perf_counter()
        return out

    def __getattr__(self, name):  # is_completed(), get_future(): the backend's own
        return getattr(self.work, name)
