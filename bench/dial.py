"""
Activation memory as a dial: what each --grad-ckpt setting saves and what it costs, measured.

bench.costs's rows (our ZeRO stage, each set up by train.build) for every setting in --ckpt,
timed in alternating rounds (each round builds every setting afresh in a rotated order), each
beside the same stage without checkpointing: the activations saved for backward per micro-step
(meter.saved_activation_bytes, beside memory.py's estimate), the step time (paired by round:
a round slow for everyone cancels out) and their ratio, MiB saved per 1% of step time paid.
The CPU demo model on one process by default; on GPUs bench.costs's GPU model.

    python -m bench.dial                       # none, selective, every 2nd / 4th block, full
    python -m bench.dial --ckpt none,selective,full --steps 30 --no-write
    python -m bench.dial --stages 3 --world-size 2 --lora lora

BENCHMARKS.md's "activations" section holds the last run.
"""
import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from beyond.activation_dial import setting
from bench import costs
from bench.common import Stopwatch, command, comma_list, load_data, paired_ratio, parser, report
from bench.common import table

DIAL = ["configuration", "dtype", "activations MiB", "memory.py", "saved vs none",
        "ms/step", "time vs none", "MiB saved per 1% of step time"]


def dial_rows(results, world_size, vocab):
    """Every row of bench.costs, and for a checkpointed one what it saved and what it paid."""
    rows = []
    by_name = {r[0]: r for r in costs.cost_rows(results, world_size, vocab)[0]}
    for res in results:
        for key, info in res["info"].items():
            stage, ckpt, lora = costs.parse_key(key)
            base_key = costs.ours_key(stage, False, lora)
            base, row = res["info"].get(base_key), by_name[costs.describe(key)]
            saved = paid = per = "-"
            if ckpt and base is not None:
                saved_bytes = base["act"] - info["act"]
                ratio = paired_ratio(res["rounds"][key], res["rounds"][base_key])
                saved = f"{saved_bytes / 2**20:.2f} ({saved_bytes / base['act']:.0%})"
                paid = f"{ratio:.2f}×"
                per = f"{saved_bytes / 2**20 / ((ratio - 1) * 100):.2f}" if ratio > 1 else \
                    "nothing paid"
            # row: costs.HEADER's cells; 5, 6: activations and memory.py's verdict; 9: ms/step
            rows.append([row[0], res["dtype"], row[5], row[6], saved, row[9], paid, per])
    return rows


def main(argv=None):
    p = parser("dial", __doc__)
    p.add_argument("--ckpt", default="none,selective,selective/2,full/4,full/2,full",
                   help="comma list of --grad-ckpt settings: none, full, selective, each "
                   "with /K for every K-th block")
    p.add_argument("--steps", type=int, default=60, help="timed steps per setting, 5 rounds")
    p.add_argument("--world-size", type=int, default=1, help="ranks (gloo on a CPU)")
    p.add_argument("--dtypes", default="fp32", help="comma list: fp32,bf16,fp16")
    p.add_argument("--stages", default="0", help="comma list of our ZeRO stages")
    p.add_argument("--lora", default="off", help="comma list: off,lora,qlora")
    a = p.parse_args(argv)
    if a.steps < 1 or a.world_size < 1:
        p.error("--steps and --world-size: at least 1")
    args = argparse.Namespace(
        steps=a.steps, refs=False, dtypes=comma_list(p, "--dtypes", a.dtypes, costs.DTYPES),
        stages=comma_list(p, "--stages", a.stages, (0, 1, 2, 3), int),
        lora=comma_list(p, "--lora", a.lora, costs.LORA_MODES),
        ckpt=comma_list(p, "--ckpt", a.ckpt, kind=setting))
    if not any(not c for c in args.ckpt):
        p.error("--ckpt: include none, the setting the others are compared with")
    watch = Stopwatch()
    results = costs.measure(args, a.world_size)
    _, vocab = load_data()
    cfg = costs.costs_config()
    numbers = (f"N = {a.world_size}; {cfg.n_layer} layers, {cfg.n_embd} wide, "
               f"{cfg.batch_size} x {cfg.block_size} tokens per rank; rounds x steps: "
               + ", ".join(f"{r['dtype']} {r['steps']}" for r in results) + ".")
    report(command("dial", argv), "activations", table(DIAL, dial_rows(results, a.world_size,
                                                                        vocab)),
           numbers, watch, not a.no_write, "Activation memory as a dial")


if __name__ == "__main__":
    main()
