"""
Will my model fit, and which flags do I need? Memory per GPU, from the same code that trains.

  python -m bench.lecture                                  # the lecture's tables, from these
  python memory.py --config config/gpt2_124m.py --dtype bf16 --world-size 8 --zero 2 --gpu-mem 80GB
  python memory.py --params 7e9 --world-size 8 --gpu-mem 80GB --advise  # which flags, as a command
  python memory.py --config config/gpt2_124m.py --world-size 4 --zero 3 --optimizer adafactor
  python memory.py --params 70e9 --world-size 1024 --zero 3 --bf16 --grad-ckpt --measure

The arithmetic is footprint.py's (model state, exact) and activations.py's (saved for backward,
per module kind), both counted on the model the flags describe and held to measurement by
tests/test_memory.py. NCCL's communicators hold memory outside torch's allocator: an
allowance of footprint.NCCL_BYTES each (an estimate from NVIDIA/nccl#864), 2 a rank on several
GPUs. Not estimated: the CUDA context and allocator fragmentation: --advise keeps HEADROOM of
the GPU free for them. --advise walks the lecture's decision flow and ends in a train.py
command that runs what it estimated. Sizes are decimal: 1 GB = 1e9 bytes. A fork's model
(model.GPT edited) is counted by its own formulas: docs/forking.md, "memory.py for a fork".
--optimizer takes train.py's names and, here only, adafactor: torch's Adafactor on
beyond/muon.py's whole-tensor layout, which a fork's own loop builds (docs/forking.md).
--measure builds and steps the real engine instead, at this size, as a rank of --world-size, on
fake tensors (machinery/measure.py, docs/scale.md): what it holds, its peak and its traffic,
measured beside this estimate and the paper; with --advise, the command it ends in.
"""
import bisect
import sys

from configurator import UserError
from optim import OPTIMIZERS
from machinery import measure
from machinery.estimator import (GB, HEADROOM, advise_plans, breakdown, command, dataset_note,
                                 fits, measured_config, model_from_flags, parse_bytes, parse_flags,
                                 plan_of, print_run, save_flags)
from machinery.footprint import estimate


def max_batch(fits_at, limit=4096):
    """Largest micro-batch b <= limit with fits_at(b), 0 if none. Memory grows with b, so the
    b that fit come first: a binary search for the first that does not is their count."""
    if not fits_at(1):  # one look, not twelve: --advise tries several plans that do not fit
        return 0
    return bisect.bisect_left(range(1, limit + 1), True, key=lambda b: not fits_at(b))


def offload_cost(e, world_size, host, optimizer="adamw"):
    """--offload-optimizer's price per step, predicted: the host bytes, the copies each way on
    PCIe, the CPU's step at AdamW's rate (rates in beyond/offload_optimizer.py, with their
    sources; no other optimizer's is measured)."""
    from beyond.offload_optimizer import CPU_ADAM_PER_CORE, PCIE_BYTES_PER_S
    slice_ = e["trainable"] / world_size  # the owned slice, less its padding
    step = "CPU AdamW" if optimizer == "adamw" else f"CPU {optimizer} (at AdamW's rate)"
    return (f"{host / GB:.1f} GB of host memory, {2 * slice_ / GB:.1f} GB each way on PCIe "
            f"(~{2 * slice_ / PCIE_BYTES_PER_S:.2f} s at {PCIE_BYTES_PER_S / GB:.0f} GB/s), "
            f"{slice_ / CPU_ADAM_PER_CORE:.1f} core-seconds of {step} a step")


def advise(cfg, world_size, gpu_bytes, dtype="bf16", psi=None, shape_args=(), batch_tokens=0,
           host_bytes=256e9, chunked_loss=True, optimizer="adamw"):
    """The lecture's decision flow, each step checked with estimate(): (lines, command or None).
    The cheapest stage that fits wins, at its largest micro-batch: ZeRO-2 before ZeRO-3
    (advise_plans). LoRA keeps the ZeRO stage the steps before chose: on ZeRO-3 its frozen
    base is sharded too. The command saves sharded checkpoints when rank 0's host could not
    assemble a consolidated one (save_flags). Muon and Adafactor are estimated on their
    whole-tensor layout (beyond/muon.py), padding included; Adafactor's LoRA is not."""
    N = world_size

    def est(**run):
        return estimate(cfg, **{"world_size": N, "dtype": dtype, "psi": psi,
                                 "chunked_loss": chunked_loss, "optimizer": optimizer, **run})

    scaler = ("with the loss scaler (this GPU has no bf16)" if dtype == "fp16" else
              "(Ampere or newer; on older GPUs pass --dtype fp16: fp16 with the loss scaler)")
    lines = [f"mixed precision, always: {dtype} {scaler}"]
    one = est(world_size=1)
    if one["activations"].get("missing"):  # no plan can be priced without them
        raise UserError(f"--advise: {one['activations']['missing']}")
    lines.append(f"batch 1 on one GPU, no ZeRO: peak {one['peak'] / GB:.2f} GB of "
                 f"{(1 - HEADROOM) * gpu_bytes / GB:.1f} GB usable ({gpu_bytes / GB:.0f} GB less "
                 f"{HEADROOM:.0%}): " + ("fits" if fits(one, gpu_bytes) else "does not fit")
                 + "\n   " + breakdown(one))
    # ZeRO-2 holds the 16-bit weights whole: tried where its model state can fit at all
    zero2 = est(stage=2, grad_ckpt=True) if not fits(one, gpu_bytes) and N > 1 else None
    zero2_fits = zero2 is not None and fits(zero2, gpu_bytes)
    if zero2 is not None and not zero2_fits:
        lines.append(f"ZeRO-2 on {N} GPUs: its model state alone needs "
                     f"{zero2['state']['total'] / GB:.2f} GB (the 16-bit weights whole, "
                     f"{zero2['state']['params'] / GB:.2f} GB): no micro-batch fits")
    best = None  # (run, micro-batch): the cheapest plan that fits
    plans = advise_plans(N, fits(one, gpu_bytes), zero2_fits)
    if optimizer == "adafactor":  # estimated for a full fine-tune only (footprint.estimate)
        plans = [plan for plan in plans if not plan[2]]
    for stage, ckpt, r, quant, offload, why in plans:
        if best and (stage, ckpt) != (3, best[0]["grad_ckpt"]):
            break  # a fitting ZeRO-2 competes only with ZeRO-3 at the same checkpointing
        run = dict(stage=stage, grad_ckpt=ckpt, lora_rank=r, quantize=quant, offload=offload)
        host = min(N, 8) * est(**run)["host"]["total"]  # the ranks of one host (8 GPUs)
        if host > host_bytes:
            lines.append(f"{why}: the host would need {host / GB:.0f} GB, over --host-mem "
                         f"{host_bytes / GB:.0f} GB")
            continue
        if offload:  # its price: host memory, PCIe and the CPU's step (offload_cost)
            why += "; " + offload_cost(est(**run), N, host, optimizer)
        b = max_batch(lambda b: fits(est(batch=b, **run), gpu_bytes))
        if batch_tokens:  # --batch-tokens: a micro-batch whose global micro-step divides it
            per_b = cfg.block_size * N
            b = max([d for d in range(1, b + 1) if batch_tokens % (d * per_b) == 0], default=0)
        peak = est(batch=max(b, 1), **run)["peak"] / GB
        lines.append(f"{why}: " + (f"micro-batch up to {b} fits (peak {peak:.2f} GB)" if b
                                   else f"batch 1 needs {peak:.2f} GB"))
        cheaper = best is not None and b > 3 * best[1]  # than the ZeRO-2 plan found
        if best and b:  # a micro-step moves Ψ on ZeRO-2 (its reduce-scatter), 3Ψ on ZeRO-3
            lines.append(f"a sequence moves Ψ/{best[1]} on ZeRO-2, 3Ψ/{b} on ZeRO-3: "
                         + ("ZeRO-3" if cheaper else "ZeRO-2"))
        if b and (best is None or cheaper):
            best = (run, b)
        if best and best[0]["stage"] != 2:
            break
    if best is None:  # one GPU alone, or more of these GPUs
        best, N = fallback(lines, est, fits(one, gpu_bytes), gpu_bytes, N)
    elif best[0]["stage"] == 2 and not fits(one, gpu_bytes):  # where we leave the flowchart
        lines.append("the lecture's flowchart goes to ZeRO-3 once batch 1 does not fit one GPU; "
                     "ZeRO-2 fits here for the traffic of data parallelism, not 1.5x: stage 3 "
                     "only when the 16-bit weights themselves do not fit")
    lines = [f"{i + 1}. {line}" for i, line in enumerate(lines)]
    if best is None:
        return lines, None
    run, b = best
    extra = last_steps(lines, est(batch=b, **run)["trainable"], host_bytes, optimizer,
                       run["stage"], run["offload"])
    return lines, command(N, [*shape_args, *extra], run["stage"], dtype, b, run["grad_ckpt"],
                          run["lora_rank"] > 0, run["quantize"], offload=run["offload"])


def fallback(lines, est, one_fits, gpu_bytes, N):
    """Where no plan on the N GPUs fits: (a plan and the GPUs it runs on, or None), its line
    appended. One GPU where it holds batch 1 and N do not: on N each rank joins NCCL's
    communicators, which can take more than ZeRO-2 saves a small model. Else: whether a full
    fine-tune would fit on more of these GPUs."""
    if one_fits and N > 1:
        b = max_batch(lambda b: fits(est(world_size=1, batch=b), gpu_bytes))
        lines.append(f"one GPU, not {N}: on {N} each rank joins NCCL's communicators, an "
                     f"allowance of {est(stage=2)['nccl'] / GB:.1f} GB, and no micro-batch "
                     f"fits; one GPU alone fits micro-batch up to {b}")
        return (dict(stage=0, grad_ckpt=False, lora_rank=0, quantize=None, offload=False), b), 1
    more = [n for n in (2**k for k in range(13))
            if fits(est(world_size=n, stage=3, grad_ckpt=True), gpu_bytes)]
    lines.append("does not fit: shorten the sequence or take bigger GPUs" + (
        f"; a full fine-tune with ZeRO-3 + checkpointing fits on {more[0]} of these GPUs"
        if more else ""))
    return None, N


def last_steps(lines, trainable, host_bytes, optimizer, stage, offload=False):
    """--advise's closing lines (appended to lines) and the command's flags they add: sharded
    checkpoints where rank 0's host could not assemble a consolidated one (save_flags); the
    optimizer, or for Adafactor, which train.py does not take, what to build (offloaded, where
    the plan is ZeRO-Offload)."""
    saving = save_flags(trainable, "adamw", host_bytes)
    if saving:
        lines.append(f"{len(lines) + 1}. checkpoints: --ckpt-format sharded (a consolidated save "
                     f"would gather 12 bytes a parameter on rank 0's host, over half of "
                     f"--host-mem {host_bytes / GB:.0f} GB)")
    if optimizer == "adafactor":
        engine = f"beyond.muon.{'WholeZeRO3' if stage == 3 else 'WholeZeRO'}"
        if offload:  # train.py's make_engine: the offloading class of the same engine
            engine = f"beyond.offload_optimizer.offload_engine({engine})"
        lines.append(f"{len(lines) + 1}. Adafactor is not a train.py --optimizer: build "
                     f"{engine} with optimizer=torch.optim.Adafactor in your own loop "
                     "(docs/forking.md), at the stage, micro-batch and checkpointing of this "
                     "command")
    named = [f"--optimizer {optimizer}"] if optimizer in OPTIMIZERS[1:] else []  # not adamw
    return saving + named


def main(argv=None):
    a, tc = parse_flags(sys.argv[1:] if argv is None else argv)
    psi = int(a.params) if a.params else None
    cfg, model_flags = model_from_flags(a, tc, psi)
    gpu = parse_bytes(a.gpu_mem)
    if a.measure and not a.advise:  # the real engine at this size, one step on fake tensors
        batch = tc.batch_size if "batch_size" in tc.explicit or not psi else 1  # as print_run
        return measure.run(measured_config(tc, cfg, batch), cfg, a.world_size, a.ranks, gpu)
    if not a.advise:  # these flags' estimate, term by term
        return print_run(a, tc, cfg, psi, gpu)
    # --advise: mixed precision always, bf16 unless fp16 is asked for
    dtype = "fp16" if tc.dtype == "fp16" else "bf16"
    lines, cmd = advise(cfg, a.world_size, gpu, dtype, psi, model_flags, tc.batch_tokens,
                        parse_bytes(a.host_mem, "--host-mem"), tc.chunked_loss, tc.optimizer)
    print("\n".join(lines) + ("\n\n" + cmd if cmd else ""))
    for note in dataset_note(model_flags, cfg.vocab_size, cmd, a.params):
        print(note)
    if a.measure:  # the plan confirmed: its command's run, one step on fake tensors
        if cmd is None:
            raise UserError("--measure: no plan fits these GPUs, so there is no command to "
                            "measure; measure one of the runs above without --advise")
        plan, world_size = plan_of(cmd)
        print("\nthe command above, measured:")
        measure.run(plan, cfg, world_size, a.ranks, gpu)
    return cmd


if __name__ == "__main__":
    from machinery import run
    run.command(main, "memory.py")  # an error is one line (run_main), never a traceback
