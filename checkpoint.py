"""
Training checkpoints: save, resume, reshard; streamed, never the whole model on one rank.

A checkpoint is a folder OUT_DIR/ckpt-ITER in one of two formats:
  consolidated  ckpt.pt, written by rank 0: every tensor whole (trainable ones as fp32 master
                weights and Adam's moments, frozen ones in their dtype), gathered one bucket at
                a time, each moved to the host before the next is gathered
  sharded       shard-RANK.pt from every rank, the pieces it owns, and meta.pt, which says
                which rank holds which element range [lo, hi) of which tensor
Both describe the state by (tensor name, element range), never by bucket or rank, so any world
size and ZeRO stage resumes from either: each rank reads the ranges it owns now, from the files
that hold them (ckpt.pt memory-mapped). Under ZeRO-3 no rank holds more than one bucket beyond
its shards, saving or restoring.

Checked on resume, each a one-line CheckpointError that changes no file (the Reader of
machinery/ckpt_reader.py): the header's types, ranges and layout; the model shape and the
vocabulary itself; every tensor's name, shape, length and crc32 (each saved beside its
tensor: a rank checks what it reads); LoRA's rank, alpha and targets, the quantization. A
corrupt file is never skipped over: its line names the older checkpoint to resume from.
May change between runs: world size, ZeRO stage, format, LoRA dropout, and the dtype (the
loss scaler then starts fresh).

Safety: a save goes into ckpt-ITER.tmp, renamed to ckpt-ITER once every rank's files are
written, fsynced and agreed on: a full disk or a crash leaves the previous checkpoint the
newest, and inf/NaN master weights are never saved. The files of one save share a save_id, so
a shard copied in from another is refused. Reading is torch.load(weights_only=True): never
code. Saved for an exact resume: master weights, the optimizer's state and step, the scaler,
the iteration (hence the LR and the batches), every rank's RNG states, the flags and the
model config. export.py writes a checkpoint out as Hugging Face or plain safetensors files.
"""
from contextlib import contextmanager
import os
import random
import uuid

import numpy as np
import torch

from collectives import Traffic, all_gather_object, all_gather_params
from machinery import lifecycle, rundir, validate
from machinery.ckpt_reader import CheckpointError, Reader, newest_checkpoint  # read, checked
from machinery.rundir import list_checkpoints
from machinery.validate import crc


# ----------------------------------------------------------------------------------------------
# a piece: what each rank owns of the model state, and the whole of it one bucket at a time

def rng_state():
    """Every generator's state as plain bytes and numbers (weights_only-loadable): an exact
    resume draws the same dropout masks."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state().numpy().tobytes(),
             "numpy": [kind, keys.tobytes(), pos, has_gauss, gauss], "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def set_rng_state(state):
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    torch.set_rng_state(as_tensor(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(as_tensor(state["cuda"]))


def stored_shapes(model):
    """{name: shape} of every tensor as files hold it: the model's own declaration (GPT's
    leaves out the zero rows its vocabulary is padded with), else each tensor's shape, the
    tied one under its first name."""
    if hasattr(model, "stored_shapes"):
        return model.stored_shapes()
    shapes, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            shapes[name] = list(t.shape)
    return shapes


def stored(shapes, name, lo, hi):
    """[lo, hi) of a flattened tensor, cut to what the checkpoint stores of it."""
    return lo, min(hi, int(np.prod(shapes[name])))


def state_piece(t, n):
    """n elements of optimizer state for a piece of n elements: per-element state as it is; a
    statistic of a whole tensor shaped otherwise (Adafactor's row and column means, only ever
    of whole tensors: zero.py deals them whole) flat in the first elements, zeros after."""
    flat = t.reshape(-1)
    return flat[:n] if len(flat) >= n else torch.cat([flat, flat.new_zeros(n - len(flat))])


def owned_pieces(zero, shapes):
    """This rank's pieces, copied to the host: {name: {"lo", "hi", "master", each optimizer state
    key}} for trainable tensors and {name: {"lo", "hi", "value"}} for frozen ones. Up to stage 2
    the frozen tensors are whole on every rank, at stage 0 all tensors: rank 0 owns them."""
    out = {}
    for s in zero.segments if zero.stage >= 1 or zero.rank == 0 else ():
        lo, hi = stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            state, n = zero.opt.state[s.master], hi - lo
            out[s.name] = {"lo": lo, "hi": hi, "master": s.flat[:n].detach().cpu().clone(),
                           **{k: state_piece(state[k], n).cpu().clone()
                              for k in opt_state_keys(zero.opt, s.master)}}
    if zero.stage == 3 or zero.rank == 0:
        for name, lo, hi, values in zero.frozen_pieces():
            lo, stop = stored(shapes, name, lo, hi)
            if lo < stop:
                out[name] = {"lo": lo, "hi": stop, "value": values[:stop - lo].cpu().clone()}
    return out


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
    return {"optimizer": zero.optimizer, "state_keys": state_keys(zero),
            "opt_step": max((c for c in every if c is not None), default=0)}


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
            has = lambda name: key == "master" or key in (keys_of or {}).get(name, ())
            if not any(has(zero.names[id(p)]) for p in b.params):
                continue  # the same collectives on every rank: keys_of is agreed
            for s in b.segments:
                if has(s.name):
                    src = s.flat if key == "master" else zero.opt.state[s.master][key]
                    owned[s.start:s.start + s.hi - s.lo] = state_piece(src, s.hi - s.lo)
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


# ----------------------------------------------------------------------------------------------
# the whole state, and saving it

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


def save(out_dir, it, zero, model, scaler, header, fmt, keep_last):
    """Write OUT_DIR/ckpt-IT on every rank (a collective). header: run flags, model config,
    tokenizer metadata. Keeps the newest keep_last complete checkpoints. On a write error
    every rank raises CheckpointError and nothing changes in out_dir."""
    rank, world_size = zero.rank, zero.world_size
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
        raise CheckpointError(f"not saving {final}: the master weights hold inf/NaN (the run "
                              "diverged); " + (f"{previous[-1]} is the newest good checkpoint"
                                               if previous else "no checkpoint was saved"))
    common = dict(header, iter=it, save_id=save_id, world_size=world_size, stage=zero.stage,
                  scaler=scaler.state_dict(), shapes=shapes,
                  frozen=[name for name in shapes if name not in trainable],
                  **opt_header)
    if fmt == "sharded":
        pieces = owned_pieces(zero, shapes)
        for piece in pieces.values():  # each piece's checksums beside it: a rank checks its own
            piece["crc"] = {k: crc(t) for k, t in piece.items() if k not in ("lo", "hi")}
        layout = all_gather_object({n: (v["lo"], v["hi"]) for n, v in pieces.items()}, world_size)
        files = {f"shard-{rank:05d}.pt": {"save_id": save_id, "rank": rank, "pieces": pieces,
                                          "rng": rng_state()}}
        if rank == 0:
            files["meta.pt"] = dict(common, format="sharded", layout=layout)
    else:
        keys = sorted({k for ks in opt_header["state_keys"].values() for k in ks})
        tensors = full_tensors(zero, shapes, ("master", *keys), opt_header["state_keys"])
        rngs = all_gather_object(rng_state(), world_size)
        crcs = {name: {k: crc(t) for k, t in entry.items()} for name, entry in tensors.items()}
        files = {"ckpt.pt": dict(common, format="consolidated", tensors=tensors, crc=crcs,
                                 rng=rngs)} if rank == 0 else {}
    # into ckpt-IT.tmp, renamed to ckpt-IT once every rank's files are written (rundir.py)
    error = rundir.write_save(out_dir, final, files, rank, world_size,
                              lambda failed: lifecycle.agree(failed, zero.device, world_size),
                              keep_last)
    if error:
        previous = list_checkpoints(out_dir)
        raise CheckpointError(f"could not write {final} ({error}); "
                              + (f"{previous[-1]} is intact" if previous else "nothing was saved"))
    return final


# ----------------------------------------------------------------------------------------------
# resume: every rank reads the pieces it owns now, from whatever files hold them

def check_compatible(*args):
    """validate.check_compatible's refusal as a CheckpointError: this run cannot continue it."""
    try:
        validate.check_compatible(*args)
    except ValueError as e:
        raise CheckpointError(str(e))


def _read_owned(reader, zero, shapes):
    """Each piece this rank owns, as stored (padded vocabulary rows are not: they stay zero):
    ([(segment, {key: tensor})], [(frozen values, tensor)])."""
    trainable, frozen = [], []
    for s in zero.segments:
        saved, mine = validate.keys_of(reader.header, s.name), opt_state_keys(zero.opt, s.master)
        if tuple(mine) != saved:
            raise CheckpointError(f"{reader.path} holds optimizer state {list(saved)} of "
                                  f"{s.name}, this run's {zero.optimizer} keeps {mine}: the "
                                  "same --optimizer and torch are needed to resume")
        lo, hi = stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            keys = ("master",) + saved
            trainable.append((s, {k: reader.read(s.name, k, lo, hi) for k in keys}))
    for name, lo, hi, values in zero.frozen_pieces():
        lo, hi = stored(shapes, name, lo, hi)
        if lo < hi:
            frozen.append((values, reader.read(name, "value", lo, hi)))
    return trainable, frozen


@torch.no_grad()
def restore(path, zero, model, scaler, config, model_args, vocab_meta):
    """Load a checkpoint into a freshly built run (any stage, any world size). Every rank reads
    only what it owns. Returns (iteration to continue from, a note to print or None, the
    header). The scaler is restored only when the precision is the same as when it was saved."""
    shapes, error = stored_shapes(model), None
    try:
        reader = Reader(path)
        h = reader.header
        check_compatible(h, model_args, vocab_meta, path, config, shapes)
        trainable, frozen = _read_owned(reader, zero, shapes)
        rng = reader.rng(zero.rank) if h["world_size"] == zero.world_size else None
        fp8 = reader.fp8(model)  # --fp8's amax histories: checked now, restored below
    except CheckpointError as e:
        error = str(e)
    # a rank reads its own shards: one bad file stops every rank, with its line
    errors = [e for e in all_gather_object(error, zero.world_size) if e]
    if errors:
        raise CheckpointError(errors[0])
    # everything is read: only now is the run changed
    for s, saved in trainable:
        n, state = len(saved["master"]), zero.opt.state[s.master]
        s.flat[:n].copy_(saved["master"])
        for k in saved.keys() - {"master"}:  # a per-tensor statistic: its first elements
            m = min(n, state[k].numel())
            state[k].view(-1)[:m].copy_(saved[k][:m])
    set_step_count(zero.opt, [s.master for s in zero.segments], h["opt_step"])
    for values, saved in frozen:
        values[:len(saved)].copy_(saved)
    zero.publish()
    note = None
    old = (h["config"].get("dtype"), h["config"].get("loss_scale"))
    if old == (config.get("dtype"), config.get("loss_scale")):
        scaler.load_state_dict(h["scaler"])
    else:
        note = (f"{path} was saved with --dtype {old[0]} --loss-scale {old[1]}: this run's "
                f"--dtype {config.get('dtype')} starts a fresh loss scaler")
    if rng is not None:  # the same ranks again: dropout continues exactly
        set_rng_state(rng)
    return h["iter"], "; ".join(n for n in (note, fp8()) if n) or None, h


if __name__ == "__main__":  # a library: the way out of a checkpoint is export.py
    import sys
    print("checkpoint.py is not a command: to write a checkpoint out, use "
          "`python export.py CKPT --to hf OUT` or `--to safetensors OUT`", file=sys.stderr)
    sys.exit(2)
