"""
Real models in: train.py's --init-from a Hugging Face GPT-2 or a checkpoint of ours (hf.py reads
the files; the way out is export.py).

    python train.py --init-from gpt2 --dataset shakespeare --lora      # or --init-from ./gpt2

The model's shape (layers, heads, width, context, vocabulary) is its config.json's, and the
data must be GPT-2 BPE. The GPT is built on the meta device and filled tensor by tensor in its
working dtype, so loading never holds an fp32 copy of a 16-bit model (load_hf says how much).
"""
import os

import torch

from machinery import hf
from checkpoint import Reader
from configurator import ConfigError
from machinery.hf import HFError
from model import GPT

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
