"""
What the benchmarks share: the machine and how busy it was, timing a block of steps, the two
training steps they compare (the textbook PyTorch step and ours, set up by train.build), a
markdown table, and the writer that puts a section into BENCHMARKS.md. Not a benchmark itself.

Each section of BENCHMARKS.md is a heading and a few paragraphs of method, written by hand,
then the part a benchmark writes, between <!-- bench:NAME --> and <!-- /bench:NAME -->: the
command, the machine, how busy it was, the table and the numbers that change from run to run.
A run replaces only its own part, so sections run separately coexist.
"""
import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from collectives import Traffic
from configurator import TrainConfig
from data import loader
from data.loader import get_batch
from machinery import rundir
from machinery.meter import measure_next_forward, saved_activation_bytes
from precision import DTYPES, set_tf32
from train import build, get_lr, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS_MD = os.path.join(ROOT, "BENCHMARKS.md")
H100_HBM = 3.35e12  # bytes/s: an H100 SXM's HBM3 (data sheet), for bandwidth-bound times
# CPU flags that mean 16-bit matrix arithmetic in hardware (oneDNN uses them when present)
CPU_UNITS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


# ----------------------------------------------------------------------------------------------
# the machine

def default_device():
    """cuda:0 when there is a GPU (fp32 matmuls on TF32 tensor cores, as train.py sets), else
    the CPU."""
    if torch.cuda.is_available():
        set_tf32()
        return torch.device("cuda:0")
    return torch.device("cpu")


def cpu_info():
    """(the CPU's model name, its set of flags) from /proc/cpuinfo; ("CPU", empty) elsewhere."""
    name, flags = "CPU", set()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "CPU":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    return name, flags


def cpu_units(dtype_names=("bf16", "fp16")):
    """The 16-bit matrix instructions this CPU has for these dtypes (none: their matmuls are
    emulated, converted to fp32 and back)."""
    flags = cpu_info()[1]
    return [f for name in dtype_names for f in CPU_UNITS[name] if f in flags]


def machine():
    """One line: the GPUs, or the CPU with its cores and vector capability; torch's version."""
    if torch.cuda.is_available():
        name = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        units = ", ".join(cpu_units()) or "no 16-bit matrix units"
        name = (f"{cpu_info()[0]}, {os.cpu_count()} cores, "
                f"{torch.backends.cpu.get_cpu_capability()} ({units})")
    return f"{name}, torch {torch.__version__}"


def cpu_seconds():
    """(CPU seconds the whole machine has used, or None without /proc/stat; CPU seconds this
    process and its finished children have used)."""
    busy = None
    if os.path.isfile("/proc/stat"):
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    return busy, sum(os.times()[:4])


class Stopwatch:
    """Wall time since it was made, and the share of all CPUs that other processes used
    meanwhile: timings on a shared machine are only as good as this."""

    def __init__(self):
        self.t0, (self.all0, self.own0) = time.time(), cpu_seconds()

    def read(self):
        """(wall seconds, other processes' share of the CPUs or None where unknown)."""
        wall = time.time() - self.t0
        all1, own1 = cpu_seconds()
        if self.all0 is None:
            return wall, None
        other = (all1 - self.all0) - (own1 - self.own0)
        return wall, max(0.0, other) / (wall * os.cpu_count())


# ----------------------------------------------------------------------------------------------
# timing

def time_block(step, first, n, device):
    """Mean ms per step of step(first), ..., step(first + n - 1), timed as one block. On a GPU
    between two CUDA events with one synchronize at the end: a synchronize around every step
    would drain the queue of launched kernels that a step which never waits keeps full, and
    hide exactly that advantage. On a CPU, by the wall clock."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            step(first + i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    t0 = time.perf_counter()
    for i in range(n):
        step(first + i)
    return (time.perf_counter() - t0) * 1000 / n


class KernelBytes(TorchDispatchMode):
    """Counts the bytes each aten op reads (its tensor inputs) and writes (its outputs): what
    an eager kernel moves through memory at least, once per tensor (a kernel's own re-reads,
    which caches may serve, are not counted). Views move nothing; an indexed op (gather,
    scatter, nll_loss) moves what its index picks; logsumexp is the four kernels ATen runs
    for it (amax, a subtraction, an exp, a sum: 6 passes over its input). Runs on the meta
    device too: shapes and dtypes are all it needs, so GPU-sized tensors cost nothing."""
    FREE = {"_unsafe_view", "_reshape_alias", "detach", "lift_fresh", "alias", "empty",
            "empty_like", "new_empty"}  # no data moved
    INDEXED = {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
               "nll_loss_forward", "nll_loss_backward"}

    def __init__(self):
        super().__init__()
        self.read = self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in self.FREE:
            return out
        size = lambda t: t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        ins = [size(a) for a in list(args) + list((kwargs or {}).values())
               for a in (a if isinstance(a, (list, tuple)) else [a])]
        outs = [size(o) for o in (out if isinstance(out, (list, tuple)) else [out])]
        if name == "nll_loss_backward":  # a zero-filled gradient, a value per row put in
            self.read, self.written = self.read + min(b for b in ins if b), \
                self.written + outs[0]
        elif name in self.INDEXED:  # the index and as many elements as it picks
            picked = min(b for b in ins if b)
            self.read, self.written = self.read + 2 * picked, self.written + picked
        elif name == "logsumexp":
            self.read, self.written = self.read + 4 * ins[0], self.written + 2 * ins[0]
        elif name.endswith("_") or "out" in (kwargs or {}):  # in place, or out=
            overwritten = "out" in (kwargs or {}) or name in ("copy_", "zero_", "fill_")
            self.read += sum(ins) - sum(outs) * overwritten  # not what it overwrites
            self.written += sum(outs)
        else:
            self.read, self.written = self.read + sum(ins), self.written + sum(outs)
        return out


def paired_ratio(a, b):
    """a's time over b's, measured in the same rounds: the median over rounds of a[r] / b[r].
    A round in which the machine was slow for everyone cancels out; medians of a and b taken
    apart would compare the machine's moods."""
    return statistics.median(x / y for x, y in zip(a, b))


def spread(values):
    return f"{min(values):.1f}-{max(values):.1f}"


# ----------------------------------------------------------------------------------------------
# data and the two steps

def load_data(dataset="shakespeare_char"):
    """train.bin of a data set (prepared on first use, by train.py's own loader) and its
    vocabulary size."""
    train, _, meta = loader.load_data(replace(TrainConfig(), dataset=dataset), 0, 1)
    return train, meta["vocab_size"]


def read_metrics(folder):
    """The rows of a run's metrics.jsonl, as the run went on (rundir.read_metrics: a cut line
    skipped, the steps a resume redid once)."""
    return rundir.read_metrics(os.path.join(folder, "metrics.jsonl"))


def run_train(flags, out_dir, launcher=(), threads=None):
    """train.py as a user runs it, in a subprocess (launcher: torchrun's arguments), with these
    flags: its metrics.jsonl rows. threads: the OpenMP threads it may use."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads)) \
        if threads else None
    subprocess.run([sys.executable, *launcher, "train.py", *flags, "--out-dir", out_dir],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    return read_metrics(out_dir)


def batch(data, cfg, it, device, rank=0, world_size=1):
    """Step it's micro-batch for this rank, as train.py draws it, on the device."""
    x, y = get_batch(data, cfg.seed, it, 0, rank, world_size, cfg.batch_size, cfg.block_size, 1)
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def decay_groups(model):
    """train.py's weight-decay groups: 2-D weights decay, biases and LayerNorm gains do not
    (weight_decay: AdamW's own, the first group's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def adamw_settings(cfg, fused=True):
    """train.py's AdamW settings. fused: one kernel for the whole update, as zero.py runs it."""
    return dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                weight_decay=cfg.weight_decay, fused=fused)


def adamw(model, cfg, fused=True):
    """torch's AdamW as train.py configures ours."""
    return torch.optim.AdamW(decay_groups(model), **adamw_settings(cfg, fused))


def plain_step(model, opt, cfg, x, y, lr, amp=None, act=None):
    """The textbook step: forward (under autocast to amp, when given), backward,
    clip_grad_norm_, AdamW. act: a list to add the bytes saved for backward to. model may be
    wrapped (DDP, torch.compile); the weights are the inner GPT's."""
    gpt = getattr(model, "module", getattr(model, "_orig_mod", model))
    opt.zero_grad(set_to_none=True)  # at the start: the gradients stay countable after the step
    counting = saved_activation_bytes(gpt, act) if act is not None else nullcontext()
    with torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
        with counting:
            _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    return loss.detach()


def our_step(model, zero, scaler, cfg, x, y, lr, act=None):
    """One step of train.py's loop as it runs on a step it does not log, with one micro-step:
    train.train_step itself. act: a list to add the bytes the forward saved for backward to.
    Returns (the loss, found_inf) as device tensors: nothing here waits for the device."""
    zero.traffic = Traffic()  # count this step's collectives
    if act is not None:
        measure_next_forward(model, lambda nbytes, moved: act.__setitem__(0, act[0] + nbytes))
    loss, found_inf, _, _ = train_step(model, zero, scaler, cfg, lambda: (x, y), 1, lr)
    return loss, found_inf


class OurRun:
    """Our training on one configuration, set up by train.build as train.py sets it up (the
    dtype: cfg.dtype's). run.step(it) trains on step it's batch. count_skips: run.skipped
    sums the steps the scaler skipped, on the device (one more tiny kernel a step)."""

    def __init__(self, cfg, data, vocab, device, rank=0, world_size=1, count_skips=False):
        self.cfg, self.data, self.device = cfg, data, device
        self.rank, self.world_size = rank, world_size
        self.model, self.zero, self.scaler = build(cfg, vocab, device, DTYPES[cfg.dtype], rank,
                                                   world_size)
        self.skipped = torch.zeros((), device=device) if count_skips else None

    def step(self, it, act=None):
        x, y = batch(self.data, self.cfg, it, self.device, self.rank, self.world_size)
        _, found_inf = our_step(self.model, self.zero, self.scaler, self.cfg, x, y,
                                get_lr(it, self.cfg), act)
        if self.skipped is not None:
            self.skipped += found_inf


class PlainRun:
    """The textbook step on a GPT (or a wrapped one: DDP, torch.compile) and its optimizer;
    amp: the autocast dtype, if any. run.step(it) trains on step it's batch."""

    def __init__(self, net, opt, cfg, data, device, amp=None, rank=0, world_size=1):
        self.net, self.opt, self.cfg, self.data, self.device = net, opt, cfg, data, device
        self.amp, self.rank, self.world_size = amp, rank, world_size

    def step(self, it, act=None):
        x, y = batch(self.data, self.cfg, it, self.device, self.rank, self.world_size)
        plain_step(self.net, self.opt, self.cfg, x, y, get_lr(it, self.cfg), self.amp, act)


# ----------------------------------------------------------------------------------------------
# the command line and the report

def parser(module, doc, writes=True):
    """An ArgumentParser named as the benchmark is run (`python -m bench.NAME`), described by
    the first paragraph of its docstring; --no-write when it writes into BENCHMARKS.md."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{module}", allow_abbrev=False,
                                description=doc.strip().split("\n\n")[0])
    if writes:
        p.add_argument("--no-write", action="store_true",
                       help="print only, leave BENCHMARKS.md alone")
    return p


def comma_list(p, flag, value, allowed=None, kind=str):
    """--flag a,b,c as a list of kind, each in allowed (when given), or a one-line usage error."""
    try:
        items = [kind(v) for v in value.split(",")]
    except ValueError:
        items = None
    if not items or (allowed is not None and any(v not in allowed for v in items)):
        choices = ", ".join(str(a) for a in allowed) if allowed else f"{kind.__name__}s"
        p.error(f"{flag} {value}: a comma list of {choices}")
    return items


def command(module, argv=None):
    """The command line that ran this benchmark (argv: its flags, default the process's), as a
    reader would type it."""
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", f"bench.{module}"] + [shlex.quote(a) for a in argv])


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def report(cmd, name, body, numbers, watch, write=True, heading=None):
    """Print section `name` (the command cmd, the machine, date, wall time, other processes'
    CPU use, then body and numbers) and, if write, put it into BENCHMARKS.md. heading: the
    title for a section BENCHMARKS.md does not have yet."""
    wall, other = watch.read()
    busy = "?" if other is None else f"{other:.0%}"
    text = (f"`{cmd}` on {machine()}, {time.strftime('%Y-%m-%d')}, {wall:.0f} s; "
            f"other processes used {busy} of the CPUs meanwhile")
    if other is not None and other >= 0.05:
        text += " (**disturbed: rerun on a quiet machine**)"
    text += f"\n\n{body}\n\n{numbers}"
    print(f"[{name}]\n{text}\n", flush=True)
    if write:
        write_section(name, text, heading=heading)


def write_section(name, text, path=BENCHMARKS_MD, heading=None):
    """Put text between BENCHMARKS.md's markers for name, or append a new section (under
    heading) when the file has none."""
    block = f"<!-- bench:{name} -->\n{text}\n<!-- /bench:{name} -->"
    old = "# Benchmarks\n"
    if os.path.isfile(path):
        with open(path) as f:
            old = f.read()
    pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.S)
    if pattern.search(old):
        new = pattern.sub(lambda match: block, old)  # a function: text is not a template
    else:
        new = old.rstrip("\n") + f"\n\n## {heading or name}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(new)
