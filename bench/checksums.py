"""
What the checkpoints' crc32 checksums cost: save and restore of a GPT-2 124M checkpoint
(consolidated, fp32 masters and Adam's moments: 1.5 GB), timed with the checksums and with
them switched off, on one process.

    python -m bench.checksums               # --repeats 3 --format consolidated|sharded

A save computes one crc32 per tensor (zlib, ~7 GB/s on one core); a restore recomputes it over
the bytes it reads. The numbers depend on the disk and its page cache: each figure is the best
of --repeats, with and without taken in turn; restores read files just written (from the page
cache: where the checksum's share is largest). The crc32 pass over every tensor is timed alone.
"""
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import checkpoint
from machinery import checked_ckpt, validate
from bench.common import Stopwatch, command, parser, report, table
from model import GPT, GPTConfig
from precision import GradScaler
from zero import ZeRO

GPT2_124M = dict(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768,
                 dropout=0.0, bias=True)


@contextmanager
def checksums_off():
    """crc32 replaced by a constant: what save and restore cost without it."""
    crc = checked_ckpt.piece_crc  # what a save writes and a read checks
    checked_ckpt.piece_crc = lambda t: 0
    try:
        yield
    finally:
        checked_ckpt.piece_crc = crc


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    p = parser("checksums", __doc__)
    p.add_argument("--repeats", type=int, default=3, help="rounds, each way in turn")
    p.add_argument("--format", choices=["consolidated", "sharded"], default="consolidated")
    p.add_argument("--out", default=None, help="a folder for the checkpoints (a temporary one)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    watch = Stopwatch()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT2_124M))
    zero = ZeRO(model, 0)
    header = {"config": {}, "model_args": GPT2_124M, "meta": {"tokenizer": "gpt2",
                                                             "vocab_size": 50257}}
    out = args.out or tempfile.mkdtemp(prefix="bench-checksums-")
    best = {}  # (label, "save" | "restore") -> the best time; the two ways taken in turn
    for _ in range(args.repeats):
        for label, ctx in (("with crc32", nullcontext), ("without", checksums_off)):
            with ctx():
                t = timed(lambda: checked_ckpt.save(out, 1, zero, model, GradScaler(), header,
                                                    args.format, 1))
                path = checkpoint.list_checkpoints(out)[-1]
                r = timed(lambda: checked_ckpt.restore(path, zero, model, GradScaler(), {}, {},
                                                       None))
            best[label, "save"] = min(t, best.get((label, "save"), t))
            best[label, "restore"] = min(r, best.get((label, "restore"), r))
    keys_of = checkpoint.state_keys(zero)
    keys = ("master", *sorted({k for ks in keys_of.values() for k in ks}))
    state = checkpoint.full_tensors(zero, model.stored_shapes(), keys, keys_of)
    alone = timed(lambda: [validate.crc(t) for e in state.values() for t in e.values()])
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    if not args.out:
        shutil.rmtree(out)
    rows = [[label, f"{best[label, 'save']:.2f}", f"{best[label, 'restore']:.2f}"]
            for label in ("with crc32", "without")]
    body = table(["checksums", "save (s)", "restore (s)"], rows)
    numbers = (f"GPT-2 124M, {args.format}, {size / 1e9:.2f} GB on disk; best of "
               f"{args.repeats}. The crc32 of every tensor alone: {alone:.2f} s.")
    report(command("checksums", argv), "checksums", body, numbers, watch, not args.no_write,
           heading="What the checkpoints' checksums cost")


if __name__ == "__main__":
    main()
