"""
Guards the reading of checkpoints: either format, every claim checked before it is used.

A checkpoint is a folder: ckpt.pt (consolidated, memory-mapped) or meta.pt and one
shard-RANK.pt per rank (sharded). The Reader opens only the files that hold what is asked
for, and checks each before any element is copied (validate.py): the bytes of its pickle
against the zip's crc32 of them (before unpickling), its non-tensor fields against their
checksum (validate.seal), the header's types, ranges and layout, every piece's length and
crc32. A bad file is one CheckpointError line that names the older checkpoint to resume
from instead. Which checkpoint a resume reads is rank 0's choice, the same for every rank
(newest_checkpoint): nodes need not share a disk.
"""
import os

import numpy as np
import torch
import torch.distributed as dist

from machinery import rundir, validate
from machinery.lifecycle import agreed_error


class CheckpointError(Exception):
    """A missing, corrupt, truncated or mismatched checkpoint: one line, no traceback."""


def _load(path, mmap=False):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    except Exception as e:  # truncated zip, a pickle that wants to run code, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {path}: {first[:200]}")


# what a rank that cannot open the checkpoint rank 0 resumes, while others can, is told
SHARE_OUT_DIR = ("every rank reads the checkpoint it resumes from: copy it into each node's "
                 "--out-dir, or put --out-dir on a disk the nodes share")


def newest_checkpoint(out_dir, world_size):
    """--resume: the newest complete checkpoint rank 0 lists, the same for every rank, as the
    path of that name in this rank's out_dir; None when rank 0 has none. Ranks that each list
    their own disk could pick another, or none, and enter other collectives: a hang. A rank
    that has no such folder stops every rank with one line (a CheckpointError)."""
    chosen = [os.path.basename(p) for p in rundir.list_checkpoints(out_dir)[-1:]] or [None]
    if world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    path = os.path.join(out_dir, chosen[0])
    missing = None if os.path.isdir(path) else f"no checkpoint at {path}"
    errors = [missing] * world_size
    if world_size > 1:
        dist.all_gather_object(errors, missing)
    error = agreed_error(errors, SHARE_OUT_DIR)
    if error:
        raise CheckpointError(error)
    return path


class Reader:
    """Reads either format. read(name, key, lo, hi) returns elements [lo, hi) of a flattened
    tensor's "master", its optimizer state keys (trainable) or "value" (frozen), assembled from
    whatever pieces were written; only the files that hold them are opened (`opened`)."""

    def __init__(self, path):
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint at {path}")
        self.path, self.shards, self.opened = path, {}, []
        self.hint = rundir.resume_hint(path)  # a bad file names what to resume from instead
        if os.path.exists(os.path.join(path, "ckpt.pt")):
            self.header = self._open("ckpt.pt", mmap=True)  # tensors are read when touched
        elif os.path.exists(os.path.join(path, "meta.pt")):
            self.header = self._open("meta.pt")
        else:
            raise CheckpointError(f"{path} has neither ckpt.pt nor meta.pt: not a complete "
                                  "checkpoint (pass another, or delete it)")
        if not isinstance(self.header, dict) or \
                self.header.get("format") not in ("consolidated", "sharded"):
            raise CheckpointError(f"{path} is not a nanoZeRO checkpoint")
        self.file = os.path.join(path, self.opened[0])
        self._checked(self.file, validate.check_header, self.header)  # before any claim is used
        self.verified = set()  # ckpt.pt's (name, key) whose checksum was checked

    def _checked(self, file, check, *args):
        """check(*args) (validate.py), its refusal a CheckpointError naming the file."""
        try:
            return check(*args)
        except ValueError as e:
            raise CheckpointError(f"{file}: {e} (a corrupt or edited file); {self.hint}")

    def _open(self, name, mmap=False):
        """One file of the checkpoint: its pickle's bytes checked, unpickled (tensors and plain
        data only), its fields checked against their checksum."""
        self.opened.append(name)
        path = os.path.join(self.path, name)
        if os.path.lexists(path):  # else _load says it is missing
            self._checked(path, validate.check_pickle, path)
        obj = _load(path, mmap)
        self._checked(path, validate.check_seal, obj)
        return obj

    def _shard(self, r):
        if r not in self.shards:
            shard, file = self._open(f"shard-{r:05d}.pt"), f"{self.path}/shard-{r:05d}.pt"
            if not isinstance(shard, dict) or shard.get("save_id") != self.header["save_id"]:
                raise CheckpointError(f"{file} belongs to another save "
                                      "than its meta.pt: the folder was edited; use another")
            # every piece's length and crc32, before any element is copied
            self._checked(file, validate.check_shard, shard, self.header["layout"][r],
                          self.header)
            self.shards[r] = shard
        return self.shards[r]

    def numel(self, name):
        shape = self.header["shapes"].get(name)
        if shape is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        return int(np.prod(shape))

    def read(self, name, key, lo, hi):
        h = self.header
        if not 0 <= lo <= hi <= self.numel(name):
            raise CheckpointError(f"{self.path}: {name} has {self.numel(name)} elements, "
                                  f"not [{lo}, {hi})")
        if h["format"] == "consolidated":
            # as many elements as its shape says, and its crc32, before any copy
            t = self._checked(self.file, validate.check_entry, h, name, key, self.verified)
            return t.reshape(-1)[lo:hi]
        # the pieces that overlap [lo, hi), each opened and checked before any copy; the
        # layout tiles every tensor exactly once (validate.check_header): every element is there
        parts = []
        for r, layout in enumerate(h["layout"]):
            if name in layout and max(lo, layout[name][0]) < min(hi, layout[name][1]):
                parts.append(self._shard(r)["pieces"][name])
                if key not in parts[-1]:
                    raise CheckpointError(f"{self.path} holds no {key} of {name!r}")
        out = torch.empty(hi - lo, dtype=parts[0][key].dtype if parts else torch.float32)
        for piece in parts:
            a, b = max(lo, piece["lo"]), min(hi, piece["hi"])
            out[a - lo:b - lo] = piece[key][a - piece["lo"]:b - piece["lo"]]
        return out

    def weights(self):
        """Every tensor whole (fp32 masters, frozen ones in their dtype), as files hold them:
        for GPT.load_weights."""
        state = {}
        for name, shape in self.header["shapes"].items():
            key = "value" if name in self.header["frozen"] else "master"
            state[name] = self.read(name, key, 0, self.numel(name)).view(shape)
        return state

    def model_args(self):
        """The header's GPTConfig kwargs, checked against its tensors' shapes: build a model
        from these, never from a bare header (it may claim 10^5 layers)."""
        h = self.header
        self._checked(self.file, validate.check_shapes_fit, h["model_args"], h["shapes"])
        return h["model_args"]

    def fp8(self, model):
        """--fp8's amax histories, checked now against model's FP8 linears (beyond/fp8.py);
        returns what restores them later and returns a note or None."""
        saved = self.header.get("fp8")
        if saved is None and not getattr(model, "fp8_settings", None):
            return lambda: None
        from beyond import fp8
        self._checked(self.file, fp8.check_state_dict, model, saved)
        return lambda: fp8.load_state_dict(model, saved, self.path)

    def rng(self, rank):
        h = self.header
        state = h["rng"][rank] if h["format"] == "consolidated" else self._shard(rank)["rng"]
        self._checked(self.file, validate.check_rng, state)  # before any generator is set
        return state


