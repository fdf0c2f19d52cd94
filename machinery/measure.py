"""
The real engine, measured at any scale on one CPU (memory.py --measure).

train.py's own build() and train_step() run at the real size, as rank r of N, and what the
engine holds and sends is read off it, not estimated:

  - FakeTensorMode (torch._subclasses): every tensor has its shape, dtype and device, and no
    storage. A 70B model costs no memory; each op costs only its Python time.
  - the "fake" process group (torch.testing's FakeStore): one process is rank r of N. Each
    collective completes at once and moves nothing, and our Traffic counter still counts it.
  - MemTracker (torch.distributed._tools.mem_tracker): the step's peak, by kind of tensor,
    as torchtitan estimates FSDP2's memory (FSDPMemTracker).

Beside them: the ZeRO paper's formulas (zero.zero_formula, zero.traffic_formula) and memory.py's
estimate (footprint.for_run). The training step does not know it is measured. The only values
a fake tensor lacks are read at start-up, by the same-weights check
(machinery.guard.check_same_weights) and LoRA's base fingerprint (adapters.base_fingerprint):
both skip a fake tensor, and the report says so.

The run is a CPU run: torch without CUDA cannot fake a GPU's kernels. What a GPU adds outside
torch's tensors (NCCL's communicators) is footprint.py's, printed beside.
"""
import contextlib
import math
import time
import warnings
import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import optim
import train
from collectives import Traffic
from configurator import UserError, grad_accum_for
from precision import DTYPES
from machinery.guard import HeldGrad, elementwise
from zero import traffic_formula, zero_formula

CPU = torch.device("cpu")
PER_NODE = 8  # GPUs a node, as memory.py's commands launch them
# Fake ops cost Python time: about 25 ms a block's forward and backward (GPT, 2 cores). Past
# this many blocks run (layers x micro-steps x ranks measured) a measurement takes too long.
MAX_BLOCKS = 20_000
MAX_WORLD = 65_536  # ranks: each an entry in the layout's per-rank counts, ZeRO++'s groups
MAX_BUCKETS = 200_000  # flat buffers a rank builds: each a few fake tensors on the host


@dataclass
class Measured:
    """One rank's measured step (measure_rank)."""
    rank: int
    world_size: int
    zero: object  # the engine, built on fake tensors (its layout: padding, ranks_that_differ)
    state: dict  # ZeRO.state_bytes() after the step
    host: dict  # host_bytes() under --offload-optimizer, else None
    peak: int  # MemTracker: the most bytes held at once during the step (model state too)
    traffic: Traffic  # the step's collectives, by collective and link (zeropp.LinkTraffic)
    copies: object  # --offload-optimizer's host copies (offload_optimizer.HostCopies), or None
    grad_accum: int
    seconds: float  # to build and step on fake tensors


# ----------------------------------------------------------------------------------------------
# the fake world: one process, rank r of N, tensors without storage

@contextlib.contextmanager
def fake_world(rank, world_size):
    """The "fake" process group as the default group, destroyed on the way out: nothing of it
    outlives the measurement (pytest workers run other tests in the same process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("memory.py --measure makes its own process group: call it outside "
                           "a distributed run")
    from machinery import hangs
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with hangs.off():  # nothing waits in a fake collective: no timeouts to name
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors():
    """FakeTensorMode, and what the measurement leaves as it found: the RNG (build() seeds
    it), torch's threads (offload sets them), and torch.utils.swap_tensors (swappable)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    threads = torch.get_num_threads()
    mode = FakeTensorMode()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), swappable(mode), mode:
        # zero3.py and zero.py compare data_ptr()s to skip a copy onto itself; a fake tensor's
        # is 0 with a warning (the copy is skipped: it allocates nothing either way)
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        try:
            yield mode
        finally:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def swappable(mode):
    """Module.to() on fake parameters, which torch 2.13 cannot do alone: it swaps each fake
    parameter for its converted copy (torch.utils.swap_tensors), and swap_tensors refuses a
    tensor with a weak reference, which FakeTensorMode's memo keeps on every fake tensor
    ("_apply(): Couldn't swap Linear.weight"; pytorch#170781, fixed upstream by letting the
    memo's references through, pytorch#196558). The two tensors are dropped from the memo
    first: it only saves converting the same tensor twice."""
    memo, swap = mode.fake_tensor_converter.tensor_memo, torch.utils.swap_tensors

    def forgotten_swap(t1, t2):
        keys = [ref.key for t in (t1, t2) for ref in weakref.getweakrefs(t)
                if isinstance(ref, weakref.KeyedRef)]
        for key in keys:
            memo.pop(key, None)
        return swap(t1, t2)

    torch.utils.swap_tensors = forgotten_swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


# ----------------------------------------------------------------------------------------------
# one rank, one step

def measure_rank(tc, vocab_size, world_size, rank):
    """train.build() and one train.train_step() (every micro-step) of the run tc describes, as
    `rank` of world_size, on fake tensors: a Measured. The tracker is entered for the build
    too, so that it knows every tensor the engine made; entered again for the step, its peak
    starts from what the build left."""
    t0 = time.perf_counter()
    grad_accum = grad_accum_for(tc, world_size)
    dtype, tracker = DTYPES[tc.dtype], step_tracker()
    with fake_world(rank, world_size), fake_tensors():
        with tracker:
            model, zero, scaler = train.build(tc, vocab_size, CPU, dtype, rank, world_size,
                                              grad_accum)

        def next_batch():  # token ids: fake too, what the step reads of them is their shape
            x = torch.randint(0, vocab_size, (tc.batch_size, tc.block_size))
            return x, x

        count_afresh(zero, tc.node_size or world_size)  # the step's alone
        with tracker:
            train.train_step(model, zero, scaler, tc, next_batch, grad_accum,
                             tc.learning_rate)
        snapshot = tracker.get_tracker_snapshot("peak").get(CPU, {})
        state = zero.state_bytes()
        host = zero.host_bytes() if hasattr(zero, "host_bytes") else None
    return Measured(rank, world_size, zero, state, host, snapshot.get("Total", 0),
                    zero.traffic, getattr(zero, "host_copies", None), grad_accum,
                    time.perf_counter() - t0)


def count_afresh(zero, node_size):
    """The engine's counters from zero, its collectives counted by collective and link at every
    stage (ZeRO++'s counter, zeropp.LinkTraffic; train.py's stages 0-2 count the paper's
    volumes only) and its host copies."""
    from beyond.zeropp import LinkTraffic
    zero.traffic = LinkTraffic(node_size=getattr(zero.traffic, "node_size", 0) or node_size)
    if hasattr(zero, "host_copies"):
        zero.host_copies = type(zero.host_copies)()


def step_tracker():
    """MemTracker, keeping the step's peak only. Its own also keeps each module's statistics:
    a pass over every module after every op (minutes at 80 layers), a gradient hook on every
    parameter (which a frozen one refuses: LoRA's base), and a refusal of the model's second
    forward (a micro-step). Here the modules' parameters are only named as such before each
    forward. And machinery.guard.HeldGrad is not counted: p.grad while the engine holds the
    gradient elsewhere, a wrapper with no data whose storage still says p's size (counted, a
    ZeRO-2 step seemed to hold every gradient whole). (MemTracker's private names: torch
    2.5-2.13's.)"""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepPeak(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            self._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
            if isinstance(t, HeldGrad):
                return set()
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _update_peak_stats(self, peak_state):
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)

    return StepPeak()


# ----------------------------------------------------------------------------------------------
# what the engine's layout says: padding, and which ranks hold what

def padding(zero):
    """(P, this rank's padding): the elements of the trainable flat buffers, padding included
    (Ψ + the padding to N slices, or to the longest dealt slice), and the elements of this
    rank's owned slices that hold no parameter (they get no optimizer state)."""
    owned = sum(b.hi - b.lo for b in zero.buckets)
    return sum(b.numel for b in zero.buckets), owned - sum(s.hi - s.lo for s in zero.segments)


def at_padded_size(zero, P, own_padding):
    """The paper's model state at the padded size, as this rank holds it: zero_formula of P
    elements (every buffer padded to N slices), less the optimizer state of its own padding.
    For an elementwise optimizer (optim.STATE_BYTES), the gradients in the working dtype, no
    frozen base (LoRA's is outside the paper's count): the measurement, to the byte."""
    k = optim.STATE_BYTES[zero.optimizer_name.lower()]
    paper = zero_formula(P, zero.stage, zero.world_size, zero.dtype, zero.optimizer_name)
    return {"params": int(paper["params"]), "grads": int(paper["grads"]),
            "optimizer_side": int(paper["optimizer_side"]) - k * own_padding,
            "total": int(paper["total"]) - k * own_padding}


def real_per_rank(zero):
    """Parameters (not padding) in each rank's owned slices, from this rank's engine: every
    rank builds the same buckets, so one rank's layout tells every rank's."""
    N = zero.world_size
    real, whole = [0] * N, [0] * (N + 1)  # whole: slices filled by one tensor, as differences
    for b in zero.buckets:
        S = b.hi - b.lo
        if S == b.numel:  # stage 0: every rank owns all of it
            real = [r + sum(p.numel() for p in b.params) for r in real]
            continue
        for p, lo in zip(b.params, b.offsets):
            hi = lo + p.numel()
            first, last = lo // S, (hi - 1) // S  # the slices [lo, hi) crosses
            real[first] += min(hi, (first + 1) * S) - lo
            if last > first:
                real[last] += hi - last * S
                whole[first + 1] += S
                whole[last] -= S
    filled = 0
    for r in range(N):
        filled += whole[r]
        real[r] += filled
    return real


def ranks_that_differ(zero):
    """The ranks holding the most and the fewest parameters (ties: the first and the last): a
    flat cut rank 0 and the last slice, which holds the padding; under Muon's dealing
    (beyond/muon.py), the owners of the most and the least of the whole matrices. Rank 0 alone
    where every rank holds alike."""
    real = real_per_rank(zero)
    most, fewest = real.index(max(real)), len(real) - 1 - real[::-1].index(min(real))
    return sorted({most, fewest}) if real[most] > real[fewest] else [0]


def why_rank(rank, real, named):
    """A few words on why this rank is measured (real: real_per_rank)."""
    if len(set(real)) == 1:
        return "every rank holds alike"
    if real[rank] == max(real):
        return "the most parameters"
    if real[rank] == min(real):
        return "the fewest parameters" + (": the last slice" if rank == len(real) - 1 else "")
    return "named by --rank" if named else "the first"


# ----------------------------------------------------------------------------------------------
# before any work: what a measurement can take

def check_measurable(tc, model_cfg, world_size, ranks, grad_accum, gpu_bytes):
    """A UserError, one line, before anything is built: a node size that does not divide N,
    a rank outside it, a model whose state cannot fit these GPUs even sharded (ZeRO-3), or a
    run too large for fake tensors' bookkeeping on this host (each op is Python; each flat
    buffer a few fake tensors). Returns tc with its node size (PER_NODE a node by default)."""
    try:  # torch's fake process group and memory tracker, both private, both recent
        import torch.distributed._tools.mem_tracker
        import torch.testing._internal.distributed.fake_pg
    except ImportError as e:
        raise UserError(f"--measure needs torch's fake process group and MemTracker, which "
                        f"torch {torch.__version__} lacks ({e}): torch 2.5 or later")
    if tc.compile:
        raise UserError("--measure runs the eager step on fake tensors, not --compile's fused "
                        "kernels: measure without --compile")
    node = tc.node_size or min(world_size, PER_NODE)
    if world_size % node:
        raise UserError(f"--world-size {world_size} is not a whole number of {node}-GPU nodes: "
                        "give --node-size (GPUs a node) that divides it")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise UserError(f"--rank {bad[0]}: ranks run from 0 to {world_size - 1}")
    blocks = getattr(model_cfg, "n_layer", 1) * grad_accum * max(1, len(ranks) or 2)
    if blocks > MAX_BLOCKS:
        raise UserError(f"--measure would run {blocks:,} blocks on fake tensors (layers x "
                        f"{grad_accum} micro-steps x ranks), over {MAX_BLOCKS:,}, about "
                        f"{MAX_BLOCKS * 0.025 / 60:.0f} minutes of Python: one micro-step holds "
                        "the same peak (--grad-accum 1, --batch-tokens 0), or name one --rank")
    if world_size > MAX_WORLD:
        raise UserError(f"--world-size {world_size:,}: --measure keeps every rank's layout and "
                        f"process group on fake tensors' bookkeeping up to {MAX_WORLD:,} ranks")
    from machinery.footprint import param_numels
    psi = sum(n for _, n in param_numels(model_cfg))
    buckets = psi * DTYPES[tc.dtype].itemsize / (tc.bucket_mb * 2**20)
    if tc.zero in (0, 1, 2) and buckets > MAX_BUCKETS:
        raise UserError(f"--bucket-mb {tc.bucket_mb:g} cuts {psi:,} parameters into "
                        f"{buckets:,.0f} buckets, over the {MAX_BUCKETS:,} that --measure keeps "
                        "as fake tensors in minutes and in this host's memory: raise --bucket-mb")
    check_fits_sharded(tc, model_cfg, world_size, gpu_bytes)
    return replace(tc, node_size=node)


def check_fits_sharded(tc, model_cfg, world_size, gpu_bytes):
    """Even ZeRO-3 over world_size GPUs leaves each more model state than it has (memory.py's
    estimate, footprint.for_run): one line, nothing to measure."""
    from machinery.estimator import HEADROOM, fmt
    from machinery.footprint import for_run
    try:
        sharded = replace(tc, zero=3, zeropp="")
        state = for_run(sharded, model_cfg, world_size)["state"]["total"]
    except ValueError:  # a model memory.py cannot count: measured all the same
        return
    usable = (1 - HEADROOM) * gpu_bytes
    if state > usable:
        raise UserError(f"even ZeRO-3 over {world_size:,} GPU(s) leaves {fmt(state)} of model "
                        f"state a GPU, over the {fmt(usable)} usable of --gpu-mem "
                        f"{fmt(gpu_bytes)}: about {math.ceil(world_size * state / usable):,} "
                        "GPUs would hold it (--world-size), or --gpu-mem of larger GPUs")


# ----------------------------------------------------------------------------------------------
# memory.py --measure

def run(tc, model_cfg, world_size, ranks=(), gpu_bytes=80e9, say=print):
    """Measure the run tc describes (a TrainConfig, its model model_cfg) as each of `ranks` of
    world_size, or as rank 0 and the ranks whose slices differ most from it (ranks_that_differ),
    and print each beside the paper and memory.py's estimate. Returns the Measured ones."""
    grad_accum = grad_accum_for(tc, world_size)
    tc = check_measurable(tc, model_cfg, world_size, ranks, grad_accum, gpu_bytes)
    vocab = model_cfg.vocab_size
    done = {r: None for r in ranks or [0]}
    first = measure_rank(tc, vocab, world_size, next(iter(done)))
    done[first.rank] = first
    for r in [] if ranks else ranks_that_differ(first.zero):
        done.setdefault(r, None)
    for r in done:
        done[r] = done[r] or measure_rank(tc, vocab, world_size, r)
    real = real_per_rank(first.zero)
    for r in sorted(done):
        say("\n".join(report(done[r], tc, model_cfg, gpu_bytes, why_rank(r, real, ranks))))
    same = "the same-weights check (machinery.guard.check_same_weights)"
    skipped = [what for what, read in ((same, world_size > 1),
                                        ("LoRA's base fingerprint", tc.lora)) if read]
    if skipped:
        say(f"note: {' and '.join(skipped)} read{'s' if len(skipped) == 1 else ''} values, "
            "which fake tensors do not have: skipped")
    return [done[r] for r in sorted(done)]


def estimates(tc, model_cfg, world_size, rank):
    """memory.py's estimate of this rank, of the CPU run measured and of the same run on GPUs
    (footprint.for_run), or (None, None) for a model it cannot count."""
    from machinery.footprint import for_run
    try:
        return tuple(for_run(tc, model_cfg, world_size, rank, device=d) for d in ("cpu", "cuda"))
    except ValueError:
        return None, None


def report(m, tc, model_cfg, gpu_bytes, why):
    """The lines for one measured rank: model state by part, the step's peak and its traffic,
    each beside memory.py's estimate and the ZeRO paper's figure; the padding; the GPU's."""
    from machinery.estimator import HEADROOM, fmt
    z, N = m.zero, m.world_size
    est, gpu = estimates(tc, model_cfg, N, m.rank)
    paper = zero_formula(z.psi, z.stage, N, z.dtype, z.optimizer_name)
    # the paper's optimizer side is the fp32 master and the optimizer's state (optim.py's K)
    state = optim.STATE_BYTES.get(z.optimizer_name.lower(), 0) * z.psi / (N if z.stage >= 1 else 1)
    paper.update(optimizer=state, master=paper["optimizer_side"] - state)
    part = lambda name, key: (name, m.state[key], est and est["state"][key], paper[key])
    rows = [part("weights", "params"), part("gradients", "grads"), part("fp32 master", "master"),
            part(f"{z.optimizer_name} state", "optimizer"), part("model state", "total")]
    if m.host:  # --offload-optimizer: the master and the optimizer state on the host
        rows.append(("host (offload)", m.host["total"], est and est["host"]["total"], None))
    rows.append(("step's peak", m.peak, est and est["peak"], None))
    cell = lambda n: "-" if n is None else fmt(n)
    lines = [f"rank {m.rank} of {N:,} ({why}): ZeRO-{z.stage}, {tc.dtype}, {z.optimizer_name}, "
             f"Ψ = {z.psi:,} trainable, {m.grad_accum} micro-step(s) of {tc.batch_size} x "
             f"{tc.block_size} tokens; measured in {m.seconds:.1f} s on fake tensors",
             f"  {'per rank':16}{'measured':>11}{'memory.py':>11}{'ZeRO paper':>11}"]
    lines += [f"  {name:16}{cell(ours):>11}{cell(guess):>11}{cell(p):>11}"
              for name, ours, guess, p in rows]
    host = (m.host or {}).get("total", 0)
    if host:  # offload_optimizer.py's host_bytes(), part by part
        lines.append("  host (offload): " + ", ".join(f"{k} {fmt(v)}" for k, v in m.host.items()
                                                      if k != "total"))
    lines.append(f"  the peak (MemTracker): the model state{', the host part' if host else ''} "
                 f"and {fmt(m.peak - m.state['total'] - host)} of activations and the step's "
                 "transients")
    lines += traffic_lines(m, tc) + padding_lines(z)
    if gpu:  # the CPU run measured, moved to a GPU as memory.py moves its estimate
        on_gpu, usable = m.peak + gpu["peak"] - est["peak"], (1 - HEADROOM) * gpu_bytes
        lines.append(f"  on a GPU: {fmt(on_gpu)} (the peak measured, with memory.py's GPU terms"
                     + (f": NCCL's {gpu['communicators']} communicator(s), an estimate"
                        if gpu["nccl"] else "") + (", less the host part" if host else "")
                     + f"), of {fmt(usable)} usable of --gpu-mem {fmt(gpu_bytes)}: "
                     + ("fits" if on_gpu <= usable else "does NOT fit"))
    return lines


def traffic_lines(m, tc):
    """The step's traffic beside zero.traffic_formula: elements in Ψ, bytes by collective and
    link; by link beside ZeRO++'s theory at stage 3; the PCIe copies under offload."""
    from machinery.estimator import fmt
    z, t = m.zero, m.traffic
    paper = traffic_formula(z.psi, z.stage, m.world_size, m.grad_accum, z.frozen_numel)
    by = ", ".join(f"{k} {fmt(v)}" for k, v in t.by.items())
    root = "; zero3.py gathers its root unit once a step" if z.stage == 3 else ""
    lines = [f"  traffic: {t.elements / z.psi:.3f}Ψ sent ({fmt(t.bytes)}: {by or 'nothing'}); "
             f"the ZeRO paper: {paper / z.psi:.3f}Ψ{root}"]
    if tc.zeropp and m.world_size > 1:  # ZeRO++ moves its traffic into the nodes
        from beyond.zeropp import link_theory
        theory = link_theory(z, tc.zeropp, tc.qgz_bits, m.grad_accum)
        lines.append(f"  by link ({t.node_size} ranks a node): {fmt(t.bytes_intra)} inside nodes, "
                     f"{fmt(t.bytes_inter)} between them; theory (beyond/zeropp.py) "
                     f"{fmt(theory['intra'])} | {fmt(theory['inter'])}")
    if hasattr(z, "pcie_formula"):
        pcie = z.pcie_formula()
        c = m.copies
        lines.append(f"  PCIe (offload): {fmt(c.d2h)} down, {fmt(c.h2d)} up; theory "
                     f"{fmt(pcie['d2h'])} | {fmt(pcie['h2d'])}")
    return lines


def padding_lines(zero):
    """The padding the engine's layout holds, and the paper's formula at the padded size."""
    P, own = padding(zero)
    if P == zero.psi:
        return [f"  padding: none (every flat buffer divides into {zero.world_size:,} slices)"]
    real = lambda b: sum(p.numel() for p in b.params)
    most = max(zero.buckets, key=lambda b: b.numel / real(b))
    worst = most.numel / real(most) - 1
    line = (f"  padding: {P - zero.psi:,} elements ({(P - zero.psi) / zero.psi:.2%} of Ψ) in "
            f"the flat buffers" + (f" (the most: {most.label}, {worst:.1%})" if worst >= 0.01
                                   else "") + f", {own:,} in this rank's slices")
    exact = elementwise(zero.optimizer_name) and not zero.frozen_numel and \
        zero.grad_dtype == zero.dtype and not hasattr(zero, "host_bytes")
    if exact:
        apart = zero.state_bytes()["total"] - at_padded_size(zero, P, own)["total"]
        line += (f"; measured = the paper at Ψ + {P - zero.psi:,}, less the optimizer state "
                 f"of its own padding" + ("" if apart == 0 else f" {apart:+,} B"))
    return [line]
