"""
LoRA adapters, put into a built GPT from outside.

  - Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", Sec. 4.1: freeze W, learn
    W + (alpha/r) B @ A, A (r, in) random and B (out, r) zero, so training starts at exactly W.
  - microsoft/loralib's MergedLinear: adapters on some slices of the fused q|k|v projection only.
  - QLoRA's quantized frozen base is quant.py; a LoRALinear computes with either kind of weight.

Order: build the model (in its dtype), apply_lora, optionally quant.quantize_base (the other
order works too), then ZeRO(model, ...), which packs only requires_grad parameters: LoRA's.
Frozen weights and quantized buffers get no gradient and no optimizer state; they stay whole on
every rank up to ZeRO-2, and ZeRO-3 shards them with their block like any weight (gathered for
the block's forward and backward, never reduced or updated).
"""
import hashlib
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from model import GPT
from quant import QuantizedWeight, declared_linears, linear
from machinery.tensorfile import write_safetensors


def targets_of(linears):
    """The names LoRA can target: every output slice of the model's declared LINEARS."""
    return tuple(name for _, slices in linears for name in slices)


TARGETS = targets_of(GPT.LINEARS)  # model.py's: q, k, v, attn_out, mlp_fc, mlp_proj


class AdapterError(Exception):
    """An adapter file that is unreadable or does not fit this model (other base, other shapes)."""


def parse_targets(spec, linears=GPT.LINEARS):
    """'q,v' | 'all' | ('q', 'v') -> a tuple of the model's target names (targets_of(linears);
    model.py's TARGETS by default), in their order."""
    TARGETS = targets_of(linears)
    if spec == "all":
        names = TARGETS
    else:
        parts = spec.split(",") if isinstance(spec, str) else spec
        names = [s.strip() for s in parts]
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise ValueError(f"unknown LoRA target(s) {bad or spec!r}: "
                         f"use 'all' or a comma list of {', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


# ----------------------------------------------------------------------------------------------
# LoRA

class LoRALinear(nn.Module):
    """A frozen Linear plus (alpha/r) B @ A on some of its len(slices) equal output slices.

    The base weight and bias are registered as self.weight / self.bias, so state dict keys stay
    model.py's (`...attn.c_attn.weight`). For c_attn, slices=(True, False, True) adapts q and v:
    as in loralib's MergedLinear, lora_A stacks one (r, in) matrix per adapted slice and lora_B one
    (out/len(slices), r) matrix per adapted slice, so an unadapted slice has no parameter that
    could move it: its delta is exactly zero."""

    def __init__(self, weight, bias, r, alpha, dropout=0.0, slices=(True,)):
        super().__init__()
        out_f, in_f = weight.shape
        if r < 1:
            raise ValueError(f"LoRA rank {r}: need r >= 1")
        self.weight, self.bias = weight, bias  # frozen: a Parameter, or a QuantizedWeight module
        self.r, self.alpha, self.scaling, self.slices = r, alpha, alpha / r, tuple(slices)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        k, s = sum(slices), out_f // len(slices)  # adapted slices, rows per slice
        dev = weight.codes.device if isinstance(weight, QuantizedWeight) else weight.device
        A = torch.empty(k * r, in_f, device=dev)  # drawn in fp32 for any dtype
        nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # as nn.Linear
        self.lora_A = nn.Parameter(A.to(weight.dtype))  # (k*r, in)
        B = torch.zeros(k * s, r, device=dev, dtype=weight.dtype)
        self.lora_B = nn.Parameter(B)  # (k*s, r)
        self.merged = False
        self.base_matmul = None  # fp8.convert puts an FP8 product of the frozen base here

    def _place(self, parts, zero, dim):
        """Concatenate the adapted slices' pieces, with `zero` where a slice has no adapter."""
        parts = iter(parts)
        return torch.cat([next(parts) if on else zero for on in self.slices], dim=dim)

    def forward(self, x):
        if self.base_matmul is None:
            y = linear(x, self.weight, self.bias)
        else:
            y = self.base_matmul(x, self.weight, self.bias)
        if self.merged:
            return y  # B @ A already sits inside the weight
        k, s = sum(self.slices), self.lora_B.shape[0] // sum(self.slices)
        h = F.linear(self.dropout(x), self.lora_A).unflatten(-1, (k, self.r))  # (..., k, r)
        d = torch.einsum("...kr,ksr->...ks", h, self.lora_B.view(k, s, self.r))  # (..., k, s)
        d = self._place(d.unbind(-2), d.new_zeros(d.shape[:-2] + (s,)), dim=-1)  # (..., out)
        return y + d * self.scaling

    @torch.no_grad()
    def delta_weight(self):
        """(alpha/r) B @ A in its slices, in fp32: (out, in), zero rows where no adapter is."""
        if self.lora_A.untyped_storage().nbytes() == 0:
            raise RuntimeError("the LoRA weights are a freed ZeRO-3 shard: merge a gathered copy "
                               "(a model loaded from checkpoint.state_dict(zero, model))")
        A, B = self.lora_A.float(), self.lora_B.float()
        k, r, s = sum(self.slices), self.r, B.shape[0] // sum(self.slices)
        return self._place([B[i * s:(i + 1) * s] @ A[i * r:(i + 1) * r] for i in range(k)],
                           A.new_zeros(s, A.shape[1]), dim=0) * self.scaling

    @torch.no_grad()
    def merge(self, sign=1.0):
        """W += (alpha/r) B @ A in place, in fp32 and cast back to W's dtype; forward then skips
        the LoRA path (inference at the base's cost). unmerge() subtracts it again."""
        if isinstance(self.weight, QuantizedWeight):
            raise RuntimeError("cannot merge into a quantized base: "
                               "requantizing would lose the delta")
        if self.merged != (sign > 0):
            w = self.weight.float() + sign * self.delta_weight()  # in fp32
            self.weight.copy_(w.to(self.weight.dtype))
            self.merged = sign > 0

    def unmerge(self):
        self.merge(sign=-1.0)  # W back up to one rounding: ~1e-7 relative in fp32, not bitwise


def _loras(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def _named_blocks(model):
    """(name, block) of the model's declared blocks(), as named_modules() names them."""
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(b)], b) for b in model.blocks()]


def _replace(block, name, new):  # "attn.c_attn" -> block.attn.c_attn = new
    parent, child = name.rsplit(".", 1)
    setattr(block.get_submodule(parent), child, new)


def apply_lora(model, rank=8, alpha=1.0, dropout=0.0, targets=("q", "v")):
    """Freeze every parameter, replace the targeted Linears of each block by LoRALinear (trainable
    lora_A / lora_B in the base weight's dtype and device); returns the replaced module names.
    Before ZeRO(model, ...): ZeRO packs what requires grad when it is built."""
    linears = declared_linears(model)
    targets = parse_targets(targets, linears)
    if _loras(model):
        raise ValueError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for prefix, block in _named_blocks(model):
        for name, slice_names in linears:
            slices = tuple(t in targets for t in slice_names)  # which output slices to adapt
            if any(slices):
                m = block.get_submodule(name)
                _replace(block, name, LoRALinear(m.weight, m.bias, rank, alpha, dropout, slices))
                names.append(f"{prefix}.{name}")
    # coverage, in the spirit of minGPT's optimizer groups: every parameter is either trainable
    # LoRA or frozen base, never both, never neither
    for n, p in model.named_parameters():
        assert p.requires_grad == ("lora_" in n), f"{n}: requires_grad={p.requires_grad}"
    model.lora_settings = dict(rank=rank, alpha=alpha, dropout=dropout, targets=list(targets))
    return names


def merge_lora(model):
    """Inference at the base's cost; a no-op where already merged."""
    for m in _loras(model):
        m.merge()


def unmerge_lora(model):
    for m in _loras(model):
        m.unmerge()


@torch.no_grad()
def remove_adapter(model):
    """Back to the base: B = 0 makes every delta exactly zero, outputs bitwise the base's."""
    if any(m.merged for m in _loras(model)):
        raise RuntimeError("unmerge_lora(model) before removing the adapter")
    for m in _loras(model):
        m.lora_B.zero_()


# ----------------------------------------------------------------------------------------------
# Adapter files

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
    from machinery import validate  # validate.py imports this module
    try:  # safetensors: tensors and strings only, nothing that could run code
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            lora = {k: f.get_tensor(k) for k in f.keys()}
        settings, fp = json.loads(meta["settings"]), meta["base_fingerprint"]
    except Exception as e:
        message = f"{path}: not a readable adapter file ({type(e).__name__}: {e})"
        raise AdapterError(message.splitlines()[0])
    try:  # before apply_lora makes modules of them: a rank of 10^9 is 256 GB
        validate.check_adapter(settings, {k: list(t.shape) for k, t in lora.items()},
                               model.config.n_embd)
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
    if any(m.merged for m in _loras(model)):
        raise AdapterError("the model has LoRA merged in: unmerge_lora(model) first")
    params = {k: p for k, p in model.named_parameters() if "lora_" in k}
    if params.keys() != lora.keys() or any(params[k].shape != lora[k].shape for k in params):
        raise AdapterError(f"{path}: LoRA tensor names or shapes differ from the model's")
    for k, p in params.items():
        p.copy_(lora[k])
    return settings
