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

Checked on resume, each a one-line CheckpointError that changes no file: the model shape and
vocabulary, every tensor's name and full shape, LoRA's rank, alpha and targets, the
quantization; every element must come from the file. May change between runs: world size, ZeRO
stage, format, LoRA dropout, and the dtype (the loss scaler then starts fresh: a scale fit for
one precision is wrong for another).

Safety: a save goes into ckpt-ITER.tmp, renamed to ckpt-ITER once every rank's files are written,
fsynced and agreed on: a full disk or a crash leaves the previous checkpoint the newest. The
files of one save share a save_id, so a shard copied in from another is refused. Reading is
torch.load(weights_only=True): tensors, numbers and strings, never code. Saved for an exact
resume: master weights, Adam's moments and step, the scaler, the iteration (hence the LR and the
batches: they depend on (seed, step) only), every rank's RNG states, the flags and model config.

    python checkpoint.py out/ckpt-0002000 --to hf OUT_DIR        # a Hugging Face GPT-2 folder
    python checkpoint.py out/ckpt-0002000 --to safetensors weights.safetensors   # plain weights
"""
import os
import random
import re
import shutil
import sys
import uuid
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from lora import parse_targets
from tensorfile import torch_save
from collectives import Traffic, all_gather_params

MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointError(Exception):
    """A missing, corrupt, truncated or mismatched checkpoint: one line, no traceback."""


# ----------------------------------------------------------------------------------------------
# files

def _load(path, mmap=False):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    except Exception as e:  # truncated zip, a pickle that wants to run code, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {path}: {first[:200]}")


def rng_state():
    """Every generator's state as plain bytes and numbers (weights_only-loadable)."""
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


def _all_gather_object(obj, world_size):
    out = [obj] * world_size
    if world_size > 1:
        dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------
# what a rank owns, streamed

def _stored(shapes, name, lo, hi):
    """[lo, hi) of a flattened tensor, cut to what the checkpoint stores of it."""
    return lo, min(hi, int(np.prod(shapes[name])))


def owned_pieces(zero, shapes):
    """This rank's pieces: {name: {"lo", "hi", "master", "exp_avg", "exp_avg_sq"}} for trainable
    tensors and {name: {"lo", "hi", "value"}} for frozen ones, copied to the host. Up to stage 2
    the frozen tensors are whole on every rank: rank 0 owns them."""
    out = {}
    for s in zero.segments:
        lo, hi = _stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            state, n = zero.opt.state[s.master], hi - lo
            out[s.name] = {"lo": lo, "hi": hi, "master": s.master[:n].detach().cpu().clone(),
                           **{k: state[k][:n].cpu().clone() for k in MOMENTS}}
    if zero.stage == 3 or zero.rank == 0:
        for name, lo, hi, values in zero.frozen_pieces():
            lo, stop = _stored(shapes, name, lo, hi)
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


def full_tensors(zero, shapes, keys=("master",) + MOMENTS):
    """Every tensor whole (as model.stored_shapes() says), by name, on rank 0's host ({} on the
    other ranks): {name: {key: tensor}}, owned_pieces' keys. A collective: buckets are gathered
    one at a time, each on the host before the next is gathered."""
    out = {}

    def host(name, flat):  # the stored part of a tensor, on the host
        return flat[:int(np.prod(shapes[name]))].view(shapes[name]).cpu().clone()

    for b in zero.buckets:
        for key in keys:
            owned = torch.zeros(b.hi - b.lo, dtype=torch.float32, device=zero.device)
            for s in b.segments:
                src = s.master if key == "master" else zero.opt.state[s.master][key]
                owned[s.start:s.start + s.hi - s.lo] = src
            with _gathered(zero, b, owned) as full:
                if zero.rank == 0:
                    for p, offset in zip(b.params, b.offsets):
                        name = zero.names[id(p)]
                        out.setdefault(name, {})[key] = host(name, full[offset:offset + p.numel()])
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
    full = full_tensors(zero, model.stored_shapes(), keys=("master",))
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
    tmp = final + ".tmp"
    # the collectives first (gathers, metadata), then the writes: a rank whose write fails
    # cannot leave the others waiting in a collective
    save_id = _all_gather_object(uuid.uuid4().hex, world_size)[0]
    shapes = model.stored_shapes()
    trainable = {zero.names[id(p)] for b in zero.buckets for p in b.params}
    adam_step = int(zero.opt.state[zero.segments[0].master]["step"].item()) \
        if zero.segments else -1
    common = dict(header, iter=it, save_id=save_id, world_size=world_size, stage=zero.stage,
                  scaler=scaler.state_dict(), shapes=shapes,
                  frozen=[name for name in shapes if name not in trainable],
                  adam_step=max(_all_gather_object(adam_step, world_size)))
    if fmt == "sharded":
        pieces = owned_pieces(zero, shapes)
        layout = _all_gather_object({n: (v["lo"], v["hi"]) for n, v in pieces.items()}, world_size)
        files = {f"shard-{rank:05d}.pt": {"save_id": save_id, "rank": rank, "pieces": pieces,
                                          "rng": rng_state()}}
        if rank == 0:
            files["meta.pt"] = dict(common, format="sharded", layout=layout)
    else:
        tensors = full_tensors(zero, shapes)
        rngs = _all_gather_object(rng_state(), world_size)
        files = {"ckpt.pt": dict(common, format="consolidated", tensors=tensors, rng=rngs)} \
            if rank == 0 else {}
    error = None
    try:
        if rank == 0:  # a crash mid-save leaves a .tmp folder: no checkpoint, and cleared here
            for stale in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
                if re.fullmatch(r"ckpt-\d+\.tmp", stale):
                    shutil.rmtree(os.path.join(out_dir, stale), ignore_errors=True)
            os.makedirs(tmp)
        _barrier(world_size)
        for name, obj in files.items():
            torch_save(obj, os.path.join(tmp, name))
    except OSError as e:
        error = e
    # every rank learns whether every rank's files are complete before anything is committed
    failed = torch.tensor([error is not None], dtype=torch.float32, device=zero.device)
    if world_size > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier(world_size)
        previous = list_checkpoints(out_dir)
        raise CheckpointError(f"could not write {final} ({error or 'failed on another rank'}); "
                              + (f"{previous[-1]} is intact" if previous else "nothing was saved"))
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # the same iteration saved again (a final save)
        os.replace(tmp, final)  # the commit point: a folder without .tmp is complete
        fd = os.open(out_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        for old in list_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world_size)
    return final


def _barrier(world_size):
    if world_size > 1:
        dist.barrier()


def list_checkpoints(out_dir):
    """Complete checkpoints in out_dir, oldest first (a .tmp folder is not one)."""
    if not os.path.isdir(out_dir):
        return []
    names = sorted(n for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d+", n))
    return [os.path.join(out_dir, n) for n in names]


# ----------------------------------------------------------------------------------------------
# read

class Reader:
    """Reads either format. read(name, key, lo, hi) returns elements [lo, hi) of a flattened
    tensor's "master", "exp_avg", "exp_avg_sq" (trainable) or "value" (frozen), assembled from
    whatever pieces were written; only the files that hold them are opened (`opened`)."""

    def __init__(self, path):
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint at {path}")
        self.path, self.shards, self.opened = path, {}, []
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

    def _open(self, name, mmap=False):
        self.opened.append(name)
        return _load(os.path.join(self.path, name), mmap)

    def _shard(self, r):
        if r not in self.shards:
            shard = self._open(f"shard-{r:05d}.pt")
            if not isinstance(shard, dict) or shard.get("save_id") != self.header["save_id"]:
                raise CheckpointError(f"{self.path}/shard-{r:05d}.pt belongs to another save "
                                      "than its meta.pt: the folder was edited; use another")
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
            entry = h["tensors"].get(name, {})
            if key not in entry:
                raise CheckpointError(f"{self.path} holds no {key} of {name!r}")
            return entry[key].reshape(-1)[lo:hi]
        out, covered = None, 0
        for r, layout in enumerate(h["layout"]):  # every written piece that overlaps [lo, hi)
            if name in layout:
                a, b = max(lo, layout[name][0]), min(hi, layout[name][1])
                if a < b:
                    piece = self._shard(r)["pieces"][name]
                    if key not in piece:
                        raise CheckpointError(f"{self.path} holds no {key} of {name!r}")
                    if out is None:
                        out = torch.empty(hi - lo, dtype=piece[key].dtype)
                    out[a - lo:b - lo] = piece[key][a - piece["lo"]:b - piece["lo"]]
                    covered += b - a
        if covered != hi - lo:  # pieces never overlap: every element must come from the file
            raise CheckpointError(f"{self.path} lacks elements [{lo}, {hi}) of {name!r}: "
                                  "a shard is missing from its layout")
        return out

    def weights(self):
        """Every tensor whole (fp32 masters, frozen ones in their dtype), as files hold them:
        for GPT.load_weights."""
        state = {}
        for name, shape in self.header["shapes"].items():
            key = "value" if name in self.header["frozen"] else "master"
            state[name] = self.read(name, key, 0, self.numel(name)).view(shape)
        return state

    def rng(self, rank):
        h = self.header
        return h["rng"][rank] if h["format"] == "consolidated" else self._shard(rank)["rng"]


# ----------------------------------------------------------------------------------------------
# resume

# the run flags that change which tensors exist or what they mean: they must match to resume
SETTINGS = {"lora": "--lora", "lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha",
            "lora_targets": "--lora-targets", "quantize": "--quantize",
            "double_quant": "--double-quant"}


def _as_flag(flag, value):  # ("--lora-rank", 8): "--lora-rank 8"; ("--lora", False): "--no-lora"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value}"


def check_compatible(header, model_args, vocab_meta, path, config=None, shapes=None):
    """A checkpoint of another model, vocabulary, LoRA or quantization setting cannot continue
    this run: one line naming the difference and what to change."""
    theirs = header.get("model_args", {})
    diff = [f"{k} {theirs.get(k)} vs {v}" for k, v in model_args.items()
            if k != "dropout" and theirs.get(k) != v]
    if diff:
        raise CheckpointError(f"{path} is for another model ({', '.join(diff)} here): "
                              f"use the same model flags or another --out-dir")
    if vocab_meta is not None and \
            header.get("meta", {}).get("vocab_size") != vocab_meta.get("vocab_size"):
        raise CheckpointError(f"{path} was trained on another vocabulary: use its data set")
    saved = header.get("config", {})
    for key, flag in SETTINGS.items() if config is not None else ():
        mine, old = config.get(key), saved.get(key)
        if key == "lora_targets" and config.get("lora") and saved.get("lora"):
            mine, old = ",".join(parse_targets(mine)), ",".join(parse_targets(old))
        if key != "lora" and not (config.get("lora") or saved.get("lora")):
            continue  # no LoRA on either side: its settings are unused
        if mine != old:
            old, mine = _as_flag(flag, old), _as_flag(flag, mine)
            raise CheckpointError(f"{path} was saved with {old}, this run has {mine}: pass "
                                  f"{old} to resume it, or use another --out-dir")
    for name, shape in (shapes or {}).items():
        if header["shapes"].get(name) != shape:
            raise CheckpointError(f"{path}: {name} is {header['shapes'].get(name)} there and "
                                  f"{shape} here: another model or LoRA setting")
    extra = set(header.get("shapes", {})) - set(shapes or header.get("shapes", {}))
    if extra:
        raise CheckpointError(f"{path} holds {sorted(extra)[0]}, which this model lacks")


@torch.no_grad()
def restore(path, zero, model, scaler, config, model_args, vocab_meta):
    """Load a checkpoint into a freshly built run (any stage, any world size). Every rank reads
    only what it owns. Returns (iteration to continue from, a note to print or None). The
    scaler is restored only when the precision is the same as when it was saved."""
    reader = Reader(path)
    h = reader.header
    shapes = model.stored_shapes()
    check_compatible(h, model_args, vocab_meta, path, config, shapes)
    # each piece this rank owns, as stored (padded vocabulary rows are not: they stay zero)
    trainable, frozen = [], []
    for s in zero.segments:
        lo, hi = _stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            keys = ("master",) + MOMENTS
            trainable.append((s, {k: reader.read(s.name, k, lo, hi) for k in keys}))
    for name, lo, hi, values in zero.frozen_pieces():
        lo, hi = _stored(shapes, name, lo, hi)
        if lo < hi:
            frozen.append((values, reader.read(name, "value", lo, hi)))
    rng = reader.rng(zero.rank) if h["world_size"] == zero.world_size else None
    # everything is read: only now is the run changed
    for s, saved in trainable:
        n, state = len(saved["master"]), zero.opt.state[s.master]
        s.master[:n].copy_(saved["master"])
        for k in MOMENTS:
            state[k][:n].copy_(saved[k])
    for s in zero.segments:
        zero.opt.state[s.master]["step"].fill_(h["adam_step"])
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
    return h["iter"], note


if __name__ == "__main__":  # the export: pretrained.py (Hugging Face, PEFT, safetensors)
    import pretrained
    sys.exit(pretrained.main())
