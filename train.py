"""
Train a GPT with our own data parallelism / ZeRO and mixed precision. Read top to bottom:
distributed init, data, the set-up (engine.py: model, LoRA, ZeRO, loss scaler), the loop, saving.
The configuration (every flag, the presets) is configurator.py.

One process (CPU or one GPU):
    python train.py                                   # the CPU demo preset, fp32
    python train.py --config config/shakespeare_char.py --bf16
Several processes on one machine (one per GPU; on a CPU, gloo processes):
    torchrun --nproc_per_node=4 train.py --zero 2 --bf16
Several machines (run on each node, node_rank 0..nnodes-1):
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST --master_port=29500 \
        train.py --config config/gpt2_124m.py --zero 2 --bf16

The training step, as the lecture teaches it and as the loop below spells it out: forward;
backward of the scaled loss (gradient collectives overlapped with it); the 16-bit gradient
slice to fp32; unscale, with an inf/NaN check that all ranks agree on; clip by the global norm;
the optimizer's step, skipped on an inf/NaN; publish the new weights; adapt the loss scale. On steps
that are not logged nothing waits for the device.
"""
import gc
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist

import checkpoint
from beyond import fp8
from machinery import pretrained
from machinery import rundir
from checkpoint import CheckpointError
from collectives import Traffic, all_reduce_sum
from configurator import ConfigError, grad_accum_for, parse_args
from data.loader import Batches, estimate_loss, load_data
from engine import build, model_config
from lora import adapter_state, save_adapter
from machinery.footprint import model_state_report
from model import peak_flops, saved_activation_bytes
from precision import grad_zero_frac, resolve_dtype, set_tf32
from machinery.rundir import RunDirError
from machinery.validate import vocab_id
from zero import replica_digest, traffic_formula
from beyond.zeropp import link_theory


def init_distributed(cfg):
    """RANK set (torchrun) -> one process per device: nccl on CUDA, gloo on CPU.
    Returns (rank, world_size, device)."""
    rank, world_size, local_rank = (int(os.environ.get(k, default)) for k, default in
                                    (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu",
                          rank_local=True)
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"rank {rank} wants cuda:{local_rank}, but {torch.cuda.device_count()} "
                          "GPU(s) are visible: one process per GPU, or --device cpu",
                          rank_local=True)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        set_tf32(True)  # fp32 matmuls on tensor cores (16-bit runs: the fp32 ones left)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                device_id=device if use_cuda else None)
    return rank, world_size, device


def get_lr(it, cfg):
    if it < cfg.warmup_iters:  # linear warmup
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def open_run(cfg, start_it, rank, world_size, print0):
    """Make out_dir this run's (rank 0 takes its lock; every rank learns a refusal) and open
    metrics.jsonl: before the run's first write, after every check of the resume."""
    error = note = None
    if rank == 0:
        try:
            note = rundir.take_lock(cfg.out_dir)
        except (RunDirError, OSError) as e:
            error = f"{e}" if isinstance(e, RunDirError) else f"cannot write {cfg.out_dir}: {e}"
    if world_size > 1:
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    if error:
        raise RunDirError(error)
    if note:
        print0(note)
    return rundir.Metrics(cfg.out_dir, start_it, rank == 0, print0)


def resume(path, zero, model, scaler, cfg, gptconf, meta):
    """checkpoint.restore, then --fp8's amax histories, exactly (in the checkpoint's header).
    Returns (iteration to continue from, a note or None)."""
    start_it, note = checkpoint.restore(path, zero, model, scaler, asdict(cfg), asdict(gptconf),
                                        meta)
    fp8_note = fp8.load_state_dict(model, checkpoint.Reader(path).header.get("fp8"), path)
    return start_it, "; ".join(n for n in (note, fp8_note) if n) or None


def agree(flag, device, world_size):
    """True on every rank when it is True on any (one tiny all-reduce)."""
    t = torch.tensor([float(flag)], device=device)
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ----------------------------------------------------------------------------------------------

@rundir.releasing_locks  # out_dir's lock is released however the run ends
def main(argv=None):
    cfg = parse_args(argv)
    rank, world_size, device = init_distributed(cfg)
    print0 = print if rank == 0 else (lambda *a, **k: None)
    try:
        dtype = resolve_dtype(cfg.dtype, device)
    except ValueError as e:
        raise ConfigError(str(e))
    # --init-from: a checkpoint of ours (init) or a Hugging Face GPT-2 (init_hf, whose config
    # sets the model flags not given), and the vocabulary the data must be in
    init, init_hf, base_meta = pretrained.open_init(cfg)
    train, val, meta = load_data(cfg, rank, world_size, base_meta)
    if init_hf:
        pretrained.check_vocab(meta, base_meta, cfg)
    grad_accum = grad_accum_for(cfg, world_size)  # --batch-tokens: after the block size is known
    tokens_per_step = cfg.batch_size * grad_accum * world_size * cfg.block_size
    print0(f"world size {world_size} on {device.type}, {cfg.dtype}, ZeRO stage {cfg.zero}; "
           f"{tokens_per_step:,} tokens per step ({cfg.batch_size} seq x {grad_accum} micro-steps "
           f"x {world_size} ranks x {cfg.block_size} tokens)")
    gptconf = model_config(cfg, meta["vocab_size"])
    weights = None
    if init:  # weights of another run (either checkpoint format), checked against this model
        checkpoint.check_compatible(init.header, asdict(gptconf), meta, cfg.init_from)
        weights = init.weights()
    model, zero, scaler = build(cfg, meta["vocab_size"], device, dtype, rank, world_size,
                                grad_accum, weights, init_hf)
    print0(f"model: {model.num_params(non_embedding=False):,} parameters, {zero.psi:,} trainable")

    start_it, note = 0, None
    header = {"config": asdict(cfg), "model_args": asdict(gptconf), "meta": meta}
    ckpts = checkpoint.list_checkpoints(cfg.out_dir) if cfg.resume else []
    if ckpts:  # read and check everything before touching any file of the run
        start_it, note = resume(ckpts[-1], zero, model, scaler, cfg, gptconf, meta)
        print0(f"resumed from {ckpts[-1]} at iteration {start_it}" + (f"; {note}" if note else ""))
    elif cfg.resume:
        print0(f"--resume: no checkpoint in {cfg.out_dir} yet, starting fresh")
    if start_it >= cfg.max_iters:
        print0(f"the run is already at iteration {start_it} (--max-iters {cfg.max_iters}): "
               "nothing to train; raise --max-iters to go on")
        return finish(model, zero, world_size)
    metrics = open_run(cfg, start_it, rank, world_size, print0)  # one writer per out-dir
    if ckpts:
        metrics.log({"event": "resume", "from": ckpts[-1], "iter": start_it, "note": note})
    line, row = model_state_report(zero, world_size)  # measured vs the paper, per rank
    print0(line)
    metrics.log({**row, "dtype": cfg.dtype, "config": asdict(cfg)})

    # a preemption (SIGTERM) or Ctrl-C (SIGINT) asks every rank to finish its step, save and exit
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.update(signal=signum))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: an OSError, not death
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = cfg.peak_tflops * 1e12 or peak_flops(gpu, dtype)  # for MFU
    batches = Batches(train, cfg, rank, world_size, grad_accum, device, start_it)
    clock = {"t": time.time(), "it": start_it, "mfu": None, "warm": False}  # the last log
    it, stopped = start_it, False
    while True:
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            t0 = time.time()
            print0(f"step {it}: evaluating on {cfg.eval_iters} batches of each split ...")
            losses = estimate_loss(model, train, val, cfg, rank, world_size, device)
            print0(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            metrics.log({"iter": it, "train_loss": losses["train"], "val_loss": losses["val"]})
            clock["t"] += time.time() - t0  # evaluation time is not step time
        if it == cfg.max_iters:
            break
        lr = get_lr(it, cfg)
        logging = it % cfg.log_interval == 0 or it == cfg.max_iters - 1
        zero.traffic = Traffic(node_size=zero.traffic.node_size)  # this step's collectives
        fp8.measure(model, logging)  # --fp8: count the casts' underflow, saturation if logged
        loss_sum = torch.zeros((), device=device)
        # -- forward and backward, micro-step by micro-step -----------------------------------
        for micro in range(grad_accum):
            x, y = batches.next()
            first = it == start_it and micro == 0  # measure the activations saved for backward
            act = [0]
            with saved_activation_bytes(model, act) if first else nullcontext():
                _, loss = model(x, y)
            if first:
                print0(f"activations saved for backward: {act[0] / 2**20:.2f} MiB per micro-step")
                metrics.log({"event": "activations", "saved_bytes": act[0],
                             "grad_ckpt": cfg.grad_ckpt})
            loss = loss / grad_accum  # the gradient of the mean over micro-steps
            if it == cfg.nan_at and rank == world_size - 1:
                loss = loss * float("nan")  # only this rank's gradients go bad: every rank skips
            loss_sum += loss.detach()
            # backward of the scaled loss; each gradient bucket's collective is launched as soon
            # as the bucket is complete (all-reduce / reduce-scatter, by stage)
            zero.backward(scaler.scale(loss), sync=micro == grad_accum - 1)
        # -- the mixed-precision step ---------------------------------------------------------
        grads = zero.master_grads()  # this rank's 16-bit gradient slice -> fp32 master gradient
        zero_frac = grad_zero_frac(grads) if logging else None  # fp16 underflow: zeros
        found_inf = scaler.unscale_(grads)  # divide by the loss scale; an inf/NaN on any rank?
        grad_norm = zero.clip_grad_norm_(cfg.grad_clip)  # global norm over every rank's slice
        zero.step(lr, found_inf)  # the optimizer on this rank's fp32 slice; skipped if found_inf
        zero.publish(wait=False)  # fp32 master -> weights (stages 1-2: all-gathers, waited
        # for bucket by bucket in the next forward's pre-hooks: they overlap it)
        scaler.update(found_inf)  # halve the scale after an overflow, grow it after a clean run
        fp8.end_step(model)  # --fp8 delayed: this step's amaxes (MAX over ranks) join the history
        zero.zero_grad()  # the next step's gradients start from zero

        if logging:  # the only steps that wait for the device
            step = dict(it=it, lr=lr, loss_sum=loss_sum, found_inf=found_inf, grad_norm=grad_norm,
                        zero_frac=zero_frac, grad_accum=grad_accum, peak=peak)
            log_step(step, clock, cfg, model, zero, scaler, metrics, print0)
            stopped = agree(stop["signal"] is not None, device, world_size)
        it += 1
        saving = cfg.save_interval and it % cfg.save_interval == 0 and it < cfg.max_iters
        if (logging or saving) and scaler.exhausted.item():
            raise ConfigError(exhausted(cfg, scaler, it))
        if saving or stopped:
            save(cfg, it, zero, model, scaler, header, print0)
        if stopped:
            print0(f"stopped by a signal after iteration {it}: resume with --resume")
            break
    wrap_up(cfg, it, zero, model, scaler, header, metrics, stopped, print0)
    rundir.release_locks()  # before finish's barrier: the run has written its last byte
    finish(model, zero, world_size)


def exhausted(cfg, scaler, it):
    """Why a run whose steps all overflow stops (without saving)."""
    if scaler.dynamic:
        return (f"by step {it - 1} the loss is non-finite at any scale, even the minimum "
                f"{cfg.min_loss_scale:g} (a NaN, not an overflow): stopped without saving; "
                "lower --learning-rate or find the NaN and resume")
    return (f"{scaler.FIXED_GIVE_UP} steps in a row, up to step {it - 1}, overflowed at the "
            f"fixed loss scale {scaler.get_scale():g}, which cannot back off: stopped without "
            "saving; use --loss-scale dynamic (or a smaller value), or find the NaN")


def log_step(step, clock, cfg, model, zero, scaler, metrics, print0):
    """One logged step: read the step's numbers off the device (the loop's only .item() calls),
    print and log them. Time per step is averaged since the last log; MFU leaves out the first
    interval of the run (warm-up, compilation)."""
    world_size, it, device = zero.world_size, step["it"], zero.device
    dt = (time.time() - clock["t"]) / (it + 1 - clock["it"])
    tps = cfg.batch_size * step["grad_accum"] * world_size * cfg.block_size / dt
    mfu = model.estimate_mfu(tps / world_size, step["peak"]) if clock["warm"] else None
    if mfu is not None:  # a running average, as nanoGPT keeps it; None without a known peak
        clock["mfu"] = mfu if clock["mfu"] is None else 0.9 * clock["mfu"] + 0.1 * mfu
    first = not clock["warm"]
    clock.update(t=time.time(), it=it + 1, warm=True)
    t, theory = zero.traffic, link_theory(zero, cfg.zeropp, cfg.qgz_bits, step["grad_accum"])
    row = {"iter": it, "loss": all_reduce_sum(step["loss_sum"], world_size).item() / world_size,
           "lr": step["lr"], "ms": dt * 1000, "tokens_per_sec": tps, "mfu": clock["mfu"],
           "loss_scale": scaler.get_scale(), "skipped": bool(step["found_inf"].item()),
           "grad_norm": step["grad_norm"].item(), "grad_zero_frac": step["zero_frac"].item(),
           "cuda_max_mem": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
           else None, "comm_elements": zero.traffic.elements, "comm_bytes": zero.traffic.bytes,
           "comm_theory_elements": traffic_formula(zero.psi, cfg.zero, world_size,
                                                   step["grad_accum"], zero.frozen_numel),
           "comm_bytes_intra": t.bytes_intra, "comm_bytes_inter": t.bytes_inter,
           "comm_theory_bytes_intra": theory["intra"], "comm_theory_bytes_inter": theory["inter"],
           "comm_by": t.by}  # bytes by collective and link
    row.update(fp8.read_stats(model))  # --fp8: the casts' underflow and saturation fractions
    eta = (cfg.max_iters - it - 1) * dt  # at this interval's pace
    print0(f"iter {it}/{cfg.max_iters}: loss {row['loss']:.4f}, lr {row['lr']:.2e}, "
           f"{row['ms']:.1f} ms, {tps:,.0f} tok/s"
           + (f", mfu {clock['mfu'] * 100:.2f}%" if clock["mfu"] else "")
           + f", ETA {int(eta // 60)}m{int(eta % 60):02d}s"
           + (f", inf/NaN gradient: step skipped (loss scale now {row['loss_scale']:g})"
              if row["skipped"] else ""))
    if first and world_size > 1:  # the lecture's numbers, measured, beside the paper's
        psi, mib = zero.psi, (lambda n: "?" if n is None else f"{n / 2**20:.2f}")
        print0(f"traffic per step and rank: {row['comm_elements'] / psi:.2f}Ψ measured "
               f"({mib(row['comm_bytes'])} MiB), {row['comm_theory_elements'] / psi:.2f}Ψ in "
               f"the ZeRO paper (Ψ = {psi:,})")
        if theory["intra"] is not None:  # ZeRO-3 and ZeRO++: the volumes by link
            print0(f"  by link: {mib(t.bytes_intra)} MiB inside nodes, {mib(t.bytes_inter)} "
                   f"MiB between them, {t.node_size or world_size} ranks a node (theory "
                   f"{mib(theory['intra'])} | {mib(theory['inter'])})")
    metrics.log(row)


def save(cfg, it, zero, model, scaler, header, print0):
    zero.wait_published()  # the weights of the last step, not a gather still on its way
    header = dict(header, fp8=fp8.state_dict(model))  # --fp8: the amax histories, else None
    path = checkpoint.save(cfg.out_dir, it, zero, model, scaler, header, cfg.ckpt_format,
                           cfg.keep_last)
    print0(f"saved {path}")


def wrap_up(cfg, it, zero, model, scaler, header, metrics, stopped, print0):
    """The end of a run: the replica check, the final checkpoint, a LoRA run's adapter."""
    # every rank must hold bitwise the same full parameters (under ZeRO-3 no rank holds them)
    zero.wait_published()
    digest = "sharded" if cfg.zero == 3 else replica_digest(model)
    digests = [digest] * zero.world_size
    if zero.world_size > 1:
        dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        print0(f"WARNING: ranks hold different parameters: {digests}")
    metrics.log({"event": "end", "iter": it, "replica_sha256": digests})
    if not stopped:  # the final checkpoint (a signal's was just written)
        save(cfg, it, zero, model, scaler, header, print0)
    if cfg.lora:  # the adapter alone: kilobytes, full tensors gathered onto rank 0 one by one
        full = checkpoint.state_dict(zero, model)
        if zero.rank == 0:
            path = os.path.join(cfg.out_dir, "adapter.safetensors")
            save_adapter(path, adapter_state(full), model.lora_settings, model.base_id,
                         vocab_id(header["meta"]))
            print0(f"saved {path} ({os.path.getsize(path) / 1024:.1f} KiB)")


def finish(model, zero, world_size):
    """Free the model, ZeRO's buffers and their finished collectives while the process group
    exists (freed at interpreter exit instead, gloo can abort the process), then leave together:
    a gloo rank that tears down while a peer still saves can abort ("terminate called without
    an active exception")."""
    del model, zero
    gc.collect()
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError, RunDirError) as e:
        if int(os.environ.get("RANK", 0)) == 0 or getattr(e, "rank_local", False):
            print(f"train.py: error: {e}", file=sys.stderr)  # one rank speaks for all
        sys.exit(2)
    finally:  # an error after init: leave no communicator behind (NCCL warns, may hang)
        if dist.is_initialized():
            dist.destroy_process_group()
