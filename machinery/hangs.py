"""
No collective waits forever, and a hang names itself: a layer over collectives.launch.

A rank that never joins a collective (a data-dependent branch, a skipped module, a crash, a
rank stuck in its data loader) leaves the others waiting in it: by torch's default 30 minutes
on gloo, then a traceback per rank from deep in the backend. install() puts this module's
launch over collectives.launch, the one point every collective of the lesson passes through:

  1. every group a collective runs on waits --collective-timeout for the slowest rank, after
     a start-up allowance (START_S) while the first step compiles and warms up (warmed_up)
  2. each collective counts one in `position` and is issued as a Handle that keeps where
     (op, label, step, micro-step, seq): a wait that lost a peer raises CollectiveTimeout
  3. name_hang: the one line, naming the ranks that never arrived (c10d's store, below)
  4. watch: the training loop's step and micro-step for that line; --hang-at, the lesson
  5. the collective log of --trace (Recorder; machinery/timeline.py writes and reads it)
  6. on NCCL, the Flight Recorder's settings: its watchdog, not a wait of ours, times out there
  7. a clean exit for a script that never destroys its process group (leave_at_exit)
"""
import atexit
import contextlib
import gc
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import collectives
from configurator import UserError

# ----------------------------------------------------------------------------------------------
# Every collective bounded in time. A collective waits for the slowest rank's *skew*, and the
# first step is where ranks drift apart: inductor compiles for minutes (--compile), NCCL opens
# its connections, cuDNN and the allocator warm up, rank 0 prepares the data. So until the
# first step is behind a collective waits at least START_S, and warmed_up() tightens every
# group to --collective-timeout after a barrier under the old value: a rank still finishing
# its first step must not meet a peer that already waits the short one (torchtitan's init and
# train timeouts, torchtitan#149). A group gets its wait at its first collective, and again
# at its first after warmed_up (_bound): dist.new_group alone gives torch's default (30 min on
# gloo, 10 on NCCL), the default group too, whoever made them.

timeout_s = None  # seconds a collective may wait for the slowest rank now (None: torch's default)
START_S = 1800.0  # ... before the first step is behind, at least: torch's own default on gloo
_steady = None  # --collective-timeout: timeout_s once warmed_up() has run
_bounded = {}  # group (None: the default group) -> the seconds it was given

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


def install(seconds=None, backend="gloo", out_dir="."):
    """From here on every collective of collectives.py is launched by launch (below): counted,
    named when it fails, and waiting `seconds` for the slowest rank once warmed_up() has run,
    max(seconds, START_S) before (None: torch's default). Call it before
    dist.init_process_group: on NCCL the Flight Recorder's settings must be in the environment
    when the communicator is made (its dumps in out_dir, a file per rank)."""
    global timeout_s, _steady
    if backend == "nccl":
        prefix = os.path.abspath(os.path.join(out_dir, "nccl_trace_rank_"))
        for old, new, value in FLIGHT_RECORDER:
            if old not in os.environ and new not in os.environ:
                os.environ[old] = os.environ[new] = value or prefix
    timeout_s = None if seconds is None else max(seconds, START_S)
    _steady = seconds
    _bounded.clear()
    position.step, position.micro, position.seq = -1, -1, 0
    collectives.launch = launch
    leave_at_exit()


_LESSON = collectives.launch  # the lecture's launch, before install() replaces it
_off = False


def installed():
    """Whether install() has run in this process (train.py's run, or an engine of ours), or
    off() holds it off."""
    return _off or collectives.launch is launch


@contextlib.contextmanager
def off():
    """The lecture's launch inside, and no install(): memory.py --measure's fake process group,
    where no collective waits and no store answers."""
    global _off
    saved, collectives.launch, _off = collectives.launch, _LESSON, True
    try:
        yield
    finally:
        collectives.launch, _off = saved, False


def warmed_up(world_size):
    """The first step is behind: from here every group waits --collective-timeout. A barrier
    first, under the allowance. Every rank calls it at the same point; a no-op the second time."""
    global timeout_s
    if world_size == 1 or _steady is None or timeout_s == _steady:
        return
    collectives.barrier(world_size, label="the first step")
    timeout_s = _steady  # each group tightened at its next collective


def _bound(group):
    """The run's wait for `group`, given before a collective runs on it. At the run's first
    collective this rank also tells the store where its process lives (name_hang's _here)."""
    if _bounded.get(group, "not yet") == timeout_s:
        return
    if group is None and None not in _bounded:
        dist.distributed_c10d._get_default_store().set(
            f"{KEY}pid/{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")
    if timeout_s is not None:
        # torch 2.3-2.13's private name; later torch makes it public as set_timeout
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_timeout(timedelta(seconds=timeout_s), group)
    _bounded[group] = timeout_s


# ----------------------------------------------------------------------------------------------
# A clean exit. A script that ends without dist.destroy_process_group() leaves its process group
# to the interpreter's exit, which tears it down in no order with the engine's garbage (a model
# and its engine's hooks are a reference cycle, with buffers that collectives wrote) and while
# gloo's worker threads may still release a collective's tensors: now and then a rank that has
# finished aborts ("terminate called without an active exception") and torchrun reports the job
# failed. train.py leaves as run.finish does; a loop of one's own gets the same at exit.

def leave_at_exit():
    """At a clean exit (no uncaught exception), while the interpreter is whole: the garbage
    freed, then the process group destroyed (it lands what is still in flight first). No
    barrier: a rank that leaves early must not wait in a collective its peers never join.
    Asked twice, once."""
    atexit.unregister(_leave)
    atexit.register(_leave)


def _leave():
    if dist.is_initialized() and not hasattr(sys, "last_value"):  # a failed rank: as it is
        gc.collect()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Where a collective was issued, always on: every collective counts one in `position.seq`, and
# its handle keeps the seq, the op, the caller's label (ZeRO-2's "bucket 3", ZeRO-3's "block 1"
# or "root", "norm") and the step and micro-step the training loop's forward set (watch).
# That is an int increment and a small object per collective: no clock read, no host sync, no
# store. Every rank issues the same collectives in the same order, so equal seqs on two ranks
# are the same collective.

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


_lesson_launch = collectives.launch


def launch(name, label, tensor, collective, *args, **kwargs):
    """collectives.launch once installed: the lesson's, on a group bounded in time (no group:
    the default one), as a Handle called `name`."""
    handle = Handle(name, label)
    _bound(kwargs.get("group"))
    try:
        handle.work = _lesson_launch(name, label, tensor, collective, *args, **kwargs)
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
# CollectiveTimeout with where this rank waits. name_hang then has each failed rank publish
# that -- its seq above all -- to the process group's own key-value store (c10d's, which every
# rank reached at start-up) and read the others' for a grace period:
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


# ----------------------------------------------------------------------------------------------
# Who never arrived (the protocol: above)

KEY = "nanozero/hang/"  # + rank: where that rank waits; + "read": how many read the others


def grace(timeout, timed_out=True):
    """How long a rank whose collective failed listens for the others' reports: the ranks
    waiting with it fail within the spread of their arrivals (or at once, when a peer's timeout
    closes the connections). A quarter of the timeout, 1 to 30 s; 1 s when this rank's own wait
    did not time out but lost its peer (a rank that crashed or was killed closes every
    connection, and torchrun stops the rest within seconds: a survivor must not linger)."""
    return min(30.0 if timed_out else 1.0, max(1.0, (timeout or 1800) / 4))


def name_hang(error):
    """The one line of a rank whose collective lost a peer (a CollectiveTimeout): where it
    waited, why, and which ranks never arrived or are gone, heard through c10d's store."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = error.where
    heard, gone = exchange(mine, rank, world_size, grace(timeout_s, error.timed_out))
    silent = [r for r in range(world_size) if r not in heard and r not in gone]
    elsewhere = {}  # where -> the ranks waiting there
    for r, w in heard.items():
        if w["seq"] != mine["seq"]:
            elsewhere.setdefault(describe(w), []).append(r)
    missing = [f"{ranks_text(gone)} {'is' if len(gone) == 1 else 'are'} gone (its process "
               "ended: killed, crashed or left)"] if gone else []
    if silent:  # with a rank gone, a survivor still waits until the ranks beside it leave
        missing += [f"{ranks_text(silent)} did not answer (alive: still waiting, or leaving)"
                    if gone else
                    f"{ranks_text(silent)} never arrived (in no collective: busy, stuck or gone)"]
    missing += [f"{ranks_text(rs)} never arrived (waiting in {w})" for w, rs in elsewhere.items()]
    if not missing:
        missing = ["every rank arrived, yet it did not finish (a slow link, a backend fault)"]
    here = ranks_text([r for r, w in heard.items() if w["seq"] == mine["seq"]])
    limit = f", --collective-timeout {timeout_s:g}" if timeout_s else ""
    return f"rank {rank}: {error}: {'; '.join(missing)} ({here} waited{limit})"


def exchange(mine, rank, world_size, seconds):
    """({rank: where it waits} of the ranks that answer within `seconds`, this one's included;
    the ranks that did not answer because their process ended). The store may live in rank 0's
    process (a group made from MASTER_ADDR without torchrun's agent): rank 0 leaves after the
    others it heard have read (a survivor whose wait fails only once rank 0 has left finds the
    store gone: torchrun's agent keeps it)."""
    heard, gone = {rank: mine}, set()
    try:
        store = dist.distributed_c10d._get_default_store()
        here = _here(store, world_size)
        gone = {r for r, pid in here.items() if not _alive(pid)}
        store.set(f"{KEY}{rank}", json.dumps(dict(mine, gone=sorted(gone))))
        deadline = time.monotonic() + seconds
        while not _listen(store, heard, gone, here, world_size) and time.monotonic() < deadline:
            time.sleep(0.05)
        read = store.add(KEY + "read", 1)
        while rank == 0 and read < len(heard) and time.monotonic() < deadline + seconds:
            time.sleep(0.05)  # late reports still count; a process that ends now does not:
            _listen(store, heard, gone, {}, world_size)  # it may be a rank that was named, leaving
            read = store.add(KEY + "read", 0)
    except RuntimeError:  # the store is gone (its host left first): what was heard so far
        pass
    return heard, gone - heard.keys()


def _listen(store, heard, gone, here, world_size):
    """The reports published so far into heard (with the ranks their writers found gone), the
    ranks of this host whose process ended since into gone; whether every rank is accounted for."""
    for r in range(world_size):
        if r not in heard and store.check([f"{KEY}{r}"]):
            heard[r] = json.loads(store.get(f"{KEY}{r}"))
            gone.update(heard[r].get("gone", ()))
    gone.update(r for r, pid in here.items() if r not in heard and not _alive(pid))
    return len(heard.keys() | gone) == world_size


def _here(store, world_size):
    """{rank: pid} of the ranks on this host (each told the store where it lives at the run's
    first collective): a killed rank answers no roll call, and neither, for a while, does a
    survivor still waiting behind it; its process tells them apart. Another host's ranks: the
    survivors there tell."""
    host, out = socket.gethostname(), {}
    for r in range(world_size):
        if store.check([f"{KEY}pid/{r}"]):
            where, pid = store.get(f"{KEY}pid/{r}").decode().split()
            if where == host:
                out[r] = int(pid)
    return out


def _alive(pid):
    """Whether process pid runs (a zombie, ended and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # Linux: the state after the command's name
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def ranks_text(ranks):
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    runs = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


# ----------------------------------------------------------------------------------------------
# Where the training loop is, and the lesson in hangs

def watch(model, cfg, rank, world_size, grad_accum, start_it):
    """Where the run is, for a collective that times out to name (position): the step and
    micro-step of each training forward, counted from start_it; an evaluation's forward is at
    the coming step, in no micro-step. A pre-hook on the model, ahead of the engine's own
    (ZeRO-3's first gather is then in this step). The first forward after the run's first step
    tightens every collective's wait to --collective-timeout (the first step compiles and warms
    up under START_S). --hang-at STEP: the last rank stops issuing collectives at that step's
    first forward (hang below)."""
    if cfg.hang_at >= 0 and world_size == 1:
        raise UserError(f"--hang-at {cfg.hang_at} stops one rank while the others wait: run "
                        "2 or more ranks (torchrun --nproc_per_node=2)")
    if cfg.hang_at >= 0 and not start_it < cfg.hang_at < cfg.max_iters:
        raise UserError(f"--hang-at {cfg.hang_at}: give a step after this run's first "
                        f"({start_it}: it compiles and warms up under a longer timeout) and "
                        f"before --max-iters {cfg.max_iters}")
    forwards, where = [start_it * grad_accum], position

    def hook(module, args):
        if not (module.training and torch.is_grad_enabled()):
            where.step, where.micro = forwards[0] // grad_accum, -1  # evaluation
        else:
            where.step, where.micro = divmod(forwards[0], grad_accum)
            forwards[0] += 1
        if where.step > start_it:
            warmed_up(world_size)
        if where.step == cfg.hang_at and where.micro == 0 and rank == world_size - 1:
            hang(cfg.hang_at, rank, cfg.collective_timeout)

    model.register_forward_pre_hook(hook, prepend=True)


def hang(step, rank, timeout):
    """--hang-at: this rank issues no collective for longer than the others wait and report
    (a rank stuck in a data loader, a deadlock, a branch of its own); then it leaves too."""
    seconds = timeout + 2 * grace(timeout) + 1
    time.sleep(seconds)
    raise UserError(f"--hang-at {step}: rank {rank} issued no collective for {seconds:g} s at "
                    f"step {step} (an injected fault); the other ranks named it", rank_local=True)
