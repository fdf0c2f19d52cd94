"""
Real models in: train.py's --init-from a Hugging Face GPT-2 or a checkpoint of ours (hf.py reads
the files; the way out is export.py).

    python train.py --init-from gpt2 --dataset shakespeare --lora      # or --init-from ./gpt2
    python train.py --init-from run/ckpt-0002000 --out-dir finetune   # weights of ours

A checkpoint of a LoRA or QLoRA run gives a new run with the same LoRA and quantization flags
its base as stored (the 4-bit codes themselves) and its adapters, to train on from there; any
other run gets that model merged (the base dequantized, W0 + B·A·alpha/r), the weights
`python export.py CKPT --to safetensors OUT --merge` writes.

The model's shape (layers, heads, width, context, vocabulary) is its config.json's, and the
data must be GPT-2 BPE. The GPT is built on the meta device and filled tensor by tensor in its
working dtype, so loading never holds an fp32 copy of a 16-bit model (load_hf says how much).
"""
import os

import torch

from checkpoint import HEADER, list_checkpoints, model_args, stored, stored_shapes
from configurator import UserError
from machinery import adapters, declared, hf, validate
from machinery.checked_ckpt import Reader
import model as model_py
from model import GPT

# the model flags a Hugging Face config.json sets (block_size too, which may be smaller)
SHAPE_FLAGS = ("n_layer", "n_head", "n_embd", "bias", "block_size")


# ----------------------------------------------------------------------------------------------
# In: --init-from

def is_checkpoint(path):
    """A checkpoint folder of ours, as opposed to a Hugging Face model (its header anything
    but a file too: the Reader's one line)."""
    return validate.file_kind(os.path.join(path, HEADER)) is not None


def check_local_files(path):
    """A local Hugging Face model (a folder, a weights file): it and the files hf.py may open
    beside it (config.json, the weights, their shards) files, before any is opened
    (validate.file_kind: a FIFO would wait for ever). A hub name is hf.locate's."""
    kind = validate.file_kind(path)
    if kind is None:
        return
    folder = path if kind == "a folder" else os.path.dirname(os.path.abspath(path))
    files = [] if kind == "a folder" else [path]
    files += [os.path.join(folder, n) for n in sorted(os.listdir(folder))
              if n == "config.json" or n in hf.WEIGHT_FILES or n.startswith("model-")]
    for file in files:
        kind = validate.file_kind(file)
        if kind != "a file":
            raise UserError(f"{file} is {kind}, not a file: not a Hugging Face model's")


def open_init(cfg):
    """--init-from: (checkpoint.Reader, None, its data's meta) for a checkpoint folder of ours;
    (None, the local folder or file, GPT-2 BPE's meta) for a Hugging Face GPT-2; (None, None,
    None) without --init-from. Either way the model flags not given are the source's model's
    (ours: its model_args; Hugging Face's: its config.json, hf_flags)."""
    if not cfg.init_from:
        return None, None, None
    if is_checkpoint(cfg.init_from):
        reader = Reader(cfg.init_from)
        saved = reader.model_args()
        for name in SHAPE_FLAGS:  # a flag given must agree: init_weights says so in one line
            if name in saved and name not in getattr(cfg, "explicit", ()):
                setattr(cfg, name, saved[name])
        return reader, None, reader.header["meta"]
    source, meta = hf_flags(cfg)
    return None, source, meta


def init_weights(reader, cfg, model_args, meta, print0):
    """The weights --init-from CKPT gives train.build (checked against the model and data): a
    state dict in model.py's names, or None for a LoRA run's checkpoint taken as it trained
    (the same LoRA and quantization flags): init_trained loads it once the run is built."""
    validate.check_compatible(reader.header, model_args, meta, cfg.init_from)
    saved = reader.header["config"]
    if not saved.get("lora"):
        return reader.weights()
    flags = " ".join(validate.as_flag(f, saved.get(k)) for k, f in validate.SETTINGS.items()
                     if saved.get(k) not in (None, "", False))
    if _as_trained(reader, cfg):
        print0(f"--init-from {cfg.init_from}: a run of the same {flags}: its base as stored and "
               "its adapters, trained on from there")
        return None
    from machinery import exporter
    print0(f"--init-from {cfg.init_from}: a run of {flags}, not this run's LoRA flags: its model "
           "merged (base dequantized, adapters folded in), as `export.py --merge` writes it")
    return exporter.merged_weights(reader)


@torch.no_grad()
def init_trained(reader, cfg, zero, model):
    """The LoRA run's tensors init_weights left for after the build, into this run's ZeRO on
    any stage and world size: the adapters (fp32 masters) and the frozen base as stored. Not
    its optimizer, scaler, RNG or iteration: a new run. The adapter file names its base."""
    validate.check_compatible(reader.header, model_args(model), None, cfg.init_from,
                              {k: getattr(cfg, k) for k in validate.SETTINGS},
                              stored_shapes(model))
    shapes = reader.header["shapes"]
    for s in zero.segments:
        lo, hi = stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            s.flat[:hi - lo].copy_(reader.read(s.name, "master", lo, hi))
    for name, lo, hi, values in zero.frozen_pieces():
        lo, hi = stored(shapes, name, lo, hi)
        if lo < hi:
            values[:hi - lo].copy_(reader.read(name, "value", lo, hi))
    zero.publish()
    model.base_id = reader.header.get("base_id") or adapters.base_fingerprint(reader.weights())


def _as_trained(reader, cfg):
    """A LoRA run's checkpoint, and this run has its LoRA and quantization flags."""
    saved = reader.header["config"]
    return bool(saved.get("lora")) and all(saved.get(k) == getattr(cfg, k)
                                           for k in validate.SETTINGS)


def hf_flags(cfg):
    """--init-from a Hugging Face GPT-2: locate it (a hub name is downloaded, when the hub is
    reachable) and set cfg's model flags from its config.json. A flag given explicitly (command
    line or preset) must agree; --block-size may be smaller than n_positions, which crops the
    position embedding to its first rows, as nanoGPT's crop_block_size does. Dropout stays a
    training choice (--dropout), not the config's. Returns (the local folder or file, the meta
    of the vocabulary the data must be in)."""
    path = cfg.init_from
    check_local_files(path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"--init-from {path} is neither a checkpoint of ours ({HEADER}) "
                        "nor a Hugging Face GPT-2 folder (config.json + weights)")
    try:
        source = hf.locate(path)
        model_args = hf.check_weights(source)  # config.json and the weights' headers agree
    except UserError as e:
        raise UserError(f"--init-from {e}")
    for name in SHAPE_FLAGS:
        mine, theirs = getattr(cfg, name), model_args[name]
        if name not in getattr(cfg, "explicit", ()):
            setattr(cfg, name, theirs)
        elif mine != theirs and not (name == "block_size" and mine < theirs):
            flag = "--" + name.replace("_", "-")
            fix = f"drop {flag} or make it smaller" if name == "block_size" else f"drop {flag}"
            raise UserError(f"{flag} {mine} contradicts {path}'s config.json ({name} {theirs}):"
                            f" {fix}")
    return source, {"tokenizer": "gpt2", "vocab_size": model_args["vocab_size"]}


def hf_weights(source):
    """{our name: fp32 tensor} of a Hugging Face GPT-2, read from its file a tensor at a time
    when asked: the full-precision source of a 16-bit run's fp32 master."""
    try:
        return hf.Weights(source)
    except UserError as e:
        raise UserError(f"--init-from {e}")


def check_vocab(meta, want, cfg):
    """The data's token ids must be the model's: GPT-2 BPE, as many as its embedding rows."""
    if (meta["tokenizer"], meta["vocab_size"]) != (want["tokenizer"], want["vocab_size"]):
        raise UserError(f"--init-from {cfg.init_from} reads GPT-2 BPE ({want['vocab_size']} "
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
    except UserError as e:
        raise UserError(f"--init-from {e}")
    return model


# ----------------------------------------------------------------------------------------------
# In: sample.py's weights

def find_checkpoint(out_dir):
    """The newest ckpt-NNNNNNN folder train.py wrote in out_dir."""
    ckpts = list_checkpoints(out_dir)
    if not ckpts:
        raise UserError(f"no checkpoint in {out_dir} (train.py writes ckpt-NNNNNNN folders "
                        f"there): train one first, e.g. `python train.py --out-dir {out_dir}`,"
                        " or pass --ckpt PATH")
    return ckpts[-1]


def load_checkpoint(path):
    """A checkpoint folder of ours, in either format: {model, model_args, meta, iter, lora}.
    Nothing else is read: a file is one line, never unpickled."""
    kind = validate.file_kind(path)
    if kind != "a folder":
        raise UserError(f"{path} is {kind}, not a checkpoint: sample.py reads the ckpt-NNNNNNN "
                        "folders train.py writes, or a Hugging Face GPT-2's (--init-from)"
                        if kind else f"no checkpoint at {path}: train one first, e.g. `python "
                        f"train.py --out-dir {os.path.dirname(path) or '.'}`")
    reader = Reader(path)
    lora = bool(reader.header["config"].get("lora"))
    if lora:  # a LoRA run's: what it trained, as `export.py --merge` writes it
        from machinery import exporter
    weights = exporter.merged_weights(reader) if lora else reader.weights()
    return {"model_args": reader.model_args(), "model": weights, "lora": lora,
            "meta": reader.header["meta"], "iter": reader.header["iter"]}


def load_hf_for_sampling(source):
    """A Hugging Face GPT-2 (a hub name, a folder, a weights file): its ckpt dict, GPT-2 BPE."""
    check_local_files(source)
    model_args, weights = hf.load_pretrained(source)
    if model_args["vocab_size"] != 50257:  # the ids tiktoken's GPT-2 encoding knows
        raise UserError(f"{source} has a vocabulary of {model_args['vocab_size']} tokens, "
                          "not GPT-2 BPE's 50257: sample.py could not decode its ids")
    return {"model": weights, "model_args": model_args,
            "meta": {"tokenizer": "gpt2", "vocab_size": 50257}}


def weights_to_sample(ckpt, init_from, out_dir):
    """sample.py's source: --ckpt PATH, --init-from a Hugging Face GPT-2, or the newest
    checkpoint in --out-dir. Returns (what it read, {model, model_args, meta[, iter]})."""
    path = ckpt or (None if init_from else find_checkpoint(out_dir))
    hf_folder = path is not None and os.path.isfile(os.path.join(path, "config.json"))
    if init_from or hf_folder:
        return init_from or path, load_hf_for_sampling(init_from or path)
    return path, load_checkpoint(path)


def model_of(ckpt):
    """The GPT a loaded checkpoint describes, holding its weights; its sizes are checked
    before anything is built (a header may claim 10^5 layers), its weights are finite."""
    try:  # model.GPT: a fork's, if model.py was edited, with its own config (declared.py)
        shapes = {k: list(getattr(t, "shape", ())) for k, t in dict(ckpt["model"]).items()}
        model = declared.build(model_py.GPT, ckpt["model_args"], shapes)
        declared.load_weights(model, ckpt["model"])  # strict: every name and shape must match
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError("checkpoint does not fit model.py: " + " ".join(str(e).split()))
    bad = next((k for k, t in model.state_dict().items() if not t.isfinite().all()), None)
    if bad:  # every draw would be a NaN probability
        raise UserError(f"the weights hold inf/NaN ({bad}): sample from an earlier checkpoint")
    return model


def check_sample_flags(args):
    """sample.py's numbers, before any work: counts >= their least, a temperature that is 0
    (greedy) or large enough that logits / T stay finite in fp32, a seed a generator takes."""
    for name, least in (("num_samples", 1), ("max_new_tokens", 0), ("top_k", 0)):
        if getattr(args, name) < least:
            raise UserError(f"--{name.replace('_', '-')} must be at least {least}")
    t = args.temperature
    if not (t == 0 or 1e-4 <= t < float("inf")):
        raise UserError(f"--temperature {t}: use 0 (greedy) or a number from 1e-4 up "
                        "(below it, logits / T overflow fp32)")
    if not 0 <= args.seed < 2**64:
        raise UserError(f"--seed {args.seed}: use an integer in [0, 2**64)")


def check_sample_size(model, prompt_tokens, args, device):
    """The samples' memory against what the device has free, before any is allocated: each
    sample's token ids (twice: torch.cat copies them each step), one forward's activations
    over the context and the logits of its last position."""
    from machinery.footprint import free_bytes
    e = next(model.parameters()).element_size()
    # GPT's sizes; a fork's config may lack some (no bound on its context: all of it)
    c = {k: getattr(model.config, k, 0) for k in ("block_size", "n_embd", "n_head", "vocab_size")}
    tokens = prompt_tokens + args.max_new_tokens
    T = min(tokens, c["block_size"] or tokens)
    need = args.num_samples * (16 * tokens + T * (12 * c["n_embd"] + c["n_head"] * T) * e
                               + 8 * c["vocab_size"])
    free = free_bytes(device)
    if free is not None and need > free:
        raise UserError(f"--num-samples {args.num_samples} x {tokens:,} tokens needs about "
                        f"{need / 1e9:.3g} GB, {free / 1e9:.3g} GB is free on {device.type}: "
                        "lower --num-samples or --max-new-tokens")
