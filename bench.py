"""
Benchmarks (not tests): print markdown tables and write them into BENCHMARKS.md.

    python bench.py                          # every section, the CPU demo model
    python bench.py --only zero --plot       # the matrix, and charts in figures/ (needs matplotlib)
    python bench.py --only zero --dtypes fp32 --stages 2,3 --lora off --steps 60
    python bench.py --only loop --no-write   # print only

  loop       the training loop's own overhead: a plain PyTorch loop vs our train path (ZeRO
             stage 0 + GradScaler on one process) vs train.py itself; target < 5%
  zero       what each technique costs and saves, on N ranks (gloo on CPU, nccl on N GPUs): our
             stage x dtype x --grad-ckpt x LoRA (off / LoRA / QLoRA) beside DDP, torch's
             ZeroRedundancyOptimizer and FSDP2: model-state bytes vs memory.py and the ZeRO paper,
             activation bytes vs memory.py, traffic vs theory, time, tokens/s (MFU, peak GPU memory
             on GPUs), the issues' speed targets. --plot: memory.png, traffic.png, loss.png
  precision  tokens/s of fp32, bf16 and fp16 through our ZeRO stage 0 + GradScaler
  quality    (only with --only quality) nanoGPT's CPU recipe over --seeds: train.py's final val
             loss beside a plain nanoGPT-style loop's, on the same 200 validation batches

Each section sits between <!-- bench:NAME --> and <!-- /bench:NAME --> in BENCHMARKS.md and is
replaced by its next run, so sections run separately coexist. Timings are medians: rounds of the
compared paths are interleaved, so a noisy neighbour slows all of them alike.
"""
import argparse
import gc
import math
import importlib.util
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lora import apply_lora, parse_targets, quantize_base
from memory import estimate
from model import GPT, GPTConfig, peak_flops_for
from precision import DTYPES, GradScaler
from train import TrainConfig, get_batch, get_lr, load_preset, saved_activation_bytes
from zero import ZeRO, traffic_formula, zero_formula

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA = torch.cuda.is_available()
if CUDA:  # as train.py: fp32 matmuls on TF32 tensor cores
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
SECTIONS = ("loop", "zero", "precision", "quality")  # quality: --only quality, ~3 min a seed


def machine():
    if CUDA:
        name = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
        name = f"{cpu}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"
    return f"{name}, torch {torch.__version__}"


def cpu_seconds():
    """(CPU seconds used by the whole machine or None, by this process and its finished children)."""
    ticks = [int(x) for x in open("/proc/stat").readline().split()[1:]] if os.path.isfile("/proc/stat") else None
    busy = ticks and (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    return busy, sum(os.times()[:4])


def load_data():
    """train.bin of shakespeare_char (prepared on first use) and its vocabulary size."""
    from data.prepare import load_meta, prepare
    folder = os.path.join(ROOT, "data", "shakespeare_char")
    if not os.path.isfile(os.path.join(folder, "train.bin")):
        prepare(dataset="shakespeare_char")
    data = np.memmap(os.path.join(folder, "train.bin"), dtype=np.uint16, mode="r")
    return data, load_meta(folder)["vocab_size"]


def build(cfg, vocab, device, dtype):
    torch.manual_seed(cfg.seed)  # the same initial weights for every method and rank
    conf = GPTConfig(block_size=cfg.block_size, vocab_size=vocab, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)
    return GPT(conf).to(device=device, dtype=dtype)


def adamw_groups(model, cfg):
    """train.py's decay groups: 2-D weights decay, biases and LayerNorm gains do not."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def ref_step(model, opt, cfg, data, it, rank, ws, device, amp=None, act=None, xy=None):
    """The textbook step: forward, backward, clip_grad_norm_, AdamW (amp: an autocast dtype).
    act: a list to add the forward's saved activation bytes to (a DDP-wrapped model).
    xy: this step's (inputs, targets), instead of get_batch's."""
    opt.zero_grad(set_to_none=True)  # at the start: the gradients stay countable after the step
    x, y = xy or get_batch(data, cfg.seed, it, 0, rank, ws, cfg.batch_size, cfg.block_size, 1)
    x, y = x.to(device), y.to(device)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None), \
            saved_activation_bytes(model.module, act) if act is not None else nullcontext():
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    for g in opt.param_groups:
        g["lr"] = get_lr(it, cfg)
    opt.step()


def our_step(model, zero, scaler, cfg, data, it, rank, ws, device, act=None):
    """What train.py's loop does on a step it does not log (act: as ref_step's)."""
    zero.traffic = {k: 0 for k in zero.traffic}
    x, y = get_batch(data, cfg.seed, it, 0, rank, ws, cfg.batch_size, cfg.block_size, 1)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with saved_activation_bytes(model, act) if act is not None else nullcontext():
        _, loss = model(x, y)
    zero.backward(scaler.scale(loss), sync=True)
    return zero.step(get_lr(it, cfg), scaler, cfg.grad_clip)


def make_ours(cfg, vocab, device, dtype, stage, rank, ws, grad_ckpt=False, lora="off"):
    """train.py's set-up: the model in its dtype, adapters (lora: "lora", or "qlora" over an nf4
    base) with train.py's defaults, then ZeRO and the scaler."""
    model = build(cfg, vocab, device, dtype)
    model.grad_ckpt = grad_ckpt
    if lora != "off":
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, parse_targets(cfg.lora_targets))
        if lora == "qlora":
            quantize_base(model, "nf4")
    zero = ZeRO(model, stage, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                bucket_mb=cfg.bucket_mb, rank=rank, world_size=ws)
    scaler = GradScaler(dynamic=True) if dtype == torch.float16 else GradScaler(init_scale=1.0, dynamic=False)
    return model, zero, scaler


def timed(fn, n, device):
    """Per-step wall times in ms of n calls fn(i), the GPU synchronized around each."""
    sync, out = torch.cuda.synchronize if device.type == "cuda" else (lambda d: None), []
    for i in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn(i)
        sync(device)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def bench_loop(args):
    torch.set_num_threads(2)
    device = torch.device("cuda:0" if CUDA else "cpu")
    cfg, (data, vocab) = TrainConfig(), load_data()
    rounds = max(2, (args.steps or 200) // 20)  # short rounds: a and b see the same machine
    K = max(1, (args.steps or 200) // rounds)
    plain = build(cfg, vocab, device, torch.float32)
    opt = torch.optim.AdamW(adamw_groups(plain, cfg), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
    ours = make_ours(cfg, vocab, device, torch.float32, 0, 0, 1)
    steps = {"a": lambda it: ref_step(plain, opt, cfg, data, it, 0, 1, device),
             "b": lambda it: our_step(*ours, cfg, data, it, 0, 1, device)}
    done, ms = {"a": 0, "b": 0}, {"a": [], "b": []}
    for r in range(-1, rounds):  # round -1 warms up; then a b, b a, a b, ...: neither always first
        for w in ("ab" if r % 2 == 0 else "ba"):
            n = 5 if r < 0 else K
            t = timed(lambda i: steps[w](done[w] + i), n, device)  # fresh batches all along
            done[w] += n
            ms[w] += [sum(t) / n] if r >= 0 else []
    a, b = (statistics.median(ms[w]) for w in "ab")
    paired = statistics.median(mb / ma for ma, mb in zip(ms["a"], ms["b"]))  # round r of b over round r of a
    spread = {w: f"{min(ms[w]):.1f}-{max(ms[w]):.1f}" for w in "ab"}

    # (c) train.py itself: logs every step (loss.item(), zero-fraction count, a JSON line)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
        cmd = [sys.executable, "train.py", "--max-iters", "60", "--eval-interval", "1000",
               "--log-interval", "1", "--out-dir", tmp]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        ms_c = [r["ms"] for r in map(json.loads, open(os.path.join(tmp, "metrics.jsonl")))
                if "ms" in r and r["iter"] >= 10]
        c, spread["c"] = statistics.median(ms_c), f"{min(ms_c):.1f}-{max(ms_c):.1f} (steps)"
    pct = lambda r: f"{(r - 1) * 100:+.1f}%"
    met = lambda r: "met" if r - 1 < 0.05 else "**missed**"
    body = table(["path", "ms/step", "spread (round means)", "overhead vs (a)", "target < 5%"], [
        ["(a) plain PyTorch: forward, backward, clip_grad_norm_, AdamW", f"{a:.2f}", spread["a"], "-", "-"],
        ["(b) our train path: ZeRO stage 0 (N=1) + GradScaler(1, fixed)", f"{b:.2f}", spread["b"], pct(paired),
         met(paired)],
        ["(c) `train.py --max-iters 60 --eval-interval 1000 --log-interval 1`", f"{c:.2f}", spread["c"], pct(c / a),
         met(c / a)]])
    notes = (f"CPU demo model (4 layers, 4 heads, 128 wide, block 64, batch 12), fp32, one process, "
             f"{torch.get_num_threads()} threads. (a) and (b): {rounds} alternating rounds of {K} steps after 5 "
             f"warm-up steps; ms/step is the median of the rounds' means, (b)'s overhead the median of the "
             f"per-round ratios b/a; batches from get_batch on shakespeare_char. (c), a separate process run "
             f"afterwards (so compared unpaired): the median of metrics.jsonl's `ms` after the first 10 of 60 "
             f"steps; it logs every step, so it also pays loss.item(), the gradient zero-fraction count, a print.")
    return "the training loop's own overhead", body, notes


# the matrix of the zero section: each of our configurations is (stage, --grad-ckpt, LoRA mode);
# "qlora" is LoRA over an nf4 base (train.py's --lora --quantize nf4); r, alpha, targets: train.py's
LORA_MODES = ("off", "lora", "qlora")
REFS = {"ddp": "DDP + AdamW", "zro": "DDP + ZeroRedundancyOptimizer(AdamW)",
        "fsdp": "FSDP2 fully_shard per block + AdamW"}
REF_OF_STAGE = {0: "ddp", 1: "zro", 2: "ddp", 3: "fsdp"}  # whom each stage is measured against
SHORT = {"ddp": "DDP", "zro": "ZeRO-Opt", "fsdp": "FSDP2"}


def ours_key(stage, ckpt=False, lora="off"):
    return f"s{stage}" + "+ckpt" * ckpt + ("" if lora == "off" else f"+{lora}")


def parse_key(key):
    """"s3+ckpt+qlora" -> (3, True, "qlora")"""
    parts = key.split("+")
    return int(parts[0][1]), "ckpt" in parts, next((p for p in parts if p in LORA_MODES), "off")


def describe(key):
    if key in REFS:
        return REFS[key]
    stage, ckpt, lora = parse_key(key)
    return f"ours, ZeRO-{stage}" + " + grad-ckpt" * ckpt + {"off": "", "lora": " + LoRA",
                                                             "qlora": " + QLoRA (nf4 base)"}[lora]


def zero_config():
    """The zero section's model: the CPU demo on CPUs; on GPUs nanoGPT's GPU baseline (10.7M
    parameters, 64 x 256 tokens a rank), where the demo would measure kernel launches, not ZeRO.
    Dropout 0: every configuration computes the same thing, and memory.py models no dropout masks."""
    preset = load_preset("config/shakespeare_char.py") if CUDA else {}
    return TrainConfig(**{**preset, "dropout": 0.0})


def _zero_worker(rank, ws, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks share the cores
    device = torch.device(f"cuda:{rank}" if CUDA else "cpu")
    if CUDA:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if CUDA else "gloo", rank=rank, world_size=ws,
                            device_id=device if CUDA else None)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    cfg, (data, vocab) = zero_config(), load_data()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)
    results = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        slow = dtype != torch.float32 and not CUDA  # 16-bit matmuls crawl on CPUs: a few steps only
        rounds, warm = (2, 1) if slow else (5, 2)
        per_round = 1 if slow else max(1, (args.steps or 60) // rounds)
        amp = None if dtype == torch.float32 else dtype

        def make(key):
            """-> (step(it, act), {part: bytes}, traffic elements of the last step or None).
            step(it, act) measures the saved activation bytes into act[0] when act is a list."""
            if key not in REFS:
                stage, ckpt, lora = parse_key(key)
                model, zero, scaler = make_ours(cfg, vocab, device, dtype, stage, rank, ws, ckpt, lora)
                return (lambda it, act=None: our_step(model, zero, scaler, cfg, data, it, rank, ws, device, act),
                        lambda: {k: v for k, v in zero.state_bytes().items() if k != "total"},
                        lambda: (sum(zero.traffic[k] for k in ("all_reduce", "reduce_scatter", "all_gather")),
                                 zero.frozen_numel))
            model = build(cfg, vocab, device, torch.float32)  # references: fp32 weights, autocast
            kw = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
            if key == "fsdp":  # PyTorch's ZeRO-3: one unit per block, then the root (the tied head)
                from torch.distributed.fsdp import fully_shard
                for block in model.transformer.h:
                    fully_shard(block)
                fully_shard(model)
                opt = torch.optim.AdamW(adamw_groups(model, cfg), **kw)
                local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard
                return (lambda it, act=None: ref_step(model, opt, cfg, data, it, rank, ws, device, amp),
                        lambda: {"params": nbytes([local(p) for p in model.parameters()]),
                                 "grads": nbytes([local(p.grad) for p in model.parameters() if p.grad is not None]),
                                 "master": 0, "optimizer": nbytes([local(s[k]) for s in opt.state.values()
                                                                   for k in ("exp_avg", "exp_avg_sq")])},
                        lambda: (None, 0))
            ddp = DDP(model, device_ids=[rank] if CUDA else None)
            opt = torch.optim.AdamW(adamw_groups(model, cfg), **kw) if key == "ddp" else \
                ZeroRedundancyOptimizer(adamw_groups(model, cfg), optimizer_class=torch.optim.AdamW, **kw)
            local = opt if key == "ddp" else opt.optim  # ZeroRedundancyOptimizer's own shard
            return (lambda it, act=None: ref_step(ddp, opt, cfg, data, it, rank, ws, device, amp, act),
                    lambda: {"params": nbytes(model.parameters()), "grads": nbytes(p.grad for p in model.parameters()),
                             "master": 0, "optimizer": nbytes([s[k] for s in local.state.values()
                                                               for k in ("exp_avg", "exp_avg_sq")])},
                    lambda: (None, 0))

        keys = list(REFS) + [ours_key(s, c, l) for s in args.stages for l in args.lora for c in (False, True)]
        times, info = {k: [] for k in keys}, {}
        for r in range(rounds):  # the order rotated, each configuration built fresh (its memory alone)
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                step, state, traffic = make(key)
                if CUDA:
                    torch.cuda.reset_peak_memory_stats(device)
                act = [0] if r == 0 else None
                step(0, act if key != "fsdp" else None)  # the first warm-up step measures activations
                for i in range(1, warm):
                    step(i)
                dist.barrier()
                times[key].append(timed(lambda i: step(warm + r * per_round + i), per_round, device))
                peaks = [None] * ws
                dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(device) if CUDA else 0)
                moved, frozen = traffic()
                info.setdefault(key, {}).update(bytes=state(), traffic=moved, frozen=frozen, peaks=peaks)
                if act is not None:
                    info[key]["act"] = act[0] if key != "fsdp" else None
                step = state = traffic = None
                gc.collect()  # free this configuration's model before the next is built
                if CUDA:
                    torch.cuda.empty_cache()
        psi = sum(p.numel() for p in build(cfg, vocab, "cpu", torch.float32).parameters())
        results.append(dict(dtype=dname, psi=psi, steps=f"{rounds} x {per_round} (+{warm} warm-up)",
                            ms={k: statistics.median(sum(times[k], [])) for k in keys},
                            rounds={k: [statistics.median(t) for t in times[k]] for k in keys}, info=info))
    if rank == 0:
        json.dump(results, open(out_path, "w"))
    dist.destroy_process_group()


def zero_rows(results, ws, vocab):
    """The zero section's table rows, with memory.py's estimate and the paper's formula beside
    each measurement. Returns (rows, missed targets)."""
    cfg = zero_config()
    gpt = GPTConfig(block_size=cfg.block_size, vocab_size=vocab, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)
    tokens, flops = ws * cfg.batch_size * cfg.block_size, GPT(gpt).flops_per_token() if CUDA else None
    peak = peak_flops_for(torch.cuda.get_device_name(0)) if CUDA else None
    mib = lambda b: f"{b / 2**20:.2f}"
    # an estimate beside a measurement: "exact" to the byte, a few bytes off, or a percentage
    diff = lambda est, got: "exact" if est == got else f"{est - got:+,} B" if abs(est - got) < 1e-3 * got \
        else f"{(est - got) / got:+.1%}"
    rows, missed = [], []
    for res in results:
        psi, dname, ms, info = res["psi"], res["dtype"], res["ms"], res["info"]
        # a time ratio is paired by round (a and b measured minutes apart on a shared machine
        # would compare the machine's moods): the median over rounds of round(a) / round(b)
        ratio = lambda a, b: statistics.median(x / y for x, y in zip(res["rounds"][a], res["rounds"][b])) \
            if b in ms else float("inf")
        for key in ms:
            i, total = info[key], sum(info[key]["bytes"].values())
            if key in REFS:  # fp32 weights, autocast: the paper's fp32 accounting; activations not estimated
                stage, ckpt, lora, dt = {"ddp": 0, "zro": 1, "fsdp": 3}[key], False, "off", "fp32"
                trainable, est = psi, None
                theory = {"ddp": 2, "zro": 3, "fsdp": 3}[key] * psi  # ZeRO-Opt: DDP's all-reduce + broadcasts
            else:
                (stage, ckpt, lora), dt = parse_key(key), dname
                est = estimate(gpt, ws, stage, dname, cfg.batch_size, cfg.block_size, ckpt,
                               cfg.lora_rank if lora != "off" else 0, tuple(parse_targets(cfg.lora_targets)),
                               "nf4" if lora == "qlora" else None, bucket_mb=cfg.bucket_mb)
                trainable = est["trainable"]
                theory = traffic_formula(trainable, stage, ws, frozen=i.get("frozen", 0))
            paper = int(zero_formula(trainable, stage, ws, DTYPES[dt])["total"]) if lora == "off" else None
            # time: a plain stage against PyTorch's counterpart; a technique against its plain stage
            if key in REFS:
                vs = "-"
            elif not ckpt and lora == "off":
                vs = f"{ratio(key, REF_OF_STAGE[stage]):.2f}× {SHORT[REF_OF_STAGE[stage]]}"
            else:
                vs = f"{ratio(key, ours_key(stage)):.2f}× ZeRO-{stage}" if ours_key(stage) in ms else "-"
            target = {"s0": ("≤ 1.10× DDP", "ddp", 1.10), "s2": ("≤ 1.10× DDP", "ddp", 1.10),
                      "s1": ("≤ 1.0× ZeRO-Opt", "zro", 1.0), "s3": ("≤ 1.0× FSDP2", "fsdp", 1.0),
                      "s3+ckpt": ("≤ 1.35× ZeRO-3", "s3", 1.35)}.get(key)
            target = target and (target[0], ratio(key, target[1]), target[2])
            if target and target[1] > target[2]:
                missed.append(f"{describe(key)} ({dname}): {target[0]}")
            tr = i["traffic"]
            row = [describe(key), dname, mib(total),
                   "-" if est is None else diff(est["state"]["total"], total),
                   "-" if paper is None else mib(paper),
                   "-" if i.get("act") is None else mib(i["act"]),
                   "-" if est is None or i.get("act") is None else diff(est["activations"]["total"], i["act"]),
                   f"{tr / psi:.3f}Ψ" if tr is not None else "-", f"{theory / psi:.3g}Ψ",
                   f"{ms[key]:.1f}", f"{tokens / ms[key] * 1000:,.0f}", vs,
                   "-" if not target else f"{target[0]}: {'met' if target[1] <= target[2] else '**missed**'}"]
            if CUDA:
                mfu = flops * tokens / ws / (ms[key] / 1000) / peak if peak else None
                row += ["-" if mfu is None else f"{mfu:.1%}", " / ".join(f"{p / 2**20:.0f}" for p in i["peaks"])]
            rows.append(row)
    return rows, missed


def bench_zero(args):
    ws = args.world_size or (torch.cuda.device_count() if CUDA else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # port 0: the OS hands out a free one
        port = s.getsockname()[1]
    _, vocab = load_data()  # prepare once, before the ranks race for it
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "zero.json")
        mp.start_processes(_zero_worker, args=(ws, port, args, out), nprocs=ws, join=True, start_method="spawn")
        results = json.load(open(out))
    header = ["configuration", "dtype", "model state MiB/rank", "memory.py", "paper", "activations MiB",
              "memory.py", "traffic/step", "theory", "ms/step", "tokens/s", "time vs", "target"] + \
        (["MFU", "max GPU MiB per rank"] if CUDA else [])
    rows, missed = zero_rows(results, ws, vocab)
    steps = ", ".join(f"{r['dtype']} {r['steps']}" for r in results)
    cfg = zero_config()
    notes = (f"World size {ws} ({'nccl, one GPU per rank' if CUDA else 'gloo, 1 thread per rank'}), "
             f"{'config/shakespeare_char.py with dropout 0' if CUDA else 'the CPU demo model'} ({cfg.n_layer} layers, "
             f"{cfg.n_embd} wide, Ψ = {results[0]['psi']:,}), {cfg.batch_size} x {cfg.block_size} tokens per rank, the same "
             f"batches for every configuration. LoRA: r={cfg.lora_rank} on {cfg.lora_targets} (train.py's "
             f"defaults); QLoRA: the same over an nf4 base. Model state: ours `ZeRO.state_bytes()` (weights incl. "
             f"a frozen or quantized base, gradients, fp32 master, Adam moments) after the steps; `memory.py`: "
             f"its estimate's difference (`exact` = to the byte); paper: the ZeRO paper's (2+2+12)Ψ or "
             f"(4+4+8)Ψ per its stage, Ψ trainable, for plain stages. References keep fp32 weights under autocast; "
             f"their bytes are parameters + .grad + Adam moments summed by hand (DDP's gradient buckets, another "
             f"4Ψ, not counted; FSDP2: its DTensors' local shards). Activations: bytes autograd saves in one "
             f"micro-step (train.py's `saved_activation_bytes`), beside memory.py's Korthikanti-style estimate; "
             f"under autocast they include the 16-bit copies of the weights autocast makes and keeps. "
             f"Traffic: elements each rank sends per step as the ZeRO paper counts, in units of the model's Ψ "
             f"(all its parameters): 2 x trainable for stages 0-2, 3 x trainable + 2 x frozen for stage 3, "
             f"which gathers LoRA's frozen base like any weight (references: theory only; ZeRO-Opt = DDP's "
             f"all-reduce 2Ψ + the owners' broadcasts Ψ); gloo runs "
             f"a reduce-scatter as a whole all-reduce, so stages 1-2 physically move 3Ψ there. ms/step: median "
             f"per-step time on rank 0 (rounds x steps: {steps}; configurations rebuilt each round, order "
             f"rotated); `time vs`: a plain stage against its PyTorch counterpart, a technique against its plain "
             f"stage, each the median over rounds of the two configurations' ratio in that round. " + ("Targets missed: " + "; ".join(missed) + "." if missed else "All targets met."))
    title = f"what each technique costs and saves: stage x dtype x grad-ckpt x LoRA, N = {ws}"
    return title, table(header, rows), notes, dict(results=results, ws=ws)


def bench_precision(args):
    torch.set_num_threads(2)
    device = torch.device("cuda:0" if CUDA else "cpu")
    data, vocab = load_data()
    # on a GPU the CPU demo model is launch-bound and shows no dtype at all: use the GPU preset
    cfg = TrainConfig(**load_preset("config/shakespeare_char.py")) if CUDA else TrainConfig()
    rows, base = [], None
    for dname in ("fp32", "bf16", "fp16"):
        dtype = DTYPES[dname]
        n = (args.steps or 30) if (dtype == torch.float32 or CUDA) else 5
        if CUDA and dname == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            continue  # pre-Ampere: train.py refuses bf16 there too
        model, zero, scaler = make_ours(cfg, vocab, device, dtype, 0, 0, 1)
        stats = [our_step(model, zero, scaler, cfg, data, i, 0, 1, device) for i in range(2)]  # warmup
        ms = timed(lambda i: stats.append(our_step(model, zero, scaler, cfg, data, 2 + i, 0, 1, device)), n, device)
        tps = cfg.batch_size * cfg.block_size / (statistics.median(ms) / 1000)
        base = base or tps
        rows.append([dname, n, f"{statistics.median(ms):.1f}", f"{tps:,.0f}", f"{tps / base:.2f}×",
                     f"{sum(s['skipped'] for s in stats)} / {scaler.get_scale():g}"])
    body = table(["dtype", "timed steps", "ms/step", "tokens/s", "vs fp32", "skipped steps / final scale"], rows)
    notes = (f"One process, ZeRO stage 0 + GradScaler (dynamic for fp16, a fixed 1.0 otherwise), {cfg.n_layer} "
             f"layers, {cfg.n_embd} wide, block {cfg.block_size}, batch {cfg.batch_size}; median step time after 2 "
             f"warm-up steps. 16-bit runs hold 16-bit weights and gradients and an fp32 master copy. "
             + ("On a GPU bf16 must beat fp32 (tensor cores)." if CUDA else "On this CPU 16-bit is far slower "
                f"than fp32: no bf16/fp16 matrix units ({torch.backends.cpu.get_cpu_capability()}), 16-bit matmuls "
                "are emulated; hence only a few 16-bit steps. On a GPU bf16 must beat fp32: rerun there."))
    return "tokens/s by precision", body, notes


def bench_quality(args):
    """nanoGPT's CPU recipe, train.py against a plain loop written the way nanoGPT's is (global
    RNG: the model from torch.manual_seed(seed), then random batch offsets), over several seeds;
    every final model scored on the same 200 validation batches."""
    torch.set_num_threads(2)
    from data.prepare import load_meta
    folder = os.path.join(ROOT, "data", args.dataset)
    if not os.path.isfile(os.path.join(folder, "val.bin")):
        sys.exit(f"bench.py: error: no prepared data in {folder}: run python data/prepare.py first")
    train = np.memmap(os.path.join(folder, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(folder, "val.bin"), dtype=np.uint16, mode="r")
    vocab = load_meta(folder)["vocab_size"]
    rows, finals = [], {"train.py": [], "plain": []}
    for seed in args.seeds:
        cfg = TrainConfig(**{**load_preset("config/shakespeare_char_cpu.py"), "seed": seed, "eval_iters": 200})
        with tempfile.TemporaryDirectory() as tmp:  # (a) train.py itself
            env = dict(os.environ, OMP_NUM_THREADS="2")
            subprocess.run([sys.executable, "train.py", "--config", "config/shakespeare_char_cpu.py", "--dataset",
                            args.dataset, "--seed", str(seed), "--eval-iters", "200", "--eval-interval",
                            str(cfg.max_iters), "--out-dir", tmp], cwd=ROOT, env=env, check=True, capture_output=True)
            log = [json.loads(l) for l in open(os.path.join(tmp, "metrics.jsonl"))]
        a_val = [r["val_loss"] for r in log if r.get("val_loss") is not None][-1]
        a_ms = statistics.median(r["ms"] for r in log if "ms" in r and r["iter"] >= 10)
        # (b) the plain loop: torch AdamW, clip_grad_norm_, nanoGPT's schedule and sampling
        torch.manual_seed(seed)
        model = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=vocab, n_layer=cfg.n_layer, n_head=cfg.n_head,
                              n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias))
        opt = torch.optim.AdamW(adamw_groups(model, cfg), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
        ms = []
        for it in range(cfg.max_iters):
            t0 = time.perf_counter()
            ix = torch.randint(len(train) - cfg.block_size, (cfg.batch_size,))
            xy = torch.from_numpy(np.stack([train[i:i + cfg.block_size + 1] for i in ix]).astype(np.int64))
            ref_step(model, opt, cfg, None, it, 0, 1, torch.device("cpu"), xy=(xy[:, :-1], xy[:, 1:]))
            ms.append((time.perf_counter() - t0) * 1000)
        model.eval()
        with torch.no_grad():  # estimate_loss's 200 val batches, one loss each
            losses = [model(*get_batch(val, cfg.seed + 7919 * 2, k, 0, 0, 1, cfg.batch_size, cfg.block_size, 1))[1]
                      .item() for k in range(cfg.eval_iters)]
        b_val, se20 = statistics.mean(losses), statistics.stdev(losses) / math.sqrt(20)
        finals["train.py"].append(a_val)
        finals["plain"].append(b_val)
        rows.append([seed, f"{a_val:.4f}", f"{a_ms:.1f}", f"{b_val:.4f}", f"{statistics.median(ms[10:]):.1f}",
                     f"±{se20:.3f}"])
        print(f"seed {seed}: train.py {a_val:.4f}, plain {b_val:.4f}", flush=True)
    mean = lambda xs: f"{statistics.mean(xs):.4f}" + (f" ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else "")
    rows.append(["mean ± sd", mean(finals["train.py"]), "", mean(finals["plain"]), "", ""])
    body = table(["seed", "train.py: val loss", "ms/step", "plain nanoGPT-style loop: val loss", "ms/step",
                  "sd of a 20-batch estimate"], rows)
    notes = (f"`config/shakespeare_char_cpu.py` (nanoGPT's CPU recipe: 4 layers, 4 heads, 128 wide, block 64, "
             f"batch 12, 2000 steps, LR 1e-3 decayed to 1e-4 over 2000, dropout 0, fp32) on `{args.dataset}`, one "
             f"process, 2 threads. Both columns score the final model on the same 200 validation batches "
             f"(train.py's estimate_loss with --eval-iters 200). The plain loop differs from train.py in "
             f"everything but the model: torch's AdamW and clip_grad_norm_, the global RNG for init and batches "
             f"as nanoGPT does. Last column: the standard deviation of the mean of 20 of those batches, i.e. how "
             f"far a 20-batch estimate such as nanoGPT's `--eval_iters=20` scatters around the true value.")
    return "nanoGPT's CPU recipe: train.py vs a plain loop, by seed", body, notes


# -- --plot: charts for the README (matplotlib, an optional dependency) ------------------------

PARTS = (("params", "weights"), ("grads", "gradients"), ("master", "fp32 master"), ("optimizer", "Adam moments"),
         ("act", "activations (one micro-step)"))
LADDER = ["ddp", "s0", "s1", "s2", "s3", "s3+ckpt", "s3+ckpt+lora", "s3+ckpt+qlora"]  # memory.py --advise's order


def loss_curves(args, ws, dtype, tmp):
    """{label: metrics.jsonl rows}: the --runs folders, or short train.py runs of every stage on ws
    ranks (the same seed and batches: ZeRO changes nothing, so the curves lie on one another)."""
    if args.runs:
        return {os.path.basename(os.path.normpath(d)): [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
                for d in args.runs}
    curves = {}
    for stage in args.stages:
        out = os.path.join(tmp, f"zero{stage}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}", "train.py",
               *(["--config", "config/shakespeare_char.py"] if CUDA else []), "--zero", str(stage), "--dtype", dtype, "--max-iters", str(args.curve_iters), "--log-interval", "5",
               "--eval-interval", str(max(1, args.curve_iters // 4)), "--eval-iters", "20", "--out-dir", out]
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        curves[f"ZeRO-{stage}, {dtype}, N={ws}"] = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return curves


def plot(zero, curves, folder):
    """memory.png (stacked bytes per rank, per dtype), traffic.png, loss.png; returns the paths."""
    import matplotlib
    matplotlib.use("Agg")  # files, no window
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    results, ws, paths = zero["results"], zero["ws"], []

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, res in zip(axes[0], results):
        keys = [k for k in LADDER if k in res["info"]]
        bottom = np.zeros(len(keys))
        for part, label in PARTS:
            mib = np.array([(res["info"][k]["bytes"].get(part) if part != "act" else res["info"][k].get("act") or 0)
                            / 2**20 for k in keys])
            ax.bar(range(len(keys)), mib, bottom=bottom, label=label)
            bottom += mib
        for x, top in enumerate(bottom):
            ax.text(x, top, f"{top:.1f}", ha="center", va="bottom", fontsize=8)
        names = {"ddp": "DDP\n(fp32 +\nautocast)" if res["dtype"] != "fp32" else "DDP", "ckpt": "ckpt",
                 "lora": "LoRA", "qlora": "QLoRA"}
        ax.set_xticks(range(len(keys)), [names["ddp"] if k == "ddp" else "\n+ ".join(
            [f"ZeRO-{k[1]}"] + [names[p] for p in k.split("+")[1:]]) for k in keys], fontsize=8)
        ax.set_ylabel("MiB per rank")
        ax.set_title(f"{res['dtype']}, N={ws}, Ψ={res['psi']:,}")
        ax.legend(fontsize=8)
    fig.suptitle("Memory per rank, measured\n(each ZeRO stage, then activation checkpointing, LoRA, QLoRA)")
    fig.tight_layout()
    paths.append(os.path.join(folder, "memory.png"))
    fig.savefig(paths[-1], dpi=110)

    res = results[0]
    keys = [k for k in ("s0", "s1", "s2", "s3") if k in res["info"]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    measured = [res["info"][k]["traffic"] / res["psi"] for k in keys]
    theory = [traffic_formula(res["psi"], int(k[1]), ws) / res["psi"] for k in keys]
    ax.bar(np.arange(len(keys)) - 0.2, measured, 0.4, label="measured (our collectives)")
    ax.bar(np.arange(len(keys)) + 0.2, theory, 0.4, label="ZeRO paper")
    ax.set_xticks(range(len(keys)), [f"ZeRO-{k[1]}" for k in keys])
    ax.set_ylabel("elements sent per rank per step / Ψ")
    ax.set_title(f"Communication per step, {res['dtype']}, N={ws}")
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(folder, "traffic.png"))
    fig.savefig(paths[-1], dpi=110)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n, (label, rows) in enumerate(curves.items()):
        steps = [(r["iter"], r["loss"]) for r in rows if r.get("loss") is not None]
        evals = [(r["iter"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        # curves that coincide (the stages do the same math) stay visible: each later one thinner
        line, = ax.plot(*zip(*steps), label=f"{label}: train", linewidth=max(0.6, 3.5 - 0.9 * n))
        if evals:
            ax.plot(*zip(*evals), "o--", color=line.get_color(), label=f"{label}: val", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss curves from metrics.jsonl" + (" (ZeRO stages: the same math, one curve)"
                                                    if all(k.startswith("ZeRO-") for k in curves) else ""))
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(folder, "loss.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return paths


def write_section(name, text, path=os.path.join(ROOT, "BENCHMARKS.md")):
    block = f"<!-- bench:{name} -->\n{text}\n<!-- /bench:{name} -->"
    old = open(path).read() if os.path.isfile(path) else (
        "# Benchmarks\n\nWritten by `bench.py` (see its docstring); each section says the command and "
        "machine that produced it and is replaced when that section runs again.\n")
    pat = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.S)
    new = pat.sub(lambda _: block, old) if pat.search(old) else old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False)
    p.add_argument("--only", choices=SECTIONS, action="append", help="run only this section (repeatable)")
    p.add_argument("--steps", type=int, help="timed steps per method (defaults: loop 200, zero 60, precision 30)")
    p.add_argument("--world-size", type=int, help="ranks for the zero section (default: GPUs, or 2 on CPU)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list for the zero section: fp32,bf16,fp16")
    p.add_argument("--stages", default="0,1,2,3", help="comma list of ZeRO stages for the zero section")
    p.add_argument("--lora", default=",".join(LORA_MODES), help="comma list for the zero section: off,lora,qlora")
    p.add_argument("--plot", action="store_true", help="also draw PNG charts (needs matplotlib; runs the zero section)")
    p.add_argument("--plot-dir", default="figures", help="where --plot writes memory.png, traffic.png, loss.png")
    p.add_argument("--runs", nargs="+", metavar="OUT_DIR", help="--plot: loss curves of these runs' metrics.jsonl "
                   "(default: a short train.py run per stage)")
    p.add_argument("--curve-iters", type=int, default=300, help="--plot: steps of each stage's loss-curve run")
    p.add_argument("--seeds", default="1337,2,3", help="quality: comma list of seeds")
    p.add_argument("--dataset", default="shakespeare_char", help="quality: a prepared data set (data/NAME)")
    p.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = p.parse_args()
    lists = {"dtypes": (args.dtypes, tuple(DTYPES)), "stages": (args.stages, ("0", "1", "2", "3")),
             "lora": (args.lora, LORA_MODES)}
    for name, (value, allowed) in lists.items():
        items = value.split(",")
        if not items or any(v not in allowed for v in items):
            p.error(f"--{name} {value}: a comma list of {', '.join(allowed)}")
        setattr(args, name, [int(v) for v in items] if name == "stages" else items)
    try:
        args.seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {args.seeds}: a comma list of integers")
    if args.plot:
        if args.only and "zero" not in args.only:
            p.error("--plot charts the zero section: add --only zero")
        missing = [d for d in args.runs or [] if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
        if missing:
            p.error(f"--runs: no metrics.jsonl in {', '.join(missing)}")
        if importlib.util.find_spec("matplotlib") is None:  # before the long runs, not after them
            sys.exit("bench.py: error: --plot draws with matplotlib, an optional dependency: "
                     ".venv/bin/pip install matplotlib (or run without --plot)")
    command = " ".join(["python", "bench.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    data = {}
    for name in args.only or SECTIONS[:3]:
        t0, (all0, own0) = time.time(), cpu_seconds()
        title, body, notes, *raw = {"loop": bench_loop, "zero": bench_zero, "precision": bench_precision,
                                  "quality": bench_quality}[name](args)
        data[name] = raw[0] if raw else None
        (all1, own1), wall = cpu_seconds(), time.time() - t0
        # other processes' CPU use while we ran: timings on a shared machine are only as good as this
        other = "?" if all0 is None else max(0.0, (all1 - all0) - (own1 - own0)) / (wall * os.cpu_count())
        quiet = other == "?" or other < 0.05
        text = (f"## {name}: {title}\n\n`{command}` on {machine()}, {time.strftime('%Y-%m-%d')}, {wall:.0f} s; "
                f"other processes used {'?' if other == '?' else f'{other:.0%}'} of the CPUs meanwhile"
                + ("" if quiet else " (**disturbed: rerun on a quiet machine**)") + f"\n\n{body}\n\n{notes}\n")
        print(text, flush=True)
        if not args.no_write:
            write_section(name, text)
    if args.plot:
        with tempfile.TemporaryDirectory() as tmp:
            curves = loss_curves(args, data["zero"]["ws"], args.dtypes[0], tmp)
        for path in plot(data["zero"], curves, os.path.join(ROOT, args.plot_dir)):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
