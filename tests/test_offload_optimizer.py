"""ZeRO-Offload (beyond/offload_optimizer.py) against the resident engine, bitwise, on gloo:
stages 1-3, fp32 and bf16, accumulation 1 and 4 (--fp32-grad-accum too), clipping on, the
plain and the overlapped copy; the bytes each way per step; an inf in one rank's host slice
skipping the step on every rank; and train.main resuming offload on <-> off."""
import contextlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

from beyond.offload_optimizer import HostCopies
from conftest import run_distributed, run_train, zero_step
from data.loader import get_batch
from model import GPT, GPTConfig
from precision import GradScaler

CFG = dict(block_size=8, vocab_size=13, n_layer=2, n_head=2, n_embd=10, dropout=0.0, bias=True)
B, T, STEPS, LR, CLIP, SEED = 2, 8, 3, 1e-2, 0.02, 1234  # CLIP: every step clips
DATA = np.random.default_rng(0).integers(0, 13, 4000).astype(np.uint16)


def engine(model, stage, offload, **kwargs):
    """The resident engine (offload None) or the offloading one, plain or overlapped; Muon's
    WholeZeRO for --optimizer muon."""
    from beyond.muon import WholeZeRO
    from zero import ZeRO
    from zero3 import ZeRO3
    Engine = ZeRO3 if stage == 3 else WholeZeRO if kwargs.get("optimizer") == "muon" else ZeRO
    if offload is not None:
        from beyond.offload_optimizer import offload_engine
        Engine = offload_engine(Engine)
        kwargs["overlap"] = offload == "overlap"
    return Engine(model, stage, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.002,
                  **kwargs)


def weights(zero):
    """What a rank holds that a step changes: the master slices and the working weights."""
    held = [b.shard if zero.stage == 3 else b.flat for b in zero.buckets]
    return [t.detach().clone() for t in list(zero.master) + held]


def train(rank, world_size, stage, dtype, accum, offload, fp32_accum=False, optimizer="adamw"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG)).to(dtype)
    zero = engine(model, stage, offload, rank=rank, world_size=world_size,
                  fp32_grad_accum=fp32_accum, optimizer=optimizer)
    scaler = GradScaler(init_scale=1.0, dynamic=False)
    norms, moved = [], []
    for step in range(STEPS):
        zero.host_copies = HostCopies()
        for micro in range(accum):
            x, y = get_batch(DATA, SEED, step, micro, rank, world_size, B, T, accum)
            zero.backward(scaler.scale(model(x, y)[1] / accum), sync=micro == accum - 1)
        norms.append(zero_step(zero, scaler, LR, CLIP))
        moved.append((zero.host_copies.d2h, zero.host_copies.h2d))
    return zero, norms, moved


def _parity(rank, world_size):
    """Every stage, dtype and accumulation at 1 and 2 ranks, each with both copies; at 3 and 4
    ranks (their slices uneven, their processes more than this machine's cores) every stage
    with fp32 unaccumulated and bf16 accumulated, the overlapped copy only: each setting is met
    at every world size, and the suite stays within its minutes."""
    dtypes_accums = [(dtype, accum) for dtype in (torch.float32, torch.bfloat16) for accum in (1, 4)]
    if world_size > 2:
        dtypes_accums = [(torch.float32, 1), (torch.bfloat16, 4)]
    cases = [(stage, dtype, accum, False) for stage in (1, 2, 3) for dtype, accum in dtypes_accums]
    cases += [(1, torch.bfloat16, 4, True), (2, torch.bfloat16, 4, True)]  # --fp32-grad-accum
    for stage, dtype, accum, fp32_accum in cases:
        case = f"stage {stage} {dtype} accum {accum} fp32-accum {fp32_accum}"
        ref, ref_norms, ref_moved = train(rank, world_size, stage, dtype, accum, None, fp32_accum)
        assert all(n[0] > CLIP for n in ref_norms), case  # clipping really ran
        assert ref_moved == [(0, 0)] * STEPS, case  # the resident engine copies nothing
        both = accum == 4 and world_size <= 2
        for offload in ("overlap", "plain") if both else ("overlap",):
            zero, norms, moved = train(rank, world_size, stage, dtype, accum, offload,
                                       fp32_accum)
            assert norms == ref_norms, (case, offload)  # same norm, same skips, every rank
            for mine, theirs in zip(weights(zero), weights(ref)):
                assert torch.equal(mine, theirs), (case, offload)
            # the bytes each way, to the byte: the gradient slice down once, the weights up once
            formula = zero.pcie_formula()
            assert moved == [(formula["d2h"], formula["h2d"])] * STEPS, (case, offload)
            owned = sum(b.hi - b.lo for b in zero.buckets)
            grad_bytes = 4 if fp32_accum or dtype == torch.float32 else 2
            assert formula["d2h"] == owned * grad_bytes, case
            # the device holds no master and no optimizer state; the host does
            held, host = zero.state_bytes(), zero.host_bytes()
            assert held["master"] == held["optimizer"] == 0, case
            stepped = sum(s.hi - s.lo for s in zero.segments)  # AdamW's moments: no padding
            assert host["master"] == 4 * owned and host["optimizer"] == 8 * stepped, case
            assert all(t.device.type == "cpu" for s in zero.opt.state.values()
                       for t in s.values()), case
    for stage in (1, 2):  # Muon's whole matrices (beyond/muon.py's WholeZeRO), and SGD
        for optimizer in ("muon", "sgd"):
            ref = train(rank, world_size, stage, torch.bfloat16, 1, None, optimizer=optimizer)
            zero, norms, _ = train(rank, world_size, stage, torch.bfloat16, 1, "overlap",
                                   optimizer=optimizer)
            assert norms == ref[1], (stage, optimizer)
            for mine, theirs in zip(weights(zero), weights(ref[0])):
                assert torch.equal(mine, theirs), (stage, optimizer)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_offload_equals_resident_bitwise(world_size):
    run_distributed(_parity, world_size)


def _inf_in_one_host_slice(rank, world_size):
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG)).to(torch.float16)
        zero = engine(model, stage, "overlap", rank=rank, world_size=world_size)
        scaler = GradScaler(init_scale=2.0**10, device="cpu")
        x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
        zero.backward(scaler.scale(model(x, y)[1]))
        before = weights(zero)
        grads = zero.master_grads()
        if rank == world_size - 1:
            grads[0].view(-1)[0] = float("inf")  # in this rank's host slice only
        found_inf = scaler.unscale_(grads)
        assert found_inf.item() == 1.0, stage  # every rank sees it, not only the last
        zero.clip_grad_norm_(CLIP)
        zero.step(LR, found_inf)
        zero.publish()
        scaler.update(found_inf)
        for mine, old in zip(weights(zero), before):
            assert torch.equal(mine, old), stage  # skipped on every rank together
        assert scaler.get_scale() == 2.0**9, stage
        # and the next step runs, and moves every rank (no rank waits in a skipped gather)
        zero.backward(scaler.scale(model(x, y)[1]))
        _, skipped = zero_step(zero, scaler, LR, CLIP)
        assert not skipped and not torch.equal(weights(zero)[0], before[0]), stage


def test_an_inf_in_one_ranks_host_slice_skips_every_rank():
    run_distributed(_inf_in_one_host_slice, 2)


def test_offload_refuses_stage_0():
    from configurator import UserError, parse_args
    with pytest.raises(UserError, match="--zero 1, 2 or 3"):
        parse_args(["--zero", "0", "--offload-optimizer"])
    assert parse_args(["--zero", "2", "--offload-optimizer"]).offload_optimizer == "overlap"


@pytest.mark.parametrize("flags", [["--zero", "1", "--bf16"], ["--zero", "2"],
                                   ["--zero", "3", "--bf16", "--bucket-mb", "0.01"],
                                   ["--zero", "2", "--bf16", "--optimizer", "muon"],
                                   ["--zero", "1", "--optimizer", "muon"],
                                   ["--zero", "3", "--optimizer", "sgd"],
                                   ["--zero", "2", "--bf16", "--offload-optimizer", "delayed"]])
def test_memory_py_counts_what_the_offloaded_engine_allocates(flags):
    """footprint.for_run (memory.py's and the start-up table's one estimator): the device's
    model state and the host's bytes, each equal to what the engine holds, to the byte."""
    from configurator import parse_args
    from machinery import report
    from machinery.footprint import for_run
    from precision import DTYPES
    from train import build
    cfg = parse_args(["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                      "--device", "cpu", "--offload-optimizer", *flags])
    model, zero, _ = build(cfg, 40, torch.device("cpu"), DTYPES[cfg.dtype])
    est = for_run(cfg, model.config, 1, device="cpu")
    assert est["state"] == zero.state_bytes() and est["state"]["master"] == 0
    assert est["host"] == zero.host_bytes() and est["host"]["optimizer"] > 0
    table, row = report.model_state_report(zero, 1)
    assert "host (offload)" in table and row["host"] == zero.host_bytes()
    assert max(len(line) for line in table.splitlines()) <= 80


TINY = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
        "32", "--batch-size", "4", "--eval-iters", "2", "--eval-interval", "1000",
        "--log-interval", "1", "--warmup-iters", "2", "--learning-rate", "3e-3",
        "--lr-decay-iters", "8", "--dataset", "tiny", "--bf16", "--grad-clip", "0.5"]


def metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def losses(out_dir):
    return {r["iter"]: r["loss"] for r in metrics(out_dir) if "loss" in r}


def test_resume_offload_on_to_off_and_off_to_on_bitwise(data_root, tmp_path):
    """train.main: 8 resident steps == 4 offloaded + resume 4 resident == 4 resident + resume 4
    offloaded, loss for loss (the checkpoint of an offloaded run is a resident run's: the host
    master and its state are saved and restored through the same segments). And the console's
    bytes each way equal the theory on every logged step."""
    args = TINY + ["--data-root", data_root, "--zero", "2"]
    off = ["--offload-optimizer"]
    run = lambda flags, out, iters: run_train(args + flags + ["--max-iters", str(iters),
                                                              "--out-dir", str(out)], 2)
    run([], tmp_path / "ref", 8)
    run(off, tmp_path / "on_off", 4)
    run(["--resume"], tmp_path / "on_off", 8)
    run([], tmp_path / "off_on", 4)
    run(off + ["--resume"], tmp_path / "off_on", 8)
    ref = losses(tmp_path / "ref")
    assert sorted(ref) == list(range(8))
    for out in ("on_off", "off_on"):
        got = losses(tmp_path / out)
        assert [got[i] for i in range(8)] == [ref[i] for i in range(8)], out
    steps = [r for r in metrics(tmp_path / "off_on") if "loss" in r]
    assert [r["d2h_bytes"] > 0 for r in steps] == [False] * 4 + [True] * 4
    assert all(r["d2h_bytes"] == r["d2h_theory"] and r["h2d_bytes"] == r["h2d_theory"]
               for r in steps)


def test_advise_offloads_a_1_5b_model_onto_one_24gb_gpu_when_the_host_holds_it(capsys):
    """memory.py --advise: after ZeRO-3 and checkpointing, before LoRA. A 1.5B model (16 bytes a
    parameter: 24 GB of model state) trains whole on one 24 GB GPU with its 18 bytes a
    parameter of optimizer side on the host; a host too small for them goes on to LoRA."""
    import memory
    from configurator import UserError
    argv = ["--params", "1.5e9", "--world-size", "1", "--gpu-mem", "24GB", "--advise"]
    cmd = memory.main(argv)
    out = capsys.readouterr().out
    # batch 9 (7 while memory.py priced model.py's loss head 4 bytes a logit high): measured,
    # that step peaks at 20.19 GB on a GPU of 21.6 usable (--advise --measure, docs/scale.md)
    assert cmd.endswith("--zero 1 --bf16 --batch-size 9 --grad-ckpt --offload-optimizer"), cmd
    assert "27.0 GB of host memory" in out and "before LoRA" in out
    cmd = memory.main(argv + ["--host-mem", "16GB"])
    assert "--lora" in cmd and "--offload-optimizer" not in cmd
    assert "the host would need 27 GB, over --host-mem 16 GB" in capsys.readouterr().out
    with pytest.raises(UserError, match="--host-mem is 16 GB"):  # memory.py without --advise
        memory.main(argv[:-1] + ["--zero", "1", "--bf16", "--offload-optimizer",
                                 "--host-mem", "16GB"])


def test_an_offloaded_zero2_run_resumes_as_offloaded_zero3_on_3_ranks(data_root, tmp_path):
    """Resharded: 4 steps of offloaded ZeRO-2 on 2 ranks, resumed as offloaded ZeRO-3 on 3
    (the same global batch, 2 x 3 = 3 x 2 sequences), ends where 8 resident ZeRO-2 steps on 2
    ranks end, within fp32's summation-order tolerance."""
    base = [a for a in TINY if a != "--bf16"] + ["--data-root", data_root]  # fp32
    run_train(base + ["--zero", "2", "--batch-size", "3", "--max-iters", "8", "--out-dir",
                      str(tmp_path / "ref")], 2)
    out = str(tmp_path / "resharded")
    run_train(base + ["--zero", "2", "--batch-size", "3", "--max-iters", "4",
                      "--offload-optimizer", "--out-dir", out], 2)
    run_train(base + ["--zero", "3", "--batch-size", "2", "--max-iters", "8", "--resume",
                      "--offload-optimizer", "plain", "--out-dir", out], 3)
    ref, got = losses(tmp_path / "ref"), losses(out)
    assert [got[i] for i in range(4)] == [ref[i] for i in range(4)]
    np.testing.assert_allclose([got[i] for i in range(8)], [ref[i] for i in range(8)],
                               rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_copies_gradients_down_during_backward(stage):
    """overlap: a bucket's slice goes down as its reduction lands, while later buckets are still
    in backward (bytes already down when the last bucket launches); plain: nothing goes down
    before master_grads. The same bytes in the end."""
    seen = {}
    for mode in ("overlap", "plain"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**dict(CFG, n_layer=4)))  # ZeRO-3: 5 units, 2 in flight
        zero = engine(model, stage, mode)
        launches = []
        reduce = zero._reduce
        zero._reduce = lambda b: (launches.append(zero.host_copies.d2h), reduce(b))
        x, y = get_batch(DATA, SEED, 0, 0, 0, 1, B, T, 1)
        zero.backward(model(x, y)[1])
        assert len(launches) > 3, "too few buckets to see the overlap"  # 2 are in flight
        after_backward = zero.host_copies.d2h
        zero.master_grads()
        seen[mode] = (launches[-1], after_backward, zero.host_copies.d2h)
    assert seen["overlap"][0] > 0 and seen["plain"][:2] == (0, 0)
    assert seen["overlap"][1] == seen["overlap"][2] == seen["plain"][2] > 0


def _dpu_reference(steps):
    """The paper's delayed update in a plain loop: torch's AdamW on an fp32 master applies
    gradient t-1 after backward t, and forward t+1 runs on what that leaves."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    params = [p for p in model.parameters() if p.requires_grad]  # the tied weight once
    master = [p.detach().clone() for p in params]
    groups = [{"params": [m for m, p in zip(master, params) if (p.dim() >= 2) == decays],
               "weight_decay": 0.1 if decays else 0.0} for decays in (True, False)]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)
    pending, losses = None, []
    for step in range(steps):
        x, y = get_batch(DATA, SEED, step, 0, 0, 1, B, T, 1)
        loss = model(x, y)[1]
        loss.backward()
        losses.append(loss.item())
        if pending is not None:  # update t-1, stepped while t computed
            for m, g in zip(master, pending):
                m.grad = g
            opt.step()
        pending = [p.grad.clone() for p in params]
        model.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
    return losses, [p.detach() for p in params]


@pytest.mark.parametrize("stage", [1, 3])
def test_delayed_update_equals_the_plain_loop_of_it(stage):
    """--offload-optimizer delayed (Ren et al. 2021, Sec. 4.3): the CPU steps gradient t in a
    thread during step t+1. Bitwise the reference loop above; not the undelayed run."""
    from beyond.offload_optimizer import offload_engine
    from zero import ZeRO
    from zero3 import ZeRO3
    ref_losses, ref_weights = _dpu_reference(5)
    runs = {}
    for delayed in (True, False):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        Engine = offload_engine(ZeRO3 if stage == 3 else ZeRO, delayed=delayed)
        zero = Engine(model, stage, lr=LR, betas=(0.9, 0.95), weight_decay=0.1,
                      bucket_mb=0.002)
        scaler, losses = GradScaler(init_scale=1.0, dynamic=False), []
        for step in range(5):
            x, y = get_batch(DATA, SEED, step, 0, 0, 1, B, T, 1)
            loss = model(x, y)[1]
            zero.backward(loss)
            losses.append(loss.item())
            zero_step(zero, scaler, LR, 0.0)  # no clipping: the reference has none
        runs[delayed] = losses
        if delayed and stage == 1:
            for mine, theirs in zip([p for p in model.parameters()], ref_weights):
                assert torch.equal(mine.detach(), theirs)
        if delayed:
            assert zero.host_bytes()["grads"] == 2 * zero.host_bytes()["master"]
    assert runs[True] == ref_losses
    # step 1 still runs on the initial weights (update 0 is being stepped): from there every
    # loss differs from the undelayed run's
    assert runs[True][0] == runs[False][0]
    assert all(a != b for a, b in zip(runs[True][1:], runs[False][1:]))


@pytest.mark.slow
def test_a_delayed_run_resumes_exactly(data_root, tmp_path):
    """--offload-optimizer delayed: at a save the master holds update t while the weights in
    use (the snapshot the next forward reads) hold update t-1. The checkpoint keeps both, so
    k + save + resume + k == 2k bitwise (losses and weights), sharded and consolidated alike.
    The same checkpoint resumed without delay starts from the master, and says so in one line
    (its resume row's note); resumed delayed at ZeRO-3 on 3 ranks (resharded, the same global
    batch) it continues the 2-rank run to the summation order's rounding."""
    from test_checkpoint import losses as ckpt_losses, resumes_exactly, run
    args = [a for a in TINY if a != "--bf16"] + ["--data-root", data_root, "--zero", "2",
                                                 "--batch-size", "6"]
    delayed = ["--offload-optimizer", "delayed"]
    full = resumes_exactly(args + delayed + ["--ckpt-format", "sharded"], tmp_path, 2)
    resumes_exactly(args + delayed + ["--bf16"], tmp_path / "bf16", 2)
    # export.py (and sample.py, --init-from: Reader.weights) read the master of a delayed
    # checkpoint, update t, one ahead of the weights in use, which the consolidated file keeps too
    import export
    from checkpoint import Reader
    from safetensors.torch import load_file
    saved = sorted(p for p in (tmp_path / "bf16" / "split").iterdir() if p.name[:5] == "ckpt-")
    reader = Reader(str(saved[0]))
    export.export(str(saved[0]), "safetensors", str(tmp_path / "w.safetensors"))
    written = load_file(str(tmp_path / "w.safetensors"))
    in_use = {n: reader.read(n, "in_use", 0, reader.numel(n)) for n in reader.header["shapes"]}
    assert reader.header["extra_keys"] == ["in_use"] and written.keys() == in_use.keys()
    for n, t in written.items():
        assert torch.equal(t.flatten(), reader.read(n, "master", 0, reader.numel(n))), n
    assert any(not torch.equal(t.flatten(), in_use[n]) for n, t in written.items())
    split = tmp_path / "split"
    for name, flags, nproc in (("undelayed", ["--offload-optimizer", "overlap"], 2),
                               ("three", delayed + ["--zero", "3", "--batch-size", "4"], 3)):
        out = tmp_path / name
        out.mkdir()
        ckpt = sorted(p for p in split.iterdir() if p.name.startswith("ckpt-"))[0]
        shutil.copytree(ckpt, out / ckpt.name)
        run(args + flags + ["--max-iters", "8", "--resume"], out, nproc)
        got = ckpt_losses(out)
        note = [r.get("note") or "" for r in metrics(out) if r.get("event") == "resume"][0]
        if name == "undelayed":
            assert "weights in use lag its master by one update" in note, note
            assert got[4] != full[4]  # the weights in use jumped one update ahead
        else:
            assert "weights in use lag" not in note, note
            np.testing.assert_allclose([got[i] for i in range(4, 8)],
                                       [full[i] for i in range(4, 8)], rtol=1e-5)


def check_root_kept_across_micro_steps(rank, world_size):
    """ZeRO-3 keeps the root unit gathered across the micro-steps of a step (zero3.py). A loop
    of one's own may call no_sync() around every micro-step, the last included: the root is
    then still gathered at step(), and the next forward must not read its old weights. Every
    ZeRO-3 engine, offloaded and delayed too, lands bitwise where the loop without it does."""
    from machinery.engines import ZeRO3, offloaded  # a loop of one's own: the guarded engines
    for Engine in (ZeRO3, offloaded(ZeRO3), offloaded(ZeRO3, delayed=True)):
        runs = []
        for every in (False, True):
            torch.manual_seed(0)
            model = GPT(GPTConfig(**CFG))
            zero = Engine(model, 3, lr=LR, weight_decay=0.1, bucket_mb=0.002, rank=rank,
                          world_size=world_size)
            for step in range(3):
                for micro in range(2):
                    x, y = get_batch(DATA, SEED, step, micro, rank, world_size, B, T, 2)
                    with zero.no_sync() if every or micro == 0 else contextlib.nullcontext():
                        (model(x, y)[1] / 2).backward()
                        zero.finish_backward()
                zero.step()
            zero.wait_published()
            runs.append(weights(zero))
        for mine, theirs in zip(*runs):
            assert torch.equal(mine, theirs), Engine.__name__


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_root_kept_across_micro_steps_is_never_stale(world_size):
    run_distributed(check_root_kept_across_micro_steps, world_size)


@pytest.mark.parametrize("delayed", [False, True])
def test_an_engine_over_parameters_publishes_in_step(delayed):
    """ZeRO(model.parameters(), ...) has no forward to publish in, so step() publishes: the
    offloaded engine, delayed or not, trains the parameters as it trains the module (the
    same losses, bitwise: each forward reads the weights the module's would have waited for)."""
    from machinery.engines import ZeRO, offloaded  # a loop of one's own: the guarded engines
    runs = []
    for over_params in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        zero = offloaded(ZeRO, delayed=delayed)(
            model.parameters() if over_params else model, 1, lr=LR, bucket_mb=0.002)
        losses = []
        for step in range(4):
            x, y = get_batch(DATA, SEED, step, 0, 0, 1, B, T, 1)
            loss = model(x, y)[1]
            loss.backward()
            zero.step()
            losses.append(loss.item())
        runs.append(losses)
    assert runs[0] == runs[1] and runs[1][0] != runs[1][-1], runs
