"""ZeRO stages 0-3 against plain single-process training, where real ZeRO implementations break:
the clipping norm across shards, every rank agreeing on an overflow before skipping a step, the
loss-scale state machine, 16-bit gradients reduced without overflow, ZeRO-3 under non-reentrant
activation checkpointing, the tied embedding, equal padded chunks, the same collectives in the
same order on every rank, gradient accumulation under sharding, and the traffic per step.

The reference is the textbook loop: one process, the model in fp32, torch.optim.AdamW with
the same decay groups, torch.nn.utils.clip_grad_norm_, gradient accumulation, fed the global
batch (every rank's slice concatenated). Our N-rank runs must land on the same weights.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import checkpoint
from conftest import make_zero, run_distributed, zero_step
from model import GPT, GPTConfig
from precision import GradScaler
from data.loader import get_batch
from collectives import Traffic
from machinery.guard import HeldGrad
from zero import ZeRO, zero_formula

# 2 layers, n_embd 10, vocab 13, bias: Ψ = 2,890 (tied wte counted once) -- not a multiple of 4
CFG = dict(block_size=8, vocab_size=13, n_layer=2, n_head=2, n_embd=10, dropout=0.0, bias=True)
B, T, ACCUM, STEPS, LR, CLIP, SEED = 2, 8, 2, 4, 1e-2, 0.02, 1234
DATA = np.random.default_rng(0).integers(0, 13, 4000).astype(np.uint16)


def make_model(dtype=torch.float32, freeze_wpe=False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG)).to(dtype)
    if freeze_wpe:  # a frozen parameter: no gradient, no optimizer slice, still in the model
        model.transformer.wpe.weight.requires_grad_(False)
    return model


def reference(world_size, freeze_wpe=False, steps=STEPS):
    """One process, fp32, torch.optim.AdamW, on the global batch of world_size ranks."""
    model = make_model(freeze_wpe=freeze_wpe)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    norms = []
    for step in range(steps):
        for micro in range(ACCUM):
            x, y = get_batch(DATA, SEED, step, micro, 0, 1, B * world_size, T, ACCUM)
            (model(x, y)[1] / ACCUM).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        opt.zero_grad()
    return model, norms


def train_zero(stage, rank, world_size, dtype=torch.float32, freeze_wpe=False, bucket_mb=0.002,
               steps=STEPS, scaler=None, check_replicas=True, grad_ckpt=False, prefetch=True):
    model = make_model(dtype, freeze_wpe)
    model.grad_ckpt = grad_ckpt
    zero = make_zero(model, stage, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=bucket_mb,
                     rank=rank, world_size=world_size, prefetch=prefetch)
    scaler = scaler or GradScaler(init_scale=1.0, dynamic=False)
    norms, traffic = [], []
    for step in range(steps):
        zero.traffic = Traffic()
        for micro in range(ACCUM):
            x, y = get_batch(DATA, SEED, step, micro, rank, world_size, B, T, ACCUM)
            zero.backward(scaler.scale(model(x, y)[1] / ACCUM), sync=micro == ACCUM - 1)
        norm, _ = zero_step(zero, scaler, LR, CLIP)
        norms.append(norm)
        traffic.append(zero.traffic.elements)
        if stage == 3:
            # between steps no rank holds a full block parameter: only the shards have storage
            assert all(p.untyped_storage().nbytes() == 0 for p in model.transformer.h.parameters())
            assert zero.gathered_bytes == 0
        elif check_replicas:
            assert_replicas_equal(model, world_size)
    if stage == 3:  # compare as the checkpoint writer sees it: gathered unit by unit onto rank 0
        model = gathered_copy(model, zero)
    return model, zero, norms, traffic


def gathered_copy(model, zero):
    """The full fp32 weights of a ZeRO-3 model in a fresh GPT (the same on every rank)."""
    state = checkpoint.state_dict(zero, model)
    objs = [state]
    if zero.world_size > 1:
        dist.broadcast_object_list(objs, src=0)
    copy = GPT(GPTConfig(**CFG))
    copy.load_weights(objs[0])
    return copy


def assert_replicas_equal(model, world_size):
    """Every rank holds bitwise the same full parameters after every step."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat) if world_size > 1 else gathered.__setitem__(0, flat)
    for other in gathered:
        assert torch.equal(other, flat), "ranks hold different parameters"


def assert_close_to(model, ref, rtol, atol):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach(), rtol=rtol, atol=atol, msg=name)


def _equivalence(rank, world_size, stage):
    ref, ref_norms = reference(world_size)
    ref_frozen, _ = reference(world_size, freeze_wpe=True)
    model, zero, norms, traffic = train_zero(stage, rank, world_size)
    # fp32: the same math in another summation order (all-reduce, pre-division by N), so
    # gradients differ in their last bits (~1e-7 relative). Adam's g/sqrt(v) passes that on
    # unchanged, and for tiny gradient entries eps makes it worse: measured up to ~1e-6
    # absolute after 4 steps of LR=1e-2, i.e. 1e-4 of one step. Tolerance: 5e-6 + 1e-5 rel.
    assert_close_to(model, ref, rtol=1e-5, atol=5e-6)
    # the global clipping norm equals clip_grad_norm_ on the unsharded gradient, and the
    # norm is far above CLIP, so clipping was active and the weights above prove its effect
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert min(ref_norms) > 10 * CLIP

    # model-state bytes: what we hold equals the ZeRO paper's formula, padding aside
    held, formula = zero.state_bytes(), zero_formula(zero.psi, stage, world_size, torch.float32)
    pad = sum(b.numel for b in zero.buckets) - zero.psi  # padded elements, < N per bucket
    assert 0 <= pad < world_size * len(zero.buckets)
    assert abs(held["params"] - formula["params"]) <= 4 * pad
    assert abs(held["grads"] - formula["grads"]) <= 4 * pad
    assert abs(held["optimizer"] - formula["optimizer_side"]) <= 8 * pad
    assert held["master"] == 0  # fp32: the parameters are the master
    # traffic per step: 2Ψ elements for stages 0-1 (all-reduce = reduce-scatter + all-gather);
    # stage 2 reduce-scatters on every one of the ACCUM micro-steps: (ACCUM+1)Ψ; stage 3
    # gathers in forward, again in backward, and reduce-scatters, per micro-step: 3Ψ,
    # less the root unit's: it stays gathered through the backward and across the step's
    # micro-steps, so it is gathered once a step (and reduce-scattered every micro-step)
    root = sum(p.numel() for p in zero.root.buckets[0].params) if stage == 3 else 0
    expected = ACCUM * (3 * zero.psi - 2 * root) + root if stage == 3 \
        else (ACCUM + 1) * zero.psi if stage == 2 else 2 * zero.psi
    expected = expected if world_size > 1 else 0
    for t in traffic:
        assert abs(t - expected) <= 3 * ACCUM * pad, (stage, t, expected)

    # activation checkpointing changes nothing: the recompute is the same fp32 arithmetic on
    # the same inputs, so the weights are bitwise equal (with and without ZeRO-3 prefetch:
    # the recompute re-runs the block's forward, so it must find its weights gathered again)
    for prefetch in ((True, False) if stage == 3 else (True,)):
        ckpt, _, ckpt_norms, _ = train_zero(stage, rank, world_size, grad_ckpt=True, prefetch=prefetch)
        for p, q in zip(ckpt.parameters(), model.parameters()):
            assert torch.equal(p, q), (stage, prefetch)
        assert ckpt_norms == norms

    # tied embedding + frozen parameter: trains identically sharded and unsharded
    model, zero, _, _ = train_zero(stage, rank, world_size, freeze_wpe=True, steps=STEPS)
    assert_close_to(model, ref_frozen, rtol=1e-5, atol=5e-6)
    assert zero.psi == ref_frozen.num_params(non_embedding=True)  # wte once, wpe frozen
    assert model.transformer.wpe.weight.grad is None
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_equals_single_process(stage, world_size):
    run_distributed(_equivalence, world_size, stage)


def _mixed_precision(rank, world_size):
    """bf16 / fp16 on N ranks against our own 1-process run of the same dtype (computed on each
    rank without communication, on the N-times larger micro-batch), then an fp16 overflow on
    one rank only."""
    import test_zero
    theta0 = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
    flat = lambda m: torch.cat([p.detach().float().reshape(-1) for p in m.parameters()])
    # 16-bit rounding of the gradients (2^-9 relative in bf16, 2^-12 in fp16) happens in
    # another order on N ranks (pre-division by N, a sum of N slices): the gradient norms
    # agree to a few such roundings. Weights: Adam's normalised update amplifies rounding in
    # near-zero gradient entries up to a whole LR step, so we compare the whole update
    # (theta_K - theta_0) in L2: measured 2-3% apart in bf16 and 0.3% in fp16 after 3 steps (2 and 4 ranks).
    for dtype, norm_rtol, update_rtol in ((torch.bfloat16, 2 ** -6, 0.15), (torch.float16, 2 ** -9, 0.02)):
        for stage in (0, 2, 3):
            scaler = lambda: GradScaler(dynamic=True) if dtype == torch.float16 else None
            model, zero, norms, _ = train_zero(stage, rank, world_size, dtype, steps=3, scaler=scaler())
            micro_batch = test_zero.B
            test_zero.B = micro_batch * world_size  # one process, the whole global batch
            one, _, one_norms, _ = train_zero(stage, 0, 1, dtype, steps=3, scaler=scaler(), check_replicas=False)
            test_zero.B = micro_batch
            assert all(p.dtype == dtype for p in zero.buckets[0].params)
            assert all(piece.dtype == torch.float32 for piece in zero.master)
            np.testing.assert_allclose(norms, one_norms, rtol=norm_rtol)
            update, one_update = flat(model) - theta0, flat(one) - theta0
            assert (update - one_update).norm() <= update_rtol * one_update.norm(), (dtype, stage)
            held = zero.state_bytes()
            formula = zero_formula(zero.psi, stage, world_size, dtype)
            assert abs(held["total"] - formula["total"]) <= 16 * world_size * len(zero.buckets)

    # an fp16 overflow on one rank only: every rank must skip the step together
    for stage in (0, 1, 2, 3):
        model = make_model(torch.float16)
        zero = make_zero(model, stage, lr=LR, bucket_mb=0.002, rank=rank, world_size=world_size)
        scaler = GradScaler(init_scale=2.0 ** 10, dynamic=True)
        before = [t.detach().clone() for t in zero.master]  # this rank's weights
        x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
        zero.backward(scaler.scale(model(x, y)[1]))
        if rank == world_size - 1:  # after the reduction: only this rank's slice sees it
            # (.data: an overflow as the reduction makes one, not a change of the loop's, which
            # zero.py refuses; .data has a version counter of its own)
            zero.buckets[0].owned_grad().data[0] = float("inf")
        _, skipped = zero_step(zero, scaler, LR, CLIP)
        assert skipped and scaler.get_scale() == 2.0 ** 9
        for t, u in zip(zero.master, before):
            assert torch.equal(t, u)
        if stage < 3:
            assert_replicas_equal(model, world_size)
        # and the next clean step goes through on every rank
        zero.backward(scaler.scale(model(x, y)[1]))
        assert not zero_step(zero, scaler, LR, CLIP)[1]
        if stage < 3:
            assert_replicas_equal(model, world_size)


def test_mixed_precision_and_overflow_world_2():
    run_distributed(_mixed_precision, 2)


def test_gradient_accumulation_stage2_frees_full_gradients():
    """Stage 2 keeps no parameter .grad after backward: the lecture's engine releases each once
    copied (None), the guarded one a loop imports puts a storage-less HeldGrad in its place
    (machinery/guard.py); stages 0-1 keep the bucket views."""
    for stage, guarded in ((0, False), (1, False), (2, False), (2, True)):
        model = make_model()
        zero = (make_zero if guarded else ZeRO)(model, stage, bucket_mb=0.002)
        x, y = get_batch(DATA, SEED, 0, 0, 0, 1, B, T, 1)
        zero.backward(model(x, y)[1])
        grads = [p.grad for p in model.parameters()]
        if stage == 2:
            assert all(isinstance(g, HeldGrad) if guarded else g is None for g in grads)
            assert all(b.flat_grad is None for b in zero.buckets)
        else:
            assert all(g is not None and g.untyped_storage().data_ptr() in
                       {b.flat_grad.untyped_storage().data_ptr() for b in zero.buckets} for g in grads)


def test_16_bit_training_follows_the_fp32_loss_curve():
    """bf16 and fp16 (with the dynamic scaler) against fp32, one process, 10 steps, the same batches.
    The weights and activations are rounded to 8 (bf16) or 11 (fp16) significant bits, but the
    update is computed on fp32 masters, so the curves do not drift apart: measured at most 0.05%
    (bf16) and 0.004% (fp16) apart per step; we allow 10x that: 0.5% and 0.05%."""
    curves = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = make_model(dtype)
        zero = ZeRO(model, 0, lr=LR, betas=(0.9, 0.95))
        scaler = GradScaler(dynamic=True) if dtype == torch.float16 else GradScaler(init_scale=1.0, dynamic=False)
        curve = []
        for step in range(10):
            x, y = get_batch(DATA, SEED, step, 0, 0, 1, 4, T, 1)
            loss = model(x, y)[1]
            curve.append(loss.item())
            zero.backward(scaler.scale(loss))
            assert not zero_step(zero, scaler, LR, CLIP)[1]
        curves[dtype] = np.array(curve)
        assert all(piece.dtype == torch.float32 for piece in zero.master)
    assert curves[torch.float32][-1] < curves[torch.float32][0] - 0.03  # it learns
    np.testing.assert_allclose(curves[torch.bfloat16], curves[torch.float32], rtol=5e-3)
    np.testing.assert_allclose(curves[torch.float16], curves[torch.float32], rtol=5e-4)


@pytest.mark.parametrize("stage", [0, 2])  # stage 3 accumulates as stage 2 does
def test_fp32_gradient_accumulation_lands_closer_to_fp32(stage):
    """bf16 over 32 micro-steps: the sum of the micro-steps' gradients, kept in a bf16 buffer,
    loses the small contributions; kept in fp32 (fp32_grad_accum, train.py's default for 16-bit
    runs with --grad-accum > 1) it stays near what an fp32 model accumulates. One rank; the
    gradient each stage hands the optimizer, compared with an fp32 model's."""
    steps = 32

    def accumulated(dtype, fp32_accum):
        model = make_model(dtype)
        zero = make_zero(model, stage, bucket_mb=0.002, fp32_grad_accum=fp32_accum)
        for micro in range(steps):
            x, y = get_batch(DATA, SEED, 0, micro, 0, 1, B, T, steps)
            zero.backward(model(x, y)[1] / steps, sync=micro == steps - 1)
        return torch.cat([g.reshape(-1) for g in zero.master_grads()])

    ref = accumulated(torch.float32, False)
    err = {acc: (accumulated(torch.bfloat16, acc) - ref).norm() / ref.norm() for acc in (False, True)}
    # both see the bf16 forward's rounding; only one also rounds the running sum to 8 bits
    # (measured: 0.45% vs 0.80% of the gradient's norm)
    assert err[True] < 0.7 * err[False], err


# ----------------------------------------------------------------------------------------------
# the naive version: the idea in one screen, held equal to the engine train.py runs

def check_naive_equals_the_engine(rank, world_size):
    """NaiveZeRO (one flat buffer, one reduce-scatter, AdamW on the fp32 slice, one all-gather,
    all after a plain backward) lands on the weights ZeRO stages 1 and 2 land on, to 1e-6. No
    biases: the key bias's gradient is zero but for rounding (softmax ignores a shift), and
    AdamW's normalised step turns that last bit into a step of lr either way.
    One AdamW group, no decay and no clipping: the naive version has neither. It moves the
    paper's 2Ψ (padded) a step, as the engine does."""
    from zero import NaiveZeRO
    results = {}
    for kind in ("naive", 1, 2):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**dict(CFG, bias=False)))
        if kind == "naive":
            zero = NaiveZeRO(model, world_size, rank, lr=LR, betas=(0.9, 0.95))
        else:
            zero = make_zero(model, kind, lr=LR, weight_decay=0.0, bucket_mb=0.002, rank=rank,
                             world_size=world_size)
        traffic = []
        for step in range(STEPS):
            x, y = get_batch(DATA, SEED, step, 0, rank, world_size, B, T, 1)
            if kind == "naive":
                zero.traffic = Traffic()
                model.zero_grad()
                model(x, y)[1].backward()
                zero.step()
            else:
                zero.traffic = Traffic()
                zero.backward(model(x, y)[1])
                zero.master_grads()
                zero.step(LR)
                zero.publish()
                zero.zero_grad()
            traffic.append(zero.traffic.elements)
        results[kind] = ([p.detach().clone() for p in model.parameters()], traffic)
    naive, naive_traffic = results["naive"]
    psi = sum(p.numel() for p in naive)
    assert naive_traffic[0] == 2 * (psi + -psi % world_size)  # 2Ψ, Ψ padded to N slices
    torch.manual_seed(0)
    start = [p.detach() for p in GPT(GPTConfig(**dict(CFG, bias=False))).parameters()]
    for stage in (1, 2):
        for a, b, s in zip(naive, results[stage][0], start):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            assert not torch.equal(a, s)  # every weight moved: the test can fail


@pytest.mark.parametrize("world_size", [2, 3])
def test_naive_zero_equals_the_engine(world_size):
    run_distributed(check_naive_equals_the_engine, world_size)
