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

Every traffic collective here is launched asynchronously and returns its handle (None on one rank).
Two rules come with a handle: wait() before reading the output, and know that the backend keeps
the input and output alive until wait() (NCCL stashes them) -- so a caller that launches many
and waits late holds all of their buffers at once (zero.py bounds that: MAX_IN_FLIGHT).

A hang names itself (the end of this file): every collective here counts one on its rank and
carries its label (a bucket, a block, "norm"); one that times out tells, on each rank that
waits in it, which ranks never arrived, in one line.
"""
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

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


def all_reduce_grads(flat, traffic, world_size, group=None, label=None):
    if world_size == 1:
        return None
    traffic.count("all_reduce", 2 * flat.numel(), 2 * flat.numel() * flat.element_size(), group)
    # SUM and an explicit division elsewhere, never ReduceOp.AVG (not supported on gloo)
    return issue("all_reduce", label, flat, dist.all_reduce, flat, op=dist.ReduceOp.SUM,
                 group=group)


def reduce_scatter_grads(shard, flat, traffic, world_size, group=None, label=None):
    if world_size == 1:
        shard.copy_(flat)
        return None
    traffic.count("reduce_scatter", flat.numel(), flat.numel() * flat.element_size(), group)
    # gloo has no native reduce-scatter: it runs an all-reduce and keeps one slice, so on CPU
    # this half costs what a whole all-reduce costs. NCCL's ring does only the reduce half.
    return issue("reduce_scatter", label, flat, _reduce_scatter, shard, flat,
                 op=dist.ReduceOp.SUM, group=group)


def all_gather_params(flat, shard, traffic, world_size, group=None, label=None):
    if world_size == 1:
        flat.copy_(shard)
        return None
    traffic.count("all_gather", flat.numel(), flat.numel() * flat.element_size(), group)
    return issue("all_gather", label, flat, _all_gather, flat, shard, group=group)


def all_to_all(out, inp, traffic, group_size, group=None, label=None):
    """Chunk i of inp (inp.numel() / group_size elements) goes to the group's i-th rank, which
    puts it at chunk [this rank] of its out. gloo runs it on CPU tensors of any dtype (int8
    and uint8 codes included, checked on torch 2.13)."""
    if group_size == 1:
        out.copy_(inp)
        return None
    traffic.count("all_to_all", inp.numel(), inp.numel() * inp.element_size(), group)
    return issue("all_to_all", label, inp, dist.all_to_all_single, out, inp, group=group)


# Control traffic: a few bytes (norms, flags, layouts), not counted as model traffic, and
# waited for at once -- but counted in `position` and named on a timeout like the rest.

def all_reduce_sum(x, world_size, group=None, label=None):
    if world_size > 1:
        issue("all_reduce", label, x, dist.all_reduce, x, op=dist.ReduceOp.SUM,
              group=group).wait()
    return x


def all_reduce_max(x, world_size, group=None, label=None):
    if world_size > 1:
        issue("all_reduce", label, x, dist.all_reduce, x, op=dist.ReduceOp.MAX,
              group=group).wait()
    return x


def all_gather_list(out, x, world_size, group=None, label=None):
    """Every rank's x into the list `out` of world_size tensors like it, in rank order."""
    if world_size > 1:
        issue("all_gather", label, x, dist.all_gather, out, x, group=group).wait()
    return out


def all_gather_object(obj, world_size, label=None):
    """Every rank's picklable obj, in rank order (metadata: layouts, ids, errors; not traffic)."""
    out = [obj] * world_size
    if world_size > 1:  # no async form: run in place, a failure named as the others are
        handle = Handle("all_gather_object", label)
        try:
            dist.all_gather_object(out, obj)
        except RuntimeError as e:
            if lost(e):
                raise stalled(handle, e) from e
            raise
    return out


def broadcast(x, src, world_size, group=None, label=None):
    """Rank src's x (src: a rank of `group`) into every rank's x, in place."""
    if world_size > 1:
        root = src if group is None else dist.get_global_rank(group, src)
        issue("broadcast", label, x, dist.broadcast, x, root, group=group).wait()
    return x


def barrier(world_size, label=None):
    if world_size > 1:
        issue("barrier", label, None, dist.barrier).wait()


# ----------------------------------------------------------------------------------------------
# The process group, every collective on it bounded in time. A rank that never joins a
# collective (a data-dependent branch, a skipped module, a crash) leaves the others waiting in
# it: by torch's default 30 minutes on gloo, then a traceback per rank from deep in the
# backend. Here every group gets --collective-timeout, and a timeout is explained (below).
#
# Not from the start, though. A collective waits for the slowest rank's *skew*, and the first
# step is where ranks drift apart: inductor compiles for minutes (--compile), NCCL opens its
# connections, cuDNN and the allocator warm up, rank 0 prepares the data. So the groups are
# made with at least START_S, and warmed_up() tightens every one of them to --collective-timeout
# once the first step is behind, after a barrier under the old value: a rank still finishing
# its first step must not meet a peer that already waits the short one (torchtitan's init and
# train timeouts, torchtitan#149).

timeout_s = None  # seconds a collective may wait for the slowest rank now (None: torch's default)
START_S = 1800.0  # ... before the first step is behind, at least: torch's own default on gloo
_steady = None  # --collective-timeout: timeout_s once warmed_up() has run
_groups = []  # the groups made here that this rank is in (the default group aside)

# NCCL runs collectives on the GPU: wait() only orders streams, so no Python-level wait ever
# times out there. The watchdog thread does: past the timeout it tears the process down
# (TORCH_NCCL_ASYNC_ERROR_HANDLING's default). Its Flight Recorder keeps each rank's last
# collectives in a ring buffer and dumps them on a timeout, a file per rank, from which
# `torchfrtrace` names the ranks that never joined (docs/debugging.md). Later torch reads
# TORCH_FR_* first and the older names after: each setting is set under both, unless the user
# set either.
FLIGHT_RECORDER = (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "2000"),
                   ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                   ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", None))


def init_process_group(backend, seconds, device=None, dump_prefix="/tmp/nccl_trace_rank_"):
    """The default group, from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR): each
    collective on it, and on the groups made here, may wait `seconds` for the slowest rank once
    warmed_up() has run, max(seconds, START_S) before. On NCCL the Flight Recorder is on too,
    its dumps named dump_prefix + rank."""
    global timeout_s, _steady
    if backend == "nccl":
        for old, new, value in FLIGHT_RECORDER:
            if old not in os.environ and new not in os.environ:
                os.environ[old] = os.environ[new] = value or dump_prefix
    timeout_s, _steady, _groups[:] = max(seconds, START_S), seconds, []
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device)


def new_group(ranks, backend=None):
    """dist.new_group with this run's timeout, tightened by warmed_up() too. Every rank calls it
    for every group, in the same order; a rank outside `ranks` gets a non-member."""
    group = dist.new_group(ranks=ranks, backend=backend, timeout=_timedelta())
    if ranks is None or dist.get_rank() in ranks:
        _groups.append(group)
    return group


def warmed_up(world_size):
    """The first step is behind: from here every group waits --collective-timeout. A barrier
    first, under the allowance. Every rank calls it at the same point; a no-op the second time."""
    global timeout_s
    if world_size == 1 or _steady is None or timeout_s == _steady:
        return
    barrier(world_size, label="the first step")
    timeout_s = _steady
    # torch 2.3-2.13's private name; later torch makes it public as set_timeout
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    for group in [None] + _groups:
        set_timeout(_timedelta(), group)


def _timedelta():
    return None if timeout_s is None else timedelta(seconds=timeout_s)


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
        _gather_groups[key] = new_group(ranks, backend)
    return _gather_groups[key]


# ----------------------------------------------------------------------------------------------
# Where a collective was issued, always on: every collective above counts one in
# `position.seq`, and its handle keeps the seq, the op, the caller's label (ZeRO-2's "bucket 3",
# ZeRO-3's "block 1" or "root", "norm") and the step and micro-step the training loop's forward
# set (machinery/lifecycle.watch). That is an int increment and a small object per collective:
# no clock read, no host sync, no store. Every rank issues the same collectives in the same
# order, so equal seqs on two ranks are the same collective.

@dataclass
class Position:
    step: int = -1  # the training step (-1: before the first forward)
    micro: int = -1  # its micro-step (-1: in none: evaluation, set-up)
    seq: int = 0  # collectives this rank has issued so far


position = Position()


class Handle:
    """A collective's work handle and where it was issued. wait() as the backend's; a wait that
    lost a peer raises CollectiveTimeout, its one line. While tracing, `event` is its entry in
    the collective log, whose wait times it notes (the first wait; later ones return)."""
    __slots__ = ("op", "label", "step", "micro", "seq", "work", "event")

    def __init__(self, op, label):
        self.op, self.label, self.work, self.event = op, label, None, None
        self.step, self.micro, self.seq = position.step, position.micro, position.seq
        position.seq += 1

    def wait(self, *args, **kwargs):
        first = self.event is not None and self.event["wait"] is None
        if first:
            self.event["wait"] = time.perf_counter()
        try:
            out = self.work.wait(*args, **kwargs)
        except RuntimeError as e:
            if lost(e):
                raise stalled(self, e) from e
            raise
        if first:
            self.event["done"] = time.perf_counter()
        return out

    def __getattr__(self, name):  # is_completed(), get_future(): the backend's own
        return getattr(self.work, name)


def issue(name, label, tensor, collective, *args, **kwargs):
    """collective(*args, **kwargs), launched asynchronously; its Handle, called `name`."""
    handle = Handle(name, label)
    try:
        handle.work = collective(*args, async_op=True, **kwargs)
    except RuntimeError as e:  # a peer lost earlier (gloo: a closed pair) fails at launch
        if lost(e):
            raise stalled(handle, e) from e
        raise
    if recorder is not None:
        handle.event = recorder.launched(handle, tensor)
    return handle


# ----------------------------------------------------------------------------------------------
# The collective log (train.py --trace; machinery/timeline.py writes and reads it). Off, the
# recorder is None and a collective pays one test of it: nothing recorded, no clock read. On,
# every collective above is one event -- its op, label, seq, bytes, step and micro-step, and
# three host clock times: launched, wait() entered, wait() returned. The time inside wait() is
# communication the compute did not hide (exposed); launched to returned bounds the collective
# itself. Marks (a block's forward or backward ending) put compute beside it.

recorder = None  # a Recorder while tracing


class Recorder:
    def __init__(self):
        self.events, self.handles = [], []

    def mark(self, what, **info):
        self.events.append(dict(kind="mark", what=what, step=position.step,
                                micro=position.micro, t=time.perf_counter(), **info))

    def launched(self, handle, tensor):
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        event = dict(kind="collective", op=handle.op, label=handle.label, step=handle.step,
                     micro=handle.micro, seq=handle.seq,
                     numel=0 if tensor is None else tensor.numel(), bytes=nbytes,
                     launch=time.perf_counter(), wait=None, done=None)
        self.events.append(event)
        self.handles.append(handle)
        return event

    def land(self):
        """Wait for every collective launched while recording: the backend's work, the log left
        as it is (a stage 1-2 publish launched at a step's end is waited for in the next
        forward). torch.profiler stopped while a gloo collective of its window is still in
        flight crashes the process when that collective completes (SIGSEGV; torch 2.13, about
        1 run in 4 of --trace at ZeRO-2): machinery/timeline.py lands them before it stops."""
        for handle in self.handles:
            handle.work.wait()


# ----------------------------------------------------------------------------------------------
# A hang names itself. A collective completes only once every rank has joined it, so when one
# times out, the ranks that never arrived are exactly those not waiting in it. A wait that
# fails (gloo: its own timeout, or a peer's, which closes the connections) raises
# CollectiveTimeout with where this rank waits. machinery/lifecycle.name_hang then has each
# failed rank publish that -- its seq above all -- to the process group's own key-value store
# (c10d's, which every rank reached at start-up) and read the others' for a grace period:
#   - the same seq: waiting in this collective too
#   - another seq: waiting in another collective (it skipped one, or took another branch)
#   - no answer: in no collective (busy, stuck, or gone)
# and print one line. Nothing of it runs before a timeout: the hot path keeps only the counter.

class CollectiveTimeout(RuntimeError):
    """A collective that lost a peer: `where` this rank waited (a dict: op, label, step, micro,
    seq) and the backend's error. where None: a collective called on torch.distributed directly,
    placed after the last of ours."""

    def __init__(self, where, error):
        if where is None:
            where = dict(op=None, label=None, step=position.step, micro=position.micro,
                         seq=position.seq)
        first = (str(error).strip() or type(error).__name__).splitlines()[0]
        # gloo: "Timed out waiting 2000ms for recv", or "Application timeout caused pair
        # closure" when another of this rank's collectives timed out first
        self.where = where
        self.timed_out = "timed out" in first.lower() or "timeout" in first.lower()
        # gloo prefixes a source path and may add a sentence of advice: the first sentence
        said = first.split("] ")[-1].split(". ")[0][:80]
        self.why = (f"timed out after {timeout_s:g} s" if self.timed_out and timeout_s else
                    f"failed ({said})")
        super().__init__(f"{describe(where)} {self.why}")


def stalled(handle, error):
    return CollectiveTimeout(dict(op=handle.op, label=handle.label, step=handle.step,
                                  micro=handle.micro, seq=handle.seq), error)


# what a collective that lost a peer raises: gloo's "Timed out waiting 3000ms for recv ...",
# "Connection closed by peer", "Application timeout caused pair closure"; NCCL's "Watchdog
# caught collective operation timeout" (with TORCH_NCCL_BLOCKING_WAIT=1)
LOST = ("timed out", "timeout", "closed", "connection reset")


def lost(error):
    text = str(error).lower()
    return any(s in text for s in LOST)


def describe(where):
    """'reduce_scatter of bucket 1 at step 5, micro-step 0 (collective #38)'."""
    what = where["op"] or "a torch.distributed collective"
    what += f" of {where['label']}" if where["label"] else ""
    when = "before training" if where["step"] < 0 else f"at step {where['step']}"
    when += f", micro-step {where['micro']}" if where["step"] >= 0 and where["micro"] >= 0 else ""
    return f"{what} {when} (collective #{where['seq']})"
