"""
FP8 training measured (fp8.py; Micikevicius et al. 2022, "FP8 Formats for Deep Learning";
TransformerEngine's delayed scaling): bf16 beside --fp8 with dynamic and delayed scaling.

For each model (the CPU demo, 4 x 128, and a wider one, 4 x 256), train.py itself runs N steps
three times: --bf16, --bf16 --fp8, --bf16 --fp8 --fp8-scaling delayed. Reported: the loss (mean
of the last logged steps), the val loss at the end, ms/step and tokens/s (medians of the
logged steps after the first 10), and from metrics.jsonl the casts' underflow (nonzero values
cast to zero) and saturation (values clamped at the max), averaged over the logged steps, the
largest saturation beside it. Then one matmul of each of the demo's linear shapes and a 4096
cube (1024 on a CPU): bf16 against FP8 (_scaled_mm alone, and with the casts), the speed-up.

On a CPU, torch emulates FP8 matmuls (no FP8 units): the times say what the emulation costs,
not what FP8 buys; only a GPU's (Hopper, Ada, Blackwell) speed-up means something.

--casts: what FP8 adds to a linear when it runs eagerly, beside the bf16 matmuls it replaces:
the casts (amax, scale, clamp, cast, the padded and transposed copies, the weight's recast in
backward), timed with the FP8 products themselves stubbed out, and their bytes counted kernel
by kernel (bench.common.KernelBytes, on the meta device) at GPT-2 124M's shapes. A CPU's
times compare the casts with real bf16 matmuls; the bytes say what a GPU's HBM must move.

    python -m bench.fp8 --formats          # the formats' table from torch.finfo
    python -m bench.fp8                    # 100 steps a run, both models
    python -m bench.fp8 --casts            # the eager casts' cost beside bf16
    python -m bench.fp8 --steps 20 --models demo --no-write   # a smoke run
"""
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from beyond import fp8
from bench.common import (H100_HBM, KernelBytes, Stopwatch, comma_list, command, cpu_units,
                          default_device, paired_ratio, parser, report, run_train, table,
                          time_block)

PRESET = "config/shakespeare_char_cpu.py"
MODELS = {"demo": ["--n-layer", "4", "--n-head", "4", "--n-embd", "128"],
          "wide": ["--n-layer", "4", "--n-head", "4", "--n-embd", "256"]}
RUNS = {"bf16": [], "fp8 dynamic": ["--fp8"],
        "fp8 delayed": ["--fp8", "--fp8-scaling", "delayed", "--fp8-amax-history", "16"]}
CASTS = ("x", "w", "grad")


def formats():
    """The formats' table: (header, rows), numbers as torch.finfo gives them."""
    header = ["format", "bits", "exponent", "mantissa", "max", "smallest normal",
              "smallest subnormal", "machine eps"]
    cell = lambda v: v if isinstance(v, (str, int)) else f"{v:.6g}"
    return header, [[cell(v) for v in row] for row in fp8.format_table()]


def train_run(model, flags, steps, device, seed):
    """train.py for `steps` steps: a row of the table and the run's metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        log = run_train(["--config", PRESET, "--device", device.type, "--bf16", *MODELS[model],
                         *flags, "--max-iters", str(steps), "--lr-decay-iters", str(steps),
                         "--eval-interval", str(steps), "--eval-iters", "50",
                         "--log-interval", "5", "--seed", str(seed)], tmp,
                        threads=torch.get_num_threads())
    steps_logged = [r for r in log if "loss" in r]
    warm = [r for r in steps_logged if r["iter"] >= 10] or steps_logged
    val = [r["val_loss"] for r in log if r.get("val_loss") is not None][-1]
    out = {"loss": statistics.mean(r["loss"] for r in steps_logged[-4:]), "val": val,
           "ms": statistics.median(r["ms"] for r in warm),
           "tps": statistics.median(r["tokens_per_sec"] for r in warm)}
    for c in CASTS:
        for kind in ("underflow", "saturated"):
            values = [r.get(f"fp8_{c}_{kind}") for r in steps_logged]
            values = [v for v in values if v is not None]
            out[f"{c}_{kind}"] = statistics.mean(values) if values else None
            out[f"{c}_{kind}_max"] = max(values) if values else None
    return out


def pct(v):
    return "-" if v is None else f"{100 * v:.3g}%"


def matmul_times(device, shapes, rounds):
    """{(M, K, N): (bf16 ms, fp8 _scaled_mm ms, fp8 with its casts ms)} for y = x @ w.T."""
    out = {}
    for M, K, N in shapes:
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
        m = fp8.FP8Matmul("bench")
        sx, sw = fp8.scale_of(x.abs().amax(), fp8.E4M3), fp8.scale_of(w.abs().amax(), fp8.E4M3)
        x8, w8 = fp8.cast(x, sx, fp8.E4M3), fp8.cast(w, sw, fp8.E4M3)
        one = torch.ones((), device=device)
        steps = {"bf16": lambda i: x @ w.t(),
                 "fp8": lambda i: fp8._scaled_mm(x8, w8.t(), one, one),
                 "fp8+casts": lambda i: m(x, w)}
        times = {}
        for name, step in steps.items():
            time_block(step, 0, 2, device)  # warm-up
            times[name] = statistics.median(time_block(step, 0, rounds, device)
                                            for _ in range(3))
        out[(M, K, N)] = (times["bf16"], times["fp8"], times["fp8+casts"])
    return out


# GPT-2 124M's four linears of a block, (K in, N out), on a micro-batch of 16 x 1024 tokens
GPT2_LINEARS, GPT2_TOKENS, GPT2_LAYERS = [(768, 2304), (768, 768), (768, 3072), (3072, 768)], \
    16 * 1024, 12


def _no_product(a, b, scale_a, scale_b, fast_accum=False):
    """fp8._scaled_mm's stand-in: an output of the right shape, no product."""
    return torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)


def linear_casts(x, w, g):
    """One FP8 linear's forward and backward with the products stubbed out: its casts only."""
    real, fp8._scaled_mm = fp8._scaled_mm, _no_product
    try:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        fp8.FP8Matmul("casts")(x, w).backward(g)
    finally:
        fp8._scaled_mm = real


def cast_bytes(M, K, N):
    """Bytes the eager casts of one linear read and write (forward and backward), counted on
    the meta device."""
    meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")
    counter = KernelBytes()
    with counter:
        linear_casts(meta(M, K), meta(N, K), meta(M, N))
    return counter.read + counter.written


def cast_times(device, shapes, rounds):
    """[(M, K, N, {"fp32", "bf16", "casts": ms}, {"fp32", "bf16": casts' time over it})]: one
    linear's three matmuls (forward, input and weight gradients) in fp32 and in bf16, beside
    FP8's eager casts for them; the ratios paired round by round."""
    out = []
    for M, K, N in shapes:
        steps = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w, g = (torch.randn(*s, device=device, dtype=dtype)
                       for s in ((M, K), (N, K), (M, N)))
            name = "fp32" if dtype == torch.float32 else "bf16"
            steps[name] = lambda i, x=x, w=w, g=g: (x @ w.t(), g @ w, g.t() @ x)
        steps["casts"] = lambda i, x=x, w=w, g=g: linear_casts(x, w, g)  # bf16 operands
        times = {name: [] for name in steps}
        for step in steps.values():
            time_block(step, 0, 1, device)  # warm-up
        for _ in range(rounds):  # alternating: a slow moment of the machine hits all three
            for name, step in steps.items():
                times[name].append(time_block(step, 0, 2, device))
        out.append((M, K, N, {k: statistics.median(v) for k, v in times.items()},
                    {k: paired_ratio(times["casts"], times[k]) for k in ("fp32", "bf16")}))
    return out


H100 = {"hbm": H100_HBM, "bf16": 989e12, "fp8": 1979e12}  # bytes/s, dense FLOP/s: data sheet


def casts_report(argv, watch, write):
    """--casts: the eager casts' time beside the matmuls', and their bytes at GPT-2 124M."""
    device = default_device()
    tokens = 512 if device.type == "cpu" else GPT2_TOKENS
    timed = cast_times(device, [(tokens, K, N) for K, N in GPT2_LINEARS],
                       3 if device.type == "cpu" else 20)
    rows = []
    for M, K, N, ms, ratio in timed:
        nbytes, flops = cast_bytes(M, K, N), 6 * M * K * N
        rows.append([f"{M}x{K} @ {K}x{N}", f"{ms['fp32']:.1f}", f"{ms['bf16']:.1f}",
                     f"{ms['casts']:.1f}", f"{ratio['fp32']:.2f}x", f"{ratio['bf16']:.3f}x",
                     f"{nbytes / 1e6:,.1f}", f"{flops / nbytes:.0f}"])
    per_micro = GPT2_LAYERS * sum(cast_bytes(GPT2_TOKENS, K, N) for K, N in GPT2_LINEARS)
    flops = GPT2_LAYERS * sum(6 * GPT2_TOKENS * K * N for K, N in GPT2_LINEARS)
    where = (f"a CPU ({cpu_units_line()})" if device.type == "cpu"
             else torch.cuda.get_device_name(device))
    body = (f"One linear of GPT-2 124M's block at {tokens:,} tokens, on {where}: its three "
            "matmuls (forward, input gradient, weight gradient) in fp32 and in bf16, beside the"
            " casts eager FP8 adds to them with bf16 operands (median ms of 2-step blocks, "
            "rounds alternating; the ratios paired by round), the bytes those casts read and "
            "write, and the matmuls' FLOPs per cast byte.")
    mm = lambda rate: flops / rate * 1000
    casts_ms = per_micro / H100["hbm"] * 1000
    numbers = (table(["linear", "fp32 matmuls ms", "bf16 matmuls ms", "FP8 casts ms",
                      "casts / fp32", "casts / bf16", "cast MB", "FLOP per cast byte"], rows) +
               f"\n\nAt GPT-2 124M's micro-batch (16 x 1024 tokens, 12 blocks of 4 linears) the "
               f"eager casts move {per_micro / 1e9:.1f} GB; the linears' matmuls are "
               f"{flops / 1e12:.2f} TFLOP. On an H100 SXM at its data sheet's rates (a "
               f"prediction): the casts {casts_ms:.1f} ms at 3.35 TB/s, the matmuls "
               f"{mm(H100['bf16']):.1f} ms in bf16 and {mm(H100['fp8']):.1f} ms in FP8: eager "
               f"FP8 adds {casts_ms - mm(H100['bf16']) + mm(H100['fp8']):.0f} ms a micro-step.")
    report(command("fp8", argv), "fp8-casts", body, numbers, watch, write,
           heading="FP8's eager casts beside bf16")


def cpu_units_line():
    """What this CPU has for bf16 matmuls."""
    units = cpu_units(("bf16",))
    return "bf16 matrix units: " + (", ".join(units) if units else "none, bf16 is emulated")


def main(argv=None):
    p = parser("fp8", __doc__)
    p.add_argument("--formats", action="store_true", help="only the formats' table")
    p.add_argument("--casts", action="store_true", help="only the eager casts' cost")
    p.add_argument("--steps", type=int, default=100, help="training steps per run")
    p.add_argument("--models", default="demo,wide", help="a comma list of demo, wide")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    watch = Stopwatch()
    header, rows = formats()
    if args.formats:
        body = ("The lecture's formats and FP8's two, read off `torch.finfo` (int8: `torch.iinfo`"
                "): bits, exponent and mantissa bits, the largest value, the smallest normal and"
                " subnormal ones, the machine epsilon (the gap above 1).")
        report(command("fp8", argv), "fp8-formats", body, table(header, rows), watch,
               not args.no_write, heading="FP8's formats")
        return
    if args.casts:
        return casts_report(argv, watch, not args.no_write)
    if args.steps < 10:
        p.error("--steps must be at least 10")
    models = comma_list(p, "--models", args.models, MODELS)
    try:
        fp8.check_available(default_device())
    except RuntimeError as e:
        p.error(str(e))
    device = default_device()
    results = {(m, r): train_run(m, flags, args.steps, device, args.seed)
               for m in models for r, flags in RUNS.items()}
    head = ["model", "run", "loss", "val loss", "ms/step", "tokens/s"] + \
           [f"{c} {k}" for c in CASTS for k in ("underflow", "saturated (max)")]
    out = []
    for (m, r), v in results.items():
        casts = [cell for c in CASTS for cell in
                 (pct(v[f"{c}_underflow"]), f"{pct(v[f'{c}_saturated'])} "
                  f"({pct(v[f'{c}_saturated_max'])})" if v[f"{c}_saturated"] is not None
                  else "-")]
        out.append([m, r, f"{v['loss']:.4f}", f"{v['val']:.4f}", f"{v['ms']:.1f}",
                    f"{v['tps']:,.0f}"] + casts)
    h = int(MODELS["demo"][-1])
    tokens = 12 * 64  # the demo's micro-batch: batch 12 x block 64
    big = 4096 if device.type == "cuda" else 1024  # a 4096 cube takes seconds emulated
    shapes = [(tokens, h, 3 * h), (tokens, h, 4 * h), (tokens, 4 * h, h), (big, big, big)]
    mm = matmul_times(device, shapes, 3 if device.type == "cpu" else 20)
    mm_rows = [[f"{M}x{K} @ {K}x{N}", f"{b:.2f}", f"{f:.2f}", f"{c:.2f}", f"{b / f:.2f}x",
                f"{b / c:.2f}x"] for (M, K, N), (b, f, c) in mm.items()]
    where = ("on a CPU: FP8 is **emulated** (no FP8 units), so its times are the emulation's "
             "cost, not FP8's speed; only a GPU's speed-up means something"
             if device.type == "cpu" else f"on {torch.cuda.get_device_name(device)}")
    body = (f"{args.steps} steps a run of `{PRESET}` (batch 12 x 64) with --bf16, seed "
            f"{args.seed}, val loss over 50 batches at the end; {where}. Underflow: the "
            "fraction of nonzero values a cast turned to zero; saturated: of all values, those"
            " clamped at the format's max (mean over logged steps, the largest in brackets).")
    numbers = (table(head, out) + "\n\nOne matmul y = x @ w.T (ms, median of 3 blocks; fp8 = "
               "_scaled_mm on cast operands, +casts = fp8.FP8Matmul with its amax and casts):"
               "\n\n" + table(["shape", "bf16 ms", "fp8 ms", "fp8+casts ms", "fp8 speed-up",
                               "with casts"], mm_rows))
    report(command("fp8", argv), "fp8", body, numbers, watch, not args.no_write,
           heading="FP8 training: bf16 vs --fp8 (dynamic, delayed scaling)")


if __name__ == "__main__":
    main()
