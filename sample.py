"""
Generate text from a checkpoint that train.py wrote, or from a Hugging Face GPT-2.

    python sample.py                                    # newest checkpoint in out/: 3 samples
    python sample.py --start "ROMEO:" --num-samples 5          # after `python train.py`
    python sample.py --ckpt out/ckpt-0002000 --start FILE:prompt.txt --device cuda --dtype bf16
    python sample.py --init-from gpt2 --start "Hello,"  # or ./gpt2, or a folder checkpoint.py
                                                        # --to hf wrote (also as --ckpt FOLDER)
    python sample.py --init-from ./gpt2 --adapter out/adapter.safetensors   # + a LoRA adapter

The checkpoint (a folder in either of checkpoint.py's formats, or one file holding model,
model_args and meta) carries everything needed: the weights (fp32, model.py's names), the
GPTConfig arguments and the data's meta.json (hence the tokenizer). It is read with
weights_only=True: tensors and plain data only, so a checkpoint from elsewhere can never run
code when loaded (nanoGPT's pickled ckpt.pt and meta.pkl could). A Hugging Face GPT-2
(config.json beside safetensors) carries its shape in config.json and speaks GPT-2 BPE
(tiktoken).
"""
import argparse
import os
import sys

import torch

from machinery import hf
from checkpoint import CheckpointError, Reader, list_checkpoints
from configurator import ConfigError, OneLineParser
from data.prepare import DataError, get_codec
from lora import AdapterError, load_adapter, merge_lora
from model import GPT, GPTConfig
from precision import resolve_dtype
from machinery.validate import check_model_args, vocab_id


class SampleError(Exception):
    """Bad input from the user: printed as one line, never a traceback."""


def parse_args(argv=None):
    p = OneLineParser(prog="sample.py",  # a usage error is one line, not argparse's usage block
                      description="Generate text from a checkpoint of train.py.",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # where the model comes from: a run's newest checkpoint, a given one, or Hugging Face
    p.add_argument("--out-dir", default="out",
                   help="use the newest checkpoint in train.py's --out-dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", default=None, metavar="PATH",
                     help="a checkpoint folder or file, or a Hugging Face folder "
                          "(overrides --out-dir)")
    src.add_argument("--init-from", default=None, metavar="MODEL",
                     help="a Hugging Face GPT-2: gpt2 | gpt2-medium | gpt2-large | gpt2-xl, "
                          "or a folder")
    p.add_argument("--adapter", default=None, metavar="PATH",
                   help="a LoRA adapter (train.py --lora writes OUT_DIR/adapter.safetensors) "
                        "to load onto the base and merge")
    # what to generate
    p.add_argument("--start", default="\n",
                   help='the prompt; "FILE:prompt.txt" reads it from a file '
                        "(default: %(default)r)")
    p.add_argument("--num-samples", type=int, default=3, metavar="N",
                   help="samples to draw")
    p.add_argument("--max-new-tokens", type=int, default=500, metavar="N",
                   help="tokens after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="<1 safer, >1 wilder, 0 greedy")
    p.add_argument("--top-k", type=int, default=200, metavar="K",
                   help="draw from the K likeliest; 0 = all")
    p.add_argument("--seed", type=int, default=1337,
                   help="same seed, checkpoint and flags: same text")
    # where and in what precision
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if visible")
    p.add_argument("--dtype", default="fp32",
                   help="fp32 | bf16 | fp16: the weights while sampling")
    args = p.parse_args(argv)
    if args.num_samples < 1:
        p.error("--num-samples must be at least 1")
    for name in ("max_new_tokens", "top_k", "temperature"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative")
    return args


def find_checkpoint(out_dir):
    """The newest ckpt-NNNNNNN folder train.py wrote in out_dir (or an out_dir/ckpt.pt file)."""
    ckpts = list_checkpoints(out_dir)
    if not ckpts and os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
        return os.path.join(out_dir, "ckpt.pt")  # a single-file checkpoint (nanoGPT's layout)
    if not ckpts:
        raise SampleError(f"no checkpoint in {out_dir} (train.py writes ckpt-NNNNNNN folders "
                          f"there): train one first, e.g. `python train.py --out-dir {out_dir}`,"
                          " or pass --ckpt PATH")
    return ckpts[-1]


def load_checkpoint(path):
    if os.path.isdir(path):
        try:
            reader = Reader(path)
            return {"model_args": reader.model_args(), "model": reader.weights(),
                    "meta": reader.header["meta"], "iter": reader.header["iter"]}
        except CheckpointError as e:
            raise SampleError(str(e))
    if not os.path.isfile(path):
        raise SampleError(f"no checkpoint at {path}: train one first, e.g. "
                          f"`python train.py --out-dir {os.path.dirname(path) or '.'}`")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        # torch's messages run over many lines: keep the one that names the cause. weights_only
        # refuses any global outside its allow-list ("Trying to load unsupported GLOBAL ...")
        why = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), None)
        if why:
            raise SampleError(f"refused {path}: it holds Python objects, "
                              f"which could run code ({why})")
        raise SampleError(f"cannot read {path}: truncated, corrupt or not a checkpoint "
                          f"({type(e).__name__})")
    if not isinstance(ckpt, dict) or not {"model", "model_args", "meta"} <= ckpt.keys():
        raise SampleError(f"{path} is not a checkpoint of train.py "
                          "(it needs model, model_args and meta)")
    return ckpt


def load_hf(source):
    """A Hugging Face GPT-2 (a hub name, a folder, a weights file): its ckpt dict, GPT-2 BPE."""
    try:
        model_args, weights = hf.load_pretrained(source)
    except hf.HFError as e:
        raise SampleError(str(e))
    if model_args["vocab_size"] != 50257:  # the ids tiktoken's GPT-2 encoding knows
        raise SampleError(f"{source} has a vocabulary of {model_args['vocab_size']} tokens, "
                          "not GPT-2 BPE's 50257: sample.py could not decode its ids")
    return {"model": weights, "model_args": model_args,
            "meta": {"tokenizer": "gpt2", "vocab_size": 50257}}


def sample(args):
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise SampleError("--device cuda but no CUDA device is visible: use --device cpu")
    device = torch.device("cuda" if use_cuda else "cpu")
    try:
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as e:
        raise SampleError(str(e))
    path = args.ckpt or (None if args.init_from else find_checkpoint(args.out_dir))
    hf_folder = path is not None and os.path.isfile(os.path.join(path, "config.json"))
    ckpt = load_hf(args.init_from or path) if args.init_from or hf_folder else load_checkpoint(path)
    try:
        check_model_args(ckpt["model_args"])  # sizes within bounds before anything is built
        model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_weights(ckpt["model"])  # strict: every name and shape must match model.py
    except (TypeError, ValueError, RuntimeError) as e:
        raise SampleError("checkpoint does not fit model.py: " + " ".join(str(e).split()))
    # base + adapter, merged: W0 + B·A·alpha/r, so sampling costs what the base costs
    if args.adapter:
        # checks the base fingerprint, the vocabulary and every shape
        load_adapter(model, args.adapter, vocab_id(ckpt["meta"]))
        merge_lora(model)
    model.eval().to(device=device, dtype=dtype)  # eval: no dropout

    start = args.start
    if start.startswith("FILE:"):
        try:
            with open(start[len("FILE:"):], encoding="utf-8") as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise SampleError(f"cannot read the prompt {start[len('FILE:'):]}: {e}")
    encode, decode = get_codec(ckpt["meta"])
    ids = encode(start)  # DataError for characters outside a char vocabulary
    if not ids:
        raise SampleError("the prompt is empty: --start needs at least one token")

    what = args.init_from or path  # every check passed: say what is sampled
    print(f"sampling from {what}" + (f" (iteration {ckpt['iter']})" if "iter" in ckpt else "")
          + (f" + {args.adapter}" if args.adapter else "") + f", on {device.type}, {args.dtype}",
          file=sys.stderr)
    # all samples in one batch: one forward per new token, not one per token and sample
    x = torch.tensor([ids], dtype=torch.long, device=device).expand(args.num_samples, -1)  # (S, T)
    # torch.multinomial draws on the logits' device, and a CPU generator cannot drive a CUDA draw
    gen = torch.Generator(device=device).manual_seed(args.seed)
    y = model.generate(x, args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k or None, generator=gen)  # (S, T + max_new_tokens)
    for row in y.tolist():
        print(decode(row), "-" * 40, sep="\n")


def main(argv=None):
    """Returns the exit status: 0, or 2 after a one-line error."""
    try:
        sample(parse_args(argv))
    except (SampleError, DataError, AdapterError, ConfigError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
