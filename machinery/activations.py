"""
What one micro-step holds besides the model state: the tensors autograd saves for backward,
term by term, and the transient working set of the loss head. memory.py adds them up.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4:
per layer s*b*h*(34 + 5*a*s/h) bytes of activations in 16 bits, 2*s*b*h with full recomputation;
Sec. 5, selective recomputation: what beyond/activation_dial.py's `selective` keeps is
priced by KEPT. meter.saved_activation_bytes measures what these formulas predict;
tests/test_memory.py holds the two equal to the byte on CPU.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn

from lora import LoRALinear, apply_lora
from machinery.declared import config_for
from machinery.validate import declared_linears, parse_targets
import model as model_py
from model import GPT, MLP, CausalSelfAttention, LayerNorm
from quant import QuantLinear

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "nf4": 0.5}  # bytes per value
INITS = ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")


_MODELS = {}  # the last shapes-only models built, by what they were built from


def shapes_model(cfg, build=None, lora_rank=0, lora_targets=(), fp8=False):
    """The model cfg describes (model.py's GPT, or build(cfg)'s), with LoRA if lora_rank and FP8
    linears if fp8, on the meta device: every shape, nothing allocated. Kept for the next call
    with the same arguments (memory.py --advise prices one model some twenty times): read it,
    never change it."""
    build = build or model_py.GPT  # model.GPT when called: a fork's edit of it is walked
    cfg = config_for(build, cfg)  # its own config class (a fork's CONFIG), from cfg's fields
    key = (repr(cfg), build, lora_rank, repr(lora_targets), fp8)
    if key not in _MODELS:
        with torch.device("meta"), meta_init():
            try:  # a model that cannot be built from the flags: one line, not a traceback
                model = build(cfg)
            except (TypeError, AttributeError, ValueError, RuntimeError) as e:
                raise ValueError(f"memory.py cannot build {build.__name__} from {cfg}: {e}")
            if lora_rank or fp8:  # a fork's LINEARS, each path in every block: else one line
                linears = declared_linears(model)
            if lora_rank:  # "all", "q,v" or ("q", "v"): names of the LINEARS' slices
                apply_lora(model, lora_rank, targets=parse_targets(lora_targets, linears))
            if fp8:  # the block linears' products in FP8 (fp8.py)
                from beyond.fp8 import FP8Linear, FP8LoRALinear, convert
                SAVED.setdefault(FP8Linear, linear)  # priced as any linear (linear())
                SAVED.setdefault(FP8LoRALinear, linear)
                KEPT.setdefault(FP8LoRALinear, kept_linear)  # a LoRALinear's, as LoRALinear
                convert(model)
        if len(_MODELS) >= 4:
            _MODELS.pop(next(iter(_MODELS)))
        _MODELS[key] = model
    return _MODELS[key]


@contextmanager
def meta_init():
    """torch.nn.init's fills as no-ops while a shapes-only model is built: on the meta device
    they compute nothing, yet each costs ~2 ms (torch's Python decomposition), so a model of
    hundreds of blocks took minutes to build and not one byte to hold."""
    saved = {name: getattr(nn.init, name) for name in INITS}
    try:
        for name in INITS:
            setattr(nn.init, name, lambda t, *args, **kwargs: t)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def activation_bytes(cfg, batch, seq, dtype, grad_ckpt=False, lora_rank=0, lora_targets=(),
                     device="cuda", build=None, fp8=False, chunked_loss=False, unknown_ok=False):
    """Bytes autograd saves for backward in one micro-step of the model cfg describes (model.py's
    GPT, or build(cfg)'s), with LoRA if lora_rank: {"layer": the last block's terms, "outside":
    the rest, "per_layer": the last block's sum, "total"}. A shapes-only copy of the model is
    walked in forward order, each module priced by its entry in SAVED. grad_ckpt: a bool (True
    = full), a name or an activation_dial.Policy (which blocks, what they keep). A model that
    declares no formula is NoFormula; with unknown_ok, zeros and "missing", why (memory.py
    counts the rest: footprint.estimate)."""
    model = shapes_model(cfg, build, lora_rank, lora_targets if lora_rank else (), fp8)
    if unknown_ok and formula(type(model), SAVED) is None:
        why = str(NoFormula.of(model))
        return {"layer": {}, "outside": {}, "per_layer": 0, "total": 0, "missing": why}
    E = BYTES[dtype]
    flow = Flow(batch, seq, E, stat=4 if device == "cuda" else E, live=False)
    flow.chunked_loss = chunked_loss  # the loss head: model.py's plain one, or chunked
    plan = NO_CHECKPOINT  # beyond/ is imported only when a flag asks for its technique
    if grad_ckpt and grad_ckpt != "none":
        from beyond.activation_dial import policy
        plan = policy(grad_ckpt)
    try:  # a formula that does not fit the model (GPT's on a fork's class): one line
        outside, blocks = root_formula(model)(model, flow, plan)
    except (AttributeError, KeyError, TypeError, IndexError) as e:
        kind = type(model).__name__
        raise ValueError(f"memory.py's activation formula for {kind} failed "
                         f"({type(e).__name__}: {e}): declare {kind}.SAVED (docs/forking.md)")
    return {"layer": blocks[-1], "outside": outside, "per_layer": sum(blocks[-1].values()),
            "total": sum(sum(t.values()) for t in blocks) + sum(outside.values())}


def formula(kind, table):
    """The formula for a module kind: the one its class declares (kind.SAVED, kind.KEPT: a
    fork's own, set in its own file with nothing imported from here), else table's entry."""
    own = getattr(kind, "SAVED" if table is SAVED else "KEPT", None)
    return own if callable(own) else table.get(kind)


class NoFormula(ValueError):
    """The model declares no activation formula: memory.py gives the rest without them."""

    @classmethod
    def of(cls, model):
        name = type(model).__name__
        return cls(f"memory.py counts activations by formulas: {name} declares none; set "
                   f"{name}.SAVED (docs/forking.md, \"memory.py for a fork\")")


def root_formula(model):
    """The whole model's formula, (model, flow, grad_ckpt) -> (terms outside the blocks, one
    dict per block): GPT's gpt(), or the class's own SAVED; else NoFormula, one line."""
    rule = formula(type(model), SAVED)
    if rule is None:
        raise NoFormula.of(model)
    return rule


class NoCheckpoint:
    """No block checkpointed: what beyond/activation_dial.py's Policy("none") answers, without
    importing it for a run that checkpoints nothing."""
    kind = "none"

    def applies(self, i):
        return False

    def __bool__(self):
        return False


NO_CHECKPOINT = NoCheckpoint()


class Flow:
    """The walk's state, in forward order: the batch, bytes per value (E; `stat` for a norm's
    statistics: fp32 on CUDA, the input's dtype on CPU), and whether the activation flowing in
    requires grad. Autograd saves nothing for a computation no input of which requires grad:
    under LoRA, everything in front of the first adapter."""

    def __init__(self, b, s, E, stat, live):
        self.b, self.s, self.E, self.stat, self.live = b, s, E, stat, live

    def values(self, width, E=None):  # bytes of one (b, s, width) activation
        return (self.E if E is None else E) * self.b * self.s * width

    # a fork's formulas call these: nothing to import from here (model.py cannot: this file
    # imports it)
    def walk(self, name, module, kept=False):  # a module by its formula (KEPT's if kept)
        return walk(name, module, self, KEPT if kept else SAVED)

    def linear(self, name, m):  # what a Linear (LoRA, quantized, FP8) keeps: linear()
        return linear(name, m, self)

    def kept_linear(self, name, m):  # selective: a Linear's matmul output: kept_linear()
        return kept_linear(name, m, self)

    def blocks(self, model, grad_ckpt, width, prefix):  # the blocks' terms: walk_blocks()
        return walk_blocks(model, self, grad_ckpt, width, prefix)

    @staticmethod
    def trainable(module):  # does module own a parameter that trains?
        return trainable(module)


def walk(name, module, flow, table=None):
    """{term: bytes} that module saves, by its entry in table (SAVED, or KEPT for a selectively
    checkpointed block); a module without one is walked child by child (in registration order:
    forward order, as model.py writes its blocks)."""
    table = SAVED if table is None else table
    rule = formula(type(module), table)
    if rule is not None:
        return rule(name, module, flow)
    children = list(module.named_children())
    if not children:
        which, kind = "SAVED" if table is SAVED else "KEPT", type(module).__name__
        raise ValueError(f"memory.py has no formula for {kind} ({name}): set {kind}.{which} "
                         "to a function saying what it saves (docs/forking.md)")
    terms = {}
    for child_name, child in children:
        terms.update(walk(f"{name}.{child_name}" if name else child_name, child, flow, table))
    return terms


def trainable(module):
    return any(p.requires_grad for p in module.parameters(recurse=False))


def linear(name, m, flow):
    """nn.Linear, quant.py's QuantLinear, lora.py's LoRALinear, fp8.py's FP8Linear: a weight's
    gradient needs the input, so the input is kept when the weight trains (in FP8: its E4M3
    cast, 1 byte a value, the rows padded to a multiple of 16) or an adapter's A reads it; the
    adapter keeps A's output (r wide per adapted slice) for B's gradient. An FP8 product keeps
    its two fp32 scales whenever autograd records it."""
    lora = isinstance(m, LoRALinear)
    # by its name: beyond/fp8.py is imported only under --fp8
    fp8 = type(m).__name__ in ("FP8Linear", "FP8LoRALinear")
    terms, width = {}, m.weight.shape[-1]
    if fp8 and (flow.live or m.weight.requires_grad):  # autograd records the product
        terms[f"{name}: FP8 scales (2 fp32)"] = 8
    if lora or (trainable(m) and not fp8):
        terms[f"{name} input"] = flow.values(width)
    elif trainable(m):  # an FP8Linear whose weight trains
        terms[f"{name} input's FP8 cast"] = math.ceil(flow.b * flow.s / 16) * 16 * width
    if lora:
        terms[f"{name}: LoRA A output (r wide)"] = flow.values(m.r * sum(m.slices))
    flow.live = flow.live or lora or trainable(m)
    return terms


def layer_norm(name, m, flow):
    if not (flow.live or trainable(m)):
        return {}
    flow.live = True
    return {f"{name} input": flow.values(m.weight.numel()),
            f"{name} mean, rstd": 2 * flow.values(1, flow.stat)}


def attention(name, m, flow):
    """c_attn, then SDPA: its fused kernels keep q, k, v (views of c_attn's output), a fp32
    logsumexp per row and head (no a*s^2 matrix) and their output, which is c_proj's input.
    Not modelled: attention dropout (SDPA's math kernel then keeps the a*s^2 matrices)."""
    terms = linear(f"{name}.c_attn", m.c_attn, flow)
    attended = flow.live
    if attended:
        terms[f"{name}: q, k, v (one c_attn output)"] = flow.values(3 * m.n_embd)
        terms[f"{name}: logsumexp (fp32)"] = 4 * flow.b * flow.s * m.n_head
        terms[f"{name}: output = c_proj input"] = flow.values(m.n_embd)
    proj = linear(f"{name}.c_proj", m.c_proj, flow)
    if attended:  # the same storage as SDPA's output, counted once
        proj.pop(f"{name}.c_proj input", None)
    terms.update(proj)
    if m.dropout > 0 and flow.live:
        terms[f"{name}: residual dropout mask"] = flow.values(m.n_embd, 1)
    return terms


def mlp(name, m, flow):
    """c_fc, GELU (which keeps its input, c_fc's output), c_proj (its input: GELU's output)."""
    terms = linear(f"{name}.c_fc", m.c_fc, flow)
    if flow.live:
        terms[f"{name}.c_fc output = gelu input"] = flow.values(m.c_fc.weight.shape[0])
    terms.update(linear(f"{name}.c_proj", m.c_proj, flow))
    if m.dropout.p > 0 and flow.live:
        terms[f"{name}: residual dropout mask"] = flow.values(m.c_proj.weight.shape[0], 1)
    return terms


def walk_blocks(model, flow, grad_ckpt, width, prefix):
    """One dict of terms per block of model.blocks(), in forward order, each block's input
    `width` wide: a checkpointed block (grad_ckpt, an activation_dial.Policy, says which)
    keeps its input, and under `selective` what KEPT lists; any other, what it saves."""
    blocks = []
    for i, block in enumerate(model.blocks()):
        if grad_ckpt.applies(i):  # the checkpoint keeps the block's input; the rest: recomputed
            terms = {"block input (kept by the checkpoint)": flow.values(width)}
            if grad_ckpt.kind == "selective":  # ... but for the matmuls' and attention's outputs
                terms.update(walk(f"{prefix}.{i}", block, flow, KEPT))
            blocks.append(terms)
            flow.live = flow.live or any(p.requires_grad for p in block.parameters())
        else:
            blocks.append(walk(f"{prefix}.{i}", block, flow))
    return blocks


def gpt(model, flow, grad_ckpt):
    """The whole model, in its forward's order: (terms outside the blocks, one dict per block).
    The embeddings keep their int64 ids when they train; a checkpointed block (grad_ckpt, an
    activation_dial.Policy, says which) keeps its input, and under `selective` what KEPT
    lists; the loss head keeps the targets and either the fp32 log-softmax (model.py) or
    the 16-bit logits and a logsumexp per row (beyond/chunked_loss.py)."""
    t, f, cfg = model.transformer, flow, model.config
    outside = {}
    if trainable(t.wte):
        outside["token ids, positions (int64)"] = 8 * f.b * f.s + 8 * f.s
    f.live = trainable(t.wte) or trainable(t.wpe)
    if cfg.dropout > 0 and f.live:
        outside["embedding dropout mask"] = f.values(cfg.n_embd, 1)
    blocks = walk_blocks(model, f, grad_ckpt, cfg.n_embd, "h")
    outside.update(walk("ln_f", t.ln_f, f))
    if trainable(model.lm_head):
        outside["lm_head input"] = f.values(cfg.n_embd)
    if f.chunked_loss:  # beyond/chunked_loss.py: the 16-bit logits, a logsumexp per row
        outside["logits (b*s*padded vocab; chunked loss)"] = f.values(cfg.padded_vocab)
        outside["logsumexp per row (fp32)"] = 4 * f.b * f.s
    else:  # model.py's head: the fp32 log-softmax of the real columns, and a total weight
        outside["log-softmax (b*s*vocab, fp32)"] = 4 * f.b * f.s * cfg.vocab_size
        outside["cross-entropy's total weight (fp32)"] = 4
    outside["targets (int64)"] = 8 * f.b * f.s
    return outside, blocks


# What each kind of module saves for backward: model.py's and torch's kinds. A fork's own
# kinds carry theirs (kind.SAVED, formula()); walk() names a missing one.
SAVED = {GPT: gpt, LayerNorm: layer_norm, CausalSelfAttention: attention, MLP: mlp,
         nn.LayerNorm: layer_norm,  # F.layer_norm as model.py's LayerNorm: the same saves
         nn.Linear: linear, QuantLinear: linear, LoRALinear: linear}  # FP8Linear: shapes_model


# -- `selective` (activation_dial.SAVE_OPS): a block keeps its matmuls' and attention's outputs,
# whether or not autograd would need them (frozen layers too); all else is recomputed

def kept_linear(name, m, flow):
    """A Linear's matmul output (out wide); LoRA's A projection is a matmul too (r wide per
    adapted slice). LoRA's einsum with B (a bmm), the sums and casts are recomputed."""
    terms = {f"{name} output (matmul)": flow.values(m.weight.shape[0])}
    if isinstance(m, LoRALinear):
        terms[f"{name}: LoRA A output (matmul)"] = flow.values(m.r * sum(m.slices))
    return terms


def kept_attention(name, m, flow):
    """c_attn's output (q, k, v), SDPA's output and its fp32 logsumexp, c_proj's output."""
    terms = kept_linear(f"{name}.c_attn", m.c_attn, flow)
    terms[f"{name}: attention output"] = flow.values(m.n_embd)
    terms[f"{name}: logsumexp (fp32)"] = 4 * flow.b * flow.s * m.n_head
    return {**terms, **kept_linear(f"{name}.c_proj", m.c_proj, flow)}


def kept_mlp(name, m, flow):
    """c_fc's output (GELU's input), c_proj's output; GELU itself is recomputed."""
    return {**kept_linear(f"{name}.c_fc", m.c_fc, flow),
            **kept_linear(f"{name}.c_proj", m.c_proj, flow)}


# What a selectively checkpointed block keeps, per module kind (a fork's: kind.KEPT)
KEPT = {LayerNorm: lambda name, m, flow: {}, CausalSelfAttention: kept_attention, MLP: kept_mlp,
        nn.LayerNorm: lambda name, m, flow: {},
        nn.Linear: kept_linear, QuantLinear: kept_linear, LoRALinear: kept_linear}


def head_working_bytes(cfg, batch, seq, dtype, chunked_loss=False):
    """The loss head's transient bytes at its peak, in its backward, beyond what is saved:
    the 16-bit gradient of the logits (b*s*padded vocab), and then either three chunks of
    fp32 (beyond/chunked_loss.py: the last chunk's softmax, still held while the next chunk's
    fp32 copy and its softmax are made) or, for model.py's plain head, two fp32 gradients of
    all the logits (the NLL's and the log-softmax's): 8 bytes a logit more. Both as
    memory.py --measure found them (machinery/measure.py): they were 2 chunks and 12 bytes."""
    # the logits are as wide as the head: model.py's padded vocabulary, else a fork's own
    grad = BYTES[dtype] * batch * seq * getattr(cfg, "padded_vocab", cfg.vocab_size)
    if not chunked_loss:
        return grad + 2 * 4 * batch * seq * cfg.vocab_size
    from beyond.chunked_loss import chunk_rows
    rows = min(batch * seq, chunk_rows(cfg.vocab_size))
    return grad + 3 * 4 * rows * cfg.vocab_size
