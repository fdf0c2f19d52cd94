"""
The ZeRO paper's model-state table, measured: train.py's own build() and one train_step() at
the real size, as rank 0 of 8, 64 and 1,024 GPUs, on fake tensors and the fake process group
(machinery/measure.py, memory.py --measure), for GPT-2 124M and model.py's GPT at 7B and 70B.

Each cell is what the rank holds (ZeRO.state_bytes) beside the paper's formula at the model's
own Ψ (Rajbhandari et al. 2019, Table 1 / Figure 1: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N in
bf16 with AdamW). The last columns: ZeRO-3's measured peak for one micro-step of one sequence
with activation checkpointing (MemTracker), beside memory.py's estimate of the same CPU run, and
the seconds the four stages took. The bytes do not depend on the machine; the seconds do.

    python -m bench.scale                          # the whole table
    python -m bench.scale --models gpt2 --world-sizes 8,64 --no-write
"""
import os
import sys
from dataclasses import replace

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Stopwatch, comma_list, command, parser, report, table
from configurator import parse_args
from machinery import measure
from machinery.estimator import fmt
from machinery.footprint import for_run
from train import model_config
from zero import zero_formula

# (name, train.py's flags): GPT-2's preset; 7B and 70B as Llama 2's widths and depths on
# model.py's GPT (a GELU MLP of 4h, learned positions, GPT-2's vocabulary)
MODELS = {"gpt2": ("GPT-2 124M", ["--config", "config/gpt2_124m.py", "--batch-tokens", "0"]),
          "7b": ("7B", ["--n-layer", "32", "--n-embd", "4096", "--n-head", "32",
                        "--block-size", "2048", "--dataset", "shakespeare"]),
          "70b": ("70B", ["--n-layer", "80", "--n-embd", "8192", "--n-head", "64",
                          "--block-size", "2048", "--dataset", "shakespeare"])}
RUN = ["--bf16", "--batch-size", "1", "--grad-ckpt", "full"]
VOCAB = 50257  # GPT-2's BPE (--dataset shakespeare)


def measure_model(flags, world_size):
    """The four stages of one model as rank 0 of world_size: (the row's cells, seconds)."""
    cells, seconds, psi = [], 0.0, None
    for stage in range(4):
        tc = parse_args(flags + RUN + ["--zero", str(stage)])
        tc = replace(tc, node_size=min(world_size, measure.PER_NODE))
        m = measure.measure_rank(tc, VOCAB, world_size, 0)
        seconds += m.seconds
        psi = m.zero.psi
        paper = zero_formula(psi, stage, world_size, m.zero.dtype)["total"]
        cells.append(f"{fmt(m.state['total'])} ({fmt(paper)})")
    est = for_run(tc, model_config(tc, VOCAB), world_size, device="cpu")["peak"]
    cells.append(f"{fmt(m.peak)} ({fmt(est)})")
    return psi, cells, seconds


def main(argv=None):
    p = parser("scale", __doc__)
    p.add_argument("--models", default="gpt2,7b,70b", help="comma list of " + ", ".join(MODELS))
    p.add_argument("--world-sizes", default="8,64,1024", help="comma list: GPUs")
    args = p.parse_args(argv)
    models = comma_list(p, "--models", args.models, list(MODELS))
    sizes = comma_list(p, "--world-sizes", args.world_sizes, kind=int)
    if any(n < 1 or (n > measure.PER_NODE and n % measure.PER_NODE) for n in sizes):
        p.error(f"--world-sizes {args.world_sizes}: whole 8-GPU nodes beyond 8")
    watch, rows = Stopwatch(), []
    for key in models:
        name, flags = MODELS[key]
        for N in sizes:
            psi, cells, seconds = measure_model(flags, N)
            rows.append([f"{name}, Ψ = {psi / 1e9:.3g}B", f"{N:,}", *cells, f"{seconds:.0f}"])
            print(" | ".join(rows[-1]), flush=True)
    header = ["model", "N", "ZeRO-0: 16Ψ", "ZeRO-1: 4Ψ + 12Ψ/N", "ZeRO-2: 2Ψ + 14Ψ/N",
              "ZeRO-3: 16Ψ/N", "ZeRO-3 peak (memory.py)", "s"]
    numbers = ("Bytes per GPU (1 GB = 1e9): measured (the paper's formula at this Ψ); the peak: "
               "measured (memory.py's estimate of the same CPU run). bf16, AdamW, rank 0, "
               "micro-batch 1 of the model's block size, --grad-ckpt full; s: the four stages' "
               "build and step on fake tensors.")
    report(command("scale", argv), "scale", table(header, rows), numbers, watch,
           not args.no_write, heading="The ZeRO paper's table, measured at 8 to 1,024 GPUs")


if __name__ == "__main__":
    main()
