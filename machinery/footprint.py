"""
The bytes one rank holds, counted on the model itself: the one memory estimator. memory.py
prints it, the start-up table prints it beside the measurement (report.py), and a run that
cannot fit is refused by it before any work (run.check_memory): all through for_run().
Held to measurement by the tests.

  - Rajbhandari et al. 2019, "ZeRO", Sec. 5: model-state bytes per stage (zero.py implements
    them), (2 + 2 + K)Ψ with K from the optimizer (optim.py)
  - Hu et al. 2021, "LoRA"; Dettmers et al. 2023, "QLoRA" (4-bit NF4 base weights)

Model state is exact: the shapes-only model the flags describe is packed by zero.py's own
planner (zero.plan_buckets), padding included, and tests/test_memory.py holds it equal to
ZeRO.state_bytes() (zero.zero_formula is the paper's count, without the padding). Activations
are activations.py's, per module kind; beside them the transients of a step: ZeRO-3's gathered
units, the gradient reductions in flight, the loss head's working set, the optimizer step's
fp32 gradient slice.
"""
import math
from dataclasses import replace

import torch

import optim
from configurator import grad_accum_for, parse_zeropp
from machinery.activations import BYTES, activation_bytes, head_working_bytes, shapes_model
from machinery.validate import parse_targets
from zero import MAX_IN_FLIGHT, plan_buckets

# stored bytes per quantized weight, as quant.py stores nf4 by default: two 4-bit codes per byte
# and an fp32 absmax per block of 64 (4.5 bits). Not modelled: --double-quant, where quant.py
# codes each scale in 8 bits on a log scale (4.129 bits), so the estimate is 0.37 bits high.
QUANT_BYTES = {"nf4": 0.5 + 4 / 64}
# optimizers stepping tensors whole, on beyond/muon.py's layout: Muon (train.py's --optimizer
# muon) and torch's Adafactor (memory.py's --optimizer adafactor only: a fork's loop builds it)
WHOLE = ("muon", "adafactor")

# NCCL's own memory, an estimate: each communicator a process joins keeps its buffers and
# proxy state on the GPU, outside torch's allocator (no torch.cuda counter sees it). One
# report measured about 1.6 GB with one communicator and about 6 GB with three or more
# (NVIDIA/nccl#864); another 0.5-0.7 GB a group on 4 A100s (nccl#964). It grows with the
# channels NCCL opens for bandwidth, communicators share nothing unless split to (nccl#986),
# and NVLS (NVLink SHARP, NCCL_NVLS_ENABLE) adds more: the high figure, a fast node's.
NCCL_BYTES = 1.6e9  # a communicator

def nccl_communicators(world_size, stage, zeropp=(), node_size=0, device="cuda"):
    """The NCCL communicators one rank of a train.py run joins: none on one rank or on gloo;
    the default group; at stages 1-3 the gather group (collectives.gather_group); under ZeRO++
    on several nodes its node group and cross-node group (zeropp.node_groups)."""
    if world_size == 1 or device != "cuda":
        return 0
    k = node_size or world_size
    return 1 + (stage >= 1) + (2 if zeropp and 1 < k < world_size else 0)


def shapes_only(cfg, build=None, lora_rank=0, lora_targets=("q", "v")):
    """The model the flags describe (model.py's GPT, or build(cfg)'s), with LoRA's adapters if
    lora_rank, built on the meta device (once: activations.shapes_model, read-only): every
    shape, nothing allocated. The estimate counts what this model holds, not a formula of
    GPT-2's."""
    return shapes_model(cfg, build, lora_rank, lora_targets if lora_rank else ())


def param_numels(cfg, build=None):
    """(unit, numel) of every parameter in named_parameters() order (a tied weight once): unit
    is the index of the block (the model's blocks()) that holds it, or "root": ZeRO-3's units."""
    model = shapes_only(cfg, build)
    if not callable(getattr(model, "blocks", None)):  # a ValueError its callers can catch
        raise ValueError(f"memory.py counts {type(model).__name__} by its blocks(): declare "
                         "them (docs/forking.md)")
    block_of = {id(p): i for i, blk in enumerate(model.blocks()) for p in blk.parameters()}
    return [(block_of.get(id(p), "root"), p.numel()) for p in model.parameters()]


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
                      optimizer="adamw", dealt=None, offload=False):
    """Bytes of model state on one rank, as ZeRO.state_bytes() counts them at start-up.
    psi: trainable parameters (Ψ), in flat buffers of sizes `buckets` (default: one). Stages 1-3
    pad each buffer to a multiple of N, so every rank owns P/N elements (P: the padded total).
    frozen_psi: frozen parameters (LoRA's base model): outside the gradient and optimizer buffers,
    whole on every rank up to stage 2; quantized_psi of them are stored as `quantize`. Stage 3
    shards them with their unit: each of frozen_layout's (numel, bytes) buffers padded to a
    multiple of N (frozen_buckets()), or without a layout simply 1/N of them. fp32_grad_accum:
    the gradient buffer that accumulates micro-steps is fp32 (4 bytes, not 2). optimizer: its
    state bytes per parameter come from optim.STATE_BYTES (AdamW 8, SGD-momentum and Lion 4).
    dealt: each buffer's numels, dealt whole to ranks (beyond/muon.deal) instead of cut in N.
    offload: the master is a copy in fp32 too (on the host: estimate() moves it there)."""
    if dealt:
        from beyond.muon import deal
    E, N, buckets = BYTES[dtype], world_size, buckets or [psi]
    G = 4 if fp32_grad_accum else E  # bytes per gradient element
    assert sum(buckets) == psi, "the buckets must hold exactly psi parameters"
    padded, real = [math.ceil(n / N) * N if stage >= 1 else n for n in buckets], psi
    if dealt and stage >= 1:  # whole tensors: a rank's slice holds its dealt ones, then zeros
        layouts = [(deal(numels, N), numels) for numels in dealt]
        padded = [numel for (_, numel), _ in layouts]
        real = sum(n for (offsets, numel), numels in layouts for o, n in zip(offsets, numels)
                   if o // (numel // N) == rank)
    elif stage >= 1:  # optimizer state exists for real parameters only: a slice may end in padding
        real = sum(max(0, min(n, (rank + 1) * p // N) - rank * p // N)
                   for n, p in zip(buckets, padded))
    P = sum(padded)
    owned = P // N if stage >= 1 else P
    frozen = E * (frozen_psi - quantized_psi) + QUANT_BYTES.get(quantize, 0) * quantized_psi
    if stage == 3 and frozen:  # sharded with its unit: each buffer padded, or simply 1/N
        frozen = (sum(math.ceil(n / N) * e for n, e in frozen_layout) if frozen_layout
                  else frozen / N)
    out = {"params": E * (owned if stage == 3 else P) + frozen,  # 16-bit (or fp32) working weights
           "grads": G * (owned if stage >= 2 else P),
           # fp32 weights are their own master: no copy (offloaded: a copy on the host)
           "master": 0 if E == 4 and not offload else 4 * owned,
           "optimizer": state_bytes_per_param(optimizer) * real}  # AdamW's two fp32 moments
    out["total"] = sum(out.values())
    return out


def state_bytes_per_param(optimizer):
    """Bytes of optimizer state per trainable parameter: optim.STATE_BYTES for our names (in any
    case: torch.optim.AdamW is "AdamW"); for an optimizer class or a function of the param
    groups, measured: one step on a 1-D fp32 parameter, its state tensors' bytes an element.
    Exact for an elementwise optimizer; one that factors a matrix's statistics (Adafactor)
    keeps less for matrices. A ValueError, one line, for what cannot be counted."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in optim.STATE_BYTES:
            raise ValueError(f"optimizer {optimizer!r}: memory.py knows "
                             f"{', '.join(optim.STATE_BYTES)}, or an optimizer class")
        return optim.STATE_BYTES[optimizer.lower()]
    p = torch.nn.Parameter(torch.zeros(64))
    try:
        opt = optimizer([p])
        p.grad = torch.ones(64)
        opt.step()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"memory.py counts an optimizer's state by one step on a parameter of "
                         f"its own, which {optimizer!r} refused ({e}): pass a name, or "
                         "functools.partial(cls, lr=...)")
    state = [t for t in opt.state[p].values() if torch.is_tensor(t) and t.dim() > 0]
    per = sum(t.numel() * t.element_size() for t in state) / p.numel()
    return int(per) if per.is_integer() else per


def whole_state_bytes(cfg, build, stage, world_size, dtype, bucket_mb, rank, fp32_grad_accum,
                      offload=False, optimizer="muon"):
    """Model state under an optimizer that steps tensors whole (beyond/muon.py): Muon, or
    torch's Adafactor (not a train.py --optimizer: a fork's loop, docs/forking.md). The state
    of each tensor is beyond.muon.state_of's. Stages 1-2: WholeZeRO's layout, the dealt
    tensors (Muon's block matrices, Adafactor's every one) as plan_whole() puts them, each
    whole in one rank's slice, the rest (Muon's AdamW part) in flat buckets of bucket_mb.
    Stage 3: WholeZeRO3's units as beyond.muon.zero3_cost lays them out. Returns (the state,
    as ZeRO.state_bytes() counts it; the elements of every buffer, padding included)."""
    from beyond.muon import block_matrices, deal, plan_whole, state_of, zero3_cost
    model, E, N, muon = shapes_only(cfg, build), BYTES[dtype], world_size, optimizer == "muon"
    if stage == 3:
        units, _, state = zero3_cost(model, N, muon)
        P, mine = sum(numel for _, numel in units), state[rank]
    else:
        params = list(model.parameters())  # in named_parameters() order, a tied weight once
        dealt = block_matrices(model) if muon else {id(p) for p in params}
        of = state_of(model, muon)
        whole = [p for p in params if id(p) in dealt]
        rest = [p.numel() for p in params if id(p) not in dealt]  # Muon's AdamW part
        P, mine = sum(rest), 8 * sum(rest)
        if stage == 0:  # every rank owns every tensor, in zero.py's buckets
            P, mine = P + sum(p.numel() for p in whole), mine + sum(of(p) for p in whole)
        else:
            cap = max(1, int(bucket_mb * 2**20 / BYTES[dtype]))
            flat = [sum(rest[i] for i in b) for b in plan_buckets(rest, cap)]
            padded = [math.ceil(n / N) * N for n in flat]
            P = sum(padded)  # each cut in N: AdamW's moments for the real elements of a slice
            mine = 8 * sum(max(0, min(n, (rank + 1) * p // N) - rank * p // N)
                           for n, p in zip(flat, padded))
            for b in plan_whole([p.shape for p in whole], cap, N):
                offsets, numel = deal([whole[i].numel() for i in b], N)
                P += numel
                mine += sum(of(whole[i]) for i, o in zip(b, offsets) if o // (numel // N) == rank)
    owned = P // N if stage >= 1 else P
    out = {"params": E * (owned if stage == 3 else P),
           "grads": (4 if fp32_grad_accum else E) * (owned if stage >= 2 else P),
           # fp32 weights are their own master (offloaded: a copy on the host)
           "master": 0 if E == 4 and not offload else 4 * owned, "optimizer": mine}
    out["total"] = sum(out.values())
    return out, P


def whole_layout(cfg, build, stage, N, dtype, bucket_mb, rank, fp32_grad_accum, offload,
                 optimizer, params, lora_rank, buckets):
    """estimate()'s model state under Muon or Adafactor, on their own layout: (the state, the
    padded elements, the buckets as gathered: at stage 3 the units padded as dealt)."""
    if not params or lora_rank:  # Adafactor's state is per matrix: counted on the shapes only
        raise ValueError("memory.py counts Adafactor's state on the model's own shapes, for a "
                         "full fine-tune: give the shape (--n-layer, --n-embd, --n-head or "
                         "--config), not --params, and no --lora")
    state, padded = whole_state_bytes(cfg, build, stage, N, dtype, bucket_mb, rank,
                                      fp32_grad_accum, offload, optimizer)
    if stage == 3:  # the units padded as dealt: gathered and reduced at that size
        from beyond.muon import zero3_cost
        buckets = [numel for _, numel in
                   zero3_cost(shapes_only(cfg, build), N, optimizer == "muon")[0]]
    return state, padded, buckets


def estimate(cfg, world_size=1, stage=0, dtype="fp32", batch=1, seq=None, grad_ckpt=False,
             lora_rank=0, lora_targets=("q", "v"), quantize=None, psi=None, bucket_mb=25.0, rank=0,
             prefetch=True, fp32_grad_accum=False, device="cuda", optimizer="adamw", build=None,
             zeropp=(), node_size=0, fp8=False, fp8_history=16, chunked_loss=False,
             offload=False):
    """Everything one GPU holds, counted on the model cfg describes (model.py's GPT, or
    build(cfg)'s, built shapes-only). psi overrides its parameter count (then cfg only shapes
    the activations). Peak: model state + the larger of the forward/backward working set and the
    optimizer step's fp32 copy of this rank's gradient slice (16-bit only), + NCCL's
    communicators (an allowance: NCCL_BYTES each). The working set: the activations, under
    ZeRO-3 the gathered root + 1 block (+ 1 more with prefetch), and the larger transient of
    backward: the loss head's, or the gradient reductions in flight."""
    seq, E, N = seq or cfg.block_size, BYTES[dtype], world_size
    # the shape's sizes where a formula needs them (--fp8, a bare --params): a fork's config
    # may name its own
    L, h = getattr(cfg, "n_layer", 0), getattr(cfg, "n_embd", 0)
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
    padded = None  # the elements of the trainable buffers, padding included: of a dealt layout
    if optimizer in WHOLE and (optimizer == "adafactor" or (params and not lora_rank)):
        state, padded, buckets = whole_layout(cfg, build, stage, N, dtype, bucket_mb, rank,
                                              fp32_grad_accum, offload, optimizer, params,
                                              lora_rank, buckets)
    else:
        state = model_state_bytes(trainable, stage, N, dtype, buckets, rank, frozen, quantized,
                                  quantize, layout, fp32_grad_accum, optimizer, offload=offload)
    host = offload_host_bytes(state, E, offload)
    if offload:  # the master and the optimizer state live on the host (offload_optimizer.py)
        state = dict(state, master=0, optimizer=0)
        state["total"] = state["params"] + state["grads"]
    acts = activation_bytes(cfg, batch, seq, dtype, grad_ckpt, lora_rank, lora_targets, device,
                            build, fp8, chunked_loss, unknown_ok=True)
    # --fp8: per linear an amax history and cast counters (fp8.FP8Matmul's buffers), and in a
    # block's backward the largest cast's fp32 copy, FP8 result and transposed copy (6 bytes a
    # value of the widest input, b*s x 4h): an estimate, not a measurement
    fp8_state = 4 * L * (12 * (fp8_history + 1) + 96) if fp8 else 0
    cast = 6 * batch * seq * 4 * h if fp8 else 0
    gathered = 0
    if stage == 3:  # the root and a block gathered (+ the next, prefetched); a frozen base alike
        # (the root stays gathered across micro-steps too, when no block is: the same peak)
        # the units as bucket_sizes() plans them (root first), else blocks of 12h^2 + 13h
        block = max(buckets[1:]) if buckets else 12 * h * h + 13 * h
        root = buckets[0] if buckets else max(0, total - L * block)
        if quantize:  # QLoRA gathers the 4-bit codes and scales of the matmul weights
            block_bytes = E * (block - 12 * h * h) + QUANT_BYTES[quantize] * 12 * h * h
        else:
            block_bytes = E * math.ceil(block / N) * N
        gathered = E * math.ceil(root / N) * N + (2 if prefetch else 1) * block_bytes
        if zeropp and buckets:  # ZeRO++'s second shards and code buffers (zeropp.py)
            from beyond.zeropp import working_bytes
            gathered += working_bytes(buckets[1:], N, node_size or N, E, zeropp)
    # stages 2-3 reduce from full-size temporaries; without the real buckets, buckets of the cap
    cap = int(bucket_mb * 2**20 / E) if stage == 2 else 12 * h * h + 13 * h
    sizes = buckets or [min(trainable, cap)] * 2
    in_flight = reduce_in_flight_bytes(sizes, stage, N, dtype)
    head = head_working_bytes(cfg, batch, seq, dtype, chunked_loss)
    # the step's fp32 copy of the owned gradient slice (none when the gradients are fp32 already)
    # (offloaded: it is on the host, allocated once, in `host`)
    step = 0 if fp32_grad_accum or offload else state["master"]
    communicators = nccl_communicators(N, stage, zeropp, node_size, device)
    nccl = NCCL_BYTES * communicators  # outside torch's allocator, on the GPU all the same
    peak = state["total"] + fp8_state + max(acts["total"] + gathered + max(head, in_flight + cast),
                                            step) + nccl
    if device == "cpu":  # a CPU run's host is its device: the offloaded bytes are there too
        peak += host["total"]
    return {"psi": total, "trainable": trainable, "state": state, "activations": acts,
            "gathered": gathered, "head": head, "in_flight": in_flight, "step": step,
            "fp8_state": fp8_state, "fp8_cast": cast, "nccl": nccl,
            "communicators": communicators, "peak": peak, "host": host, "padded": padded}


def offload_host_bytes(state, E, offload):
    """--offload-optimizer: the host bytes of one rank, as OffloadOptimizer.host_bytes() counts
    them: the fp32 master of the owned slice (state's, made with offload: a copy in fp32 too),
    the optimizer state, an fp32 gradient slice as large as the master, and in 16 bits a
    staging slice of E bytes an owned element. All zeros without offload."""
    master = state["master"]  # 4 bytes an owned element
    out = {"master": master, "optimizer": state["optimizer"], "grads": master,
           "staging": 0 if E == 4 else master // 4 * E}
    if offload == "delayed":  # DPU: a second gradient slice, and a snapshot of the weights
        out["grads"] += master
        out["staging"] += master // 4 * E
    if not offload:
        out = dict.fromkeys(out, 0)
    out["total"] = sum(out.values())
    return out


def for_run(tc, cfg, world_size, rank=0, psi=None, batch=None, device="cuda"):
    """estimate() of a train.py run: its flags tc (a TrainConfig) on the model cfg, as rank
    `rank` of world_size holds it; batch (default: --batch-size) and psi (a bare parameter
    count) as memory.py asks. The micro-steps per step come as train.py derives them."""
    batch = batch or tc.batch_size
    r = tc.lora_rank if tc.lora else 0
    accum = grad_accum_for(replace(tc, batch_size=batch, block_size=cfg.block_size), world_size)
    ckpt = False
    if tc.grad_ckpt != "none":  # a technique from after the lecture: asked for by the flag
        from beyond.activation_dial import Policy
        ckpt = Policy(tc.grad_ckpt, tc.grad_ckpt_every)
    targets = parse_targets(tc.lora_targets) if r else ()  # the model's LINEARS: LoRA's only
    return estimate(cfg, world_size, tc.zero, tc.dtype, batch,
                    getattr(cfg, "block_size", tc.block_size), ckpt, r, targets,
                    tc.quantize or None, psi, tc.bucket_mb, rank,
                    fp32_grad_accum=tc.fp32_grad_accum and accum > 1,
                    zeropp=parse_zeropp(tc.zeropp), node_size=tc.node_size, fp8=tc.fp8,
                    fp8_history=tc.fp8_amax_history, chunked_loss=tc.chunked_loss,
                    optimizer=tc.optimizer, prefetch=tc.prefetch, device=device,
                    offload={"none": False, "delayed": "delayed"}.get(tc.offload_optimizer,
                                                                       True))


def reduce_in_flight_bytes(buckets, stage, world_size, dtype):
    """Stages 2-3: the full-size gradient temporaries of the reductions in flight, which zero.py
    bounds to MAX_IN_FLIGHT: the largest buckets (numels), padded to a multiple of N; and beside
    them the next bucket's gradients, whole until the bucket is complete and packed (zero.py's
    _grads_to_flat): one largest bucket more (memory.py --measure found it)."""
    if stage < 2:
        return 0  # stages 0-1 reduce their persistent gradient buffers in place
    padded = sorted((math.ceil(n / world_size) * world_size for n in buckets), reverse=True)
    return BYTES[dtype] * (sum(padded[:MAX_IN_FLIGHT]) + max(buckets))


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
