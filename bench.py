"""
Benchmarks (not tests): print markdown tables and write them into BENCHMARKS.md.

    python bench.py                          # every section, the CPU demo model
    python bench.py --only zero --dtypes fp32,bf16 --steps 60
    python bench.py --only loop --no-write   # print only

  loop       the training loop's own overhead: a plain PyTorch loop vs our train path (ZeRO
             stage 0 + GradScaler on one process) vs train.py itself; target < 5%
  zero       N ranks (gloo on CPU, nccl on N GPUs): our stages 0-2 beside DDP + AdamW and
             torch's ZeroRedundancyOptimizer: time, model-state bytes, traffic, the issue's targets
  precision  tokens/s of fp32, bf16 and fp16 through our ZeRO stage 0 + GradScaler

Each section sits between <!-- bench:NAME --> and <!-- /bench:NAME --> in BENCHMARKS.md and is
replaced by its next run, so sections run separately coexist. Timings are medians: rounds of the
compared paths are interleaved, so a noisy neighbour slows all of them alike.
"""
import argparse
import gc
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

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import GPT, GPTConfig
from precision import DTYPES, GradScaler
from train import TrainConfig, get_batch, get_lr, load_preset
from zero import ZeRO, zero_formula

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA = torch.cuda.is_available()
if CUDA:  # as train.py: fp32 matmuls on TF32 tensor cores
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
SECTIONS = ("loop", "zero", "precision")
METHODS = {"ddp": "DDP + AdamW", "zro": "DDP + ZeroRedundancyOptimizer(AdamW)",
           "fsdp": "FSDP2 fully_shard per block + AdamW", "ours0": "ours, stage 0", "ours1": "ours, stage 1",
           "ours2": "ours, stage 2", "ours3": "ours, stage 3", "ours3c": "ours, stage 3 + --grad-ckpt"}


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


def ref_step(model, opt, cfg, data, it, rank, ws, device, amp=None):
    """The textbook step: forward, backward, clip_grad_norm_, AdamW (amp: an autocast dtype)."""
    opt.zero_grad(set_to_none=True)  # at the start: the gradients stay countable after the step
    x, y = get_batch(data, cfg.seed, it, 0, rank, ws, cfg.batch_size, cfg.block_size, 1)
    x, y = x.to(device), y.to(device)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    for g in opt.param_groups:
        g["lr"] = get_lr(it, cfg)
    opt.step()


def our_step(model, zero, scaler, cfg, data, it, rank, ws, device):
    """What train.py's loop does on a step it does not log."""
    zero.traffic = {k: 0 for k in zero.traffic}
    x, y = get_batch(data, cfg.seed, it, 0, rank, ws, cfg.batch_size, cfg.block_size, 1)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    _, loss = model(x, y)
    zero.backward(scaler.scale(loss), sync=True)
    return zero.step(get_lr(it, cfg), scaler, cfg.grad_clip)


def make_ours(cfg, vocab, device, dtype, stage, rank, ws, grad_ckpt=False):
    model = build(cfg, vocab, device, dtype)
    model.grad_ckpt = grad_ckpt
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
    cfg, (data, vocab) = TrainConfig(), load_data()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)
    results = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        slow = dtype != torch.float32 and not CUDA  # 16-bit matmuls crawl on CPUs: a few steps only
        rounds, warm = (3, 1) if slow else (5, 2)
        per_round = 1 if slow else max(1, (args.steps or 60) // rounds)
        amp = None if dtype == torch.float32 else dtype

        def make(method):
            """-> (step(it), state bytes, traffic elements of the last step or None)"""
            if method.startswith("ours"):
                model, zero, scaler = make_ours(cfg, vocab, device, dtype, int(method[4]), rank, ws,
                                                grad_ckpt=method.endswith("c"))
                return (lambda it: our_step(model, zero, scaler, cfg, data, it, rank, ws, device),
                        lambda: zero.state_bytes()["total"],
                        lambda: sum(zero.traffic[k] for k in ("all_reduce", "reduce_scatter", "all_gather")))
            model = build(cfg, vocab, device, torch.float32)  # references: fp32 weights, autocast
            if method == "fsdp":  # PyTorch's ZeRO-3: one unit per block, then the root (the tied head)
                from torch.distributed.fsdp import fully_shard
                for block in model.transformer.h:
                    fully_shard(block)
                fully_shard(model)
                opt = torch.optim.AdamW(adamw_groups(model, cfg), lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
                local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard
                return (lambda it: ref_step(model, opt, cfg, data, it, rank, ws, device, amp),
                        lambda: nbytes([local(p) for p in model.parameters()] +
                                       [local(p.grad) for p in model.parameters() if p.grad is not None] +
                                       [local(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]),
                        lambda: None)
            ddp = DDP(model, device_ids=[rank] if CUDA else None)
            kw = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2))
            opt = torch.optim.AdamW(adamw_groups(model, cfg), **kw) if method == "ddp" else \
                ZeroRedundancyOptimizer(adamw_groups(model, cfg), optimizer_class=torch.optim.AdamW, **kw)
            local = opt if method == "ddp" else opt.optim  # ZeroRedundancyOptimizer's own shard
            return (lambda it: ref_step(ddp, opt, cfg, data, it, rank, ws, device, amp),
                    lambda: nbytes(list(model.parameters()) + [p.grad for p in model.parameters()] +
                                   [s[k] for s in local.state.values() for k in ("exp_avg", "exp_avg_sq")]),
                    lambda: None)

        methods = list(METHODS)
        times, info = {m: [] for m in methods}, {}
        for r in range(rounds):  # the order rotated, each method built fresh (its memory alone)
            for m in methods[r % len(methods):] + methods[:r % len(methods)]:
                step, state, traffic = make(m)
                if CUDA:
                    torch.cuda.reset_peak_memory_stats(device)
                for i in range(warm):
                    step(i)
                dist.barrier()
                times[m] += timed(lambda i: step(warm + r * per_round + i), per_round, device)
                peaks = [None] * ws
                dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(device) if CUDA else 0)
                info[m] = dict(bytes=state(), traffic=traffic(), peaks=peaks)
                step = state = traffic = None
                gc.collect()  # free this method's model before the next is built
                if CUDA:
                    torch.cuda.empty_cache()
        psi = sum(p.numel() for p in build(cfg, vocab, "cpu", torch.float32).parameters())
        results.append(dict(dtype=dname, psi=psi, steps=f"{rounds} x {per_round} (+{warm} warm-up)",
                            ms={m: statistics.median(times[m]) for m in methods}, info=info))
    if rank == 0:
        json.dump(results, open(out_path, "w"))
    dist.destroy_process_group()


def bench_zero(args):
    ws = args.world_size or (torch.cuda.device_count() if CUDA else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # port 0: the OS hands out a free one
        port = s.getsockname()[1]
    load_data()  # prepare once, before the ranks race for it
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "zero.json")
        mp.start_processes(_zero_worker, args=(ws, port, args, out), nprocs=ws, join=True, start_method="spawn")
        results = json.load(open(out))
    header = ["method", "dtype", "ms/step", "vs DDP", "vs ZeRO-Opt", "state bytes/rank (measured)",
              "formula", "traffic elements/step", "target"] + (["max GPU MiB per rank"] if CUDA else [])
    rows, missed = [], []
    for res in results:
        psi, dt, ms, info = res["psi"], DTYPES[res["dtype"]], res["ms"], res["info"]
        ref_dt = torch.float32  # the references keep fp32 weights (autocast computes in 16 bits)
        formula = {"ddp": zero_formula(psi, 0, ws, ref_dt), "zro": zero_formula(psi, 1, ws, ref_dt),
                   "fsdp": zero_formula(psi, 3, ws, ref_dt), "ours3c": zero_formula(psi, 3, ws, dt),
                   **{f"ours{s}": zero_formula(psi, s, ws, dt) for s in range(4)}}
        for m, name in METHODS.items():
            tr = info[m]["traffic"]
            tr = f"{tr:,} ({tr / psi:.3f}Ψ)" if tr is not None else \
                (f"{2 * psi:,} (2Ψ, theory)" if m == "ddp" else f"{3 * psi:,} (3Ψ, theory)")  # zro, fsdp
            rd, rz = ms[m] / ms["ddp"], ms[m] / ms["zro"]
            rf, rc = ms[m] / ms["fsdp"], ms["ours3c"] / ms["ours3"]
            target = {"ours0": ("≤ 1.10× DDP", rd <= 1.10), "ours2": ("≤ 1.10× DDP", rd <= 1.10),
                      "ours1": ("≤ 1.0× ZeRO-Opt", rz <= 1.0),
                      "ours3": (f"≤ 1.0× FSDP2 ({rf:.2f}×)", rf <= 1.0),
                      "ours3c": (f"≤ 1.35× stage 3 without ({rc:.2f}×)", rc <= 1.35)}.get(m)
            if target and not target[1]:
                missed.append(f"{name} ({res['dtype']}): {target[0]}")
            autocast = m in ("ddp", "zro") and res["dtype"] != "fp32"
            row = [name + (f" (autocast {res['dtype']})" if autocast else ""), res["dtype"], f"{ms[m]:.2f}",
                   f"{rd:.2f}×", f"{rz:.2f}×", f"{info[m]['bytes']:,}", f"{int(formula[m]['total']):,}", tr,
                   "-" if not target else f"{target[0]}: {'met' if target[1] else '**missed**'}"]
            if CUDA:
                row.append(" / ".join(f"{p / 2**20:.1f}" for p in info[m]["peaks"]))
            rows.append(row)
    steps = ", ".join(f"{r['dtype']} {r['steps']}" for r in results)
    notes = (f"World size {ws} ({'nccl, one GPU per rank' if CUDA else 'gloo, 1 thread per rank'}), CPU demo "
             f"model, 12 x 64 tokens per rank, the same batches for every method. ms/step: median per-step time "
             f"on rank 0 (rounds x steps: {steps}; methods rebuilt each round, order rotated). State bytes: "
             f"ours `zero.state_bytes()`; DDP: parameters + .grad + Adam moments summed by hand (its gradient "
             f"bucket copies, another 4Ψ bytes by default, not counted); ZeRO-Opt: the same with its local "
             f"optimizer's moments. Traffic in elements, the ZeRO paper's way; ZeroRedundancyOptimizer = DDP's "
             f"all-reduce (2Ψ) + the owners' broadcasts (Ψ). Gloo runs a reduce-scatter as a whole all-reduce: "
             f"stages 1-2 physically move 3Ψ there. FSDP2: `fully_shard` on each block, then on the model "
             f"(its default reshard-after-forward); state bytes are the local shards of its DTensors. "
             + ("Targets missed: " + "; ".join(missed) + "." if missed else "All targets met."))
    return f"ZeRO stages vs DDP, ZeroRedundancyOptimizer and FSDP2, N = {ws}", table(header, rows), notes


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
    p.add_argument("--dtypes", default="fp32", help="comma list for the zero section: fp32,bf16,fp16")
    p.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = p.parse_args()
    if any(d not in DTYPES for d in args.dtypes.split(",")):
        p.error(f"--dtypes {args.dtypes}: use fp32, bf16, fp16")
    args.dtypes = args.dtypes.split(",")
    command = " ".join(["python", "bench.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    for name in args.only or SECTIONS:
        t0, (all0, own0) = time.time(), cpu_seconds()
        title, body, notes = {"loop": bench_loop, "zero": bench_zero, "precision": bench_precision}[name](args)
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


if __name__ == "__main__":
    main()
