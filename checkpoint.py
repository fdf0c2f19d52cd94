"""
Training checkpoints: save, resume, reshard; streamed, never the whole model on one rank.

A piece is an element range [lo, hi) of a flattened tensor with its values: the fp32 master
weight and every optimizer state tensor by its key (trainable), or the value (frozen); from
--offload-optimizer delayed also the weights in use, one update behind the master ("in_use"). A
checkpoint is a folder OUT_DIR/ckpt-ITER of pieces in one format:
  shard-NNNNN.safetensors  the pieces, each a 1-D tensor named "TENSOR/KEY", written by the
                           safetensors package; --ckpt-format says how many files:
                             consolidated  1 file, rank 0's: every tensor whole, gathered one
                                           bucket at a time, each moved to the host before the
                                           next is gathered (nodes need not share a disk)
                             sharded       1 file per rank, the pieces it owns (no gather)
  checkpoint.json          the header: which file holds which element range of which tensor
                           (layout), each piece's crc32, the optimizer's keys and step, the
                           scaler, every rank's RNG states, fp8's settings, the flags and the
                           model config, the iteration
The state is described by (tensor name, element range), never by bucket or rank, so any world
size and ZeRO stage resumes from either: each rank reads the ranges it owns now, from the
pieces that overlap them (Reader.read). Under ZeRO-3 no rank holds more than one bucket beyond
its shards, saving or restoring.

Checked on resume, each a one-line UserError that changes no file (machinery/ckpt_reader.py
opens the files, validate.py checks the header): the header's checksum, types, ranges and
layout; the model shape and the vocabulary itself; each file's save_id and tensor names; every
piece's length and crc32 (a rank checks what it reads); LoRA's rank, alpha and targets, the
quantization. A corrupt file is never skipped over: its line names the older checkpoint to
resume from. May change between runs: world size, ZeRO stage, --ckpt-format, LoRA dropout, and
the dtype (the loss scaler then starts fresh). A checkpoint of the pickled format before this
one (ckpt.pt, meta.pt) is refused in one line naming `python -m machinery.convert CKPT`.

Safety: a save goes into ckpt-ITER.tmp, renamed to ckpt-ITER once every rank's files are
written, fsynced and agreed on: a full disk or a crash leaves the previous checkpoint the
newest, and inf/NaN master weights are never saved. The files of one save share a save_id, so
a shard copied in from another is refused. No file holds a pickle: reading runs no code. Saved
for an exact resume: master weights, the optimizer's state and step, the scaler, the iteration
(hence the LR and the batches), every rank's RNG states, the flags and the model config.
export.py writes a checkpoint out as Hugging Face or plain safetensors files.
"""
import base64
from contextlib import contextmanager
import os
import random
import uuid

import numpy as np
import torch

from collectives import Traffic, all_gather_object, all_gather_params
from precision import GradScaler
from machinery import ckpt_reader, declared, lifecycle, rundir, validate
from machinery.ckpt_reader import CheckpointFiles, newest_checkpoint  # checked
# what files keep of the model: its declarations, or the defaults (docs/forking.md)
from machinery.declared import model_args, stored_shapes
from machinery.rundir import list_checkpoints
from configurator import UserError


# ----------------------------------------------------------------------------------------------
# a piece: what each rank owns of the model state, by (tensor name, element range)

def stored(shapes, name, lo, hi):
    """[lo, hi) of a flattened tensor, cut to what the checkpoint stores of it."""
    return lo, min(hi, int(np.prod(shapes[name])))


def state_piece(t, n):
    """n elements of optimizer state for a piece of n elements: per-element state as it is; a
    statistic of a whole tensor shaped otherwise (Adafactor's row and column means, only ever
    of whole tensors: zero.py deals them whole) flat in the first elements, zeros after."""
    flat = t.reshape(-1)
    return flat[:n] if len(flat) >= n else torch.cat([flat, flat.new_zeros(n - len(flat))])


def opt_state_keys(opt, param):
    """The names of the state tensors the optimizer keeps for param (not its scalar step)."""
    return sorted(k for k, t in opt.state[param].items() if torch.is_tensor(t) and t.dim() > 0)


def step_count(opt, param):
    """The optimizer's step count for param (AdamW's "step"), or None if it keeps none."""
    t = opt.state[param].get("step")
    return None if t is None else int(t.item() if torch.is_tensor(t) else t)


def set_step_count(opt, params, step):
    """A resumed step count (AdamW's bias correction needs it), where the optimizer keeps one."""
    for p in params:
        if torch.is_tensor(opt.state[p].get("step")):
            opt.state[p]["step"].fill_(step)


def lagging(zero):
    """Does the engine publish weights one update behind its master between steps (beyond/
    offload_optimizer.py's DelayedUpdate)? Its checkpoints then save those weights in use too,
    as "in_use" (fp32), each piece beside its master: a resume publishes them, exactly."""
    return hasattr(zero, "in_use")


def source(zero, s, key):
    """Segment s's tensor under a checkpoint key: its fp32 master, the weights in use (where
    they lag the master), or an optimizer state tensor."""
    if key == "master":
        return s.flat
    return zero.in_use(s).float() if key == "in_use" else zero.opt.state[s.master][key]


def owned_pieces(zero, shapes):
    """This rank's pieces, copied to the host: {name: {"lo", "hi", "master", each optimizer state
    key (and "in_use" where lagging)}} for trainable tensors and {name: {"lo", "hi", "value"}}
    for frozen ones. Up to stage 2 the frozen tensors are whole on every rank, at stage 0 all
    tensors: rank 0 owns them."""
    out = {}
    extra = ["in_use"] if lagging(zero) else []
    for s in zero.segments if zero.stage >= 1 or zero.rank == 0 else ():
        lo, hi = stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            n = hi - lo
            out[s.name] = {"lo": lo, "hi": hi, "master": s.flat[:n].detach().cpu().clone(),
                           **{k: state_piece(source(zero, s, k), n).cpu().clone()
                              for k in opt_state_keys(zero.opt, s.master) + extra}}
    if zero.stage == 3 or zero.rank == 0:
        for name, lo, hi, values in zero.frozen_pieces():
            lo, stop = stored(shapes, name, lo, hi)
            if lo < stop:
                out[name] = {"lo": lo, "hi": stop, "value": values[:stop - lo].cpu().clone()}
    return out


# ----------------------------------------------------------------------------------------------
# the whole of it, gathered one bucket at a time

@contextmanager
def _gathered(zero, b, owned):
    """Every rank's `owned` piece of bucket b (hi - lo elements, any dtype) all-gathered into one
    full flat tensor (a collective), counted in zero.gathered_bytes while it exists."""
    full = torch.empty(b.numel, dtype=owned.dtype, device=owned.device)
    nbytes = full.numel() * full.element_size()
    zero.gathered_bytes += nbytes
    zero.peak_gathered_bytes = max(zero.peak_gathered_bytes, zero.gathered_bytes)
    try:
        if zero.stage == 0:  # every rank owns everything
            full.copy_(owned)
        else:
            work = all_gather_params(full, owned, Traffic(), zero.world_size, zero.gather_group)
            if work is not None:
                work.wait()
        yield full
    finally:
        zero.gathered_bytes -= nbytes


def full_tensors(zero, shapes, keys, keys_of=None):
    """Every tensor whole (as model.stored_shapes() says), by name, on rank 0's host ({} on the
    other ranks): {name: {key: tensor}}, owned_pieces' keys; a state key only for the tensors
    that have it (keys_of: state_keys()). A collective: buckets are gathered one at a time,
    each on the host before the next is gathered."""
    out = {}

    def host(name, flat):  # the stored part of a tensor, on the host
        return flat[:int(np.prod(shapes[name]))].view(shapes[name]).cpu().clone()

    for b in zero.buckets:
        for key in keys:
            owned = torch.zeros(b.hi - b.lo, dtype=torch.float32, device=zero.device)
            every = key in ("master", "in_use")  # every trainable tensor has one
            has = lambda name: every or key in (keys_of or {}).get(name, ())
            if not any(has(zero.names[id(p)]) for p in b.params):
                continue  # the same collectives on every rank: keys_of is agreed
            for s in b.segments:
                if has(s.name):
                    owned[s.start:s.start + s.hi - s.lo] = state_piece(source(zero, s, key),
                                                                       s.hi - s.lo)
            with _gathered(zero, b, owned) as full:
                if zero.rank == 0:
                    for p, offset in zip(b.params, b.offsets):
                        name = zero.names[id(p)]
                        if has(name):
                            out.setdefault(name, {})[key] = host(name, full[offset:offset
                                                                            + p.numel()])
    frozen = [b for u in zero.all_units for b in u.buckets if b.frozen] if zero.stage == 3 else []
    for b in frozen:  # ZeRO-3's frozen buckets: their shards gathered the same way
        with _gathered(zero, b, b.shard) as full:
            if zero.rank == 0:
                for t, offset in zip(b.params, b.offsets):
                    name = zero.names[id(t)]
                    out[name] = {"value": host(name, full[offset:offset + t.numel()])}
    if zero.stage < 3 and zero.rank == 0:
        for t in zero.frozen:
            out[zero.names[id(t)]] = {"value": host(zero.names[id(t)], t.detach().reshape(-1))}
    return out


def state_dict(zero, model):
    """What model.state_dict() would give if no rank held a shard: its names, order and shapes
    (the padded vocabulary rows as the zeros they are), fp32 master weights for what trains and
    the frozen tensors as they are; on rank 0's host, None elsewhere. A collective."""
    full = full_tensors(zero, stored_shapes(model), keys=("master",))
    if zero.rank != 0:
        return None
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        entry = full[zero.names[id(t)]]  # the tied head: under its first name
        value = entry.get("master", entry.get("value"))
        if value.shape != t.shape:  # the padded rows
            value = torch.cat([value, value.new_zeros((t.shape[0] - len(value),) + t.shape[1:])])
        out[name] = value
    return out


# ----------------------------------------------------------------------------------------------
# saving: the pieces, every rank's RNG states, the optimizer's keys and step

def rng_state(device):
    """Every generator's state the run draws from, as JSON (bytes as base64): an exact resume
    draws the same dropout masks. The CUDA generator only on a CUDA run: asking for it creates
    a CUDA context, and a CPU run on a GPU machine must not hold one."""
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    state = {"torch": b64(torch.get_rng_state()), "numpy": [kind, keys.tolist(), pos,
                                                             has_gauss, gauss],
             "python": [version, list(words), gauss_next]}
    if device.type == "cuda":
        state["cuda"] = b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state, device):
    as_tensor = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
    torch.set_rng_state(as_tensor(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, words, gauss_next = state["python"]
    random.setstate((version, tuple(words), gauss_next))
    if "cuda" in state and device.type == "cuda":  # a CPU run leaves a saved CUDA state be
        torch.cuda.set_rng_state(as_tensor(state["cuda"]), device)


def state_keys(zero):
    """{tensor name: the optimizer's state keys} for every trainable tensor, as the optimizer
    made them (AdamW: exp_avg, exp_avg_sq; SGD and Muon's matrices: momentum_buffer;
    Adafactor's matrices: row_var, col_var), agreed by every rank: a checkpoint saves each, by
    key (state_piece). A collective."""
    mine = {s.name: opt_state_keys(zero.opt, s.master) for s in zero.segments}
    keys = {}
    for every in all_gather_object(mine, zero.world_size):
        keys.update(every)
    return keys


def optimizer_header(zero):
    """The optimizer's name, per-element state keys and step count, agreed by every rank (a
    rank that owns nothing but padding has neither keys nor a count)."""
    counts = [step_count(zero.opt, s.master) for s in zero.segments]
    every = all_gather_object(max((c for c in counts if c is not None), default=None),
                              zero.world_size)
    return {"optimizer": zero.optimizer_name, "state_keys": state_keys(zero),
            "opt_step": max((c for c in every if c is not None), default=0)}


def save(out_dir, it, zero, model, scaler=None, header=None, fmt="consolidated", keep_last=2):
    """Write OUT_DIR/ckpt-IT on every rank (a collective). header: run flags ("config"), the
    model config ("model_args"), tokenizer metadata ("meta"), fp8's state; what it leaves out
    is {}, and model_args the model's own (model_args()). scaler: None saves a fixed scale of 1
    (no scaler). fmt: "consolidated" (1 file, gathered by rank 0) or "sharded" (1 file a rank).
    Keeps the newest keep_last complete checkpoints. On a write error every rank raises
    UserError and nothing changes in out_dir."""
    rank, world_size = zero.rank, zero.world_size
    header = {"config": {}, "meta": {}, "model_args": model_args(model), **(header or {})}
    scaler = GradScaler(init_scale=1.0, dynamic=False) if scaler is None else scaler
    final = os.path.join(out_dir, f"ckpt-{it:07d}")
    # the collectives first (gathers, metadata), then the writes: a rank whose write fails
    # cannot leave the others waiting in a collective
    save_id = all_gather_object(uuid.uuid4().hex, world_size)[0]
    shapes = stored_shapes(model)
    trainable = {zero.names[id(p)] for b in zero.buckets for p in b.params}
    opt_header = optimizer_header(zero)
    # a diverged run (inf / NaN master weights) is never saved over the last good checkpoint
    if lifecycle.agree(not all(s.flat.isfinite().all() for s in zero.segments),
                       zero.device, world_size):
        previous = list_checkpoints(out_dir)
        raise UserError(f"not saving {final}: the master weights hold inf/NaN (the run "
                        "diverged); " + (f"{previous[-1]} is the newest good checkpoint"
                                               if previous else "no checkpoint was saved"))
    if fmt == "sharded":  # each rank its own pieces
        pieces, n_files = owned_pieces(zero, shapes), world_size
    else:  # rank 0 every tensor whole: one piece [0, numel) of each
        keys = sorted({k for ks in opt_header["state_keys"].values() for k in ks})
        keys += ["in_use"] if lagging(zero) else []
        full = full_tensors(zero, shapes, ("master", *keys), opt_header["state_keys"])
        pieces, n_files = {name: {"lo": 0, "hi": int(np.prod(shapes[name])),
                                  **{k: t.reshape(-1) for k, t in entry.items()}}
                           for name, entry in full.items()}, 1
    tensors = {f"{name}/{k}": t for name, piece in pieces.items()
               for k, t in piece.items() if k not in ("lo", "hi")}
    fp8 = header.get("fp8")
    if fp8 is not None and rank == 0:  # the amax histories: tensors of file 0
        tensors.update({f"fp8/{n}": t for n, t in fp8["history"].items()})
    # rank 0 writes the header: what every file holds, its crc32s, every rank's RNG states
    index = {"layout": {n: [p["lo"], p["hi"]] for n, p in pieces.items()},
             "crc": ckpt_reader.checksums(tensors), "rng": rng_state(zero.device)}
    every = all_gather_object(index, world_size)
    files = [ckpt_reader.shard_name(i) for i in range(n_files)]
    head = dict(header, format=ckpt_reader.FORMAT, iter=it, save_id=save_id,
                world_size=world_size, stage=zero.stage, scaler=scaler.state_dict(),
                shapes=shapes, frozen=[name for name in shapes if name not in trainable],
                **opt_header, delayed=lagging(zero),  # "in_use" beside every master
                files=files, layout=[e["layout"] for e in every[:n_files]],
                crc=[e["crc"] for e in every[:n_files]], rng=[e["rng"] for e in every],
                fp8=None if fp8 is None else {"settings": fp8["settings"],
                                              "history": sorted(fp8["history"])})

    def write(tmp):  # this rank's files into the save's .tmp folder (rundir.write_save)
        if rank < n_files:
            ckpt_reader.write_shard(os.path.join(tmp, files[rank]), tensors,
                                    {"save_id": save_id, "file": str(rank)})
        if rank == 0:
            ckpt_reader.write_header(os.path.join(tmp, ckpt_reader.HEADER), head)

    # into ckpt-IT.tmp, renamed to ckpt-IT once every rank's files are written (rundir.py)
    error = rundir.write_save(out_dir, final, write, rank, world_size,
                              lambda failed: lifecycle.agree(failed, zero.device, world_size),
                              keep_last)
    if error:
        previous = list_checkpoints(out_dir)
        raise UserError(f"could not write {final} ({error}); "
                        + (f"{previous[-1]} is intact" if previous else "nothing was saved"))
    return final


# ----------------------------------------------------------------------------------------------
# resume: every rank reads the pieces it owns now, from whatever files hold them

class Reader(CheckpointFiles):
    """A checkpoint opened, its header checked (ckpt_reader.py). read(name, key, lo, hi)
    returns elements [lo, hi) of a flattened tensor's "master", its optimizer state keys
    (trainable) or "value" (frozen), from whichever files' pieces overlap them: the resharding.
    Only the files that hold them are opened, each piece checked as it is read."""

    def read(self, name, key, lo, hi):
        if not 0 <= lo <= hi <= self.numel(name):
            raise UserError(f"{self.path}: {name} has {self.numel(name)} elements, "
                            f"not [{lo}, {hi})")
        # the layout tiles every tensor exactly once (validate.check_header): every element
        # of [lo, hi) is in exactly one of the pieces that overlap it
        out = None
        for i, layout in enumerate(self.header["layout"]):
            if name not in layout or max(lo, layout[name][0]) >= min(hi, layout[name][1]):
                continue
            piece, (start, stop) = self.piece(i, name, key), layout[name]
            if out is None:
                out = torch.empty(hi - lo, dtype=piece.dtype)
            if piece.dtype != out.dtype:
                raise UserError(f"{self.path}: the pieces of {name} differ in dtype")
            a, b = max(lo, start), min(hi, stop)
            out[a - lo:b - lo] = piece[a - start:b - start]
        return torch.empty(0) if out is None else out

    def weights(self):
        """Every tensor whole (fp32 masters, frozen ones in their dtype), as files hold them:
        for GPT.load_weights."""
        state = {}
        for name, shape in self.header["shapes"].items():
            key = "value" if name in self.header["frozen"] else "master"
            state[name] = self.read(name, key, 0, self.numel(name)).view(shape)
        return state


def check_compatible(*args):
    """validate.check_compatible's refusal as a UserError: this run cannot continue it."""
    try:
        validate.check_compatible(*args)
    except ValueError as e:
        raise UserError(str(e))


def _read_owned(reader, zero, shapes):
    """Each piece this rank owns, as stored (padded vocabulary rows are not: they stay zero):
    ([(segment, {key: tensor})], [(frozen values, tensor)]). The weights in use ("in_use")
    where the checkpoint and this run both lag the master by an update."""
    trainable, frozen = [], []
    extra = ("in_use",) if reader.header.get("delayed") and lagging(zero) else ()
    for s in zero.segments:
        saved, mine = validate.keys_of(reader.header, s.name), opt_state_keys(zero.opt, s.master)
        if tuple(mine) != saved:
            raise UserError(f"{reader.path} holds optimizer state {list(saved)} of "
                            f"{s.name}, this run's {zero.optimizer_name} keeps {mine}: the "
                            "same --optimizer and torch are needed to resume")
        lo, hi = stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            keys = ("master",) + saved + extra
            trainable.append((s, {k: reader.read(s.name, k, lo, hi) for k in keys}))
    for name, lo, hi, values in zero.frozen_pieces():
        lo, hi = stored(shapes, name, lo, hi)
        if lo < hi:
            frozen.append((values, reader.read(name, "value", lo, hi)))
    return trainable, frozen


@torch.no_grad()
def restore(path, zero, model, scaler=None, config=None, model_args=None, vocab_meta=None):
    """Load a checkpoint into a freshly built run (any stage, any world size). Every rank reads
    only what it owns. Returns (iteration to continue from, a note to print or None, the
    header). Checked first: the model (model_args: default the model's own; {} checks the
    tensors alone), the vocabulary (vocab_meta, if given), the optimizer (config's, else the
    engine's; "adamw" is torch.optim.AdamW's "AdamW") and config's LoRA flags. The scaler is
    restored only when the precision is the same as when it was saved (scaler None: not)."""
    shapes, error = stored_shapes(model), None
    config = {"optimizer": zero.optimizer_name, **(config or {})}
    model_args = declared.model_args(model) if model_args is None else model_args
    try:
        reader = Reader(path)
        h = reader.header
        check_compatible(h, model_args, vocab_meta, path, config, shapes)
        trainable, frozen = _read_owned(reader, zero, shapes)
        rng = reader.rng(zero.rank, zero.device) if h["world_size"] == zero.world_size else None
        fp8 = reader.fp8(model)  # --fp8's amax histories: checked now, restored below
    except UserError as e:
        error = str(e)
    # a rank reads its own shards: one bad file stops every rank, with its line
    errors = [e for e in all_gather_object(error, zero.world_size) if e]
    if errors:
        raise UserError(errors[0])
    # everything is read: only now is the run changed
    for s, saved in trainable:
        n, state = len(saved["master"]), zero.opt.state[s.master]
        s.flat[:n].copy_(saved["master"])
        for k in saved.keys() - {"master", "in_use"}:  # a per-tensor statistic: its first
            m = min(n, state[k].numel())  # elements
            state[k].view(-1)[:m].copy_(saved[k][:m])
    set_step_count(zero.opt, [s.master for s in zero.segments], h["opt_step"])
    for values, saved in frozen:
        values[:len(saved)].copy_(saved)
    if h.get("delayed") and lagging(zero):  # the weights in use, one update behind
        zero.restore_in_use([(s, saved["in_use"]) for s, saved in trainable])
    zero.publish()
    notes = []
    if h.get("delayed") and not lagging(zero):
        notes.append(f"{path} was saved by --offload-optimizer delayed, whose weights in use lag "
                     "its master by one update: without the delay this run starts from the "
                     "master")
    old = (h["config"].get("dtype"), h["config"].get("loss_scale"))
    same_precision = old == (config.get("dtype"), config.get("loss_scale"))
    if scaler is not None and same_precision:
        scaler.load_state_dict(h["scaler"])
    elif scaler is not None:
        notes.append(f"{path} was saved with --dtype {old[0]} --loss-scale {old[1]}: this run's "
                     f"--dtype {config.get('dtype')} starts a fresh loss scaler")
    if rng is not None:  # the same ranks again: dropout continues exactly
        set_rng_state(rng, zero.device)
    return h["iter"], "; ".join(n for n in (*notes, fp8()) if n) or None, h
