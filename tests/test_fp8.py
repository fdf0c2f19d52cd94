"""fp8.py: the formats from torch.finfo, the motivating underflow of unscaled E4M3 casts, one
FP8 linear against the bf16 reference (dynamic and delayed scaling, padded rows, bias), the
saturation delayed scaling lets through after a spike, the one-line errors, --compile, --lora
and --grad-ckpt with --fp8, ZeRO-0 vs ZeRO-3 on 2 ranks, and an exact resume of the histories."""
import json
import subprocess
import sys

import pytest
import torch

from beyond import fp8
from configurator import UserError, TrainConfig
from configurator import parse_args
from conftest import ROOT, run_distributed, run_train, zero_step
from train import build

SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, dropout=0.0,
             bucket_mb=0.0001, dtype="bf16", fp8=True)
VOCAB = 50
# relative L2 error bounds against the fp32 product of the same bf16 tensors. The formats'
# unit roundoff is 2^-4 (E4M3) and 2^-3 (E5M2); a uniform rounding error has an RMS of u/sqrt(3):
# 0.036 per E4M3 operand, 0.072 per E5M2 one. Forward (two E4M3 operands): sqrt(2) x 0.036 =
# 0.051; a gradient (one E5M2, one E4M3): 0.081. bf16 alone (u = 2^-8) stays below 0.01.
FORWARD_BOUND, GRAD_BOUND = 0.06, 0.095


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_formats_table_is_finfo():
    rows = {r[0]: r[1:] for r in fp8.format_table()}
    assert rows["fp8 E4M3"] == (8, 4, 3, 448.0, 2.0**-6, 2.0**-9, 0.125)
    assert rows["fp8 E5M2"] == (8, 5, 2, 57344.0, 2.0**-14, 2.0**-16, 0.25)
    assert rows["fp16"] == (16, 5, 10, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10)
    assert rows["bf16"][:3] == (16, 8, 7) and rows["int8"][3] == 127
    out = subprocess.run([sys.executable, "-m", "beyond.fp8"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "E4M3" in out.stdout and "57344" in out.stdout


def test_unscaled_e4m3_loses_small_activations_and_scaled_keeps_them():
    """The motivating failure: activations of size ~1e-3 sit below E4M3's smallest subnormal
    (2^-9 = 0.00195), so a cast without a scale turns most of them to zero. A scale from the
    tensor's amax moves them into the format: none is lost."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-3
    stats = torch.zeros(4, dtype=torch.long)
    fp8.cast(x, torch.tensor(1.0), fp8.E4M3, stats)
    assert stats[0] / stats[2] > 0.5  # most values lost
    stats.zero_()
    q = fp8.cast(x, fp8.scale_of(x.abs().amax(), fp8.E4M3), fp8.E4M3, stats)
    assert stats[0] == 0 and stats[1] == 0 and q.float().abs().max() == 448
    # past the max, a plain cast to E5M2 gives inf (torch 2.13 saturates E4M3 on CPU); ours
    # saturates both
    assert torch.tensor([1e6]).to(fp8.E5M2).float().item() == float("inf")
    assert fp8.cast(torch.tensor([1e6]), torch.tensor(1.0), fp8.E5M2).float().item() == 57344
    assert fp8.cast(torch.tensor([1e6]), torch.tensor(1.0), fp8.E4M3).float().item() == 448


def test_the_scale_is_torchaos_for_every_bf16_amax():
    """The scale as torchao's float8 training computes it (torchao/float8/float8_utils.py,
    amax_to_scale): the format's max over the amax, divided in fp64 and rounded once to fp32,
    for every positive finite bf16 amax from 1e-12 (torchao's clamp) up. An fp32 `max / amax`
    is torch's reciprocal times max, two roundings: one ulp off for 5,632 of these (torch 2.13).
    Below 1e-12 torchao caps the scale and ours keeps filling the format; zeros get scale 1."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    amax = bits.float()[bits.float() >= 1e-12]  # 21,491 of the 32,639 positive finite values
    for fmt in (fp8.E4M3, fp8.E5M2):
        torchao = (torch.finfo(fmt).max / amax.double().clamp(min=1e-12)).float()
        assert torch.equal(fp8.scale_of(amax, fmt), torchao), fmt
        tiny = torch.tensor([1e-20, 1e-30, 0.0])
        assert fp8.scale_of(tiny, fmt).tolist()[2] == 1.0
        torch.testing.assert_close(tiny[:2] * fp8.scale_of(tiny[:2], fmt),
                                   torch.full((2,), torch.finfo(fmt).max), rtol=1e-6, atol=0)


def one_step(m, x, w, b, g):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = m(x, w, b)
    y.backward(g)
    return y, x.grad, w.grad, b.grad


@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_fp8_linear_matches_bf16_within_bound(scaling):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 64, generator=gen).bfloat16()  # 21 rows: padded to 32 inside
    w = (torch.randn(96, 64, generator=gen) * 0.02).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    g = (torch.randn(3, 7, 96, generator=gen) * 1e-4).bfloat16()  # gradients are small
    m = fp8.FP8Matmul("test", scaling, history=4)
    for step in range(3):  # delayed: the first step scales dynamically, then from the history
        xs = x * (1 + 0.1 * step)
        y, dx, dw, db = one_step(m, xs, w, b, g)
        fp8.end_step(m_model(m))
        ref = one_step(lambda a, c, d: a.float() @ c.float().t() + d.float(), xs, w, b, g.float())
        assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
        assert rel(y, ref[0]) < FORWARD_BOUND, (step, rel(y, ref[0]))
        assert rel(dx, ref[1]) < GRAD_BOUND and rel(dw, ref[2]) < GRAD_BOUND, step
        assert rel(db, ref[3]) < 0.01  # the bias stays bf16
    if scaling == "delayed":
        assert (m.history[:, 1:4] > 0).all() and (m.history[:, 0] == 0).all()


def m_model(m):
    """A stand-in model holding one FP8Matmul, for end_step."""
    return torch.nn.ModuleList([m])


def test_end_step_shifts_every_history_in_a_few_ops():
    """--fp8-scaling delayed's end of a step: every linear's amax history shifted with a fixed
    number of ops (stacked, shifted, one multi-tensor copy back), not two a linear; the
    histories exactly what shifting each alone gives."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen, counts = [], []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    for n in (2, 6):
        ms = [fp8.FP8Matmul(f"t{i}", "delayed", history=3) for i in range(n)]
        for i, m in enumerate(ms):
            m.history.copy_(torch.rand(m.history.shape) + i)
        want = [torch.cat([torch.zeros(3, 1), m.history[:, :1], m.history[:, 1:-1]], dim=1)
                for m in ms]
        seen.clear()
        with Ops():
            fp8.end_step(torch.nn.ModuleList(ms))
        assert all(torch.equal(m.history, w) for m, w in zip(ms, want))
        counts.append(len(seen))
    assert counts[0] == counts[1], counts


def test_delayed_scaling_saturates_after_a_spike_and_catches_up():
    """Delayed scaling casts with last steps' amax: a tensor 8x larger than its history
    saturates (clamped at 448) until the history has seen it; dynamic scaling never does."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    w = torch.randn(32, 32).bfloat16() * 0.1
    sat = {}
    for scaling in ("dynamic", "delayed"):
        m = fp8.FP8Matmul("t", scaling, history=2)
        model, fracs = m_model(m), []
        fp8.measure(model, True)
        for spike in (1, 1, 8, 8):
            m(x * spike, w)
            fp8.end_step(model)
            fracs.append(fp8.read_stats(model)["fp8_x_saturated"])
        sat[scaling] = fracs
    assert sat["dynamic"] == [0.0] * 4
    assert sat["delayed"][:2] == [0.0, 0.0] and sat["delayed"][2] > 0.3
    assert sat["delayed"][3] == 0.0  # the history now holds the spike


def test_bad_fp8_settings_are_one_line_errors():
    with pytest.raises(UserError, match="add --bf16"):
        parse_args(["--fp8"])
    with pytest.raises(UserError, match="fp8-scaling"):
        parse_args(["--fp8", "--bf16", "--fp8-scaling", "late"])
    cfg = TrainConfig(**{**SHAPE, "n_embd": 40, "n_head": 2})
    with pytest.raises(ValueError, match=r"c_attn is 120x40.*--n-embd a multiple of 16"):
        build(cfg, VOCAB, torch.device("cpu"), torch.bfloat16)


def train_losses(cfg, steps=3):
    model, zero, scaler = build(cfg, VOCAB, torch.device("cpu"), torch.bfloat16)
    gen, out = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, 16), generator=gen)
        loss = model(x, x)[1]
        zero.backward(loss)
        zero_step(zero, scaler, 1e-2, 1.0)
        fp8.end_step(model)
        out.append(loss.item())
    return out, model


@pytest.mark.compiles
def test_compile_grad_ckpt_and_lora_with_fp8():
    """--compile and --grad-ckpt train as eager does (bf16: to its rounding); under LoRA the
    frozen base computes in FP8 and only the adapters move."""
    eager, _ = train_losses(TrainConfig(**SHAPE, fp8_scaling="delayed"))
    ckpt, _ = train_losses(TrainConfig(**SHAPE, fp8_scaling="delayed", grad_ckpt="full"))
    assert ckpt == eager  # the recompute casts exactly as the forward did
    compiled, _ = train_losses(TrainConfig(**SHAPE, fp8_scaling="delayed", compile=True))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=2e-2)
    cfg = TrainConfig(**SHAPE, lora=True, lora_targets="all", grad_ckpt="full")
    losses, model = train_losses(cfg)
    assert losses[-1] < losses[0]
    attn = model.transformer.h[0].attn.c_attn
    assert isinstance(attn, fp8.FP8LoRALinear) and isinstance(attn.fp8, fp8.FP8Matmul)
    assert attn.weight.grad is None


def _stages(rank, world_size, out):
    res = {}
    for stage in (0, 1, 2, 3):
        cfg = TrainConfig(**SHAPE, zero=stage, fp8_scaling="delayed")
        model, zero, scaler = build(cfg, VOCAB, torch.device("cpu"), torch.bfloat16, rank,
                                    world_size)
        gen, losses = torch.Generator().manual_seed(rank), []
        for _ in range(4):
            x = torch.randint(0, VOCAB, (4, 16), generator=gen)
            loss = model(x, x)[1]
            zero.backward(loss)
            zero_step(zero, scaler, 1e-2, 1.0)
            fp8.end_step(model)
            losses.append(loss.item())
        res[stage] = (losses, fp8.state_dict(model)["history"])
    for stage in (1, 2, 3):
        torch.testing.assert_close(res[stage][0], res[0][0], rtol=0, atol=1e-5)
        for name, h in res[0][1].items():  # the same histories
            assert torch.equal(h, res[stage][1][name]), (stage, name)
    # every rank holds the same history (the MAX all-reduce), though each saw its own batches
    flat = torch.cat([h.flatten() for h in res[0][1].values()])
    both = [None] * world_size
    torch.distributed.all_gather_object(both, flat)
    assert torch.equal(both[0], both[1])
    if rank == 0:
        torch.save(res[0][1], out)


def test_zero_stages_0_to_3_give_the_same_fp8_losses_on_2_ranks(tmp_path):
    run_distributed(_stages, 2, str(tmp_path / "h.pt"))
    assert torch.load(tmp_path / "h.pt")  # rank 0 got through


TINY = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
        "16", "--batch-size", "4", "--eval-iters", "2", "--eval-interval", "1000",
        "--log-interval", "1", "--warmup-iters", "2", "--lr-decay-iters", "8", "--dataset",
        "tiny", "--bf16"]


def rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_fp8_resume_is_exact_and_toggling_fp8_says_so(data_root, tmp_path):
    args = TINY + ["--data-root", data_root, "--fp8", "--fp8-scaling", "delayed"]
    run_train(args + ["--max-iters", "6", "--out-dir", str(tmp_path / "full")])
    run_train(args + ["--max-iters", "3", "--out-dir", str(tmp_path / "split")])
    run_train(args + ["--max-iters", "6", "--resume", "--out-dir", str(tmp_path / "split")])
    loss = lambda out: [r["loss"] for r in rows(out) if "loss" in r]
    assert loss(tmp_path / "full") == loss(tmp_path / "split")  # histories restored bitwise
    full = rows(tmp_path / "full")[-3]
    assert 0 <= full["fp8_grad_underflow"] < 0.5 and "fp8_x_saturated" in full
    run_train(TINY + ["--data-root", data_root, "--max-iters", "8", "--resume", "--out-dir",
                      str(tmp_path / "split")])
    note = [r for r in rows(tmp_path / "split") if r.get("event") == "resume"][-1]["note"]
    assert "trained with --fp8; this run computes in bf16" in note


@pytest.mark.parametrize("targets", [(), ("q", "v"), ("attn_out",), ("mlp_proj",)])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_fp8_activations_are_counted_to_the_byte(targets, grad_ckpt):
    """activations.py's FP8 terms against what autograd keeps (CPU): each linear's FP8 input
    cast (rows padded to 16: 3 x 24 = 72 -> 80) and its two scales; a frozen base keeps no cast."""
    from machinery.activations import activation_bytes
    from lora import apply_lora
    from model import GPT, GPTConfig
    from machinery.meter import saved_activation_bytes
    cfg = GPTConfig(block_size=24, vocab_size=50, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg).bfloat16()
    model.grad_ckpt = grad_ckpt
    if targets:
        apply_lora(model, rank=4, targets=targets)
    fp8.convert(model)
    x, y = torch.randint(0, 50, (3, 24)), torch.randint(0, 50, (3, 24))
    out = [0]
    with saved_activation_bytes(model, out):
        model(x, y)
    est = activation_bytes(cfg, 3, 24, "bf16", grad_ckpt, 4 if targets else 0, targets, "cpu",
                           fp8=True)
    assert est["total"] == out[0]
