"""
Training checkpoints: save, resume, reshard, export.

A checkpoint is a folder OUT_DIR/ckpt-ITER (ITER zero-padded) in one of two formats:
  consolidated  ckpt.pt: full fp32 weights (model.py's names), Adam's moments, everything else.
                Gathered onto rank 0 one ZeRO unit/bucket at a time.
  sharded       shard-RANK.pt from every rank (its slices of each parameter: master weights and
                moments, and its RNG states) plus meta.pt, which says which rank holds which
                slice [lo, hi) of which flattened parameter.
Both describe the state by (parameter name, element range), never by bucket or rank layout,
so any world size and any ZeRO stage can read either one back: each rank asks for the ranges it
owns now and the reader assembles them from whatever pieces were written (PITFALLS 13).

Safety: a checkpoint is written into ckpt-ITER.tmp and becomes ckpt-ITER by one atomic rename
after every file is complete and fsynced, so a crash mid-save leaves the previous checkpoint as
the newest complete one. Files are read with torch.load(weights_only=True): a checkpoint can
hold tensors, numbers and strings, never code. Any problem reading one is a CheckpointError
with a one-line message.

What is saved, so that a resumed run continues exactly: weights (fp32 master values), Adam's
moments and step, the loss-scaler state, the iteration (which fixes the LR schedule and the data
order: the batch of step t depends only on (seed, t)), every rank's RNG states (torch, CUDA,
numpy, python: dropout), the run's flags and the model config.

    python checkpoint.py out/ckpt-0002000 weights.pt    # export plain weights (a state_dict)
"""
import os
import random
import re
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist


class CheckpointError(Exception):
    """A missing, corrupt, truncated or mismatched checkpoint: one line, no traceback."""


def _fsync_save(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _load(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    except Exception as e:  # truncated zip, a pickle that wants to run code, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read {path}: {first[:200]}")


def rng_state():
    """Every generator's state as plain bytes and numbers (weights_only-loadable, picklable)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state().numpy().tobytes(), "numpy": [kind, keys.tobytes(), pos, has_gauss, gauss],
             "python": random.getstate()}
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


def _gather_object(obj, world_size):
    out = [obj] * world_size
    if world_size > 1:
        dist.all_gather_object(out, obj)
    return out


def save(out_dir, it, zero, model, scaler, header, fmt, keep_last, rank, world_size):
    """Write OUT_DIR/ckpt-IT on every rank (a collective). header: run flags, model config,
    tokenizer metadata. Keeps the newest keep_last complete checkpoints."""
    final = os.path.join(out_dir, f"ckpt-{it:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if world_size > 1:
        dist.barrier()
    rngs = _gather_object(rng_state(), world_size) if fmt == "consolidated" else None
    with zero.gathered():  # ZeRO-3 shards frozen tensors too: gather them to save them whole
        frozen = {n: p.detach().float().clone() for n, p in model.named_parameters() if not p.requires_grad}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    common = dict(header, iter=it, scaler=scaler.state_dict(), adam_step=zero.adam_step(), world_size=world_size,
                  stage=zero.stage)
    if fmt == "sharded":
        shard = zero.shard_state()
        _fsync_save({"slices": shard, "rng": rng_state()}, os.path.join(tmp, f"shard-{rank:05d}.pt"))
        layout = _gather_object({n: (v["lo"], v["hi"]) for n, v in shard.items()}, world_size)
        if rank == 0:
            shapes = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
            _fsync_save(dict(common, format="sharded", layout=layout, shapes=shapes, frozen=frozen, buffers=buffers),
                        os.path.join(tmp, "meta.pt"))
    else:
        weights = zero.full_state_dict(model)
        moments = {k: zero.full_state_dict(model, k) for k in ("exp_avg", "exp_avg_sq")}
        if rank == 0:
            _fsync_save(dict(common, format="consolidated", model=weights, optim=moments, rng=rngs),
                        os.path.join(tmp, "ckpt.pt"))
    if world_size > 1:
        dist.barrier()  # every rank's files are on disk
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # the same iteration saved again (a final save)
        os.replace(tmp, final)  # the commit point: a folder without .tmp is complete
        fd = os.open(out_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        for old in list_checkpoints(out_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    if world_size > 1:
        dist.barrier()
    return final


def list_checkpoints(out_dir):
    """Complete checkpoints in out_dir, oldest first."""
    if not os.path.isdir(out_dir):
        return []
    names = sorted(n for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d+", n))
    return [os.path.join(out_dir, n) for n in names]


class Reader:
    """Reads either format; read(name, key, lo, hi) returns elements [lo, hi) of a flattened
    parameter's "master" weights, "exp_avg" or "exp_avg_sq", assembled from whatever slices
    were written."""

    def __init__(self, path):
        if not os.path.isdir(path):
            raise CheckpointError(f"no checkpoint at {path}")
        self.path = path
        if os.path.exists(os.path.join(path, "ckpt.pt")):
            self.header = _load(os.path.join(path, "ckpt.pt"))
        else:
            self.header = _load(os.path.join(path, "meta.pt"))
            self.shards = {}
        if not isinstance(self.header, dict) or self.header.get("format") not in ("consolidated", "sharded"):
            raise CheckpointError(f"{path} is not a nanoZeRO checkpoint")

    def _shard(self, r):
        if r not in self.shards:
            self.shards[r] = _load(os.path.join(self.path, f"shard-{r:05d}.pt"))
        return self.shards[r]

    def read(self, name, key, lo, hi):
        h = self.header
        if h["format"] == "consolidated":
            full = (h["model"] if key == "master" else h["optim"][key]).get(name)
            if full is None:
                raise CheckpointError(f"{self.path} has no tensor {name!r}: another model or LoRA setting?")
            return full.reshape(-1)[lo:hi]
        if name not in h["shapes"]:
            raise CheckpointError(f"{self.path} has no tensor {name!r}: another model or LoRA setting?")
        out = torch.empty(hi - lo)
        for r, layout in enumerate(h["layout"]):  # copy every written slice that overlaps [lo, hi)
            if name in layout:
                a, b = max(lo, layout[name][0]), min(hi, layout[name][1])
                if a < b:
                    piece = self._shard(r)["slices"][name]
                    out[a - lo:b - lo] = piece[key][a - piece["lo"]:b - piece["lo"]]
        return out

    def weights(self):
        """Full fp32 weights with model.py's names (a plain state_dict)."""
        h = self.header
        if h["format"] == "consolidated":
            return h["model"]
        state = dict(h["frozen"], **h["buffers"])
        for name, shape in h["shapes"].items():
            state[name] = self.read(name, "master", 0, int(np.prod(shape))).view(shape)
        if "lm_head.weight" not in state and "transformer.wte.weight" in state:
            state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: saved once
        return state

    def rng(self, rank):
        h = self.header
        return h["rng"][rank] if h["format"] == "consolidated" else self._shard(rank)["rng"]


def check_compatible(header, model_args, vocab_meta, path):
    """A checkpoint of another model shape or vocabulary cannot continue this run."""
    theirs = header.get("model_args", {})
    diff = [f"{k} {theirs.get(k)} vs {v}" for k, v in model_args.items() if k != "dropout" and theirs.get(k) != v]
    if diff:
        raise CheckpointError(f"{path} is for another model ({', '.join(diff)} here): "
                              f"use the same model flags or another --out-dir")
    if vocab_meta is not None and header.get("meta", {}).get("vocab_size") != vocab_meta.get("vocab_size"):
        raise CheckpointError(f"{path} was trained on another vocabulary: use its data set")


def restore(path, zero, model, scaler, model_args, vocab_meta, rank, world_size):
    """Load a checkpoint into a freshly built ZeRO run (any stage, any world size). Returns the
    iteration to continue from. Reads everything before anything is changed."""
    reader = Reader(path)
    h = reader.header
    check_compatible(h, model_args, vocab_meta, path)
    state = reader.weights()
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    missing = [n for n in list(frozen) + list(zero.names.values()) if n not in state]
    if missing:
        raise CheckpointError(f"{path} lacks {missing[0]}: saved with other LoRA settings?")
    rng = reader.rng(rank) if h["world_size"] == world_size else None
    with torch.no_grad(), zero.gathered(write_back=True):  # ZeRO-3: into the full tensors, then the shards
        for n, p in frozen.items():
            p.copy_(state[n])
        for n, b in model.named_buffers():
            if n in state:
                b.copy_(state[n])
    zero.load_shard_state(reader.read, h["adam_step"])
    scaler.load_state_dict(h["scaler"])
    if rng is not None:  # the same ranks again: dropout continues exactly
        set_rng_state(rng)
    return h["iter"]


def main(argv=None):
    """Export plain weights: python checkpoint.py CKPT_DIR OUT.pt"""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python checkpoint.py CKPT_DIR OUT.pt   (writes a plain state_dict)", file=sys.stderr)
        return 2
    try:
        reader = Reader(argv[0])
        torch.save({k: v.clone() for k, v in reader.weights().items()}, argv[1])
    except CheckpointError as e:
        print(f"checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {argv[1]}: {len(reader.weights())} tensors, model {reader.header['model_args']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
