"""
A run's side work, in one object train.py's loop calls a few times: everything a run does besides
training, so that train.py reads as the lecture.

  Run(cfg)          the flags, checked before any work: the schedule fitted to the run's length
  run.start(...)    the run folder's lock and history, the data (checked, its identity taken),
                    --init-from's source; returns the data
  run.init          what train.build starts the model from: --init-from's weights, or new ones
  run.resume(...)   a checkpoint restored exactly (its data and schedule kept), the metrics log
                    opened, the start-up table, signals, the hooks of --nan-at, --hang-at, --trace
  run.evaluate(...) the loss on both splits, printed and logged
  run.begin_step / run.end_step   around each train_step: the step's numbers on logged steps,
                    a signal agreed by every rank, the scaler's give-up, the saving cadence
  run.finish()      the last checkpoint, the replica check, the adapter, a clean teardown
"""
import gc
import os
import signal
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import checkpoint
import collectives
from configurator import SCHEDULE, TrainConfig, UserError
from machinery import checked_ckpt, declared, hangs, quirks, report, rundir, validate
from machinery.footprint import free_bytes
from machinery.rundir import releasing_locks  # noqa: F401 (train.py's, through this module)


def fit_schedule(cfg):
    """A short run decays over its own length: --lr-decay-iters follows --max-iters unless a
    preset or a flag sets it, and the warm-up is cut to a tenth of the run (nanoGPT's 2,000
    warm-up steps would be a 50-step run's whole life). cfg.explicit: what a flag or preset set."""
    if "lr_decay_iters" not in cfg.explicit and "max_iters" in cfg.explicit:
        cfg.lr_decay_iters = cfg.max_iters
        if "warmup_iters" not in cfg.explicit:
            cfg.warmup_iters = min(TrainConfig.warmup_iters, cfg.max_iters // 10)
    return cfg


def keep_schedule(cfg, saved):
    """On resume, the saved run's schedule wins over what fit_schedule derived for this one: a
    resumed run is the run it continues, only a flag or preset that sets a schedule setting
    changes it. Returns the line that says which schedule runs."""
    changed = []
    for key in SCHEDULE:
        if key in saved and key not in cfg.explicit:
            setattr(cfg, key, saved[key])
        elif key in saved and saved[key] != getattr(cfg, key):
            changed.append(f"--{key.replace('_', '-')} {saved[key]:g} -> {getattr(cfg, key):g}")
    past = (f", then {cfg.min_lr:.2e} to --max-iters {cfg.max_iters}"
            if cfg.max_iters > cfg.lr_decay_iters else "")
    return (f"schedule: warmup {cfg.warmup_iters:g}, cosine {cfg.learning_rate:.2e} -> "
            f"{cfg.min_lr:.2e} by iteration {cfg.lr_decay_iters:g}{past} ("
            + (f"changed: {', '.join(changed)})" if changed else "the checkpoint's; a schedule "
               "flag changes it)"))


def command(main, name="train.py"):
    """main() as this process's command: its exit status (run_main), the process group left."""
    try:
        status = run_main(main, name)
    finally:  # an error after init: leave no communicator behind (NCCL warns, may hang)
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)


class Run:
    def __init__(self, cfg, model_class):
        from machinery import validate
        self.cfg, self.GPT = fit_schedule(cfg), model_class  # model.GPT, a fork's model.py's
        validate.check_run(cfg, model_class)  # what the flags ask of the model and optimizer
        check_device(cfg)
        # every collective may wait --collective-timeout, then names the hang (docs/debugging.md);
        # before the process group is made: NCCL reads its Flight Recorder's settings then
        cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        hangs.install(cfg.collective_timeout, "nccl" if cuda else "gloo", cfg.out_dir)
        self.print0, self.stopped, self.it = print, False, None
        self.model = self.zero = self.scaler = None

    # -- before the model ----------------------------------------------------------------------

    def start(self, rank, world_size, device):
        """The run folder (its lock and history, the memory the run needs), --init-from's source
        and the data it sets the vocabulary of. Returns (train, val, meta)."""
        from data.loader import data_identity, load_data
        from machinery import declared
        cfg, GPT = self.cfg, self.GPT
        self.rank, self.world_size, self.device = rank, world_size, device
        self.print0 = print if rank == 0 else (lambda *a, **k: None)
        claim(cfg, rank, world_size, device, self.print0)
        quirks.apply(cfg, device)  # what a torch version or a GPU needs
        if cfg.fp8:  # where FP8 matmuls run (on a CPU: emulated), or one line
            from beyond import fp8
            try:
                eager = fp8.check_available(device, cfg.compile)  # a warning on a GPU, or None
            except RuntimeError as e:  # no FP8 on this torch or GPU (a ValueError: run_main's)
                raise UserError(str(e))
            if eager:
                self.print0(eager)
        # --init-from: weights of ours (a Reader) or a Hugging Face GPT-2 (a folder), whose
        # config.json sets the model flags not given, and the vocabulary the data must be in
        self.reader = self.hf = base_meta = None
        if cfg.init_from:
            from machinery import pretrained
            self.reader, self.hf, base_meta = pretrained.open_init(cfg)
        train, val, meta = load_data(cfg, rank, world_size, base_meta)
        declared.config_of_flags(GPT, cfg, meta["vocab_size"])  # the shape the flags describe
        self.meta = meta
        self.data_id = data_identity(cfg, train, val, meta, world_size)  # what a resume compares
        if self.hf:
            pretrained.check_vocab(meta, base_meta, cfg)
        return train, val, meta

    def init(self, config, device, dtype):
        """The model train.build starts from, in its working dtype, and the fp32 values its
        master is seeded from: --init-from's (a checkpoint of ours, a Hugging Face GPT-2), or new
        weights. Checked against the flags; with LoRA, base_id names its base for the adapter."""
        from machinery import adapters, declared
        cfg, self.base_id, self.load_after = self.cfg, None, False
        if self.hf:  # built on the meta device and filled tensor by tensor: no fp32 copy
            from machinery import pretrained
            model = pretrained.load_hf(self.hf, config, device, dtype, cfg.lora)
            self.base_id = model.base_id
            return model, pretrained.hf_weights(self.hf)  # the file's, a tensor at a time
        model = self.GPT(config)
        declared.check_model(model, cfg)  # it keeps what the flags set on it
        source = self._init_weights(model)
        self.load_after = self.reader is not None and source is None  # resume() loads it
        if source is not None:
            try:
                declared.load_weights(model, source)
            except ValueError as e:
                raise UserError(f"--init-from does not fit this model: {e}")
        if cfg.lora:  # an adapter file names its base: the weights before LoRA and quantization
            self.base_id = adapters.base_fingerprint(model)
        source = model.state_dict() if source is None else source
        return model.to(device=device, dtype=dtype), source

    def _init_weights(self, model):
        """--init-from a checkpoint of ours: its weights checked against the model and data, or
        None (none given, or a LoRA run's checkpoint taken as it trained: loaded after the
        build, in resume)."""
        if self.reader is None:
            return None
        from machinery import pretrained
        return pretrained.init_weights(self.reader, self.cfg, checkpoint.model_args(model),
                                       self.meta, self.print0)

    # -- the built run ---------------------------------------------------------------------------

    def resume(self, model, zero, scaler, grad_accum):
        """Everything before the first step: a LoRA run's checkpoint taken as it trained
        (--init-from), --resume's checkpoint restored (read and checked before any file of the
        run changes), the metrics log, the start-up table, signals and the fault hooks. Returns
        the iteration to go on from."""
        cfg, print0 = self.cfg, self.print0
        self.model, self.zero, self.scaler, self.grad_accum = model, zero, scaler, grad_accum
        if self.load_after:  # a LoRA run's checkpoint, taken as it trained
            from machinery import pretrained
            pretrained.init_trained(self.reader, cfg, zero, model)
            self.base_id = model.base_id
        tokens = cfg.batch_size * grad_accum * self.world_size * cfg.block_size
        print0(f"world size {self.world_size} on {self.device.type}, {cfg.dtype}, ZeRO stage "
               f"{cfg.zero}; {tokens:,} tokens per step ({cfg.batch_size} seq x {grad_accum} "
               f"micro-steps x {self.world_size} ranks x {cfg.block_size} tokens)")
        print0(f"model: {declared.num_params(model):,} parameters, {zero.psi:,} trainable")
        start_it, ckpt, note, new_data = self._restore()
        self.header = {"config": asdict(cfg), "model_args": checkpoint.model_args(model),
                       "meta": self.meta, "base_id": self.base_id,  # an adapter's base
                       "data": self.data_id}  # train.bin's and val.bin's sizes and sha256
        self.it = start_it
        if start_it >= cfg.max_iters:
            print0(f"the run is already at iteration {start_it} (--max-iters {cfg.max_iters}): "
                   "nothing to train; raise --max-iters to go on")
            self.stopped = "done"
            return start_it
        self.metrics = rundir.Metrics(cfg.out_dir, self.rank == 0, print0)  # appended to
        if ckpt:
            self.metrics.log({"event": "resume", "from": ckpt, "iter": start_it, "note": note})
        if new_data:  # --accept-new-data: a person can tell this run apart later
            self.metrics.log(new_data)
        report.start(cfg, model, zero, self.metrics, print0)  # model state vs the paper's
        if cfg.nan_at >= 0:  # the lesson in skipped steps: one rank's loss goes NaN
            inject_nan(model, cfg.nan_at, self.rank, self.world_size, grad_accum,
                                 start_it)
        hangs.watch(model, cfg, self.rank, self.world_size, grad_accum, start_it)  # --hang-at
        self.signal = stop_on_signals()  # SIGTERM / Ctrl-C: finish, save, exit
        self.log = report.StepLog(cfg, model, zero, scaler, self.metrics, print0, grad_accum,
                                  start_it)
        self.tracer = None
        if cfg.trace:  # a timeline of a few steps (docs/debugging.md)
            from machinery import timeline
            self.tracer = timeline.Tracer(cfg, model, self.rank, self.device, self.metrics,
                                          print0, start_it)
        return start_it

    def _restore(self):
        """--resume: rank 0's newest checkpoint, for every rank (each listing its own disk could
        differ), restored exactly, its schedule kept, on the data it trained on (or
        --accept-new-data). Returns (the iteration, the checkpoint or None, a note, the
        metrics row of accepted new data or None)."""
        from data.loader import changed_data
        cfg, zero, print0 = self.cfg, self.zero, self.print0
        path = checked_ckpt.newest_checkpoint(cfg.out_dir, zero.world_size) if cfg.resume else None
        if not path:
            if cfg.resume:
                print0(f"--resume: no checkpoint in {cfg.out_dir} yet, starting fresh")
            return 0, None, None, None
        start_it, note, saved = checked_ckpt.restore(path, zero, self.model, self.scaler,
                                                     asdict(cfg),
                                                     checkpoint.model_args(self.model), self.meta)
        # the batch of step t is the run's only on the bytes it trained on: every rank compares
        # the files it reads with the header's (a checkpoint older than that has none)
        changed = changed_data(saved.get("data"), self.data_id, path, zero.world_size)
        if changed and not cfg.accept_new_data:
            raise UserError(f"--resume: {changed}; the batches from here on would not be the "
                            "run's: prepare the data it trained on again, or pass "
                            "--accept-new-data to go on with this data (recorded in "
                            "metrics.jsonl)")
        new_data = None
        if changed:
            new_data = {"event": "new_data", "iter": start_it, "from": path, "change": changed,
                        "data": self.data_id}
            note = "; ".join(n for n in (note, f"{changed} (--accept-new-data)") if n)
        # the saved run's learning-rate schedule, unless a schedule flag is given
        note = "; ".join(n for n in (note, keep_schedule(cfg, saved["config"])) if n)
        print0(f"resumed from {path} at iteration {start_it}; {note}")
        return start_it, path, note, new_data

    # -- the loop ----------------------------------------------------------------------------

    def evaluate(self, it, estimate):
        """estimate(): {"train": loss, "val": loss}, printed and logged; not step time."""
        t0 = time.time()
        self.print0(f"step {it}: evaluating on {self.cfg.eval_iters} batches of each split ...")
        losses = estimate()
        self.print0(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        self.metrics.log({"iter": it, "train_loss": losses["train"], "val_loss": losses["val"]})
        self.log.pause(time.time() - t0)

    def begin_step(self, it):
        """Before step it. Returns what train_step calls on the master gradients of a logged
        step (fp16's underflow: the fraction of zeros), else None."""
        cfg = self.cfg
        self.logging = it % cfg.log_interval == 0 or it == cfg.max_iters - 1
        self.log.new_step()  # count this step's collectives
        if cfg.fp8:  # count the casts' underflow and saturation on logged steps
            from beyond import fp8
            fp8.measure(self.model, self.logging)
        if self.tracer:
            self.tracer.begin(it)
        return report.grad_zero_frac if self.logging else None

    def end_step(self, it, lr, loss_sum, found_inf, grad_norm, measured):
        """After step it - 1: FP8's amax histories, the trace, the log (the only steps that
        wait for the device), a signal agreed by every rank, the scaler's give-up, a save."""
        cfg, zero = self.cfg, self.zero
        if cfg.fp8:  # delayed scaling: this step's amaxes (MAX over ranks) join the history
            from beyond import fp8
            fp8.end_step(self.model)
        if self.tracer:
            self.tracer.end(it - 1)
        if self.logging:
            self.log.log(it - 1, lr, loss_sum, found_inf, grad_norm, measured)
            if validate.agree(self.signal["signal"] is not None, zero.device, self.world_size):
                self.stopped = "signal"
        self.it = it
        saving = cfg.save_interval and it % cfg.save_interval == 0 and it < cfg.max_iters
        if (self.logging or saving) and self.scaler.exhausted.item():
            raise UserError(exhausted(cfg, self.scaler, it))
        if saving or self.stopped:
            self.save(it)
        if self.stopped:
            self.print0(f"stopped by a signal after iteration {it}: resume with --resume")

    def save(self, it):
        cfg, zero = self.cfg, self.zero
        zero.wait_published()  # the weights of the last step, not a gather still on its way
        header = self.header
        if cfg.fp8:  # the amax histories
            from beyond import fp8
            header = dict(header, fp8=fp8.state_dict(self.model))
        path = checked_ckpt.save(cfg.out_dir, it, zero, self.model, self.scaler, header,
                                 cfg.ckpt_format, cfg.keep_last)
        self.print0(f"saved {path}")

    def finish(self):
        """The end: the replica check and the final checkpoint (a signal's is written), a LoRA
        run's adapter alone, then out_dir's lock released and the ranks leave together."""
        if self.stopped != "done":
            report.check_replicas(self.zero, self.model, self.metrics, self.it, self.print0)
            if not self.stopped:
                self.save(self.it)
            if self.cfg.lora:  # the adapter alone: kilobytes
                from machinery import adapters
                self.model.base_id = self.base_id
                adapters.save_run_adapter(self.cfg.out_dir, self.zero, self.model, self.meta,
                                          self.print0)
        leave(self.model, self.zero, self.world_size)
        self.model = self.zero = None


def check_device(cfg):
    """--device cuda where no GPU is, or more ranks on this node than GPUs: one line."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible: use --device cpu",
                        rank_local=True)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise UserError(f"rank {os.environ.get('RANK', 0)} wants cuda:{local_rank}, but "
                        f"{torch.cuda.device_count()} GPU(s) are visible: one process per GPU, "
                        "or --device cpu", rank_local=True)


# ----------------------------------------------------------------------------------------------
# how a run starts and ends: signals, agreed stops, one-line errors, a clean teardown
#
#   - SIGTERM (a preemption) or Ctrl-C asks every rank to finish its step, save and exit 0
#   - a run whose every step overflows stops, with the reason, before it saves NaN weights
#   - --nan-at makes one rank's loss NaN at one step: the lesson in skipped steps
#   - a collective that times out (--collective-timeout) is one line on each rank that waited in
#     it, naming the collective, the step and the ranks that never arrived (exit 3;
#     machinery/hangs.py)
#   - an error a user can fix is one line on stderr (exit 2), printed by one rank for all,
#     agreed on by every rank where only some can see it (a node without the data)
#   - a run that cannot fit in the memory it has is refused before any work (check_memory), and
#     an out-of-memory error is one line that says what to lower
#   - the process group is torn down together, after every rank has written its last byte

def stop_on_signals():
    """A dict whose "signal" becomes the number of a SIGTERM / SIGINT once one arrives."""
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.update(signal=signum))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit: an OSError, not death
    return stop


def exhausted(cfg, scaler, it):
    """Why a run whose steps all overflow stops (without saving)."""
    if scaler.dynamic:
        return (f"by step {it - 1} the loss is non-finite at any scale, even the minimum "
                f"{cfg.min_loss_scale:g} (a NaN, not an overflow): stopped without saving; "
                "lower --learning-rate or find the NaN and resume")
    return (f"{scaler.FIXED_GIVE_UP} steps in a row, up to step {it - 1}, overflowed at the "
            f"fixed loss scale {scaler.get_scale():g}, which cannot back off: stopped without "
            "saving; use --loss-scale dynamic (or a smaller value), or find the NaN")


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


def claim(cfg, rank, world_size, device, print0):
    """Before any work: the memory the run needs and --trace's folder, then out_dir's lock and
    history (one run a folder): a UserError, one line, the same on every rank."""
    def checks():  # on rank 0, its line for every rank
        check_memory(cfg, device)
        if cfg.trace:  # --trace's folder (its module loads only with the flag)
            from machinery import timeline
            timeline.check_target(cfg.trace, world_size)
    rundir.claim(cfg, rank, world_size, print0, checks)


def leave(model, zero, world_size):
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


def run_main(main, name, errors=(UserError, ValueError)):
    """The one place an error becomes one line, for every command: main()'s exit status, 0; or
    2 after an error a user can fix (a UserError, or the ValueError of any check, the lesson's
    own included) or running out of memory (each rank that does), one line on stderr. Under
    torchrun rank 0 speaks for all, unless the error is rank_local (only this rank can see
    it). 3 after a collective that lost a peer: one line on each rank that waited in it
    (name_hang)."""
    try:
        main()
        return 0
    except errors as e:
        if int(os.environ.get("RANK", 0)) == 0 or getattr(e, "rank_local", False):
            print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if dist.is_initialized() and (isinstance(e, hangs.CollectiveTimeout) or hangs.lost(e)):
            if not isinstance(e, hangs.CollectiveTimeout):  # torch.distributed's own
                e = hangs.CollectiveTimeout(None, e)
            print(f"{name}: error: {hangs.name_hang(e)}", file=sys.stderr, flush=True)
            return 3  # a hang, named by every rank that waited
        line = out_of_memory(e)
        if line is None:
            raise
        print(f"{name}: error: {line}", file=sys.stderr)
        return 2
