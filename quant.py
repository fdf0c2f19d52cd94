"""
Quantized storage of a frozen weight: int8 absmax rows, NF4 blocks, double quantization.

  - Dettmers et al. 2022, "LLM.int8()": symmetric absmax quantization, one scale per row.
  - Dettmers et al. 2023, "QLoRA", Sec. 3: the frozen base as 4-bit NormalFloat (NF4) in
    blocks of 64 with one absmax scale each; the scales themselves quantized to 8 bits
    ("double quantization"); dequantized on the fly in forward and backward, so that a 4-bit
    base computes in 16 bits and gets no gradient.

A QuantizedWeight holds only buffers (no parameters: no gradient, no optimizer state, not in
ZeRO's gradient buckets; ZeRO-3 shards them with their block like any frozen tensor).
quantize_base turns every block's declared linear layers (the model's LINEARS; LoRA-wrapped or
not) into such weights.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def nf4_code():
    """The 16 NF4 values (QLoRA appendix E; bitsandbytes' create_normal_map): N(0, 1) quantiles
    at evenly spaced probabilities, 8 positive and 7 negative so that 0 is exact (4 bits
    cannot be symmetric and hold 0), the outermost at p = 0.9677 since p = 1 is infinite;
    scaled to [-1, 1]."""
    p = lambda n: torch.linspace(0.9677083, 0.5, n, dtype=torch.float64)[:-1]
    v = torch.cat([torch.special.ndtri(p(9)), -torch.special.ndtri(p(8)),
                   torch.zeros(1, dtype=torch.float64)])
    return (v.sort().values / v.max()).float()  # (16,), [7] == 0


def absmax_quantize(x, qmax=127):
    """Symmetric absmax quantization of each row (the last dim) to integers in [-qmax, qmax]:
    x ~= q * scale, scale = absmax / qmax, so |x - q * scale| <= scale / 2 = absmax / (2 qmax).
    Returns (q int8, scale fp32 with the last dim dropped). A row holding an inf or a NaN gets
    a non-finite scale, so it decodes to inf / NaN again (0 * inf is NaN): an overflow check
    after dequantization still sees it. The one source of blockwise codes: LLM.int8()'s rows
    here, ZeRO++'s blocks in zeropp.py (qmax 127 for int8, 7 for int4)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / qmax
    q = torch.round(x.float() / scale).clamp(-qmax, qmax).nan_to_num(0.0)
    return q.to(torch.int8), scale.squeeze(-1)


def _log_codes(absmax, group=256):
    """Double quantization of the block scales: 8 bits each, in groups of `group`. QLoRA codes
    absmax - mean with 8-bit floats; a linear 8-bit code of that fails on an outlier block (its
    step swamps the small scales, which then decode to ~0 or below it and flip their blocks'
    sign). We code log2(absmax) linearly between its group's min and max: the error is
    relative to each scale (under 1% for a spread of 2^12), and 2^x never reaches zero.
    Returns (codes uint8, lo fp32, step fp32) with absmax ~= 2 ** (lo + codes * step)."""
    n, pad = absmax.numel(), -absmax.numel() % group
    la = absmax.clamp(min=1e-30).log2()
    hi = F.pad(la, (0, pad), value=-math.inf).view(-1, group).amax(1)  # (groups,)
    # an all-zero block decodes to its zero codes whatever its scale: cap the range at 2^-32
    lo = torch.maximum(F.pad(la, (0, pad), value=math.inf).view(-1, group).amin(1), hi - 32)
    step = ((hi - lo) / 255).clamp(min=1e-12)
    expand = lambda t: t.repeat_interleave(group)[:n]
    codes = torch.round((la.clamp(min=expand(lo)) - expand(lo)) / expand(step)).clamp(0, 255)
    return codes.to(torch.uint8), lo, step


class QuantizedWeight(nn.Module):
    """A frozen weight held in buffers, rebuilt by dequantize(). int8: one fp32 scale per output
    row (8 + 32/in bits per parameter). nf4: blocks of `block` values of the flattened weight,
    two 4-bit codes per byte, one fp32 absmax per block (4 + 32/64 bits), or with double_quant
    an 8-bit code per block's scale (4 + 8/64 + 64/(64*256) bits)."""
    BUFFERS_ARE_STATE = True  # its codes and scales are the weight: ZeRO shards them

    def __init__(self, w, mode="nf4", double_quant=False, block=64):
        super().__init__()
        if mode not in ("int8", "nf4") or block % 2:
            raise ValueError(f"quantize mode {mode!r}, block {block}: use 'int8' or 'nf4' "
                             "and an even block")
        self.mode, self.double_quant, self.block = mode, double_quant, block
        self.shape, self.dtype = tuple(w.shape), w.dtype
        w = w.detach().float()
        if mode == "int8":  # codes (out, in) int8, scale (out,) fp32
            codes, scale = absmax_quantize(w, 127)
            self.register_buffer("codes", codes)
            self.register_buffer("scale", scale)
            return
        self.register_buffer("code", nf4_code().to(w.device), persistent=False)  # the 16 values
        flat = F.pad(w.reshape(-1), (0, -w.numel() % block)).view(-1, block)  # (nblocks, block)
        absmax = flat.abs().amax(1)  # (nblocks,)
        if double_quant:
            codes, lo, step = _log_codes(absmax)
            self.register_buffer("absmax_codes", codes)  # (nblocks,) uint8
            self.register_buffer("absmax_lo", lo)  # (ceil(nblocks / 256),) fp32
            self.register_buffer("absmax_step", step)
            absmax = self._absmax()  # encode against the scales the decoder will see
        else:
            self.register_buffer("absmax", absmax)
        # nearest code: bucketize against the midpoints between neighbouring code values
        mid = (self.code[1:] + self.code[:-1]) / 2
        idx = torch.bucketize(flat / absmax.clamp(min=1e-12)[:, None], mid).to(torch.uint8)
        idx = idx.view(-1)
        self.register_buffer("codes", idx[0::2] << 4 | idx[1::2])  # (padded numel / 2,) uint8

    def _absmax(self):
        """(nblocks,) fp32 block scales, decoded from 8 bits under double quantization."""
        if not self.double_quant:
            return self.absmax
        n = self.absmax_codes.numel()
        lo, step = (t.repeat_interleave(256)[:n] for t in (self.absmax_lo, self.absmax_step))
        return torch.exp2(lo + self.absmax_codes.float() * step)

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


def linear(x, weight, bias):
    """F.linear for a plain weight or a QuantizedWeight."""
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
        return linear(x, self.weight, self.bias)


def quantize_base(model, mode="nf4", double_quant=False, block=64):
    """Quantize the weights of every block's four Linears, LoRA-wrapped or not (the tied
    embedding / head stay as they are). Returns the quantized module names."""
    names, paths = [], [path for path, _ in model.LINEARS]
    block_names = {id(m): n for n, m in model.named_modules()}
    for blk in model.blocks():
        for name in paths:
            m = blk.get_submodule(name)
            if isinstance(m.weight, QuantizedWeight) or getattr(m, "merged", False):
                raise ValueError(f"{block_names[id(blk)]}.{name} is already quantized or has "
                                 "LoRA merged in")
            qw = QuantizedWeight(m.weight, mode, double_quant, block)
            if isinstance(m, nn.Linear):
                parent, _, child = name.rpartition(".")  # "" for a block's own child
                setattr(blk.get_submodule(parent), child, QuantLinear(qw, m.bias))
            else:  # a wrapper that computes with .weight (LoRALinear): the buffers take its name
                del m.weight
                m.weight = qw
            names.append(f"{block_names[id(blk)]}.{name}")
    return names


def quantized_bytes(model):
    """{name: {"params", "bytes", "bits_per_param"}} per quantized weight, by summing the buffers
    actually stored (codes, scales; not the shared 16-value code table): the bits a weight
    costs, measured (docs/lora.md prints them)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedWeight):
            nbytes = sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n != "code")
            n = math.prod(m.shape)
            out[name] = {"params": n, "bytes": nbytes, "bits_per_param": 8 * nbytes / n}
    return out
