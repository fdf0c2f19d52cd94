"""
GPT-2 124M on one GPU in bf16: ms/iter, MFU and peak memory of our training (ZeRO stage 0,
the same with FlashAttention-2 first, stage 3, --grad-ckpt, --offload-optimizer at stages 1
and 3, --compile, each set up by train.build) beside a plain PyTorch loop of the same model
(fp32 weights under bf16 autocast, fused AdamW), compiled and not. Sized for a few minutes of
GPU time: 9 configurations of 70 steps (by FLOPs, well under 0.1 s each on an H100-class GPU)
and two compilations.

    python -m bench.gpu                              # config/gpt2_124m.py's shape, 16 x 1024 a step
    python -m bench.gpu --configs plain,s0 --steps 10
    python -m bench.gpu --configs s0+compile,s0+fp8+compile    # bf16 vs --fp8 (Ada, Hopper+)
    python -m bench.gpu --configs s0,s0+flash        # cuDNN's attention vs FlashAttention-2
    python -m bench.gpu --tiny --no-write            # the same code on a tiny model, on a CPU
    python -m bench.gpu --tiny --configs plain,s0,s3,s0+ckpt --steps 2 --no-write

BENCHMARKS.md's "gpu" section says how it measures.
"""
import gc
import os
import statistics
import sys
from dataclasses import replace

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from bench.common import (OurRun, PlainRun, Stopwatch, adamw, comma_list, command, default_device,
                          parser, report, spread, table, time_block)
from configurator import TrainConfig
from configurator import load_preset
from model import GPT
from machinery.report import peak_flops
from precision import resolve_dtype
from machinery import quirks
from train import model_config

VOCAB = 50257  # GPT-2's BPE
TINY_VOCAB = 512  # --tiny: GPT-2's 50k logits in bf16 take seconds a step on an AVX2 CPU
CONFIGS = {
    "plain": "PyTorch: fp32 weights, bf16 autocast, fused AdamW",
    "plain+compile": "the same, torch.compile(model)",
    "s0": "ours: ZeRO-0 (bf16 weights, fp32 master)",
    "s0+flash": "ours: ZeRO-0, FlashAttention-2 first (--no-cudnn-attention)",
    "s3": "ours: ZeRO-3",
    "s0+ckpt": "ours: ZeRO-0 + --grad-ckpt",
    "s1+offload": "ours: ZeRO-1 + --offload-optimizer (fp32 master and AdamW on the host)",
    "s3+offload": "ours: ZeRO-3 + --offload-optimizer",
    "s0+compile": "ours: ZeRO-0 + --compile",
    "s0+fp8+compile": "ours: ZeRO-0 + --compile --fp8 (dynamic scaling; MFU of bf16's peak)",
}


def gpu_config(tiny):
    """config/gpt2_124m.py's model and micro-batch, one micro-step a step, bf16; --tiny: a small
    model (and TINY_VOCAB), for a smoke run on a CPU."""
    cfg = TrainConfig(**load_preset("config/gpt2_124m.py"))
    cfg = replace(cfg, dtype="bf16", grad_accum=1, dropout=0.0)
    if tiny:
        cfg = replace(cfg, n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=4)
    return cfg


def tokens(cfg, vocab):
    """Random token ids, as many as 64 batches hold: the speed does not depend on their values,
    and real GPT-2 tokens would need a tokenizer's files on the GPU machine."""
    n = 64 * cfg.batch_size * (cfg.block_size + 1)
    return np.random.default_rng(0).integers(0, vocab, size=n, dtype=np.uint16)


def make_run(key, cfg, data, device, vocab):
    """The configuration's run, with SDPA's kernel order as it would have it: PyTorch's own
    for the plain loop, machinery/quirks.py's for ours (on a GPU)."""
    quirks.KERNEL_ORDER.close()  # PyTorch's order again (a configuration before may have set one)
    if key.startswith("plain"):
        torch.manual_seed(cfg.seed)
        model = GPT(model_config(cfg, vocab)).to(device)  # fp32 weights: autocast computes
        net = torch.compile(model) if key == "plain+compile" else model
        return PlainRun(net, adamw(model, cfg), cfg, data, device, torch.bfloat16)
    ckpt = "full" if key == "s0+ckpt" else "none"
    stage = 3 if key.startswith("s3") else 1 if key.startswith("s1") else 0
    run_cfg = replace(cfg, zero=stage, grad_ckpt=ckpt,
                      offload_optimizer="overlap" if "offload" in key else "none",
                      compile=key.endswith("compile") and key != "plain+compile",
                      fp8="fp8" in key,  # dynamic scaling: no history for fp8.end_step
                      cudnn_attention=key != "s0+flash")
    quirks.apply(run_cfg, device)
    return OurRun(run_cfg, data, vocab, device)


def measure(key, cfg, data, device, args, vocab):
    """(ms per step of each block, peak bytes allocated or None) of one configuration, built
    alone on the device and freed after: a dedicated GPU needs no interleaving of
    configurations, and each one's peak memory is then its own."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = make_run(key, cfg, data, device, vocab)
    time_block(run.step, 0, args.warmup, device)  # the compilations happen here
    blocks = []
    for r in range(args.rounds):
        blocks.append(time_block(run.step, args.warmup + r * args.steps, args.steps, device))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del run
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return blocks, peak


def main(argv=None):
    p = parser("gpu", __doc__)
    default = ",".join(k for k in CONFIGS if "fp8" not in k)  # FP8 needs Ada / Hopper or newer
    p.add_argument("--configs", default=default, help="comma list of " + ", ".join(CONFIGS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=3, help="timed blocks per configuration")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation)")
    p.add_argument("--tiny", action="store_true", help="a tiny model: a smoke run on a CPU")
    args = p.parse_args(argv)
    keys = comma_list(p, "--configs", args.configs, tuple(CONFIGS))
    if min(args.steps, args.rounds, args.warmup) < 1:
        p.error("--steps, --rounds and --warmup: at least 1")
    device = default_device()
    if device.type == "cpu" and not args.tiny:
        p.error("no GPU here: --tiny runs the same code on a tiny model on the CPU")
    try:
        resolve_dtype("bf16", device)  # pre-Ampere GPUs: refused as train.py refuses them
    except ValueError as e:
        p.error(str(e))
    cfg = gpu_config(args.tiny)
    vocab = TINY_VOCAB if args.tiny else VOCAB
    data = tokens(cfg, vocab)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak_rate = peak_flops(name, torch.bfloat16)
    with torch.device("meta"):  # for the FLOPs a token costs: the shape, no memory
        shape = GPT(model_config(cfg, vocab))
    watch, rows, base = Stopwatch(), [], None
    for key in keys:
        blocks, peak = measure(key, cfg, data, device, args, vocab)
        ms = statistics.median(blocks)
        base = base or ms
        tps = cfg.batch_size * cfg.block_size / (ms / 1000)
        mfu = shape.estimate_mfu(tps, peak_rate)
        rows.append([CONFIGS[key], f"{ms:.1f}", spread(blocks), f"{ms / base:.2f}×",
                     f"{tps:,.0f}", "-" if mfu is None else f"{mfu:.1%}",
                     "-" if peak is None else f"{peak / 2**30:.2f}"])
        print(f"{key}: {ms:.1f} ms/iter", flush=True)
    body = table(["configuration", "ms/iter", "spread (blocks)", f"vs {keys[0]}", "tokens/s",
                  "MFU", "max allocated GiB"], rows)
    smoke = " (--tiny: a smoke run, not a measurement)" if args.tiny else ""
    numbers = (f"{name or 'CPU'}{smoke}; {cfg.n_layer} layers, "
               f"{cfg.n_embd} wide, {cfg.batch_size} x {cfg.block_size} tokens a step, bf16; "
               f"{args.warmup} warm-up steps, then {args.rounds} blocks of {args.steps} steps.")
    report(command("gpu", argv), "gpu", body, numbers, watch, not args.no_write,
           "GPT-2 124M on one GPU")


if __name__ == "__main__":
    main()
