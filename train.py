"""
Train a GPT with our own data parallelism / ZeRO and mixed precision.

Read it top to bottom, as nanoGPT's train.py:
  1. distributed init: one process per GPU (or gloo processes on a CPU)
  2. build(): the model, LoRA, ZeRO and the loss scaler, each where it must come
  3. train_step(): the training step in the lecture's order, nothing else in it
  4. main(): the data, a resume, then the loop: a train_step, then the logging and saving

The configuration (every flag, the presets) is configurator.py.

One process (CPU or one GPU):
    python train.py                                   # the CPU demo preset, fp32
    python train.py --config config/shakespeare_char.py --bf16
Several processes on one machine (one per GPU; on a CPU, gloo processes):
    torchrun --nproc_per_node=4 train.py --zero 2 --bf16
Several machines (run on each node, node_rank 0..nnodes-1):
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST \
        --master_port=29500 train.py --config config/gpt2_124m.py --zero 2 --bf16
"""
import contextlib
import math
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import checkpoint
import optim
from configurator import SCHEDULE, UserError, TrainConfig, grad_accum_for, parse_args
from data.loader import Batches, changed_data, data_identity, estimate_loss, load_data
from lora import apply_lora
from machinery import lifecycle, report  # the run's guards; its numbers, measured
from model import GPT
from precision import DTYPES, GradScaler, grad_zero_frac, resolve_dtype, set_tf32
from quant import quantize_base
from zero import ZeRO
from zero3 import ZeRO3


def init_distributed(cfg):
    """RANK set (torchrun) -> one process per device: nccl on CUDA, gloo on CPU.
    Returns (rank, world_size, device)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible: use --device cpu",
                        rank_local=True)
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise UserError(f"rank {rank} wants cuda:{local_rank}, but "
                        f"{torch.cuda.device_count()} GPU(s) are visible: one process "
                        "per GPU, or --device cpu", rank_local=True)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        set_tf32()  # fp32 matmuls on tensor cores (16-bit runs: the fp32 ones left)
        prefer_cudnn_attention(cfg.cudnn_attention, device)  # SDPA's kernel order
    if "RANK" in os.environ:
        backend = "nccl" if use_cuda else "gloo"
        # every collective may wait --collective-timeout, then names the hang (docs/debugging.md)
        lifecycle.hangs.install(cfg.collective_timeout, backend, cfg.out_dir)
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    return rank, world_size, device


# sdpa_kernel's context, held open for the process: left (or garbage-collected), it would
# restore the order it found
KERNEL_ORDER = contextlib.ExitStack()


def prefer_cudnn_attention(on, device):
    """SDPA's kernel order for this process on a GPU: cuDNN's attention first where PyTorch
    trusts it, else FlashAttention-2 first. cuDNN's is reported 1.7-2.3x faster on Hopper
    for training shapes (transformers#48163); PyTorch made it opt-in after bugs (pytorch#138522)
    and puts it first itself on sm90 / sm100 with cuDNN >= 9.15.1 (sdp_utils.cpp,
    check_prefer_cudnn_attention; torch >= 2.10): the same rule, for torch >= 2.6 (sdpa_kernel's
    set_priority). A no-op on older torch. Returns whether cuDNN's kernel comes first."""
    if torch.__version__ < "2.6":
        return False
    from torch.nn.attention import SDPBackend, sdpa_kernel
    trusted = (torch.cuda.get_device_capability(device) in ((9, 0), (10, 0))
               and (torch.backends.cudnn.version() or 0) >= 91501)
    first = on and trusted
    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    order = [SDPBackend.CUDNN_ATTENTION] + order if first else order + [SDPBackend.CUDNN_ATTENTION]
    KERNEL_ORDER.enter_context(sdpa_kernel(order, set_priority=True))
    return first


def get_lr(it, cfg):
    if it < cfg.warmup_iters:  # linear warmup
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


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


# ----------------------------------------------------------------------------------------------
# the training step: the lecture, in its order

def train_step(model, zero, scaler, cfg, next_batch, grad_accum, lr, on_grads=None):
    """One optimizer step on grad_accum micro-batches (next_batch() -> x, y). Nothing in it
    waits for the device. on_grads(grads): called with this rank's fp32 master gradients
    before they are unscaled (the loop measures fp16's underflow there on logged steps).
    Returns (the loss summed over micro-steps, found_inf, the gradient norm, on_grads' value):
    device tensors."""
    loss_sum = torch.zeros((), device=zero.device)
    for micro in range(grad_accum):
        x, y = next_batch()
        _, loss = model(x, y)
        loss = loss / grad_accum  # the gradient of the mean over micro-steps
        loss_sum += loss.detach()
        # backward of the scaled loss; each gradient bucket's collective is launched as
        # soon as the bucket is complete (all-reduce / reduce-scatter, by stage)
        zero.backward(scaler.scale(loss), sync=micro == grad_accum - 1)
    found_inf, grad_norm, measured = update(zero, scaler, lr, cfg.grad_clip, on_grads)
    if cfg.fp8:  # delayed scaling: this step's amaxes (MAX over ranks) join the history
        from beyond import fp8
        fp8.end_step(model)
    return loss_sum, found_inf, grad_norm, measured


def update(zero, scaler, lr, grad_clip, on_grads=None):
    """After backward: the step's second half, the part a loop of its own around ZeRO calls
    after its own backward (the tests do). Returns (found_inf, grad_norm, on_grads' value)."""
    grads = zero.master_grads()  # this rank's gradient slice -> fp32 master gradient
    measured = on_grads(grads) if on_grads else None
    found_inf = scaler.unscale_(grads)  # divide by the loss scale; an inf/NaN anywhere?
    grad_norm = zero.clip_grad_norm_(grad_clip)  # global norm over every rank's slice
    zero.step(lr, found_inf)  # the optimizer on this rank's fp32 slice (skipped on an
    # inf/NaN); the gradient buffers then start the next step from zero
    zero.publish(wait=False)  # fp32 master -> weights (stages 1-2: all-gathers,
    # waited for bucket by bucket in the next forward's pre-hooks: they overlap it)
    scaler.update(found_inf)  # halve the scale after an overflow, grow it after a run
    return found_inf, grad_norm, measured


# ----------------------------------------------------------------------------------------------
# the set-up

def model_config(cfg, vocab_size):
    """The model's config of a run's flags: a GPTConfig (a fork's CONFIG), each field named
    like a flag set by it, vocab_size the data's (a UserError when the shape does not divide)."""
    from machinery.declared import config_of_flags  # a fork's config too (docs/forking.md)
    return config_of_flags(GPT, cfg, vocab_size)


def build(cfg, vocab_size, device, dtype, rank=0, world_size=1, grad_accum=1,
          init_weights=None, init_hf=None):
    """The model and what trains it, each where it must come. Returns (model, zero, scaler).
    init_weights: a state_dict to start from (--init-from a checkpoint of ours); init_hf: a
    Hugging Face GPT-2 folder or file (--init-from gpt2)."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    # 1. the model, in its working dtype: fp32 weights cast to bf16 / fp16. The fp32 values
    #    stay the source the fp32 master is seeded from: a master made from 16-bit weights
    #    would keep only their 16 bits (up to 2^-9 relative lost, for good)
    if init_hf:  # built on the meta device and filled tensor by tensor: no fp32 copy
        from machinery import pretrained
        model = pretrained.load_hf(init_hf, model_config(cfg, vocab_size), device, dtype,
                                   cfg.lora)
        source = pretrained.hf_weights(init_hf)  # the file's, read a tensor at a time
    else:
        from machinery import declared  # what the model declares, or a default
        model = GPT(model_config(cfg, vocab_size))
        declared.check_model(model, cfg)  # it keeps what the flags set on it
        if init_weights is not None:
            try:
                declared.load_weights(model, init_weights)
            except ValueError as e:
                raise UserError(f"--init-from does not fit this model: {e}")
        # an adapter file names its base: the weights before LoRA and quantization
        if cfg.lora:
            from machinery import adapters
            model.base_id = adapters.base_fingerprint(model)
        else:
            model.base_id = None
        source = init_weights if init_weights is not None else model.state_dict()
        model = model.to(device=device, dtype=dtype)
    # 2. LoRA before ZeRO: ZeRO packs what requires grad when it is built, so only the
    #    adapters reach its buffers and the optimizer
    if cfg.lora:
        try:  # the targets are names of the model's own LINEARS
            apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
        except ValueError as e:
            raise UserError(f"--lora-targets {cfg.lora_targets}: {e}")
        if cfg.quantize:  # QLoRA: the frozen base in 4 or 8 bits, under the adapters
            quantize_base(model, cfg.quantize, cfg.double_quant)
    # 3. FP8 after LoRA: the base's product goes FP8, the adapters stay bf16
    if cfg.fp8:
        from beyond import fp8
        try:
            eager = fp8.check_available(device, cfg.compile)  # a warning on a GPU, or None
            fp8.convert(model, cfg.fp8_scaling, cfg.fp8_amax_history)
        except (RuntimeError, ValueError) as e:
            raise UserError(str(e))
        if eager and rank == 0:
            print(eager)
    # 4. activation checkpointing: read by the block loop in every forward
    if cfg.grad_ckpt == "full" and cfg.grad_ckpt_every == 1:
        model.grad_ckpt = True  # model.py's plain version: every block keeps its input
    elif cfg.grad_ckpt != "none":  # selective, or every K-th block
        from beyond.activation_dial import Policy
        model.grad_ckpt = Policy(cfg.grad_ckpt, cfg.grad_ckpt_every)
    if cfg.offload_activations:  # the saved tensors in host memory
        from beyond import offload
        _, note = offload.install_offload(model, device)
        if rank == 0:
            print(note)
    if cfg.chunked_loss:  # the loss head without fp32 logits of the whole batch
        from beyond.chunked_loss import cross_entropy
        model.cross_entropy = cross_entropy
    # 5. compile each block's forward, not the module: ZeRO's hooks run in the module's
    #    __call__, around forward, so they stay outside the compiled code
    if cfg.compile:
        compile_model(model)
    # 6. ZeRO last: it packs the parameters as they now are into its flat buckets
    zero = make_engine(cfg, model, dtype, rank, world_size, grad_accum, source)
    # 7. the loss scaler: dynamic for fp16; bf16 and fp32 need no scale
    auto = "dynamic" if cfg.dtype == "fp16" else "none"
    scale = auto if cfg.loss_scale == "auto" else cfg.loss_scale
    # a fixed scale of 1 is "no scaler", but still finds inf/NaN gradients and skips the step
    fixed = 1.0 if scale == "none" else None if scale == "dynamic" else float(scale)
    scaler = GradScaler(init_scale=fixed or 2.0**16, dynamic=fixed is None,
                        min_scale=cfg.min_loss_scale, device=device)
    torch.manual_seed(cfg.seed + rank)  # dropout: different masks on different ranks
    return model, zero, scaler


def make_engine(cfg, model, dtype, rank, world_size, grad_accum, source=None):
    """ZeRO stages 0-2 (zero.py), 3 (zero3.py), ZeRO++ (beyond/zeropp.py), or for Muon, whose
    matrices must be whole, the same stages dealing them whole (beyond/muon.py); any of them
    with the optimizer in host memory (beyond/offload_optimizer.py)."""
    Engine, extra = (ZeRO3, {"prefetch": cfg.prefetch}) if cfg.zero == 3 else (ZeRO, {})
    muon = cfg.optimizer == "muon"
    if muon:
        from beyond.muon import WholeZeRO, WholeZeRO3, WholeZeROpp
        Engine = WholeZeRO3 if cfg.zero == 3 else WholeZeRO
    node_size = cfg.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % node_size:
        raise UserError(f"--node-size {node_size} does not divide the world size "
                        f"{world_size}")
    if cfg.zeropp:
        from beyond.zeropp import ZeROpp, parse_zeropp
        Engine = WholeZeROpp if muon else ZeROpp
        extra.update(zeropp=parse_zeropp(cfg.zeropp), node_size=node_size,
                     qgz_bits=cfg.qgz_bits)
    if cfg.offload_optimizer != "none":  # the master and the optimizer on the host
        from beyond.offload_optimizer import offload_engine, host_threads
        Engine = offload_engine(Engine, delayed=cfg.offload_optimizer == "delayed")
        extra.update(overlap=cfg.offload_optimizer != "plain")
        host_threads(model, world_size)
    try:  # a model the engine cannot take (ranks apart, a missing blocks()): one line
        # the GPT policy, given explicitly: --weight-decay on the matrices and embeddings
        zero = Engine(model, cfg.zero, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                      weight_decay=cfg.weight_decay, decay=optim.matrices,
                      bucket_mb=cfg.bucket_mb, rank=rank,
                      world_size=world_size, reduce_dtype=DTYPES.get(cfg.reduce_dtype),
                      fp32_grad_accum=cfg.fp32_grad_accum and grad_accum > 1
                      and dtype != torch.float32, optimizer=cfg.optimizer,
                      master_weights=source, **extra)
    except ValueError as e:
        raise UserError(str(e))
    if cfg.zero == 3:  # bytes by link, beside ZeRO++'s theory (report.py)
        from beyond.zeropp import LinkTraffic
        zero.traffic = LinkTraffic(node_size=node_size)
    return zero


def compile_model(model):
    """torch.compile each block's forward and the loss head (final LayerNorm, LM head,
    loss), where the memory-bound work (LayerNorms, residual adds, GELU, the softmax)
    fuses. A selective checkpoint goes inside the compiled forward (activation_dial.py).
    The blocks share one graph, their weights its inputs: dynamo inlines built-in modules,
    by default from torch 2.5; before, it compiles once per block (torchtitan#508)."""
    if torch.__version__ < "2.5":  # later versions warn that the flag is always on
        torch._dynamo.config.inline_inbuilt_nn_modules = True
    inside = getattr(model.grad_ckpt, "compiled", lambda forward, i: forward)
    for i, block in enumerate(model.blocks()):
        block.forward = torch.compile(inside(block.forward, i))
    model.head = torch.compile(model.head)


# ----------------------------------------------------------------------------------------------

@lifecycle.releasing_locks  # out_dir's lock is released however the run ends
def main(argv=None):
    cfg = fit_schedule(parse_args(argv))
    rank, world_size, device = init_distributed(cfg)
    print0 = print if rank == 0 else (lambda *a, **k: None)
    # before any work: what the flags ask of the model, the memory it needs, then out_dir's
    # lock and history (one run a folder)
    lifecycle.start(cfg, GPT, rank, world_size, device, print0)
    try:  # the working dtype of weights and gradients; bf16 where the device has it natively
        dtype = resolve_dtype(cfg.dtype, device)
    except ValueError as e:
        raise UserError(str(e))
    # --init-from: weights of ours (init) or a Hugging Face GPT-2 (init_hf), whose
    # config.json sets the model flags not given, and the vocabulary the data must be in
    init = init_hf = base_meta = None
    if cfg.init_from:
        from machinery import pretrained
        init, init_hf, base_meta = pretrained.open_init(cfg)
    train, val, meta = load_data(cfg, rank, world_size, base_meta)
    data_id = data_identity(cfg, train, val, meta, world_size)  # the bytes a resume compares
    if init_hf:
        pretrained.check_vocab(meta, base_meta, cfg)
    grad_accum = grad_accum_for(cfg, world_size)  # --batch-tokens: needs the block size
    tokens_per_step = cfg.batch_size * grad_accum * world_size * cfg.block_size
    print0(f"world size {world_size} on {device.type}, {cfg.dtype}, ZeRO stage {cfg.zero}; "
           f"{tokens_per_step:,} tokens per step ({cfg.batch_size} seq x {grad_accum} "
           f"micro-steps x {world_size} ranks x {cfg.block_size} tokens)")
    gptconf = model_config(cfg, meta["vocab_size"])
    # weights of another run (either format), checked against this model; a LoRA run's as
    # it trained are loaded into the built run (pretrained.init_trained)
    weights = init and pretrained.init_weights(init, cfg, checkpoint.model_args(GPT, gptconf),
                                               meta, print0)
    model, zero, scaler = build(cfg, meta["vocab_size"], device, dtype, rank, world_size,
                                grad_accum, weights, init_hf)
    if init and weights is None:  # a LoRA run's checkpoint, taken as it trained
        pretrained.init_trained(init, cfg, zero, model)
    print0(f"model: {report.num_params(model):,} parameters, {zero.psi:,} trainable")

    # resume: read and check everything before touching any file of the run
    start_it, ckpt, note, new_data = resume(cfg, zero, model, scaler, meta, data_id, print0)
    header = {"config": asdict(cfg), "model_args": checkpoint.model_args(model), "meta": meta,
              "base_id": model.base_id,  # what an adapter of this run loads onto
              "data": data_id}  # train.bin's and val.bin's sizes and sha256, the vocabulary
    if start_it >= cfg.max_iters:
        print0(f"the run is already at iteration {start_it} (--max-iters {cfg.max_iters}): "
               "nothing to train; raise --max-iters to go on")
        return lifecycle.finish(model, zero, world_size)
    metrics = lifecycle.Metrics(cfg.out_dir, rank == 0, print0)  # appended to, never truncated
    if ckpt:
        metrics.log({"event": "resume", "from": ckpt, "iter": start_it, "note": note})
    if new_data:  # --accept-new-data: a person can tell this run apart later
        metrics.log(new_data)
    report.start(cfg, model, zero, metrics, print0)  # model state measured vs the paper's
    if cfg.nan_at >= 0:  # the lesson in skipped steps: one rank's loss goes NaN
        lifecycle.inject_nan(model, cfg.nan_at, rank, world_size, grad_accum, start_it)
    lifecycle.hangs.watch(model, cfg, rank, world_size, grad_accum, start_it)  # step; --hang-at
    stop = lifecycle.stop_on_signals()  # SIGTERM / Ctrl-C: finish the step, save, exit
    log = report.StepLog(cfg, model, zero, scaler, metrics, print0, grad_accum, start_it)
    batches = Batches(train, cfg, rank, world_size, grad_accum, device, start_it)
    tracer = None
    if cfg.trace:  # a timeline of a few steps (docs/debugging.md)
        from machinery import timeline
        tracer = timeline.Tracer(cfg, model, rank, device, metrics, print0, start_it)

    it, stopped = start_it, False
    while True:
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            t0 = time.time()
            print0(f"step {it}: evaluating on {cfg.eval_iters} batches of each split ...")
            losses = estimate_loss(model, train, val, cfg, rank, world_size, device)
            print0(f"step {it}: train loss {losses['train']:.4f}, "
                   f"val loss {losses['val']:.4f}")
            metrics.log({"iter": it, "train_loss": losses["train"], "val_loss": losses["val"]})
            log.pause(time.time() - t0)
        if it == cfg.max_iters:
            break
        lr = get_lr(it, cfg)
        logging = it % cfg.log_interval == 0 or it == cfg.max_iters - 1
        log.new_step()  # count this step's collectives
        if cfg.fp8:  # count the casts' underflow and saturation on logged steps
            from beyond import fp8
            fp8.measure(model, logging)

        if tracer:
            tracer.begin(it)
        # ---- the training step (above): the lecture, in its order --------------------------
        loss_sum, found_inf, grad_norm, zero_frac = train_step(
            model, zero, scaler, cfg, batches.next, grad_accum, lr,
            grad_zero_frac if logging else None)  # fp16 underflow: zeros, on logged steps
        # ---- everything after this is logging and saving -----------------------------------
        if tracer:
            tracer.end(it)

        if logging:  # the only steps that wait for the device
            log.log(it, lr, loss_sum, found_inf, grad_norm, zero_frac)
            stopped = lifecycle.agree(stop["signal"] is not None, device, world_size)
        it += 1
        saving = cfg.save_interval and it % cfg.save_interval == 0 and it < cfg.max_iters
        if (logging or saving) and scaler.exhausted.item():
            raise UserError(lifecycle.exhausted(cfg, scaler, it))
        if saving or stopped:
            save(cfg, it, zero, model, scaler, header, print0)
        if stopped:
            print0(f"stopped by a signal after iteration {it}: resume with --resume")
            break
    report.check_replicas(zero, model, metrics, it, print0)
    if not stopped:  # the final checkpoint (a signal's was just written)
        save(cfg, it, zero, model, scaler, header, print0)
    if cfg.lora:  # the adapter alone: kilobytes
        from machinery import adapters
        adapters.save_run_adapter(cfg.out_dir, zero, model, meta, print0)
    lifecycle.finish(model, zero, world_size)  # out_dir's lock released, the ranks leave together


def resume(cfg, zero, model, scaler, meta, data_id, print0):
    """--resume: rank 0's newest checkpoint, for every rank (each listing its own disk could
    differ), restored exactly (checkpoint.restore), its schedule kept, on the data it trained
    on (or --accept-new-data). Returns (the iteration to go on from, the checkpoint or None, a
    note or None, the metrics row of accepted new data or None)."""
    path = checkpoint.newest_checkpoint(cfg.out_dir, zero.world_size) if cfg.resume else None
    if not path:
        if cfg.resume:
            print0(f"--resume: no checkpoint in {cfg.out_dir} yet, starting fresh")
        return 0, None, None, None
    start_it, note, saved = checkpoint.restore(path, zero, model, scaler, asdict(cfg),
                                               checkpoint.model_args(model), meta)
    # the batch of step t is the run's only on the bytes it trained on: every rank compares
    # the files it reads with the header's (a checkpoint older than that has none)
    changed, new_data = changed_data(saved.get("data"), data_id, path, zero.world_size), None
    if changed and not cfg.accept_new_data:
        raise UserError(f"--resume: {changed}; the batches from here on would not be the "
                        "run's: prepare the data it trained on again, or pass "
                        "--accept-new-data to go on with this data (recorded in metrics.jsonl)")
    if changed:
        new_data = {"event": "new_data", "iter": start_it, "from": path, "change": changed,
                    "data": data_id}
        note = "; ".join(n for n in (note, f"{changed} (--accept-new-data)") if n)
    # the saved run's learning-rate schedule, unless a schedule flag is given
    note = "; ".join(n for n in (note, keep_schedule(cfg, saved["config"])) if n)
    print0(f"resumed from {path} at iteration {start_it}; {note}")
    return start_it, path, note, new_data


def save(cfg, it, zero, model, scaler, header, print0):
    zero.wait_published()  # the weights of the last step, not a gather still on its way
    if cfg.fp8:  # the amax histories
        from beyond import fp8
        header = dict(header, fp8=fp8.state_dict(model))
    path = checkpoint.save(cfg.out_dir, it, zero, model, scaler, header, cfg.ckpt_format,
                           cfg.keep_last)
    print0(f"saved {path}")


if __name__ == "__main__":
    lifecycle.run_main(main, "train.py", UserError)
