"""
Guards the lecture's claim: every number is measured and printed beside the paper's.

train.py calls these in one line each. They read the run, never change it:

  1. the start-up table: the model state each rank holds, measured (ZeRO.state_bytes)
     beside the ZeRO paper's formula (zero.zero_formula)
  2. the bytes saved for backward in the first micro-step (meter.py)
  3. one row per logged step: loss, time, MFU, loss scale, skipped steps, the gradient
     norm, and the traffic measured beside the paper's 2Ψ or 3Ψ (zero.traffic_formula); on
     a GPU, once, PyTorch's peak memory beside the device's own count (NCCL's is outside it)
  4. the replica check at the end: data parallelism's invariant, all weights bitwise equal

The same rows go to metrics.jsonl (rundir.Metrics), one JSON object per row.
"""
import hashlib
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from collectives import all_gather_object, all_reduce_sum
from machinery import meter
# MFU, or the default for a fork that declares none (declared.py)
from machinery.declared import estimate_mfu
from zero import traffic_formula, zero_formula

# ----------------------------------------------------------------------------------------------
# 1. the start-up table

def model_state_report(zero, world_size):
    """What each rank holds (ZeRO.state_bytes(), gathered from every rank: a collective) beside
    the ZeRO paper's formula: (a table that fits 80 columns, a metrics.jsonl row)."""
    held = zero.state_bytes()
    per_rank = [held] * world_size
    if world_size > 1:
        dist.all_gather_object(per_rank, held)
    paper = zero_formula(zero.psi, zero.stage, world_size, zero.dtype, zero.optimizer_name)
    master = "fp32 master + " if zero.dtype != torch.float32 else ""
    pairs = [("weights", held["params"], paper["params"], ""),
             ("gradients", held["grads"], paper["grads"], ""),
             ("optimizer side", held["master"] + held["optimizer"], paper["optimizer_side"],
              f"{master}{zero.optimizer_name} state"),
             ("total", held["total"], paper["total"], "")]
    mib = lambda n: f"{n / 2**20:>6.2f} MiB  "
    lines = [f"model state per rank, ZeRO-{zero.stage} on {world_size} rank(s), Ψ = "
             f"{zero.psi:,} trainable:", f"  {'':16}{'measured':>10}  {'ZeRO paper':>10}"]
    lines += [f"  {name:16}{mib(ours)}{mib(p)}{note}".rstrip() for name, ours, p, note in pairs]
    host = zero.host_bytes() if hasattr(zero, "host_bytes") else None
    if host:  # --offload-optimizer: the master and the optimizer state are on the host
        lines.append(f"  {'host (offload)':16}{mib(host['total'])}"
                     f"master, {zero.optimizer_name} state, grad, staging")
    row = {"event": "model_state", "psi": zero.psi, "stage": zero.stage,
           "world_size": world_size, "per_rank": per_rank, "formula": paper,
           "optimizer": zero.optimizer_name, "host": host}
    return "\n".join(lines), row


def start(cfg, model, zero, metrics, print0):
    """The run's first rows: the start-up table (printed and logged with the whole
    configuration), then, once the first micro-step has run, its activations."""
    line, row = model_state_report(zero, zero.world_size)
    print0(line)
    metrics.log({**row, "dtype": cfg.dtype, "config": asdict(cfg)})
    meter_first_forward(model, cfg, print0, metrics)


# ----------------------------------------------------------------------------------------------
# 2. the activations of the first micro-step

def meter_first_forward(model, cfg, print0, metrics):
    """Measure the next training forward's saved tensors, print and log them once."""
    def done(nbytes, moved):
        print0(f"activations saved for backward: {nbytes / 2**20:.2f} MiB per micro-step"
               + (f", {moved / 2**20:.2f} MiB of them in pinned host memory"
                  if cfg.offload_activations and moved else ""))
        metrics.log({"event": "activations", "saved_bytes": nbytes, "grad_ckpt": cfg.grad_ckpt,
                     "offloaded_bytes": moved})
    meter.measure_next_forward(model, done)


# ----------------------------------------------------------------------------------------------
# 3. a logged step

def grad_zero_frac(grads, group=None):
    """Fraction of gradient entries that are exactly zero, over every rank's gradients (a device
    tensor). Under fp16 a rising value means that gradients underflow: the scale is too low."""
    grads = [g for g in grads if g is not None]
    device = grads[0].device if grads else "cpu"
    total = sum(g.numel() for g in grads)  # a Python int: no kernel for it
    nonzero = torch.stack([torch.count_nonzero(g) for g in grads]).sum() if grads else 0
    counts = torch.stack([torch.as_tensor(total - nonzero, dtype=torch.float64, device=device),
                          torch.tensor(float(total), dtype=torch.float64, device=device)])
    if dist.is_initialized():  # ranks holding the same gradients (stage 0) leave it unchanged
        if dist.get_backend(group) == "nccl":  # host gradients (an offloaded optimizer)
            counts = counts.to(torch.device("cuda", torch.cuda.current_device()))
        all_reduce_sum(counts, dist.get_world_size(group), group, label="zero fraction")
    return counts[0] / counts[1].clamp(min=1)


# Dense peak TFLOP/s per GPU from the vendors' data sheets, for MFU: (name as
# torch.cuda.get_device_name gives it, 16-bit (bf16 / fp16), TF32 (fp32 matmuls with TF32 on,
# as train.py sets; V100 and T4 have no TF32: their plain fp32)). First match wins: the
# specific variants (NVL, PCIe, GB200 before B200, A10G before A10) come first; the plain name
# is the SXM part. A10G has no public data sheet: None, so MFU asks for --peak-tflops.
PEAK_TFLOPS = [
    ("GB200", 2500, 1250), ("B200", 2250, 1100),
    ("H200 NVL", 835, 418), ("H200", 989, 495), ("H100 NVL", 835, 418), ("H100 PCIe", 756, 378),
    ("H100", 989, 495), ("H800 PCIe", 756, 378), ("H800", 989, 495), ("H20", 148, 74),
    ("A100", 312, 156), ("L40S", 362, 183), ("L40", 181, 90.5), ("L4", 121, 60),
    ("A10G", None, None), ("A10", 125, 62.5), ("RTX 4090", 165, 82.6), ("RTX 3090", 71, 35.6),
    ("V100", 125, 15.7), ("T4", 65, 8.1),
]


def peak_flops(device_name, dtype):
    """Dense peak FLOP/s of the GPU called device_name in this dtype; None when unknown or
    no GPU (then MFU is not shown; --peak-tflops sets it)."""
    for key, half, tf32 in PEAK_TFLOPS:
        if key.lower() in (device_name or "").lower():
            peak = tf32 if dtype == torch.float32 else half
            return None if peak is None else peak * 1e12
    return None


class StepLog:
    """Logged steps: time per step averaged since the last log, MFU (leaving out the first
    interval: warm-up, compilation), the traffic beside the paper's, once per run."""

    def __init__(self, cfg, model, zero, scaler, metrics, print0, grad_accum, start_it):
        self.cfg, self.model, self.zero, self.scaler = cfg, model, zero, scaler
        self.metrics, self.print0, self.grad_accum = metrics, print0, grad_accum
        device = zero.device
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.peak = cfg.peak_tflops * 1e12 or peak_flops(gpu, zero.dtype)
        if self.peak and estimate_mfu(model, 1.0, self.peak) is None:  # a fork's: say why
            print0(f"MFU not shown: {type(model).__name__} declares no flops_per_token() "
                   "(docs/forking.md)")
        self.t, self.since, self.mfu, self.warm = time.time(), start_it, None, False

    def pause(self, seconds):
        """Evaluation time is not step time."""
        self.t += seconds

    def new_step(self):
        """Count only this step's collectives (ZeRO++'s counter by link keeps its node size)
        and host copies (--offload-optimizer's)."""
        t = self.zero.traffic
        self.zero.traffic = type(t)(node_size=t.node_size) if hasattr(t, "node_size") else type(t)()
        if hasattr(self.zero, "host_copies"):
            self.zero.host_copies = type(self.zero.host_copies)()

    def log(self, it, lr, loss_sum, found_inf, grad_norm, zero_frac):
        """Read the step's numbers off the device (the loop's only .item() calls)."""
        cfg, zero, N = self.cfg, self.zero, self.zero.world_size
        dt, cuda = (time.time() - self.t) / (it + 1 - self.since), zero.device.type == "cuda"
        tps = cfg.batch_size * self.grad_accum * N * cfg.block_size / dt
        mfu = estimate_mfu(self.model, tps / N, self.peak) if self.warm else None
        if mfu is not None:  # a running average, as nanoGPT keeps it
            self.mfu = mfu if self.mfu is None else 0.9 * self.mfu + 0.1 * mfu
        first, self.warm = not self.warm, True
        self.t, self.since = time.time(), it + 1
        row = {"iter": it, "loss": all_reduce_sum(loss_sum, N).item() / N, "lr": lr,
               "ms": dt * 1000, "tokens_per_sec": tps, "mfu": self.mfu,
               "loss_scale": self.scaler.get_scale(), "skipped": bool(found_inf.item()),
               "grad_norm": grad_norm.item(), "grad_zero_frac": zero_frac.item(),
               "cuda_max_mem": torch.cuda.max_memory_allocated(zero.device) if cuda else None,
               # what the process holds: offloading lowers what is allocated, not always it
               "cuda_max_reserved": torch.cuda.max_memory_reserved(zero.device) if cuda else None,
               # what the device has in use: PyTorch's reserved bytes and what it never sees
               "cuda_used": device_used(zero.device) if cuda else None}
        row.update(self._traffic())
        if cfg.fp8:  # the casts' underflow and saturation fractions
            from beyond import fp8
            row.update(fp8.read_stats(self.model))
        self._print(it, row, dt, tps, first)
        if first and cuda:  # once: the allocator's peak beside the device's own count
            self.print0(memory_line(row["cuda_max_mem"], torch.cuda.memory_reserved(zero.device),
                                    row["cuda_used"], torch.cuda.mem_get_info(zero.device)[1],
                                    communicators(cfg, N, zero)))
        self.metrics.log(row)
        return row

    def _traffic(self):
        cfg, zero, t = self.cfg, self.zero, self.zero.traffic
        theory = {"intra": None, "inter": None}
        if zero.stage == 3 and zero.world_size > 1:  # bytes by link: ZeRO++'s theory
            from beyond.zeropp import link_theory
            theory = link_theory(zero, cfg.zeropp, cfg.qgz_bits, self.grad_accum)
        formula = traffic_formula(zero.psi, cfg.zero, zero.world_size, self.grad_accum,
                                  zero.frozen_numel)
        pcie = zero.pcie_formula() if hasattr(zero, "pcie_formula") else {"d2h": 0, "h2d": 0}
        copies = getattr(zero, "host_copies", None)  # --offload-optimizer's (offload_optimizer.py)
        return {"d2h_bytes": copies.d2h if copies else 0, "h2d_bytes": copies.h2d if copies else 0,
                "d2h_theory": pcie["d2h"], "h2d_theory": pcie["h2d"],
                "comm_elements": t.elements, "comm_bytes": t.bytes,
                "comm_theory_elements": formula,
                # by link at stage 3 (zeropp.LinkTraffic), else None
                "comm_bytes_intra": getattr(t, "bytes_intra", None),
                "comm_bytes_inter": getattr(t, "bytes_inter", None),
                "comm_theory_bytes_intra": theory["intra"],
                "comm_theory_bytes_inter": theory["inter"],
                "comm_by": getattr(t, "by", None)}  # bytes by collective and link

    def _print(self, it, row, dt, tps, first):
        cfg, say = self.cfg, self.print0
        eta = (cfg.max_iters - it - 1) * dt  # at this interval's pace
        say(f"iter {it}/{cfg.max_iters}: loss {row['loss']:.4f}, lr {row['lr']:.2e}, "
            f"{row['ms']:.1f} ms, {tps:,.0f} tok/s"
            + (f", mfu {self.mfu * 100:.2f}%" if self.mfu else "")
            + f", ETA {int(eta // 60)}m{int(eta % 60):02d}s"
            + (f", inf/NaN gradient: step skipped (loss scale now {row['loss_scale']:g})"
               if row["skipped"] else ""))
        if first and row["d2h_theory"]:  # --offload-optimizer: the copies, once
            say(f"host copies per step and rank: {row['d2h_bytes']:,} B device->host (gradient "
                f"slice; theory {row['d2h_theory']:,}), {row['h2d_bytes']:,} B host->device "
                f"(weight slice; theory {row['h2d_theory']:,})")
        if not first or self.zero.world_size == 1:
            return
        # the lecture's numbers, measured, beside the paper's: once
        psi, t = self.zero.psi, self.zero.traffic
        mib = lambda n: "?" if n is None else f"{n / 2**20:.2f}"
        say(f"traffic per step and rank: {row['comm_elements'] / psi:.2f}Ψ measured "
            f"({mib(row['comm_bytes'])} MiB), {row['comm_theory_elements'] / psi:.2f}Ψ in "
            f"the ZeRO paper (Ψ = {psi:,})")
        if row["comm_theory_bytes_intra"] is not None:  # ZeRO-3 and ZeRO++: by link
            say(f"  by link: {mib(t.bytes_intra)} MiB inside nodes, {mib(t.bytes_inter)} "
                f"MiB between them, {t.node_size or self.zero.world_size} ranks a node "
                f"(theory {mib(row['comm_theory_bytes_intra'])} | "
                f"{mib(row['comm_theory_bytes_inter'])})")


def device_used(device):
    """Bytes in use on the GPU, as the driver counts them (cudaMemGetInfo): the process's
    allocator, its CUDA context, library workspaces, NCCL's buffers, other processes."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def communicators(cfg, world_size, zero):
    """The NCCL communicators this rank joins, as memory.py counts them (footprint.py), on
    the node size the run found (--node-size, else torchrun's LOCAL_WORLD_SIZE)."""
    from configurator import parse_zeropp
    from machinery.footprint import nccl_communicators
    return nccl_communicators(world_size, cfg.zero, parse_zeropp(cfg.zeropp),
                              getattr(zero.traffic, "node_size", 0), zero.device.type)


def memory_line(peak, reserved, used, total, n_comms):
    """PyTorch's peak beside the device's count: the gap is what the allocator never sees (the
    CUDA context, cuBLAS / cuDNN workspaces, NCCL's communicators), which max_memory_allocated
    leaves out and an out-of-memory error still meets."""
    from machinery.footprint import NCCL_BYTES
    gib = lambda n: f"{n / 2**30:.2f}"
    nccl = (f"; memory.py allows {n_comms} NCCL communicator(s) {n_comms * NCCL_BYTES / 2**30:.2f}"
            " GiB of it, an estimate" if n_comms else "")
    return (f"GPU memory: peak {gib(peak)} GiB allocated, {gib(reserved)} GiB reserved by "
            f"PyTorch; the device has {gib(used)} of {gib(total)} GiB in use: "
            f"{gib(used - reserved)} GiB outside PyTorch's allocator (the CUDA context, library "
            f"workspaces, NCCL, other processes){nccl}")


# ----------------------------------------------------------------------------------------------
# 4. the end of a run

def replica_digest(model):
    """sha256 of every parameter: data parallelism's invariant is that all ranks hold bitwise
    the same weights after every step (compare the digests across ranks)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def check_replicas(zero, model, metrics, it, print0):
    """Every rank must hold bitwise the same full parameters (under ZeRO-3 none holds them)."""
    zero.wait_published()
    digest = "sharded" if zero.stage == 3 else replica_digest(model)
    digests = all_gather_object(digest, zero.world_size, label="the replica check")
    if len(set(digests)) > 1:
        print0(f"WARNING: ranks hold different parameters: {digests}")
    metrics.log({"event": "end", "iter": it, "replica_sha256": digests})
