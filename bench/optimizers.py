"""
Loss curves by optimizer: train.py on the CPU demo (config/shakespeare_char_cpu.py), one run
per --optimizer, the validation loss at every evaluation side by side, in one process and at
ZeRO-3 on 2 ranks. About 5 minutes a run on 2 cores at the preset's 2000 steps.

    python -m bench.optimizers                           # AdamW beside Muon (beyond/muon.py)
    python -m bench.optimizers --optimizers adamw,muon,lion --lr 1e-3,1e-3,3e-4
    python -m bench.optimizers --max-iters 40 --zero3-ranks 0 --no-write  # a smoke run

Each run is train.py itself in a subprocess, with the preset's learning rate and schedule
unless --lr says otherwise: Muon shares AdamW's learning rate (Moonlight's scaling of its
update). One seed a run: differences of a few thousandths are within a seed's spread
(bench.quality: 1.9006 to 1.9128 over 3 seeds).

The ZeRO-3 rows run `torchrun --nproc_per_node=N train.py --zero 3` (gloo) on the preset's
global batch, each rank 12 / N sequences; the one-process runs then take the same batches as
N micro-steps of 12 / N (data/loader.py draws them alike, and evaluation scores batches of
--batch-size: the same ones too). Muon there is beyond/muon.py's WholeZeRO3, each block
matrix whole on one rank: its val loss is the one process's to the rounding of another
summation order, and its state bytes per rank show the dealt layout's padding beside
AdamW's flat cut. --rounds R runs every configuration R times,
in turn (so that a load on a shared machine falls on all alike): the losses are the first
round's (they do not depend on the load), ms/step the median over rounds of each run's
median. Adafactor is not a train.py --optimizer: tests/test_muon3.py holds it at ZeRO-3.
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
BATCH = 12  # the preset's micro-batch: the global batch that ZeRO-3's ranks share


def run(name, lr, ranks, args, tmp):
    """One train.py run, in one process (ranks 0) or at ZeRO-3 on `ranks` gloo ranks: (val
    loss by step, median ms a step, model-state bytes of each rank)."""
    flags = ["--config", PRESET, "--device", "cpu", "--optimizer", name]
    flags += ["--learning-rate", str(lr)] if lr else []
    flags += ["--max-iters", str(args.max_iters)] if args.max_iters else []
    launcher, N = (), args.zero3_ranks
    if N:  # each rank, or each micro-step of one process, its share of the same global batch
        flags += ["--batch-size", str(BATCH // N)] + (["--grad-accum", str(N)] if not ranks
                                                      else ["--zero", "3"])
    if ranks:
        launcher = ("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}")
    rows = run_train(flags, os.path.join(tmp, f"{name}-{ranks}"), launcher, args.threads)
    curve = {r["iter"]: r["val_loss"] for r in rows if r.get("val_loss") is not None}
    ms = statistics.median(r["ms"] for r in rows if "ms" in r and r["iter"] >= 10)
    state = next(r for r in rows if r.get("event") == "model_state")["per_rank"]
    return curve, ms, [s["total"] for s in state]


def main(argv=None):
    p = parser("optimizers", __doc__)
    p.add_argument("--optimizers", default="adamw,muon", help="comma list of --optimizer names")
    p.add_argument("--lr", default="", help="comma list of learning rates, one an optimizer "
                   "(default: the preset's)")
    p.add_argument("--max-iters", type=int, default=0, help="steps (default: the preset's)")
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads of each process "
                   "(each rank's, at ZeRO-3)")
    p.add_argument("--zero3-ranks", type=int, default=2, help="ranks of the ZeRO-3 runs (0: "
                   "one process only)")
    p.add_argument("--rounds", type=int, default=1, help="runs of every configuration, in turn")
    args = p.parse_args(argv)
    names = comma_list(p, "--optimizers", args.optimizers, allowed=optim.OPTIMIZERS)
    lrs = comma_list(p, "--lr", args.lr, kind=float) if args.lr else [None] * len(names)
    if len(lrs) != len(names):
        p.error(f"--lr {args.lr}: one learning rate for each of {len(names)} optimizers")
    if args.zero3_ranks < 0 or args.zero3_ranks and BATCH % args.zero3_ranks:
        p.error(f"--zero3-ranks {args.zero3_ranks}: 0, or a divisor of the preset's batch of "
                f"{BATCH}")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    runs = [(n, lr, ranks) for ranks in sorted({0, args.zero3_ranks}) for n, lr in
            zip(names, lrs)]
    watch, curves, ms, state = Stopwatch(), {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, lr, ranks in runs:
                curve, t, held = run(name, lr, ranks, args, os.path.join(tmp, str(r)))
                curves.setdefault((name, ranks), curve)
                ms.setdefault((name, ranks), []).append(t)
                state[name, ranks] = held
                print(f"round {r + 1}: {label(name, ranks)}: val {curve[max(curve)]:.4f}, "
                      f"{t:.1f} ms/step", flush=True)
    keys = [(n, ranks) for n, _, ranks in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    mib = lambda held: " / ".join(f"{b / 2**20:.2f}" for b in held)
    body = table(["step"] + [f"{label(*k)}: val loss" for k in keys],
                 [[s] + [f"{curves[k][s]:.4f}" for k in keys] for s in steps]
                 + [["ms/step"] + [f"{statistics.median(ms[k]):.1f}" for k in keys]]
                 + [["model state, MiB a rank"] + [mib(state[k]) for k in keys]])
    numbers = (f"`{PRESET}`, seed 1337, {args.threads} thread(s) a process, "
               f"{args.rounds} round(s); learning rates: "
               + ", ".join(f"{n} {lr or 'the preset'}" for n, lr in zip(names, lrs)) + ".")
    report(command("optimizers", argv), "optimizers", body, numbers, watch, not args.no_write,
           "Optimizers: loss curves on the CPU demo")


def label(name, ranks):
    return f"{name} ZeRO-3 x{ranks}" if ranks else name


if __name__ == "__main__":
    main()
