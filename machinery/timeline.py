"""The collective log of a traced run (hangs.Recorder's events) written as JSON lines,
and read back into per-step numbers: exposed communication -- the host time spent inside a
collective's wait(), compute that had nothing left to do -- and the overlap fraction, the share
of each collective's launched-to-landed time that compute hid.

On gloo a collective runs on the host beside the compute, so these are host times; on CUDA
the wait is a stream wait and the host times bound the exposure from above (the profiler's
trace, written beside the log, holds the device's own)."""
import json
import os

import torch

from configurator import UserError
from machinery import hangs


def write(events, path, rank):
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps(dict(e, rank=rank)) + "\n")


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def per_step(events):
    """{step: dict(exposed_s, comm_s, overlap)} over the collectives that were waited for."""
    out = {}
    for e in events:
        if e.get("kind") != "collective" or e.get("done") is None:
            continue
        s = out.setdefault(e["step"], dict(exposed_s=0.0, comm_s=0.0))
        s["exposed_s"] += e["done"] - e["wait"]
        s["comm_s"] += e["done"] - e["launch"]
    for s in out.values():
        s["overlap"] = 1 - s["exposed_s"] / s["comm_s"] if s["comm_s"] > 0 else 0.0
    return out


def check_target(folder, world_size):
    """--trace FOLDER, before any work: a folder (made now) whose files of each rank are regular
    files or not there yet (a FIFO blocks the write, a folder fails it at the window's end). A
    UserError, one line; before, a file there was a FileExistsError on every rank."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise UserError(f"--trace {folder} is not a folder (the trace writes a file per rank "
                        "into it): give another path")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # a parent that is a file, no permission, a read-only disk
        raise UserError(f"--trace {folder}: cannot make this folder ({e.strerror or e}): give "
                        "a path you can write")
    for r in range(world_size):
        for name in (f"trace_rank{r}.json", f"collectives_rank{r}.jsonl", f"memory_rank{r}.pickle"):
            path = os.path.join(folder, name)
            if os.path.lexists(path) and not os.path.isfile(path):
                raise UserError(f"--trace: {path} is not a regular file: move it away, or give "
                                "another folder")


WARMUP = 2  # steps before the window: the first pays allocations, compile, the fork's costs


class Tracer:
    """train.py --trace DIR: steps start+2 .. start+2+n-1 recorded. Outside the window it
    does nothing; inside, every collective goes to hangs.recorder beside marks of each
    block's forward end and backward begin, torch.profiler runs, and on CUDA the allocator
    records its history. Each traced step prints and logs its
    exposed communication and overlap; the window's end writes, per rank, trace_rank{r}.json
    (Chrome trace: chrome://tracing or ui.perfetto.dev), collectives_rank{r}.jsonl and, on
    CUDA, memory_rank{r}.pickle (pytorch.org/memory_viz)."""

    def __init__(self, cfg, model, rank, device, metrics, print0, start_it):
        self.model, self.dir, self.rank, self.device = model, cfg.trace, rank, device
        self.metrics, self.print0 = metrics, print0
        self.first = start_it + WARMUP
        self.last = min(self.first + cfg.trace_steps, cfg.max_iters) - 1  # the run may end first
        self.rec, self.prof, self.hooks = None, None, []
        os.makedirs(self.dir, exist_ok=True)

    def begin(self, it):
        if not self.first <= it <= self.last:
            return
        if it == self.first:
            self._start()
        # the step, before its first forward sets it (hangs.watch: the micro-steps too);
        # the step's own collectives logged, not the logging's and saving's after it
        hangs.position.step, hangs.position.micro = it, -1
        hangs.recorder = self.rec
        self.rec.mark("step_begin")

    def end(self, it):
        if self.rec is None or it != hangs.position.step:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels in its own span (a traced step syncs)
        self.rec.mark("step_end")
        hangs.recorder = None  # a launched collective's wait is still noted (its Handle)
        events = [e for e in self.rec.events if e["step"] == it]
        s = per_step(events).get(it, dict(exposed_s=0.0, comm_s=0.0, overlap=0.0))
        step_s = events[-1]["t"] - events[0]["t"]
        self.print0(f"trace step {it}: {1e3 * step_s:.1f} ms, communication "
                    f"{1e3 * s['comm_s']:.1f} ms launched-to-landed, {1e3 * s['exposed_s']:.1f} ms "
                    f"exposed (waited for), overlap {100 * s['overlap']:.0f}%")
        self.metrics.log({"iter": it, "event": "trace", "step_ms": 1e3 * step_s,
                          "comm_ms": 1e3 * s["comm_s"], "exposed_comm_ms": 1e3 * s["exposed_s"],
                          "overlap": s["overlap"]})
        if it == self.last:
            self._stop()

    def _start(self):
        self.rec = hangs.Recorder()
        blocks = getattr(self.model, "blocks", None)  # the model declares them (model.py)
        for i, block in enumerate(blocks() if callable(blocks) else []):
            self.hooks.append(block.register_forward_hook(
                lambda m, args, out, i=i: self._forward_end(i, out)))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100000)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.__enter__()

    def _forward_end(self, i, out):
        """Compute beside the collectives: block i's forward ends (a recompute's too, under
        --grad-ckpt), and, when the gradient of its output arrives, its backward begins."""
        rec = hangs.recorder
        if rec is None:
            return  # an evaluation between traced steps
        rec.mark("forward_end", block=i)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: rec.mark("backward_begin", block=i))

    def _stop(self):
        self.rec.land()  # nothing of the window still in flight (hangs.Recorder.land)
        self.prof.__exit__(None, None, None)
        self.prof.export_chrome_trace(os.path.join(self.dir, f"trace_rank{self.rank}.json"))
        if self.device.type == "cuda":
            path = os.path.join(self.dir, f"memory_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
        write(self.rec.events, os.path.join(self.dir, f"collectives_rank{self.rank}.jsonl"),
              self.rank)
        for h in self.hooks:
            h.remove()
        self.rec, self.hooks = None, []
        self.print0(f"trace: {self.dir}/trace_rank*.json and collectives_rank*.jsonl "
                    f"(python -m bench.plots --timeline {self.dir})")
