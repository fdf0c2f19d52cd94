"""
Real models in and out: train.py's --init-from a Hugging Face GPT-2, and the export of our
checkpoints to Hugging Face, PEFT and plain safetensors files (hf.py reads and writes the files).

    python train.py --init-from gpt2 --dataset shakespeare --lora      # or --init-from ./gpt2
    python checkpoint.py out/ckpt-0000100 --to hf gpt2-shakespeare      # a LoRA run: + adapter/
    python checkpoint.py out/ckpt-0000100 --to hf gpt2-merged --merge --dtype bf16
    python checkpoint.py out/ckpt-0000100 --to safetensors weights.safetensors

In: the model's shape (layers, heads, width, context, vocabulary) is its config.json's, and the
data must be GPT-2 BPE. The GPT is built on the meta device and filled tensor by tensor in its
working dtype, so loading never holds an fp32 copy of a 16-bit model (load_hf says how much).
Out: the checkpoint is rebuilt as it trained (LoRA, a quantized base), its quantized weights
dequantized; the adapter is either merged in (W0 + B·A·alpha/r) or written beside the base in
PEFT's format. Every check comes before the first byte is written.
"""
import json
import os
import sys

import torch

import hf
from checkpoint import CheckpointError, Reader, check_compatible
from configurator import ConfigError, OneLineParser
from hf import HFError
from lora import adapter_state, apply_lora, merge_lora, parse_targets
from model import GPT, GPTConfig
from precision import DTYPES
from quant import dequantize_base, quantize_base
from tensorfile import write_safetensors
from validate import check_adapter

# the model flags a Hugging Face config.json sets (block_size too, which may be smaller)
SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "bias", "block_size")


# ----------------------------------------------------------------------------------------------
# In: --init-from

def is_checkpoint(path):
    """A checkpoint folder of ours (either format), as opposed to a Hugging Face model."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("ckpt.pt", "meta.pt"))


def open_init(cfg):
    """--init-from: (checkpoint.Reader, None, its data's meta) for a checkpoint folder of ours;
    (None, the local folder or file, GPT-2 BPE's meta) for a Hugging Face GPT-2, whose config
    sets cfg's model flags (hf_flags); (None, None, None) without --init-from."""
    if not cfg.init_from:
        return None, None, None
    if is_checkpoint(cfg.init_from):
        reader = Reader(cfg.init_from)
        return reader, None, reader.header["meta"]
    source, meta = hf_flags(cfg)
    return None, source, meta


def hf_flags(cfg):
    """--init-from a Hugging Face GPT-2: locate it (a hub name is downloaded, when the hub is
    reachable) and set cfg's model flags from its config.json. A flag given explicitly (command
    line or preset) must agree; --block-size may be smaller than n_positions, which crops the
    position embedding to its first rows, as nanoGPT's crop_block_size does. Dropout stays a
    training choice (--dropout), not the config's. Returns (the local folder or file, the meta
    of the vocabulary the data must be in)."""
    path = cfg.init_from
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--init-from {path} is neither a checkpoint of ours (ckpt.pt or "
                          "meta.pt) nor a Hugging Face GPT-2 folder (config.json + weights)")
    try:
        source = hf.locate(path)
        model_args = hf.check_weights(source)  # config.json and the weights' headers agree
    except HFError as e:
        raise ConfigError(f"--init-from {e}")
    for name in SHAPE_FLAGS:
        mine, theirs = getattr(cfg, name), model_args[name]
        if name not in getattr(cfg, "explicit", ()):
            setattr(cfg, name, theirs)
        elif mine != theirs and not (name == "block_size" and mine < theirs):
            flag = "--" + name.replace("_", "-")
            fix = f"drop {flag} or make it smaller" if name == "block_size" else f"drop {flag}"
            raise ConfigError(f"{flag} {mine} contradicts {path}'s config.json ({name} {theirs}):"
                              f" {fix}")
    return source, {"tokenizer": "gpt2", "vocab_size": model_args["vocab_size"]}


def check_vocab(meta, want, cfg):
    """The data's token ids must be the model's: GPT-2 BPE, as many as its embedding rows."""
    if (meta["tokenizer"], meta["vocab_size"]) != (want["tokenizer"], want["vocab_size"]):
        raise ConfigError(f"--init-from {cfg.init_from} reads GPT-2 BPE ({want['vocab_size']} "
                          f"tokens), the data set {cfg.dataset} is {meta['tokenizer']} "
                          f"({meta['vocab_size']} tokens): prepare one with `python "
                          "data/prepare.py --input FILE --tokenizer gpt2 --name NAME`, or use "
                          "--dataset shakespeare")


def load_hf(source, config, device, dtype, lora=False):
    """The GPT of `config` holding a Hugging Face GPT-2's weights, in dtype on device. Built on
    the meta device (shapes only: no memory, no random init to overwrite), given memory in its
    working dtype, then filled tensor by tensor by hf.load_into. Peak host memory: the model in
    its dtype (nothing on a GPU run) plus one tensor as the file holds it, the largest being
    the embedding (50257 x 1600 x 4 B = 322 MB for gpt2-xl in fp32): never an fp32 copy of a
    16-bit model. ZeRO-3 then keeps only each rank's shards of it. With lora, model.base_id
    names the base for the adapter file: the file's weights in fp32 (read again, a tensor at a
    time), what sample.py loads, whatever this run's dtype or --block-size."""
    with torch.device("meta"):
        model = GPT(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.transformer.wte.weight = model.lm_head.weight  # to_empty untied them: tie them again
    with torch.no_grad():  # to_empty's memory is garbage: load_into overwrites every element
        model.lm_head.weight[config.vocab_size:] = 0.0  # but model.py's padded rows
    try:
        hf.load_into(model, source)
        model.base_id = hf.base_fingerprint(source) if lora else None
    except HFError as e:
        raise ConfigError(f"--init-from {e}")
    return model


# ----------------------------------------------------------------------------------------------
# Out: python checkpoint.py CKPT --to hf|safetensors OUT

class ExportError(Exception):
    """Bad input to the export: one line, nothing written."""


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
    model = GPT(GPTConfig(**model_args))
    if cfg.get("lora"):
        try:
            settings = dict(rank=cfg["lora_rank"], alpha=cfg["lora_alpha"],
                            dropout=cfg["lora_dropout"],
                            targets=list(parse_targets(cfg["lora_targets"])))
            check_adapter(settings, {}, model_args["n_embd"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ExportError(f"{reader.path}: its LoRA flags are not valid ({e})")
        apply_lora(model, **settings)
        if cfg.get("quantize"):
            if cfg["quantize"] not in ("int8", "nf4"):
                raise ExportError(f"{reader.path}: --quantize {cfg['quantize']!r} is not ours")
            quantize_base(model, cfg["quantize"], bool(cfg.get("double_quant")))
    check_compatible(h, model_args, None, reader.path, None, model.stored_shapes())
    try:
        model.load_weights(weights)
    except ValueError as e:
        raise ExportError(f"{reader.path} does not fit its own model config: {e}")
    return model


def check_writable(out, to):
    """Refuse an output path we could not write, before any work: its nearest existing
    ancestor must be a folder we may write into, and the path itself of the right kind."""
    if os.path.exists(out) and os.path.isdir(out) != (to == "hf"):
        kind = "a file" if to == "hf" else "a folder"
        raise ExportError(f"{out} is {kind}: --to {to} writes " +
                          ("a folder" if to == "hf" else "one .safetensors file"))
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ExportError(f"cannot write {out}: {parent} is not a folder we may write into")


def export(ckpt, to, out, dtype=None, merge=False):
    """Write the checkpoint as a Hugging Face folder (to="hf") or one safetensors file; returns
    the lines to print."""
    reader = Reader(ckpt)
    lora = bool(reader.header.get("config", {}).get("lora"))
    if merge and not lora:
        raise ExportError(f"--merge: {ckpt} has no LoRA adapter to merge (drop --merge)")
    if to == "safetensors" and dtype:
        raise ExportError("--dtype is for --to hf: --to safetensors keeps the checkpoint's dtypes")
    check_writable(out, to)
    arch = reader.header.get("model_args", {}).get("arch")
    if arch != GPT.ARCH:  # hf.py writes GPT-2's layout (Conv1D, the tied head, wpe)
        raise ExportError(f"{ckpt} holds a {arch!r} model: the export writes GPT-2's "
                          f"architecture only ({GPT.ARCH!r})")
    model_args = reader.model_args()
    weights = reader.weights()
    model = rebuild(reader, weights)  # every check before the first byte is written
    if to == "safetensors" and not merge:  # as the checkpoint holds them; load_weights reads it
        return write_weights(weights, model_args, out)
    quantized = dequantize_base(model)  # QLoRA: the base the adapter trained on, as plain fp32
    adapter = adapter_state(model.state_dict()) if lora else None
    if merge:
        merge_lora(model)  # W0 + B·A·alpha/r, in fp32
    sd = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    if to == "safetensors":
        shapes = model.stored_shapes()  # the tied weight once, the vocabulary's own rows
        return write_weights({k: sd[k][:shapes[k][0]] for k in shapes if k in sd}, model_args, out)
    hf.save_hf(sd, model_args, out, DTYPES[dtype or "fp32"])
    lines = [f"wrote {out}: config.json + model.safetensors ({dtype or 'fp32'}, "
             f"{model_args['n_layer']} layers, {model_args['n_embd']} wide), for transformers' "
             f"GPT2LMHeadModel.from_pretrained" + (", LoRA merged in" if merge else "")]
    if lora and not merge:
        hf.save_peft_adapter(adapter, model.lora_settings, os.path.join(out, "adapter"),
                             os.path.abspath(out))
        lines.append(f"wrote {os.path.join(out, 'adapter')}: the LoRA adapter in PEFT's format "
                     f"(peft.PeftModel.from_pretrained(model, that folder)); --merge folds it in")
    if quantized:
        lines.append(f"the base is the {len(quantized)} quantized weights dequantized: the "
                     "values the adapter trained on")
    return lines


def write_weights(weights, model_args, out):
    """Plain weights (model.py's names, as GPT.load_weights reads them) in one
    safetensors file, the model config in its metadata."""
    header = {name: (t.dtype, tuple(t.shape)) for name, t in weights.items()}
    write_safetensors(out, header, iter(weights.items()),
                      metadata={"model_args": json.dumps(model_args)})
    return [f"wrote {out}: {len(weights)} tensors, model {model_args}"]


def main(argv=None):
    p = OneLineParser(prog="checkpoint.py", description="Export a checkpoint's weights: a "
                      "Hugging Face GPT-2 folder, or plain safetensors.")  # one-line errors
    p.add_argument("ckpt", metavar="CKPT", help="a checkpoint folder (either format)")
    p.add_argument("--to", required=True, choices=["hf", "safetensors"],
                   help="hf: config.json + model.safetensors (+ adapter/ for LoRA); "
                        "safetensors: the weights as model.py names them")
    p.add_argument("out", metavar="OUT", help="the folder (hf) or .safetensors file to write")
    p.add_argument("--dtype", choices=list(DTYPES), help="--to hf: the weights' dtype (fp32)")
    p.add_argument("--merge", action="store_true",
                   help="fold a LoRA adapter into the weights (a quantized base dequantized)")
    try:
        args = p.parse_args(argv)
        lines = export(args.ckpt, args.to, args.out, args.dtype, args.merge)
    except (CheckpointError, ExportError, HFError, ConfigError) as e:
        print(f"checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a vanished folder: the temporary files are gone
        print(f"checkpoint.py: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
