"""
Train a GPT with our own data parallelism / ZeRO and mixed precision. Read top to bottom:
config, distributed init, data, model, ZeRO wrap + optimizer, loss scaler, the loop, saving.

One process (CPU or one GPU):
    python train.py                                   # the CPU demo preset, fp32
    python train.py --config config/shakespeare_char.py --bf16
Several processes on one machine (one per GPU; on a CPU, gloo processes):
    torchrun --nproc_per_node=4 train.py --zero 2 --bf16
Several machines (run on each node, node_rank 0..nnodes-1):
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST --master_port=29500 \
        train.py --config config/gpt2_124m.py --zero 2 --bf16
"""
import ast
import gc
import hashlib
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
from checkpoint import CheckpointError, Reader, check_compatible, list_checkpoints, restore
from lora import adapter_state, apply_lora, base_fingerprint, parse_targets, quantize_base, save_adapter
from model import GPT, GPTConfig, peak_flops_for
from precision import GradScaler, resolve_dtype
from zero import ZeRO, traffic_formula, zero_formula

ROOT = os.path.dirname(os.path.abspath(__file__))


class ConfigError(Exception):
    """Bad input from the user: printed as one line, never a traceback."""


def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = opt("out", "where metrics.jsonl and ckpt.pt go")
    dataset: str = opt("shakespeare_char", "a folder under --data-root made by data/prepare.py")
    data_root: str = opt("data", "where the prepared data sets live (relative to this file)")
    eval_interval: int = opt(250, "evaluate train/val loss every this many steps")
    eval_iters: int = opt(20, "batches per loss estimate")
    log_interval: int = opt(10, "print and log every this many steps")
    save_interval: int = opt(0, "save a checkpoint every this many steps (and always at the end); 0 = end only")
    ckpt_format: str = opt("consolidated", "consolidated (one file, gathered on rank 0) | sharded (a file per rank)")
    keep_last: int = opt(2, "keep the newest K checkpoints in out_dir")
    resume: bool = opt(False, "carry on from the newest checkpoint in out_dir (start fresh if there is none)")
    init_from: str = opt("", "start from this checkpoint's weights, e.g. to fine-tune (--resume wins once the run has its own)")
    input: str = opt("", "train on this UTF-8 text file (prepared into data/<its name>, in --init-from's vocabulary)")
    # LoRA (Hu et al. 2021) and a quantized frozen base (Dettmers et al. 2023, QLoRA): lora.py
    lora: bool = opt(False, "freeze the model and train low-rank adapters B·A only")
    lora_rank: int = opt(8, "r, the adapters' rank")
    lora_alpha: float = opt(1.0, "alpha; the update is scaled by alpha / r")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input")
    lora_targets: str = opt("q,v", "which projections to adapt: q,k,v,attn_out,mlp_fc,mlp_proj or all")
    quantize: str = opt("", "int8 | nf4: store the frozen base Linear weights quantized (needs --lora)")
    double_quant: bool = opt(False, "nf4: quantize the block scales too (QLoRA's double quantization)")
    # model (nanoGPT's CPU shakespeare_char recipe by default)
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads")
    n_embd: int = opt(128, "residual width; must divide by n_head")
    block_size: int = opt(64, "context length in tokens")
    dropout: float = opt(0.0, "dropout probability")
    bias: bool = opt(False, "biases in Linear and LayerNorm layers")
    # batch: one optimizer step sees batch_size * grad_accum * world_size sequences
    batch_size: int = opt(12, "micro-batch per rank (sequences)")
    grad_accum: int = opt(1, "micro-steps per rank per optimizer step")
    # AdamW and its schedule: linear warmup, cosine decay to min_lr
    learning_rate: float = opt(1e-3, "peak learning rate")
    max_iters: int = opt(2000, "optimizer steps")
    weight_decay: float = opt(0.1, "decoupled weight decay on 2-D weights")
    beta1: float = opt(0.9, "Adam beta1")
    beta2: float = opt(0.99, "Adam beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = off")
    warmup_iters: int = opt(100, "linear warmup steps")
    lr_decay_iters: int = opt(2000, "steps of cosine decay (usually = max_iters)")
    min_lr: float = opt(1e-4, "learning rate at the end of the decay")
    # system
    device: str = opt("auto", "auto | cpu | cuda")
    dtype: str = opt("fp32", "fp32 | bf16 | fp16 (the working precision of weights and gradients)")
    loss_scale: str = opt("auto", "dynamic | none | VALUE; auto = dynamic for fp16, none otherwise")
    zero: int = opt(0, "ZeRO stage: 0 data parallel, 1 shard optimizer, 2 +gradients, 3 +parameters")
    prefetch: bool = opt(True, "ZeRO-3: gather the next unit while this one computes")
    grad_ckpt: bool = opt(False, "activation checkpointing: recompute each block in backward")
    bucket_mb: float = opt(25.0, "gradient bucket size in MiB for overlapped communication")
    peak_tflops: float = opt(0.0, "peak TFLOP/s per device for MFU; 0 = look the GPU up")
    seed: int = opt(1337, "the batch at step t depends only on (seed, t)")
    nan_at: int = opt(-1, "a lesson in skipped steps: make the last rank's loss NaN at this step")


# ----------------------------------------------------------------------------------------------
# config: dataclass defaults < preset file (--config) < explicit flags

def load_preset(path):
    """A preset is a file of plain `name = literal` lines; parsed, never executed."""
    for cand in (path, path + ".py", os.path.join(ROOT, "config", path), os.path.join(ROOT, "config", path + ".py")):
        if os.path.isfile(cand):
            path = cand
            break
    else:
        raise ConfigError(f"no preset {path!r}: see the files in config/")
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    with open(path) as f:
        source = f.read()
    for node in ast.parse(source, path).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ConfigError(f"{path}:{node.lineno}: presets hold only `name = value` lines")
        name = node.targets[0].id
        if name not in known:
            raise ConfigError(f"{path}:{node.lineno}: unknown setting {name!r}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise ConfigError(f"{path}:{node.lineno}: {name} must be a literal value")
        ftype = known[name].type
        if ftype is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not ftype:
            raise ConfigError(f"{path}:{node.lineno}: {name} must be {ftype.__name__}, got {value!r}")
        out[name] = value
    return out


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Train a GPT with nanoZeRO.", allow_abbrev=False)
    p.error = lambda msg: (_ for _ in ()).throw(ConfigError(msg))  # one line, no usage dump
    p.add_argument("--config", help="a preset from config/, e.g. config/shakespeare_char.py")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"])
        else:
            p.add_argument(flag, type=f.type, default=None, metavar=f.type.__name__.upper(), help=f.metadata["help"])
    p.add_argument("--bf16", action="store_true", help="shortcut for --dtype bf16")
    p.add_argument("--fp16", action="store_true", help="shortcut for --dtype fp16")
    args = p.parse_args(argv)
    values = load_preset(args.config) if args.config else {}
    values.update({k: v for k, v in vars(args).items() if v is not None and k in TrainConfig.__dataclass_fields__})
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 conflict: pick one")
    for short in ("bf16", "fp16"):
        if getattr(args, short):
            if args.dtype not in (None, short):
                raise ConfigError(f"--{short} conflicts with --dtype {args.dtype}: pick one")
            values["dtype"] = short
    cfg = TrainConfig(**values)
    check_config(cfg)
    return cfg


def check_config(cfg):
    if cfg.dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"--dtype {cfg.dtype}: use fp32, bf16 or fp16")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {cfg.device}: use auto, cpu or cuda")
    if cfg.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero {cfg.zero}: use 0, 1, 2 or 3")
    if cfg.loss_scale not in ("auto", "dynamic", "none"):
        try:
            if float(cfg.loss_scale) <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--loss-scale {cfg.loss_scale}: use dynamic, none or a positive number")
    for name in ("batch_size", "grad_accum", "max_iters", "eval_interval", "eval_iters", "log_interval"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.bucket_mb <= 0:
        raise ConfigError("--bucket-mb must be positive")
    if cfg.ckpt_format not in ("consolidated", "sharded"):
        raise ConfigError(f"--ckpt-format {cfg.ckpt_format}: use consolidated or sharded")
    if cfg.quantize not in ("", "int8", "nf4"):
        raise ConfigError(f"--quantize {cfg.quantize}: use int8 or nf4")
    if (cfg.quantize or cfg.double_quant) and not cfg.lora:
        raise ConfigError("--quantize stores a frozen base: it needs --lora")
    if cfg.double_quant and cfg.quantize != "nf4":
        raise ConfigError("--double-quant quantizes nf4's block scales: it needs --quantize nf4")
    if cfg.lora:
        try:
            parse_targets(cfg.lora_targets)
        except ValueError as e:
            raise ConfigError(str(e))
        if cfg.lora_rank < 1:
            raise ConfigError("--lora-rank must be at least 1")
    if cfg.save_interval < 0 or cfg.keep_last < 1:
        raise ConfigError("--save-interval must be >= 0 and --keep-last >= 1")


# ----------------------------------------------------------------------------------------------
# data: the global batch of step t is a function of (seed, t) alone; rank r of N takes its slice,
# so N ranks see exactly the batches of one rank with an N-times larger micro-batch

def get_batch(data, seed, step, micro, rank, world_size, batch_size, block_size, grad_accum):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ix = torch.randint(len(data) - block_size, (grad_accum * world_size * batch_size,), generator=g)
    start = (micro * world_size + rank) * batch_size  # micro-step-major, then rank
    ix = ix[start:start + batch_size].tolist()
    xy = torch.from_numpy(np.stack([data[i:i + block_size + 1] for i in ix]).astype(np.int64))
    return xy[:, :-1], xy[:, 1:]  # inputs, next-token targets: (B, T) each


def load_data(cfg, rank, world_size, base_meta=None):
    """Memory-map train.bin / val.bin, preparing the data set first if it is missing (the
    built-in ones, or --input FILE in base_meta's vocabulary; rank 0 prepares, the others wait)."""
    from data.prepare import DATASETS, DataError, load_meta, prepare
    if cfg.input:
        cfg.dataset = os.path.splitext(os.path.basename(cfg.input))[0]
    data_dir = os.path.join(ROOT, cfg.data_root, cfg.dataset)  # an absolute data_root wins
    missing = not os.path.isfile(os.path.join(data_dir, "val.bin"))
    if missing and not cfg.input and cfg.dataset not in DATASETS:  # the ones prepare.py builds
        raise ConfigError(f"no prepared data in {data_dir}: run `python data/prepare.py --input FILE --name {cfg.dataset}`")
    if (missing or cfg.input) and rank == 0:
        try:
            prepare(dataset="shakespeare_char" if cfg.input else cfg.dataset, input_path=cfg.input or None,
                    out_root=os.path.join(ROOT, cfg.data_root), base_meta=base_meta)
        except DataError as e:
            raise ConfigError(str(e))
    if world_size > 1:
        dist.barrier()
    if not os.path.isfile(os.path.join(data_dir, "val.bin")):
        raise ConfigError(f"no prepared data in {data_dir}: run `python data/prepare.py --dataset {cfg.dataset}`")
    meta = load_meta(data_dir)
    train = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")
    if min(len(train), len(val)) <= cfg.block_size + 1:
        raise ConfigError(f"{data_dir} has too few tokens for --block-size {cfg.block_size}")
    return train, val, meta


def get_lr(it, cfg):
    if it < cfg.warmup_iters:  # linear warmup
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(model, train, val, cfg, rank, world_size, device):
    """Mean loss over eval_iters fixed batches per split; rank r takes batches r, r+N, ...
    so the estimate is the same on any world size. Every rank runs the same number of forwards
    (a spare one is not counted): under ZeRO-3 each forward is a series of collectives."""
    model.eval()
    out = {}
    for si, (split, data) in enumerate((("train", train), ("val", val))):
        total = torch.zeros(2, dtype=torch.float64, device=device)  # nccl reduces device tensors only
        for k in range(rank, math.ceil(cfg.eval_iters / world_size) * world_size, world_size):
            x, y = get_batch(data, cfg.seed + 7919 * (si + 1), k, 0, 0, 1, cfg.batch_size, cfg.block_size, 1)
            _, loss = model(x.to(device), y.to(device))
            if k < cfg.eval_iters:
                total += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
        if world_size > 1:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


@contextmanager
def saved_activation_bytes(model, out):
    """Adds to out[0] the bytes autograd keeps for backward during the enclosed forward: every
    saved tensor's storage once, weights left out. Under activation checkpointing autograd
    saves almost nothing inside a block; what the checkpoint keeps is the block's input, which
    the pre-hooks count. Exact on any device: it counts tensors, not allocator pages."""
    seen = set()

    def count(t):
        ptr = t.untyped_storage().data_ptr()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        if ptr not in seen and ptr not in weights:
            seen.add(ptr)
            out[0] += t.untyped_storage().nbytes()

    def pack(t):
        count(t)
        return t

    hooks = [b.register_forward_pre_hook(lambda m, a: count(a[0])) for b in model.transformer.h] \
        if model.grad_ckpt else []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield
    for h in hooks:
        h.remove()


# ----------------------------------------------------------------------------------------------

def main(argv=None):
    cfg = parse_args(argv)

    # distributed init: RANK set (torchrun) -> one process per device; nccl on CUDA, gloo on CPU
    distributed = "RANK" in os.environ
    rank, world_size, local_rank = 0, 1, 0
    if distributed:
        rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    master = rank == 0
    print0 = print if master else (lambda *a, **k: None)
    try:
        dtype = resolve_dtype(cfg.dtype, device)
    except ValueError as e:
        raise ConfigError(str(e))
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (reseeded per rank below)
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    init = Reader(cfg.init_from) if cfg.init_from else None
    train, val, meta = load_data(cfg, rank, world_size, base_meta=init.header["meta"] if init else None)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * world_size * cfg.block_size
    print0(f"world size {world_size} on {device.type} ({'nccl' if use_cuda else 'gloo'} if distributed), "
           f"{cfg.dtype}, ZeRO stage {cfg.zero}; {tokens_per_step:,} tokens per step "
           f"({cfg.batch_size} seq x {cfg.grad_accum} micro-steps x {world_size} ranks x {cfg.block_size} tokens)")

    try:
        gptconf = GPTConfig(block_size=cfg.block_size, vocab_size=meta["vocab_size"], n_layer=cfg.n_layer,
                            n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)
    except ValueError as e:
        raise ConfigError(str(e))
    model = GPT(gptconf)
    if init:  # weights of another run (either checkpoint format), checked against this model
        check_compatible(init.header, asdict(gptconf), meta, cfg.init_from)
        model.load_state_dict(init.weights())
        print0(f"initialised from {cfg.init_from} (iteration {init.header['iter']})")
    model = model.to(device=device, dtype=dtype)  # 16-bit working weights in bf16 / fp16
    model.grad_ckpt = cfg.grad_ckpt
    if cfg.lora:  # freeze the base, add adapters: only they reach ZeRO's buffers and the optimizer
        base_id = base_fingerprint(init.weights() if init else model)  # what an adapter file checks
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, parse_targets(cfg.lora_targets))
        if cfg.quantize:
            quantize_base(model, cfg.quantize, cfg.double_quant)
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_all = n_train + sum(p.numel() for p in model.parameters() if not p.requires_grad)
        print0(f"LoRA r={cfg.lora_rank} on {cfg.lora_targets}: {n_train:,} trainable of {n_all:,} parameters "
               f"({100 * n_train / n_all:.2f}%)" + (f", base in {cfg.quantize}" if cfg.quantize else ""))
    torch.manual_seed(cfg.seed + rank)  # dropout: different masks on different ranks
    print0(f"model: {model.num_params(non_embedding=False):,} parameters (tied embedding counted once)")

    zero = ZeRO(model, cfg.zero, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                weight_decay=cfg.weight_decay, bucket_mb=cfg.bucket_mb, rank=rank, world_size=world_size,
                prefetch=cfg.prefetch)
    scale = {"auto": "dynamic" if cfg.dtype == "fp16" else "none"}.get(cfg.loss_scale, cfg.loss_scale)
    # a fixed scale of 1 is "no scaler", but still finds inf/NaN gradients and skips the step
    scaler = GradScaler(dynamic=True) if scale == "dynamic" else \
        GradScaler(init_scale=1.0 if scale == "none" else float(scale), dynamic=False)

    start_it = 0
    if cfg.resume:  # read everything before touching any file of the run
        ckpts = list_checkpoints(cfg.out_dir)
        if ckpts:
            start_it = restore(ckpts[-1], zero, model, scaler, asdict(gptconf), meta, rank, world_size)
            print0(f"resumed from {ckpts[-1]} at iteration {start_it}")
        else:
            print0(f"--resume: no checkpoint in {cfg.out_dir} yet, starting fresh")
    header = {"config": asdict(cfg), "model_args": asdict(gptconf), "meta": meta}

    # a preemption (SIGTERM) or Ctrl-C (SIGINT) asks every rank to finish its step, save and exit
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.update(signal=signum))

    # what we hold vs what the ZeRO paper predicts, per rank
    held = zero.state_bytes()
    formula = zero_formula(zero.psi, cfg.zero, world_size, dtype)
    per_rank = [None] * world_size
    if distributed:
        dist.all_gather_object(per_rank, held)
    else:
        per_rank = [held]
    metrics = None
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        # on resume keep the rows before the checkpoint: the steps after it are about to be redone
        kept = [line for line in open(path) if json.loads(line).get("iter", -1) < start_it] \
            if start_it and os.path.exists(path) else []
        metrics = open(path, "w")
        metrics.writelines(kept)

    def log(row):
        if master:  # NaN / inf become null: metrics.jsonl stays valid JSON for every reader
            row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    mb = lambda b: f"{b / 2**20:8.2f} MiB"
    print0(f"model state per rank, Ψ = {zero.psi:,} trainable parameters "
           f"(measured | ZeRO paper): params {mb(held['params'])} | {mb(formula['params'])}, "
           f"grads {mb(held['grads'])} | {mb(formula['grads'])}, master+Adam "
           f"{mb(held['master'] + held['optimizer'])} | {mb(formula['optimizer_side'])}, "
           f"total {mb(held['total'])} | {mb(formula['total'])}")
    log({"event": "model_state", "psi": zero.psi, "stage": cfg.zero, "world_size": world_size,
         "dtype": cfg.dtype, "per_rank": per_rank, "formula": formula, "config": asdict(cfg)})

    peak = cfg.peak_tflops * 1e12 if cfg.peak_tflops else (
        peak_flops_for(torch.cuda.get_device_name(device)) if use_cuda else None)
    running_mfu, t_last, it, stopped = None, time.time(), start_it, False
    while True:
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            losses = estimate_loss(model, train, val, cfg, rank, world_size, device)
            print0(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            log({"iter": it, "train_loss": losses["train"], "val_loss": losses["val"]})
            t_last = time.time()  # evaluation time is not step time
        if it == cfg.max_iters:
            break

        lr = get_lr(it, cfg)
        logging = it % cfg.log_interval == 0 or it == cfg.max_iters - 1
        zero.traffic = {k: 0 for k in zero.traffic}  # count this step's collectives
        loss_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            x, y = get_batch(train, cfg.seed, it, micro, rank, world_size, cfg.batch_size, cfg.block_size, cfg.grad_accum)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            act = [0]  # activation bytes, measured on the first micro-step of the run
            with saved_activation_bytes(model, act) if it == 0 and micro == 0 else nullcontext():
                _, loss = model(x, y)
            if it == 0 and micro == 0:
                print0(f"activations saved for backward: {act[0] / 2**20:.2f} MiB per micro-step"
                       f"{' (with --grad-ckpt)' if cfg.grad_ckpt else ''}")
                log({"event": "activations", "saved_bytes": act[0], "grad_ckpt": cfg.grad_ckpt})
            loss = loss / cfg.grad_accum  # the gradient of the mean over micro-steps
            if it == cfg.nan_at and rank == world_size - 1:
                loss = loss * float("nan")  # only this rank's gradients go bad: every rank must skip
            loss_sum += loss.detach()
            zero.backward(scaler.scale(loss), sync=micro == cfg.grad_accum - 1)
        stats = zero.step(lr, scaler, cfg.grad_clip, want_zero_frac=logging)
        if stats["skipped"]:
            # loud in every dtype: a run whose steps are all skipped looks healthy while no
            # weight changes. The step still counts: iteration and LR schedule advance.
            print0(f"step {it}: inf/NaN gradient, update skipped (loss scale now {scaler.get_scale():g})")

        if logging:
            if world_size > 1:
                dist.all_reduce(loss_sum)  # the loss of the whole global batch
                loss_sum /= world_size
            lossf = loss_sum.item()  # .item() waits for the device: only on logged steps
            dt = time.time() - t_last
            tps = tokens_per_step / dt
            mfu = model.estimate_mfu(tps / world_size, peak)
            if mfu is not None:
                running_mfu = mfu if running_mfu is None else 0.9 * running_mfu + 0.1 * mfu
            print0(f"iter {it}: loss {lossf:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, {tps:,.0f} tok/s"
                   + (f", mfu {running_mfu * 100:.2f}%" if running_mfu is not None else ""))
            log({"iter": it, "loss": lossf, "lr": lr, "ms": dt * 1000, "tokens_per_sec": tps,
                 "mfu": running_mfu, "loss_scale": scaler.get_scale(), "skipped": stats["skipped"],
                 "cuda_max_mem": torch.cuda.max_memory_allocated(device) if use_cuda else None,
                 "grad_norm": stats["grad_norm"], "grad_zero_frac": stats["grad_zero_frac"],
                 "comm_elements": sum(zero.traffic[k] for k in ("all_reduce", "reduce_scatter", "all_gather")),
                 "comm_bytes": zero.traffic["bytes"], "comm_theory_elements": traffic_formula(zero.psi, cfg.zero, world_size, cfg.grad_accum,
                                                         zero.frozen_numel)})
        it += 1
        # every rank must agree to stop at the same step: one tiny all-reduce of the signal flag
        flag = torch.tensor([stop["signal"] is not None], dtype=torch.float32, device=device)
        if distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stopped = bool(flag.item())
        if (cfg.save_interval and it % cfg.save_interval == 0 and it < cfg.max_iters) or stopped:
            path = checkpoint.save(cfg.out_dir, it, zero, model, scaler, header, cfg.ckpt_format, cfg.keep_last,
                                   rank, world_size)
            print0(f"saved {path}")
        if stopped:
            print0(f"stopped by a signal after iteration {it}: resume with --resume")
            break
        t_last = time.time()

    # every rank must hold bitwise the same full parameters: compare fingerprints once, at the end
    # (under ZeRO-3 no rank holds them between steps: the checkpoint below gathers them)
    digest = "sharded" if cfg.zero == 3 else hashlib.sha256(
        b"".join(p.detach().cpu().float().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests = [digest] * world_size
    if distributed:
        dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        print0(f"WARNING: ranks hold different parameters: {digests}")
    log({"event": "end", "iter": it, "replica_sha256": digests})

    if not stopped:  # the final checkpoint (a signal's was just written)
        print0(f"saved {checkpoint.save(cfg.out_dir, it, zero, model, scaler, header, cfg.ckpt_format, cfg.keep_last, rank, world_size)}")
    if cfg.lora:  # the adapter alone: kilobytes, full tensors gathered onto rank 0 (also under ZeRO-3)
        full = zero.full_state_dict(model)
        if master:
            path = os.path.join(cfg.out_dir, "adapter.pt")
            save_adapter(path, adapter_state(full), model.lora_settings, base_id)
            print0(f"saved {path} ({os.path.getsize(path) / 1024:.1f} KiB)")
    if master:
        metrics.close()
    if distributed:
        # free the model, ZeRO's buffers and their finished collectives while the process group
        # exists (freed at interpreter exit instead, gloo can abort the process), then leave
        # together: a gloo rank that tears down while its peer is still busy saving can abort too
        # ("terminate called without an active exception")
        model = zero = loss = None
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
