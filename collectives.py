"""
The collectives ZeRO runs, named once: the one place that counts traffic, and the one place
that launches a collective.

Traffic is counted in elements, as the ZeRO paper counts it (Rajbhandari et al. 2019, Sec. 7),
and in bytes, which follow the dtype on the wire (--reduce-dtype for gradients). An all-reduce
of n elements moves 2n (a reduce-scatter half and an all-gather half), a reduce-scatter or an
all-gather of an n-element buffer moves n. On one rank there is nothing to move: local copies.

Every traffic collective here is launched asynchronously and returns its handle (None on one rank).
Two rules come with a handle: wait() before reading the output, and know that the backend keeps
the input and output alive until wait() (NCCL stashes them) -- so a caller that launches many
and waits late holds all of their buffers at once (zero.py bounds that: MAX_IN_FLIGHT).

Each goes through launch (the end of this file), and only there: the one point a layer from
outside replaces (machinery/hangs.py's: bounded waits, a hang that names itself, --trace's log).
"""
from dataclasses import dataclass

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
    bytes: int = 0

    @property
    def elements(self):
        return self.all_reduce + self.reduce_scatter + self.all_gather

    def count(self, kind, elements, nbytes, group=None):
        """Add one collective on `group`: `kind` is the field its elements go to."""
        setattr(self, kind, getattr(self, kind) + elements)
        self.bytes += nbytes


def all_reduce_grads(flat, traffic, world_size, group=None, label=None):
    if world_size == 1:
        return None
    traffic.count("all_reduce", 2 * flat.numel(), 2 * flat.numel() * flat.element_size(), group)
    # SUM and an explicit division elsewhere, never ReduceOp.AVG (not supported on gloo)
    return launch("all_reduce", label, flat, dist.all_reduce, flat, op=dist.ReduceOp.SUM,
                  group=group)


def reduce_scatter_grads(shard, flat, traffic, world_size, group=None, label=None):
    if world_size == 1:
        shard.copy_(flat)
        return None
    traffic.count("reduce_scatter", flat.numel(), flat.numel() * flat.element_size(), group)
    # gloo has no native reduce-scatter: it runs an all-reduce and keeps one slice, so on CPU
    # this half costs what a whole all-reduce costs. NCCL's ring does only the reduce half.
    return launch("reduce_scatter", label, flat, _reduce_scatter, shard, flat,
                  op=dist.ReduceOp.SUM, group=group)


def all_gather_params(flat, shard, traffic, world_size, group=None, label=None):
    if world_size == 1:
        flat.copy_(shard)
        return None
    traffic.count("all_gather", flat.numel(), flat.numel() * flat.element_size(), group)
    return launch("all_gather", label, flat, _all_gather, flat, shard, group=group)


# Control traffic: a few bytes (norms, flags, layouts), not counted as model traffic, and
# waited for at once -- but launched as the rest are.

def all_reduce_sum(x, world_size, group=None, label=None):
    if world_size > 1:
        launch("all_reduce", label, x, dist.all_reduce, x, op=dist.ReduceOp.SUM,
               group=group).wait()
    return x


def all_reduce_max(x, world_size, group=None, label=None):
    if world_size > 1:
        launch("all_reduce", label, x, dist.all_reduce, x, op=dist.ReduceOp.MAX,
               group=group).wait()
    return x


def all_gather_list(out, x, world_size, group=None, label=None):
    """Every rank's x into the list `out` of world_size tensors like it, in rank order."""
    if world_size > 1:
        launch("all_gather", label, x, dist.all_gather, out, x, group=group).wait()
    return out


def all_gather_object(obj, world_size, label=None):
    """Every rank's picklable obj, in rank order (metadata: layouts, ids, errors; not traffic)."""
    out = [obj] * world_size
    if world_size > 1:
        launch("all_gather_object", label, None, _at_once(dist.all_gather_object), out, obj).wait()
    return out


def _at_once(collective):
    """A collective torch has no async form of, launched as one: it runs in the launch, and its
    handle's wait() has nothing left to wait for."""
    def run(*args, async_op):
        collective(*args)
        return _Done()
    return run


class _Done:
    def wait(self, *_):  # as a work handle's wait(), which may be given a bound
        return True


def broadcast(x, src, world_size, group=None, label=None):
    """Rank src's x (src: a rank of `group`) into every rank's x, in place."""
    if world_size > 1:
        root = src if group is None else dist.get_global_rank(group, src)
        launch("broadcast", label, x, dist.broadcast, x, root, group=group).wait()
    return x


def barrier(world_size, label=None):
    if world_size > 1:
        launch("barrier", label, None, dist.barrier).wait()


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
        _gather_groups[key] = dist.new_group(ranks, backend=backend)
    return _gather_groups[key]


# ----------------------------------------------------------------------------------------------
# The launch point. Every collective above is launched here and nowhere else, so a layer from
# outside replaces this one function (collectives.launch = its own) and sees them all: name,
# the collective's; label, what it moves (ZeRO-2's "bucket 3", ZeRO-3's "block 1", "norm");
# tensor, its buffer (None: no data). The lesson's launch is torch's, asynchronous.

def launch(name, label, tensor, collective, *args, **kwargs):
    """collective(*args, **kwargs) launched asynchronously: its work handle (wait() it)."""
    return collective(*args, async_op=True, **kwargs)
