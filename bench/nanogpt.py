"""
Our loop's step time beside nanoGPT's own train.py, on nanoGPT's CPU recipe (4 layers, 128
wide, block 64, batch 12, fp32, one process) and the same data: Tiny Shakespeare, one token a
character. The two run in turns, N steps each per round, and each reports its own per-step
times: nanoGPT's printed `iter N: loss X, time Y ms`, our metrics.jsonl `ms`.

nanoGPT is not part of this repository: bring a checkout of it.

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT
    python -m bench.nanogpt --nanogpt ../nanoGPT                 # 3 rounds x 200 steps each
    python -m bench.nanogpt --nanogpt ../nanoGPT --rounds 1 --steps 20 --no-write
    python -m bench.nanogpt --nanogpt ../nanoGPT --compile     # both sides torch.compile'd

nanoGPT's data/shakespeare_char/prepare.py downloads Tiny Shakespeare; we write its input.txt
from our copy (data/tinyshakespeare.txt) first, so it runs offline, and check that its token
files equal ours. BENCHMARKS.md's "nanogpt" section says how it measures.
"""
import hashlib
import os
import re
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from bench.common import (Stopwatch, command, load_data, paired_ratio, parser, report, run_train,
                          table)
from data.prepare import TINY_PATH, TINY_SHA256

HOW = "git clone https://github.com/karpathy/nanoGPT"
# nanoGPT's README, "I only have a macbook": its CPU recipe for shakespeare_char, except that
# --max_iters is the round's length (lr_decay_iters stays 2000: the same schedule)
RECIPE = ["config/train_shakespeare_char.py", "--device=cpu",
          "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12",
          "--n_layer=4", "--n_head=4", "--n_embd=128", "--lr_decay_iters=2000", "--dropout=0.0"]
ITER_LINE = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+) ?ms", re.M)
SKIP = 10  # steps left out at the start of each run: warm-up (and nanoGPT's first evaluation)


def prepare_nanogpt_data(path):
    """nanoGPT's shakespeare_char from our copy of Tiny Shakespeare, checked to be token for
    token the data our train.py reads."""
    folder = os.path.join(path, "data", "shakespeare_char")
    text = os.path.join(folder, "input.txt")
    if os.path.isfile(text):
        with open(text, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != TINY_SHA256:
                sys.exit(f"python -m bench.nanogpt: error: {text} is not Tiny Shakespeare: "
                         "remove it, and this benchmark writes it from our copy")
    else:
        with open(TINY_PATH, "rb") as src, open(text, "wb") as dst:
            dst.write(src.read())
    if not os.path.isfile(os.path.join(folder, "train.bin")):
        subprocess.run([sys.executable, "prepare.py"], cwd=folder, check=True,
                       capture_output=True)
    theirs = np.fromfile(os.path.join(folder, "train.bin"), dtype=np.uint16)
    if not np.array_equal(theirs, np.asarray(load_data()[0])):
        sys.exit(f"python -m bench.nanogpt: error: {folder}/train.bin differs from our "
                 "data/shakespeare_char/train.bin: not the same data")


def run_nanogpt(path, steps, out_dir, compile=False):
    """nanoGPT's train.py for steps + 1 iterations (it runs 0..max_iters): {iter: (loss, ms)}."""
    cmd = [sys.executable, "train.py", *RECIPE, f"--compile={compile}", f"--max_iters={steps}",
           f"--out_dir={out_dir}"]
    done = subprocess.run(cmd, cwd=path, check=True, capture_output=True, text=True)
    return {int(i): (float(loss), float(ms)) for i, loss, ms in ITER_LINE.findall(done.stdout)}


def run_ours(steps, out_dir, compile=False):
    """Our train.py on the same recipe (config/shakespeare_char_cpu.py is it), logging every
    step as nanoGPT does here: {iter: (loss, ms)}."""
    rows = run_train(["--config", "config/shakespeare_char_cpu.py", "--device", "cpu",
                      "--log-interval", "1", "--max-iters", str(steps),
                      "--lr-decay-iters", "2000"]  # nanoGPT's schedule, as RECIPE sets it
                     + (["--compile"] if compile else []), out_dir)
    return {r["iter"]: (r["loss"], r["ms"]) for r in rows if "ms" in r}


def median_ms(log):
    return statistics.median(ms for it, (_, ms) in log.items() if it >= SKIP)


def main(argv=None):
    p = parser("nanogpt", __doc__)
    p.add_argument("--nanogpt", metavar="PATH", help=f"a nanoGPT checkout ({HOW})")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs both once")
    p.add_argument("--steps", type=int, default=200, help="steps of each run")
    p.add_argument("--compile", action="store_true", help="both sides with torch.compile "
                   "(nanoGPT: the whole model; ours: each block and the loss head)")
    args = p.parse_args(argv)
    if not args.nanogpt:
        p.error(f"--nanogpt PATH: a nanoGPT checkout is needed ({HOW})")
    if not os.path.isfile(os.path.join(args.nanogpt, "train.py")):
        p.error(f"--nanogpt {args.nanogpt}: no nanoGPT checkout there ({HOW})")
    if args.rounds < 1 or args.steps <= SKIP:
        p.error(f"--rounds: at least 1; --steps: more than {SKIP}")
    path = os.path.abspath(args.nanogpt)
    prepare_nanogpt_data(path)
    watch, ms, last = Stopwatch(), {"ours": [], "nanogpt": []}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # ours first in even rounds, nanoGPT first in odd ones
            for side in (("ours", "nanogpt") if r % 2 == 0 else ("nanogpt", "ours")):
                out = os.path.join(tmp, f"{side}{r}")
                log = run_ours(args.steps, out, args.compile) if side == "ours" else \
                    run_nanogpt(path, args.steps, out, args.compile)
                ms[side].append(median_ms(log))
                last[side] = log[max(log)][0]
                print(f"round {r}: {side} {ms[side][-1]:.1f} ms/step", flush=True)
    rows = [[r, f"{ms['ours'][r]:.1f}", f"{ms['nanogpt'][r]:.1f}",
             f"{ms['ours'][r] / ms['nanogpt'][r]:.2f}×"] for r in range(args.rounds)]
    rows.append(["median", f"{statistics.median(ms['ours']):.1f}",
                 f"{statistics.median(ms['nanogpt']):.1f}",
                 f"{paired_ratio(ms['ours'], ms['nanogpt']):.2f}×"])
    body = table(["round", "ours: ms/step", "nanoGPT: ms/step", "ours / nanoGPT"], rows)
    commit = "unknown (not a git checkout)"
    if os.path.exists(os.path.join(path, ".git")):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path,
                                capture_output=True, text=True).stdout.strip()
    mode = "both compiled (torch.compile)" if args.compile else "both eager"
    numbers = (f"nanoGPT at commit {commit}, {mode}; {args.rounds} rounds of {args.steps} "
               f"steps each, the median step time after the first {SKIP} of each run; loss at "
               f"the last step: ours {last['ours']:.4f}, nanoGPT {last['nanogpt']:.4f}.")
    name = "nanogpt-compile" if args.compile else "nanogpt"
    report(command("nanogpt", argv), name, body, numbers, watch, not args.no_write,
           "Our loop beside nanoGPT's train.py, both compiled" if args.compile else
           "Our loop beside nanoGPT's train.py")


if __name__ == "__main__":
    main()
