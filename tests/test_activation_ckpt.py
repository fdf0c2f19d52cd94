"""beyond/activation_dial.py: the dial's flags, losses and gradients equal to no checkpointing (bitwise in
fp32) for every policy and K under ZeRO 0-3 and LoRA, memory.py's activation estimate equal to
the bytes measured for each, the ordering a learner should see (none > selective > every-K >
full), --advise trying the least checkpointing first, the offload hooks' logic on a CPU with a
stand-in for the device, --compile, and a resume that changes the setting."""
import json
import os

import pytest
import torch

import lora
import quant
from machinery import validate
from beyond.activation_dial import Policy, policy
from beyond.offload import Offload, install_offload
from machinery.activations import activation_bytes
from configurator import UserError, TrainConfig
from configurator import parse_args
from conftest import make_zero, run_distributed, run_train, zero_step
from memory import advise, estimate
from machinery.estimator import parse_bytes, shape_for
from model import GPT, GPTConfig
from machinery.meter import saved_activation_bytes
from precision import GradScaler

SETTINGS = [Policy(k, K) for k in ("full", "selective") for K in (1, 2, 3)]
TINY = dict(block_size=16, vocab_size=40, n_layer=3, n_head=2, n_embd=32, bias=True)


def test_flags():
    assert parse_args([]).grad_ckpt == "none"
    assert parse_args(["--grad-ckpt"]).grad_ckpt == "full"  # bare: as before
    assert parse_args(["--grad-ckpt", "--lora"]).grad_ckpt == "full"
    assert parse_args(["--grad-ckpt", "selective"]).grad_ckpt == "selective"
    assert parse_args(["--grad-ckpt", "--no-grad-ckpt"]).grad_ckpt == "none"
    assert parse_args(["--grad-ckpt", "--grad-ckpt-every", "2"]).grad_ckpt_every == 2
    for argv, message in ((["--grad-ckpt", "some"], "--grad-ckpt some: use none, full, selective"),
                          (["--grad-ckpt-every", "0"], "--grad-ckpt-every must be at least 1"),
                          (["--grad-ckpt-every", "2"], "add --grad-ckpt \\[full\\|selective\\]")):
        with pytest.raises(UserError, match=message):
            parse_args(argv)
    assert policy(True) == Policy("full") and not policy(False) and not Policy("none", 3)
    assert Policy("selective", 2).flags() == "--grad-ckpt selective --grad-ckpt-every 2"
    assert [Policy("full", 2).applies(i) for i in range(4)] == [True, False, True, False]


def test_preset_with_a_bool_and_an_old_checkpoint(tmp_path):
    preset = tmp_path / "old.py"  # from when --grad-ckpt was a switch: refused, with the fix
    preset.write_text("grad_ckpt = True\n")
    with pytest.raises(UserError, match="grad_ckpt must be str \\('none', 'full', "
                                          "'selective'\\), got True"):
        parse_args(["--config", str(preset)])
    # the checkpoint's config is compared only for the settings that matter (not this one)
    header = {"model_args": {}, "config": {"grad_ckpt": True, "lora": False}}
    validate.check_compatible(header, {}, None, "ckpt", config={"grad_ckpt": "selective",
                                                                "lora": False})


def grads_and_losses(ckpt, dtype=torch.float32, dropout=0.1):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, dropout=dropout)).to(dtype)
    model.grad_ckpt = ckpt
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x, y = (torch.randint(0, 40, (3, 16), generator=g) for _ in range(2))
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_same_losses_and_gradients_bitwise(dtype):
    """With dropout: the recompute replays the same RNG and the same arithmetic (on a CPU in
    16 bits too)."""
    ref_losses, ref_grads = grads_and_losses(False, dtype)
    for ckpt in SETTINGS if dtype == torch.float32 else SETTINGS[:2] + SETTINGS[3:5]:
        losses, grads = grads_and_losses(ckpt, dtype)
        assert losses == ref_losses, ckpt
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), ckpt


def measure(model, cfg):
    x, y = torch.randint(0, cfg.vocab_size, (3, 16)), torch.randint(0, cfg.vocab_size, (3, 16))
    out = [0]
    with saved_activation_bytes(model, out):
        model(x, y)
    return out[0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_estimate_equals_measured_for_every_policy_and_k(dtype):
    cfg = GPTConfig(**TINY)
    for ckpt in SETTINGS + [Policy()]:
        for base in ("trains", "lora", "qlora"):
            torch.manual_seed(0)
            model = GPT(cfg).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
            r = 0 if base == "trains" else 4
            if r:
                lora.apply_lora(model, r, targets=("q", "v"))
            if base == "qlora":
                quant.quantize_base(model, "nf4")
            model.grad_ckpt = ckpt
            est = activation_bytes(cfg, 3, 16, dtype, ckpt, r, ("q", "v"), device="cpu")
            assert est["total"] == measure(model, cfg), (dtype, ckpt, base)  # to the byte


def test_the_dial_orders_memory_on_the_cpu_demo():
    """The CPU demo (4 layers of 128, 12 x 64 tokens): selective saves clearly less than none,
    every-K lies between full and none, and more checkpointing never keeps more."""
    cfg = GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, bias=False)

    def total(kind, every=1):
        return activation_bytes(cfg, 12, 64, "fp32", Policy(kind, every), device="cpu")["total"]

    none, sel, full = total("none"), total("selective"), total("full")
    assert sel < 0.8 * none and full < sel
    assert full < total("full", 2) < total("full", 4) < none
    assert sel < total("selective", 2) < none
    # per layer, in Korthikanti et al.'s units of s*b*h values: 1 kept by full, 11 + the
    # logsumexp by selective (block input, q|k|v, attention output, 2 projections, c_fc)
    layer = activation_bytes(cfg, 12, 64, "fp32", "selective")["per_layer"]
    assert layer == 4 * 12 * 64 * (11 * 128 + 4)


def test_advise_tries_the_least_checkpointing_first():
    cfg = shape_for(7e9)
    # a 7B is 32 x 4096 x 32; each GPU also gives NCCL's 2 communicators 3.2 GB (footprint.py)
    lines, cmd = advise(cfg, 8, parse_bytes("30GB"), psi=int(7e9))
    assert "selective" in lines[-1] and "fits" in lines[-1]
    assert "--zero 3" in cmd and "--grad-ckpt selective" in cmd
    lines, cmd = advise(cfg, 8, parse_bytes("28GB"), psi=int(7e9))
    assert "--grad-ckpt --grad-ckpt-every 2" in cmd
    est = estimate(cfg, 8, 3, "bf16", psi=int(7e9), grad_ckpt=Policy("full", 2))
    assert est["activations"]["total"] < estimate(cfg, 8, 3, "bf16", psi=int(7e9),
                                                  grad_ckpt="selective")["activations"]["total"]


def train_stage(stage, rank, world_size, ckpt, r=0):
    """Three ZeRO steps of the tiny model (LoRA on q, v if r), checkpointed as ckpt."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, dropout=0.1))
    if r:
        lora.apply_lora(model, r, targets=("q", "v"))
    model.grad_ckpt = ckpt
    zero = make_zero(model, stage, lr=1e-2, bucket_mb=0.002, rank=rank, world_size=world_size)
    scaler, g, out = GradScaler(init_scale=1.0, dynamic=False), torch.Generator(), []
    g.manual_seed(rank)
    for _ in range(3):
        x, y = (torch.randint(0, 40, (2, 16), generator=g) for _ in range(2))
        loss = model(x, y)[1]
        zero.backward(scaler.scale(loss))
        zero_step(zero, scaler, 1e-2, 1.0)
        out.append(loss.item())
    return out


def check_stages(rank, world_size):
    for stage in range(4):
        for r in (0, 4):
            ref = train_stage(stage, rank, world_size, False, r)
            for ckpt in (Policy("selective"), Policy("full", 2), Policy("selective", 2)):
                assert train_stage(stage, rank, world_size, ckpt, r) == ref, (stage, r, ckpt)


@pytest.mark.slow
def test_zero_stages_and_lora_two_ranks():
    """ZeRO-3's gather/free hooks fire around the recompute of every policy (frozen LoRA base
    weights too): the same losses as no checkpointing, bitwise, on 2 gloo ranks."""
    run_distributed(check_stages, 2)


class FakeMover:
    """Stands in for the device: every tensor counts as on it, and moving is a copy (a
    contiguous one, as a copy to pinned memory is). Records what it moved and settled."""

    def __init__(self):
        self.moved, self.settled, self.fetched = [], [], []

    def on_device(self, t):
        return True

    def to_host(self, t):
        self.moved.append(t.numel() * t.element_size())
        return t.detach().clone(memory_format=torch.contiguous_format), len(self.moved) - 1

    def settle(self, done):
        self.settled.append(done)

    def to_device(self, host, done, device):
        self.fetched.append(done)
        return host.clone()

    def wait(self, t):
        pass


def test_offload_round_trip_and_threshold():
    """Through the pack/unpack hooks the step is unchanged; small tensors and weights stay."""
    ref_losses, ref_grads = grads_and_losses(False, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    mover, threshold = FakeMover(), 3 * 16 * 32 * 4  # one (b, s, h) fp32 activation
    off, note = install_offload(model, torch.device("cpu"), mover, min_bytes=threshold)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x, y = (torch.randint(0, 40, (3, 16), generator=g) for _ in range(2))
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses == ref_losses
    assert all(torch.equal(p.grad, q) for p, q in zip(model.parameters(), ref_grads))
    assert mover.moved and min(mover.moved) >= threshold and off.kept_bytes > 0
    # unit logic: a weight stays however large; a small activation stays; a large one moves
    unit = Offload(model, FakeMover(), min_bytes=threshold)
    w = model.lm_head.weight
    assert unit.pack(w) is w and unit.pack(w.t()).data_ptr() == w.data_ptr()
    small = torch.randn(3)
    assert unit.pack(small) is small
    big = torch.randn(3, 16, 32)
    assert torch.equal(unit.unpack(unit.pack(big)), big) and unit.host_bytes == big.nbytes


def test_offload_keeps_strides_and_moves_a_storage_once():
    """q, k, v are strided views of one q|k|v buffer (model.py): the storage goes out once and
    each view comes back with its own size, stride and offset (a compiled backward asserts
    them: "expected stride 512==1536" when a contiguous copy came back)."""
    model = GPT(GPTConfig(**TINY))
    mover = FakeMover()
    off = Offload(model, mover, min_bytes=0)
    qkv = torch.randn(3, 16, 96)
    views = [t.view(3, 16, 2, 16).transpose(1, 2) for t in qkv.split(32, dim=2)]
    packed = [off.pack(t) for t in views]
    assert mover.moved == [qkv.nbytes] and off.host_bytes == qkv.nbytes
    for t, p in zip(views, packed):
        back = off.unpack(p)
        assert (back.shape, back.stride(), back.storage_offset()) == \
            (t.shape, t.stride(), t.storage_offset())
        assert torch.equal(back, t)
    assert len(mover.fetched) == 1  # and it came back once


def test_offload_bounds_the_bytes_in_flight():
    """Past the budget the oldest copy out is settled (on CUDA: the compute stream waits for
    it, and only then is its device memory let go): at most budget bytes, plus the copy just
    started, are ever in flight, and backward settles the rest before it reads any."""
    model = GPT(GPTConfig(**TINY))
    mover, budget = FakeMover(), 3 * 2**10
    off = Offload(model, mover, min_bytes=0, budget=budget)
    xs = [torch.randn(256) for _ in range(8)]  # 1 KiB each
    packed = [off.pack(x) for x in xs]
    assert off.peak_in_flight <= budget + xs[0].nbytes and off.in_flight_bytes <= budget
    assert mover.settled == list(range(len(xs) - 3))  # the oldest first
    assert torch.equal(off.unpack(packed[-1]), xs[-1])
    assert mover.settled == list(range(len(xs))) and off.in_flight_bytes == 0


def test_offload_prefetches_the_next_block_in_backward():
    """Backward unpacks block i's tensors, then block i-1's: the copies back of block i-1 start
    when block i's first tensor is unpacked, before any of them is needed. The weight set is
    taken once per forward, not once per saved tensor."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    off, _ = install_offload(model, torch.device("cpu"), FakeMover(), min_bytes=0)
    events, fetch, unpack, calls = [], off._fetch, off.unpack, [0]
    off._fetch = lambda e: (events.append(("fetch", e.block)), fetch(e))

    def logged_unpack(p):
        if not isinstance(p, torch.Tensor):
            events.append(("use", p[0].block))
        return unpack(p)

    off.unpack = logged_unpack
    parameters = model.parameters
    model.parameters = lambda *a, **k: (calls.__setitem__(0, calls[0] + 1), parameters(*a, **k))[1]
    x = torch.randint(0, 40, (3, 16))
    loss = model(x, x)[1]
    assert calls[0] == 1  # the weights' storages, once per forward
    loss.backward()
    first = {e: events.index(e) for e in reversed(events)}
    for b in range(TINY["n_layer"] - 1):
        assert first[("use", b + 1)] < first[("fetch", b)] < first[("use", b)], (b, events)


def test_offload_counts_in_the_activation_line():
    """With --offload-activations the meter sees what was saved (the offload's hooks used to
    shadow its own: 0 bytes), and says how much of it went to host memory."""
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    plain = measure(GPT(cfg), cfg)
    model = GPT(cfg)
    off, _ = install_offload(model, torch.device("cpu"), FakeMover(), min_bytes=2**10)
    assert measure(model, cfg) == plain > 0
    from machinery.meter import measure_next_forward
    out, before = [], off.host_bytes
    measure_next_forward(model, lambda nbytes, moved: out.append((nbytes, moved)))
    model(torch.randint(0, 40, (3, 16)), torch.randint(0, 40, (3, 16)))
    assert out == [(plain, off.host_bytes - before)] and 0 < out[0][1] < plain


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.compiles
def test_offload_under_compile(stage):
    """--compile --offload-activations: the compiled backward gets back the strides it saved
    (a stand-in mover whose copies are contiguous, as pinned copies are): the same losses as
    eager, where it used to stop at the first backward with a stride assertion."""
    from train import build
    shape = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, dropout=0.0)
    x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for compile in (False, True):
        cfg = TrainConfig(**shape, zero=stage, compile=compile)
        model, zero, scaler = build(cfg, 50, torch.device("cpu"), torch.float32)
        mover = FakeMover()
        install_offload(model, torch.device("cpu"), mover, min_bytes=0)
        for _ in range(2):
            loss = model(x, x)[1]
            zero.backward(loss)
            zero_step(zero, scaler, 1e-2, 1.0)
            losses.append(loss.item())
        assert mover.moved
    torch.testing.assert_close(losses[2:], losses[:2], rtol=0, atol=1e-5)


def test_offload_is_a_no_op_on_a_cpu(capsys):
    from train import build
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, offload_activations=True)
    build(cfg, 40, torch.device("cpu"), torch.float32)
    assert capsys.readouterr().out.count("--offload-activations: a no-op on a CPU") == 1


def test_resume_may_change_the_setting(data_root, tmp_path):
    """6 steps selective on every 2nd block, resumed for 6 more with full: bitwise 12 without."""
    args = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
            "--block-size", "32", "--batch-size", "4", "--eval-iters", "2", "--eval-interval",
            "1000", "--log-interval", "1", "--dropout", "0.1", "--data-root", data_root,
            "--dataset", "tiny", "--lr-decay-iters", "12"]  # one schedule for 6 and 12 steps
    run_train(args + ["--max-iters", "12", "--out-dir", str(tmp_path / "plain")])
    split = ["--out-dir", str(tmp_path / "split")]
    run_train(args + split + ["--max-iters", "6", "--grad-ckpt", "selective",
                              "--grad-ckpt-every", "2"])
    run_train(args + split + ["--max-iters", "12", "--resume", "--grad-ckpt"])

    def losses(out):
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        return {r["iter"]: r["loss"] for r in rows if "loss" in r}

    assert sorted(losses(tmp_path / "split")) == list(range(12))
    assert losses(tmp_path / "plain") == losses(tmp_path / "split")
    rows = [json.loads(line) for line in open(tmp_path / "split" / "metrics.jsonl")]
    assert [r["grad_ckpt"] for r in rows if r.get("event") == "activations"] == ["selective",
                                                                               "full"]


@pytest.mark.slow
def test_bench_keys_and_the_dial_table(capsys):
    """bench.costs keys each setting, bench.dial prints each beside none (1 timed step)."""
    from bench import costs, dial
    for key in ("s0", "s3+ckpt", "s1+sel", "s2+ckpt2+lora", "s3+sel4+qlora"):
        stage, ckpt, lora = costs.parse_key(key)
        assert costs.ours_key(stage, ckpt, lora) == key
    assert costs.describe("s0+sel2") == "ours, ZeRO-0 + grad-ckpt selective every 2"
    with pytest.raises(SystemExit):
        dial.main(["--ckpt", "full,sometimes", "--no-write"])
    dial.main(["--ckpt", "none,selective", "--steps", "1", "--no-write"])
    out = capsys.readouterr().out
    assert "| ours, ZeRO-0 + grad-ckpt selective | fp32 |" in out and "× |" in out
