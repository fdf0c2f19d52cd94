"""
Guards the way out: a checkpoint exported only when every check passed, before the first byte.

The checkpoint is rebuilt as it trained (LoRA, a quantized base), its quantized weights
dequantized; the adapter either merged in (W0 + B·A·alpha/r) or written beside the base in
PEFT's format (hf.py writes the base, adapters.py the adapter). export.py is the command.
"""
import json
import os

import torch
import torch.nn as nn

from checkpoint import stored_shapes
from lora import apply_lora, merge_lora
from safetensors.torch import save_file

from machinery import adapters, declared, hf
from machinery.checked_ckpt import Reader
from machinery.validate import (check_adapter, check_compatible, file_kind, parse_targets,
                                 targets_of, vocab_id)
import model as model_py
from precision import DTYPES
from quant import QuantizedWeight, quantize_base
from configurator import UserError




def rebuild(reader, weights=None):
    """The model a checkpoint trained (LoRA and a quantized base where its flags say so), on
    the CPU, holding the checkpoint's tensors (weights: reader.weights(), if read already):
    fp32 masters of what trained, frozen ones as they were saved. The header is checked against
    the tensors (every element read, its checksum compared) before the model is built at the
    size it claims, and the model's names and shapes against the header's: nothing else is
    exported."""
    h = reader.header
    model_args, cfg = reader.model_args(), h["config"]
    weights = reader.weights() if weights is None else weights
    try:  # a fork's, if model.py was edited: its own config class (declared.py)
        model = declared.build(model_py.GPT, model_args, h["shapes"])
    except ValueError as e:
        raise UserError(f"{reader.path}: {e}")
    if cfg.get("lora"):
        try:
            settings = dict(rank=cfg["lora_rank"], alpha=cfg["lora_alpha"],
                            dropout=cfg["lora_dropout"],
                            targets=list(parse_targets(cfg["lora_targets"])))
            check_adapter(settings, declared.width(model), targets_of(model.LINEARS))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{reader.path}: its LoRA flags are not valid ({e})")
        apply_lora(model, **settings)
        if cfg.get("quantize"):
            if cfg["quantize"] not in ("int8", "nf4"):
                raise UserError(f"{reader.path}: --quantize {cfg['quantize']!r} is not ours")
            quantize_base(model, cfg["quantize"], bool(cfg.get("double_quant")))
    check_compatible(h, model_args, None, reader.path, None, stored_shapes(model))
    try:
        declared.load_weights(model, weights)
    except ValueError as e:
        raise UserError(f"{reader.path} does not fit its own model config: {e}")
    return model


def check_writable(out, to):
    """Refuse an output path we could not write, before any work: its nearest existing
    ancestor must be a folder we may write into, and the path itself of the right kind (in an
    hf folder, config.json too: transformers opens it to write, and a FIFO would wait for
    ever)."""
    if os.path.exists(out) and os.path.isdir(out) != (to == "hf"):
        kind = "a file" if to == "hf" else "a folder"
        raise UserError(f"{out} is {kind}: --to {to} writes " +
                        ("a folder" if to == "hf" else "one .safetensors file"))
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {out}: {parent} is not a folder we may write into")
    config = os.path.join(out, "config.json")
    if to == "hf" and file_kind(config) not in (None, "a file"):
        raise UserError(f"{config} is {file_kind(config)}, not a file: move it away")


def export(ckpt, to, out, dtype=None, merge=False):
    """Write the checkpoint as a Hugging Face folder (to="hf") or one safetensors file; returns
    the lines to print."""
    reader = Reader(ckpt)
    lora = bool(reader.header.get("config", {}).get("lora"))
    if merge and not lora:
        raise UserError(f"--merge: {ckpt} has no LoRA adapter to merge (drop --merge)")
    if to == "safetensors" and dtype:
        raise UserError("--dtype is for --to hf: --to safetensors keeps the checkpoint's dtypes")
    check_writable(out, to)
    if to == "hf":  # before the checkpoint is read: config.json is transformers' GPT2Config
        hf.library("transformers", "export.py --to hf")
    model_args = reader.model_args()
    arch, ours = model_args.get("arch"), getattr(model_py.GPT, "ARCH", None)  # a fork's, if
    if to == "hf" and arch != "gpt2":  # hf.py writes GPT-2's layout (Conv1D, tied head, wpe)
        raise UserError(f"{ckpt} holds a {arch!r} model: the export writes GPT-2's "
                        "architecture only ('gpt2'); --to safetensors writes any model")
    if arch != ours:
        raise UserError(f"{ckpt} holds a {arch!r} model, model.py builds {ours!r}: export "
                        "it from the code that trained it")
    weights = reader.weights()  # every element read, its checksum compared, before a byte
    model = rebuild(reader, weights)  # as it trained: LoRA, a quantized base; names checked
    if to == "safetensors" and not merge:  # as the checkpoint holds them; load_weights reads it
        return write_weights(weights, model_args, out)
    quantized = dequantize_base(model)  # QLoRA: the base the adapter trained on, as plain fp32
    adapter = adapters.adapter_state(model.state_dict()) if lora else None
    if merge:
        merge_lora(model)  # W0 + B·A·alpha/r, in fp32
    sd = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    if to == "safetensors":
        shapes = stored_shapes(model)  # the tied weight once, the vocabulary's own rows
        return write_weights({k: sd[k][:shapes[k][0]] for k in shapes if k in sd}, model_args, out)
    hf.save_hf(sd, model_args, out, DTYPES[dtype or "fp32"])
    lines = [f"wrote {out}: config.json + model.safetensors ({dtype or 'fp32'}, "
             f"{model_args['n_layer']} layers, {model_args['n_embd']} wide), for transformers' "
             f"GPT2LMHeadModel.from_pretrained" + (", LoRA merged in" if merge else "")]
    if lora and not merge:  # named by the base just written: sample.py --ckpt OUT loads that
        adapters.save_adapter(os.path.join(out, "adapter"), model, hf.base_fingerprint(out),
                              vocab_id(reader.header["meta"]), os.path.abspath(out), adapter)
        lines.append(f"wrote {os.path.join(out, 'adapter')}: the LoRA adapter in PEFT's format "
                     f"(peft.PeftModel.from_pretrained(model, that folder)); --merge folds it in")
    if quantized:
        lines.append(f"the base is the {len(quantized)} quantized weights dequantized: the "
                     "values the adapter trained on")
    return lines


def merged_weights(reader):
    """The model a LoRA checkpoint trained, as plain weights (model.py's names, the vocabulary's
    own rows): its quantized base dequantized, its adapters merged in (W0 + B·A·alpha/r)."""
    model = rebuild(reader)
    dequantize_base(model)
    merge_lora(model)
    sd, shapes = model.state_dict(), stored_shapes(model)
    return {k: sd[k][:shapes[k][0]] for k in shapes if "lora_" not in k}


def write_weights(weights, model_args, out):
    """Plain weights (model.py's names, as GPT.load_weights reads them) in one
    safetensors file, the model config in its metadata."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.tmp")
    save_file({k: t.contiguous() for k, t in weights.items()}, tmp,
              metadata={"format": "pt", "model_args": json.dumps(model_args)})
    os.replace(tmp, out)  # the old file or the new one
    return [f"wrote {out}: {len(weights)} tensors, model {model_args}"]


def dequantize_base(model):
    """quantize_base undone for export: every quantized weight becomes a frozen fp32 Parameter
    holding its dequantized values (not the weights before quantization: those are gone), so
    LoRA can be merged into it and the model saved as plain weights. Returns the module names."""
    quantized = [(n, m) for n, m in model.named_modules()
                 if isinstance(getattr(m, "weight", None), QuantizedWeight)]
    for name, m in quantized:  # collected first: the loop edits the modules it walks
        w = m.weight.dequantize(torch.float32)
        del m.weight
        m.weight = nn.Parameter(w, requires_grad=False)
    return [name for name, _ in quantized]
