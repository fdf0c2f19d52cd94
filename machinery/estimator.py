"""
Guards memory.py's command line: sizes parsed and bounded, a bare --params given a standard
shape, the estimate printed term by term. The arithmetic itself is footprint.py's.
"""
import math
from dataclasses import asdict, fields, replace

from configurator import UserError, config_from, load_preset, make_parser, parse_args
from machinery.declared import MODEL_FLAGS, config_for
from machinery.footprint import NCCL_BYTES, estimate, for_run, state_bytes_per_param
from machinery.validate import BOUNDS, check_model_args, check_optimizer
import model as model_py  # model.GPT when called: a fork's edit of it is estimated
from model import GPTConfig

HEADROOM = 0.10  # fraction of the GPU kept free for what the estimate leaves out


GB = 1e9


# Standard shapes for a bare --params, (parameters, layers, width, heads): GPT-3's (Brown et al.
# 2020, Table 2.1) and Llama 2 70B's. The nearest within 25% is taken, else shape_for's rule.
SHAPES = [(125e6, 12, 768, 12), (350e6, 24, 1024, 16), (760e6, 24, 1536, 16),
          (1.3e9, 24, 2048, 16), (2.7e9, 32, 2560, 32), (6.7e9, 32, 4096, 32),
          (13e9, 40, 5120, 40), (70e9, 80, 8192, 64), (175e9, 96, 12288, 96)]


def shape_for(psi, vocab=50257, block=2048):
    """A GPT shape for a bare parameter count (model state uses psi itself; the shape sizes
    the activations and goes into the command): the nearest standard shape within 25%, else
    width 128 x depth with heads 128 wide (GPT-3 175B: 96 layers of 12288)."""
    n, L, h, a = min(SHAPES, key=lambda row: abs(math.log(row[0] / psi)))
    if abs(n / psi - 1) > 0.25:
        L = max(1, round((psi / (12 * 128**2)) ** (1 / 3)))
        h, a = 128 * L, L
    return GPTConfig(block_size=block, vocab_size=vocab, n_layer=L, n_head=a, n_embd=h,
                     bias=False)


def save_flags(trainable, optimizer, host_bytes):
    """A consolidated save assembles every fp32 master and optimizer state tensor in rank 0's
    host memory before writing ((4 + K) bytes a parameter: 12 for AdamW); past half of the
    host's memory, each rank writes its own shard instead."""
    held = (4 + state_bytes_per_param(optimizer)) * trainable
    return ["--ckpt-format sharded"] if held > host_bytes / 2 else []


def fits(est, gpu_bytes):
    return est["peak"] <= (1 - HEADROOM) * gpu_bytes


def breakdown(est):
    """What a peak is made of, in GB, beside the lecture's 16 bytes a parameter (bf16 and
    AdamW: 2 weights + 2 gradients + 4 master + 8 optimizer), then the larger of the working
    set of forward and backward and the optimizer step's fp32 copy of the gradients (4 more,
    held once the activations are freed)."""
    st, psi, g = est["state"], est["psi"], lambda n: f"{n / GB:.2f}"
    work = est["activations"]["total"] + est["gathered"] + max(est["head"],
                                                                est["in_flight"] + est["fp8_cast"])
    last = (f"{g(est['step'])} in the optimizer step (the gradients' fp32 copy; the "
            f"activations, {g(work)}, are freed by then)" if est["step"] > work else
            f"{g(work)} of activations and working set")
    nccl = (f" + NCCL {g(est['nccl'])} ({est['communicators']} communicators, an estimate)"
            if est["nccl"] else "")
    per = round(st["total"] / psi)  # 16 with AdamW; Muon's and Adafactor's state is smaller
    lecture = "the lecture's" if per == 16 else "the lecture's is AdamW's 16"
    return (f"= weights {g(st['params'])} + gradients {g(st['grads'])} + master and optimizer "
            f"{g(st['master'] + st['optimizer'])}: {per} B/parameter, {lecture}; + "
            f"{last}{nccl}: {est['peak'] / psi:.0f} B/parameter")


def advise_plans(N, one_fits, zero2_fits):
    """--advise's plans, in the order tried: (ZeRO stage, grad_ckpt, LoRA rank, quantize,
    offload, why). After ZeRO-3 and checkpointing, before LoRA: ZeRO-Offload, which trains
    every weight still (beyond/offload_optimizer.py; ZeRO-1 on one GPU: nothing to shard).
    zero2_fits: can ZeRO-2's model state fit at all (with full checkpointing, batch 1)? Where
    one GPU does not hold batch 1, each amount of checkpointing is tried on ZeRO-2, then on
    ZeRO-3 (the least traffic first); the lecture's flowchart would jump to ZeRO-3 at once."""
    from beyond.activation_dial import Policy  # selective, every K-th block
    if one_fits:
        return [(2, False, 0, None, False, f"yes: ZeRO-2 on {N} GPUs (the traffic of data "
                 "parallelism, its model state sharded)")] if N > 1 else \
            [(0, False, 0, None, False, "yes: one GPU has nothing to shard; a larger "
              "micro-batch")]
    stages = {2: f"ZeRO-2 on {N} GPUs: gradients and optimizer state sharded, the 16-bit "
                 "weights whole (the traffic of data parallelism)",
              3: f"ZeRO-3 on {N} GPUs shards the weights too (1.5x the traffic)"}
    stages = {z: why for z, why in stages.items() if z == 3 or zero2_fits} if N > 1 else {0: ""}
    # the least checkpointing that fits: none, the pointwise ops, every 2nd block, every block
    levels = [(False, ""), (Policy("selective"), "selective activation checkpointing: the "
               "blocks keep their matmuls' outputs, recompute the pointwise ops"),
              (Policy("full", 2), "activation checkpointing of every 2nd block: it keeps only "
               "its input"), (True, "activation checkpointing: each block keeps only its input")]
    name = lambda z: f"ZeRO-{z} " if len(stages) > 1 else ""  # which stage, where two are tried
    plans = [(z, ckpt, 0, None, False, f"{name(z)}+ {why}" if ckpt else stages[z])
             for ckpt, why in levels for z in stages if z or ckpt]
    z, sharded = (3, " (ZeRO-3 still shards it)") if N > 1 else (0, "")
    offload = (max(z, 1), True, 0, None, True, "+ ZeRO-Offload (--offload-optimizer; after "
               "ZeRO-3 and checkpointing, before LoRA: every weight still trains): the fp32 "
               "master and the optimizer state in host memory (AdamW's: 12 of 16 bytes a "
               "parameter), the step on the CPU (Ren et al. 2021)")
    return plans + [offload,
                    (z, True, 8, None, False, "+ LoRA on q,v, r=8: only the adapters train, no "
                     f"gradients or optimizer state for the base{sharded}"),
                    (z, True, 8, "nf4", False, "+ QLoRA: the frozen base weights in 4-bit NF4")]


def fmt(n):
    return f"{n / GB:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e4 else f"{n:.0f} B"


def table(rows, header):
    """Plain text: the first column and notes (header "") left-aligned, numbers right-aligned."""
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        cells = [str(c).ljust(w[i]) if i == 0 or header[i] == "" else str(c).rjust(w[i])
                 for i, c in enumerate(r)]
        print("  " + "  ".join(cells).rstrip())
    print()


def parse_bytes(text, flag="--gpu-mem"):
    """'80GB' -> 80e9, '24GiB' -> 24 * 2**30 (an '80GB' H100 holds 80 GiB = 85.9 GB)."""
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "TB": 1e12, "GB": 1e9, "MB": 1e6, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "")
    if not unit and t.replace(".", "", 1).isdigit():  # '24' would be 24 bytes: nothing fits
        raise UserError(f"{flag} {text}: give its unit, e.g. {text}GB or {text}GiB")
    try:
        n = float(t[:len(t) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        n = -1
    if not 0 < n < math.inf:
        raise UserError(f"{flag} {text}: use a size such as 80GB or 24GiB")
    return n


# memory.py's own numbers, bounded so that every answer comes in seconds: a bare --params
# gets a shape within validate.BOUNDS (at most 512 layers of 65536 for 2.6e13), the model
# flags are held to the same BOUNDS in model_from_flags
LIMITS = {"params": 1e13, "vocab": BOUNDS["vocab_size"], "world_size": 2**20}


def parse_flags(argv):
    """train.py's own flags (a preset, the model, --zero, --dtype, --batch-size, --grad-ckpt,
    LoRA) and memory.py's: (the parsed flags, their TrainConfig)."""
    p = make_parser("Memory per GPU of a train.py run with these flags (the lecture's tables: "
                    "python -m bench.lecture).")
    p.add_argument("--params", type=float, help="a bare parameter count, e.g. 1e9 (a GPT shape "
                   "is assumed)")
    p.add_argument("--vocab", type=int, help="the vocabulary (default: --dataset's, or GPT-2's)")
    p.add_argument("--world-size", type=int, default=1, help="GPUs (ranks)")
    p.add_argument("--gpu-mem", default="80GB", help="memory of one GPU, e.g. 80GB, 24GiB")
    p.add_argument("--host-mem", default="256GB", help="memory of rank 0's host: --advise "
                   "saves sharded checkpoints when a consolidated one would not fit in half")
    p.add_argument("--advise", action="store_true", help="the lecture's decision flow, ending in "
                   "a command")
    p.add_argument("--measure", action="store_true", help="build and step the real engine at this "
                   "size, as a rank of --world-size, on fake tensors (machinery/measure.py): what "
                   "it holds, its peak and its traffic, measured; with --advise, of its command")
    p.add_argument("--rank", help="--measure these ranks, e.g. 0,63 (default: 0 and the ranks "
                   "whose slices hold the most and the fewest parameters)")
    a = p.parse_args(argv)
    a.ranks = parse_ranks(a.rank) if a.rank is not None else ()
    if a.rank is not None and not a.measure:
        raise UserError("--rank names the ranks --measure measures: add --measure")
    for name, most in LIMITS.items():  # NaN fails every comparison: refused too
        value = getattr(a, name)
        if value is not None and not 1 <= value <= most:
            raise UserError(f"--{name.replace('_', '-')} {value:g}: use a number in "
                            f"[1, {most:g}]")
    tc = config_from(a)
    try:  # and torch's Adafactor, which a fork's loop builds (footprint.WHOLE)
        if tc.optimizer != "adafactor":
            check_optimizer(tc.optimizer)
    except ValueError as e:
        raise UserError(str(e) + " (memory.py: or adafactor)")
    if tc.optimizer == "adafactor" and (a.params or tc.lora):  # its state is per matrix
        raise UserError("--optimizer adafactor is counted on the model's shapes, for a full "
                        "fine-tune: give --config or --n-layer/--n-embd/--n-head, not --params, "
                        "and no --lora")
    if tc.quantize == "int8":
        raise UserError("memory.py models the nf4 base (QLoRA's): use --quantize nf4")
    if a.measure and tc.optimizer == "adafactor":
        raise UserError("--measure builds what train.py builds, and Adafactor is no train.py "
                        "--optimizer (a fork's loop builds it): measure muon or adamw")
    return a, tc


def parse_ranks(text):
    """--rank 0,63 -> (0, 63); anything else is one line."""
    try:
        ranks = tuple(dict.fromkeys(int(r) for r in text.split(",")))
    except ValueError:
        ranks = ()
    if not ranks or min(ranks) < 0:
        raise UserError(f"--rank {text}: give ranks as numbers from 0, e.g. --rank 0,63")
    return ranks


def measured_config(tc, cfg, batch):
    """The TrainConfig --measure builds: the flags, with the model memory.py describes (a bare
    --params' shape too) and its micro-batch."""
    shape = {k: getattr(cfg, k) for k in MODEL_FLAGS if hasattr(cfg, k)}
    return replace(tc, batch_size=batch, **shape)


def plan_of(cmd):
    """(its flags as a TrainConfig, its world size) of --advise's train.py command: what
    --advise --measure measures."""
    words = cmd.split()
    at = words.index("train.py")
    launch = dict(w[2:].split("=", 1) for w in words[:at] if w.startswith("--") and "=" in w)
    world_size = int(launch.get("nnodes", 1)) * int(launch.get("nproc_per_node", 1))
    return parse_args(words[at + 1:]), world_size


def model_from_flags(a, tc, psi):
    """The model the flags describe (a bare --params gets its shape from shape_for() and 2048
    tokens): a GPTConfig, and its flags for train.py (the preset and what overrides it, or the
    whole shape)."""
    vocab = a.vocab or (65 if tc.dataset == "shakespeare_char" and not psi else 50257)
    block = 2048 if psi and a.block_size is None else tc.block_size
    base = shape_for(psi, vocab, block) if psi else tc
    shape = {k: getattr(a, k) or getattr(base, k) for k in ("n_layer", "n_embd", "n_head")}
    bias = bool(a.bias) if psi else tc.bias
    try:
        cfg = GPTConfig(arch=getattr(model_py.GPT, "ARCH", GPTConfig.arch), block_size=block,
                        vocab_size=vocab, bias=bias, dropout=0.0 if psi else tc.dropout, **shape)
        cfg = config_for(model_py.GPT, cfg)  # a fork's own config class (its CONFIG)
        check_model_args(asdict(cfg), type(cfg))  # validate.BOUNDS: 10^5 layers is no model
    except ValueError as e:  # e.g. a width its heads do not divide
        raise UserError(str(e).replace("model_args ", "--").replace("_", "-"))
    names = {f.name for f in fields(cfg)}  # a fork's config may lack GPT's sizes: as train.py,
    lost = [k for k in MODEL_FLAGS if k in tc.explicit and k not in names]  # a flag it lacks
    if lost:  # would change nothing; the command would carry it to train.py, which refuses it
        raise UserError(f"--{lost[0].replace('_', '-')}: {type(cfg).__name__} has no field "
                        f"{lost[0]}, so the flag would change nothing; drop it")
    if not (a.measure and not a.advise):  # measured, a model needs no formula
        check_countable(tc, cfg, a.world_size, psi, a.advise)
    preset = a.config and not psi
    flags = [f"--config {a.config}"] if preset else []
    for k, v in {**shape, "block_size": block}.items():
        if (not preset or getattr(a, k)) and k in names:
            flags.append(f"--{k.replace('_', '-')} {v}")
    if "dataset" in tc.explicit and not (preset and tc.dataset == load_preset(a.config).get(
            "dataset")):
        flags.append(f"--dataset {tc.dataset}")
    elif not preset and vocab != 65:  # the estimate's vocabulary, not the 65 characters'
        flags.append("--dataset shakespeare" if vocab == 50257 else "--dataset YOUR_DATA")
    return cfg, flags + (["--bias"] if bias and not preset else [])


def check_countable(tc, cfg, world_size, psi, advise):
    """memory.py counts the model itself: its blocks() and each module kind's formula
    (activations.py's, or a fork's own SAVED and KEPT). One that it cannot count is one line,
    before any table: what to declare."""
    from beyond.activation_dial import Policy
    for_run(tc, cfg, world_size, psi=psi, batch=1)
    if advise:  # --advise tries selective checkpointing: the KEPT formulas
        estimate(cfg, psi=psi, grad_ckpt=Policy("selective"))


def dataset_note(flags, vocab, cmd, params):
    """The lines under --advise's command: what its --dataset stands for, where the user must
    look at it, and the shape a bare --params was given."""
    notes = []
    if cmd and "--dataset shakespeare" in flags:
        notes.append("--dataset shakespeare is the built-in GPT-2 BPE data set (50,257 tokens, "
                     "as estimated): for yours, `python data/prepare.py --input FILE "
                     "--tokenizer gpt2 --name NAME` and --dataset NAME")
    if cmd and "--dataset YOUR_DATA" in flags:
        notes.append(f"YOUR_DATA: a data set in a {vocab:,}-token vocabulary, as estimated "
                     "(`python data/prepare.py --input FILE --name YOUR_DATA`)")
    if params:
        notes.append(f"(--params {params:g}: the shape is the nearest standard one within 25% "
                     "(GPT-3's table, Llama 2 70B), else 128-wide heads; pass yours with "
                     "--n-layer/--n-embd/--n-head)")
    return notes


def print_estimate(e, cfg, gpu, optimizer="adamw"):
    """estimate()'s answer per GPU, whether it fits, and the activations term by term."""
    st, act = e["state"], e["activations"]
    missing = act.get("missing")  # a fork with no formula (activations.NoFormula)
    rows = [("weights", st["params"], "working weights (+ the frozen base)"),
            ("gradients", st["grads"], ""), ("fp32 master weights", st["master"], "16-bit only"),
            ("optimizer state", st["optimizer"], "fp32 (AdamW: exp_avg, exp_avg_sq)"
             if optimizer == "adamw" else f"fp32, {optimizer}'s"),
            ("model state", st["total"], "= ZeRO.state_bytes() at start-up"),
            ("activations", None if missing else act["total"], "no formula: below" if missing
             else f"{getattr(cfg, 'n_layer', 'its')} layers x {fmt(act['per_layer'])} + the "
             "rest, below"),
            ("ZeRO-3 gathered units", e["gathered"], "root + a block (+ the prefetched one)"
             " (+ ZeRO++'s second shards and codes)"),
            ("loss head, transient", e["head"], "the logits' gradient + fp32 work"),
            ("reductions in flight", e["in_flight"], "stages 2-3: two buckets' temporaries + "
             "the next one's gradients"),
            ("step: fp32 grad slice", e["step"], "in the optimizer step, activations freed"),
            ("NCCL communicators", e["nccl"], f"{e['communicators']} x {fmt(NCCL_BYTES)}, "
             "outside torch's allocator: an estimate (NVIDIA/nccl#864)"),
            ("peak", e["peak"], "state + max(acts + gathered + max(head, in flight), step)"
             " + NCCL")]
    if e["fp8_state"]:  # --fp8
        rows[-1:-1] = [("FP8 amax histories", e["fp8_state"], "per linear, with cast counters"),
                       ("FP8 cast, transient", e["fp8_cast"], "the widest cast, in backward")]
    if missing:
        rows[-1] = ("peak", e["peak"], "without the activations: a lower bound")
    table([[name, "unknown" if n is None else fmt(n), note] for name, n, note in rows],
          ["per GPU", "bytes", ""])
    verdict = ("fits" if fits(e, gpu) else "does NOT fit: try --advise") if not missing else \
        ("all but the activations fit" if fits(e, gpu) else "does NOT fit, without activations")
    print(f"GPU {fmt(gpu)}, {(1 - HEADROOM) * gpu / GB:.2f} GB usable ({HEADROOM:.0%} kept for the "
          f"CUDA context, fragmentation, transient buffers): {verdict}\n")
    if missing:
        print(f"Activations: unknown. {missing}; train.py measures them on its first step")
        return
    print("Activations saved for backward, per layer and outside the blocks:")
    terms = {**act["layer"], **act["outside"]}
    table([[k, fmt(v)] for k, v in terms.items() if v], ["term", "bytes"])


def sizes(cfg):
    """The model's sizes for the estimate's first line: GPT's L, h and a, or the integer fields
    of a fork's own config (which may name none of them)."""
    if all(hasattr(cfg, k) for k in ("n_layer", "n_embd", "n_head")):
        return f"L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}"
    return ", ".join(f"{k}={v}" for k, v in asdict(cfg).items()
                     if type(v) is int and k not in ("vocab_size", "block_size"))


def print_run(a, tc, cfg, psi, gpu):
    """memory.py without --advise: the estimate of the run these flags describe."""
    from beyond.activation_dial import Policy
    batch = tc.batch_size if "batch_size" in tc.explicit or not psi else 1
    r = tc.lora_rank if tc.lora else 0
    e = for_run(tc, cfg, a.world_size, psi=psi, batch=batch)  # the estimate train.py checks
    ckpt = Policy(tc.grad_ckpt, tc.grad_ckpt_every)
    extras = ((f", {ckpt.flags()}" if ckpt else "") + (f", LoRA r={r} on {tc.lora_targets}"
              if r else "") + (f", {tc.quantize} base" if tc.quantize else "")
              + (", --fp8" if tc.fp8 else ""))
    bias = ", bias" if getattr(cfg, "bias", False) else ""
    print(f"{model_py.GPT.__name__}: {e['psi']:,} parameters ({sizes(cfg)}, vocab "
          f"{cfg.vocab_size}, block {cfg.block_size}{bias}), "
          f"{e['trainable']:,} trainable; {tc.dtype}, ZeRO-{tc.zero}, {a.world_size} GPU(s), "
          f"micro-batch {batch} x {cfg.block_size} tokens{extras}")
    print_estimate(e, cfg, gpu, tc.optimizer)
    if e["padded"] and tc.zero:  # Muon's or Adafactor's dealt layout (beyond/muon.py)
        print(dealt_line(e, a.world_size, tc.optimizer))
    if tc.offload_optimizer != "none":
        print(offload_host_line(e["host"], a.world_size, parse_bytes(a.host_mem, "--host-mem")))
    return e


def dealt_line(e, world_size, optimizer):
    """Where --optimizer muon or adafactor deals whole tensors to ranks (beyond/muon.py): the
    buffers' padding, held in every rank's slices and moved by every collective."""
    padded, real = e["padded"], e["trainable"]
    return (f"{optimizer} steps whole tensors (beyond/muon.py): each dealt to one rank's slice, "
            f"every slice as long as the longest: the buffers hold {padded:,} elements for "
            f"{real:,} parameters, {padded / real - 1:.1%} of padding on {world_size} rank(s), "
            f"in the weights, gradients and master of every rank and in the traffic\n")


def offload_host_line(host, world_size, host_bytes, per_node=8):
    """--offload-optimizer: what each rank's host memory holds (beyond/offload_optimizer.py),
    and for the ranks of one host; a UserError, one line, when --host-mem cannot hold it."""
    ranks = min(world_size, per_node)
    need = ranks * host["total"]
    if need > host_bytes:
        raise UserError(f"--offload-optimizer: {ranks} rank(s) a host need {need / GB:.2f} GB "
                        f"of host memory (fp32 master, optimizer state, gradient slice), "
                        f"--host-mem is {host_bytes / GB:.0f} GB: use more hosts, or no offload")
    return (f"host memory per rank (--offload-optimizer): {host['total'] / GB:.3f} GB = master "
            f"{host['master'] / GB:.3f} + optimizer {host['optimizer'] / GB:.3f} + fp32 gradient "
            f"{host['grads'] / GB:.3f} + staging {host['staging'] / GB:.3f}; {ranks} rank(s) a "
            f"host: {need / GB:.2f} GB of --host-mem {host_bytes / GB:.0f} GB")


def command(world_size, shape_args, stage, dtype, batch, grad_ckpt=False, lora=False,
            quantize=None, per_node=8, offload=False):
    """The train.py launch line; beyond one node, run it on each node with its own --node_rank."""
    from beyond.activation_dial import policy  # --grad-ckpt's flags
    N = world_size
    launch = "python" if N == 1 else f"torchrun --nproc_per_node={N}"
    if N > per_node:
        launch = (f"torchrun --nnodes={math.ceil(N / per_node)} --nproc_per_node={per_node} "
                  "--node_rank=0 --master_addr=HOST --master_port=29500")
    flags = [f"--zero {stage}" if stage > 0 else "", f"--{dtype}" if dtype != "fp32" else "",
             f"--batch-size {batch}", policy(grad_ckpt).flags(),
             "--lora --lora-rank 8 --lora-targets q,v" if lora else "",
             f"--quantize {quantize}" if quantize else "",
             "--offload-optimizer" if offload else ""]
    return " ".join([launch, "train.py", *shape_args] + [f for f in flags if f])
