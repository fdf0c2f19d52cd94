"""
The run's configuration: one typed dataclass, presets, the command line, cross-field checks.

    python train.py --config config/shakespeare_char.py --n-layer 8 --bf16

Precedence: the dataclass defaults < a preset file (--config) < explicit flags. Every field
becomes a flag (`zero` -> --zero, `grad_ckpt` -> --grad-ckpt / --no-grad-ckpt) with its comment
as the help text. A preset is a file of plain `name = value` lines, parsed with `ast` and never
executed (nanoGPT's configurator exec()s Python files). Bad input is a ConfigError: train.py
prints it as one line, never a traceback. The resolved configuration goes into metrics.jsonl
and every checkpoint.
"""
import argparse
import ast
import math
import os
from dataclasses import dataclass, field, fields

from lora import parse_targets
from beyond.zeropp import parse_zeropp

ROOT = os.path.dirname(os.path.abspath(__file__))


class ConfigError(Exception):
    """Bad input from the user: printed as one line, never a traceback; under torchrun by rank
    0 alone, the same on every rank, unless rank_local (only this rank can see the problem)."""

    def __init__(self, message, rank_local=False):
        super().__init__(message)
        self.rank_local = rank_local


def opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = opt("out", "where metrics.jsonl and the checkpoints go")
    dataset: str = opt("shakespeare_char", "a folder under --data-root made by data/prepare.py")
    data_root: str = opt("data", "where the prepared data sets live (relative to this file)")
    eval_interval: int = opt(250, "evaluate train/val loss every this many steps")
    eval_iters: int = opt(20, "batches per loss estimate")
    log_interval: int = opt(10, "print and log every this many steps (the only steps that "
                                "wait for the device)")
    save_interval: int = opt(0, "save a checkpoint every this many steps (and at the end); "
                                "0 = at the end only")
    ckpt_format: str = opt("consolidated", "consolidated (one file, written by rank 0) | "
                                           "sharded (a file per rank)")
    keep_last: int = opt(2, "keep the newest K checkpoints in out_dir")
    resume: bool = opt(False, "carry on from the newest checkpoint in out_dir "
                              "(start fresh if there is none)")
    init_from: str = opt("", "start from these weights: a checkpoint folder of ours, a Hugging "
                             "Face GPT-2 folder or file, or gpt2 | gpt2-medium | gpt2-large | "
                             "gpt2-xl, whose config.json sets the model flags not given "
                             "(--resume wins once the run has its own checkpoint)")
    input: str = opt("", "train on this UTF-8 text file (prepared into data/<its name>, "
                         "in --init-from's vocabulary)")
    # LoRA (Hu et al. 2021) and a quantized frozen base (Dettmers et al. 2023, QLoRA)
    lora: bool = opt(False, "freeze the model and train low-rank adapters B·A only")
    lora_rank: int = opt(8, "r, the adapters' rank")
    lora_alpha: float = opt(1.0, "alpha; the update is scaled by alpha / r")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input")
    lora_targets: str = opt("q,v", "which projections to adapt: "
                                   "q,k,v,attn_out,mlp_fc,mlp_proj or all")
    quantize: str = opt("", "int8 | nf4: store the frozen base Linear weights quantized "
                            "(needs --lora)")
    double_quant: bool = opt(False, "nf4: quantize the block scales too "
                                    "(QLoRA's double quantization)")
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
    batch_tokens: int = opt(0, "the global batch in tokens; sets --grad-accum from the world "
                               "size, so a preset trains alike on 1 or 8 GPUs (0 = off)")
    # the optimizer (optim.py) and its schedule: linear warmup, cosine decay to min_lr
    optimizer: str = opt("adamw", "adamw | sgd (with momentum --beta1) | lion (Chen et al. "
                                  "2023: take a 3-10x smaller --learning-rate)")
    learning_rate: float = opt(1e-3, "peak learning rate")
    max_iters: int = opt(2000, "optimizer steps")
    weight_decay: float = opt(0.1, "decoupled weight decay on 2-D weights")
    beta1: float = opt(0.9, "AdamW's and Lion's beta1; SGD's momentum")
    beta2: float = opt(0.99, "AdamW's and Lion's beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = off")
    warmup_iters: int = opt(100, "linear warmup steps (with --max-iters alone: at most a "
                                 "tenth of them)")
    lr_decay_iters: int = opt(2000, "steps of cosine decay; follows --max-iters unless set")
    min_lr: float = opt(1e-4, "learning rate at the end of the decay")
    # system
    device: str = opt("auto", "auto | cpu | cuda")
    dtype: str = opt("fp32", "fp32 | bf16 | fp16 (the working precision of weights "
                             "and gradients)")
    loss_scale: str = opt("auto", "dynamic | none | VALUE; auto = dynamic for fp16, "
                                  "none otherwise")
    min_loss_scale: float = opt(1.0, "the dynamic scaler's floor: an overflow at this scale "
                                     "stops the run (the loss is non-finite at any scale)")
    fp32_grad_accum: bool = opt(True, "16-bit runs with --grad-accum > 1: accumulate "
                                      "gradients in fp32")
    reduce_dtype: str = opt("auto", "auto | fp32 | bf16 | fp16: the dtype gradients are reduced "
                                    "in, at every stage (auto = --dtype's)")
    zero: int = opt(0, "ZeRO stage: 0 data parallel, 1 shard optimizer, 2 +gradients, "
                       "3 +parameters")
    prefetch: bool = opt(True, "ZeRO-3: gather the next unit while this one computes")
    zeropp: str = opt("", "ZeRO++ on stage 3 (zeropp.py), any of qwz,hpz,qgz: int8 weight "
                          "gathers, a node-local second shard, quantized gradients")
    node_size: int = opt(0, "ranks per node, for ZeRO++ and the traffic by link "
                            "(0 = torchrun's LOCAL_WORLD_SIZE, else all ranks)")
    qgz_bits: int = opt(4, "ZeRO++ qgz: 4 | 8 bits per gradient element on the wire")
    fp8: bool = opt(False, "the blocks' linears in FP8 (E4M3 / E5M2 matmuls, fp8.py); "
                           "needs --bf16")
    fp8_scaling: str = opt("dynamic", "dynamic (scale from this tensor's amax) | delayed "
                                      "(from the amax history of the last steps)")
    fp8_amax_history: int = opt(16, "--fp8-scaling delayed: steps of amax history")
    # a bare --grad-ckpt is full, --no-grad-ckpt is none (activation_ckpt.py says what each keeps)
    grad_ckpt: str = field(default="none", metadata=dict(
        help="activation checkpointing: none | full (keep each block's input, recompute the "
             "block) | selective (keep the matmuls' and attention's outputs too)",
        nargs="?", const="full"))
    grad_ckpt_every: int = opt(1, "checkpoint every K-th block only (blocks 0, K, 2K, ...)")
    offload_activations: bool = opt(False, "CUDA: keep the tensors saved for backward in pinned "
                                           "host memory (a no-op on a CPU)")
    compile: bool = opt(False, "torch.compile each block's forward and the loss head")
    bucket_mb: float = opt(25.0, "gradient bucket size in MiB for overlapped communication")
    peak_tflops: float = opt(0.0, "peak TFLOP/s per device for MFU; 0 = look the GPU up")
    seed: int = opt(1337, "the batch at step t depends only on (seed, t)")
    nan_at: int = opt(-1, "a lesson in skipped steps: make the last rank's loss NaN "
                          "at this step")

    def __post_init__(self):  # presets, checkpoints and code from when --grad-ckpt was a switch
        if isinstance(self.grad_ckpt, bool):
            self.grad_ckpt = "full" if self.grad_ckpt else "none"


def load_preset(path):
    """A preset is a file of plain `name = literal` lines; parsed, never executed."""
    for cand in (path, path + ".py", os.path.join(ROOT, "config", path),
                 os.path.join(ROOT, "config", path + ".py")):
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
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise ConfigError(f"{path}:{node.lineno}: presets hold only `name = value` lines")
        name = node.targets[0].id
        if name not in known:
            raise ConfigError(f"{path}:{node.lineno}: unknown setting {name!r}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise ConfigError(f"{path}:{node.lineno}: {name} must be a literal value")
        ftype = known[name].type
        if name == "grad_ckpt" and isinstance(value, bool):  # a preset from when it was a switch
            value = "full" if value else "none"
        if ftype is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not ftype:
            raise ConfigError(f"{path}:{node.lineno}: {name} must be {ftype.__name__}, "
                              f"got {value!r}")
        out[name] = value
    return out


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one-line ConfigErrors."""

    def error(self, message):  # one line, no usage dump
        raise ConfigError(message)


# --help groups the flags as TrainConfig's sections above: the first field of each
SECTIONS = {"out_dir": "I/O", "lora": "LoRA and a quantized frozen base", "n_layer": "model",
            "batch_size": "batch", "optimizer": "the optimizer and its schedule",
            "device": "system: precision, parallelism, memory"}
CHOICES = {"dtype": ("fp32", "bf16", "fp16"), "device": ("auto", "cpu", "cuda"),
           "zero": (0, 1, 2, 3), "ckpt_format": ("consolidated", "sharded"),
           "quantize": ("", "int8", "nf4"), "reduce_dtype": ("auto", "fp32", "bf16", "fp16"),
           "optimizer": ("adamw", "sgd", "lion"), "fp8_scaling": ("dynamic", "delayed"),
           "grad_ckpt": ("none", "full", "selective")}


def make_parser(description="Train a GPT with nanoZeRO."):
    """Every TrainConfig field as a flag, grouped by section, its help ending in the default a
    run gets without a preset (memory.py adds its own flags to the same parser). The flags'
    own defaults stay None: a preset then fills what no flag set."""
    p = OneLineParser(description=description, allow_abbrev=False)
    p.add_argument("--config", help="a preset from config/, e.g. config/shakespeare_char.py; "
                   "its values replace these defaults, explicit flags win over both")
    group = p
    for f in fields(TrainConfig):
        if f.name in SECTIONS:
            group = p.add_argument_group(SECTIONS[f.name])
        flag, shown = "--" + f.name.replace("_", "-"), f.default
        help = f"{f.metadata['help']} (default: {'none' if shown == '' else shown})"
        if f.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help)
            continue
        names = "|".join(str(c) for c in CHOICES.get(f.name, ()) if c != "")
        extra = {k: f.metadata[k] for k in ("nargs", "const") if k in f.metadata}  # --grad-ckpt
        group.add_argument(flag, type=f.type, default=None, help=help, **extra,
                           metavar=f"{{{names}}}" if names else f.type.__name__.upper())
        if f.name == "grad_ckpt":
            group.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_const",
                               const="none", help="the same as --grad-ckpt none")
        if f.name == "dtype":
            group.add_argument("--bf16", action="store_true", help="shortcut for --dtype bf16")
            group.add_argument("--fp16", action="store_true", help="shortcut for --dtype fp16")
    return p


def parse_args(argv=None):
    return config_from(make_parser().parse_args(argv))


def config_from(args):
    """The TrainConfig of parsed flags: defaults < the preset < the flags, then checked."""
    values = load_preset(args.config) if args.config else {}
    values.update({k: v for k, v in vars(args).items()
                   if v is not None and k in TrainConfig.__dataclass_fields__})
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 conflict: pick one")
    for short in ("bf16", "fp16"):
        if getattr(args, short):
            if args.dtype not in (None, short):
                raise ConfigError(f"--{short} conflicts with --dtype {args.dtype}: pick one")
            values["dtype"] = short
    # a short run decays over its own length: --lr-decay-iters follows --max-iters unless a
    # preset or a flag sets it, and warm-up is cut to fit inside it
    if "lr_decay_iters" not in values and "max_iters" in values:
        values["lr_decay_iters"] = values["max_iters"]
        if "warmup_iters" not in values:
            values["warmup_iters"] = min(TrainConfig.warmup_iters, values["max_iters"] // 10)
    cfg = TrainConfig(**values)
    # the fields a preset or a flag set: --init-from a Hugging Face model takes the model's
    # shape from its config.json, and must know a flag that contradicts it from a default
    cfg.explicit = frozenset(values)
    check_config(cfg)
    return cfg


def check_config(cfg):
    """Cross-field checks that need no data, model or process group."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: use "
                              f"{', '.join(str(a) for a in allowed if a != '')}")
    if cfg.loss_scale not in ("auto", "dynamic", "none"):
        try:
            if not 0 < float(cfg.loss_scale) < math.inf:  # nan fails this too
                raise ValueError
        except ValueError:
            raise ConfigError(f"--loss-scale {cfg.loss_scale}: use dynamic, none or a "
                              "positive number")
    check_ranges(cfg)
    for name in ("batch_size", "grad_accum", "max_iters", "eval_interval", "eval_iters",
                 "log_interval", "keep_last", "grad_ckpt_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.grad_ckpt_every > 1 and cfg.grad_ckpt == "none":
        raise ConfigError(f"--grad-ckpt-every {cfg.grad_ckpt_every} picks which blocks "
                          "--grad-ckpt checkpoints: add --grad-ckpt [full|selective]")
    if cfg.save_interval < 0 or cfg.batch_tokens < 0:
        raise ConfigError("--save-interval and --batch-tokens must not be negative")
    if (cfg.quantize or cfg.double_quant) and not cfg.lora:
        raise ConfigError("--quantize stores a frozen base: it needs --lora")
    if cfg.fp8 and cfg.dtype != "bf16":
        raise ConfigError(f"--fp8 computes around bf16 working weights: add --bf16 "
                          f"(not --dtype {cfg.dtype})")
    if cfg.fp8 and cfg.grad_ckpt == "selective":  # its policy sees ops, not FP8's Function
        raise ConfigError("--grad-ckpt selective keeps the outputs of torch's matmul ops, which "
                          "--fp8's products are not: use --grad-ckpt full with --fp8")
    if cfg.fp8 and (cfg.quantize or cfg.fp8_amax_history < 1):
        raise ConfigError("--fp8 needs --fp8-amax-history >= 1 and no --quantize "
                          "(a quantized base would be quantized twice)")
    if cfg.double_quant and cfg.quantize != "nf4":
        raise ConfigError("--double-quant quantizes nf4's block scales: it needs --quantize nf4")
    if cfg.zeropp:
        try:
            parse_zeropp(cfg.zeropp)
        except ValueError as e:
            raise ConfigError(str(e))
        if cfg.zero != 3:
            raise ConfigError(f"--zeropp {cfg.zeropp} extends ZeRO stage 3: add --zero 3")
    if cfg.qgz_bits not in (4, 8) or cfg.node_size < 0:
        raise ConfigError("--qgz-bits is 4 or 8, --node-size at least 0")
    if cfg.lora:
        try:
            parse_targets(cfg.lora_targets)
        except ValueError as e:
            raise ConfigError(str(e))
        if cfg.lora_rank < 1:
            raise ConfigError("--lora-rank must be at least 1")


# each number's allowed range, [lo, hi) or [lo, hi] (closed): a NaN or an infinity is never in it
RANGES = {"learning_rate": ("(", 0, math.inf), "min_lr": ("[", 0, math.inf),
          "weight_decay": ("[", 0, math.inf), "beta1": ("[", 0, 1), "beta2": ("[", 0, 1),
          "grad_clip": ("[", 0, math.inf), "dropout": ("[", 0, 1),
          "lora_dropout": ("[", 0, 1), "lora_alpha": ("(", 0, math.inf),
          "bucket_mb": ("(", 0, math.inf), "min_loss_scale": ("(", 0, math.inf),
          "peak_tflops": ("[", 0, math.inf), "warmup_iters": ("[", 0, math.inf),
          "lr_decay_iters": ("[", 0, math.inf)}


def check_ranges(cfg):
    """Every number within its range: a negative learning rate is a traceback deep in AdamW, an
    infinite one saves NaN weights, --grad-clip -1 turns clipping silently off."""
    for name, (bracket, lo, hi) in RANGES.items():
        value = getattr(cfg, name)
        low_ok = value > lo if bracket == "(" else value >= lo
        if not (math.isfinite(value) and low_ok and value < hi):
            spelled = "a positive number" if bracket == "(" and hi == math.inf else \
                "a number >= 0" if hi == math.inf else f"in [{lo}, {hi})"
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be {spelled}")


def grad_accum_for(cfg, world_size):
    """Micro-steps per rank: --grad-accum, or what --batch-tokens asks of this world size."""
    if not cfg.batch_tokens:
        return cfg.grad_accum
    per_micro = cfg.batch_size * cfg.block_size * world_size  # tokens of one micro-step, all ranks
    if cfg.batch_tokens % per_micro:
        raise ConfigError(f"--batch-tokens {cfg.batch_tokens} is not a multiple of batch_size x "
                          f"block_size x world size = {per_micro}: pick a multiple of it")
    return cfg.batch_tokens // per_micro
