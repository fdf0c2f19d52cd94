"""
Will my model fit, and which flags do I need? Memory per GPU, from the same code that trains.

References:
  - Rajbhandari et al. 2019, "ZeRO": model-state bytes per stage (zero.py implements them)
  - Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models": per
    layer s*b*h*(34 + 5*a*s/h) bytes of activations in 16 bits, 2*s*b*h with full recomputation
  - Hu et al. 2021, "LoRA"; Dettmers et al. 2023, "QLoRA" (4-bit NF4 base weights)

  python -m bench.lecture                                  # the lecture's tables, from these
  python memory.py --config config/gpt2_124m.py --dtype bf16 --world-size 8 --zero 2 --gpu-mem 80GB
  python memory.py --params 7e9 --world-size 8 --gpu-mem 80GB --advise  # which flags, as a command

Model state is exact: it counts what zero.py allocates, padding included, and tests/test_memory.py
holds it equal to ZeRO.state_bytes(). Activations count what model.saved_activation_bytes
measures (tensors saved for backward, weights left out), term by term; on CPU they match to the
byte. Not estimated: the CUDA context, allocator fragmentation, transient buffers (the logits'
gradient, communication buckets): --advise keeps HEADROOM of the GPU free for them.
Sizes are decimal, as the lecture counts them: 1 GB = 1e9 bytes.
"""
import bisect
import math
import sys
from dataclasses import replace

import torch

import optim
from activation_ckpt import Policy, policy
from activations import BYTES, activation_bytes, head_working_bytes
from configurator import ConfigError, config_from, grad_accum_for, make_parser
from lora import apply_lora, parse_targets
from model import GPT, GPTConfig
from buckets import plan_buckets
from zero import MAX_IN_FLIGHT, zero_formula

# stored bytes per quantized weight, as quant.py stores nf4 by default: two 4-bit codes per byte
# and an fp32 absmax per block of 64 (4.5 bits). Not modelled: --double-quant, where quant.py
# codes each scale in 8 bits on a log scale (4.129 bits), so the estimate is 0.37 bits high.
QUANT_BYTES = {"nf4": 0.5 + 4 / 64}
HEADROOM = 0.10  # fraction of the GPU kept free for what the estimate leaves out
GB = 1e9


def shapes_only(cfg, build=None, lora_rank=0, lora_targets=("q", "v")):
    """The model the flags describe (model.py's GPT, or build(cfg)'s), with LoRA's adapters if
    lora_rank, built on the meta device: every shape, nothing allocated. The estimate counts
    what this model holds, not a formula of GPT-2's."""
    with torch.device("meta"):
        model = (build or GPT)(cfg)
        if lora_rank:
            apply_lora(model, lora_rank, targets=lora_targets)
    return model


def param_numels(cfg, build=None):
    """(unit, numel) of every parameter in named_parameters() order (a tied weight once): unit
    is the index of the block (the model's blocks()) that holds it, or "root": ZeRO-3's units."""
    model = shapes_only(cfg, build)
    block_of = {id(p): i for i, blk in enumerate(model.blocks()) for p in blk.parameters()}
    return [(block_of.get(id(p), "root"), p.numel()) for p in model.parameters()]


def param_count(n_layer, n_embd, n_head, vocab, block, bias=True, pad_vocab=64):
    """GPT-2's closed form, for the lecture's tables (the estimate counts the model itself):
    = GPT(...).num_params(non_embedding=False). Per block 12h^2 of matmuls (qkv 3h^2, attention
    output h^2, MLP 4h^2 + 4h^2), two LayerNorm gains, and with bias 9h of Linear biases + 2h of
    LayerNorm biases. n_head splits the width but adds nothing."""
    h = n_embd
    block_params = 12 * h * h + 2 * h + (11 * h if bias else 0)
    vocab = math.ceil(vocab / pad_vocab) * pad_vocab  # model.py pads the embedding's rows
    return vocab * h + block * h + n_layer * block_params + (2 * h if bias else h)


def bucket_sizes(params, stage, dtype, bucket_mb=25.0):
    """Real (unpadded) numel of each ZeRO flat buffer, by zero.py's own planner: stage 3 one per
    unit (root first), stages 0-2 buckets of bucket_mb. params: param_numels(), less frozen ones."""
    if stage == 3:
        units = {}
        for unit, n in params:
            units[unit] = units.get(unit, 0) + n
        return list(units.values())
    cap = max(1, int(bucket_mb * 2**20 / BYTES[dtype]))
    return [sum(params[i][1] for i in b) for b in plan_buckets([n for _, n in params], cap)]


def lora_numel(cfg, rank, targets, build=None):
    """Trainable LoRA parameters of the whole model: lora.py's adapters on a shapes-only copy."""
    model = shapes_only(cfg, build, rank, targets)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def quantized_numels(cfg, build=None):
    """Per block, the numel of each weight quant.py quantizes: the model's declared LINEARS."""
    model = shapes_only(cfg, build)
    return [[blk.get_submodule(path).weight.numel() for path, _ in model.LINEARS]
            for blk in model.blocks()]


def frozen_buckets(cfg, dtype, quantize=None, build=None):
    """(numel, bytes per element) of each frozen flat buffer ZeRO-3 makes under LoRA, one per unit
    and dtype: with `quantize` the blocks' declared linear weights as quant.py stores them."""
    E, out = BYTES[dtype], []
    sizes, mats = bucket_sizes(param_numels(cfg, build), 3, dtype), quantized_numels(cfg, build)
    for i, n in enumerate(sizes):
        if not quantize or i == 0:  # the root (embeddings, ln_f) is never quantized
            out.append((n, E))
            continue
        blocks = sum(math.ceil(m / 64) for m in mats[i - 1])  # 32 bytes of codes, fp32 absmax
        rest = n - sum(mats[i - 1])  # LayerNorms and biases
        # in fp32 the scales share the buffer of the rest: one buffer per unit and dtype
        out += [(32 * blocks, 1)] + ([(rest + blocks, 4)] if E == 4 else [(rest, E), (blocks, 4)])
    return out


def model_state_bytes(psi, stage, world_size, dtype, buckets=None, rank=0, frozen_psi=0,
                      quantized_psi=0, quantize=None, frozen_layout=None, fp32_grad_accum=False,
                      optimizer="adamw"):
    """Bytes of model state on one rank, as ZeRO.state_bytes() counts them at start-up.
    psi: trainable parameters (Ψ), in flat buffers of sizes `buckets` (default: one). Stages 1-3
    pad each buffer to a multiple of N, so every rank owns P/N elements (P: the padded total).
    frozen_psi: frozen parameters (LoRA's base model): outside the gradient and optimizer buffers,
    whole on every rank up to stage 2; quantized_psi of them are stored as `quantize`. Stage 3
    shards them with their unit: each of frozen_layout's (numel, bytes) buffers padded to a
    multiple of N (frozen_buckets()), or without a layout simply 1/N of them. fp32_grad_accum:
    the gradient buffer that accumulates micro-steps is fp32 (4 bytes, not 2). optimizer: its
    state bytes per parameter come from optim.STATE_BYTES (AdamW 8, SGD-momentum and Lion 4)."""
    E, N, buckets = BYTES[dtype], world_size, buckets or [psi]
    G = 4 if fp32_grad_accum else E  # bytes per gradient element
    assert sum(buckets) == psi, "the buckets must hold exactly psi parameters"
    padded = [math.ceil(n / N) * N if stage >= 1 else n for n in buckets]
    P = sum(padded)
    owned = P // N if stage >= 1 else P
    real = psi
    if stage >= 1:  # optimizer state exists for real parameters only: a slice may end in padding
        real = sum(max(0, min(n, (rank + 1) * p // N) - rank * p // N)
                   for n, p in zip(buckets, padded))
    frozen = E * (frozen_psi - quantized_psi) + QUANT_BYTES.get(quantize, 0) * quantized_psi
    if stage == 3 and frozen:  # sharded with its unit: each buffer padded, or simply 1/N
        frozen = (sum(math.ceil(n / N) * e for n, e in frozen_layout) if frozen_layout
                  else frozen / N)
    out = {"params": E * (owned if stage == 3 else P) + frozen,  # 16-bit (or fp32) working weights
           "grads": G * (owned if stage >= 2 else P),
           "master": 0 if E == 4 else 4 * owned,  # fp32 weights are their own master: no copy
           "optimizer": optim.STATE_BYTES[optimizer] * real}  # e.g. AdamW's two fp32 moments
    out["total"] = sum(out.values())
    return out


def model_state_report(zero, world_size):
    """What each rank holds (ZeRO.state_bytes(), gathered from every rank: a collective) beside
    the ZeRO paper's formula: (a small table that fits 80 columns, a row for metrics.jsonl)."""
    held = zero.state_bytes()
    per_rank = [held] * world_size
    if world_size > 1:
        torch.distributed.all_gather_object(per_rank, held)
    paper = zero_formula(zero.psi, zero.stage, world_size, zero.dtype, zero.optimizer)
    master = "fp32 master + " if zero.dtype != torch.float32 else ""
    pairs = [("weights", held["params"], paper["params"], ""),
             ("gradients", held["grads"], paper["grads"], ""),
             ("optimizer side", held["master"] + held["optimizer"], paper["optimizer_side"],
              f"{master}{zero.optimizer} state"),
             ("total", held["total"], paper["total"], "")]
    lines = [f"model state per rank, ZeRO-{zero.stage} on {world_size} rank(s), Ψ = "
             f"{zero.psi:,} trainable:", f"  {'':16}{'measured':>10}  {'ZeRO paper':>10}"]
    lines += [f"  {name:16}{ours / 2**20:>6.2f} MiB  {p / 2**20:>6.2f} MiB  {note}".rstrip()
              for name, ours, p, note in pairs]
    return "\n".join(lines), {"event": "model_state", "psi": zero.psi, "stage": zero.stage,
                              "world_size": world_size, "per_rank": per_rank, "formula": paper,
                              "optimizer": zero.optimizer}


def shape_for(psi, vocab=50257, block=2048):
    """A GPT shape for a bare parameter count, for the activations: width 128 x depth and heads
    128 wide (GPT-3 175B: 96 layers of 12288). Model state uses psi itself."""
    L = max(1, round((psi / (12 * 128**2)) ** (1 / 3)))
    return GPTConfig(block_size=block, vocab_size=vocab, n_layer=L, n_head=L, n_embd=128 * L,
                     bias=False)


def estimate(cfg, world_size=1, stage=0, dtype="fp32", batch=1, seq=None, grad_ckpt=False,
             lora_rank=0, lora_targets=("q", "v"), quantize=None, psi=None, bucket_mb=25.0, rank=0,
             prefetch=True, fp32_grad_accum=False, device="cuda", optimizer="adamw", build=None):
    """Everything one GPU holds, counted on the model cfg describes (model.py's GPT, or
    build(cfg)'s, built shapes-only). psi overrides its parameter count (then cfg only shapes
    the activations). Peak: model state + the larger of the forward/backward working set and the
    optimizer step's fp32 copy of this rank's gradient slice (16-bit only). The working set: the
    activations, under ZeRO-3 the gathered root + 1 block (+ 1 more with prefetch), and the
    larger transient of backward: the loss head's, or the gradient reductions in flight."""
    seq, L, h, E, N = seq or cfg.block_size, cfg.n_layer, cfg.n_embd, BYTES[dtype], world_size
    params = None if psi else param_numels(cfg, build)
    total = psi or sum(n for _, n in params)
    buckets = bucket_sizes(params, stage, dtype, bucket_mb) if params else None
    trainable, frozen, quantized, layout = total, 0, 0, None
    if lora_rank:  # the base model frozen, an A (r x in) and a B (out x r) per target per layer
        trainable, frozen, buckets = lora_numel(cfg, lora_rank, lora_targets, build), total, None
        if quantize:  # the blocks' declared linear weights (a bare --params: GPT-2's 12h^2)
            quantized = (sum(map(sum, quantized_numels(cfg, build))) if params
                         else L * 12 * h * h)
        if stage == 3 and params:
            layout = frozen_buckets(cfg, dtype, quantize, build)
    fp32_grad_accum = fp32_grad_accum and E != 4
    state = model_state_bytes(trainable, stage, N, dtype, buckets, rank, frozen, quantized,
                              quantize, layout, fp32_grad_accum, optimizer)
    acts = activation_bytes(cfg, batch, seq, dtype, grad_ckpt, lora_rank, lora_targets, device,
                            build)
    gathered = 0
    if stage == 3:  # the root and a block gathered (+ the next, prefetched); a frozen base alike
        # the units as bucket_sizes() plans them (root first), else blocks of 12h^2 + 13h
        block = max(buckets[1:]) if buckets else 12 * h * h + 13 * h
        root = buckets[0] if buckets else max(0, total - L * block)
        if quantize:  # QLoRA gathers the 4-bit codes and scales of the matmul weights
            block_bytes = E * (block - 12 * h * h) + QUANT_BYTES[quantize] * 12 * h * h
        else:
            block_bytes = E * math.ceil(block / N) * N
        gathered = E * math.ceil(root / N) * N + (2 if prefetch else 1) * block_bytes
    # stages 2-3 reduce from full-size temporaries; without the real buckets, buckets of the cap
    cap = int(bucket_mb * 2**20 / E) if stage == 2 else 12 * h * h + 13 * h
    sizes = buckets or [min(trainable, cap)] * 2
    in_flight = reduce_in_flight_bytes(sizes, stage, N, dtype)
    head = head_working_bytes(cfg, batch, seq, dtype)
    # the step's fp32 copy of the owned gradient slice (none when the gradients are fp32 already)
    step = 0 if fp32_grad_accum else state["master"]
    peak = state["total"] + max(acts["total"] + gathered + max(head, in_flight), step)
    return {"psi": total, "trainable": trainable, "state": state, "activations": acts,
            "gathered": gathered, "head": head, "in_flight": in_flight, "step": step,
            "peak": peak}


def reduce_in_flight_bytes(buckets, stage, world_size, dtype):
    """Stages 2-3: the full-size gradient temporaries of the reductions in flight, which zero.py
    bounds to MAX_IN_FLIGHT: the largest buckets (numels), padded to a multiple of N."""
    if stage < 2:
        return 0  # stages 0-1 reduce their persistent gradient buffers in place
    padded = sorted((math.ceil(n / world_size) * world_size for n in buckets), reverse=True)
    return BYTES[dtype] * sum(padded[:MAX_IN_FLIGHT])


def fits(est, gpu_bytes):
    return est["peak"] <= (1 - HEADROOM) * gpu_bytes


def max_batch(fits_at, limit=4096):
    """Largest micro-batch b <= limit with fits_at(b), 0 if none. Memory grows with b, so the
    b that fit come first: a binary search for the first that does not is their count."""
    if not fits_at(1):  # one look, not twelve: --advise tries several plans that do not fit
        return 0
    return bisect.bisect_left(range(1, limit + 1), True, key=lambda b: not fits_at(b))


def command(world_size, shape_args, stage, dtype, batch, grad_ckpt=False, lora=False,
            quantize=None, per_node=8):
    """The train.py launch line; beyond one node, run it on each node with its own --node_rank."""
    N = world_size
    launch = "python" if N == 1 else f"torchrun --nproc_per_node={N}"
    if N > per_node:
        launch = (f"torchrun --nnodes={math.ceil(N / per_node)} --nproc_per_node={per_node} "
                  "--node_rank=0 --master_addr=HOST --master_port=29500")
    flags = [f"--zero {stage}" if stage > 0 else "", f"--{dtype}" if dtype != "fp32" else "",
             f"--batch-size {batch}", policy(grad_ckpt).flags(),
             "--lora --lora-rank 8 --lora-targets q,v" if lora else "",
             f"--quantize {quantize}" if quantize else ""]
    return " ".join([launch, "train.py", *shape_args] + [f for f in flags if f])


def advise(cfg, world_size, gpu_bytes, dtype="bf16", psi=None, shape_args=(), batch_tokens=0):
    """The lecture's decision flow, each step checked with estimate(): (lines, command or None).
    LoRA keeps the ZeRO stage the steps before chose: on ZeRO-3 its frozen base is sharded too."""
    N = world_size

    def est(**run):
        return estimate(cfg, **{"world_size": N, "dtype": dtype, "psi": psi, **run})

    scaler = ("with the loss scaler (this GPU has no bf16)" if dtype == "fp16" else
              "(Ampere or newer; on older GPUs pass --dtype fp16: fp16 with the loss scaler)")
    lines = [f"mixed precision, always: {dtype} {scaler}"]
    one = est(world_size=1)
    lines.append(f"batch 1 on one GPU, no ZeRO: peak {one['peak'] / GB:.2f} GB of "
                 f"{(1 - HEADROOM) * gpu_bytes / GB:.1f} GB usable ({gpu_bytes / GB:.0f} GB less "
                 f"{HEADROOM:.0%}): " + ("fits" if fits(one, gpu_bytes) else "does not fit"))
    # (ZeRO stage, grad_ckpt, LoRA rank, quantize, why), tried in order until a micro-batch fits
    if fits(one, gpu_bytes) and N > 1:
        plans = [(2, False, 0, None, f"yes: ZeRO-2 on {N} GPUs (the traffic of data parallelism, "
                  "less memory) and a larger micro-batch")]
    elif fits(one, gpu_bytes):
        plans = [(0, False, 0, None, "yes: one GPU has nothing to shard; a larger micro-batch")]
    else:
        z, sharded = (3, " (ZeRO-3 still shards it)") if N > 1 else (0, "")
        plans = [(3, False, 0, None, f"no: ZeRO-3 on {N} GPUs shards the weights too (1.5x the "
                  "traffic)")] if N > 1 else []
        # the least checkpointing that fits: the pointwise ops, every 2nd block, every block
        plans += [(z, Policy("selective"), 0, None, "+ selective activation checkpointing: the "
                   "blocks keep their matmuls' outputs, recompute the pointwise ops"),
                  (z, Policy("full", 2), 0, None, "+ activation checkpointing of every 2nd "
                   "block: it keeps only its input"),
                  (z, True, 0, None, "+ activation checkpointing: each block keeps only its input"),
                  (z, True, 8, None, "+ LoRA on q,v, r=8: only the adapters train, no gradients "
                   f"or optimizer state for the base{sharded}"),
                  (z, True, 8, "nf4", "+ QLoRA: the frozen base weights in 4-bit NF4")]
    for stage, ckpt, r, quant, why in plans:
        run = dict(stage=stage, grad_ckpt=ckpt, lora_rank=r, quantize=quant)
        b = max_batch(lambda b: fits(est(batch=b, **run), gpu_bytes))
        if batch_tokens:  # --batch-tokens: a micro-batch whose global micro-step divides it
            per_b = cfg.block_size * N
            b = max([d for d in range(1, b + 1) if batch_tokens % (d * per_b) == 0], default=0)
        peak = est(batch=max(b, 1), **run)["peak"] / GB
        lines.append(f"{why}: " + (f"micro-batch up to {b} fits (peak {peak:.2f} GB)" if b
                                   else f"batch 1 needs {peak:.2f} GB"))
        if b:
            break
    else:
        # would a full fine-tune fit on more of these GPUs?
        more = [n for n in (2**k for k in range(13))
                if fits(est(world_size=n, stage=3, grad_ckpt=True), gpu_bytes)]
        lines.append("does not fit: shorten the sequence or take bigger GPUs" + (
            f"; a full fine-tune with ZeRO-3 + checkpointing fits on {more[0]} of these GPUs"
            if more else ""))
    lines = [f"{i + 1}. {line}" for i, line in enumerate(lines)]
    return lines, command(N, shape_args, stage, dtype, b, ckpt, r > 0, quant) if b else None


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


def parse_bytes(text):
    """'80GB' -> 80e9, '24GiB' -> 24 * 2**30 (an '80GB' H100 holds 80 GiB = 85.9 GB)."""
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "TB": 1e12, "GB": 1e9, "MB": 1e6, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        return float(t[:len(t) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        raise ConfigError(f"--gpu-mem {text}: use a size such as 80GB or 24GiB")


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
    p.add_argument("--advise", action="store_true", help="the lecture's decision flow, ending in "
                   "a command")
    a = p.parse_args(argv)
    for name in ("world_size", "params", "vocab"):
        if (getattr(a, name) or 1) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    tc = config_from(a)
    if tc.quantize == "int8":
        raise ConfigError("memory.py models the nf4 base (QLoRA's): use --quantize nf4")
    return a, tc


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
        cfg = GPTConfig(block_size=block, vocab_size=vocab, bias=bias,
                        dropout=0.0 if psi else tc.dropout, **shape)
    except ValueError as e:  # e.g. a width its heads do not divide
        raise ConfigError(str(e))
    preset = a.config and not psi
    flags = [f"--config {a.config}"] if preset else []
    for k, v in {**shape, "block_size": block}.items():
        if not preset or getattr(a, k):
            flags.append(f"--{k.replace('_', '-')} {v}")
    return cfg, flags + (["--bias"] if bias and not preset else [])


def print_estimate(e, cfg, gpu):
    """estimate()'s answer per GPU, whether it fits, and the activations term by term."""
    st, act = e["state"], e["activations"]
    rows = [("weights", st["params"], "working weights (+ the frozen base)"),
            ("gradients", st["grads"], ""), ("fp32 master weights", st["master"], "16-bit only"),
            ("optimizer state", st["optimizer"], "fp32 (AdamW: exp_avg, exp_avg_sq)"),
            ("model state", st["total"], "= ZeRO.state_bytes() at start-up"),
            ("activations", act["total"],
             f"{cfg.n_layer} layers x {fmt(act['per_layer'])} + the rest, below"),
            ("ZeRO-3 gathered units", e["gathered"], "root + a block (+ the prefetched one)"),
            ("loss head, transient", e["head"], "the logits' gradient + a chunk (loss.py)"),
            ("reductions in flight", e["in_flight"], "stages 2-3: two buckets' temporaries"),
            ("step: fp32 grad slice", e["step"], "in the optimizer step, activations freed"),
            ("peak", e["peak"], "state + max(acts + gathered + max(head, in flight), step)")]
    table([[name, fmt(n), note] for name, n, note in rows], ["per GPU", "bytes", ""])
    print(f"GPU {fmt(gpu)}, {(1 - HEADROOM) * gpu / GB:.2f} GB usable ({HEADROOM:.0%} kept for the "
          "CUDA context, fragmentation, transient buffers): "
          + ("fits\n" if fits(e, gpu) else "does NOT fit: try --advise\n"))
    print("Activations saved for backward, per layer and outside the blocks:")
    terms = {**act["layer"], **act["outside"]}
    table([[k, fmt(v)] for k, v in terms.items() if v], ["term", "bytes"])


def main(argv=None):
    a, tc = parse_flags(sys.argv[1:] if argv is None else argv)
    psi = int(a.params) if a.params else None
    cfg, model_flags = model_from_flags(a, tc, psi)
    gpu = parse_bytes(a.gpu_mem)
    if a.advise:  # mixed precision always: bf16 unless fp16 is asked for
        dtype = "fp16" if tc.dtype == "fp16" else "bf16"
        lines, cmd = advise(cfg, a.world_size, gpu, dtype, psi, model_flags, tc.batch_tokens)
        print("\n".join(lines) + ("\n\n" + cmd if cmd else ""))
        if psi:
            print("(the vocabulary comes from --dataset; a bare --params gets this shape: "
                  "pass yours)")
        return cmd
    batch = tc.batch_size if "batch_size" in tc.explicit or not psi else 1
    r, targets = (tc.lora_rank if tc.lora else 0), parse_targets(tc.lora_targets)
    # micro-steps per step, as train.py derives them (--batch-tokens: from this micro-batch)
    accum = grad_accum_for(replace(tc, batch_size=batch, block_size=cfg.block_size), a.world_size)
    ckpt = Policy(tc.grad_ckpt, tc.grad_ckpt_every)
    e = estimate(cfg, a.world_size, tc.zero, tc.dtype, batch, cfg.block_size, ckpt, r,
                 targets, tc.quantize or None, psi, tc.bucket_mb,
                 fp32_grad_accum=tc.fp32_grad_accum and accum > 1)
    extras = ((f", {ckpt.flags()}" if ckpt else "") + (f", LoRA r={r} on {tc.lora_targets}"
              if r else "") + (f", {tc.quantize} base" if tc.quantize else ""))
    print(f"GPT: {e['psi']:,} parameters (L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}, "
          f"vocab {cfg.vocab_size}, block {cfg.block_size}{', bias' if cfg.bias else ''}), "
          f"{e['trainable']:,} trainable; {tc.dtype}, ZeRO-{tc.zero}, {a.world_size} GPU(s), "
          f"micro-batch {batch} x {cfg.block_size} tokens{extras}")
    print_estimate(e, cfg, gpu)
    return e


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        print(f"memory.py: error: {e}", file=sys.stderr)
        sys.exit(2)
