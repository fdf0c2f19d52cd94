"""
Guards one run's folder (--out-dir): one writer at a time, one run's history, a log that is
only ever appended to, and leftover saves cleared only when no live run owns them.

  OUT_DIR/lock           who writes here: pid, host, boot id and the process's start time (a
                         pid alone is reused), torchrun's job id and restart count. Taken
                         before any work and removed when the run ends. A live run's lock
                         refuses a second run in one line; a dead run's (on this host: its pid
                         gone, reused or from before a reboot; or an earlier attempt of the
                         same torchrun job) is taken over with a note; one we cannot judge
                         (another host, an edited file) names the remedy: delete it if no run
                         writes here, or --take-over-lock.
  OUT_DIR/metrics.jsonl  one JSON object a line, appended to (a resume never truncates it). A
                         crash or a full disk can cut the last line short: it stays, and
                         read_metrics skips it. A failed write stops the logging with one
                         line; the run and its checkpoints go on untouched.
  OUT_DIR/ckpt-N.tmp/    a save in progress; its owner.json names the run writing it.

A folder holds one run's history: a run without --resume where an earlier run left checkpoints
or a log is refused (--archive moves that run into OUT_DIR/archive-N/ first; nothing is ever
deleted). A run that fails before its first step leaves the folder as it found it.
"""
import functools
import json
import math
import os
import re
import shutil
import socket

import torch.distributed as dist

import collectives
from checkpoint import list_checkpoints
from configurator import UserError
from machinery.validate import file_kind, is_int

LOCK = "lock"
RUN_FILES = re.compile(r"ckpt-\d+(\.tmp)?|metrics\.jsonl|adapter")  # a run's own
_held = set()  # the out-dirs' locks this process holds
_created = set()  # the out-dirs this process created: removed again if it leaves them empty
_archived = []  # (from, to) moves of --archive: undone if the run fails before a step
_logs = []  # the Metrics this process opened: rolled back if the run fails before a step
_saves = []  # the checkpoints this process committed: a run that saved is never rolled back




def _start_time(pid):
    """The process's start time (clock ticks after boot, /proc/PID/stat's 22nd field), or None
    where /proc cannot tell: with the pid it names one process, never a later one reusing it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # after "pid (comm)": field 3 on
    except (OSError, ValueError, IndexError):
        return None


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _owner():
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(),
            "start_time": _start_time(pid), "job": os.environ.get("TORCHELASTIC_RUN_ID"),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)}


def judge(owner):
    """Whether the run an owner record (a lock, a save's owner.json) names is alive: "mine",
    "alive", "dead", "unknown" (another host's: it cannot be looked up) or "invalid" (no run's
    identity), with why."""
    me = _owner()
    if not isinstance(owner, dict) or not is_int(owner.get("pid")) or owner["pid"] <= 0 \
            or not isinstance(owner.get("host"), str):
        return "invalid", "holds no run's identity (a pid and a host)"
    pid, host = owner["pid"], owner["host"]
    if owner == me:
        return "mine", ""
    if owner.get("job") and owner.get("job") == me["job"] and is_int(owner.get("restart")) \
            and owner["restart"] < me["restart"]:  # torchrun stops every worker to restart
        return "dead", f"an earlier attempt (restart {owner['restart']}) of this torchrun job"
    if host != me["host"]:
        return "unknown", f"names pid {pid} on host {host}, which this host cannot look up"
    if owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"]:
        return "dead", f"pid {pid} ran before this machine restarted"
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists
    except ProcessLookupError:
        return "dead", f"pid {pid} is no longer running"
    except PermissionError:  # it exists, as another user's process
        pass
    started = owner.get("start_time")
    if started is not None and me["start_time"] is not None and started != _start_time(pid):
        return "dead", f"pid {pid} is now another process"
    return "alive", f"pid {pid} on {host}"


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def take_lock(out_dir, take_over=False):
    """Make out_dir this process's: create OUT_DIR/lock, or take over one whose run is dead (or
    is this process: an earlier run in it that raised), or with take_over one we cannot judge.
    Returns a note to print, or None; UserError when a live run holds the folder, or when we
    cannot tell and take_over is off."""
    if not os.path.isdir(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        _created.add(os.path.abspath(out_dir))
    path, me = os.path.join(out_dir, LOCK), _owner()
    kind = file_kind(path)  # a FIFO would hold the read below for ever
    if kind not in (None, "a file"):
        raise UserError(f"{path} is {kind} where the run's lock file belongs: move it away")
    tmp = f"{path}.{me['pid']}"
    with open(tmp, "w") as f:
        json.dump(me, f)
    note = None
    try:
        for _ in range(3):
            try:  # link fails if the lock exists: two runs starting at once cannot both win
                os.link(tmp, path)
                _held.add(path)
                return note
            except FileExistsError:
                held = _read_json(path)
            if not os.path.exists(path):  # released between our link and our read
                continue
            verdict, why = judge(held)
            if verdict == "alive":
                raise UserError(f"{out_dir} is in use by the run of {why} ({path}): wait for it "
                                "to end, or use another --out-dir")
            if verdict in ("unknown", "invalid") and not take_over:
                raise UserError(f"cannot tell whether a run still writes to {out_dir}: {path} "
                                f"{why}; if none does, delete {path} or pass --take-over-lock, "
                                "else use another --out-dir")
            if verdict != "mine":
                note = f"took over {path} from pid {(held or {}).get('pid')} ({why})" \
                    if isinstance(held, dict) else f"took over {path} ({why})"
            _set_aside(path, held)
        raise UserError(f"cannot take {path}: another run keeps replacing it")
    finally:
        os.remove(tmp)


def _set_aside(path, held):
    """Remove the lock `held` read from path, unless another run replaced it meanwhile (then it
    is put back, and the caller's next try reads the new one)."""
    aside = f"{path}.stale{os.getpid()}"
    try:
        os.rename(path, aside)  # atomic: only one of two runs taking over moves it
    except FileNotFoundError:
        return
    if _read_json(aside) != held:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.remove(aside)


def claim(cfg, rank, world_size, print0, check=None):
    """Before any work: make out_dir this run's (rank 0 takes its lock, and refuses a fresh run
    where an earlier run left its history, or archives that run with --archive); every rank
    learns a refusal. check(), if given, runs first on rank 0 (the memory a run needs)."""
    error = note = raised = None
    if rank == 0:
        try:
            if check:
                check()
            note = take_lock(cfg.out_dir, cfg.take_over_lock)
            note = "; ".join(n for n in (note, _one_history(cfg)) if n) or None
        except UserError as e:  # rank 0 raises it as it is, the others its line
            error, raised = str(e), e
        except OSError as e:
            error = f"cannot write {cfg.out_dir}: {e.strerror or e}"
    if world_size > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if raised:
        raise raised
    if error:
        raise UserError(error)
    if note:
        print0(note)


def _one_history(cfg):
    """A fresh run where an earlier one left checkpoints or a log: refused, or (--archive) that
    run moved into OUT_DIR/archive-N/. Anything else where a run's file or folder belongs (a
    FIFO would hold metrics.jsonl's open for ever): refused."""
    out = cfg.out_dir
    for name, want in (("metrics.jsonl", "a file"), ("adapter", "a folder")):  # PEFT's folder
        kind = file_kind(os.path.join(out, name))
        if kind not in (None, want):
            raise UserError(f"{os.path.join(out, name)} is {kind} where the run's "
                            f"{name} belongs: move it away, or use another --out-dir")
    log = os.path.join(out, "metrics.jsonl")
    earlier = list_checkpoints(out)
    logged = os.path.isfile(log) and os.path.getsize(log) > 0
    if cfg.resume or not (earlier or logged):
        return None
    what = (f"checkpoints up to {earlier[-1]}" if earlier else "no checkpoint") + \
        (" and metrics.jsonl" if logged else "")
    if not cfg.archive:
        raise UserError(f"{out} holds an earlier run ({what}): pass --resume to continue it, "
                        "another --out-dir for a new run, or --archive to move it into "
                        f"{out}/archive-N/ first")
    names = sorted(n for n in os.listdir(out) if RUN_FILES.fullmatch(n))
    init = os.path.abspath(cfg.init_from) if cfg.init_from else ""
    if any(init == os.path.abspath(os.path.join(out, n)) for n in names):
        raise UserError(f"--init-from {cfg.init_from} is part of the run --archive would move: "
                        "start the new run in another --out-dir")
    taken = {int(m.group(1)) for m in map(re.compile(r"archive-(\d+)").fullmatch,
                                          os.listdir(out)) if m}
    folder = os.path.join(out, f"archive-{max(taken, default=0) + 1}")
    os.makedirs(folder)
    for name in names:
        os.rename(os.path.join(out, name), os.path.join(folder, name))
        _archived.append((os.path.join(out, name), os.path.join(folder, name)))
    return f"--archive: moved the earlier run ({what}) into {folder}"


def release_locks(failed=False):
    """Remove the locks this process holds (at the end of a run, or after its error). failed:
    the run raised; if it logged no step and saved nothing, what it wrote is taken back (its
    log rows, an --archive's move), and a folder it created and left empty is removed."""
    if failed and not _saves and not any(m.steps for m in _logs):
        for m in _logs:
            m.roll_back()
        for src, dst in reversed(_archived):
            os.rename(dst, src)
        if _archived:
            os.rmdir(os.path.dirname(_archived[0][1]))
    _logs.clear()
    _archived.clear()
    _saves.clear()
    for path in list(_held):
        if _read_json(path) == _owner():
            os.remove(path)
        _held.discard(path)
        folder = os.path.dirname(os.path.abspath(path))
        if folder in _created and not os.listdir(folder):
            os.rmdir(folder)  # a refused run leaves no empty --out-dir behind
        _created.discard(folder)


def releasing_locks(main):
    """main, then release_locks() however main ends: an error (or a test that calls main
    in-process) leaves no lock of a live process behind, and a run that fails before its first
    step leaves its folder as it found it."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            result = main(*args, **kwargs)
        except BaseException:
            release_locks(failed=True)
            raise
        release_locks()
        return result
    return run


def mark_save(tmp):
    """Name this process as the owner of the save folder tmp (before any file goes in)."""
    with open(os.path.join(tmp, "owner.json"), "w") as f:
        json.dump(_owner(), f)


def write_save(out_dir, final, write, rank, world_size, any_rank, keep_last):
    """Write one save's files into FINAL.tmp (write(tmp) writes this rank's, fsynced), then
    commit it: the rename to FINAL once every rank's files are written (any_rank(failed) tells
    every rank whether any failed). Keeps the newest keep_last checkpoints up to FINAL. Returns
    None, or what failed: then nothing is committed and the .tmp folder is gone."""
    tmp, error = final + ".tmp", None
    try:
        if rank == 0:  # a crash mid-save leaves a .tmp folder: no checkpoint, cleared here
            clear_stale_saves(out_dir)  # unless a live run is writing it
            os.makedirs(tmp)
            mark_save(tmp)
        _barrier(world_size)
        write(tmp)
    except OSError as e:
        error = e
    # every rank learns whether every rank's files are complete before anything is committed
    if any_rank(error is not None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(world_size)
        return str(error or "failed on another rank")
    if rank == 0:
        os.remove(os.path.join(tmp, "owner.json"))
        shutil.rmtree(final, ignore_errors=True)  # the same iteration saved again (a final save)
        os.replace(tmp, final)  # the commit point: a folder without .tmp is complete
        _saves.append(final)
        fd = os.open(out_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        # the oldest go; never the one just written, nor one numbered after it
        older = [c for c in list_checkpoints(out_dir)
                 if os.path.basename(c) < os.path.basename(final)]
        for old in older[:max(0, len(older) - keep_last + 1)]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world_size)
    return None


def _barrier(world_size):
    collectives.barrier(world_size, label="a save")


def clear_stale_saves(out_dir):
    """Remove the ckpt-N.tmp folders of saves that crashed: those whose owner is not a live
    run other than this one (a folder without owner.json crashed before naming it)."""
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if re.fullmatch(r"ckpt-\d+\.tmp", name):
            owner = _read_json(os.path.join(out_dir, name, "owner.json"))
            if judge(owner)[0] in ("mine", "dead", "invalid"):
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def resume_hint(path):
    """What a bad checkpoint's error says to resume from instead (never chosen on our own):
    the newest complete checkpoint beside it that is older."""
    path = os.path.abspath(path)
    older = [c for c in list_checkpoints(os.path.dirname(path))
             if os.path.basename(c) < os.path.basename(path)]
    return (f"move it away to resume from {older[-1]}" if older else
            "no older checkpoint is left to resume from")


# ----------------------------------------------------------------------------------------------

class Metrics:
    """OUT_DIR/metrics.jsonl, one JSON object per row, written by rank 0 only, appended to: a
    resume adds its rows after the earlier ones (read_metrics reads the run as it went on)."""

    def __init__(self, out_dir, enabled, print0=print):
        self.file, self.path, self.print0 = None, os.path.join(out_dir, "metrics.jsonl"), print0
        self.size, self.steps = None, 0  # its size before this run; the steps this run logged
        if enabled:
            try:
                self.size = os.path.getsize(self.path) if os.path.isfile(self.path) else None
                self.file = open(self.path, "a", encoding="utf-8")
                if self.size and not self._ends_a_line():
                    self.file.write("\n")  # never glue a row onto a line a crash cut short
                    print0(f"{self.path}: its last line was cut short (a crash or a full disk):"
                           " kept as it is, and skipped by every reader")
                self.file.flush()
            except OSError as e:
                self._failed(e)
            _logs.append(self)

    def _ends_a_line(self):
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _failed(self, e):
        self.print0(f"cannot write {self.path} ({e.strerror or e}): logging to it stops; "
                    "training and its checkpoints go on")
        self.file = None

    def log(self, row):
        self.steps += "loss" in row
        if self.file:  # NaN / inf become null: metrics.jsonl stays valid JSON for every reader
            row = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                   for k, v in row.items()}
            try:
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
            except OSError as e:
                self._failed(e)

    def roll_back(self):
        """Take back what this run wrote (it failed before its first step): the file as it was."""
        if self.file:
            self.file.close()
            self.file = None
            if self.size is None:
                os.remove(self.path)
            elif os.path.isfile(self.path):
                os.truncate(self.path, self.size)


def read_metrics(path):
    """A metrics.jsonl's rows as the run went on: objects only (a line cut short by a crash, or
    one that is not a JSON object, is skipped); after a resume from iteration k the rows of
    iterations >= k written before it are dropped: they were redone."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            if row.get("event") == "resume" and is_int(row.get("iter")):
                rows = [r for r in rows if not (is_int(r.get("iter")) and r["iter"] >= row["iter"])]
            rows.append(row)
    return rows
