"""
The set-up of a run, once for train.py and for every benchmark: the model in its working dtype,
then LoRA (and a quantized base), FP8, activation checkpointing, --compile, the ZeRO engine
(stages 0-2 zero.py, stage 3 zero3.py, ZeRO++ zeropp.py) and the loss scaler. train.py's loop
drives what build() returns; bench/ times it beside PyTorch's own.
"""
import torch

from beyond import activation_dial
from beyond import fp8
from machinery import pretrained
from configurator import ConfigError
from lora import apply_lora, base_fingerprint
from model import GPT, GPTConfig
from precision import DTYPES, GradScaler
from quant import quantize_base
from zero import ZeRO
from zero3 import ZeRO3
from beyond.zeropp import ZeROpp, default_node_size, parse_zeropp



def model_config(cfg, vocab_size):
    """The GPTConfig of a run's configuration (a ConfigError when the shape does not divide)."""
    try:
        return GPTConfig(arch=GPT.ARCH, block_size=cfg.block_size, vocab_size=vocab_size,
                         n_layer=cfg.n_layer,
                         n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias)
    except ValueError as e:
        raise ConfigError(str(e))


def build(cfg, vocab_size, device, dtype, rank=0, world_size=1, grad_accum=1, init_weights=None,
          init_hf=None):
    """Model in its working dtype -> LoRA (and a quantized base) -> ZeRO -> loss scaler.
    Returns (model, zero, scaler). --init-from: init_weights, a state_dict of ours to start
    from, or init_hf, a Hugging Face GPT-2 folder or file."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    if init_hf:  # built in its working dtype and filled tensor by tensor: no fp32 copy
        model = pretrained.load_hf(init_hf, model_config(cfg, vocab_size), device, dtype, cfg.lora)
    else:
        model = GPT(model_config(cfg, vocab_size))
        if init_weights is not None:
            try:
                model.load_weights(init_weights)
            except ValueError as e:
                raise ConfigError(f"--init-from does not fit this model: {e}")
        # what an adapter file names as its base: the weights before LoRA and quantization
        model.base_id = base_fingerprint(model) if cfg.lora else None
        model = model.to(device=device, dtype=dtype)  # 16-bit working weights in bf16 / fp16
    # which blocks are checkpointed, what they keep, where saved tensors live: activation_ckpt.py
    model.grad_ckpt = activation_dial.policy(cfg.grad_ckpt, cfg.grad_ckpt_every)
    if cfg.offload_activations:
        _, note = activation_dial.install_offload(model, device)
        if rank == 0:
            print(note)
    if cfg.lora:  # freeze the base, add adapters: only they reach ZeRO's buffers and the optimizer
        try:  # the targets are names of the model's own LINEARS
            apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
        except ValueError as e:
            raise ConfigError(f"--lora-targets {cfg.lora_targets}: {e}")
        if cfg.quantize:
            quantize_base(model, cfg.quantize, cfg.double_quant)
    if cfg.fp8:  # the blocks' four linears compute in FP8 (fp8.py); adapters stay bf16
        try:
            fp8.check_available(device)
            fp8.convert(model, cfg.fp8_scaling, cfg.fp8_amax_history)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(str(e))
    if cfg.compile:  # each block's whole forward, and the loss head: see compile_model
        compile_model(model)
    node_size = cfg.node_size or default_node_size(world_size)  # ranks per node
    if world_size % node_size:
        raise ConfigError(f"--node-size {node_size} does not divide the world size {world_size}")
    Engine = ZeROpp if cfg.zeropp else ZeRO3 if cfg.zero == 3 else ZeRO
    extra = {"prefetch": cfg.prefetch} if cfg.zero == 3 else {}
    if cfg.zeropp:
        extra.update(zeropp=parse_zeropp(cfg.zeropp), node_size=node_size,
                     qgz_bits=cfg.qgz_bits)
    zero = Engine(model, cfg.zero, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
                  weight_decay=cfg.weight_decay, bucket_mb=cfg.bucket_mb, rank=rank,
                  world_size=world_size, fp32_grad_accum=cfg.fp32_grad_accum and grad_accum > 1
                  and dtype != torch.float32, reduce_dtype=DTYPES.get(cfg.reduce_dtype),
                  optimizer=cfg.optimizer, **extra)
    auto = "dynamic" if cfg.dtype == "fp16" else "none"  # bf16 and fp32 need no scale
    scale = auto if cfg.loss_scale == "auto" else cfg.loss_scale
    # a fixed scale of 1 is "no scaler", but still finds inf/NaN gradients and skips the step
    fixed = 1.0 if scale == "none" else None if scale == "dynamic" else float(scale)
    scaler = GradScaler(init_scale=fixed or 2.0**16, dynamic=fixed is None,
                        min_scale=cfg.min_loss_scale, device=device)
    zero.traffic.node_size = node_size  # bytes by link (collectives.Traffic)
    torch.manual_seed(cfg.seed + rank)  # dropout: different masks on different ranks
    return model, zero, scaler


def compile_model(model):
    """torch.compile each block's forward and the loss head (final LayerNorm, LM head, loss),
    where the memory-bound work (LayerNorms, residual adds, GELU, the softmax) fuses. A module's
    hooks run in its __call__, around forward: compiling forward, not the module, keeps the
    hooks that drive ZeRO (gathers, frees, gradient reductions) outside the compiled code."""
    for block in model.blocks():
        block.forward = torch.compile(block.forward)
    model.head = torch.compile(model.head)
