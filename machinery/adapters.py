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
c_attn whose B is block-diagonal (peft_tensors). Any model's LoRA modules convert so (a fork's
too): their slices come from the model (lora_layout) and go into the metadata. Converted here,
not by peft: peft adapts transformers' modules, not lora.py's slices, and a LoRA run must not
need peft installed.
"""
import hashlib
import json
import os

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
from lora import LoRALinear, apply_lora, lora_modules
from machinery import declared, validate
from collectives import all_gather_object
from configurator import UserError

CONFIG, WEIGHTS, KEY = "adapter_config.json", "adapter_model.safetensors", "nanozero"




def adapter_state(state_dict):
    """The LoRA tensors of a full state dict. Under ZeRO-3 pass checkpoint.state_dict(zero,
    model): the model's own LoRA parameters are freed shards there, and an adapter saved from
    them would hold shape-[0] tensors instead of the trained weights."""
    out = {}
    for k, t in state_dict.items():
        if "lora_" in k:
            if t.untyped_storage().nbytes() == 0:
                raise UserError(f"{k} has no storage (a ZeRO-3 shard): "
                                "use checkpoint.state_dict(zero, model)")
            out[k] = t.detach().cpu().clone()
    return out


def base_fingerprint(model_or_state_dict):
    """Short sha256 of the base: every non-LoRA tensor's name, shape and fp32 bytes. Quantized
    buffers belong to the base (an adapter trained on an NF4 base matches only that NF4 base);
    integer codes survive fp32 exactly, so an fp32 copy of the base hashes the same."""
    sd = model_or_state_dict
    sd = sd.state_dict() if isinstance(sd, nn.Module) else sd
    if any(is_fake(t) for t in sd.values()):  # memory.py --measure: shapes, no bytes
        return None
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

def lora_layout(model):
    """{LoRA module name: which of its equal output slices it adapts}: lora.py's LoRALinears."""
    return {n: list(m.slices) for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def peft_tensors(lora_state, layout, r):
    """{PEFT name: tensor} of lora.py's LoRA tensors (our names), shapes checked against the
    layout and rank r (ValueError). A module with k adapted slices of n becomes one rank k*r
    adapter: A is ours, B (n*rows, k*r) is block-diagonal (slice j's rows see only its own r
    columns of A's output; an unadapted slice's rows are zero)."""
    want = {f"{m}.lora_{x}" for m in layout for x in "AB"}
    if set(lora_state) != want:
        bad = sorted(set(lora_state) ^ want)[0]
        raise ValueError(f"LoRA tensor {bad} does not fit the model's LoRA modules")
    out = {}
    for m, slices in layout.items():
        A, B, k = lora_state[m + ".lora_A"], lora_state[m + ".lora_B"], sum(slices)
        s = B.shape[0] // k  # rows per adapted slice
        if A.dim() != 2 or A.shape[0] != k * r or tuple(B.shape) != (k * s, r) or s == 0:
            raise ValueError(f"{m} has A {list(A.shape)}, B {list(B.shape)}: not (k*r, in), "
                             f"(k*rows, r) for rank {r} and {k} slice(s)")
        if len(slices) > 1:  # our n-th block of B is slice j's
            full = B.new_zeros(len(slices) * s, k * r)
            for n, j in enumerate(j for j, on in enumerate(slices) if on):
                full[j * s:(j + 1) * s, n * r:(n + 1) * r] = B[n * s:(n + 1) * s]
            B = full
        out[f"base_model.model.{m}.lora_A.weight"] = A.contiguous()
        out[f"base_model.model.{m}.lora_B.weight"] = B.contiguous()
    return out


def lora_tensors(peft, layout, r):
    """peft_tensors undone: {our name: tensor}, each B's blocks taken back out. Written back to
    PEFT's form, it must give the file's tensors exactly (ValueError otherwise): no tensor
    missing or extra, none misshapen, none off its blocks (then it is no lora.py adapter)."""
    out = {}
    try:
        for m, slices in layout.items():
            A = peft[f"base_model.model.{m}.lora_A.weight"]
            B = peft[f"base_model.model.{m}.lora_B.weight"]
            if len(slices) > 1:  # slice j's rows, its n-th r columns: our n-th block of B
                s = B.shape[0] // len(slices)
                B = torch.cat([B[j * s:(j + 1) * s, n * r:(n + 1) * r]
                               for n, j in enumerate(j for j, on in enumerate(slices) if on)])
            out[m + ".lora_A"], out[m + ".lora_B"] = A, B
        again = peft_tensors(out, layout, r)
    except (KeyError, IndexError, RuntimeError) as e:
        raise ValueError(f"its tensors do not fit its LoRA modules ({type(e).__name__}: "
                         f"{e})".splitlines()[0])
    if again.keys() != peft.keys() or any(not torch.equal(again[k], peft[k]) for k in peft):
        raise ValueError("its tensors are not what lora.py's layout makes (a B not "
                         "block-diagonal, or tensors extra)")
    return out


def _suffix(name):
    """transformer.h.0.attn.c_attn -> attn.c_attn: the module's name inside its block."""
    parts = name.split(".")
    return ".".join(parts[next((i for i, p in enumerate(parts) if p.isdigit()), -1) + 1:])


def peft_config(settings, layout, conv1d, base_name=None):
    """adapter_config.json: PEFT's LoraConfig for peft_tensors' tensors. PEFT scales by
    lora_alpha / r, so a module of k adapted slices (rank k*r) gets lora_alpha k*alpha:
    alpha/r, lora.py's scaling, stays the same. conv1d: the base stores (in, out), as GPT-2's
    Conv1D does (PEFT then transposes the delta)."""
    r, alpha = settings["rank"], settings["alpha"]
    ks = {_suffix(m): sum(slices) for m, slices in layout.items()}
    if len(set(ks.values())) == 1:  # one k for all (c_attn alone): the adapter's rank
        k, ks = next(iter(ks.values())), {}
        r, alpha = k * r, k * alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
        "r": r, "lora_alpha": alpha, "lora_dropout": settings["dropout"],
        # "attn.c_proj", not "c_proj": PEFT matches suffixes, and mlp.c_proj ends in c_proj too
        "target_modules": sorted(set(_suffix(m) for m in layout)),
        "rank_pattern": {m: k * r for m, k in ks.items() if k != 1},
        "alpha_pattern": {m: k * alpha for m, k in ks.items() if k != 1},
        "fan_in_fan_out": conv1d, "bias": "none", "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
    }


def _conv1d(model):
    return getattr(model, "ARCH", None) == "gpt2"  # GPT-2's Hugging Face layout: Conv1D


# ----------------------------------------------------------------------------------------------
# The folder

def save_adapter(folder, model, fingerprint, vocab=None, base_name=None, lora_state=None):
    """Write model's adapter folder: the LoRA tensors (lora_state, or the model's own) in PEFT's
    names; our settings, the modules' slices, the base's fingerprint and the vocabulary's
    identity (validate.vocab_id) in their metadata; then adapter_config.json. Each file replaced
    whole (a crash leaves the old file or the new); the shapes are checked first (ValueError),
    so nothing is written for a bad state."""
    settings = {k: model.lora_settings[k] for k in ("rank", "alpha", "dropout", "targets")}
    settings["targets"], layout = list(settings["targets"]), lora_layout(model)
    if lora_state is None:
        lora_state = adapter_state(model.state_dict())
    tensors = peft_tensors(lora_state, layout, settings["rank"])
    ours = {"settings": settings, "slices": layout, "base_fingerprint": fingerprint,
            "vocab": vocab, "tensors": fingerprint_tensors(sorted(tensors.items()))}
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{WEIGHTS}.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={KEY: json.dumps(ours, sort_keys=True)})
    os.replace(tmp, os.path.join(folder, WEIGHTS))
    tmp = os.path.join(folder, f".{CONFIG}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(peft_config(settings, layout, _conv1d(model), base_name), f, indent=2)
    os.replace(tmp, os.path.join(folder, CONFIG))


def read_adapter(path):
    """(adapter_config.json, our metadata, {PEFT name: tensor}) of an adapter folder (or its
    adapter_model.safetensors). UserError, one line, for anything unreadable."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.fspath(path))
    for name in (CONFIG, WEIGHTS):  # before either is opened: a FIFO would wait for ever
        kind = validate.file_kind(os.path.join(folder, name))
        if kind not in (None, "a file"):
            raise UserError(f"{os.path.join(folder, name)} is {kind}, not a file: not a "
                            "readable adapter folder")
    try:  # safetensors: tensors and strings only, nothing that could run code
        with open(os.path.join(folder, CONFIG)) as f:
            config = json.load(f)
        with safe_open(os.path.join(folder, WEIGHTS), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise UserError(f"{path}: not a readable adapter folder ({type(e).__name__}: {e})"
                        .splitlines()[0])
    try:
        ours = json.loads(meta[KEY])
        assert isinstance(ours, dict) and isinstance(config, dict)
        assert isinstance(ours.get("base_fingerprint"), str) and "tensors" in ours
    except (KeyError, ValueError, AssertionError):
        raise UserError(f"{path}: no base fingerprint or settings in its metadata (an adapter"
                        " from elsewhere?): train.py --lora and export.py write them")
    return config, ours, tensors


@torch.no_grad()
def load_adapter(model, path, vocab=None):
    """Load an adapter folder into model and return its settings. A model without LoRA gets
    apply_lora with the file's settings (checked first against their types, ranges and the
    file's tensors); one with LoRA must have the same settings. The checksums, the base
    fingerprint, the vocabulary (vocab: the model's validate.vocab_id, when known) and every
    name and shape must match, else UserError. Load before ZeRO wraps the model: under
    ZeRO-3 its LoRA parameters are shards."""
    config, ours, tensors = read_adapter(path)
    settings, layout = ours.get("settings"), ours.get("slices")
    try:  # before apply_lora makes modules of them: a rank of 10^9 is 256 GB
        got = fingerprint_tensors(sorted(tensors.items()))
        if got != ours["tensors"]:
            raise ValueError(f"its tensors fail their checksum (sha256 {got}, saved "
                             f"{ours['tensors']}): their bytes changed")
        validate.check_adapter(settings, declared.width(model),
                               validate.targets_of(validate.declared_linears(model)))
        if not isinstance(layout, dict) or not all(
                isinstance(v, list) and any(v) and all(isinstance(b, bool) for b in v)
                for v in layout.values()):
            raise ValueError(f"its slices {str(layout)[:60]} are not lists of booleans")
        lora = lora_tensors(tensors, layout, settings["rank"])
        want = peft_config(settings, layout, _conv1d(model),
                           config.get("base_model_name_or_path"))
        edited = sorted(k for k in want if config.get(k) != want[k])
        if edited:  # peft would run another adapter than ours
            raise ValueError(f"{CONFIG}'s {edited[0]} {config.get(edited[0])!r} is not what its "
                             f"tensors' settings make ({want[edited[0]]!r}): edited?")
        if not all(t.isfinite().all() for t in lora.values()):
            raise ValueError("its tensors hold inf/NaN: use an adapter of an earlier checkpoint")
    except ValueError as e:
        raise UserError(f"{path}: {e}")
    if vocab is not None and ours.get("vocab") not in (None, vocab):
        raise UserError(f"{path} was trained on vocabulary {ours['vocab']}, this model reads "
                        f"{vocab}: the same ids would mean other tokens")
    base, fp = base_fingerprint(model), ours["base_fingerprint"]
    if fp != base:
        raise UserError(f"{path} was trained on base {fp}, this model is base {base}")
    have = getattr(model, "lora_settings", None)
    if have is None:
        apply_lora(model, **settings)
    elif have != settings:
        raise UserError(f"{path} has LoRA settings {settings}, the model has {have}")
    if any(m.merged for m in lora_modules(model)):
        raise UserError("the model has LoRA merged in: unmerge_lora(model) first")
    params = {k: p for k, p in model.named_parameters() if "lora_" in k}
    if lora_layout(model) != layout or params.keys() != lora.keys() \
            or any(params[k].shape != lora[k].shape for k in params):
        raise UserError(f"{path}: LoRA tensor names or shapes differ from the model's")
    for k, p in params.items():
        p.copy_(lora[k])
    return settings


def save_run_adapter(out_dir, zero, model, meta, print0):
    """The end of a LoRA run: the adapter alone (kilobytes) in OUT_DIR/adapter, PEFT's folder,
    its full tensors gathered onto rank 0 one by one (a collective). A failed write (a full
    disk) is a UserError on every rank that names the checkpoint holding the adapter."""
    full, error = checkpoint.state_dict(zero, model), None
    path = os.path.join(out_dir, "adapter")
    if zero.rank == 0:
        try:
            save_adapter(path, model, model.base_id, validate.vocab_id(meta),
                         lora_state=adapter_state(full))
            size = os.path.getsize(os.path.join(path, WEIGHTS))
            print0(f"saved {path} (PEFT's adapter folder, {size / 1024:.1f} KiB)")
        except OSError as e:
            newest = (checkpoint.list_checkpoints(out_dir) or ["no checkpoint"])[-1]
            error = (f"could not write {path} ({e.strerror or e}); the run is saved: {newest} "
                     "holds the adapter, and `python export.py` writes it out (--to hf OUT)")
    error = all_gather_object(error, zero.world_size)[0]
    if error:
        raise UserError(error)
