"""
A checkpoint's files, written and read back safely: every claim checked before it is used.

A checkpoint is a folder: checkpoint.json (the header, JSON) and shard-NNNNN.safetensors (the
tensors, 1 file or 1 per rank), written and read by the safetensors package's own save_file and
safe_open: no pickle anywhere, so nothing in them can run code. Each piece is a 1-D tensor named
"TENSOR/KEY" ("transformer.h.0.attn.c_attn.weight/exp_avg"); the header says which file holds
which element range of which tensor (layout), each piece's crc32 (with its dtype), the save_id
that each file's metadata repeats, and its own crc32 over every field (header_crc, in JSON's
canonical form: sorted keys, no spaces).

Checked before anything is used (validate.py for the header's types, ranges and layout): the
header's bytes (JSON, its checksum), then each file as it is opened (safetensors' own header
checks, its save_id, its tensor names) and each piece as it is read (its length and crc32). A
bad file is one UserError line that names the older checkpoint to resume from instead.
Which checkpoint a resume reads is rank 0's choice, the same for every rank (newest_checkpoint):
nodes need not share a disk.
"""
import json
import os
import zlib

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from machinery import rundir, validate
from machinery.lifecycle import agreed_error
from configurator import UserError

HEADER = "checkpoint.json"
SEAL = "header_crc"  # the header's own checksum, kept in it
FORMAT = "nanoZeRO"
OLD = ("ckpt.pt", "meta.pt")  # the pickled formats of nanoZeRO before this one
CONVERT = "python -m machinery.convert"




def shard_name(i):
    return f"shard-{i:05d}.safetensors"


def _first_line(e):
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


# ----------------------------------------------------------------------------------------------
# writing: every file fsynced, so the save's rename commits bytes that are on the disk

def piece_crc(t):
    """crc32 of a piece's bytes, then of its dtype's name: the same bytes read as another dtype
    (a safetensors header whose dtype was edited) fail it."""
    return zlib.crc32(str(t.dtype).encode(), validate.crc(t))


def checksums(tensors):
    return {key: piece_crc(t) for key, t in tensors.items()}


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(path, tensors, metadata):
    """{"TENSOR/KEY": 1-D tensor} by safetensors' own writer, fsynced. An OSError (a full disk,
    a file-size limit) when the bytes did not reach the disk."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:  # the writer's I/O error, as a str: "... File too large ..."
        raise OSError(_first_line(e))
    _fsync(path)


def canonical(header):
    """The header as JSON in one fixed form: what its checksum is of."""
    return json.dumps(header, sort_keys=True, separators=(",", ":"))


def write_header(path, header):
    """The header as JSON (tuples become lists), sealed with its crc32, fsynced."""
    header = json.loads(canonical({k: v for k, v in header.items() if k != SEAL}))
    header[SEAL] = zlib.crc32(canonical(header).encode())
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, sort_keys=True) + "\n")  # one line: its RNG lists are long
        f.flush()
        os.fsync(f.fileno())


def read_header(path):
    """A header's JSON, its checksum checked before any field is used: ValueError otherwise."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError:
        raise ValueError(f"cannot read it: not JSON ({_first_line(e)})")  # [[[[... nested deep
    if not isinstance(header, dict) or not validate.is_int(header.get(SEAL)):
        raise ValueError("its header has no checksum: not a header a save writes")
    want = header.pop(SEAL)
    got = zlib.crc32(canonical(header).encode())
    if got != want:
        raise ValueError(f"its header fails its checksum (crc32 {got:08x}, saved {want:08x}): "
                         "a field changed")
    return header


# ----------------------------------------------------------------------------------------------
# reading

# what a rank that cannot open the checkpoint rank 0 resumes, while others can, is told
SHARE_OUT_DIR = ("every rank reads the checkpoint it resumes from: copy it into each node's "
                 "--out-dir, or put --out-dir on a disk the nodes share")


def newest_checkpoint(out_dir, world_size):
    """--resume: the newest complete checkpoint rank 0 lists, the same for every rank, as the
    path of that name in this rank's out_dir; None when rank 0 has none. Ranks that each list
    their own disk could pick another, or none, and enter other collectives: a hang. A rank
    that has no such folder stops every rank with one line (a UserError)."""
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
        raise UserError(error)
    return path


def refuse_old(path):
    """A folder in a format of an earlier nanoZeRO: one line naming the command that converts."""
    old = [f for f in OLD if os.path.exists(os.path.join(path, f))]
    if old:
        raise UserError(f"{path} holds {old[0]}, the pickled format of an earlier "
                        f"nanoZeRO: convert it with `{CONVERT} {path}`, then use it")


class CheckpointFiles:
    """A checkpoint's header (checked whole when opened) and its pieces, each checked as it is
    read (piece). Which pieces make up a range is checkpoint.py's Reader (the resharding)."""

    def __init__(self, path):
        if not os.path.isdir(path):
            raise UserError(f"no checkpoint at {path}")
        self.path, self.checked = path, set()  # the files opened and checked
        self.hint = rundir.resume_hint(path)  # a bad file names what to resume from instead
        self.file = os.path.join(path, HEADER)
        if not os.path.isfile(self.file):
            refuse_old(path)
            raise UserError(f"{path} has no {HEADER}: not a complete checkpoint (pass "
                            "another, or delete it)")
        try:
            self.header = self._checked(self.file, read_header, self.file)
        except OSError as e:
            raise UserError(f"cannot read {self.file}: {e.strerror or e}")
        if self.header.get("format") != FORMAT:
            raise UserError(f"{path} is not a nanoZeRO checkpoint")
        self._checked(self.file, validate.check_header, self.header)  # before any claim is used

    def _checked(self, file, check, *args):
        """check(*args) (validate.py), its refusal a UserError naming the file."""
        try:
            return check(*args)
        except ValueError as e:
            raise UserError(f"{file}: {e} (a corrupt or edited file); {self.hint}")

    def tensor(self, i, key):
        """Tensor `key` of file i, opened by safe_open (its own header checked), the file's
        save_id and names against the header's, the tensor's crc32 before it is used."""
        h, name = self.header, self.header["files"][i]
        file = os.path.join(self.path, name)
        if key not in h["crc"][i]:
            raise UserError(f"{self.path} holds no {key} in {name}")
        try:
            with safe_open(file, framework="pt") as f:  # memory-mapped: only key is read
                if name not in self.checked:  # once a file: its save, its names
                    if f.metadata() != {"save_id": h["save_id"], "file": str(i)}:
                        raise UserError(f"{file} belongs to another save than its "
                                        f"{HEADER}: the folder was edited; use another")
                    if set(f.keys()) != set(h["crc"][i]):
                        raise UserError(f"{file} holds other tensors than its {HEADER} "
                                        f"says (a corrupt or edited file); {self.hint}")
                    self.checked.add(name)
                t = f.get_tensor(key)
        except FileNotFoundError:
            raise UserError(f"{file} is missing: the checkpoint is incomplete")
        except (SafetensorError, OSError) as e:  # truncated, a header that lies, ...
            raise UserError(f"cannot read {file}: {_first_line(e)}; {self.hint}")
        got = piece_crc(t)
        if got != h["crc"][i][key]:
            raise UserError(f"{file}: {key} fails its checksum (crc32 {got:08x}, saved "
                            f"{h['crc'][i][key]:08x}): its bytes changed; {self.hint}")
        return t

    def piece(self, i, name, key):
        """File i's piece of tensor `name`: `key`'s elements [lo, hi) of the layout, checked."""
        lo, hi = self.header["layout"][i][name]
        t = self.tensor(i, f"{name}/{key}")
        if t.dim() != 1 or len(t) != hi - lo:
            raise UserError(f"{self.path}: the piece of {name} holds {key} of shape "
                            f"{list(t.shape)}, not [{hi - lo}]; {self.hint}")
        return t

    def numel(self, name):
        shape = self.header["shapes"].get(name)
        if shape is None:
            raise UserError(f"{self.path} has no tensor {name!r}")
        return int(torch.Size(shape).numel())

    def model_args(self):
        """The header's GPTConfig kwargs, checked against its tensors' shapes: build a model
        from these, never from a bare header (it may claim 10^5 layers)."""
        h = self.header
        self._checked(self.file, validate.check_shapes_fit, h["model_args"], h["shapes"])
        return h["model_args"]

    def fp8(self, model):
        """--fp8's amax histories (tensors of file 0), checked now against model's FP8 linears
        (beyond/fp8.py); returns what restores them later and returns a note or None."""
        saved = self.header.get("fp8")
        if saved is None and not getattr(model, "fp8_settings", None):
            return lambda: None
        from beyond import fp8
        if saved is not None:
            saved = {"settings": saved["settings"],
                     "history": {n: self.tensor(0, f"fp8/{n}") for n in saved["history"]}}
        self._checked(self.file, fp8.check_state_dict, model, saved)
        return lambda: fp8.load_state_dict(model, saved, self.path)

    def rng(self, rank, device):
        state = self.header["rng"][rank]
        self._checked(self.file, validate.check_rng, state, device)  # before any generator is set
        return state

