"""
Guards LoRA's adapter files: an adapter loads only onto the base and vocabulary it was trained on.

An adapter file (OUT_DIR/adapter.safetensors) holds the LoRA tensors alone, kilobytes, with
the settings (JSON), a fingerprint of the base and the vocabulary's identity as metadata.
Everything it claims is checked (machinery/validate.py) before a LoRA module is made from it.
"""
import hashlib
import json
import os

import torch
import torch.nn as nn
from safetensors import safe_open

import checkpoint
from lora import apply_lora, lora_modules
from machinery import validate
from collectives import all_gather_object
from machinery.tensorfile import check_crcs, write_safetensors


class AdapterError(Exception):
    """An adapter file that is unreadable or does not fit this model (other base, other shapes)."""


def adapter_state(state_dict):
    """The LoRA tensors of a full state dict. Under ZeRO-3 pass checkpoint.state_dict(zero,
    model): the model's own LoRA parameters are freed shards there, and an adapter saved from
    them would hold shape-[0] tensors instead of the trained weights."""
    out = {}
    for k, t in state_dict.items():
        if "lora_" in k:
            if t.untyped_storage().nbytes() == 0:
                raise AdapterError(f"{k} has no storage (a ZeRO-3 shard): "
                                   "use checkpoint.state_dict(zero, model)")
            out[k] = t.detach().cpu().clone()
    return out


def base_fingerprint(model_or_state_dict):
    """Short sha256 of the base: every non-LoRA tensor's name, shape and fp32 bytes. Quantized
    buffers belong to the base (an adapter trained on an NF4 base matches only that NF4 base);
    integer codes survive fp32 exactly, so an fp32 copy of the base hashes the same."""
    sd = model_or_state_dict
    sd = sd.state_dict() if isinstance(sd, nn.Module) else sd
    return fingerprint_tensors((k, sd[k]) for k in sorted(k for k in sd if "lora_" not in k))


def fingerprint_tensors(named_tensors):
    """base_fingerprint's hash of (name, tensor) pairs in name order, taken one at a time (so
    hf.base_fingerprint can read them from a file one at a time)."""
    h = hashlib.sha256()
    for k, t in named_tensors:
        t = t.detach().float().contiguous().cpu()
        h.update(f"{k}{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def save_adapter(path, lora_tensors, settings, fingerprint, vocab=None):
    """A safetensors file (adapter.safetensors): the LoRA tensors, with the settings (JSON),
    the base's fingerprint and the vocabulary's identity (validate.vocab_id) as its metadata.
    Written atomically (tensorfile.py): a crash leaves the old file or the new one."""
    settings = {k: settings[k] for k in ("rank", "alpha", "dropout", "targets")}
    settings["targets"] = list(settings["targets"])
    header = {k: (t.dtype, tuple(t.shape)) for k, t in lora_tensors.items()}
    meta = {"settings": json.dumps(settings), "base_fingerprint": fingerprint}
    write_safetensors(path, header, iter(lora_tensors.items()),
                      metadata=meta if vocab is None else dict(meta, vocab=vocab))


@torch.no_grad()
def load_adapter(model, path, vocab=None):
    """Load an adapter file into model and return its settings. A model without LoRA gets
    apply_lora with the file's settings (checked first against their types, ranges and the
    file's tensors); one with LoRA must have the same settings. The base fingerprint, the
    vocabulary (vocab: the model's validate.vocab_id, when known) and every name and shape must
    match, else AdapterError. Load before ZeRO wraps the model: under ZeRO-3 its LoRA parameters
    are shards."""
    try:  # safetensors: tensors and strings only, nothing that could run code
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            lora = {k: f.get_tensor(k) for k in f.keys()}
        settings, fp = json.loads(meta["settings"]), meta["base_fingerprint"]
    except Exception as e:
        message = f"{path}: not a readable adapter file ({type(e).__name__}: {e})"
        raise AdapterError(message.splitlines()[0])
    try:  # every tensor against its crc32; before apply_lora makes modules of them: a rank of
        check_crcs(meta, lora)  # 10^9 is 256 GB
        validate.check_adapter(settings, {k: list(t.shape) for k, t in lora.items()},
                               model.config.n_embd)
        if not all(t.isfinite().all() for t in lora.values()):
            raise ValueError("its tensors hold inf/NaN: use an adapter of an earlier checkpoint")
    except ValueError as e:
        raise AdapterError(f"{path}: {e}")
    if vocab is not None and meta.get("vocab", vocab) != vocab:
        raise AdapterError(f"{path} was trained on vocabulary {meta['vocab']}, this model reads "
                           f"{vocab}: the same ids would mean other tokens")
    base = base_fingerprint(model)
    if fp != base:
        raise AdapterError(f"{path} was trained on base {fp}, this model is base {base}")
    have = getattr(model, "lora_settings", None)
    if have is None:
        apply_lora(model, **settings)
    elif have != settings:
        raise AdapterError(f"{path} has LoRA settings {settings}, the model has {have}")
    if any(m.merged for m in lora_modules(model)):
        raise AdapterError("the model has LoRA merged in: unmerge_lora(model) first")
    params = {k: p for k, p in model.named_parameters() if "lora_" in k}
    if params.keys() != lora.keys() or any(params[k].shape != lora[k].shape for k in params):
        raise AdapterError(f"{path}: LoRA tensor names or shapes differ from the model's")
    for k, p in params.items():
        p.copy_(lora[k])
    return settings


def save_run_adapter(out_dir, zero, model, meta, print0):
    """The end of a LoRA run: the adapter alone (kilobytes) in OUT_DIR/adapter.safetensors,
    its full tensors gathered onto rank 0 one by one (a collective). A failed write (a full
    disk) is a CheckpointError on every rank that names the checkpoint holding the adapter."""
    full, error = checkpoint.state_dict(zero, model), None
    path = os.path.join(out_dir, "adapter.safetensors")
    if zero.rank == 0:
        try:
            save_adapter(path, adapter_state(full), model.lora_settings, model.base_id,
                         validate.vocab_id(meta))
            print0(f"saved {path} ({os.path.getsize(path) / 1024:.1f} KiB)")
        except OSError as e:
            newest = (checkpoint.list_checkpoints(out_dir) or ["no checkpoint"])[-1]
            error = (f"could not write {path} ({e.strerror or e}); the run is saved: {newest} "
                     "holds the adapter, and `python export.py` writes it out (--to hf OUT: "
                     "PEFT's adapter folder)")
    error = all_gather_object(error, zero.world_size)[0]
    if error:
        raise checkpoint.CheckpointError(error)
