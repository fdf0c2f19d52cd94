"""
Guards how a run starts and ends: signals, agreed stops, one-line errors, a clean teardown.

  - SIGTERM (a preemption) or Ctrl-C asks every rank to finish its step, save and exit 0
  - a run whose every step overflows stops, with the reason, before it saves NaN weights
  - --nan-at makes one rank's loss NaN at one step: the lesson in skipped steps
  - a collective that times out (--collective-timeout) is one line on each rank that waited in
    it, naming the collective, the step and the ranks that never arrived (exit 3;
    machinery/hangs.py)
  - an error a user can fix is one line on stderr (exit 2), printed by one rank for all,
    agreed on by every rank where only some can see it (a node without the data)
  - a run that cannot fit in the memory it has is refused before any work (check_memory), and
    an out-of-memory error is one line that says what to lower
  - the process group is torn down together, after every rank has written its last byte
"""
import gc
import os
import signal
import sys

import torch
import torch.distributed as dist

import collectives
from configurator import UserError
# hangs: train.py's too, through this module (install, watch): every collective bounded in
# time, a hang named, --hang-at
from machinery import hangs, rundir, timeline, validate
# train.py's, through this module: the run's metrics.jsonl and its folder's lock
from machinery.rundir import Metrics, releasing_locks


def stop_on_signals():
    """A dict whose "signal" becomes the number of a SIGTERM / SIGINT once one arrives."""
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.update(signal=signum))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: an OSError, not death
    return stop


def agree(flag, device, world_size):
    """True on every rank when it is True on any (one tiny all-reduce)."""
    t = torch.tensor([float(flag)], device=device)
    return bool(collectives.all_reduce_max(t, world_size, label="agree").item())


def exhausted(cfg, scaler, it):
    """Why a run whose steps all overflow stops (without saving)."""
    if scaler.dynamic:
        return (f"by step {it - 1} the loss is non-finite at any scale, even the minimum "
                f"{cfg.min_loss_scale:g} (a NaN, not an overflow): stopped without saving; "
                "lower --learning-rate or find the NaN and resume")
    return (f"{scaler.FIXED_GIVE_UP} steps in a row, up to step {it - 1}, overflowed at the "
            f"fixed loss scale {scaler.get_scale():g}, which cannot back off: stopped without "
            "saving; use --loss-scale dynamic (or a smaller value), or find the NaN")


def agreed_error(errors, hint):
    """The one line every rank raises, from each rank's error or None (all_gather_object's
    list); None when no rank failed. When some failed and others did not (nodes that share
    no disk), it names the first that failed and adds hint: what every node must have."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return None
    r, e = failed[0]
    return e if len(failed) == len(errors) else f"rank {r} of {len(errors)}: {e}; {hint}"


def inject_nan(model, step, rank, world_size, grad_accum, start_it):
    """--nan-at STEP: the last rank's loss is NaN on every micro-step of that step, so only
    its gradients go bad; every rank must still skip the step together. A forward hook on
    the model: the training loop stays the lecture's."""
    forwards = [start_it * grad_accum]  # training forwards so far, counted as micro-steps

    def hook(module, args, output):
        if not (module.training and torch.is_grad_enabled()):
            return None  # evaluation
        it = forwards[0] // grad_accum
        forwards[0] += 1
        logits, loss = output
        if it == step and rank == world_size - 1 and loss is not None:
            return logits, loss * float("nan")
        return None

    model.register_forward_hook(hook)


def start(cfg, model_class, rank, world_size, device, print0):
    """Before any work: what the flags ask of the model class and the optimizer, the memory the
    run needs and --trace's folder, then out_dir's lock and history (one run a folder): a
    UserError, one line, the same on every rank."""
    validate.check_run(cfg, model_class)

    def checks():  # on rank 0, its line for every rank
        check_memory(cfg, device)
        if cfg.trace:
            timeline.check_target(cfg.trace, world_size)
    rundir.claim(cfg, rank, world_size, print0, checks)


def finish(model, zero, world_size):
    """The run has written its last byte: out_dir's lock released (before the barrier: a
    rank that waits there holds nothing). Then free the model, ZeRO's buffers and their
    finished collectives while the process group exists (freed at interpreter exit instead,
    gloo can abort the process), then leave together: a gloo rank that tears down while a
    peer still saves can abort ("terminate called without an active exception")."""
    rundir.release_locks()
    del model, zero
    gc.collect()
    if world_size > 1:
        collectives.barrier(world_size, label="finish")
        dist.destroy_process_group()


def free_bytes(device):
    """Memory free for this process's device: the GPU's, or the host's MemAvailable; None where
    it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_memory(cfg, device):
    """A UserError, before any work, when this run cannot fit in the memory it has: half of
    memory.py's estimate of one rank's peak (footprint.for_run, the one estimator) times the
    ranks sharing a host, so that a refusal is never a close call. The data set, and with it
    the vocabulary, is not read yet: the estimate takes the smallest, a need at least. On NCCL
    the default group's communicator is made already (init_process_group's device_id= makes it
    at once): its memory is gone from `free` and in the estimate's NCCL allowance too, at half
    weight, an error on the side of a refusal."""
    from dataclasses import asdict
    from machinery.footprint import for_run
    from machinery.validate import check_model_args
    from model import GPT, GPTConfig
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if device.type == "cpu" else 1
    free = free_bytes(device)
    if free is None:
        return
    try:
        shape = GPTConfig(arch=GPT.ARCH, block_size=cfg.block_size, vocab_size=1, bias=cfg.bias,
                          n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd)
        check_model_args(asdict(shape))  # validate.BOUNDS: no model of 10^5 layers to walk
        need = for_run(cfg, shape, world_size, device=device.type)["peak"] / 2 * ranks
    except ValueError:  # flags the model cannot be built from: check_run's one line follows
        return
    if need > free:
        where = f"{ranks} ranks on this host" if ranks > 1 else f"this {device.type}"
        raise UserError(f"--batch-size {cfg.batch_size} x --block-size {cfg.block_size} on "
                        f"{cfg.n_layer} x {cfg.n_embd}: {where} needs over {need / 1e9:.3g} GB, "
                        f"{free / 1e9:.3g} GB is free: lower --batch-size (--grad-accum keeps "
                        "the batch), or add --grad-ckpt; `python memory.py` with these flags "
                        "estimates it")


def out_of_memory(e):
    """An allocator's refusal (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError) as
    the line to print, or None for any other error. On several GPUs it names what torch's
    allocator never sees: NCCL's communicators (footprint.NCCL_BYTES, an estimate)."""
    text = str(e)
    if not (isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in text
            or "not enough memory" in text):
        return None
    nccl = ""
    if isinstance(e, torch.OutOfMemoryError) and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        from machinery.footprint import NCCL_BYTES
        nccl = (f", NCCL's communicators included (1 a rank at ZeRO-0, 2 at stages 1-3, 4 "
                f"under ZeRO++ across nodes; ~{NCCL_BYTES / 1e9:.1f} GB each outside PyTorch's "
                "allocator: an estimate; docs/gpus.md)")
    return (f"out of memory ({text.strip().splitlines()[0][:160]}): lower --batch-size "
            "(--grad-accum keeps the batch), or add --grad-ckpt or --zero 3; `python memory.py` "
            "with these flags estimates the need" + nccl)


def run_main(main, name, errors):
    """Run main(); an error in `errors` is one line on stderr (exit 2), as is running out of
    memory (each rank that does). Under torchrun rank 0 speaks for all, unless the error is
    rank_local (only this rank can see it). A collective that lost a peer is one line on each
    rank that waited in it (name_hang; exit 3)."""
    try:
        main()
    except errors as e:
        if int(os.environ.get("RANK", 0)) == 0 or getattr(e, "rank_local", False):
            print(f"{name}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:
        if dist.is_initialized() and (isinstance(e, hangs.CollectiveTimeout) or hangs.lost(e)):
            if not isinstance(e, hangs.CollectiveTimeout):  # torch.distributed's own
                e = hangs.CollectiveTimeout(None, e)
            print(f"{name}: error: {hangs.name_hang(e)}", file=sys.stderr, flush=True)
            sys.exit(3)  # a hang, named by every rank that waited
        line = out_of_memory(e)
        if line is None:
            raise
        print(f"{name}: error: {line}", file=sys.stderr)
        sys.exit(2)
    finally:  # an error after init: leave no communicator behind (NCCL warns, may hang)
        if dist.is_initialized():
            dist.destroy_process_group()
