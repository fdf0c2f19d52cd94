"""FP8 training: the blocks' matmuls in 8-bit floats, each tensor scaled to fill its format.

  - Micikevicius et al. 2022, "FP8 Formats for Deep Learning": two formats. E4M3 (4 exponent
    bits, 3 mantissa bits, max 448) for weights and activations, E5M2 (max 57,344) for the
    gradients, whose range is wider. A per-tensor scale maps the tensor's absolute maximum
    (amax) onto the format's max: fp16's loss scale, generalised to every matmul input.
  - NVIDIA TransformerEngine's delayed scaling: the scale from the amaxes of the last N steps
    (an amax history), so that a cast needs no pass over its tensor first.
  - torchao's float8 training and nanochat read as references (never copied): the same three
    casts per linear, and the same choice of what stays in bf16.

Read top to bottom: the formats, the scaling, the autograd Function with its three matmuls,
the module swap, the step-end bookkeeping (histories, statistics, checkpoints).

What runs in FP8: the four linears of each block (c_attn, attention c_proj, c_fc, MLP c_proj),
their 12h^2 weights per layer; attention's own products (q k^T, softmax v) stay in SDPA's bf16
kernel. The embeddings are lookups, not matmuls.
The LM head stays bf16: its logits feed the softmax over the whole vocabulary, where a 3-bit
mantissa would blur the small probabilities, and it is tied to the embedding. LayerNorms and
the loss are reductions, done in fp32 arithmetic anyway. FP8 exists only inside the matmul:
the master weights stay fp32 (zero.py), the working weights, outputs and gradients bf16.

    python -m beyond.fp8      # the formats' table, from torch.finfo
    python train.py --bf16 --fp8 [--fp8-scaling delayed --fp8-amax-history 16]
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from collectives import all_reduce_max, all_reduce_sum
from lora import LoRALinear
from quant import QuantizedWeight

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2  # "fn": finite only, no inf
ROWS = ("x", "w", "grad")  # the three casts of a linear: input, weight, output gradient
FORMAT = {"x": E4M3, "w": E4M3, "grad": E5M2}
MULTIPLE = 16  # cuBLAS FP8 matmuls want every dimension a multiple of 16


# ----------------------------------------------------------------------------------------------
# 1. the formats

def format_row(name, dtype):
    """(name, bits, exponent bits, mantissa bits, max, smallest normal, smallest subnormal, eps),
    read off torch.finfo (int8: torch.iinfo; an integer has no exponent, its step is 1)."""
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return (name, info.bits, "-", "-", info.max, 1, 1, 1)
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))  # eps = 2^-mantissa
    return (name, info.bits, info.bits - 1 - mantissa, mantissa, info.max,
            info.smallest_normal, info.smallest_normal * info.eps, info.eps)


def format_table():
    """The lecture's rows (fp32, fp16, bf16, int8) and the two FP8 formats."""
    return [format_row(n, d) for n, d in (("fp32", torch.float32), ("fp16", torch.float16),
                                          ("bf16", torch.bfloat16), ("int8", torch.int8),
                                          ("fp8 E4M3", E4M3), ("fp8 E5M2", E5M2))]


# ----------------------------------------------------------------------------------------------
# 2. the scaling, and the cast

def scale_of(amax, fmt):
    """The fp32 scale that maps amax onto the format's max: x * scale fills the format.
    Divided in fp64 and rounded once to fp32, as torchao's amax_to_scale does: the quotient
    correctly rounded. In fp32, torch's `max / amax` is amax's reciprocal times max, two
    roundings, and a compiled reciprocal can round otherwise than an eager one (torchao's
    note). An all-zero tensor gets scale 1 (any scale casts zeros to zeros)."""
    amax = amax.double()
    return torch.where(amax > 0, torch.finfo(fmt).max / amax.clamp(min=1e-30), 1.0).float()


def cast(t, scale, fmt, stats=None):
    """t * scale in the FP8 format, saturating: a value past the max becomes the max. A plain
    .to() is not to be relied on: torch 2.13 on CPU saturates E4M3 but rounds an E5M2 overflow to
    inf, and E4M3 "fn" has no inf, older kernels made it NaN. With stats, a (4,) int64 tensor,
    adds the values the cast turned to zero though they were not (underflow), the ones it clamped
    (saturation), the nonzero ones and all of them."""
    top = torch.finfo(fmt).max
    v = t.float() * scale  # fp32: the scaled value before rounding (a transient copy)
    q = v.clamp(-top, top).to(fmt)
    if stats is not None:
        # saturated: past the max by more than fp32's rounding (the amax itself may land there)
        # the count of values by a fill on the device: torch.tensor(n, device=...) would be a
        # blocking host-to-device copy on a GPU, one per cast
        stats += torch.stack([((q == 0) & (t != 0)).sum(), (v.abs() > top * (1 + 1e-6)).sum(),
                              (t != 0).sum(), torch.full((), t.numel(), device=t.device)])
    return q


# ----------------------------------------------------------------------------------------------
# 3. the matmuls: torch._scaled_mm and the autograd Function

def _scaled_mm(a, b, scale_a, scale_b, fast_accum=False):
    """a @ b from FP8 operands, out = (scale_a * scale_b) * (a @ b) in bf16, fp32 accumulation.
    The scales are the inverses of the cast's: they undo it. cuBLAS (and so CUDA) wants `a`
    row-major and `b` column-major, every dimension a multiple of 16, fp32 scalar scales, and
    never E5M2 x E5M2; torch 2.13's CPU kernel takes any layout and size, but we give it the
    CUDA layouts so that the CPU tests exercise the GPU's path. Before torch 2.4 it returned
    (out, amax). fast_accum: Hopper's FP8 tensor cores then skip the periodic promotion of
    their partial sums to fp32 (faster, fewer bits): torchao's default for the forward's
    product only; the gradients' long sums (dw sums over every token) keep the full one.
    The CPU kernel ignores it."""
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                           use_fast_accum=fast_accum)
    return out[0] if isinstance(out, tuple) else out


def _col_major(t):  # the same matrix, its elements stored column by column
    return t.t().contiguous().t()


def _pad_rows(t):  # (M, K) -> (M rounded up to 16, K); zero rows add nothing to any product
    pad = -t.shape[0] % MULTIPLE
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


class _FP8Matmul(torch.autograd.Function):
    """y = x @ w.T with the three matmuls of a linear in FP8 (Micikevicius et al. 2022):
        forward        y  = x8 @ w8.T          E4M3 x E4M3
        input grad     dx = g8 @ w8            E5M2 x E4M3
        weight grad    dw = g8.T @ x8          E5M2 x E4M3
    Saved for backward: x8 (one byte per value, half of bf16's x) and w by reference, recast in
    backward with the forward's scale (the same bits): an FP8 copy of every weight kept until
    backward would undo what ZeRO-3 frees. The output gradient's scale: from its own amax
    (dynamic) or from the history (delayed), known before backward."""

    @staticmethod
    def forward(ctx, x, w, owner, training):
        K, N = x.shape[-1], w.shape[0]
        x2 = _pad_rows(x.reshape(-1, K)).contiguous()  # (M, K) row-major, M a multiple of 16
        s_x, s_w = owner.scale("x", x2, training), owner.scale("w", w, training)
        x8 = cast(x2, s_x, E4M3, owner.stat("x", training))
        w8 = cast(w, s_w, E4M3, owner.stat("w", training))
        y = _scaled_mm(x8, w8.t(), s_x.reciprocal(), s_w.reciprocal(),  # w8.t(): col-major
                       fast_accum=True)  # (M, N)
        ctx.owner, ctx.shape = owner, x.shape
        ctx.save_for_backward(x8 if w.requires_grad else None, w, s_x, s_w)
        return y[:math.prod(x.shape[:-1])].view(*x.shape[:-1], N)  # the padded rows cut off

    @staticmethod
    def backward(ctx, grad):
        x8, w, s_x, s_w = ctx.saved_tensors
        owner, M = ctx.owner, math.prod(ctx.shape[:-1])
        g2 = _pad_rows(grad.reshape(-1, w.shape[0])).contiguous()  # (M', N); may come strided
        s_g = owner.scale("grad", g2, True)
        g8 = cast(g2, s_g, E5M2, owner.stat("grad", True))
        dx = dw = None
        if ctx.needs_input_grad[0]:  # (M', N) @ (N, K); w8 column-major
            w8 = cast(w, s_w, E4M3)
            dx = _scaled_mm(g8, _col_major(w8), s_g.reciprocal(), s_w.reciprocal())
            dx = dx[:M].view(ctx.shape)
        if ctx.needs_input_grad[1]:  # (N, M') @ (M', K); x8 column-major
            dw = _scaled_mm(g8.t().contiguous(), _col_major(x8), s_g.reciprocal(),
                            s_x.reciprocal())
        return dx, dw, None, None


# ----------------------------------------------------------------------------------------------
# 4. the module swap

class FP8Matmul(nn.Module):
    """One linear's FP8 state: its scaling recipe, amax history and cast statistics, all
    non-persistent buffers (outside state_dict, ZeRO's buffers and the model's shapes).

    history (3, N+1): rows x, w, grad; column 0 is the running max of this optimizer step
    (over micro-steps, and idempotent under --grad-ckpt's recompute), columns 1..N the last N
    steps. Delayed scaling casts with the max of columns 1..N, so the scale of a step is fixed
    before it starts, the recompute casts exactly as the forward did, and a spike in this step
    saturates until the history sees it. The first step, with no history, scales dynamically."""

    def __init__(self, name, scaling="dynamic", history=16, device="cpu"):
        super().__init__()
        self.name, self.scaling, self.measuring = name, scaling, False
        self.register_buffer("history", torch.zeros(3, history + 1, device=device),
                             persistent=False)
        self.register_buffer("stats", torch.zeros(3, 4, dtype=torch.long, device=device),
                             persistent=False)

    def scale(self, row, t, training):
        """The scale for this cast; a training cast's amax (not an evaluation's) is recorded."""
        amax = t.detach().abs().amax().float()
        if self.scaling == "delayed":
            i = ROWS.index(row)
            if training:
                self.history[i, 0] = torch.maximum(self.history[i, 0], amax)
            past = self.history[i, 1:].amax()
            amax = torch.where(past > 0, past, amax)  # no history yet: this tensor's own
        return scale_of(amax, FORMAT[row])

    def stat(self, row, training):
        return self.stats[ROWS.index(row)] if self.measuring and training else None

    def forward(self, x, weight, bias=None):
        # a forward under no_grad (an evaluation) casts alike but leaves history and stats be
        y = _FP8Matmul.apply(x, weight, self, torch.is_grad_enabled())
        return y if bias is None else y + bias  # the bias in bf16, outside the FP8 product


class FP8Linear(nn.Module):
    """A block's nn.Linear with its product in FP8: the same weight and bias Parameters, so
    state_dict keys, ZeRO's buckets and checkpoints are model.py's."""

    def __init__(self, weight, bias, matmul):
        super().__init__()
        self.weight, self.bias, self.fp8 = weight, bias, matmul

    def forward(self, x):
        return self.fp8(x, self.weight, self.bias)


class FP8LoRALinear(LoRALinear):
    """A LoRALinear whose frozen base computes in FP8 (its forward and input gradient: a frozen
    weight has no weight gradient); the adapters stay bf16. convert() makes one of a LoRALinear
    in place, by swapping its class as torch.nn.utils.parametrize does: the same module, so its
    parameters, names and adapters are untouched."""

    def base(self, x):
        return self.fp8(x, self.weight, self.bias)


def check_available(device, compiled=False):
    """A one-line RuntimeError where this torch or device has no FP8 matmul. Returns a line to
    print once where FP8 runs eagerly on a GPU (without --compile), else None."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        raise RuntimeError(f"torch {torch.__version__} has no FP8 matmul: upgrade, or drop --fp8")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (needs "
                           "compute capability 8.9: Ada, Hopper or newer): drop --fp8")
    try:
        a = torch.zeros(MULTIPLE, MULTIPLE, device=device, dtype=E4M3)
        one = torch.ones((), device=device)
        _scaled_mm(a, a.t(), one, one)
    except (RuntimeError, NotImplementedError) as e:
        raise RuntimeError(f"torch {torch.__version__} has no FP8 matmul on {device.type} "
                           f"({str(e).splitlines()[0]}): drop --fp8")
    if device.type == "cuda" and not compiled:  # docs/fp8.md: what an eager cast costs
        return ("warning: --fp8 without --compile: each cast (amax, scale, clamp, cast, "
                "transposed copies) is a pass of its own over memory, and they cost more "
                "than the FP8 matmuls save (bench.fp8): add --compile to fuse them")
    return None


def convert(model, scaling="dynamic", history=16):
    """Put FP8 into each block's four linears; returns their names. A plain nn.Linear becomes an
    FP8Linear, a LoRALinear an FP8LoRALinear (its frozen base's product in FP8, its adapters
    bf16). ValueError (one line) for a shape FP8 matmuls cannot take or a quantized base."""
    if scaling not in ("dynamic", "delayed") or history < 1:
        raise ValueError(f"--fp8-scaling {scaling} --fp8-amax-history {history}: use dynamic "
                         "or delayed, and a history of at least 1")
    names, paths = [], [path for path, _ in model.LINEARS]  # (path in a block, its slices)
    block_names = {id(m): n for n, m in model.named_modules()}
    for block in model.blocks():
        for name in paths:
            m, full = block.get_submodule(name), f"{block_names[id(block)]}.{name}"
            if isinstance(m.weight, QuantizedWeight):
                raise ValueError(f"{full}: --fp8 with a --quantize'd base would quantize twice: "
                                 "drop one")
            N, K = m.weight.shape
            if N % MULTIPLE or K % MULTIPLE:
                raise ValueError(f"--fp8: {full} is {N}x{K}; FP8 matmuls need multiples of "
                                 f"{MULTIPLE}: pick --n-embd a multiple of {MULTIPLE}")
            fp8 = FP8Matmul(full, scaling, history, m.weight.device)
            if isinstance(m, LoRALinear):  # its base's product in FP8, its adapters bf16
                m.__class__ = FP8LoRALinear
                m.fp8 = fp8
            else:
                parent, _, child = name.rpartition(".")  # "" for a block's own child
                setattr(block.get_submodule(parent), child, FP8Linear(m.weight, m.bias, fp8))
            names.append(full)
    model.fp8_settings = {"scaling": scaling, "history": history}
    return names


# ----------------------------------------------------------------------------------------------
# 5. per step: histories, statistics, checkpoints

def matmuls(model):
    return [m for m in model.modules() if isinstance(m, FP8Matmul)]


def measure(model, on):
    """Count underflow and saturation in this step's casts (train.py: on logged steps only)."""
    for m in matmuls(model):
        m.measuring = on


@torch.no_grad()
def end_step(model, group=None):
    """After the optimizer step, under delayed scaling: this step's amaxes, the MAX over every
    rank (one all-reduce of 3 values per linear, as TransformerEngine reduces amaxes over the
    data-parallel group), join the history, and the oldest step leaves it. Every rank then
    holds the same history: one copy in a checkpoint resumes on any world size. Every
    linear's history stacked, shifted as one tensor and copied back by one multi-tensor copy:
    a few kernels a step, not two a linear (convert gives them all one length)."""
    ms = [m for m in matmuls(model) if m.scaling == "delayed"]
    if not ms:
        return
    history = torch.stack([m.history for m in ms])  # (linears, 3, steps + 1)
    now = history[:, :, 0].contiguous()  # (linears, 3): this step's amaxes
    if dist.is_initialized():
        all_reduce_max(now, dist.get_world_size(group), group, label="amax")
    shifted = torch.cat([torch.zeros_like(now)[..., None], now[..., None], history[..., 1:-1]],
                        dim=2)
    torch._foreach_copy_([m.history for m in ms], list(shifted.unbind(0)))


@torch.no_grad()
def read_stats(model, group=None):
    """{fp8_x_underflow, fp8_x_saturated, ... grad}: over every FP8 linear and rank, the
    fraction of the nonzero values each cast turned to zero, and of all values it clamped to
    the format's max, since the last read; then reset. Waits for the device: logged steps."""
    ms = matmuls(model)
    if not ms:
        return {}
    counts = torch.stack([m.stats for m in ms]).sum(0).double()  # (3, 4)
    if dist.is_initialized():
        all_reduce_sum(counts, dist.get_world_size(group), group, label="fp8 statistics")
    for m in ms:
        m.stats.zero_()
    out = {}
    for i, row in enumerate(ROWS):
        under, sat, nonzero, total = counts[i].tolist()
        out[f"fp8_{row}_underflow"] = under / nonzero if nonzero else 0.0
        out[f"fp8_{row}_saturated"] = sat / total if total else 0.0
    return out


def state_dict(model):
    """What a checkpoint keeps: the settings and each linear's amax history (on the host)."""
    if not matmuls(model):
        return None
    return {"settings": dict(model.fp8_settings),
            "history": {m.name: m.history.detach().cpu().clone() for m in matmuls(model)}}


def check_state_dict(model, saved):
    """A checkpoint's FP8 state against this model's FP8 linears, before load_state_dict copies
    any of it: a ValueError names a history that is missing, extra, of another shape or dtype,
    or not finite and >= 0 (an amax)."""
    if saved is None:
        return
    if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict) \
            or not isinstance(saved.get("history"), dict):
        raise ValueError("its FP8 state is not the one a save writes")
    if not matmuls(model) or saved["settings"] != dict(model.fp8_settings):
        return  # a fresh history: nothing of it is copied
    want = {m.name: m.history for m in matmuls(model)}
    odd = sorted(set(want) ^ set(saved["history"]), key=str)
    if odd:
        raise ValueError(f"its FP8 histories and this model's FP8 linears differ at {odd[0]!r}")
    for name, h in want.items():
        t = saved["history"][name]
        if not isinstance(t, torch.Tensor) or t.shape != h.shape or t.dtype != h.dtype \
                or not (t.isfinite() & (t >= 0)).all():
            raise ValueError(f"the FP8 amax history of {name} is not {h.dtype} {list(h.shape)} "
                             "of finite amaxes >= 0")


@torch.no_grad()
def load_state_dict(model, saved, path):
    """Restore the histories exactly (checked first by check_state_dict); returns a one-line
    note where FP8 was turned on or off or its recipe changed since the save (allowed: the
    scaling starts afresh), else None."""
    mine = dict(model.fp8_settings) if matmuls(model) else None
    theirs = saved["settings"] if saved else None
    if mine is None and theirs is None:
        return None
    if mine is None:
        return f"{path} was trained with --fp8; this run computes in bf16"
    if theirs is None:
        return f"{path} was trained without --fp8; this run's FP8 scaling starts afresh"
    if mine != theirs:
        return (f"{path} was saved with FP8 scaling {theirs}, this run has {mine}: "
                "a fresh amax history")
    for m in matmuls(model):
        m.history.copy_(saved["history"][m.name])
    return None


if __name__ == "__main__":
    head = ("format", "bits", "exp", "mant", "max", "min normal", "min subnormal", "eps")
    print(" | ".join(f"{h:>13}" for h in head))
    for row in format_table():
        print(" | ".join(f"{v:>13}" if isinstance(v, (str, int)) else f"{v:>13.6g}" for v in row))
