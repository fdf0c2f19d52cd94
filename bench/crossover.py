"""
Where --bf16 overtakes fp32 on a CPU: our step time (train.build, ZeRO stage 0, one process) in
fp32 and in bf16 as the model widens. A CPU with bf16 matrix units (AVX512-BF16, AMX) runs bf16
matmuls in hardware at up to twice fp32's rate or more, but a small model's step is dominated by
what is not a big matmul (conversions, LayerNorm, the optimizer on its fp32 master), so the
wider the model, the more bf16 can gain; without such units bf16 is emulated and slower.

    python -m bench.crossover                                        # widths 128 to 1024
    python -m bench.crossover --widths 64,128 --steps 2 --no-write   # a smoke run

BENCHMARKS.md's "crossover" section says how it measures.
"""
import os
import statistics
import sys
from dataclasses import replace

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import (OurRun, Stopwatch, comma_list, command, cpu_info, cpu_units, load_data,
                          paired_ratio, parser, report, spread, table, time_block)
from configurator import TrainConfig

PAIR = ("fp32", "bf16")  # the two dtypes compared
EVEN = 0.03  # ratios within 3% of 1 are "even": closer than rounds on a shared machine agree


def capability():
    """What this CPU offers bf16, as one line."""
    name, _ = cpu_info()
    units = ", ".join(cpu_units(["bf16"])) or "none: bf16 matmuls are emulated"
    return (f"{name}; torch's CPU capability {torch.backends.cpu.get_cpu_capability()}; "
            f"bf16 matrix units: {units}")


def measure_width(width, args, data, vocab):
    """(Ψ, {dtype: [ms per step, one per round]}) at this width, the dtypes alternating."""
    cfg = replace(TrainConfig(), n_embd=width, dropout=0.0)
    device = torch.device("cpu")
    runs = {dname: OurRun(replace(cfg, dtype=dname), data, vocab, device) for dname in PAIR}
    for run in runs.values():
        time_block(run.step, 0, 2, device)  # warm-up
    ms = {dname: [] for dname in PAIR}
    for r in range(args.rounds):  # fp32 bf16, bf16 fp32, ...: neither always first
        order = PAIR if r % 2 == 0 else PAIR[::-1]
        for dname in order:
            ms[dname].append(time_block(runs[dname].step, 2 + r * args.steps, args.steps, device))
    return runs["fp32"].zero.psi, ms


def main(argv=None):
    p = parser("crossover", __doc__)
    p.add_argument("--widths", default="128,256,512,768,1024",
                   help="comma list of n_embd (multiples of the 4 heads)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round and dtype")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per width")
    args = p.parse_args(argv)
    widths = comma_list(p, "--widths", args.widths, kind=int)
    if any(w < 4 or w % 4 for w in widths):
        p.error(f"--widths {args.widths}: multiples of 4 (the heads)")
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds: at least 1")
    print(capability(), flush=True)
    data, vocab = load_data()
    watch, rows, crossover = Stopwatch(), [], None
    for width in widths:
        psi, ms = measure_width(width, args, data, vocab)
        ratio = paired_ratio(ms["bf16"], ms["fp32"])
        faster = "even"
        if ratio < 1 - EVEN:
            faster = "bf16"
        elif ratio > 1 + EVEN:
            faster = "fp32"
        if faster == "bf16" and crossover is None:
            crossover = width
        rows.append([width, f"{psi:,}", f"{statistics.median(ms['fp32']):.1f}",
                     spread(ms["fp32"]), f"{statistics.median(ms['bf16']):.1f}",
                     spread(ms["bf16"]), f"{ratio:.2f}×", faster])
        print(f"width {width}: fp32 {statistics.median(ms['fp32']):.1f} ms, "
              f"bf16 {statistics.median(ms['bf16']):.1f} ms", flush=True)
    body = table(["n_embd", "Ψ", "fp32 ms/step", "spread", "bf16 ms/step", "spread",
                  "bf16 / fp32", "faster"], rows)
    verdict = f"bf16 is faster by more than {EVEN:.0%} at none of these widths"
    if crossover is not None:
        verdict = f"bf16 is first faster by more than {EVEN:.0%} at n_embd {crossover}"
    numbers = (f"{capability()}. {torch.get_num_threads()} threads; 4 layers, 4 heads, block 64, "
               f"batch 12; {args.rounds} rounds of {args.steps} steps per dtype after 2 warm-up "
               f"steps. {verdict}.")
    report(command("crossover", argv), "crossover", body, numbers, watch, not args.no_write,
           "Where bf16 overtakes fp32 on a CPU")


if __name__ == "__main__":
    main()
