"""
LoRA adapters on disk, in PEFT's format, and the guard that an adapter loads only onto the base
and vocabulary it was trained on.

An adapter is a folder (OUT_DIR/adapter; export.py --to hf writes OUT/adapter the same way):
adapter_config.json (PEFT's LoraConfig) and adapter_model.safetensors (lora_A / lora_B per
module, PEFT's names), so `peft.PeftModel.from_pretrained(gpt2, folder)` runs it on transformers'
GPT2LMHeadModel. The safetensors metadata holds what PEFT has no field for: lora.py's settings,
a fingerprint of the base, the vocabulary's identity and a checksum of the tensors, as one JSON
value under one key (safetensors writes several keys in no fixed order: the same adapter would
give other bytes). Every claim is checked (machinery/validate.py) before a LoRA module is made.

PEFT adapts whole modules: lora_A (r, in), lora_B (out, r), delta = (lora_alpha / r) * B @ A.
lora.py adapts k slices of the fused q|k|v projection; that is one rank k*r adapter of all of
c_attn whose B is block-diagonal (peft_tensors). Converted here, not by peft: peft adapts
transformers' modules, not lora.py's slices, and a LoRA run must not need peft installed.
"""
import hashlib
import json
import os

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
from lora import apply_lora, lora_modules
from machinery import validate
from collectives import all_gather_object
from model import GPT

CONFIG, WEIGHTS, KEY = "adapter_config.json", "adapter_model.safetensors", "nanozero"
# lora.py's target names -> (the module they adapt, which of its equal slices; None: all of it)
SLICE_OF = {name: (path, j if len(names) > 1 else None)
            for path, names in GPT.LINEARS for j, name in enumerate(names)}


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


# ----------------------------------------------------------------------------------------------
# lora.py's tensors <-> PEFT's

def _layout(settings):
    """[(module, [adapted slice indices] or None)] of lora.py's settings, in model order."""
    out = {}
    for path, j in (SLICE_OF[t] for t in SLICE_OF if t in settings["targets"]):
        out.setdefault(path, None if j is None else [])
        if j is not None:
            out[path].append(j)
    return list(out.items())


def peft_tensors(lora_state, settings):
    """{PEFT name: tensor} of lora.py's LoRA tensors (our names), shapes checked against the
    settings. c_attn's k adapted slices become one rank k*r adapter: A is ours, B (3C, k*r) is
    block-diagonal (slice j's rows see only its own r columns of A's output; an unadapted
    slice's rows are zero)."""
    r, layout, out = settings["rank"], dict(_layout(settings)), {}
    for name in sorted(lora_state):
        ours = name.removesuffix(".lora_A").removesuffix(".lora_B")
        module = ours.split(".", 3)[-1]
        if module not in layout or {ours + ".lora_A", ours + ".lora_B"} - lora_state.keys():
            raise ValueError(f"LoRA tensor {name} does not fit targets {settings['targets']}")
        if name.endswith(".lora_B"):
            continue
        A, B, slices = lora_state[name], lora_state[ours + ".lora_B"], layout[module]
        k = len(slices) if slices else 1
        s = B.shape[0] // k  # rows per adapted slice
        if A.dim() != 2 or A.shape[0] != k * r or tuple(B.shape) != (k * s, r) or s == 0:
            raise ValueError(f"{ours} has A {list(A.shape)}, B {list(B.shape)}: not (k*r, in), "
                             f"(k*rows, r) for rank {r} and {k} slice(s)")
        if slices:  # our n-th block of B is q|k|v slice j
            full = B.new_zeros(3 * s, k * r)
            for n, j in enumerate(slices):
                full[j * s:(j + 1) * s, n * r:(n + 1) * r] = B[n * s:(n + 1) * s]
            B = full
        out[f"base_model.model.{ours}.lora_A.weight"] = A.contiguous()
        out[f"base_model.model.{ours}.lora_B.weight"] = B.contiguous()
    return out


def lora_tensors(peft, settings, n_layer):
    """peft_tensors undone: {our name: tensor}, each c_attn B's blocks taken back out. Written
    back to PEFT's form, it must give the file's tensors exactly (ValueError otherwise): no
    tensor missing or extra, none misshapen, none off c_attn's blocks (then it is no lora.py
    adapter)."""
    r, out = settings["rank"], {}
    try:
        for i in range(n_layer):
            for module, slices in _layout(settings):
                ours = f"transformer.h.{i}.{module}"
                A = peft[f"base_model.model.{ours}.lora_A.weight"]
                B = peft[f"base_model.model.{ours}.lora_B.weight"]
                if slices:  # our n-th block of B is q|k|v slice j's rows, its n-th r columns
                    s = B.shape[0] // 3
                    B = torch.cat([B[j * s:(j + 1) * s, n * r:(n + 1) * r]
                                   for n, j in enumerate(slices)])
                out[ours + ".lora_A"], out[ours + ".lora_B"] = A, B
        again = peft_tensors(out, settings)
    except (KeyError, IndexError, RuntimeError) as e:
        raise ValueError(f"its tensors are not the {n_layer} blocks of targets "
                         f"{settings['targets']} ({type(e).__name__}: {e})".splitlines()[0])
    if again.keys() != peft.keys() or any(not torch.equal(again[k], peft[k]) for k in peft):
        raise ValueError(f"its tensors are not what lora.py's settings {settings} make "
                         "(c_attn's B not block-diagonal, or tensors extra)")
    return out


def peft_config(settings, base_name=None):
    """adapter_config.json: PEFT's LoraConfig for peft_tensors' tensors. PEFT scales by
    lora_alpha / r, so c_attn's rank k*r gets lora_alpha k*alpha: alpha/r, lora.py's scaling,
    stays the same."""
    r, alpha, rank_pattern, alpha_pattern = settings["rank"], settings["alpha"], {}, {}
    layout = _layout(settings)
    k = len(dict(layout).get("attn.c_attn") or [None])
    if k > 1 and len(layout) > 1:  # c_attn's rank differs from the other modules'
        rank_pattern["attn.c_attn"], alpha_pattern["attn.c_attn"] = k * r, k * alpha
    elif k > 1:  # c_attn alone: its rank is the adapter's rank
        r, alpha = k * r, k * alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
        "r": r, "lora_alpha": alpha, "lora_dropout": settings["dropout"],
        # "attn.c_proj", not "c_proj": PEFT matches suffixes, and mlp.c_proj ends in c_proj too
        "target_modules": [m for m, _ in layout], "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "fan_in_fan_out": True,  # GPT-2's Conv1D stores (in, out): PEFT transposes the delta
        "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
    }


# ----------------------------------------------------------------------------------------------
# The folder

def save_adapter(folder, lora_state, settings, fingerprint, vocab=None, base_name=None):
    """Write the adapter folder: the tensors in PEFT's names, our settings, the base's
    fingerprint and the vocabulary's identity (validate.vocab_id) in their metadata, then
    adapter_config.json. Each file replaced whole (a crash leaves the old file or the new);
    the shapes are checked first (ValueError), so nothing is written for a bad state."""
    settings = {k: settings[k] for k in ("rank", "alpha", "dropout", "targets")}
    settings["targets"] = list(settings["targets"])
    tensors = peft_tensors(lora_state, settings)
    ours = {"settings": settings, "base_fingerprint": fingerprint, "vocab": vocab,
            "tensors": fingerprint_tensors(sorted(tensors.items()))}  # a flipped byte shows
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{WEIGHTS}.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={KEY: json.dumps(ours, sort_keys=True)})
    os.replace(tmp, os.path.join(folder, WEIGHTS))
    tmp = os.path.join(folder, f".{CONFIG}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(peft_config(settings, base_name), f, indent=2)
    os.replace(tmp, os.path.join(folder, CONFIG))


def read_adapter(path):
    """(adapter_config.json, our metadata, {PEFT name: tensor}) of an adapter folder (or its
    adapter_model.safetensors). AdapterError, one line, for anything unreadable."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.fspath(path))
    try:  # safetensors: tensors and strings only, nothing that could run code
        with open(os.path.join(folder, CONFIG)) as f:
            config = json.load(f)
        with safe_open(os.path.join(folder, WEIGHTS), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        message = f"{path}: not a readable adapter folder ({type(e).__name__}: {e})"
        raise AdapterError(message.splitlines()[0])
    try:
        ours = json.loads(meta[KEY])
        assert isinstance(ours, dict) and isinstance(config, dict)
        assert isinstance(ours.get("base_fingerprint"), str) and "tensors" in ours
    except (KeyError, ValueError, AssertionError):
        raise AdapterError(f"{path}: no base fingerprint or settings in its metadata (an adapter"
                           " from elsewhere?): train.py --lora and export.py write them")
    return config, ours, tensors


@torch.no_grad()
def load_adapter(model, path, vocab=None):
    """Load an adapter folder into model and return its settings. A model without LoRA gets
    apply_lora with the file's settings (checked first against their types, ranges and the
    file's tensors); one with LoRA must have the same settings. The checksums, the base
    fingerprint, the vocabulary (vocab: the model's validate.vocab_id, when known) and every
    name and shape must match, else AdapterError. Load before ZeRO wraps the model: under
    ZeRO-3 its LoRA parameters are shards."""
    config, ours, tensors = read_adapter(path)
    settings = ours.get("settings")
    try:  # before apply_lora makes modules of them: a rank of 10^9 is 256 GB
        got = fingerprint_tensors(sorted(tensors.items()))
        if got != ours["tensors"]:
            raise ValueError(f"its tensors fail their checksum (sha256 {got}, saved "
                             f"{ours['tensors']}): their bytes changed")
        validate.check_adapter(settings, model.config.n_embd)
        lora = lora_tensors(tensors, settings, model.config.n_layer)
        want = peft_config(settings, config.get("base_model_name_or_path"))
        edited = sorted(k for k in want if config.get(k) != want[k])
        if edited:  # peft would run another adapter than ours
            raise ValueError(f"{CONFIG}'s {edited[0]} {config.get(edited[0])!r} is not what its "
                             f"tensors' settings make ({want[edited[0]]!r}): edited?")
        if not all(t.isfinite().all() for t in lora.values()):
            raise ValueError("its tensors hold inf/NaN: use an adapter of an earlier checkpoint")
    except ValueError as e:
        raise AdapterError(f"{path}: {e}")
    if vocab is not None and ours.get("vocab") not in (None, vocab):
        raise AdapterError(f"{path} was trained on vocabulary {ours['vocab']}, this model reads "
                           f"{vocab}: the same ids would mean other tokens")
    base, fp = base_fingerprint(model), ours["base_fingerprint"]
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
    """The end of a LoRA run: the adapter alone (kilobytes) in OUT_DIR/adapter, PEFT's folder,
    its full tensors gathered onto rank 0 one by one (a collective). A failed write (a full
    disk) is a CheckpointError on every rank that names the checkpoint holding the adapter."""
    full, error = checkpoint.state_dict(zero, model), None
    path = os.path.join(out_dir, "adapter")
    if zero.rank == 0:
        try:
            save_adapter(path, adapter_state(full), model.lora_settings, model.base_id,
                         validate.vocab_id(meta))
            size = os.path.getsize(os.path.join(path, WEIGHTS))
            print0(f"saved {path} (PEFT's adapter folder, {size / 1024:.1f} KiB)")
        except OSError as e:
            newest = (checkpoint.list_checkpoints(out_dir) or ["no checkpoint"])[-1]
            error = (f"could not write {path} ({e.strerror or e}); the run is saved: {newest} "
                     "holds the adapter, and `python export.py` writes it out (--to hf OUT)")
    error = all_gather_object(error, zero.world_size)[0]
    if error:
        raise checkpoint.CheckpointError(error)
