"""
The run's configuration: every setting, its default, its meaning and its range, in one
typed dataclass, and the checks across settings.

    python train.py --config config/shakespeare_char.py --n-layer 8 --bf16

Each field of TrainConfig is a flag, the command line generated from the dataclass (the end of
this file): `zero` -> --zero, `grad_ckpt` -> --grad-ckpt, with its help text, choices and range
from the field. Precedence: the dataclass defaults < a preset file (--config) < explicit flags.
A preset is a file of plain `name = value` lines, parsed with `ast`, never executed (nanoGPT's
configurator exec()s Python files). Bad input is a UserError: one line, never a traceback.
The resolved configuration goes into metrics.jsonl and every checkpoint. This file imports
nothing of the project: the flags are checked here by what they are, the model and the data
later by what they hold.
"""
import argparse
import ast
import math
import os
from dataclasses import dataclass, field, fields

ROOT = os.path.dirname(os.path.abspath(__file__))


class UserError(Exception):
    """Bad input from the user (a flag, a file, a folder, the data): printed as one line, never
    a traceback, by every command of ours; under torchrun by rank 0 alone, the same on every
    rank, unless rank_local (only this rank can see the problem). The one class of them all."""

    def __init__(self, message, rank_local=False):
        super().__init__(message)
        self.rank_local = rank_local


def opt(default, help, choices=None, check=None, **argparse_extra):
    """A field: its default, its --help text, the values it may take (choices) or its
    range (check: one of RANGES' keys), and anything else argparse needs."""
    return field(default=default, metadata=dict(help=help, choices=choices, check=check,
                                                argparse=argparse_extra))


# A number's allowed range. NaN and infinity are in none of them: a negative learning rate
# is a traceback deep in AdamW, an infinite one saves NaN weights, --grad-clip -1 turns
# clipping silently off.
RANGES = {"> 0": (lambda v: 0 < v < math.inf, "must be a positive number"),
          "(0, 2**20]": (lambda v: 0 < v <= 2**20, "must be in (0, 1048576]"),
          "[1, 2**20] s": (lambda v: 1 <= v <= 2**20, "must be 1 to 1048576 s: a step must fit"),
          "fp32 normal": (lambda v: 2.0**-126 <= v <= 2.0**127, "must be in [2**-126, 2**127]"),
          ">= 0": (lambda v: 0 <= v < math.inf, "must be a number >= 0"),
          "[0, 1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
          "int >= 1": (lambda v: v >= 1, "must be at least 1"),
          "int >= 0": (lambda v: v >= 0, "must not be negative"),
          "int >= -1": (lambda v: v >= -1, "must be a step, or -1 for none")}


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = opt("out", "where metrics.jsonl and the checkpoints go")
    dataset: str = opt("shakespeare_char", "a folder under --data-root made by data/prepare.py")
    data_root: str = opt("data", "where the prepared data sets live (relative to this file)")
    eval_interval: int = opt(250, "evaluate train/val loss every this many steps",
                             check="int >= 1")
    eval_iters: int = opt(20, "batches per loss estimate", check="int >= 1")
    log_interval: int = opt(10, "print and log every this many steps (the only steps that "
                                "wait for the device)", check="int >= 1")
    save_interval: int = opt(0, "save a checkpoint every this many steps (and at the end); "
                                "0 = at the end only", check="int >= 0")
    ckpt_format: str = opt("consolidated", "consolidated (one file, written by rank 0) | "
                                           "sharded (a file per rank)",
                           choices=("consolidated", "sharded"))
    keep_last: int = opt(2, "keep the newest K checkpoints in out_dir", check="int >= 1")
    resume: bool = opt(False, "carry on from the newest checkpoint in out_dir "
                              "(start fresh if there is none)")
    accept_new_data: bool = opt(False, "--resume on data other than the checkpoint's (its "
                                       "train.bin / val.bin sizes and sha256): go on, and "
                                       "record the change in metrics.jsonl")
    archive: bool = opt(False, "a new run where an earlier one left its history: move that "
                               "run into OUT_DIR/archive-N/ first (nothing is deleted)")
    take_over_lock: bool = opt(False, "take OUT_DIR/lock over from a run this host cannot "
                                      "see (another host's): only when none writes there")
    init_from: str = opt("", "start from these weights: a checkpoint folder of ours, a Hugging "
                             "Face GPT-2 folder or file, or gpt2 | gpt2-medium | gpt2-large | "
                             "gpt2-xl, whose config.json sets the model flags not given "
                             "(--resume wins once the run has its own checkpoint)")
    input: str = opt("", "train on this UTF-8 text file (prepared into data/<its name>, "
                         "in --init-from's vocabulary)")
    # LoRA (Hu et al. 2021) and a quantized frozen base (Dettmers et al. 2023, QLoRA)
    lora: bool = opt(False, "freeze the model and train low-rank adapters B·A only")
    lora_rank: int = opt(8, "r, the adapters' rank", check="int >= 1")
    lora_alpha: float = opt(1.0, "alpha; the update is scaled by alpha / r", check="> 0")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input", check="[0, 1)")
    lora_targets: str = opt("q,v", "which projections to adapt: "
                                   "q,k,v,attn_out,mlp_fc,mlp_proj or all")
    quantize: str = opt("", "int8 | nf4: store the frozen base Linear weights quantized "
                            "(needs --lora)", choices=("", "int8", "nf4"))
    double_quant: bool = opt(False, "nf4: quantize the block scales too "
                                    "(QLoRA's double quantization)")
    # model (nanoGPT's CPU shakespeare_char recipe by default)
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads")
    n_embd: int = opt(128, "residual width; must divide by n_head")
    block_size: int = opt(64, "context length in tokens")
    dropout: float = opt(0.0, "dropout probability", check="[0, 1)")
    bias: bool = opt(False, "biases in Linear and LayerNorm layers")
    # batch: one optimizer step sees batch_size * grad_accum * world_size sequences
    batch_size: int = opt(12, "micro-batch per rank (sequences)", check="int >= 1")
    grad_accum: int = opt(1, "micro-steps per rank per optimizer step", check="int >= 1")
    batch_tokens: int = opt(0, "the global batch in tokens; sets --grad-accum from the world "
                               "size, so a preset trains alike on 1 or 8 GPUs (0 = off)",
                            check="int >= 0")
    # the optimizer (optim.py) and its schedule: linear warmup, cosine decay to min_lr
    optimizer: str = opt("adamw", "adamw | sgd (with momentum --beta1) | lion (Chen et al. "
                                  "2023: take a 3-10x smaller --learning-rate) | muon "
                                  "(AdamW for embeddings, head, gains)")
    learning_rate: float = opt(1e-3, "peak learning rate", check="> 0")
    max_iters: int = opt(2000, "optimizer steps", check="int >= 1")
    weight_decay: float = opt(0.1, "decoupled weight decay on 2-D weights", check=">= 0")
    beta1: float = opt(0.9, "AdamW's and Lion's beta1; SGD's momentum", check="[0, 1)")
    beta2: float = opt(0.99, "AdamW's and Lion's beta2", check="[0, 1)")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 = off", check=">= 0")
    warmup_iters: int = opt(100, "linear warmup steps (with --max-iters alone: at most a "
                                 "tenth of them)", check=">= 0")
    lr_decay_iters: int = opt(2000, "steps of cosine decay; follows --max-iters unless set",
                              check=">= 0")
    min_lr: float = opt(1e-4, "learning rate at the end of the decay", check=">= 0")
    # system
    device: str = opt("auto", "auto | cpu | cuda", choices=("auto", "cpu", "cuda"))
    dtype: str = opt("fp32", "fp32 | bf16 | fp16 (the working precision of weights "
                             "and gradients)", choices=("fp32", "bf16", "fp16"))
    loss_scale: str = opt("auto", "dynamic | none | VALUE; auto = dynamic for fp16, "
                                  "none otherwise")
    min_loss_scale: float = opt(1.0, "the dynamic scaler's floor: an overflow at this scale "
                                     "stops the run (the loss is non-finite at any scale)",
                                check="fp32 normal")
    fp32_grad_accum: bool = opt(True, "16-bit runs with --grad-accum > 1: accumulate "
                                      "gradients in fp32")
    reduce_dtype: str = opt("auto", "the dtype gradients are reduced in, at every stage "
                                    "(auto = --dtype's)",
                            choices=("auto", "fp32", "bf16", "fp16"))
    zero: int = opt(0, "ZeRO stage: 0 data parallel, 1 shard optimizer, 2 +gradients, "
                       "3 +parameters", choices=(0, 1, 2, 3))
    prefetch: bool = opt(True, "ZeRO-3: gather the next unit while this one computes")
    zeropp: str = opt("", "ZeRO++ on stage 3 (beyond/zeropp.py), any of qwz,hpz,qgz: int8 "
                          "weight gathers, a node-local second shard, quantized gradients")
    node_size: int = opt(0, "ranks per node, for ZeRO++ and the traffic by link "
                            "(0 = torchrun's LOCAL_WORLD_SIZE, else all ranks)",
                         check="int >= 0")
    qgz_bits: int = opt(4, "ZeRO++ qgz: bits per gradient element on the wire", choices=(4, 8))
    fp8: bool = opt(False, "the blocks' linears in FP8 (E4M3 / E5M2 matmuls, beyond/fp8.py); "
                           "needs --bf16")
    fp8_scaling: str = opt("dynamic", "dynamic (scale from this tensor's amax) | delayed "
                                      "(from the amax history of the last steps)",
                           choices=("dynamic", "delayed"))
    fp8_amax_history: int = opt(16, "--fp8-scaling delayed: steps of amax history",
                                check="int >= 1")
    # a bare --grad-ckpt is full, --no-grad-ckpt is none
    grad_ckpt: str = opt("none", "activation checkpointing: none | full (keep each block's "
                                 "input, recompute the block) | selective (keep the matmuls' "
                                 "and attention's outputs too: beyond/activation_dial.py)",
                         choices=("none", "full", "selective"), nargs="?", const="full")
    grad_ckpt_every: int = opt(1, "checkpoint every K-th block only (blocks 0, K, 2K, ...)",
                               check="int >= 1")
    offload_activations: bool = opt(False, "CUDA: keep the tensors saved for backward in "
                                           "pinned host memory (a no-op on a CPU)")
    # a bare --offload-optimizer is overlap
    offload_optimizer: str = opt("none", "ZeRO-Offload (beyond/offload_optimizer.py): the fp32 "
                                         "master and optimizer state of a rank's slice in host "
                                         "memory, the step on the CPU; overlap copies each "
                                         "gradient bucket down as it lands, plain after "
                                         "backward; delayed also steps in a thread during the "
                                         "next step (the paper's DPU: other arithmetic)",
                                 choices=("none", "plain", "overlap", "delayed"), nargs="?",
                                 const="overlap")
    compile: bool = opt(False, "torch.compile each block's forward and the loss head")
    cudnn_attention: bool = opt(True, "CUDA: SDPA's kernels in PyTorch's order (cuDNN's "
                                      "attention first on Hopper and Blackwell with cuDNN >= "
                                      "9.15.1, torch >= 2.10); off: cuDNN's last")
    chunked_loss: bool = opt(False, "the loss head's fp32 softmax a chunk of rows at a time "
                                    "(beyond/chunked_loss.py; pays at a 50k vocabulary: "
                                    "config/gpt2_124m.py sets it); off: model.py's plain head")
    bucket_mb: float = opt(25.0, "gradient bucket size in MiB for overlapped communication",
                           check="(0, 2**20]")
    peak_tflops: float = opt(0.0, "peak TFLOP/s per device for MFU; 0 = look the GPU up",
                             check=">= 0")
    seed: int = opt(1337, "the batch at step t depends only on (seed, t)")
    nan_at: int = opt(-1, "a lesson in skipped steps: make the last rank's loss NaN at this step",
                      check="int >= -1")
    collective_timeout: float = opt(600.0, "seconds a collective waits for the slowest rank "
                                           "before the run stops, naming the collective and "
                                           "the ranks that never arrived; generous, as a step, "
                                           "an evaluation or a save must fit in it. The first "
                                           "step (a compile, rank 0 preparing --input) waits "
                                           "at least 30 min (docs/debugging.md)",
                                    check="[1, 2**20] s")
    hang_at: int = opt(-1, "a lesson in hangs: the last rank stops issuing collectives at "
                           "this step (after the run's first); the others name it after "
                           "--collective-timeout", check="int >= -1")
    trace: str = opt("", "a timeline into this folder: a torch.profiler trace per rank and the "
                         "collective log of --trace-steps steps after 2 warm-up steps, each "
                         "step's exposed communication and overlap (docs/debugging.md)")
    trace_steps: int = opt(3, "how many steps --trace records", check="int >= 1")


SCHEDULE = ("learning_rate", "min_lr", "warmup_iters", "lr_decay_iters")  # train.get_lr's
ZEROPP_PARTS = ("qwz", "hpz", "qgz")  # --zeropp: a comma list of these (beyond/zeropp.py)
FP32_TINY = 2.0**-126  # torch.finfo(torch.float32).tiny: the smallest fixed loss scale


def parse_zeropp(text):
    """'qwz,hpz' -> ('qwz', 'hpz'); a ValueError names an unknown part."""
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    for p in parts:
        if p not in ZEROPP_PARTS:
            raise ValueError(f"--zeropp {text}: {p!r} is not one of {', '.join(ZEROPP_PARTS)}")
    return parts


def check_config(cfg):
    """Each field against its choices and range, then the checks across fields: all
    before any data, model or process group exists."""
    for f in fields(TrainConfig):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        choices, check = f.metadata["choices"], f.metadata["check"]
        if choices and value not in choices:
            raise UserError(f"{flag} {value}: use "
                            f"{', '.join(str(c) for c in choices if c != '')}")
        if check and not RANGES[check][0](value):  # NaN fails every comparison
            message = RANGES[check][1]
            raise UserError(f"{flag} {message}" if check.startswith("int") else
                            f"{flag} {value}: {message}")
    if cfg.loss_scale not in ("auto", "dynamic", "none"):
        try:  # a scale below fp32's smallest normal number makes every gradient zero
            if not FP32_TINY <= float(cfg.loss_scale) < math.inf:
                raise ValueError
        except ValueError:
            raise UserError(f"--loss-scale {cfg.loss_scale}: use dynamic, none or a number "
                            f"from {FP32_TINY:g} (fp32's smallest normal) up")
    if cfg.grad_ckpt_every > 1 and cfg.grad_ckpt == "none":
        raise UserError(f"--grad-ckpt-every {cfg.grad_ckpt_every} picks which blocks "
                        "--grad-ckpt checkpoints: add --grad-ckpt [full|selective]")
    if (cfg.quantize or cfg.double_quant) and not cfg.lora:
        raise UserError("--quantize stores a frozen base: it needs --lora")
    if cfg.double_quant and cfg.quantize != "nf4":
        raise UserError("--double-quant quantizes nf4's block scales: it needs --quantize nf4")
    if cfg.fp8 and cfg.dtype != "bf16":
        raise UserError(f"--fp8 computes around bf16 working weights: add --bf16 "
                        f"(not --dtype {cfg.dtype})")
    if cfg.fp8 and cfg.grad_ckpt == "selective":  # its policy sees ops, not FP8's Function
        raise UserError("--grad-ckpt selective keeps the outputs of torch's matmul ops, which "
                        "--fp8's products are not: use --grad-ckpt full with --fp8")
    if cfg.fp8 and cfg.quantize:
        raise UserError("--fp8 needs no --quantize (a quantized base would be quantized "
                        "twice)")
    if cfg.offload_optimizer != "none" and cfg.zero == 0:
        raise UserError("--offload-optimizer offloads the slice of the optimizer a rank owns: "
                        "use --zero 1, 2 or 3 (at stage 0 each rank would hold all of it)")
    if cfg.offload_optimizer != "none" and cfg.zeropp:
        raise UserError("--offload-optimizer and --zeropp are not combined here: pick one")
    if cfg.zeropp:
        parse_zeropp(cfg.zeropp)  # a ValueError, one line
        if cfg.zero != 3:
            raise UserError(f"--zeropp {cfg.zeropp} extends ZeRO stage 3: add --zero 3")


def grad_accum_for(cfg, world_size):
    """Micro-steps per rank: --grad-accum, or what --batch-tokens asks of this world size."""
    if not cfg.batch_tokens:
        return cfg.grad_accum
    per_micro = cfg.batch_size * cfg.block_size * world_size  # tokens of one micro-step, all ranks
    if cfg.batch_tokens % per_micro:
        raise UserError(f"--batch-tokens {cfg.batch_tokens} is not a multiple of batch_size x "
                        f"block_size x world size = {per_micro}: pick a multiple of it")
    return cfg.batch_tokens // per_micro


# ----------------------------------------------------------------------------------------------
# the command line: every field a flag, presets read without running them

def load_preset(path):
    """A preset is a file of plain `name = literal` lines; parsed, never executed."""
    for cand in (path, path + ".py", os.path.join(ROOT, "config", path),
                 os.path.join(ROOT, "config", path + ".py")):
        if os.path.isfile(cand):
            path = cand
            break
    else:
        raise UserError(f"no preset {path!r}: see the files in config/")
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    with open(path) as f:
        source = f.read()
    for node in ast.parse(source, path).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise UserError(f"{path}:{node.lineno}: presets hold only `name = value` lines")
        name = node.targets[0].id
        if name not in known:
            raise UserError(f"{path}:{node.lineno}: unknown setting {name!r}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise UserError(f"{path}:{node.lineno}: {name} must be a literal value")
        ftype = known[name].type
        if ftype is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not ftype:
            choices = known[name].metadata["choices"]
            hint = f" ({', '.join(map(repr, choices))})" if choices else ""
            raise UserError(f"{path}:{node.lineno}: {name} must be {ftype.__name__}{hint}, "
                            f"got {value!r}")
        out[name] = value
    return out


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one-line UserErrors."""

    def error(self, message):  # one line, no usage dump
        raise UserError(message)


# --help groups the flags as TrainConfig's sections above: the first field of each
SECTIONS = {"out_dir": "I/O", "lora": "LoRA and a quantized frozen base", "n_layer": "model",
            "batch_size": "batch", "optimizer": "the optimizer and its schedule",
            "device": "system: precision, parallelism, memory"}


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
        choices = f.metadata["choices"] or ()
        names = "|".join(str(c) for c in choices if c != "")
        group.add_argument(flag, type=f.type, default=None, help=help,
                           metavar=f"{{{names}}}" if names else f.type.__name__.upper(),
                           **f.metadata["argparse"])  # --grad-ckpt's nargs and const
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
        raise UserError("--bf16 and --fp16 conflict: pick one")
    for short in ("bf16", "fp16"):
        if getattr(args, short):
            if args.dtype not in (None, short):
                raise UserError(f"--{short} conflicts with --dtype {args.dtype}: pick one")
            values["dtype"] = short
    given = frozenset(values)  # a preset's or a flag's: train.fit_schedule derives the rest
    cfg = TrainConfig(**values)
    # the fields a preset or a flag set: --init-from a Hugging Face model takes the model's
    # shape from its config.json, and must know a flag that contradicts it from a default; a
    # short run's schedule follows --max-iters, a resume keeps the checkpoint's unless one is
    # given (train.fit_schedule, train.keep_schedule)
    cfg.explicit = given
    check_config(cfg)
    return cfg
