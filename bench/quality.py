"""
Quality over seeds: nanoGPT's CPU recipe (config/shakespeare_char_cpu.py, 2000 steps), train.py
beside a plain loop written the way nanoGPT's is, every final model scored on the same 200
validation batches. About 3 minutes a seed and path on 2 cores.

    python -m bench.quality                              # seeds 1337, 2, 3 on Tiny Shakespeare
    python -m bench.quality --seeds 1 --max-iters 30 --no-write   # a smoke run

BENCHMARKS.md's "quality" section says how it measures.
"""
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from bench.common import (Stopwatch, adamw, comma_list, command, parser, plain_step, report,
                          run_train, table)
from configurator import UserError, TrainConfig
from configurator import load_preset
from model import GPT
from data.loader import get_batch, load_data
from train import model_config
from train import get_lr

PRESET = "config/shakespeare_char_cpu.py"
EVAL_ITERS = 200  # validation batches each final model is scored on


def run_train_py(cfg, dataset):
    """(a) train.py itself on the CPU: (its final val loss over EVAL_ITERS batches, ms per step
    after the first 10)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = run_train(["--config", PRESET, "--device", "cpu", "--dataset", dataset,
                         "--seed", str(cfg.seed), "--max-iters", str(cfg.max_iters),
                         "--eval-iters", str(EVAL_ITERS), "--eval-interval", str(cfg.max_iters)],
                        tmp, threads=torch.get_num_threads())
    val = [r["val_loss"] for r in log if r.get("val_loss") is not None][-1]
    return val, [r["ms"] for r in log if "ms" in r and r["iter"] >= 10]


def run_plain(cfg, train, val, vocab):
    """(b) the plain loop as nanoGPT writes it: the model from torch.manual_seed(seed), then
    batch offsets from the same global RNG; torch's AdamW (unfused, as nanoGPT's on a CPU) and
    clip_grad_norm_. Returns (val loss over the same EVAL_ITERS batches as train.py's estimate,
    the standard deviation of a 20-batch mean of them, ms per step after the first 10)."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_config(cfg, vocab))
    opt = adamw(model, cfg, fused=False)
    ms = []
    for it in range(cfg.max_iters):
        t0 = time.perf_counter()
        ix = torch.randint(len(train) - cfg.block_size, (cfg.batch_size,))
        xy = np.stack([train[i:i + cfg.block_size + 1] for i in ix])
        xy = torch.from_numpy(xy.astype(np.int64))
        plain_step(model, opt, cfg, xy[:, :-1], xy[:, 1:], get_lr(it, cfg))
        ms.append((time.perf_counter() - t0) * 1000)
    model.eval()
    losses = []
    with torch.no_grad():  # data.loader.estimate_loss: the val split's fixed batches
        for k in range(EVAL_ITERS):
            x, y = get_batch(val, cfg.seed + 7919 * 2, k, 0, 0, 1, cfg.batch_size,
                             cfg.block_size, 1)
            losses.append(model(x, y)[1].item())
    se20 = statistics.stdev(losses) / math.sqrt(20)
    return statistics.mean(losses), se20, ms[10:]


def mean_sd(xs):
    text = f"{statistics.mean(xs):.4f}"
    return text + (f" ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else "")


def main(argv=None):
    p = parser("quality", __doc__)
    p.add_argument("--seeds", default="1337,2,3", help="comma list of seeds")
    p.add_argument("--dataset", default="shakespeare_char", help="a data set under data/")
    p.add_argument("--max-iters", type=int, default=0,
                   help="steps of each run (default: the preset's 2000)")
    args = p.parse_args(argv)
    seeds = comma_list(p, "--seeds", args.seeds, kind=int)
    if args.max_iters and args.max_iters < 20:  # step times leave out the first 10
        p.error(f"--max-iters {args.max_iters}: 20 or more (0: the preset's)")
    torch.set_num_threads(min(2, os.cpu_count()))  # nanoGPT's CPU recipe on 2 cores
    try:  # train.py's loader: prepared on first use, or a one-line error that says how
        train, val, meta = load_data(replace(TrainConfig(), dataset=args.dataset), 0, 1)
    except UserError as e:
        p.error(str(e))
    vocab = meta["vocab_size"]
    watch, rows, finals = Stopwatch(), [], {"train.py": [], "plain": []}
    for seed in seeds:
        cfg = replace(TrainConfig(**load_preset(PRESET)), seed=seed)
        if args.max_iters:
            cfg = replace(cfg, max_iters=args.max_iters)
        a_val, a_ms = run_train_py(cfg, args.dataset)
        b_val, se20, b_ms = run_plain(cfg, train, val, vocab)
        finals["train.py"].append(a_val)
        finals["plain"].append(b_val)
        rows.append([seed, f"{a_val:.4f}", f"{statistics.median(a_ms):.1f}", f"{b_val:.4f}",
                     f"{statistics.median(b_ms):.1f}", f"±{se20:.3f}"])
        print(f"seed {seed}: train.py {a_val:.4f}, plain {b_val:.4f}", flush=True)
    rows.append(["mean ± sd", mean_sd(finals["train.py"]), "", mean_sd(finals["plain"]), "", ""])
    body = table(["seed", "train.py: val loss", "ms/step", "plain nanoGPT-style loop: val loss",
                  "ms/step", "sd of a 20-batch estimate"], rows)
    numbers = (f"`{PRESET}` on `{args.dataset}`, {cfg.max_iters} steps, one process, "
               f"{torch.get_num_threads()} threads.")
    report(command("quality", argv), "quality", body, numbers, watch, not args.no_write,
           "Quality: nanoGPT's CPU recipe, train.py vs a plain loop, by seed")


if __name__ == "__main__":
    main()
