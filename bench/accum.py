"""
bf16 with gradient accumulation: the micro-steps' gradients summed in a bf16 buffer, or in fp32
(train.py's default for 16-bit runs, --fp32-grad-accum), each beside the same run in fp32.

Two measurements on the CPU demo model, the same batches and seed throughout. (1) The gradient
of one step accumulated over k micro-steps (k = 8 ... 128), each way, against the fp32 model's:
the relative error of what the optimizer would see. (2) train.py itself, 100 steps of
--grad-accum 8 each way and in fp32: how far each bf16 run's training loss strays from the fp32
run's, step by step, and the final validation losses.
A bf16 sum of 8 gradients rounds each partial sum to 8 significant bits: the small
contributions are lost, as Megatron's and DeepSpeed's bf16 optimizers know (they accumulate in
fp32). On a CPU without bf16 matrix units (lscpu: no avx512_bf16 / amx_bf16) this is slow.

    python -m bench.accum                  # micro-steps 8, 32, 128; then 100 steps each
    python -m bench.accum --steps 20 --micro 8,16 --no-write
"""
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import (Stopwatch, batch, comma_list, command, load_data, parser, report,
                          run_train, table)
from configurator import TrainConfig
from configurator import load_preset
from precision import DTYPES
from train import build

RUNS = {"fp32": ["--dtype", "fp32"],
        "bf16, gradients summed in bf16": ["--bf16", "--no-fp32-grad-accum"],
        "bf16, gradients summed in fp32": ["--bf16", "--fp32-grad-accum"]}


def gradient(data, vocab, dtype, k, fp32_accum):
    """Step 0's gradient summed over k micro-steps (the optimizer's fp32 view of it)."""
    preset = load_preset("config/shakespeare_char_cpu.py")
    cfg = TrainConfig(**{**preset, "dtype": dtype, "grad_accum": k, "fp32_grad_accum": fp32_accum})
    model, zero, _ = build(cfg, vocab, torch.device("cpu"), DTYPES[dtype], grad_accum=k)
    for micro in range(k):
        x, y = batch(data, cfg, micro, torch.device("cpu"))  # a different batch per micro-step
        zero.backward(model(x, y)[1] / k, sync=micro == k - 1)
    return torch.cat([g.reshape(-1) for g in zero.master_grads()])


def gradient_errors(micro_steps):
    """Rows: k, then the relative error of each bf16 way of summing against fp32's sum."""
    data, vocab = load_data()
    rows = []
    for k in micro_steps:
        ref = gradient(data, vocab, "fp32", k, False)
        errors = [(gradient(data, vocab, "bf16", k, fp32) - ref).norm() / ref.norm()
                  for fp32 in (False, True)]
        rows.append([k, f"{errors[0]:.2%}", f"{errors[1]:.2%}", f"{errors[1] / errors[0]:.2f}"])
        print(f"{k} micro-steps: bf16 sum {errors[0]:.2%}, fp32 sum {errors[1]:.2%}", flush=True)
    return rows


def train(flags, steps, out_dir):
    """train.py on the CPU demo preset with --grad-accum 8: {step: loss}, the final val loss."""
    rows = run_train(["--config", "config/shakespeare_char_cpu.py", "--grad-accum", "8",
                      "--max-iters", str(steps), "--lr-decay-iters", str(steps),
                      "--warmup-iters", str(max(1, steps // 10)), "--log-interval", "1",
                      "--eval-interval", str(steps), "--eval-iters", "50", "--device", "cpu",
                      *flags], out_dir, threads=os.cpu_count())
    losses = {r["iter"]: r["loss"] for r in rows if r.get("loss") is not None}
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None][-1]
    return losses, val


def main(argv=None):
    p = parser("accum", __doc__)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of each run")
    p.add_argument("--micro", default="8,32,128", help="comma list: micro-steps summed")
    args = p.parse_args(argv)
    micro = comma_list(p, "--micro", args.micro, kind=int)
    watch = Stopwatch()
    grads = table(["micro-steps", "bf16 sum: error vs fp32", "fp32 sum: error vs fp32",
                   "ratio"], gradient_errors(micro))
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
    header = ["run", "mean gap to fp32's loss", "largest gap", "final train loss",
              "final val loss"]
    body = grads + "\n\n" + table(header, rows)
    numbers = (f"(1) step 0's gradient of the CPU demo model, summed over k micro-steps of 12 x "
               f"64 tokens: the relative L2 error against the fp32 model's. (2) {args.steps} "
               "steps of --grad-accum 8; loss per step from metrics.jsonl, val over 50 batches.")
    report(command("accum", argv), "accum", body, numbers, watch, not args.no_write,
           heading="bf16 gradient accumulation in bf16 and in fp32")


if __name__ == "__main__":
    main()
