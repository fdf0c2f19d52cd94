"""
bf16 with gradient accumulation: the micro-steps' gradients summed in a bf16 buffer, or in fp32
(train.py's default for 16-bit runs, --fp32-grad-accum), each beside the same run in fp32.

train.py itself runs each, on the same batches and seed: the CPU demo model, --grad-accum 8 (96
sequences a step), bf16 with and without --fp32-grad-accum, and fp32. Measured: how far each bf16
run's training loss strays from the fp32 run's, step by step, and the final validation losses.
A bf16 sum of 8 gradients rounds each partial sum to 8 significant bits: the small
contributions are lost, as Megatron's and DeepSpeed's bf16 optimizers know (they accumulate in
fp32). On a CPU without bf16 matrix units (lscpu: no avx512_bf16 / amx_bf16) this is slow.

    python -m bench.accum                  # 100 steps each
    python -m bench.accum --steps 20 --no-write
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, Stopwatch, command, parser, report, table

RUNS = {"fp32": ["--dtype", "fp32"],
        "bf16, gradients summed in bf16": ["--bf16", "--no-fp32-grad-accum"],
        "bf16, gradients summed in fp32": ["--bf16", "--fp32-grad-accum"]}


def train(flags, steps, out_dir):
    """train.py on the CPU demo preset with --grad-accum 8: {step: loss}, the final val loss."""
    cmd = [sys.executable, "train.py", "--config", "config/shakespeare_char_cpu.py",
           "--grad-accum", "8", "--max-iters", str(steps), "--lr-decay-iters", str(steps),
           "--warmup-iters", str(max(1, steps // 10)), "--log-interval", "1",
           "--eval-interval", str(steps), "--eval-iters", "50", "--device", "cpu",
           "--out-dir", out_dir, *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = {r["iter"]: r["loss"] for r in rows if r.get("loss") is not None}
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
    return losses, val


def main(argv=None):
    p = parser("accum", __doc__)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of each run")
    args = p.parse_args(argv)
    watch = Stopwatch()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, flags) in enumerate(RUNS.items()):
            results[name] = train(flags, args.steps, os.path.join(tmp, str(i)))
            print(f"{name}: final val loss {results[name][1]:.4f}", flush=True)
    ref, ref_val = results["fp32"]
    rows = []
    for name, (losses, val) in results.items():
        gap = [abs(losses[it] - ref[it]) for it in ref if it in losses]
        rows.append([name, f"{statistics.mean(gap):.4f}" if name != "fp32" else "-",
                     f"{max(gap):.4f}" if name != "fp32" else "-", f"{losses[max(losses)]:.4f}",
                     f"{val:.4f}"])
    body = table(["run", "mean |loss - fp32's|", "max", "final train loss", "final val loss"],
                 rows)
    numbers = (f"{args.steps} steps of --grad-accum 8 x 12 sequences x 64 tokens; the CPU demo "
               "model; loss per step from metrics.jsonl, val over 50 batches.")
    report(command("accum", argv), "accum", body, numbers, watch, not args.no_write,
           heading="bf16 gradient accumulation in bf16 and in fp32")


if __name__ == "__main__":
    main()
