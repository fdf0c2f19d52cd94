"""precision.py: our GradScaler against torch.amp.GradScaler step for step, the fixed scale,
the floor, fp16 gradient underflow with and without loss scaling, and the found-inf all-reduce
on 2 ranks."""
import copy
import io
import math

import pytest
import torch
import torch.distributed as dist

from conftest import run_distributed
from machinery.report import grad_zero_frac
from precision import GradScaler, resolve_dtype

INJECT = {3: math.inf, 4: -math.inf, 9: math.nan, 10: math.inf, 17: math.nan, 31: math.inf}


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train_step(model, opt, scaler, step):
    """One iteration; some steps get an inf/NaN in a (scaled) gradient and every third step
    clips. torch's scaler: nanoGPT's unscale_ / clip / step / update. Ours: train.py's order,
    with the skip decided by found_inf (fused AdamW takes it on the device; SGD here on the
    host). Returns whether the weights stayed as they were."""
    x, y = _batch(step)
    opt.zero_grad(set_to_none=True)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if step in INJECT:
        model.weight.grad[1, 2] = INJECT[step]
    before = [p.clone() for p in model.parameters()]
    if isinstance(scaler, GradScaler):
        found_inf = scaler.unscale_([p.grad for p in model.parameters()])
        if step % 3 == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not found_inf.item():
            opt.step()
        scaler.update(found_inf)
    else:
        if step % 3 == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped?


def _assert_same(ours, theirs, m1, m2, steps):
    for step in steps:
        skipped1 = _train_step(m1, ours[1], ours[0], step)
        skipped2 = _train_step(m2, theirs[1], theirs[0], step)
        assert skipped1 == skipped2 == (step in INJECT), step
        assert ours[0].get_scale() == theirs[0].get_scale(), step
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p1, p2), step  # bitwise


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("factors", [
    dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    # factors that are not powers of two exercise the fp32 rounding of scale and 1/scale
    dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=3)])
def test_matches_torch_grad_scaler(opt_name, factors):
    torch.manual_seed(0)
    m1 = torch.nn.Linear(6, 3)
    m2 = copy.deepcopy(m1)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)}[opt_name]
    ours = (GradScaler(**factors, min_scale=1e-30), make(m1.parameters()))
    theirs = (torch.amp.GradScaler("cpu", **factors), make(m2.parameters()))
    _assert_same(ours, theirs, m1, m2, range(30))
    assert ours[0].get_scale() != factors["init_scale"]  # it moved (both ways, see INJECT)

    # state_dict round trip through torch.save / torch.load(weights_only=True), then go on
    sd1, sd2 = ours[0].state_dict(), theirs[0].state_dict()
    assert {k: sd1[k] for k in sd2} == sd2  # torch's keys and values (plus dynamic, min_scale)
    loaded = []
    for sd, fresh in [(sd1, GradScaler()), (sd2, torch.amp.GradScaler("cpu"))]:
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        loaded.append(fresh)
    _assert_same((loaded[0], ours[1]), (loaded[1], theirs[1]), m1, m2, range(30, 40))


def test_scale_never_grows_to_inf_and_backoff_resets_tracker():
    ours = GradScaler(2.0**127, growth_interval=1)
    theirs = torch.amp.GradScaler("cpu", 2.0**127, growth_interval=1)
    p = torch.nn.Parameter(torch.zeros(2))
    for grad in [0.0, 0.0, math.nan, 1.0, 1.0]:
        ours.update(ours.unscale_([torch.full((2,), grad)]))
        opt = torch.optim.SGD([p], lr=0.1)
        theirs.scale(p.sum())  # lazily creates torch's scale tensor
        p.grad = torch.full((2,), grad)
        theirs.step(opt)
        theirs.update()
        assert math.isfinite(ours.get_scale()) and ours.get_scale() == theirs.get_scale()
    assert ours.state_dict()["scale"] == theirs.state_dict()["scale"] == 2.0**127  # 2^126 * 2 again
    assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"] == 0


def test_the_floor_stops_a_loss_that_is_nan_at_any_scale():
    """A NaN that no scale can fix: 2^4 backs off to the floor 1.0 in 4 overflowing steps, and
    the fifth, at the floor, marks the scaler exhausted (train.py then stops with one line). The
    scale never reaches 0, which it would after ~150 halvings without a floor."""
    scaler = GradScaler(2.0**4, min_scale=1.0)
    nan = [torch.tensor([math.nan])]
    for step in range(4):
        scaler.update(scaler.unscale_(nan))
        assert not scaler.exhausted.item()
    assert scaler.get_scale() == 1.0
    scaler.update(scaler.unscale_(nan))
    assert scaler.exhausted.item() and scaler.get_scale() == 1.0
    for step in range(200):  # no floor: torch's arithmetic halves down to 0.0
        scaler.update(scaler.unscale_(nan))
    assert scaler.get_scale() == 1.0
    fixed = GradScaler(1.0, dynamic=False)  # bf16: a fixed scale skips, never "exhausts"
    fixed.update(fixed.unscale_(nan))
    assert not fixed.exhausted.item()


def test_unscale_refuses_fp16_gradients():
    with pytest.raises(ValueError, match="FP16"):  # unscale fp32 masters, as torch insists
        GradScaler().unscale_([torch.ones(2, dtype=torch.float16)])


@pytest.mark.parametrize("scale", [1024.0, 1.0])  # --loss-scale 1024 / none (the bf16 case)
def test_fixed_scale_never_changes_but_still_skips(scale):
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(6, 3), None
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), GradScaler(scale, dynamic=False)
    for step in range(12):  # growth_interval is 2000, but a dynamic one would back off at step 3
        x, y = _batch(step)
        ref = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), model.weight)[0]
        skipped = _train_step(model, opt, scaler, step)
        assert skipped == (step in INJECT)
        if not skipped and step % 3 != 0:  # no clipping: the unscaled gradient is the true one
            assert torch.equal(model.weight.grad, ref)  # power-of-two scales unscale exactly
        assert scaler.get_scale() == scale and scaler.state_dict()["_growth_tracker"] == 0


def _grads(dtype, w, b, x, loss_mult, scaler=None):
    """Gradients of a tiny Linear run in `dtype`, fed back as fp32 master gradients: unscaled
    by `scaler` when there is one. Returns (16-bit grads, fp32 master grads)."""
    model = torch.nn.Linear(16, 16).to(dtype)
    with torch.no_grad():
        model.weight.copy_(w), model.bias.copy_(b)
    loss = model(x.to(dtype)).float().pow(2).mean() * loss_mult  # the loss itself in fp32
    (scaler.scale(loss) if scaler else loss).backward()
    low = [model.weight.grad, model.bias.grad]
    master = [g.float() for g in low]
    if scaler:
        assert not scaler.unscale_(master).item()
    return low, master


def test_fp16_gradients_underflow_without_loss_scaling():
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 16), torch.randn(16, 16) * 0.25, torch.randn(16) * 0.1
    w, b = w.half().float(), b.half().float()  # weights every dtype represents exactly
    mult = 1e-6  # a small loss, as late in training: the gradients drop to ~1e-8 < 2^-24
    _, ref = _grads(torch.float32, w, b, x, mult)
    assert grad_zero_frac(ref) == 0.0  # the true gradients are not zero: the test can fail

    fp16, _ = _grads(torch.float16, w, b, x, mult)
    assert grad_zero_frac(fp16) > 0.5  # underflow: most fp16 gradients flushed to zero

    fp16, master = _grads(torch.float16, w, b, x, mult, GradScaler(2.0**16))
    assert grad_zero_frac(fp16) < 0.01  # scaled up by 2^16, they survive in fp16
    for m, r in zip(master, ref):  # and unscaled in fp32 they are the true gradients
        torch.testing.assert_close(m, r, rtol=1e-2, atol=1e-3 * r.abs().max().item())

    bf16, master = _grads(torch.bfloat16, w, b, x, mult)  # bf16: fp32's exponent range, no scale
    assert grad_zero_frac(bf16) < 0.01
    for m, r in zip(master, ref):
        torch.testing.assert_close(m, r, rtol=5e-2, atol=1e-2 * r.abs().max().item())


def _two_ranks_skip_together(rank, world_size):
    # each rank owns one fp32 master slice, like a ZeRO shard; only one rank overflows
    for scaler, bad_rank in [(GradScaler(2.0**16, growth_interval=2), 1),
                             (GradScaler(1.0, dynamic=False), 0)]:  # --loss-scale none (bf16)
        start = scaler.get_scale()
        shard = torch.nn.Parameter(torch.full((4,), float(rank)))
        opt = torch.optim.AdamW([shard], lr=0.1, fused=True)  # skips on found_inf, on the device
        shard.grad = scaler.scale(torch.ones(4))
        if rank == bad_rank:
            shard.grad[2] = math.nan
        found_inf = scaler.unscale_([shard.grad])
        opt.found_inf = found_inf
        opt.step()
        scaler.update(found_inf)
        assert found_inf.item() == 1.0  # on both ranks, not only on the one with the NaN
        assert torch.equal(shard.detach(), torch.full((4,), float(rank)))
        assert opt.state[shard]["step"].item() == 0  # not even Adam's step count moved
        expected = start * 0.5 if scaler.dynamic else start
        scales = [None] * world_size
        dist.all_gather_object(scales, scaler.get_scale())
        assert scales == [expected] * world_size, scales

        shard.grad = scaler.scale(torch.ones(4))  # a clean step: both ranks move
        found_inf = scaler.unscale_([shard.grad])
        opt.found_inf = found_inf
        opt.step()
        scaler.update(found_inf)
        assert found_inf.item() == 0.0
        assert not torch.equal(shard.detach(), torch.full((4,), float(rank)))
        assert torch.equal(shard.grad, torch.ones(4))  # unscaled exactly


def test_found_inf_is_all_reduced_across_ranks():
    run_distributed(_two_ranks_skip_together, 2)


def test_helpers_and_resolve_dtype(monkeypatch):
    assert grad_zero_frac([torch.tensor([0.0, 1.0]), None, torch.zeros(2)]) == 0.75
    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) is torch.float32
    assert resolve_dtype("bf16", cpu) is torch.bfloat16
    assert resolve_dtype("fp16", cpu) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float16", cpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: False)  # a pre-Ampere GPU
    with pytest.raises(ValueError, match="fp16"):
        resolve_dtype("bf16", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: True)
    assert resolve_dtype("bf16", torch.device("cuda", 0)) is torch.bfloat16


def test_tf32_setting_leaves_every_getter_readable():
    """train.py's set-up on CUDA (and bench's) turns TF32 on through precision.set_tf32. Torch's
    per-backend API (matmul.fp32_precision) would make the legacy getters, which inductor still
    reads, raise "mix of the legacy and new APIs" (pytorch#166387): --compile would fail on a
    GPU. The getters must answer after the call, on a CPU too; nothing else sets TF32."""
    import os
    import re
    import precision
    import train
    assert train.set_tf32 is precision.set_tf32  # the call init_distributed makes
    before = torch.get_float32_matmul_precision()
    try:
        precision.set_tf32()
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32 in (True, False)  # answers, never raises
        assert torch.backends.cudnn.allow_tf32 in (True, False)
    finally:
        torch.set_float32_matmul_precision(before)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in ("", "beyond", "machinery", "bench", "data"):
        for name in os.listdir(os.path.join(root, folder)):
            if name.endswith(".py"):
                with open(os.path.join(root, folder, name)) as f:
                    assert not re.search(r"fp32_precision\s*=[^=]", f.read()), (folder, name)
