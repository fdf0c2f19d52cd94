"""
Training checkpoints: save, resume, reshard; streamed, never the whole model on one rank.

A piece is an element range [lo, hi) of a flattened tensor with its values: the fp32 master
weight and every optimizer state tensor by its key (trainable), or the value (frozen). A
checkpoint is a folder OUT_DIR/ckpt-ITER of pieces in one format:
  shard-NNNNN.safetensors  the pieces, each a 1-D tensor named "TENSOR/KEY", written by the
                           safetensors package (no pickle: reading runs no code); fmt says how
                           many files:
                             consolidated  1 file, rank 0's: every tensor whole, gathered one
                                           bucket at a time, each moved to the host before the
                                           next is gathered (nodes need not share a disk)
                             sharded       1 file per rank, the pieces it owns (no gather)
  checkpoint.json          the header: which file holds which element range of which tensor
                           (layout), the optimizer's keys and step, the scaler, every rank's
                           RNG states, the flags and the model config, the iteration
The state is described by (tensor name, element range), never by bucket or rank, so any world
size and ZeRO stage resumes from either: each rank reads the ranges it owns now, from the
pieces that overlap them (Reader.read). Under ZeRO-3 no rank holds more than one bucket beyond
its shards, saving or restoring. Saved for an exact resume: master weights, the optimizer's
state and step, the scaler, the iteration (hence the LR and the batches), every rank's RNG
states. An engine that keeps more beside each master names its keys (checkpoint_keys: beyond/
offload_optimizer.py's delayed update keeps the weights in use, an update behind): each is
saved and restored as a piece beside the master.

This is the lesson, and it trusts its files. train.py and a loop of one's own use machinery/
checked_ckpt.py, which extends it: a crc32 of every piece and of the header, every claim
checked before it is used, inf/NaN never saved, a save committed by a rename once every rank's
files are on the disk, the newest keep_last kept.
"""
import base64
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
import json
import math
import os
import random
import re

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from collectives import Traffic, all_gather_object, all_gather_params, barrier
import model as model_py  # model.py's defaults, for any model (a fork's too)
from precision import GradScaler

HEADER = "checkpoint.json"


def model_args(owner, config=None):
    """What a checkpoint's header keeps of the model: its config's fields and its ARCH (owner:
    the model, or its class with the config it is built from). {} for a model with neither: a
    resume then checks its tensors alone."""
    config = getattr(owner, "config", None) if config is None else config
    args = asdict(config) if is_dataclass(config) and not isinstance(config, type) else {}
    arch = getattr(owner, "ARCH", None)
    return {"arch": arch, **args} if arch is not None else args


def stored_shapes(model):
    """{name: shape} of every tensor as files hold it: the model's own (GPT's leaves out the zero
    rows its vocabulary is padded with), else model.py's default for any model."""
    if hasattr(model, "stored_shapes"):
        return model.stored_shapes()
    return model_py.stored_shapes(model)


def shard_name(i):
    return f"shard-{i:05d}.safetensors"


def list_checkpoints(out_dir):
    """The checkpoints in out_dir, oldest first (a save in progress, ckpt-N.tmp, is not one)."""
    if not os.path.isdir(out_dir):
        return []
    names = sorted(n for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d+", n))
    return [os.path.join(out_dir, n) for n in names]


# ----------------------------------------------------------------------------------------------
# a piece: what each rank owns of the model state, by (tensor name, element range)

def stored(shapes, name, lo, hi):
    """[lo, hi) of a flattened tensor, cut to what the checkpoint stores of it."""
    return lo, min(hi, math.prod(shapes[name]))


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


def extra_keys(zero):
    """What the engine keeps beside each master and a checkpoint saves with it, by key: its
    own answer (checkpoint_keys), none for ZeRO's engines."""
    return tuple(getattr(zero, "checkpoint_keys", ()))


def source(zero, s, key):
    """Segment s's tensor under a checkpoint key: its fp32 master, an optimizer state tensor,
    or what the engine keeps beside the master (checkpoint_piece)."""
    if key == "master":
        return s.flat
    state = zero.opt.state[s.master]
    return state[key] if key in state else zero.checkpoint_piece(s, key)


def owned_pieces(zero, shapes):
    """This rank's pieces, copied to the host: {name: {"lo", "hi", "master", each optimizer state
    key and each extra key}} for trainable tensors and {name: {"lo", "hi", "value"}} for frozen
    ones. Up to stage 2 the frozen tensors are whole on every rank, at stage 0 all tensors:
    rank 0 owns them."""
    out = {}
    extra = list(extra_keys(zero))
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
        return flat[:math.prod(shapes[name])].view(shapes[name]).cpu().clone()

    for b in zero.buckets:
        for key in keys:
            owned = torch.zeros(b.hi - b.lo, dtype=torch.float32, device=zero.device)
            every = key == "master" or key in extra_keys(zero)  # every trainable tensor's
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


def pieces_and_header(it, zero, model, scaler=None, header=None, fmt="consolidated"):
    """What a save at iteration it writes: (this rank's file, {"TENSOR/KEY": 1-D tensor}, or
    None where it writes none; the header). A collective, on every rank: the gathers first,
    then the writes (save), so a rank whose write fails cannot leave the others waiting."""
    rank, world_size = zero.rank, zero.world_size
    header = {"config": {}, "meta": {}, "model_args": model_args(model), **(header or {})}
    scaler = GradScaler(init_scale=1.0, dynamic=False) if scaler is None else scaler
    shapes = stored_shapes(model)
    trainable = {zero.names[id(p)] for b in zero.buckets for p in b.params}
    opt_header = optimizer_header(zero)
    if fmt == "sharded":  # each rank its own pieces
        pieces, n_files = owned_pieces(zero, shapes), world_size
    else:  # rank 0 every tensor whole: one piece [0, numel) of each
        keys = sorted({k for ks in opt_header["state_keys"].values() for k in ks})
        full = full_tensors(zero, shapes, ("master", *keys, *extra_keys(zero)),
                            opt_header["state_keys"])
        pieces, n_files = {name: {"lo": 0, "hi": math.prod(shapes[name]),
                                  **{k: t.reshape(-1) for k, t in entry.items()}}
                           for name, entry in full.items()}, 1
    tensors = {f"{name}/{k}": t for name, piece in pieces.items()
               for k, t in piece.items() if k not in ("lo", "hi")}
    # every rank's layout and RNG states, for the header rank 0 writes
    every = all_gather_object({"layout": {n: [p["lo"], p["hi"]] for n, p in pieces.items()},
                               "rng": rng_state(zero.device)}, world_size)
    head = dict(header, iter=it, world_size=world_size, stage=zero.stage,
                scaler=scaler.state_dict(), shapes=shapes,
                frozen=[name for name in shapes if name not in trainable], **opt_header,
                extra_keys=list(extra_keys(zero)), files=[shard_name(i) for i in range(n_files)],
                layout=[e["layout"] for e in every[:n_files]], rng=[e["rng"] for e in every])
    return (tensors if rank < n_files else None), head


def save(out_dir, it, zero, model, scaler=None, header=None, fmt="consolidated"):
    """Write OUT_DIR/ckpt-IT on every rank (a collective) and return its path. header: run flags
    ("config"), the model config ("model_args"), tokenizer metadata ("meta"); what it leaves
    out is {}, and model_args the model's own (model_args()). scaler: None saves a fixed scale
    of 1 (no scaler). fmt: "consolidated" (1 file, gathered by rank 0) or "sharded" (1 file a
    rank)."""
    tensors, head = pieces_and_header(it, zero, model, scaler, header, fmt)
    folder = os.path.join(out_dir, f"ckpt-{it:07d}")
    os.makedirs(folder, exist_ok=True)  # on every rank: nodes need not share a disk
    if tensors is not None:
        save_file(tensors, os.path.join(folder, shard_name(zero.rank)))
    if zero.rank == 0:
        with open(os.path.join(folder, HEADER), "w", encoding="utf-8") as f:
            json.dump(head, f)
    barrier(zero.world_size)  # every file written before any rank reads one
    return folder


# ----------------------------------------------------------------------------------------------
# resume: every rank reads the pieces it owns now, from whatever files hold them

class Reader:
    """A checkpoint opened: its header, and read(name, key, lo, hi), elements [lo, hi) of a
    flattened tensor's "master", an optimizer state key (trainable) or "value" (frozen), from
    whichever files' pieces overlap them: the resharding. Only the files that hold them are
    opened, memory-mapped: only the pieces asked for are read."""

    def __init__(self, path):
        self.path = path
        self.header = self.read_header(os.path.join(path, HEADER))

    def read_header(self, file):
        with open(file, encoding="utf-8") as f:
            return json.load(f)

    def tensor(self, i, key):
        """Tensor key ("TENSOR/KEY") of file i."""
        with safe_open(os.path.join(self.path, self.header["files"][i]), framework="pt") as f:
            return f.get_tensor(key)

    def piece(self, i, name, key):
        """File i's piece of tensor name: key's elements [lo, hi) of the layout."""
        return self.tensor(i, f"{name}/{key}")

    def numel(self, name):
        return math.prod(self.header["shapes"][name])

    def read(self, name, key, lo, hi):
        assert 0 <= lo <= hi <= self.numel(name), (name, lo, hi)
        # the layout tiles every tensor exactly once: every element of [lo, hi) is in exactly
        # one of the pieces that overlap it
        out = None
        for i, layout in enumerate(self.header["layout"]):
            start, stop = layout.get(name, (0, 0))
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                piece = self.piece(i, name, key)
                if out is None:
                    out = torch.empty(hi - lo, dtype=piece.dtype)
                out[a - lo:b - lo] = piece[a - start:b - start]
        return torch.empty(0) if out is None else out

    def weights(self):
        """Every tensor whole (fp32 masters, frozen ones in their dtype), as files hold them:
        for GPT.load_weights."""
        h = self.header
        return {name: self.read(name, "value" if name in h["frozen"] else "master", 0,
                                self.numel(name)).view(shape)
                for name, shape in h["shapes"].items()}


def read_owned(reader, zero, shapes):
    """Each piece this rank owns, as stored (padded vocabulary rows are not: they stay zero):
    ([(segment, {key: tensor})], [(frozen values, tensor)]); what the engine keeps beside a
    master where the checkpoint holds it too."""
    trainable, frozen = [], []
    extra = tuple(k for k in extra_keys(zero) if k in reader.header["extra_keys"])
    for s in zero.segments:
        lo, hi = stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            keys = ("master", *reader.header["state_keys"].get(s.name, ()), *extra)
            trainable.append((s, {k: reader.read(s.name, k, lo, hi) for k in keys}))
    for name, lo, hi, values in zero.frozen_pieces():
        lo, hi = stored(shapes, name, lo, hi)
        if lo < hi:
            frozen.append((values, reader.read(name, "value", lo, hi)))
    return trainable, frozen


@torch.no_grad()
def load(pieces, zero, header, scaler=None, rng=None):
    """What read_owned read, into the run; then the scaler's state (scaler None: not), this
    rank's RNG states (rng None: not) and the engine publishes its weights."""
    trainable, frozen = pieces
    for s, saved in trainable:
        n, state = len(saved["master"]), zero.opt.state[s.master]
        s.flat[:n].copy_(saved["master"])
        for k in header["state_keys"].get(s.name, ()):  # a per-tensor statistic: its
            m = min(n, state[k].numel())  # first elements
            state[k].view(-1)[:m].copy_(saved[k][:m])
    set_step_count(zero.opt, [s.master for s in zero.segments], header["opt_step"])
    for values, saved in frozen:
        values[:len(saved)].copy_(saved)
    for key in extra_keys(zero):  # the engine's own, after the masters it may start from
        if key in header["extra_keys"]:
            zero.restore_checkpoint_pieces(key, [(s, saved[key]) for s, saved in trainable])
    zero.publish()
    if scaler is not None:
        scaler.load_state_dict(header["scaler"])
    if rng is not None:  # the same ranks again: dropout continues exactly
        set_rng_state(rng, zero.device)


def restore(path, zero, model, scaler=None):
    """Load a checkpoint into a freshly built run (any stage, any world size): every rank reads
    only what it owns. The RNG states come back where the world size is the one saved. Returns
    the header (its "iter": the iteration to go on from)."""
    reader = Reader(path)
    h = reader.header
    rng = h["rng"][zero.rank] if h["world_size"] == zero.world_size else None
    load(read_owned(reader, zero, stored_shapes(model)), zero, h, scaler, rng)
    return h
