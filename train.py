"""
Train a GPT with our own data parallelism / ZeRO and mixed precision.

Read it top to bottom, as nanoGPT's train.py:
  1. distributed init: one process per GPU (or gloo processes on a CPU)
  2. get_lr(): the learning-rate schedule
  3. train_step(): the training step in the lecture's order, nothing else in it
  4. build(): the model, LoRA, ZeRO and the loss scaler, each where it must come
  5. main(): the data, the model, then the loop: evaluate, a train_step, log and save

What a run does besides training (the checks before any work, --init-from, a resume, the console
and metrics.jsonl, signals, saves) is machinery/run.py's Run, which the loop calls a few times;
which engine class the flags ask for, machinery/engines.py's make_engine. The flags and presets
are configurator.py.

One process (CPU or one GPU):
    python train.py                                   # the CPU demo preset, fp32
    python train.py --config config/shakespeare_char.py --bf16
Several processes on one machine (one per GPU; on a CPU, gloo processes):
    torchrun --nproc_per_node=4 train.py --zero 2 --bf16
Several machines (run on each node, node_rank 0..nnodes-1):
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST \
        --master_port=29500 train.py --config config/gpt2_124m.py --zero 2 --bf16
"""
import math
import os
from dataclasses import fields

import torch
import torch.distributed as dist

from configurator import grad_accum_for, parse_args
from data.loader import Batches, estimate_loss
from lora import apply_lora
from machinery import engines  # which engine the flags ask for (guarded: any loop may drive it)
from machinery.run import Run, command, releasing_locks  # the run's side work
from model import GPT, GPTConfig
from precision import GradScaler, resolve_dtype, set_tf32
from quant import quantize_base


def init_distributed(cfg):
    """RANK set (torchrun) -> one process per device: nccl on CUDA, gloo on CPU.
    Returns (rank, world_size, device)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        set_tf32()  # fp32 matmuls on tensor cores (16-bit runs: the fp32 ones left)
    if "RANK" in os.environ:  # device_id: NCCL makes its communicator now, on this GPU
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                device_id=device if use_cuda else None)
    return rank, world_size, device


def get_lr(it, cfg):
    if it < cfg.warmup_iters:  # linear warmup
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


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
    """The model's config from the flags: each field named like a flag takes its value (a fork's
    CONFIG too, docs/forking.md), vocab_size the data's, arch the model's."""
    Config = getattr(GPT, "CONFIG", None) or GPTConfig
    names = {f.name for f in fields(Config)}
    values = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
    values.update(vocab_size=vocab_size, **({"arch": GPT.ARCH} if "arch" in names else {}))
    return Config(**values)


def build(cfg, vocab_size, device, dtype, rank=0, world_size=1, grad_accum=1, init=None):
    """The model and what trains it, each where it must come. Returns (model, zero, scaler).
    init(config, device, dtype) -> (model, source): where the model starts (machinery/run.py's:
    --init-from's weights, checked); by default new weights."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    # 1. the model, in its working dtype: fp32 weights cast to bf16 / fp16. The fp32 values
    #    stay the source the fp32 master is seeded from: a master made from 16-bit weights
    #    would keep only their 16 bits (up to 2^-9 relative lost, for good)
    if init is None:
        model = GPT(model_config(cfg, vocab_size))
        source = model.state_dict()
        model = model.to(device=device, dtype=dtype)
    else:
        model, source = init(model_config(cfg, vocab_size), device, dtype)
    # 2. LoRA before ZeRO: ZeRO packs what requires grad when it is built, so only the
    #    adapters reach its buffers and the optimizer
    if cfg.lora:  # --lora-targets: all, or names of the LINEARS' slices (checked before any work)
        every = [t for _, names in model.LINEARS for t in names]
        targets = every if cfg.lora_targets == "all" else \
            [t.strip() for t in cfg.lora_targets.split(",")]
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, targets)
        if cfg.quantize:  # QLoRA: the frozen base in 4 or 8 bits, under the adapters
            quantize_base(model, cfg.quantize, cfg.double_quant)
    # 3. FP8 after LoRA: the base's product goes FP8, the adapters stay bf16
    if cfg.fp8:
        from beyond import fp8
        fp8.convert(model, cfg.fp8_scaling, cfg.fp8_amax_history)
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
    zero = engines.make_engine(cfg, model, dtype, rank, world_size, grad_accum, source)
    # 7. the loss scaler: dynamic for fp16; bf16 and fp32 need no scale
    auto = "dynamic" if cfg.dtype == "fp16" else "none"
    scale = auto if cfg.loss_scale == "auto" else cfg.loss_scale
    # a fixed scale of 1 is "no scaler", but still finds inf/NaN gradients and skips the step
    fixed = 1.0 if scale == "none" else None if scale == "dynamic" else float(scale)
    scaler = GradScaler(init_scale=fixed or 2.0**16, dynamic=fixed is None,
                        min_scale=cfg.min_loss_scale, device=device)
    torch.manual_seed(cfg.seed + rank)  # dropout: different masks on different ranks
    return model, zero, scaler


def compile_model(model):
    """torch.compile each block's forward and the loss head (final LayerNorm, LM head,
    loss), where the memory-bound work (LayerNorms, residual adds, GELU, the softmax)
    fuses. A selective checkpoint goes inside the compiled forward (activation_dial.py).
    The blocks share one graph, their weights its inputs (dynamo inlines built-in modules)."""
    inside = getattr(model.grad_ckpt, "compiled", lambda forward, i: forward)
    for i, block in enumerate(model.blocks()):
        block.forward = torch.compile(inside(block.forward, i))
    model.head = torch.compile(model.head)


# ----------------------------------------------------------------------------------------------

@releasing_locks  # out_dir's lock is released however the run ends
def main(argv=None):
    run = Run(parse_args(argv), GPT)  # before any work: the flags checked (machinery/run.py)
    cfg = run.cfg
    rank, world_size, device = init_distributed(cfg)
    train, val, meta = run.start(rank, world_size, device)  # the run folder, the data
    dtype = resolve_dtype(cfg.dtype, device)  # weights and gradients; bf16 where native
    grad_accum = grad_accum_for(cfg, world_size)  # micro-steps: --batch-tokens, if given
    model, zero, scaler = build(cfg, meta["vocab_size"], device, dtype, rank, world_size,
                                grad_accum, run.init)
    it = run.resume(model, zero, scaler, grad_accum)  # a checkpoint restored; start-up table
    batches = Batches(train, cfg, rank, world_size, grad_accum, device, it)
    while not run.stopped:
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            run.evaluate(it, lambda: estimate_loss(model, train, val, cfg, rank, world_size,
                                                   device))
        if it == cfg.max_iters:
            break
        lr = get_lr(it, cfg)
        on_grads = run.begin_step(it)  # on logged steps: fp16's underflow, measured
        # ---- the training step (above): the lecture, in its order --------------------------
        loss_sum, found_inf, grad_norm, measured = train_step(
            model, zero, scaler, cfg, batches.next, grad_accum, lr, on_grads)
        it += 1
        run.end_step(it, lr, loss_sum, found_inf, grad_norm, measured)  # log, save, a signal
    run.finish()  # the last checkpoint, the adapter; the ranks leave together


if __name__ == "__main__":
    command(main)
