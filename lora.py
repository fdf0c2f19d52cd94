"""
LoRA adapters and a quantized frozen base (QLoRA), put into a built GPT from outside.

  - Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models": freeze W and learn
    W + (alpha/r) B @ A, A (r, in) random and B (out, r) zero, so training starts at exactly W.
  - microsoft/loralib's MergedLinear: adapters on some slices of the fused q|k|v projection only.
  - Dettmers et al. 2023, "QLoRA": the frozen base as 4-bit NormalFloat (NF4) in blocks of 64 with
    absmax scales, the scales themselves quantized ("double quantization"), dequantized on the fly.

Order: build the model (in its dtype), apply_lora, optionally quantize_base (the other order
works too), then ZeRO(model, ...), which packs only requires_grad parameters: the LoRA ones.
Frozen weights and quantized buffers get no gradient and no optimizer state; they stay whole on
every rank up to ZeRO-2, and ZeRO-3 shards them with their block like any weight (gathered for
the block's forward and backward, never reduced or updated).
"""
import hashlib
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGETS = ("q", "k", "v", "attn_out", "mlp_fc", "mlp_proj")
LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # per block; q|k|v share c_attn


class AdapterError(Exception):
    """An adapter file that does not fit this model (another base, other shapes) or is unreadable."""


def parse_targets(spec):
    """'q,v' | 'all' | ('q', 'v') -> a tuple of names from TARGETS, in TARGETS' order."""
    names = TARGETS if spec == "all" else [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec)]
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise ValueError(f"unknown LoRA target(s) {bad or spec!r}: use 'all' or a comma list of {', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


# ----------------------------------------------------------------------------------------------
# Quantized storage of a frozen weight

def nf4_code():
    """The 16 NF4 values (QLoRA appendix E; bitsandbytes' create_normal_map): N(0, 1) quantiles at
    evenly spaced probabilities, 8 positive and 7 negative so that 0 is exact (4 bits cannot be
    symmetric and hold 0), the outermost at p = 0.9677 since p = 1 is infinite; scaled to [-1, 1]."""
    p = lambda n: torch.linspace(0.9677083, 0.5, n, dtype=torch.float64)[:-1]
    v = torch.cat([torch.special.ndtri(p(9)), -torch.special.ndtri(p(8)), torch.zeros(1, dtype=torch.float64)])
    return (v.sort().values / v.max()).float()  # (16,), [7] == 0


def _absmax_int8(x):
    """Symmetric absmax quantization of each row to [-127, 127]: x ~= q * scale."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x / scale).to(torch.int8), scale.squeeze(-1)


class QuantizedWeight(nn.Module):
    """A frozen weight held in buffers (not parameters: no gradient, no optimizer state, not in
    ZeRO's buffers), rebuilt by dequantize(). int8: one fp32 scale per output row (8 + 32/in bits
    per parameter). nf4: blocks of `block` values of the flattened weight, two 4-bit codes per
    byte, one fp32 absmax per block (4 + 32/64 bits), or with double_quant 4 + 8/64 + 32/(64*256)."""

    def __init__(self, w, mode="nf4", double_quant=False, block=64):
        super().__init__()
        if mode not in ("int8", "nf4") or block % 2:
            raise ValueError(f"quantize mode {mode!r}, block {block}: use 'int8' or 'nf4' and an even block")
        self.mode, self.double_quant, self.block = mode, double_quant, block
        self.shape, self.dtype = tuple(w.shape), w.dtype
        w = w.detach().float()
        if mode == "int8":  # codes (out, in) int8, scale (out,) fp32
            [self.register_buffer(n, t) for n, t in zip(("codes", "scale"), _absmax_int8(w))]
            return
        self.register_buffer("code", nf4_code().to(w.device), persistent=False)  # the 16 values
        flat = F.pad(w.reshape(-1), (0, -w.numel() % block)).view(-1, block)  # (nblocks, block)
        absmax = flat.abs().amax(1)  # (nblocks,)
        if double_quant:
            # the scales are positive and alike: subtract their mean, store them as int8 in blocks
            # of 256 with one fp32 scale each (the paper uses 8-bit floats; linear int8 here)
            c = F.pad(absmax - absmax.mean(), (0, -absmax.numel() % 256)).view(-1, 256)
            q, s = _absmax_int8(c)
            self.register_buffer("absmax_q", q.view(-1)[:absmax.numel()].clone())  # (nblocks,)
            self.register_buffer("absmax_scale", s)  # (ceil(nblocks / 256),)
            self.register_buffer("absmax_mean", absmax.mean())
            absmax = self._absmax()  # encode against the scales the decoder will see
        else:
            self.register_buffer("absmax", absmax)
        # nearest code: bucketize against the midpoints between neighbouring code values
        mid = (self.code[1:] + self.code[:-1]) / 2
        idx = torch.bucketize(flat / absmax.clamp(min=1e-12)[:, None], mid).to(torch.uint8).view(-1)
        self.register_buffer("codes", idx[0::2] << 4 | idx[1::2])  # (padded numel / 2,) uint8

    def _absmax(self):  # (nblocks,) fp32, decoded from 8 bits under double quantization
        if not self.double_quant:
            return self.absmax
        s = self.absmax_scale.repeat_interleave(256)[:self.absmax_q.numel()]
        return self.absmax_q.float() * s + self.absmax_mean

    def dequantize(self, dtype=None):
        """The weight (out, in), computed in fp32, cast to dtype (default: the original's)."""
        if self.mode == "int8":
            w = self.codes.float() * self.scale[:, None]
        else:
            idx = torch.stack([self.codes >> 4, self.codes & 15], dim=-1).view(-1).long()
            w = (self.code[idx].view(-1, self.block) * self._absmax()[:, None]).view(-1)
            w = w[:math.prod(self.shape)].view(self.shape)
        return w.to(dtype or self.dtype)


class _DequantLinear(torch.autograd.Function):
    """x @ W^T that saves no full weight for backward: backward dequantizes again (QLoRA trades
    compute for memory). The weight is frozen, so only x gets a gradient."""

    @staticmethod
    def forward(ctx, x, qw):
        ctx.qw = qw  # the module, i.e. its few-bit buffers, not a dequantized copy
        return x @ qw.dequantize(x.dtype).t()

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.qw.dequantize(g.dtype), None


def _linear(x, weight, bias):
    if isinstance(weight, QuantizedWeight):
        y = _DequantLinear.apply(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class QuantLinear(nn.Module):
    """A frozen Linear whose weight is a QuantizedWeight (for the Linears LoRA does not adapt)."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return _linear(x, self.weight, self.bias)


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
        A = nn.init.kaiming_uniform_(torch.empty(k * r, in_f, device=dev), a=math.sqrt(5))  # as nn.Linear
        self.lora_A = nn.Parameter(A.to(weight.dtype))  # (k*r, in), drawn in fp32 for any dtype
        self.lora_B = nn.Parameter(torch.zeros(k * s, r, device=dev, dtype=weight.dtype))  # (k*s, r)
        self.merged = False

    def _place(self, parts, zero, dim):
        """Concatenate the adapted slices' pieces, with `zero` where a slice has no adapter."""
        parts = iter(parts)
        return torch.cat([next(parts) if on else zero for on in self.slices], dim=dim)

    def forward(self, x):
        y = _linear(x, self.weight, self.bias)
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
                               "(a model loaded from zero.full_state_dict(model))")
        A, B = self.lora_A.float(), self.lora_B.float()
        k, r, s = sum(self.slices), self.r, B.shape[0] // sum(self.slices)
        return self._place([B[i * s:(i + 1) * s] @ A[i * r:(i + 1) * r] for i in range(k)],
                           A.new_zeros(s, A.shape[1]), dim=0) * self.scaling

    @torch.no_grad()
    def merge(self, sign=1.0):
        """W += (alpha/r) B @ A in place, in fp32 and cast back to W's dtype; forward then skips
        the LoRA path (inference at the base's cost). unmerge() subtracts it again."""
        if isinstance(self.weight, QuantizedWeight):
            raise RuntimeError("cannot merge into a quantized base: requantizing would lose the delta")
        if self.merged != (sign > 0):
            self.weight.copy_((self.weight.float() + sign * self.delta_weight()).to(self.weight.dtype))
            self.merged = sign > 0

    def unmerge(self):
        self.merge(sign=-1.0)  # W back up to one rounding: ~1e-7 relative in fp32, not bitwise


def _loras(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def _replace(block, name, new):  # "attn.c_attn" -> block.attn.c_attn = new
    parent, child = name.rsplit(".", 1)
    setattr(block.get_submodule(parent), child, new)


def apply_lora(model, rank=8, alpha=1.0, dropout=0.0, targets=("q", "v")):
    """Freeze every parameter, replace the targeted Linears of each block by LoRALinear (trainable
    lora_A / lora_B in the base weight's dtype and device); returns the replaced module names.
    Before ZeRO(model, ...): ZeRO packs what requires grad when it is built."""
    targets = parse_targets(targets)
    if _loras(model):
        raise ValueError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    qkv = tuple(t in targets for t in ("q", "k", "v"))  # which slices of the fused c_attn
    slices = dict(zip(LINEARS, [qkv] + [(t in targets,) for t in ("attn_out", "mlp_fc", "mlp_proj")]))
    names = []
    for i, block in enumerate(model.transformer.h):
        for name in (n for n in LINEARS if any(slices[n])):
            m = block.get_submodule(name)
            _replace(block, name, LoRALinear(m.weight, m.bias, rank, alpha, dropout, slices[name]))
            names.append(f"transformer.h.{i}.{name}")
    # coverage, in the spirit of minGPT's optimizer groups: every parameter is either trainable
    # LoRA or frozen base, never both, never neither
    for n, p in model.named_parameters():
        assert p.requires_grad == ("lora_" in n), f"{n}: requires_grad={p.requires_grad}"
    model.lora_settings = dict(rank=rank, alpha=alpha, dropout=dropout, targets=list(targets))
    return names


def merge_lora(model):  # inference at the base's cost; a no-op where already merged
    [m.merge() for m in _loras(model)]


def unmerge_lora(model):
    [m.unmerge() for m in _loras(model)]


@torch.no_grad()
def remove_adapter(model):
    """Back to the base: B = 0 makes every delta exactly zero, outputs bitwise the base's."""
    if any(m.merged for m in _loras(model)):
        raise RuntimeError("unmerge_lora(model) before removing the adapter")
    [m.lora_B.zero_() for m in _loras(model)]


def quantize_base(model, mode="nf4", double_quant=False, block=64):
    """Quantize the weights of every block's four Linears, LoRA-wrapped or not (the tied
    embedding / head stay as they are). Returns the quantized module names."""
    names = []
    for i, blk in enumerate(model.transformer.h):
        for name in LINEARS:
            m = blk.get_submodule(name)
            if isinstance(m.weight, QuantizedWeight) or getattr(m, "merged", False):
                raise ValueError(f"transformer.h.{i}.{name} is already quantized or has LoRA merged in")
            qw = QuantizedWeight(m.weight, mode, double_quant, block)
            if isinstance(m, LoRALinear):
                del m.weight  # the Parameter goes, the module of buffers takes its name
                m.weight = qw
            else:
                _replace(blk, name, QuantLinear(qw, m.bias))
            names.append(f"transformer.h.{i}.{name}")
    return names


def quantized_bytes(model):
    """{name: {"params", "bytes", "bits_per_param"}} per quantized weight, by summing the buffers
    actually stored (codes, scales; not the shared 16-value code table)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedWeight):
            nbytes = sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n != "code")
            n = math.prod(m.shape)
            out[name] = {"params": n, "bytes": nbytes, "bits_per_param": 8 * nbytes / n}
    return out


# ----------------------------------------------------------------------------------------------
# Adapter files

def adapter_state(state_dict):
    """The LoRA tensors of a full state dict. Under ZeRO-3 pass zero.full_state_dict(model): the
    model's own LoRA parameters are freed shards there (PITFALLS 10, the shape-[0] adapter)."""
    out = {}
    for k, t in state_dict.items():
        if "lora_" in k:
            if t.untyped_storage().nbytes() == 0:
                raise AdapterError(f"{k} has no storage (a ZeRO-3 shard): use zero.full_state_dict(model)")
            out[k] = t.detach().cpu().clone()
    return out


def base_fingerprint(model_or_state_dict):
    """Short sha256 of the base: every non-LoRA tensor's name, shape and fp32 bytes. Quantized
    buffers belong to the base (an adapter trained on an NF4 base matches only that NF4 base);
    integer codes survive fp32 exactly, so zero.full_state_dict's fp32 copies hash the same."""
    sd = model_or_state_dict
    sd = sd.state_dict() if isinstance(sd, nn.Module) else sd
    h = hashlib.sha256()
    for k in sorted(k for k in sd if "lora_" not in k):
        t = sd[k].detach().float().contiguous().cpu()
        h.update(f"{k}{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def save_adapter(path, lora_tensors, settings, fingerprint):
    """Write atomically: a temporary file, fsync, os.replace. A crash leaves the old file or the
    new one, never half of one."""
    settings = {k: settings[k] for k in ("rank", "alpha", "dropout", "targets")}
    settings["targets"] = list(settings["targets"])
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"lora": lora_tensors, "settings": settings, "base_fingerprint": fingerprint}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@torch.no_grad()
def load_adapter(model, path):
    """Load an adapter file into model and return its settings. A model without LoRA gets
    apply_lora with the file's settings; one with LoRA must have the same settings. The base
    fingerprint and every name and shape must match, else AdapterError. Load before ZeRO wraps
    the model: under ZeRO-3 its LoRA parameters are shards."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        lora, settings, fp = obj["lora"], obj["settings"], obj["base_fingerprint"]
        if not all(isinstance(t, torch.Tensor) for t in lora.values()):
            raise TypeError("LoRA entries are not tensors")
    except Exception as e:
        raise AdapterError(f"{path}: not a readable adapter file ({type(e).__name__}: {e})".splitlines()[0])
    if fp != base_fingerprint(model):
        raise AdapterError(f"{path} was trained on base {fp}, this model is base {base_fingerprint(model)}")
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
