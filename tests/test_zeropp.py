"""ZeRO++ (zeropp.py) on gloo ranks standing for nodes (4 ranks as 2 nodes x 2, 2 ranks as one
node): hpZ bitwise equal to ZeRO-3, the error of one qwZ gather and one qgZ reduction within the
stated bound, backward seeing exactly the forward's weights, an overflow surviving the codes,
the bytes by link beside the paper's volumes, the second shard's memory, LoRA over a 4-bit base,
and checkpoints resumed across ZeRO-3 and ZeRO++."""
import json
import os

import pytest
import torch
import torch.distributed as dist

import configurator
import configurator as flags
from machinery import footprint
from beyond import zeropp
from collectives import Traffic, all_gather_params
from conftest import run_distributed, run_train, zero_step
from data.loader import get_batch
from train import build
from lora import apply_lora
from model import GPT, GPTConfig
from precision import GradScaler
from quant import quantize_base
from test_checkpoint import TINY, assert_same_weights, final_weights, losses
from test_zero import ACCUM, B, CFG, DATA, LR, SEED, T, gathered_copy, make_model
from zero3 import ZeRO3
from beyond.zeropp import ZeROpp, expected_by_link, link_theory
from configurator import UserError

ALL = ("qwz", "hpz", "qgz")
WIDE = dict(CFG, n_embd=64, bias=False)  # blocks of ~49k: quantization blocks pad little


def engine(model, parts, rank, world_size, node_size, bits=4):
    kwargs = dict(lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.002, rank=rank,
                  world_size=world_size)
    if parts is None:  # plain ZeRO-3, its bytes by link as train.py counts them
        zero = ZeRO3(model, 3, **kwargs)
        zero.traffic = zeropp.LinkTraffic(node_size=node_size)
        return zero
    return ZeROpp(model, 3, zeropp=parts, node_size=node_size, qgz_bits=bits, **kwargs)


def train_steps(parts, rank, world_size, node_size, steps=3, grad_ckpt=False,
                dtype=torch.float32):
    """steps of ACCUM micro-steps; returns (gathered fp32 copy, grad norms, the engine)."""
    model = make_model(dtype)
    model.grad_ckpt = grad_ckpt
    zero = engine(model, parts, rank, world_size, node_size)
    scaler, norms = GradScaler(init_scale=1.0, dynamic=False), []
    for step in range(steps):
        for micro in range(ACCUM):
            x, y = get_batch(DATA, SEED, step, micro, rank, world_size, B, T, ACCUM)
            zero.backward(scaler.scale(model(x, y)[1] / ACCUM), sync=micro == ACCUM - 1)
        norms.append(zero_step(zero, scaler, LR, 0.02)[0])
        assert zero.gathered_bytes == 0  # no second shard or code buffer outlives a step
    return gathered_copy(model, zero), norms, zero


def assert_hpz_is_zero3(rank, world_size, node_size):
    """hpZ changes where backward's weights come from, not their values: bitwise ZeRO-3."""
    for grad_ckpt in (False, True):  # the recompute gathers from the second shard too
        ref, ref_norms, _ = train_steps(None, rank, world_size, node_size, grad_ckpt=grad_ckpt)
        got, norms, _ = train_steps(("hpz",), rank, world_size, node_size, grad_ckpt=grad_ckpt)
        assert norms == ref_norms
        for (name, p), q in zip(got.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (name, grad_ckpt)


def full_shards(b, world_size):
    """The exact full buffer of a bucket, all-gathered from its shards without codes."""
    full = torch.empty_like(b.flat)
    work = all_gather_params(full, b.shard, Traffic(), world_size)
    work.wait()
    return full


def check_qwz_gather_bound(rank, world_size):
    """One qwZ gather: |w - w'| <= absmax(block) / 254, plus rounding to the working dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(dtype)
        zero = engine(model, ("qwz",), rank, world_size, 2)
        unit = zero.units[0]
        zero._gather(unit)  # a collective: every rank together
        b = unit.buckets[0]
        exact, got = full_shards(b, world_size).float(), b.flat.float()
        S = b.shard.numel()
        blocks = torch.nn.functional.pad(exact.view(world_size, S), (0, -S % 256))
        amax = blocks.view(world_size, -1, 256).abs().amax(-1).repeat_interleave(256, 1)
        bound = amax[:, :S].reshape(-1) / 254 + (got.abs() * 2 ** -8 if dtype != torch.float32
                                                 else 1e-7 * amax[:, :S].reshape(-1))
        err = (got - exact).abs()
        assert (err <= bound).all() and err.max() > 0, dtype  # quantized, and within the bound
        zero._free(unit.buckets)


def quantized_reduce_scatter(zero, flat):
    """qgZ's reduction, waited for: this rank's slice of the mean (fp32)."""
    out = torch.empty(flat.numel() // zero.world_size, device=flat.device)
    zero.launch_quantized_reduce_scatter(flat, out).wait()
    return out


def check_qgz_reduction_bound(rank, world_size, node_size):
    """One qgZ reduction of N ranks' gradients (k per node, n nodes): each element within
    (sum over the N hop-1 codes + the n hop-2 codes) of absmax / (2 qmax); an inf survives."""
    n = world_size // node_size
    for bits, qmax in ((4, 7), (8, 127)):
        zero = engine(make_model(), ("qgz",), rank, world_size, node_size, bits)
        g = torch.Generator().manual_seed(rank)
        flat = torch.randn(world_size * 1000, generator=g) * (1 + rank)
        every = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(every, flat)
        got = quantized_reduce_scatter(zero, flat.clone())
        exact = torch.stack(every).sum(0)[rank * 1000:(rank + 1) * 1000] / world_size
        a1 = sum(x.abs().max() / world_size for x in every)  # hop 1: every rank's codes
        nodes = torch.stack(every).view(n, node_size, -1).sum(1) / world_size
        a2 = sum(p.abs().max() + a1 / (2 * qmax) for p in nodes)  # hop 2: the partial sums
        err = (got - exact).abs()
        assert err.max() <= (a1 + a2) / (2 * qmax) * (1 + 1e-5) and err.max() > 0, bits
        flat[0] = float("inf") if rank == world_size - 1 else flat[0]  # rank 0 owns element 0
        got = quantized_reduce_scatter(zero, flat.clone())
        assert (not got[:64].isfinite().any()) if rank == 0 else got.isfinite().all()


def check_backward_sees_forward(rank, world_size):
    """Every tensor saved for backward (the gathered weights among them) holds, when backward
    reads it, bitwise what the forward saved: with qwZ's codes re-gathered, and with hpZ."""
    for parts in (("qwz",), ("qwz", "hpz"), ALL, "control"):
        model = make_model()
        zero = engine(model, ("qwz",) if parts == "control" else parts, rank, world_size, 2)
        if parts == "control":  # the check can fail: backward re-gathers without the codes
            zero._quantized = lambda b: not zero.in_backward
        bad = []

        def unpack(pair):
            if not torch.equal(pair[0], pair[1]):
                bad.append(tuple(pair[0].shape))
            return pair[0]
        x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (t, t.detach().clone()), unpack):
            loss = model(x, y)[1]
        zero.backward(loss)
        assert bool(bad) == (parts == "control"), (parts, bad)


def check_bytes_by_link(rank, world_size):
    """Inter-node bytes of one bf16 step (one micro-step) per combination, against plain ZeRO-3
    and the paper's volumes (expected_bytes; ours skip the root's re-gather)."""
    inter = {}
    for parts, bits in ((None, 4), ((), 4), (("qwz",), 4), (("hpz",), 4), (("qgz",), 4),
                        (ALL, 4), (ALL, 8)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**WIDE)).to(torch.bfloat16)
        zero = engine(model, parts, rank, world_size, 2, bits)
        zero.traffic = zeropp.LinkTraffic(node_size=2)
        x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
        zero.backward(model(x, y)[1])
        t = zero.traffic
        theory = expected_by_link(zero.psi, world_size, 2, parts or (), qgz_bits=bits)
        for link in ("intra", "inter"):
            measured = getattr(t, "bytes_" + link)
            assert abs(measured - theory[link]) <= 0.06 * theory[link] + 1, \
                (parts, link, measured, theory[link])
        inter[(parts, bits)] = t.bytes_inter
        zero.publish()
    plain = inter[(None, 4)]
    assert inter[((), 4)] == plain  # ZeROpp without parts is ZeRO-3, by link
    assert inter[(ALL, 4)] <= 0.3 * plain and inter[(ALL, 8)] <= 0.36 * plain, inter
    assert inter[(("hpz",), 4)] < 0.7 * plain  # no backward gather crosses nodes


def est_blocks():
    return footprint.bucket_sizes(footprint.param_numels(GPTConfig(**CFG)), 3, "bf16")[1:]


def check_memory(rank, world_size):
    """The start-up state equals ZeRO-3's; after a forward, hpZ holds 1/k of every block's
    16-bit weights more (2Ψ/k), counted in weight_bytes() and the peak gathered bytes."""
    plain = ZeRO3(make_model(torch.bfloat16), 3, rank=rank, world_size=world_size)
    model = make_model(torch.bfloat16)
    zero = engine(model, ALL, rank, world_size, 2)
    assert zero.state_bytes() == plain.state_bytes()
    x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
    loss = model(x, y)[1]
    second = sum(b.numel // 2 * 2 for u in zero.units for b in u.buckets)  # bytes, k = 2
    # still gathered: the root, and the last block, whose re-gather starts behind the head
    gathered = sum(b.numel * 2 for u in (zero.root, zero.units[-1]) for b in u.buckets)
    assert zero.weight_bytes() - plain.weight_bytes() == second + gathered
    assert zero.peak_gathered_bytes >= second + gathered
    zero.backward(loss)
    assert zero.weight_bytes() == plain.weight_bytes() and zero.gathered_bytes == 0
    # memory.py's working set: ZeRO-3's root and two blocks, every second shard, one block's
    # codes in flight: an upper bound, within one second shard of the measured peak
    est = footprint.estimate(GPTConfig(**CFG), world_size, 3, "bf16", zeropp=ALL, node_size=2)
    one = zeropp.working_bytes(est_blocks()[:1], world_size, 2, 2, ("hpz",))
    assert est["gathered"] - one <= zero.peak_gathered_bytes <= est["gathered"], \
        (est["gathered"], zero.peak_gathered_bytes, one)


def check_lora_and_fp16(rank, world_size):
    """LoRA over an nf4 base: its uint8 / fp32 buckets are gathered as they are (already 4-bit),
    its losses follow ZeRO-3's. fp16: an overflow on one rank survives qgZ's codes, so every
    rank's scaler sees it and skips."""
    losses_by = {}
    for parts in (None, ALL):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**WIDE))  # a shard of each unit's adapters: one block of codes
        apply_lora(model, 4, targets=("q", "v"))
        quantize_base(model, "nf4")
        zero = engine(model, parts, rank, world_size, 2)
        scaler, out = GradScaler(init_scale=1.0, dynamic=False), []
        zero.traffic = zeropp.LinkTraffic(node_size=2)
        for step in range(3):
            x, y = get_batch(DATA, SEED, step, 0, rank, world_size, B, T, 1)
            loss = model(x, y)[1]
            out.append(loss.item())
            zero.backward(loss)
            zero_step(zero, scaler, 1e-2, 1.0)
        theory = {link: 3 * v for link, v in  # 3 steps of one micro-step
                  link_theory(zero, ",".join(parts or ()), 4).items()}
        for link in ("intra", "inter"):  # the frozen base's gathers counted too
            measured = getattr(zero.traffic, "bytes_" + link)
            assert abs(measured - theory[link]) <= 0.06 * theory[link], (parts, link)
        if parts:
            frozen = [b for u in zero.units for b in u.buckets if b.frozen]
            assert frozen and not any(zero._quantized(b) for b in frozen)
        losses_by[parts] = out
    for a, b in zip(losses_by[None], losses_by[ALL]):
        assert abs(a - b) <= 2e-3 * a
    model = make_model(torch.float16)
    zero = engine(model, ALL, rank, world_size, 2)
    scaler = GradScaler(init_scale=2.0 ** 10, dynamic=True)
    x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
    loss = model(x, y)[1] * (float("inf") if rank == world_size - 1 else 1.0)
    zero.backward(scaler.scale(loss))
    assert zero_step(zero, scaler, LR, 1.0)[1] and scaler.get_scale() == 2.0 ** 9


def check_qgz_overlaps_backward(rank, world_size, node_size):
    """qgZ's all-to-all is launched from the gradient hook and waited for only once the next
    block's backward has begun (it was waited for inside the hook: backward stood still)."""
    events, real = [], zeropp.all_to_all

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            if self.work is not None:
                self.work.wait()

    def logged(out, inp, traffic, size, group=None):
        events.append("launch")
        return Logged(real(out, inp, traffic, size, group))

    model = make_model()
    zero = engine(model, ("qgz",), rank, world_size, node_size)
    def mark(i):  # the gradient of block i's output arrives: its backward begins
        def hook(module, args, out):
            out.register_hook(lambda grad: events.append(f"block {i} backward"))
        return hook

    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(mark(i))
    zeropp.all_to_all = logged
    try:
        x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
        zero.backward(model(x, y)[1])
    finally:
        zeropp.all_to_all = real
    first = events.index("launch")
    assert "block 0 backward" in events[first:events.index("wait")], events


def check_hpz_regathers_on_the_gather_group(rank, world_size):
    """On one node hpZ's re-gather spans the world: on the gather group (a stream of its own
    on NCCL, made here on gloo too), not behind the default group's reduce-scatters."""
    import collectives
    groups, real, separate = [], zeropp.all_gather_params, collectives.separate_gather_stream

    def logged(flat, shard, traffic, size, group=None):
        groups.append((zero.in_backward, group))
        return real(flat, shard, traffic, size, group)

    collectives.separate_gather_stream = lambda device: True
    zeropp.all_gather_params = logged
    try:
        model = make_model()
        zero = engine(model, ("hpz",), rank, world_size, world_size)
        x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
        zero.backward(model(x, y)[1])
    finally:
        collectives.separate_gather_stream = separate
        zeropp.all_gather_params = real
    regathers = [g for backward, g in groups if backward]
    assert zero.gather_group is not None and regathers
    assert all(g is zero.gather_group for g in regathers), regathers


def _four_ranks_two_nodes(rank, world_size):
    assert_hpz_is_zero3(rank, world_size, 2)
    check_qwz_gather_bound(rank, world_size)
    check_qgz_reduction_bound(rank, world_size, 2)
    check_backward_sees_forward(rank, world_size)
    check_bytes_by_link(rank, world_size)
    check_memory(rank, world_size)
    check_lora_and_fp16(rank, world_size)


def _two_ranks_one_node(rank, world_size):
    assert_hpz_is_zero3(rank, world_size, 2)
    check_qgz_reduction_bound(rank, world_size, 2)
    check_qgz_overlaps_backward(rank, world_size, 2)
    check_hpz_regathers_on_the_gather_group(rank, world_size)
    for parts in (None, ALL):  # one step of ACCUM micro-steps: the root gathered once
        _, _, zero = train_steps(parts, rank, world_size, 2, steps=1)
        theory = link_theory(zero, ",".join(parts or ()), 4, grad_accum=ACCUM)["intra"]
        measured = zero.traffic.bytes_intra
        assert abs(measured - theory) <= 0.06 * theory, (parts, measured, theory)
    assert zero.traffic.bytes_inter == 0 and zero.traffic.bytes_intra > 0  # one node


def test_zeropp_on_four_ranks_as_two_nodes():
    run_distributed(_four_ranks_two_nodes, 4)


def test_zeropp_on_two_ranks_in_one_node():
    run_distributed(_two_ranks_one_node, 2)


def rows(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def test_checkpoints_resume_across_zero3_and_zeropp(data_root, tmp_path):
    """2 ranks as 2 nodes of 1. A ZeRO++ checkpoint holds no second shard and no code: hpZ for 2
    steps, then plain ZeRO-3 for 2 more, is bitwise 4 steps of ZeRO-3; plain ZeRO-3 resumed
    with all three trains on, with a fifth of the bytes between nodes."""
    args = TINY + ["--zero", "3", "--node-size", "1", "--data-root", data_root]
    run_train(args + ["--max-iters", "4", "--out-dir", str(tmp_path / "plain")], 2)
    split = ["--out-dir", str(tmp_path / "split")]
    run_train(args + ["--max-iters", "2", "--zeropp", "hpz"] + split, 2)
    run_train(args + ["--max-iters", "4", "--resume"] + split, 2)
    plain, hpz = losses(tmp_path / "plain"), losses(tmp_path / "split")
    assert [plain[i] for i in range(4)] == [hpz[i] for i in range(4)]
    assert_same_weights(final_weights(tmp_path / "plain"), final_weights(tmp_path / "split"))
    back = ["--out-dir", str(tmp_path / "back")]
    run_train(args + ["--max-iters", "2"] + back, 2)
    run_train(args + ["--max-iters", "4", "--resume", "--zeropp", "qwz,hpz,qgz"] + back, 2)
    zpp = [r for r in rows(tmp_path / "back") if r.get("iter") == 3 and "loss" in r][0]
    ref = [r for r in rows(tmp_path / "plain") if r.get("iter") == 3 and "loss" in r][0]
    assert abs(zpp["loss"] - ref["loss"]) < 0.02 * ref["loss"]
    assert zpp["comm_bytes_inter"] < 0.25 * ref["comm_bytes_inter"]  # fp32 here: 12Ψ -> ~1.6Ψ
    assert zpp["comm_theory_bytes_inter"] > 0 and ref["comm_bytes_intra"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--zeropp", "qwz"], "add --zero 3"),
    (["--zero", "3", "--zeropp", "qwz,fast"], "'fast' is not one of"),
    (["--zero", "3", "--qgz-bits", "2"], "--qgz-bits 2: use 4, 8")])
def test_bad_zeropp_flags_are_one_line(argv, message):
    with pytest.raises((UserError, ValueError), match=message):  # run_main's one line
        flags.parse_args(argv)


def test_a_node_size_that_does_not_divide_the_world_is_one_line():
    cfg = flags.parse_args(["--zero", "3", "--zeropp", "hpz", "--node-size", "3"])
    with pytest.raises(ValueError, match="does not divide the world size 2"):
        build(cfg, 65, torch.device("cpu"), torch.float32, 0, 2)


def test_bench_tables_from_measured_bytes():
    """bench.zeropp's tables from made-up runs: the ratio to ZeRO-3 is of inter-node bytes, and
    the cluster estimate is labelled as one."""
    from types import SimpleNamespace
    from bench import zeropp as bench
    psi = 1000
    by = {"ZeRO-3": {"all_gather/inter": 4 * psi, "reduce_scatter/inter": 2 * psi}}
    found = {(name, 1): (by.get(name, {"all_gather/inter": 600, "all_gather/intra": 2000}),
                         2.0, 100.0, psi) for name, _, _ in bench.ROWS}
    body, numbers = bench.tables(found, [1], SimpleNamespace(steps=200, seeds="1", dtype="bf16"))
    assert "| all (int4) | 1 | 2 | 0 | 0 | 0 | 0.100 | 0.216 |" in body
    assert "**Estimate, not a measurement**" in numbers
