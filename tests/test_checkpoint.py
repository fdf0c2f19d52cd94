"""Checkpoints: exact resume, resharding across world sizes, stages and file counts, bad files,
preemption (SIGTERM) and a killed rank under torchrun --max-restarts."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from checkpoint import list_checkpoints
from conftest import ROOT, free_port, run_distributed, run_train
from machinery import checked_ckpt
from machinery.checked_ckpt import Reader
from train import main
from configurator import UserError

TINY = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4",
        "--eval-iters", "2", "--eval-interval", "1000", "--log-interval", "1", "--warmup-iters", "2",
        "--learning-rate", "3e-3", "--lr-decay-iters", "12", "--dataset", "tiny"]


def cmd(nproc, extra=()):
    if nproc == 1:
        return [sys.executable, "train.py"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", *extra, "train.py"]


def run(args, out_dir, nproc=1, expect=0, extra=(), torchrun=False):
    """train.py on nproc ranks forked from the tests' warm server; as a subprocess (python
    train.py, or torchrun for several ranks) with torchrun=True or when an exit code is expected."""
    if not torchrun and expect == 0 and not extra:
        run_train(args + ["--out-dir", str(out_dir)], nproc)
        return None
    r = subprocess.run(cmd(nproc, extra) + args + ["--out-dir", str(out_dir)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == expect, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def losses(out_dir):
    """iter -> loss, the last row for each iteration."""
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {r["iter"]: r["loss"] for r in rows if "loss" in r}


def final_weights(out_dir):
    return Reader(list_checkpoints(out_dir)[-1]).weights()


def assert_same_weights(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("nproc, flags", [(1, ["--zero", "0", "--dropout", "0.1"]),
                                          (2, ["--zero", "2", "--ckpt-format", "sharded", "--dropout", "0.1"])])
def test_exact_continuation(data_root, tmp_path, nproc, flags):
    """2k steps in one run == k steps, resume, k more: bitwise (fp32, CPU, same world size). Dropout is
    on, so the RNG states have to come back too."""
    args = TINY + flags + ["--data-root", data_root]
    run(args + ["--max-iters", "12"], tmp_path / "full", nproc)
    run(args + ["--max-iters", "6"], tmp_path / "split", nproc)
    run(args + ["--max-iters", "12", "--resume"], tmp_path / "split", nproc)
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(full) == sorted(split) == list(range(12))
    assert [full[i] for i in range(12)] == [split[i] for i in range(12)]
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(tmp_path / "split"))


def test_reshard_across_world_sizes_stages_and_formats(data_root, tmp_path):
    """Save with ZeRO-3 on 4 ranks (sharded), resume with ZeRO-1 on 2 (consolidated), then with
    ZeRO-3 on 4 again: the end equals an uninterrupted run within the equivalence tolerance
    (the same global batch; only summation order differs)."""
    base = TINY + ["--data-root", data_root, "--batch-size", "2"]  # 4 ranks x 2 == 2 ranks x 4
    run(base + ["--max-iters", "12", "--zero", "1", "--batch-size", "4"], tmp_path / "ref", 2)
    out = tmp_path / "resharded"
    run(base + ["--max-iters", "4", "--zero", "3", "--ckpt-format", "sharded"], out, 4)
    run(base + ["--max-iters", "8", "--zero", "1", "--batch-size", "4", "--resume"], out, 2)
    assert Reader(list_checkpoints(out)[-1]).header["files"] == ["shard-00000.safetensors"]
    run(base + ["--max-iters", "12", "--zero", "3", "--resume", "--ckpt-format", "sharded"], out, 4)
    ref, got = losses(tmp_path / "ref"), losses(out)
    np.testing.assert_allclose([got[i] for i in range(12)], [ref[i] for i in range(12)], rtol=1e-4)
    assert_same_weights(final_weights(tmp_path / "ref"), final_weights(out), exact=False)


def test_bad_checkpoints_give_one_line_and_touch_nothing(data_root, tmp_path):
    out = tmp_path / "run"
    args = TINY + ["--data-root", data_root, "--max-iters", "4", "--save-interval", "2", "--keep-last", "2"]
    run(args + ["--ckpt-format", "sharded"], out)
    assert [os.path.basename(c) for c in list_checkpoints(out)] == ["ckpt-0000002", "ckpt-0000004"]

    def snapshot():
        return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(out) for f in fs}

    def expect_error(extra, message):
        """In-process (fast); the one-line CLI form is checked once below and in test_train.py."""
        before = snapshot()
        with pytest.raises(UserError, match=message):
            main(args + ["--max-iters", "6", "--out-dir", str(out)] + extra)
        assert snapshot() == before  # nothing overwritten, nothing added

    r = run(args + ["--max-iters", "6", "--resume", "--n-embd", "48"], out, expect=2)  # mismatched shape
    assert "another model" in r.stderr and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0
    newest = list_checkpoints(out)[-1]
    shard = os.path.join(newest, "shard-00000.safetensors")
    data = open(shard, "rb").read()
    # a folder someone edited: a shard copied in from another save, a header gone, a header
    # that names another model (sealed anew: only the checks behind the checksum can tell)
    other = os.path.join(list_checkpoints(out)[0], "shard-00000.safetensors")
    open(shard, "wb").write(open(other, "rb").read())
    expect_error(["--resume"], "shard-00000.safetensors: .* fails its checksum")
    open(shard, "wb").write(data)
    meta = os.path.join(newest, "checkpoint.json")
    os.rename(meta, meta + ".away")
    expect_error(["--resume"], "has no checkpoint.json")
    os.rename(meta + ".away", meta)
    meta_bytes, header = open(meta, "rb").read(), checked_ckpt.read_header(meta)
    checked_ckpt.write_header(meta, {**header, "model_args": {**header["model_args"], "n_layer": 3}})
    expect_error(["--resume"], "another model")
    open(meta, "wb").write(meta_bytes)
    open(shard, "wb").write(data[: len(data) // 2])  # truncated
    expect_error(["--resume"], "cannot read .*shard-00000.safetensors")
    open(shard, "wb").write(b"\x00garbage" * 100)  # corrupt
    expect_error(["--resume"], "cannot read .*shard-00000.safetensors")
    open(shard, "wb").write(data)

    # a pickle that would run code, in the header's place: read as the JSON it is not
    marker = tmp_path / "pwned"
    torch.save({"format": "consolidated", "payload": Evil(str(marker))}, meta)
    expect_error(["--resume"], "cannot read it: not JSON")
    assert not marker.exists()
    open(meta, "w").write("[" * 100000)  # JSON nested deeper than Python's parser recurses
    expect_error(["--resume"], "cannot read it: not JSON")
    torch.save({"format": "consolidated", "payload": Evil(str(marker))}, meta)
    with pytest.raises(UserError, match="not JSON"):
        main(TINY + ["--data-root", data_root, "--max-iters", "1", "--init-from", newest, "--out-dir", str(tmp_path / "new")])
    assert not marker.exists()


class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_sigterm_saves_and_resumes(data_root, tmp_path):
    out = tmp_path / "run"
    args = TINY + ["--data-root", data_root, "--max-iters", "100000", "--lr-decay-iters", "100000"]
    p = subprocess.Popen(cmd(1) + args + ["--out-dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(losses(out)) >= 3):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-2000:]
    assert "stopped by a signal" in stdout
    stopped_at = max(losses(out)) + 1
    assert os.path.basename(list_checkpoints(out)[-1]) == f"ckpt-{stopped_at:07d}"
    run(args[:-4] + ["--max-iters", str(stopped_at + 2), "--resume"], out)
    assert sorted(losses(out)) == list(range(stopped_at + 2))


@pytest.mark.slow
def test_sigkill_one_rank_under_torchrun_restarts_and_ends_the_same(data_root, tmp_path):
    """torchrun --max-restarts=1 restarts the group after a rank is killed (even mid-save); the
    run carries on from the newest complete checkpoint and ends with the uninterrupted loss."""
    args = TINY + ["--data-root", data_root, "--max-iters", "40", "--lr-decay-iters", "40", "--save-interval", "5",
                   "--zero", "2", "--resume", "--ckpt-format", "sharded"]
    run(args, tmp_path / "ref", 2)
    out = tmp_path / "killed"
    # --standalone (c10d rendezvous on a free port) and a store of the workers' own: when torchrun
    # shares its rendezvous store with the workers, a restarted gloo mesh can read the dead group's
    # addresses and fail with "connectFullMesh failed ... Connection refused" (pytorch#135712)
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "--max-restarts=1", "train.py"] + args + ["--out-dir", str(out)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    try:
        killed_run(p, out)
    finally:
        if p.poll() is None:  # never leave a hung group behind for the next test
            os.killpg(p.pid, signal.SIGKILL)
    ref, got = losses(tmp_path / "ref"), losses(out)
    assert got[39] == ref[39]
    assert_same_weights(final_weights(tmp_path / "ref"), final_weights(out))


def killed_run(p, out):
    """Kill rank 1 while a save is in progress: the moment a ckpt-*.tmp folder exists after the
    first complete checkpoint (polled without sleeping: a save of this model takes milliseconds)."""
    deadline, victim = time.time() + 120, None
    while time.time() < deadline and victim is None:
        if list_checkpoints(out):
            victim = rank_pid(str(out), 1)
        time.sleep(0.01)
    assert victim is not None
    mid_save = False
    while time.time() < deadline and not mid_save and p.poll() is None:
        mid_save = any(n.endswith(".tmp") for n in os.listdir(out))
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = p.communicate(timeout=120)
    assert mid_save  # the kill landed while a checkpoint was half written
    assert p.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout
    assert not any(n.endswith(".tmp") for n in os.listdir(out))  # the half-written one is gone


def rank_pid(out_dir, local_rank):
    """The pid of the training process of this run with LOCAL_RANK=local_rank."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"train.py" in cmdline and out_dir.encode() in cmdline and f"LOCAL_RANK={local_rank}".encode() in env \
                and not any(b"torch.distributed.run" in c for c in cmdline):
            return int(pid)
    return None


def resumes_exactly(args, tmp_path, nproc):
    """8 steps straight (tmp_path/full) and 4 + save + --resume to 8 (tmp_path/split): the same
    losses and final weights, bitwise. Returns the straight run's losses."""
    run(args + ["--max-iters", "8"], tmp_path / "full", nproc)
    run(args + ["--max-iters", "4"], tmp_path / "split", nproc)
    run(args + ["--max-iters", "8", "--resume"], tmp_path / "split", nproc)
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert [full[i] for i in range(8)] == [split[i] for i in range(8)]
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(tmp_path / "split"))
    return full


def test_lora_run_resumes_exactly(data_root, tmp_path):
    """LoRA under ZeRO-3 (adapters and the frozen nf4 base both sharded: saved from gathered tensors,
    restored into the shards): k + resume + k == 2k, bitwise."""
    args = TINY + ["--data-root", data_root, "--lora", "--quantize", "nf4", "--lora-targets", "q,v,mlp_fc",
                   "--learning-rate", "1e-2", "--zero", "3"]
    resumes_exactly(args, tmp_path, 2)
    full, split = (tmp_path / run / "adapter" / "adapter_model.safetensors"
                   for run in ("full", "split"))
    assert open(full, "rb").read() == open(split, "rb").read()


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_zero3_restores_a_frozen_base_into_its_shards(tmp_path, fmt):
    """Under ZeRO-3 the frozen base (here nf4 codes and scales) lives in shards: a checkpoint saves
    it from gathered tensors and restore writes it back into the shards, not into freed storage.
    The run restored into starts from another base, so a restore that wrote nothing would show."""
    from dataclasses import asdict

    import checkpoint
    import lora
    import quant
    from conftest import zero_step
    from model import GPT, GPTConfig
    from precision import GradScaler
    from zero3 import ZeRO3
    cfg = GPTConfig(block_size=16, vocab_size=20, n_layer=2, n_head=2, n_embd=64, bias=False)

    def build(seed):
        torch.manual_seed(seed)
        model = GPT(cfg)
        lora.apply_lora(model, rank=4, targets=("q", "v"))
        quant.quantize_base(model, "nf4")
        return model, ZeRO3(model, 3)

    (a, za), (b, zb) = build(0), build(1)
    x = torch.randint(0, 20, (2, 16))
    za.backward(a(x, x)[1])
    zero_step(za, GradScaler(init_scale=1.0, dynamic=False), 1e-2, 1.0)  # adapters move too
    header = {"config": {}, "model_args": asdict(cfg), "meta": {"vocab_size": 20}}
    path = checked_ckpt.save(str(tmp_path), 1, za, a, GradScaler(), header, fmt, 1)
    before = checkpoint.state_dict(zb, b)
    checked_ckpt.restore(path, zb, b, GradScaler(), {}, asdict(cfg), {"vocab_size": 20})
    want, got = checkpoint.state_dict(za, a), checkpoint.state_dict(zb, b)
    assert any(not torch.equal(before[k], want[k]) for k in want if "codes" in k)  # the bases differed
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert torch.equal(a(x, x)[1], b(x, x)[1])  # and the restored model computes the same


def _with_error_file(main, argv):
    """main(argv), but a UserError is written to OUT_DIR/error-RANK.txt (each rank)."""
    import torch.distributed as dist
    out = argv[argv.index("--out-dir") + 1]
    try:
        main(argv)
    except UserError as e:
        with open(os.path.join(out, f"error-{os.environ.get('RANK', '0')}.txt"), "w") as f:
            f.write(str(e))
        if dist.is_initialized():
            dist.destroy_process_group()


def _small_file_limit(main, argv):
    """A disk that fills up: files may not grow past 32 KiB (the checkpoints' shards are
    larger, metrics.jsonl is not). SIGXFSZ is ignored by train.py: writes fail with EFBIG."""
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, 32 * 1024))
    _with_error_file(main, argv)


def test_a_full_disk_mid_save_keeps_the_previous_checkpoint(data_root, tmp_path):
    args = TINY + ["--data-root", data_root, "--zero", "2", "--ckpt-format", "sharded",
                   "--save-interval", "2", "--lr-decay-iters", "8"]
    run(args + ["--max-iters", "8"], tmp_path / "ref", 2)
    out = tmp_path / "run"
    run(args + ["--max-iters", "4"], out, 2)
    before = list_checkpoints(out)
    run_train(args + ["--max-iters", "8", "--resume", "--out-dir", str(out)], 2,
              wrap=_small_file_limit)
    for rank in (0, 1):  # one line on every rank, naming the file and the intact checkpoint
        message = open(out / f"error-{rank}.txt").read()
        assert "File too large" in message and "ckpt-0000004 is intact" in message, message
        assert "\n" not in message
    assert list_checkpoints(out) == before  # ckpt-0000004 is still the newest
    assert not any(n.endswith(".tmp") for n in os.listdir(out))
    run(args + ["--max-iters", "8", "--resume"], out, 2)  # and it resumes from there, bitwise
    assert [losses(out)[i] for i in range(8)] == [losses(tmp_path / "ref")[i] for i in range(8)]
    assert_same_weights(final_weights(tmp_path / "ref"), final_weights(out))


def test_resume_refuses_other_lora_and_quantization_settings(data_root, tmp_path):
    """A LoRA rank, alpha or targets, or a quantization, other than the checkpoint's: restore
    would load misaligned or uninitialised tensors; it is one line naming the flag instead.
    LoRA dropout may change."""
    base = TINY + ["--data-root", data_root, "--max-iters", "2", "--lora"]
    runs = {"r8": ["--lora-rank", "8"], "r4": ["--lora-rank", "4", "--ckpt-format", "sharded"],
            "dq": ["--quantize", "nf4", "--double-quant"]}
    for name, flags in runs.items():
        run(base + flags, tmp_path / name)

    def refused(name, flags, message):
        with pytest.raises(UserError, match=message):
            main(base + flags + ["--max-iters", "4", "--resume", "--out-dir", str(tmp_path / name)])

    refused("r8", ["--lora-rank", "4"], "saved with --lora-rank 8, this run has --lora-rank 4")
    refused("r4", ["--lora-rank", "8", "--ckpt-format", "sharded"], "--lora-rank 4")
    refused("r8", ["--lora-rank", "8", "--lora-alpha", "2"], "--lora-alpha 1.0")
    refused("r8", ["--lora-rank", "8", "--lora-targets", "q,k,v"], "--lora-targets")
    refused("dq", ["--quantize", "nf4"], "--double-quant, this run has --no-double-quant")
    refused("dq", ["--quantize", "int8"], "--quantize nf4, this run has --quantize int8")
    with pytest.raises(UserError, match="--no-lora"):  # and no LoRA at all
        main(TINY + ["--data-root", data_root, "--max-iters", "4", "--resume",
                     "--out-dir", str(tmp_path / "r8")])
    run(base + ["--lora-rank", "8", "--lora-dropout", "0.1", "--max-iters", "4", "--resume"],
        tmp_path / "r8")
    assert max(losses(tmp_path / "r8")) == 3


def test_resume_at_or_past_max_iters_trains_nothing(data_root, tmp_path, capsys):
    args = TINY + ["--data-root", data_root, "--out-dir", str(tmp_path)]
    run(args + ["--max-iters", "4"], tmp_path)
    files = sorted(os.listdir(tmp_path))
    for max_iters in ("4", "2"):
        main(args + ["--max-iters", max_iters, "--resume"])  # returns: no endless loop
        assert "already at iteration 4" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == files


def test_another_precision_starts_a_fresh_scaler(data_root, tmp_path):
    """bf16 (a fixed scale of 1) resumed as fp16: a scale of 1 would let fp16 gradients
    underflow; the run starts the dynamic scaler fresh and says so."""
    args = TINY + ["--data-root", data_root, "--n-embd", "16", "--block-size", "8"]
    run(args + ["--max-iters", "2", "--bf16"], tmp_path)
    run(args + ["--max-iters", "3", "--fp16", "--resume"], tmp_path)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    resume = [r for r in rows if r.get("event") == "resume"][0]
    assert "--dtype bf16" in resume["note"] and "fresh loss scaler" in resume["note"]
    assert [r["loss_scale"] for r in rows if r.get("iter") == 2 and "loss" in r] == [2.0**16]


def test_the_loss_scale_floor_stops_a_nan_run(data_root, tmp_path):
    """fp16 with a learning rate that blows the weights up: every step overflows, the scale
    backs off to the floor (--min-loss-scale 1) instead of to 0.0 and a ZeroDivisionError, and
    the run stops with one line; nothing is saved from the broken state."""
    args = ["--device", "cpu", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size",
            "8", "--batch-size", "2", "--data-root", data_root, "--dataset", "tiny", "--fp16",
            "--learning-rate", "1e4", "--grad-clip", "0", "--warmup-iters", "0", "--max-iters", "60",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--save-interval", "40"]
    r = run(args, tmp_path, expect=2)
    assert "non-finite at any scale" in r.stderr and r.stderr.strip().count("\n") == 0
    steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert steps[-1]["loss_scale"] == 1.0 and steps[-1]["skipped"]
    assert list_checkpoints(tmp_path) == []


def _peak_gathered(rank, world_size, fmt, lora, folder):
    """ZeRO-3 on 2 ranks: save and restore, recording the most bytes gathered at once beyond the
    shards (zero.peak_gathered_bytes), against the largest unit."""
    import lora as lora_mod
    from conftest import make_zero
    from model import GPT, GPTConfig
    from precision import GradScaler
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=30, n_layer=8, n_head=2, n_embd=32)
    model = GPT(cfg)
    if lora:
        every = ("q", "k", "v", "attn_out", "mlp_fc", "mlp_proj")  # GPT's LINEARS' slices
        lora_mod.apply_lora(model, rank=4, targets=every)
    zero = make_zero(model, 3, rank=rank, world_size=world_size)
    units = [sum(b.numel * b.flat.element_size() for b in u.buckets) for u in zero.all_units]
    header = {"config": {}, "model_args": {}, "meta": {"vocab_size": 30}}
    peaks = []
    for step in ("save", "restore"):
        zero.peak_gathered_bytes = zero.gathered_bytes
        if step == "save":
            path = checked_ckpt.save(folder, 1, zero, model, GradScaler(), header, fmt, 1)
        else:
            checked_ckpt.restore(path, zero, model, GradScaler(), {}, {}, None)
        peaks.append(zero.peak_gathered_bytes)
    assert max(peaks) <= max(units), (peaks, max(units))
    if rank == 0:
        print(f"{fmt} lora={lora}: peak gathered during save {peaks[0]:,} B, restore "
              f"{peaks[1]:,} B; largest unit {max(units):,} B, all units {sum(units):,} B")


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
@pytest.mark.parametrize("lora", [False, True])
def test_zero3_saves_and_restores_one_unit_at_a_time(tmp_path, fmt, lora):
    run_distributed(_peak_gathered, 2, fmt, lora, str(tmp_path))


def _files_read(rank, world_size, folder):
    """A 2-rank ZeRO-3 restore of a 4-rank sharded checkpoint: every rank opens only the shards
    whose pieces overlap the ranges it owns now."""
    import checkpoint
    from conftest import make_zero
    from model import GPT, GPTConfig
    from precision import GradScaler
    opened, safe_open = [], checkpoint.safe_open

    def counted(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return safe_open(path, *args, **kwargs)

    checkpoint.safe_open = counted
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=30, n_layer=2, n_head=2, n_embd=32))
    zero = make_zero(model, 3, rank=rank, world_size=world_size)
    path = checkpoint.list_checkpoints(folder)[-1]
    checked_ckpt.restore(path, zero, model, GradScaler(), {}, {}, None)
    layout = checkpoint.Reader(path).header["layout"]
    owned = [(s.name, s.lo, s.hi) for s in zero.segments]
    owned += [(name, lo, hi) for name, lo, hi, _ in zero.frozen_pieces()]
    needed = {f"shard-{r:05d}.safetensors" for r, pieces in enumerate(layout)
              for name, lo, hi in owned
              if name in pieces and pieces[name][0] < hi and lo < pieces[name][1]}
    assert sorted(set(opened)) == sorted(needed), (rank, opened)
    assert len(needed) < len(layout)  # fewer than every shard


def _save_sharded_4(rank, world_size, folder):
    from conftest import make_zero
    from model import GPT, GPTConfig
    from precision import GradScaler
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=30, n_layer=2, n_head=2, n_embd=32))
    zero = make_zero(model, 3, rank=rank, world_size=world_size)
    header = {"config": {}, "model_args": {}, "meta": {"vocab_size": 30}}
    checked_ckpt.save(folder, 1, zero, model, GradScaler(), header, "sharded", 1)


def test_a_sharded_resume_reads_only_the_shards_it_needs(tmp_path):
    run_distributed(_save_sharded_4, 4, str(tmp_path))
    run_distributed(_files_read, 2, str(tmp_path))


def _lesson_round_trip(rank, world_size, folder):
    """checkpoint.py alone (no machinery/checked_ckpt.py): ZeRO-3 on 2 ranks, 2 steps, save
    (sharded), 2 more; a fresh run restored from the save by checkpoint.restore and stepped
    the same 2 equals it bitwise, and a 1-rank ZeRO-1 run restores the same weights."""
    import checkpoint
    from conftest import make_zero, zero_step
    from model import GPT, GPTConfig
    from precision import GradScaler
    cfg = GPTConfig(block_size=16, vocab_size=30, n_layer=2, n_head=2, n_embd=32, dropout=0.1)

    def run(stage, steps, path=None, save=False):
        torch.manual_seed(0)
        model = GPT(cfg)
        zero = make_zero(model, stage, rank=rank, world_size=world_size)
        scaler = GradScaler()
        if path:
            assert checkpoint.restore(path, zero, model, scaler)["iter"] == 2
        for step in steps:
            x = torch.randint(0, 30, (4, 16), generator=torch.Generator().manual_seed(step))
            zero.backward(model(x[rank::world_size], x[rank::world_size])[1])
            zero_step(zero, scaler, 1e-2, 1.0)
            if save and step == 1:
                path = checkpoint.save(folder, 2, zero, model, scaler, fmt="sharded")
        return checkpoint.state_dict(zero, model), path

    if world_size == 2:
        straight, path = run(3, range(4), save=True)
        resumed, _ = run(3, range(2, 4), path)
        if rank == 0:
            assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    else:
        path = checkpoint.list_checkpoints(folder)[-1]
        saved = checkpoint.Reader(path).weights()
        weights, _ = run(1, (), path)  # the model's names; its vocabulary padded with zeros
        assert all(torch.equal(saved[k], weights[k][:len(saved[k])]) for k in saved)


def test_the_lesson_alone_resumes_bitwise_and_reshards(tmp_path):
    run_distributed(_lesson_round_trip, 2, str(tmp_path))
    run_distributed(_lesson_round_trip, 1, str(tmp_path))
