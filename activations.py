"""
What one micro-step holds besides the model state: the tensors autograd saves for backward,
term by term, and the transient working set of the loss head. memory.py adds them up.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4:
per layer s*b*h*(34 + 5*a*s/h) bytes of activations in 16 bits, 2*s*b*h with full recomputation.
model.saved_activation_bytes measures what these formulas predict; tests/test_memory.py holds
the two equal to the byte on CPU.
"""
import math

import loss

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "nf4": 0.5}  # bytes per value

# the input each adapter's A reads (and so keeps for its gradient), named as in activation_bytes()
ADAPTER_INPUT = {"q": "c_attn input", "k": "c_attn input", "v": "c_attn input",
                 "attn_out": "attention output = c_proj input", "mlp_fc": "c_fc input",
                 "mlp_proj": "gelu output = c_proj input"}


def activation_bytes(cfg, batch, seq, dtype, grad_ckpt=False, lora_rank=0, lora_targets=(),
                     device="cuda", fp8=False):
    """Bytes autograd saves for backward in one micro-step, as {term: bytes} per layer and outside
    the blocks. Korthikanti et al. count 34*s*b*h per layer in 16 bits: 4 (two LayerNorm inputs) +
    11 (attention) + 19 (MLP), 2 of them dropout masks, plus 5*a*s^2*b for the attention matrix,
    its softmax and dropout. Ours differs: SDPA's fused kernels keep a logsumexp per row instead
    of the a*s^2 matrix, LayerNorm keeps its mean and rstd (fp32 on CUDA; in the input's dtype
    on CPU: `device`), there is no mask with dropout 0, and in fp32 every 16-bit term doubles.
    The loss head keeps the 16-bit logits, not an fp32 log-softmax (loss.py). Under LoRA the
    base weights are frozen, so autograd skips the inputs that only a weight's gradient needs,
    and everything in front of the first adapter."""
    E, b, s, h, a = BYTES[dtype], batch, seq, cfg.n_embd, cfg.n_head
    bsh, lora = b * s * h, lora_rank > 0
    needed = [ADAPTER_INPUT[t] for t in lora_targets]
    # dropout: a bool mask per dropout (CUDA). Not modelled: on CPU the masks are float, and with
    # dropout SDPA falls back to its math kernel there, which does keep the a*s^2 matrices
    drop = bsh if cfg.dropout > 0 else 0

    stat = 4 if device == "cuda" else E  # bytes of a LayerNorm mean / rstd

    def ln(name):
        return {f"{name} input": E * bsh, f"{name} mean, rstd": 2 * stat * b * s}

    if grad_ckpt:  # the checkpoint keeps the block's input; the rest is recomputed in backward
        layer = {"block input (kept by the checkpoint)": E * bsh}
    else:  # in forward order
        layer = {**ln("ln_1"), "c_attn input": E * bsh, "q, k, v (one c_attn output)": 3 * E * bsh,
                 "attention logsumexp (fp32; no a*s^2 matrix)": 4 * b * a * s,
                 "attention output = c_proj input": E * bsh,  # SDPA keeps it, with the logsumexp
                 "residual dropout masks": 2 * drop, **ln("ln_2"), "c_fc input": E * bsh,
                 "c_fc output = gelu input": 4 * E * bsh, "gelu output = c_proj input": 4 * E * bsh,
                 "LoRA A outputs (r wide)": E * b * s * lora_rank * len(lora_targets)}
        if lora:  # a frozen weight needs no gradient: a Linear's input is kept for an adapter only
            for term in ("c_attn input", "c_fc input", "gelu output = c_proj input"):
                if term not in needed:
                    layer[term] = 0
    outside = {"token ids, positions (int64)": 0 if lora else 8 * b * s + 8 * s,
               "embedding dropout mask": drop, **ln("ln_f"),
               "lm_head input": 0 if lora else E * bsh,
               "logits (b*s*padded vocab; loss.py)": E * b * s * cfg.padded_vocab,
               "logsumexp per row (fp32)": 4 * b * s, "targets (int64)": 8 * b * s}
    if fp8 and not grad_ckpt:
        layer = fp8_terms(layer, b * s, h, lora)
    per_layer = first = sum(layer.values())
    if lora and not grad_ckpt:  # the first layer saves from its first adapter's input on
        start = min(list(layer).index(term) for term in needed)
        first = sum(list(layer.values())[start:])
    return {"layer": layer, "outside": outside, "per_layer": per_layer,
            "total": first + (cfg.n_layer - 1) * per_layer + sum(outside.values())}


def fp8_terms(layer, rows, h, lora):
    """--fp8 (fp8.py): each block linear keeps two fp32 scales and, for its weight's gradient,
    its input's FP8 cast (1 byte a value, the rows padded to a multiple of 16) instead of the
    bf16 input; SDPA still keeps its own output. A frozen base (LoRA) keeps no cast, and the
    first layer's linears in front of the first adapter keep nothing: the scales come first."""
    M = math.ceil(rows / 16) * 16
    linear = {"c_attn input": ("c_attn", h), "attention output = c_proj input": ("attn.c_proj", h),
              "c_fc input": ("c_fc", h), "gelu output = c_proj input": ("mlp.c_proj", 4 * h)}
    out = {}
    for term, v in layer.items():
        name, width = linear.get(term, (None, 0))
        if name:
            out[f"{name} FP8 scales (2 fp32)"] = 8
        if name == "attn.c_proj":
            out[term], out["attn.c_proj input's FP8 cast"] = v, 0 if lora else M * width
        elif name:
            out[term] = v if lora else M * width  # the cast, not the bf16 input
        else:
            out[term] = v
    return out


def head_working_bytes(cfg, batch, seq, dtype):
    """The loss head's transient bytes at its peak, in its backward, beyond what is saved: the
    16-bit gradient of the logits (b*s*padded vocab) and one chunk's fp32 softmax and its
    scaled copy (loss.py). The textbook head held an fp32 copy of all the logits, its fp32
    log-softmax and their fp32 gradient here: 12 bytes per logit more."""
    rows = min(batch * seq, loss.chunk_rows(cfg.vocab_size))
    return BYTES[dtype] * batch * seq * cfg.padded_vocab + 2 * 4 * rows * cfg.vocab_size
