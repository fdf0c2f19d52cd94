"""
The training loop's own overhead, and tokens/s per dtype, on one process.

loop: (a) the textbook PyTorch step (forward, backward, clip_grad_norm_, fused AdamW) against
(b) our step (train.build's ZeRO stage 0 and GradScaler, train.py's loop calls) in alternating
rounds, and (c) train.py itself, logging every step; target: (b) within 5% of (a).
precision: our step in fp32, bf16 and fp16 (GradScaler dynamic for fp16).

    python -m bench.loop                       # both sections, the CPU demo model
    python -m bench.loop --only loop --steps 60 --no-write
    python -m bench.loop --only loop --compile  # (a) torch.compile(model); (b), (c) --compile
    python bench/loop.py --only precision

BENCHMARKS.md's "loop" and "precision" sections say how they measure.
"""
import os
import statistics
import sys
import tempfile
from dataclasses import replace

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import (OurRun, PlainRun, Stopwatch, adamw, command, cpu_units, default_device,
                          load_data, paired_ratio, parser, report, run_train, spread, table,
                          time_block)
from configurator import TrainConfig
from configurator import load_preset
from model import GPT
from precision import DTYPES, resolve_dtype
from train import model_config

TARGET = 1.05  # our step may take at most 5% longer than the plain one


def demo_config(device):
    """The CPU demo model; on a GPU nanoGPT's GPU baseline, where the demo model would measure
    kernel launches and no dtype at all."""
    if device.type == "cuda":
        return TrainConfig(**load_preset("config/shakespeare_char.py"))
    return TrainConfig()


def loop_overhead(args, device):
    """Rows for (a), (b), (c), and the numbers line."""
    cfg, (data, vocab) = TrainConfig(compile=args.compile), load_data()
    steps = args.steps or 200
    rounds = max(2, steps // 20)  # short rounds: a and b see the same machine
    per_round = max(1, steps // rounds)
    torch.manual_seed(cfg.seed)  # the weights train.build starts from
    plain = GPT(model_config(cfg, vocab)).to(device)
    opt = adamw(plain, cfg)
    if args.compile:  # the whole model, as nanoGPT compiles it
        plain = torch.compile(plain)
    runs = {"a": PlainRun(plain, opt, cfg, data, device),
            "b": OurRun(cfg, data, vocab, device)}
    ms = {"a": [], "b": []}
    for w in "ab":
        time_block(runs[w].step, 0, 5, device)  # warm-up
    for r in range(rounds):  # a b, b a, a b, ...: neither always first; fresh batches all along
        for w in ("ab" if r % 2 == 0 else "ba"):
            ms[w].append(time_block(runs[w].step, 5 + r * per_round, per_round, device))
    a, b = statistics.median(ms["a"]), statistics.median(ms["b"])
    overhead = paired_ratio(ms["b"], ms["a"])
    c_ms = train_py_ms(["--compile"] if args.compile else [])
    c = statistics.median(c_ms)
    compiled = ", compiled" if args.compile else ""
    rows = [[f"(a) plain PyTorch: forward, backward, clip_grad_norm_, fused AdamW{compiled}",
             f"{a:.2f}",
             spread(ms["a"]), "-", "-"],
            ["(b) our train path: ZeRO stage 0 (N=1) + GradScaler(1, fixed)", f"{b:.2f}",
             spread(ms["b"]), percent(overhead), judge(overhead)],
            [f"(c) `train.py --max-iters 60 --eval-interval 1000 --log-interval 1"
             f"{' --compile' if args.compile else ''}`", f"{c:.2f}",
             spread(c_ms) + " (steps)", percent(c / a), judge(c / a)]]
    body = table(["path", "ms/step", "spread (round means)", "overhead vs (a)", "target < 5%"],
                 rows)
    numbers = (f"{device.type}, {torch.get_num_threads()} threads; (a), (b): {rounds} rounds of "
               f"{per_round} steps after 5 warm-up steps; (c): {len(c_ms)} steps.")
    return body, numbers


def percent(ratio):
    return f"{(ratio - 1) * 100:+.1f}%"


def judge(ratio):
    return "met" if ratio <= TARGET else "**missed**"


def train_py_ms(extra=()):
    """(c): train.py as a user runs it, logging every step (so it also pays loss.item(), the
    gradient zero-fraction count, a JSON line); its metrics.jsonl `ms` after the first 10."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_train(["--max-iters", "60", "--eval-interval", "1000", "--log-interval", "1",
                          *extra], tmp, threads=torch.get_num_threads())
    return [r["ms"] for r in rows if "ms" in r and r["iter"] >= 10]


def precision(args, device):
    """tokens/s of our step in fp32, bf16 and fp16, and the scaler's account of each run."""
    data, vocab = load_data()
    base, rows, few = None, [], []
    for dname in DTYPES:
        # without matrix units for the dtype 16-bit matmuls are emulated and slow: a few steps
        emulated = device.type == "cpu" and dname != "fp32" and not cpu_units([dname])
        n = args.steps or 30
        if emulated:
            n = min(5, n)
            few.append(dname)
        try:
            resolve_dtype(dname, device)
        except ValueError:
            continue  # bf16 on a pre-Ampere GPU: train.py refuses it there too
        cfg = replace(demo_config(device), dtype=dname)
        run = OurRun(cfg, data, vocab, device, count_skips=True)
        time_block(run.step, 0, 2, device)  # warm-up
        ms = time_block(run.step, 2, n, device)
        tps = cfg.batch_size * cfg.block_size / (ms / 1000)
        base = base or tps
        rows.append([dname, n, f"{ms:.1f}", f"{tps:,.0f}", f"{tps / base:.2f}×",
                     f"{int(run.skipped.item())} / {run.scaler.get_scale():g}"])
    body = table(["dtype", "timed steps", "ms/step", "tokens/s", "vs fp32",
                  "skipped steps / final scale"], rows)
    cfg = demo_config(device)
    numbers = (f"{device.type}, {torch.get_num_threads()} threads; {cfg.n_layer} layers, "
               f"{cfg.n_embd} wide, block {cfg.block_size}, batch {cfg.batch_size}; one block "
               f"of the timed steps after 2 warm-up steps.")
    if few:
        numbers += (f" No {' or '.join(few)} matrix units on this CPU: such matmuls are "
                    "emulated, hence only a few steps.")
    return body, numbers


def main(argv=None):
    p = parser("loop", __doc__)
    p.add_argument("--only", choices=("loop", "precision"), help="run only this section")
    p.add_argument("--compile", action="store_true", help="loop: every path torch.compile'd "
                   "(written as section loop-compile)")
    p.add_argument("--steps", type=int, help="timed steps: per path (loop, default 200); per "
                   "dtype (precision, default 30; at most 5 for a 16-bit dtype this CPU emulates)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps}: at least 1")
    torch.set_num_threads(min(2, os.cpu_count()))  # as the CPU demo runs; the same in every run
    device = default_device()
    sections = {"loop": (loop_overhead, "Loop overhead"),
                "precision": (precision, "Tokens/s by precision")}
    for name in [args.only] if args.only else list(sections):
        measure, heading = sections[name]
        watch = Stopwatch()
        body, numbers = measure(args, device)
        if args.compile and name == "loop":
            name, heading = "loop-compile", "Loop overhead, compiled"
        report(command("loop", argv), name, body, numbers, watch, not args.no_write, heading)


if __name__ == "__main__":
    main()
