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
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from quant import QuantizedWeight, linear


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

    def _place(self, parts, zero, dim):
        """Concatenate the adapted slices' pieces, with `zero` where a slice has no adapter."""
        parts = iter(parts)
        return torch.cat([next(parts) if on else zero for on in self.slices], dim=dim)

    def base(self, x):
        """The frozen layer, W x + b: W a Parameter or a QuantizedWeight (quant.linear)."""
        return linear(x, self.weight, self.bias)

    def forward(self, x):
        y = self.base(x)
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


def lora_modules(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def _named_blocks(model):
    """(name, block) of the model's declared blocks(), as named_modules() names them."""
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(b)], b) for b in model.blocks()]


def _replace(block, name, new):  # "attn.c_attn" -> block.attn.c_attn = new; "fc" -> block.fc
    parent, _, child = name.rpartition(".")
    setattr(block.get_submodule(parent), child, new)


def apply_lora(model, rank=8, alpha=1.0, dropout=0.0, targets=("q", "v")):
    """Freeze every parameter, replace the targeted Linears of each block by LoRALinear (trainable
    lora_A / lora_B in the base weight's dtype and device); returns the replaced module names.
    targets: names of output slices in the model's LINEARS, ("q", "v") of GPT's fused q|k|v.
    Before ZeRO(model, ...): ZeRO packs what requires grad when it is built."""
    linears = model.LINEARS  # (path in a block, names of its equal output slices)
    known = [t for _, slice_names in linears for t in slice_names]
    if not targets or not set(targets) <= set(known):
        raise ValueError(f"LoRA targets {targets!r}: name some of {known}")
    if lora_modules(model):
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
    targets = [t for t in known if t in targets]  # in the model's order, as files keep them
    model.lora_settings = dict(rank=rank, alpha=alpha, dropout=dropout, targets=targets)
    return names


def merge_lora(model):
    """Inference at the base's cost; a no-op where already merged."""
    for m in lora_modules(model):
        m.merge()


def unmerge_lora(model):
    for m in lora_modules(model):
        m.unmerge()
