"""
Loss curves by optimizer: train.py on the CPU demo (config/shakespeare_char_cpu.py), one run
per --optimizer, the validation loss at every evaluation side by side. About 5 minutes a run
on 2 cores at the preset's 2000 steps.

    python -m bench.optimizers                           # AdamW beside Muon (beyond/muon.py)
    python -m bench.optimizers --optimizers adamw,muon,lion --lr 1e-3,1e-3,3e-4
    python -m bench.optimizers --max-iters 40 --no-write # a smoke run

Each run is train.py itself in a subprocess (one process, its own threads), with the preset's
learning rate and schedule unless --lr says otherwise: Muon shares AdamW's learning rate
(Moonlight's scaling of its update). One seed a run: differences of a few thousandths are
within a seed's spread (bench.quality: 1.9006 to 1.9128 over 3 seeds).
"""
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optim
from bench.common import Stopwatch, comma_list, command, parser, report, run_train, table

PRESET = "config/shakespeare_char_cpu.py"


def main(argv=None):
    p = parser("optimizers", __doc__)
    p.add_argument("--optimizers", default="adamw,muon", help="comma list of --optimizer names")
    p.add_argument("--lr", default="", help="comma list of learning rates, one an optimizer "
                   "(default: the preset's)")
    p.add_argument("--max-iters", type=int, default=0, help="steps (default: the preset's)")
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads of each run")
    args = p.parse_args(argv)
    names = comma_list(p, "--optimizers", args.optimizers, allowed=optim.OPTIMIZERS)
    lrs = comma_list(p, "--lr", args.lr, kind=float) if args.lr else [None] * len(names)
    if len(lrs) != len(names):
        p.error(f"--lr {args.lr}: one learning rate for each of {len(names)} optimizers")
    watch, curves, ms = Stopwatch(), {}, {}
    for name, lr in zip(names, lrs):
        flags = ["--config", PRESET, "--device", "cpu", "--optimizer", name]
        flags += ["--learning-rate", str(lr)] if lr else []
        flags += ["--max-iters", str(args.max_iters)] if args.max_iters else []
        with tempfile.TemporaryDirectory() as tmp:
            rows = run_train(flags, tmp, threads=args.threads)
        curves[name] = {r["iter"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
        ms[name] = statistics.median(r["ms"] for r in rows if "ms" in r and r["iter"] >= 10)
        print(f"{name}: val {curves[name][max(curves[name])]:.4f}", flush=True)
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    body = table(["step"] + [f"{n}: val loss" for n in names],
                 [[s] + [f"{curves[n][s]:.4f}" for n in names] for s in steps]
                 + [["ms/step"] + [f"{ms[n]:.1f}" for n in names]])
    numbers = (f"`{PRESET}`, one process, {args.threads} threads, seed 1337; learning rates: "
               + ", ".join(f"{n} {lr or 'the preset'}" for n, lr in zip(names, lrs)) + ".")
    report(command("optimizers", argv), "optimizers", body, numbers, watch, not args.no_write,
           "Optimizers: loss curves on the CPU demo")


if __name__ == "__main__":
    main()
