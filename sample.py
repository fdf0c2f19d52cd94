"""
Generate text from a checkpoint that train.py wrote, or from a Hugging Face GPT-2.

    python sample.py                                    # newest checkpoint in out/: 3 samples
    python sample.py --start "ROMEO:" --num-samples 5          # after `python train.py`
    python sample.py --ckpt out/ckpt-0002000 --start FILE:prompt.txt --device cuda --dtype bf16
    python sample.py --init-from gpt2 --start "Hello,"  # or ./gpt2, or a folder export.py
                                                        # --to hf wrote (also as --ckpt FOLDER)
    python sample.py --init-from ./gpt2 --adapter out/adapter   # + a LoRA adapter (PEFT's)

The checkpoint (a folder of checkpoint.py's, JSON and safetensors) carries everything needed:
the weights (fp32, model.py's names), the GPTConfig arguments and the data's meta.json (hence
the tokenizer). Nothing is unpickled, so a checkpoint from elsewhere can never run code when
loaded (nanoGPT's pickled ckpt.pt and meta.pkl could). A Hugging Face GPT-2 (config.json beside
safetensors) carries its shape in config.json and speaks GPT-2 BPE (tiktoken).
"""
import argparse
import sys

import torch

from configurator import OneLineParser, UserError
from data.prepare import get_codec
from lora import merge_lora
from machinery import pretrained
from machinery.adapters import load_adapter
from machinery.declared import generate
from machinery.run import run_main
from machinery.validate import vocab_id
from precision import resolve_dtype


def parse_args(argv=None):
    p = OneLineParser(prog="sample.py",  # a usage error is one line, not argparse's usage block
                      description="Generate text from a checkpoint of train.py.",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    arg = p.add_argument
    # where the model comes from: a run's newest checkpoint, a given one, or Hugging Face
    arg("--out-dir", default="out", help="use the newest checkpoint in train.py's --out-dir")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", metavar="PATH", help="a checkpoint folder or file, or a Hugging "
                     "Face folder (overrides --out-dir)")
    src.add_argument("--init-from", metavar="MODEL", help="a Hugging Face GPT-2: gpt2 | "
                     "gpt2-medium | gpt2-large | gpt2-xl, or a folder")
    arg("--adapter", metavar="PATH", help="a LoRA adapter folder in PEFT's format (train.py "
        "--lora writes OUT_DIR/adapter) to load onto the base and merge")
    # what to generate
    arg("--start", default="\n", help='the prompt; "FILE:prompt.txt" reads it from a file '
        "(default: %(default)r)")
    arg("--num-samples", type=int, default=3, metavar="N", help="samples to draw")
    arg("--max-new-tokens", type=int, default=500, metavar="N", help="tokens after the prompt")
    arg("--temperature", type=float, default=0.8, metavar="T",
        help="<1 safer, >1 wilder, 0 greedy")
    arg("--top-k", type=int, default=200, metavar="K", help="draw from the K likeliest; 0 = all")
    arg("--seed", type=int, default=1337, help="same seed, checkpoint and flags: same text")
    # where and in what precision
    arg("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if visible")
    arg("--dtype", default="fp32", help="fp32 | bf16 | fp16: the weights while sampling")
    args = p.parse_args(argv)
    pretrained.check_sample_flags(args)  # counts, temperature, seed: before any work
    return args


def sample(args):
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible: use --device cpu")
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = resolve_dtype(args.dtype, device)
    # the weights: a run's newest checkpoint, a given one, or a Hugging Face GPT-2
    what, ckpt = pretrained.weights_to_sample(args.ckpt, args.init_from, args.out_dir)
    model = pretrained.model_of(ckpt)  # its sizes checked before it is built
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
            raise UserError(f"cannot read the prompt {start[len('FILE:'):]}: {e}")
    encode, decode = get_codec(ckpt["meta"])
    ids = encode(start)  # UserError for characters outside a char vocabulary
    if not ids:
        raise UserError("the prompt is empty: --start needs at least one token")
    pretrained.check_sample_size(model, len(ids), args, device)  # samples x tokens: it fits

    # every check passed: say what is sampled
    print(f"sampling from {what}" + (f" (iteration {ckpt['iter']})" if "iter" in ckpt else "")
          + (f" + {args.adapter}" if args.adapter else "")
          + (", a LoRA run's: its base and adapters merged" if ckpt.get("lora") else "")
          + f", on {device.type}, {args.dtype}",
          file=sys.stderr)
    # all samples in one batch: one forward per new token, not one per token and sample
    x = torch.tensor([ids], dtype=torch.long, device=device).expand(args.num_samples, -1)  # (S, T)
    # torch.multinomial draws on the logits' device, and a CPU generator cannot drive a CUDA draw
    gen = torch.Generator(device=device).manual_seed(args.seed)
    # the model's generate(), or model.py's loop over forward's logits (a fork's: declared.py)
    y = generate(model, x, args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k or None, generator=gen)  # (S, T + max_new_tokens)
    for row in y.tolist():
        print(decode(row), "-" * 40, sep="\n")


def main(argv=None):
    """Returns the exit status: 0, or 2 after a one-line error (machinery/run.py's run_main)."""
    return run_main(lambda: sample(parse_args(argv)), "sample.py")


if __name__ == "__main__":
    sys.exit(main())
