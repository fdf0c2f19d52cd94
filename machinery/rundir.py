"""
One run's folder (--out-dir): one writer at a time, a log that survives a crash, and leftover
saves cleared only when no live run owns them.

  OUT_DIR/lock           {"pid", "host"} of the run writing here, taken before its first write
                         and removed when it ends. A second run on the folder is refused with
                         one line naming the first; the lock of a process that died (on this
                         host: its pid is gone) is taken over, with a note.
  OUT_DIR/metrics.jsonl  one JSON object a line. A crash or a full disk can cut the last line
                         short: on resume such a line is dropped with a note, never a traceback.
                         A failed write stops the logging with one line; the run and its
                         checkpoints go on untouched.
  OUT_DIR/ckpt-N.tmp/    a save in progress; its owner.json names the run writing it.
"""
import functools
import json
import math
import os
import re
import shutil
import socket

import torch.distributed as dist

from machinery import validate
from machinery.tensorfile import torch_save

LOCK = "lock"
_held = set()  # the out-dirs whose lock this process holds


class RunDirError(Exception):
    """The folder is another live run's: one line, nothing written."""


def _owner():
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _alive(owner):
    """Whether the process an owner record names may still be running. Only this host's
    processes can be looked up; another host's run is taken as alive (we cannot tell)."""
    if not isinstance(owner, dict):
        return False
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the pid exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def take_lock(out_dir):
    """Make out_dir this process's: create OUT_DIR/lock, or take over one whose process is dead
    (or is this process: an earlier run in it that raised). Returns a note to print, or None;
    RunDirError when a live run holds the folder."""
    os.makedirs(out_dir, exist_ok=True)
    path, me = os.path.join(out_dir, LOCK), _owner()
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
            if held is not None and held != me and _alive(held):
                raise RunDirError(f"{out_dir} is in use by the run of pid {held.get('pid')} on "
                                  f"{held.get('host')} ({path}): wait for it to end, or use "
                                  "another --out-dir")
            if held != me:
                note = (f"took over {path} from pid {(held or {}).get('pid')}, which is no "
                        "longer running")
            os.remove(path)
        raise RunDirError(f"cannot take {path}: another run keeps replacing it")
    finally:
        os.remove(tmp)


def open_run(cfg, start_it, rank, world_size, print0):
    """Make out_dir this run's (rank 0 takes its lock; every rank learns a refusal) and open
    metrics.jsonl: before the run's first write, after every check of the resume."""
    error = note = None
    if rank == 0:
        try:
            note = take_lock(cfg.out_dir)
        except (RunDirError, OSError) as e:
            error = f"{e}" if isinstance(e, RunDirError) else f"cannot write {cfg.out_dir}: {e}"
    if world_size > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise RunDirError(error)
    if note:
        print0(note)
    return Metrics(cfg.out_dir, start_it, rank == 0, print0)


def release_locks():
    """Remove the locks this process holds (at the end of a run, or after its error)."""
    for path in list(_held):
        if _read_json(path) == _owner():
            os.remove(path)
        _held.discard(path)


def releasing_locks(main):
    """main, then release_locks() however main ends: an error (or a test that calls main
    in-process) leaves no lock of a live process behind."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        finally:
            release_locks()
    return run


def mark_save(tmp):
    """Name this process as the owner of the save folder tmp (before any file goes in)."""
    with open(os.path.join(tmp, "owner.json"), "w") as f:
        json.dump(_owner(), f)


def write_save(out_dir, final, files, rank, world_size, any_rank, keep_last):
    """Write one save's files ({name: object} on each rank) into FINAL.tmp, then commit it:
    the rename to FINAL once every rank's files are written and fsynced (any_rank(failed)
    tells every rank whether any failed). Each file's non-tensor fields are sealed with their
    checksum first (validate.seal). Keeps the newest keep_last checkpoints. Returns None, or
    what failed: then nothing is committed and the .tmp folder is gone."""
    tmp, error = final + ".tmp", None
    try:
        if rank == 0:  # a crash mid-save leaves a .tmp folder: no checkpoint, cleared here
            clear_stale_saves(out_dir)  # unless a live run is writing it
            os.makedirs(tmp)
            mark_save(tmp)
        _barrier(world_size)
        for name, obj in files.items():
            torch_save(validate.seal(obj), os.path.join(tmp, name))
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
        fd = os.open(out_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        for old in list_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world_size)
    return None


def _barrier(world_size):
    if world_size > 1:
        dist.barrier()


def clear_stale_saves(out_dir):
    """Remove the ckpt-N.tmp folders of saves that crashed: those whose owner is not a live
    run other than this one (a folder without owner.json crashed before naming it)."""
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if re.fullmatch(r"ckpt-\d+\.tmp", name):
            owner = _read_json(os.path.join(out_dir, name, "owner.json"))
            if owner == _owner() or not _alive(owner):
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def list_checkpoints(out_dir):
    """Complete checkpoints in out_dir, oldest first (a .tmp folder is not one)."""
    if not os.path.isdir(out_dir):
        return []
    names = sorted(n for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d+", n))
    return [os.path.join(out_dir, n) for n in names]


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
    """OUT_DIR/metrics.jsonl, one JSON object per row, written by rank 0 only. On resume the
    rows before the checkpoint are kept: the steps after it are about to be redone."""

    def __init__(self, out_dir, start_it, enabled, print0=print):
        self.file, self.path, self.print0 = None, os.path.join(out_dir, "metrics.jsonl"), print0
        if enabled:
            kept = self._kept(start_it) if start_it and os.path.exists(self.path) else []
            try:
                self.file = open(self.path, "w")
                self.file.writelines(kept)
                self.file.flush()
            except OSError as e:
                self._failed(e)

    def _kept(self, start_it):
        kept, lines = [], open(self.path, encoding="utf-8", errors="replace").readlines()
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
            except ValueError:
                self.print0(f"{self.path}: line {i + 1} of {len(lines)} is not JSON (a write "
                            "cut short by a crash or a full disk): dropped")
                continue
            if isinstance(row, dict) and row.get("iter", -1) < start_it:
                kept.append(line if line.endswith("\n") else line + "\n")
        return kept

    def _failed(self, e):
        self.print0(f"cannot write {self.path} ({e.strerror or e}): logging to it stops; "
                    "training and its checkpoints go on")
        self.file = None

    def log(self, row):
        if self.file:  # NaN / inf become null: metrics.jsonl stays valid JSON for every reader
            row = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                   for k, v in row.items()}
            try:
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
            except OSError as e:
                self._failed(e)
