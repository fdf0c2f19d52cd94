"""
What each technique costs and saves, on N ranks (gloo processes on a CPU; one GPU each, nccl):
our ZeRO stage x dtype x --grad-ckpt x LoRA (off / LoRA / QLoRA), each set up by train.build,
beside PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2. Per configuration: model-state bytes
per rank beside memory.py's estimate and the ZeRO paper's formula, activation bytes beside
memory.py's, traffic beside theory, step time and tokens/s, time ratios paired by round and
the speed targets; on GPUs MFU and peak memory too.

    python -m bench.costs                      # fp32 and bf16, stages 0-3, N=2 on a CPU (~8 min)
    python -m bench.costs --plot               # and the charts: figures/memory.png, traffic.png,
                                               # loss.png (needs matplotlib)
    python -m bench.costs --dtypes fp32 --stages 2,3 --lora off --steps 60 --no-write
    python -m bench.costs --save costs.json    # keep the raw results: python -m bench.plots
    python -m bench.costs --ckpt none,selective,full/2,full   # rows per --grad-ckpt setting

BENCHMARKS.md's "costs" section says what each column means.
"""
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import warnings
from dataclasses import replace

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from beyond.activation_dial import Policy, policy, setting
from bench import plots
from bench.common import (OurRun, PlainRun, Stopwatch, adamw, adamw_settings, comma_list, command,
                          cpu_units, decay_groups, load_data, paired_ratio, parser, report, table,
                          time_block)
from configurator import TrainConfig
from configurator import load_preset
from machinery.footprint import estimate
from model import GPT
from machinery.report import peak_flops
from machinery.validate import parse_targets
from precision import DTYPES, set_tf32
from train import model_config
from zero import traffic_formula, zero_formula

# our configurations are keyed "s<stage>[+ckpt|+sel[K]][+lora|+qlora]" (sel: selective, K:
# every K-th block); QLoRA is LoRA over an nf4 base (train.py's --lora --quantize nf4); r, alpha
# and targets are train.py's defaults
LORA_MODES = ("off", "lora", "qlora")
CKPT_TAGS = {"full": "ckpt", "selective": "sel"}
REFS = {"ddp": "DDP + AdamW", "zro": "DDP + ZeroRedundancyOptimizer(AdamW)",
        "fsdp": "FSDP2 fully_shard per block + AdamW"}
SHORT = {"ddp": "DDP", "zro": "ZeRO-Opt", "fsdp": "FSDP2"}
REF_OF_STAGE = {0: "ddp", 1: "zro", 2: "ddp", 3: "fsdp"}  # whom each plain stage is timed against
REF_STAGE = {"ddp": 0, "zro": 1, "fsdp": 3}  # what the paper's formula counts for a reference
REF_TRAFFIC = {"ddp": 2, "zro": 3, "fsdp": 3}  # x Ψ; ZeRO-Opt: DDP's 2Ψ + the owners' broadcasts
# the speed targets: (label, the configuration compared with, the largest ratio that meets it)
TARGETS = {"s0": ("≤ 1.10× DDP", "ddp", 1.10), "s2": ("≤ 1.10× DDP", "ddp", 1.10),
           "s1": ("≤ 1.0× ZeRO-Opt", "zro", 1.0), "s3": ("≤ 1.0× FSDP2", "fsdp", 1.0),
           "s3+ckpt": ("≤ 1.35× ZeRO-3", "s3", 1.35)}
STATE_PARTS = ("params", "grads", "master", "optimizer")


def ours_key(stage, ckpt=False, lora="off"):
    key, ckpt = f"s{stage}", policy(ckpt)
    if ckpt:
        key += f"+{CKPT_TAGS[ckpt.kind]}" + (str(ckpt.every) if ckpt.every > 1 else "")
    if lora != "off":
        key += f"+{lora}"
    return key


def parse_key(key):
    """"s3+sel2+qlora" -> (3, Policy("selective", 2), "qlora")"""
    parts, lora, ckpt = key.split("+"), "off", Policy()
    kinds = {tag: kind for kind, tag in CKPT_TAGS.items()}
    for part in parts[1:]:
        tag = part.rstrip("0123456789")
        lora = part if part in LORA_MODES else lora
        if tag in kinds:
            ckpt = Policy(kinds[tag], int(part[len(tag):] or 1))
    return int(parts[0][1:]), ckpt, lora


def describe(key):
    if key in REFS:
        return REFS[key]
    stage, ckpt, lora = parse_key(key)
    name = f"ours, ZeRO-{stage}" + (" + grad-ckpt" if ckpt else "")
    name += (f" {ckpt.kind}" if ckpt.kind == "selective" else "") + (
        f" every {ckpt.every}" if ckpt and ckpt.every > 1 else "")
    return name + {"off": "", "lora": " + LoRA", "qlora": " + QLoRA (nf4 base)"}[lora]


def costs_config():
    """The CPU demo model on CPUs; on GPUs nanoGPT's GPU baseline (10.7M parameters, 64 x 256
    tokens a rank), where the demo would measure kernel launches, not ZeRO. Dropout 0: every
    configuration computes the same thing, and memory.py models no dropout masks."""
    preset = load_preset("config/shakespeare_char.py") if torch.cuda.is_available() else {}
    return TrainConfig(**{**preset, "dropout": 0.0})


# ----------------------------------------------------------------------------------------------
# the configurations: each steps, and says what it holds and what it sent

class Ours(OurRun):
    """One of our configurations, set up by train.build as train.py sets it up."""

    def __init__(self, key, cfg, data, vocab, device, rank, world_size):
        stage, ckpt, lora = parse_key(key)
        cfg = replace(cfg, zero=stage, grad_ckpt=ckpt.kind, grad_ckpt_every=ckpt.every,
                      lora=lora != "off", quantize="nf4" if lora == "qlora" else "")
        super().__init__(cfg, data, vocab, device, rank, world_size)

    def state_bytes(self):
        held = self.zero.state_bytes()
        return {part: held[part] for part in STATE_PARTS}

    def traffic(self):
        """(elements this rank's collectives sent in the last step, frozen elements)."""
        return self.zero.traffic.elements, self.zero.frozen_numel


def nbytes(tensors):
    """Bytes of these tensors; a DTensor (FSDP2's parameters) counts its local shard."""
    total = 0
    for t in tensors:
        if t is not None:
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


class Reference(PlainRun):
    """PyTorch's counterpart of a stage, like for like: fp32 weights and fused AdamW; in a
    16-bit dtype the forward and backward run in 16 bits and gradients travel in 16 bits.
    DDP: autocast, and a compression hook that all-reduces 16-bit gradients (gloo refuses
    the bf16 hook: bf16 rows on a CPU all-reduce fp32 gradients). FSDP2: a MixedPrecisionPolicy
    that gathers 16-bit weights and reduce-scatters 16-bit gradients, one unit per block, then
    the root (the tied embedding and head)."""

    def __init__(self, key, cfg, data, vocab, device, rank, world_size):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(cfg.seed)  # the same initial weights as ours
        self.model = GPT(model_config(cfg, vocab)).to(device)
        dtype = DTYPES[cfg.dtype]
        amp = None if dtype == torch.float32 else dtype
        if key == "fsdp":
            # model.py returns the logits as a view (the padded vocabulary rows cut off), and
            # FSDP2 warns that an in-place op on it would skip its hook: we only read them
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* view tensor")
            policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=amp)
            for block in self.model.transformer.h:
                fully_shard(block, mp_policy=policy)
            fully_shard(self.model, mp_policy=policy)
            self.local_opt = adamw(self.model, cfg)
            # the policy casts the weights: no autocast on top
            super().__init__(self.model, self.local_opt, cfg, data, device, amp=None, rank=rank,
                             world_size=world_size)
            return
        net = DDP(self.model, device_ids=[rank] if device.type == "cuda" else None)
        hook = {torch.float16: default_hooks.fp16_compress_hook,
                torch.bfloat16: default_hooks.bf16_compress_hook}.get(dtype)
        if dtype == torch.bfloat16 and device.type != "cuda":
            hook = None  # the bf16 hook wants NCCL, gloo refuses it: here gradients stay fp32
        if hook is not None:
            net.register_comm_hook(None, hook)
        if key == "ddp":
            opt = self.local_opt = adamw(self.model, cfg)
        else:
            opt = ZeroRedundancyOptimizer(decay_groups(self.model),
                                          optimizer_class=torch.optim.AdamW,
                                          **adamw_settings(cfg))
            self.local_opt = opt.optim  # this rank's shard of the optimizer
        super().__init__(net, opt, cfg, data, device, amp, rank, world_size)

    def state_bytes(self):
        """Weights, .grad and Adam's moments summed by hand (DDP's gradient buckets, another
        copy of the gradients, are not counted)."""
        params = list(self.model.parameters())
        moments = [s[k] for s in self.local_opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        return {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
                "master": 0, "optimizer": nbytes(moments)}

    def traffic(self):
        return None, 0  # not counted: PyTorch's collectives are not ours


# ----------------------------------------------------------------------------------------------
# the measurement, on every rank

def worker(rank, world_size, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N ranks share the cores
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
        set_tf32()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size,
                            device_id=device if cuda else None)
    data, vocab = load_data()
    results = []
    for dname in args.dtypes:
        results.append(measure_dtype(dname, args, data, vocab, device, rank, world_size))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    gc.collect()  # free the last configuration while the process group exists
    dist.barrier()
    dist.destroy_process_group()


def measure_dtype(dname, args, data, vocab, device, rank, world_size):
    """Every configuration in one dtype, in rounds: each round builds every configuration
    afresh (its memory alone on the device) in a rotated order and times one block of steps.
    Returns {dtype, psi, steps, rounds: {key: ms per round}, info: {key: what it held}}."""
    cfg = replace(costs_config(), dtype=dname)
    # a 16-bit dtype a CPU emulates (no matrix units for it) runs many times slower than fp32:
    # a few steps only
    slow = device.type == "cpu" and dname != "fp32" and not cpu_units([dname])
    rounds, warm = (2, 1) if slow else (5, 2)
    per_round = 1 if slow else max(1, args.steps // rounds)
    keys = list(REFS) if getattr(args, "refs", True) else []  # bench.dial: ours only
    for stage in args.stages:
        for lora in args.lora:
            keys += [ours_key(stage, ckpt, lora) for ckpt in args.ckpt]
    times, info = {k: [] for k in keys}, {k: {} for k in keys}
    for r in range(rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            Config = Reference if key in REFS else Ours
            run = Config(key, cfg, data, vocab, device, rank, world_size)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            act = [0] if r == 0 and key != "fsdp" else None  # FSDP2 moves its weights about
            run.step(0, act)  # the first warm-up step measures the activations
            for i in range(1, warm):
                run.step(i)
            dist.barrier()
            times[key].append(time_block(run.step, warm + r * per_round, per_round, device))
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            peaks = [None] * world_size
            dist.all_gather_object(peaks, peak)
            moved, frozen = run.traffic()
            info[key].update(bytes=run.state_bytes(), traffic=moved, frozen=frozen, peaks=peaks)
            if act is not None:
                info[key]["act"] = act[0]
            del run
            gc.collect()  # free this configuration's model before the next is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    psi = estimate(model_config(cfg, vocab))["psi"]
    return dict(dtype=dname, psi=psi, steps=f"{rounds} x {per_round} (+{warm} warm-up)",
                rounds=times, info=info)


def measure(args, world_size):
    """The results of every dtype, from world_size spawned ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # port 0: the OS hands out a free one
        port = s.getsockname()[1]
    load_data()  # prepare the data once, before the ranks race for it
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "costs.json")
        mp.start_processes(worker, args=(world_size, port, args, out), nprocs=world_size,
                           join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)


# ----------------------------------------------------------------------------------------------
# the table

def mib(nbytes):
    return f"{nbytes / 2**20:.2f}"


def difference(est, got):
    """An estimate beside a measurement: "exact" to the byte, a few bytes off, or a percentage."""
    if est == got:
        return "exact"
    if abs(est - got) < 1e-3 * got:
        return f"{est - got:+,} B"
    return f"{(est - got) / got:+.1%}"


def expected(key, res, cfg, world_size, vocab):
    """(memory.py's estimate or None, the paper's model-state bytes or None, the theory's
    traffic in elements) for one row. References hold fp32 weights: the paper's fp32
    accounting, and no estimate."""
    psi = res["psi"]
    if key in REFS:
        paper = zero_formula(psi, REF_STAGE[key], world_size, torch.float32)["total"]
        return None, int(paper), REF_TRAFFIC[key] * psi
    stage, ckpt, lora = parse_key(key)
    est = estimate(model_config(cfg, vocab), world_size, stage, res["dtype"], cfg.batch_size,
                   cfg.block_size, ckpt, cfg.lora_rank if lora != "off" else 0,
                   tuple(parse_targets(cfg.lora_targets)), "nf4" if lora == "qlora" else None,
                   bucket_mb=cfg.bucket_mb, device="cuda" if torch.cuda.is_available() else "cpu")
    paper = None
    if lora == "off":  # the paper has no formula for a frozen base
        paper = int(zero_formula(est["trainable"], stage, world_size,
                                 DTYPES[res["dtype"]])["total"])
    frozen = res["info"][key].get("frozen", 0)
    return est, paper, traffic_formula(est["trainable"], stage, world_size, frozen=frozen)


def time_versus(key, rounds):
    """(the `time vs` cell, the target cell, the target's text if missed): a plain stage
    against its PyTorch counterpart, a technique against its plain stage; ratios paired by
    round."""
    vs = "-"
    if key not in REFS:
        stage, ckpt, lora = parse_key(key)
        base, name = REF_OF_STAGE[stage], SHORT[REF_OF_STAGE[stage]]
        if ckpt or lora != "off":
            base, name = ours_key(stage), f"ZeRO-{stage}"
        if base in rounds:
            vs = f"{paired_ratio(rounds[key], rounds[base]):.2f}× {name}"
    if key not in TARGETS or TARGETS[key][1] not in rounds:
        return vs, "-", None
    label, base, limit = TARGETS[key]
    met = paired_ratio(rounds[key], rounds[base]) <= limit
    return vs, f"{label}: {'met' if met else '**missed**'}", None if met else label


def cost_rows(results, world_size, vocab):
    """The table's rows, each measurement beside memory.py's estimate and the paper's formula.
    Returns (rows, the missed targets)."""
    cfg = costs_config()
    tokens = world_size * cfg.batch_size * cfg.block_size  # per step, all ranks
    cuda = torch.cuda.is_available()
    flops = GPT(model_config(cfg, vocab)).flops_per_token() if cuda else None
    rows, missed = [], []
    for res in results:
        ms = {k: statistics.median(v) for k, v in res["rounds"].items()}
        for key in ms:
            info, psi = res["info"][key], res["psi"]
            total = sum(info["bytes"].values())
            est, paper, theory = expected(key, res, cfg, world_size, vocab)
            vs, target, miss = time_versus(key, res["rounds"])
            if miss:
                missed.append(f"{describe(key)} ({res['dtype']}): {miss}")
            act = info.get("act")
            row = [describe(key), res["dtype"], mib(total),
                   "-" if est is None else difference(est["state"]["total"], total),
                   "-" if paper is None else mib(paper),
                   "-" if act is None else mib(act),
                   "-" if est is None or act is None else difference(
                       est["activations"]["total"], act),
                   "-" if info["traffic"] is None else f"{info['traffic'] / psi:.3f}Ψ",
                   f"{theory / psi:.3g}Ψ", f"{ms[key]:.1f}", f"{tokens / ms[key] * 1000:,.0f}",
                   vs, target]
            if cuda:
                peak = peak_flops(torch.cuda.get_device_name(0), DTYPES[res["dtype"]])
                mfu = flops * tokens / world_size / (ms[key] / 1000) / peak if peak else None
                row += ["-" if mfu is None else f"{mfu:.1%}",
                        " / ".join(f"{p / 2**20:.0f}" for p in info["peaks"])]
            rows.append(row)
    return rows, missed


def summary(results, world_size, missed):
    """The numbers of a run the method text cannot know: ranks, model, rounds, targets."""
    cfg, cuda = costs_config(), torch.cuda.is_available()
    model = "config/shakespeare_char.py, dropout 0" if cuda else "the CPU demo model"
    backend = "nccl, one GPU per rank" if cuda else "gloo, 1 thread per rank"
    steps = ", ".join(f"{r['dtype']} {r['steps']}" for r in results)
    verdict = "Targets missed: " + "; ".join(missed) + "." if missed else "All targets met."
    return (f"N = {world_size} ({backend}); {model} ({cfg.n_layer} layers, {cfg.n_embd} wide, "
            f"Ψ = {results[0]['psi']:,}), {cfg.batch_size} x {cfg.block_size} tokens per rank; "
            f"LoRA r={cfg.lora_rank} on {cfg.lora_targets}. Rounds x steps: {steps}. {verdict}")


HEADER = ["configuration", "dtype", "model state MiB/rank", "memory.py", "paper",
          "activations MiB", "memory.py", "traffic/step", "theory", "ms/step", "tokens/s",
          "time vs", "target"]


def main(argv=None):
    p = parser("costs", __doc__)
    p.add_argument("--steps", type=int, default=60,
                   help="timed steps per configuration and dtype, over 5 rounds")
    p.add_argument("--world-size", type=int, help="ranks (default: the GPUs, or 2 on a CPU)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list: fp32,bf16,fp16")
    p.add_argument("--stages", default="0,1,2,3", help="comma list of our ZeRO stages")
    p.add_argument("--lora", default=",".join(LORA_MODES), help="comma list: off,lora,qlora")
    p.add_argument("--ckpt", default="none,full", help="comma list of --grad-ckpt settings "
                   "for our rows: none, full, selective, each with /K for every K-th block")
    p.add_argument("--save", metavar="FILE", help="also write the raw results as JSON, for "
                   "python -m bench.plots --costs FILE")
    plots.add_plot_flags(p)
    args = p.parse_args(argv)
    args.dtypes = comma_list(p, "--dtypes", args.dtypes, tuple(DTYPES))
    args.stages = comma_list(p, "--stages", args.stages, (0, 1, 2, 3), int)
    args.lora = comma_list(p, "--lora", args.lora, LORA_MODES)
    args.ckpt = comma_list(p, "--ckpt", args.ckpt, kind=setting)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: at least 1")
    gpus = torch.cuda.device_count()
    world_size = args.world_size or gpus or 2
    if world_size < 1:
        p.error(f"--world-size {world_size}: at least 1")
    if gpus and world_size > gpus:
        p.error(f"--world-size {world_size}: one rank a GPU, and {gpus} are visible")
    plots.check_plot_flags(p, args)  # before the long runs, not after them
    watch = Stopwatch()
    results = measure(args, world_size)
    _, vocab = load_data()
    rows, missed = cost_rows(results, world_size, vocab)
    header = HEADER + (["MFU", "max GPU MiB per rank"] if gpus else [])
    report(command("costs", argv), "costs", table(header, rows),
           summary(results, world_size, missed), watch, not args.no_write,
           "What each technique costs and saves")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"world_size": world_size, "results": results}, f)
    if args.plot:
        plots.plot_costs(args, world_size, results)


if __name__ == "__main__":
    main()
