"""
The checkpoint train.py and a loop of one's own use: checkpoint.py's save and Reader, with
every claim checked before it is used.

checkpoint.py writes and reads the pieces and trusts its files. This extends it (docs/
checkpoints.md, "What the checksums cover"):
  - a crc32 of every piece (its bytes, then its dtype's name) in the header, and the header's
    own crc32 over every other field (header_crc, in JSON's canonical form: sorted keys, no
    spaces), checked before any field is used: a flipped byte, an edited field, a truncated
    shard or one copied in from another save fails one of them;
  - the header's claims (types, ranges, a layout that tiles every tensor once, file names of
    ours) checked by validate.check_header before any is used, each piece's length against
    the layout: a header a writer with a bug sealed anew is one line, never a huge allocation;
  - a save refused when the master weights hold inf/NaN (the run diverged); written into
    OUT_DIR/ckpt-ITER.tmp, each file fsynced, renamed to ckpt-ITER once every rank's files are
    written (rundir.write_save): a full disk or a crash leaves the previous checkpoint the
    newest; the newest keep_last kept;
  - a resume that checks the model, the vocabulary, the optimizer and LoRA's flags first
    (validate.check_compatible), reads the checkpoint rank 0 chose (newest_checkpoint: nodes
    need not share a disk), and raises any rank's refusal on every rank before anything changes.
A bad file is one UserError line that names the older checkpoint to resume from instead.
"""
import json
import os
import zlib

import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file

import checkpoint
from checkpoint import HEADER, extra_keys, list_checkpoints, opt_state_keys
from collectives import all_gather_object
from configurator import UserError
from machinery import rundir, validate

SEAL = "header_crc"  # the header's own checksum, kept in it


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


def write_shard(path, tensors):
    """{"TENSOR/KEY": 1-D tensor} by safetensors' own writer, fsynced. An OSError (a full disk,
    a file-size limit) when the bytes did not reach the disk."""
    try:
        save_file(tensors, path)
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


def save(out_dir, it, zero, model, scaler=None, header=None, fmt="consolidated", keep_last=2):
    """checkpoint.save, checked: OUT_DIR/ckpt-IT written on every rank (a collective) into
    ckpt-IT.tmp and renamed once every rank's files are written, then the newest keep_last
    complete checkpoints kept. header as checkpoint.save's, and "fp8" (beyond/fp8.py's
    state_dict: its amax histories become tensors of file 0). Inf/NaN master weights, or a
    write error on any rank: every rank raises UserError and nothing changes in out_dir."""
    rank, world_size = zero.rank, zero.world_size
    final = os.path.join(out_dir, f"ckpt-{it:07d}")
    any_rank = lambda failed: validate.agree(failed, zero.device, world_size)
    # a diverged run (inf / NaN master weights) is never saved over the last good checkpoint
    if any_rank(not all(s.flat.isfinite().all() for s in zero.segments)):
        previous = list_checkpoints(out_dir)
        raise UserError(f"not saving {final}: the master weights hold inf/NaN (the run "
                        "diverged); " + (f"{previous[-1]} is the newest good checkpoint"
                                         if previous else "no checkpoint was saved"))
    fp8 = (header or {}).get("fp8")
    if fp8 is not None:  # the amax histories: tensors of file 0, their names in the header
        header = dict(header, fp8={"settings": fp8["settings"],
                                   "history": sorted(fp8["history"])})
    tensors, head = checkpoint.pieces_and_header(it, zero, model, scaler, header, fmt)
    if fp8 is not None and rank == 0:
        tensors.update({f"fp8/{n}": t for n, t in fp8["history"].items()})
    # every file's crc32s, in the header rank 0 writes
    head["crc"] = all_gather_object(checksums(tensors or {}), world_size)[:len(head["files"])]

    def write(tmp):  # this rank's files into the save's .tmp folder (rundir.write_save)
        if tensors is not None:
            write_shard(os.path.join(tmp, head["files"][rank]), tensors)
        if rank == 0:
            write_header(os.path.join(tmp, HEADER), head)

    error = rundir.write_save(out_dir, final, write, rank, world_size, any_rank, keep_last)
    if error:
        previous = list_checkpoints(out_dir)
        raise UserError(f"could not write {final} ({error}); "
                        + (f"{previous[-1]} is intact" if previous else "nothing was saved"))
    return final


# ----------------------------------------------------------------------------------------------
# reading

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


# what a rank that cannot open the checkpoint rank 0 resumes, while others can, is told
SHARE_OUT_DIR = ("every rank reads the checkpoint it resumes from: copy it into each node's "
                 "--out-dir, or put --out-dir on a disk the nodes share")


def newest_checkpoint(out_dir, world_size):
    """--resume: the newest complete checkpoint rank 0 lists, the same for every rank, as the
    path of that name in this rank's out_dir; None when rank 0 has none. Ranks that each list
    their own disk could pick another, or none, and enter other collectives: a hang. A rank
    that has no such folder stops every rank with one line (a UserError)."""
    chosen = [os.path.basename(p) for p in list_checkpoints(out_dir)[-1:]] or [None]
    if world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    path = os.path.join(out_dir, chosen[0])
    missing = None if os.path.isdir(path) else f"no checkpoint at {path}"
    errors = [missing] * world_size
    if world_size > 1:
        dist.all_gather_object(errors, missing)
    error = validate.agreed_error(errors, SHARE_OUT_DIR)
    if error:
        raise UserError(error)
    return path


class Reader(checkpoint.Reader):
    """checkpoint.Reader, every claim checked before it is used: the header (its checksum, then
    validate.check_header) when opened, each piece (its crc32, length and dtype) as it is
    read."""

    def __init__(self, path):
        if not os.path.isdir(path):
            raise UserError(f"no checkpoint at {path}")
        self.hint = rundir.resume_hint(path)  # a bad file names what to resume from instead
        self.file, self.dtypes = os.path.join(path, HEADER), {}
        kind = validate.file_kind(self.file)
        if kind != "a file":
            raise UserError((f"{path} has no {HEADER}" if kind is None else
                             f"{self.file} is {kind}, not a file") + ": not a complete "
                            "checkpoint (pass another, or move it away)")
        try:
            super().__init__(path)
        except OSError as e:
            raise UserError(f"cannot read {self.file}: {e.strerror or e}")
        if "extra_keys" not in self.header:  # saved before the engine named its keys: then
            delayed = self.header.get("delayed") is True  # only the delayed update kept any
            self.header["extra_keys"] = ["in_use"] if delayed else []
        self._checked(validate.check_header, self.header)  # before any claim is used

    def read_header(self, file):
        return self._checked(read_header, file)

    def _checked(self, check, *args):
        """check(*args) (validate.py), its refusal a UserError naming the header."""
        try:
            return check(*args)
        except ValueError as e:
            raise UserError(f"{self.file}: {e} (a corrupt or edited file); {self.hint}")

    def tensor(self, i, key):
        """Tensor key of file i: the file a file (safe_open checks its own header), the
        tensor's crc32 before it is used."""
        h, file = self.header, os.path.join(self.path, self.header["files"][i])
        kind = validate.file_kind(file)  # before it is opened: a FIFO would wait for ever
        if kind is None:
            raise UserError(f"{file} is missing: the checkpoint is incomplete")
        if kind != "a file":
            raise UserError(f"{file} is {kind}, not a file; {self.hint}")
        try:
            t = super().tensor(i, key)
        except (SafetensorError, OSError) as e:  # truncated, a header that lies, ...
            raise UserError(f"cannot read {file}: {_first_line(e)}; {self.hint}")
        got = piece_crc(t)
        if got != h["crc"][i][key]:
            raise UserError(f"{file}: {key} fails its checksum (crc32 {got:08x}, saved "
                            f"{h['crc'][i][key]:08x}): its bytes changed; {self.hint}")
        return t

    def piece(self, i, name, key):
        lo, hi = self.header["layout"][i][name]
        t = super().piece(i, name, key)
        if t.dim() != 1 or len(t) != hi - lo:
            raise UserError(f"{self.path}: the piece of {name} holds {key} of shape "
                            f"{list(t.shape)}, not [{hi - lo}]; {self.hint}")
        if self.dtypes.setdefault((name, key), t.dtype) != t.dtype:
            raise UserError(f"{self.path}: the pieces of {name} differ in dtype")
        return t

    def model_args(self):
        """The header's GPTConfig kwargs, checked against its tensors' shapes: build a model
        from these, never from a bare header (it may claim 10^5 layers)."""
        h = self.header
        self._checked(validate.check_shapes_fit, h["model_args"], h["shapes"])
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
        self._checked(fp8.check_state_dict, model, saved)
        return lambda: fp8.load_state_dict(model, saved, self.path)

    def rng(self, rank, device):
        state = self.header["rng"][rank]
        self._checked(validate.check_rng, state, device)  # before any generator is set
        return state


# ----------------------------------------------------------------------------------------------
# resume

def restore(path, zero, model, scaler=None, config=None, model_args=None, vocab_meta=None):
    """checkpoint.restore, checked: into a freshly built run (any stage, any world size), each
    rank reading only what it owns. Returns (iteration to continue from, a note to print or
    None, the header). Checked first: the model (model_args: default the model's own; {}
    checks the tensors alone), the vocabulary (vocab_meta, if given), the optimizer (config's,
    else the engine's; "adamw" is torch.optim.AdamW's "AdamW"), its state keys tensor by tensor
    and config's LoRA flags. The scaler is restored only when the precision is the one saved
    (scaler None: not)."""
    shapes, error = checkpoint.stored_shapes(model), None
    config = {"optimizer": zero.optimizer_name, **(config or {})}
    model_args = checkpoint.model_args(model) if model_args is None else model_args
    try:
        reader = Reader(path)
        h = reader.header
        validate.check_compatible(h, model_args, vocab_meta, path, config, shapes)
        for s in zero.segments:
            saved, mine = validate.keys_of(h, s.name), opt_state_keys(zero.opt, s.master)
            if tuple(mine) != saved:
                raise UserError(f"{reader.path} holds optimizer state {list(saved)} of "
                                f"{s.name}, this run's {zero.optimizer_name} keeps {mine}: the "
                                "same --optimizer and torch are needed to resume")
        pieces = checkpoint.read_owned(reader, zero, shapes)
        rng = reader.rng(zero.rank, zero.device) if h["world_size"] == zero.world_size else None
        fp8 = reader.fp8(model)  # --fp8's amax histories: checked now, restored below
    except UserError as e:
        error = str(e)
    # a rank reads its own shards: one bad file stops every rank, with its line
    errors = [e for e in all_gather_object(error, zero.world_size) if e]
    if errors:
        raise UserError(errors[0])
    # everything is read: only now is the run changed
    old = (h["config"].get("dtype"), h["config"].get("loss_scale"))
    same_precision = old == (config.get("dtype"), config.get("loss_scale"))
    checkpoint.load(pieces, zero, h, scaler if same_precision else None, rng)
    notes = []
    if "in_use" in h["extra_keys"] and "in_use" not in extra_keys(zero):
        notes.append(f"{path} was saved by --offload-optimizer delayed, whose weights in use lag "
                     "its master by one update: without the delay this run starts from the "
                     "master")
    if scaler is not None and not same_precision:
        notes.append(f"{path} was saved with --dtype {old[0]} --loss-scale {old[1]}: this run's "
                     f"--dtype {config.get('dtype')} starts a fresh loss scaler")
    return h["iter"], "; ".join(n for n in (*notes, fp8()) if n) or None, h
