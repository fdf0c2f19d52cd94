"""
A checkpoint of an earlier nanoZeRO (pickled: ckpt.pt, or meta.pt and shard-RANK.pt) rewritten
in today's format, in its own folder:

    python -m machinery.convert out/ckpt-0002000 [more ...]

The old files are read with torch.load(weights_only=True) (tensors and plain data only: no code
runs) and every tensor is held to the crc32 the old file kept beside it before anything is
written; the new files are then read back, each piece checked, before the old ones go. The
checkpoint.json is written last: a conversion cut short leaves a folder the old way, which
this command converts again.
"""
import base64
import os
import sys

import numpy as np
import torch

import checkpoint
from machinery import checked_ckpt, validate
from configurator import UserError

OLD_ONLY = ("format", "tensors", "crc", "rng", "layout", "header_crc")  # not today's fields


def _load(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the checkpoint is incomplete")
    except Exception as e:  # truncated zip, a pickle that wants to run code, ...
        raise UserError(f"cannot read {path}: {checked_ckpt._first_line(e)}")


def _checked(path, name, key, t, want):
    if not isinstance(t, torch.Tensor) or validate.crc(t) != want:
        raise UserError(f"{path}: {key} of {name} fails its checksum: not converted")
    return t.reshape(-1)


def _rng(state):
    """An old RNG state (bytes, numpy's keys as bytes, python's tuple) as today's JSON."""
    b64 = lambda b: base64.b64encode(bytes(b)).decode()
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    version, words, gauss_next = state["python"]
    out = {"torch": b64(state["torch"]),
           "numpy": [kind, np.frombuffer(keys, dtype=np.uint32).tolist(), pos, has_gauss, gauss],
           "python": [version, list(words), gauss_next]}
    if "cuda" in state:
        out["cuda"] = b64(state["cuda"])
    return out


def _files(path, h):
    """[(layout, tensors)] per new file, and the RNG states, from the old files (checked)."""
    if h.get("format") == "consolidated":
        file, tensors, layout = os.path.join(path, "ckpt.pt"), {}, {}
        for name, entry in h["tensors"].items():
            layout[name] = [0, int(np.prod(h["shapes"][name]))]
            for key, t in entry.items():
                tensors[f"{name}/{key}"] = _checked(file, name, key, t, h["crc"][name][key])
        return [(layout, tensors)], h["rng"]
    files, rngs = [], []
    for r in range(h["world_size"]):
        file = os.path.join(path, f"shard-{r:05d}.pt")
        shard = _load(file)
        if shard.get("save_id") != h["save_id"]:
            raise UserError(f"{file} belongs to another save than its meta.pt")
        layout, tensors = {}, {}
        for name, piece in shard["pieces"].items():
            layout[name] = [piece["lo"], piece["hi"]]
            for key, t in piece.items():
                if key not in ("lo", "hi", "crc"):
                    tensors[f"{name}/{key}"] = _checked(file, name, key, t, piece["crc"][key])
        files.append((layout, tensors))
        rngs.append(shard["rng"])
    return files, rngs


def convert(path):
    """Rewrite the old checkpoint in folder path as checkpoint.json + shard-NNNNN.safetensors."""
    if os.path.isfile(os.path.join(path, checkpoint.HEADER)):
        raise UserError(f"{path} is in today's format already")
    old = [f for f in checked_ckpt.OLD if os.path.isfile(os.path.join(path, f))]
    if not old:
        raise UserError(f"{path} holds neither ckpt.pt nor meta.pt: not an old checkpoint")
    h = _load(os.path.join(path, old[0]))
    if not isinstance(h, dict) or h.get("format") not in ("consolidated", "sharded"):
        raise UserError(f"{path}/{old[0]} is not a nanoZeRO checkpoint")
    try:
        pieces, rngs = _files(path, h)
        fp8 = h.get("fp8")
        if fp8:  # the amax histories: tensors of file 0
            pieces[0][1].update({f"fp8/{n}": t for n, t in fp8["history"].items()})
            fp8 = {"settings": fp8["settings"], "history": sorted(fp8["history"])}
        names = [checkpoint.shard_name(i) for i in range(len(pieces))]
        header = {k: v for k, v in h.items() if k not in OLD_ONLY}
        header.update(format=checkpoint.FORMAT, files=names, fp8=fp8, extra_keys=[],
                      layout=[layout for layout, _ in pieces], rng=[_rng(s) for s in rngs],
                      crc=[checked_ckpt.checksums(tensors) for _, tensors in pieces])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{path}: its old files are not the ones a save wrote ({e!r})")
    try:
        for i, (name, (_, tensors)) in enumerate(zip(names, pieces)):
            checked_ckpt.write_shard(os.path.join(path, name), tensors,
                                    {"save_id": header["save_id"], "file": str(i)})
        checked_ckpt.write_header(os.path.join(path, checkpoint.HEADER), header)
        files = checked_ckpt.Reader(path)  # read back: the header, every piece
        for i, crcs in enumerate(files.header["crc"]):
            for key in crcs:
                files.tensor(i, key)
    except BaseException:  # the folder as it was: the old files alone
        for name in [checkpoint.HEADER] + names:
            if os.path.exists(os.path.join(path, name)):
                os.remove(os.path.join(path, name))
        raise
    for name in os.listdir(path):
        if name in checked_ckpt.OLD or (name.startswith("shard-") and name.endswith(".pt")):
            os.remove(os.path.join(path, name))


def main(argv):
    if not argv or any(a.startswith("-") for a in argv):
        print("usage: python -m machinery.convert CKPT [CKPT ...]", file=sys.stderr)
        return 2
    for path in argv:
        try:
            convert(path)
        except (UserError, OSError) as e:
            print(f"{e}", file=sys.stderr)
            return 2
        print(f"converted {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
