"""Runs kept apart, nothing silently wrong (issues 30 and 31): a folder holds one run's history,
odd files in it are one line, a checkpoint's header is checksummed whole, a resume keeps its
schedule, a lock names its run well enough to be cleared, every entry point's numbers are
bounded before any work, and the safetensors files we write carry a crc32 per tensor.

Each test is named by its issue's item. Runs are tiny and in-process (train.main); a CLI's
one-line form is checked by calling its main or run_main."""
import errno
import importlib
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
import memory
import train
from checkpoint import list_checkpoints
from configurator import UserError
from machinery import adapters, checked_ckpt, hf, rundir
from machinery import run as run_py
from machinery.checked_ckpt import Reader
from configurator import parse_args
from model import GPT, GPTConfig
from precision import GradScaler
from safetensors import safe_open
from zero import ZeRO

TINY = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
        "32", "--batch-size", "4", "--eval-iters", "1", "--eval-interval", "1000",
        "--log-interval", "1", "--learning-rate", "3e-3", "--dataset", "tiny"]
SCHEDULE = ["--warmup-iters", "1", "--lr-decay-iters", "12"]


def run(data_root, out, *flags):
    train.main(TINY + ["--data-root", data_root, "--out-dir", str(out)] + list(flags))


def snapshot(folder):
    """Every file under folder, by its path relative to it: its bytes (a FIFO or a symlink to
    nothing: its mode, never opened)."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(d, f)
            out[os.path.relpath(path, folder)] = open(path, "rb").read() \
                if os.path.isfile(path) else os.lstat(path).st_mode
    return out


# ----------------------------------------------------------------------------------------------
# 30.1 a folder holds one run's history

def test_a_fresh_run_never_eats_an_earlier_run(data_root, tmp_path, capsys):
    out = tmp_path / "out"
    run(data_root, out, *SCHEDULE, "--max-iters", "4", "--save-interval", "2")
    before = snapshot(out)
    with pytest.raises(UserError, match=r"holds an earlier run \(checkpoints up to \S+"
                       r"ckpt-0000004 and metrics.jsonl\): pass --resume to continue it, "
                       "another --out-dir for a new run, or --archive"):
        run(data_root, out, *SCHEDULE, "--max-iters", "2")
    assert snapshot(out) == before  # nothing replaced, nothing deleted, no lock left
    run(data_root, out, *SCHEDULE, "--max-iters", "2", "--archive")
    assert "--archive: moved the earlier run" in capsys.readouterr().out
    assert snapshot(out / "archive-1") == before  # the first run, whole, aside
    assert [os.path.basename(c) for c in list_checkpoints(out)] == ["ckpt-0000002"]
    # a resume of the first run from its archive still works: it is a run folder
    run(data_root, out / "archive-1", *SCHEDULE, "--max-iters", "5", "--resume")
    assert os.path.basename(list_checkpoints(out / "archive-1")[-1]) == "ckpt-0000005"


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    for it in (2, 4, 10, 20):  # 10 and 20: another history's, numbered past the new save
        os.makedirs(tmp_path / f"ckpt-{it:07d}")
    final = str(tmp_path / "ckpt-0000006")
    write = lambda tmp: open(os.path.join(tmp, "x"), "w").write("x")  # the save's one file
    assert rundir.write_save(str(tmp_path), final, write, 0, 1, bool, 2) is None
    assert os.listdir(final) == ["x"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000004", "ckpt-0000006", "ckpt-0000010",
                                            "ckpt-0000020"]


# ----------------------------------------------------------------------------------------------
# 30.2 every file read back from the folder checked by type

def test_odd_files_in_a_run_folder_are_one_line(data_root, tmp_path):
    first = tmp_path / "first"
    run(data_root, first, *SCHEDULE, "--max-iters", "2")
    with open(first / "metrics.jsonl", "a") as f:  # rows an editor or another program left
        for row in ({"iter": None, "loss": 1.0}, {"iter": "4", "loss": 1.0}, {"iter": [1]}, [1, 2], 7):
            f.write(json.dumps(row) + "\n")
    run(data_root, first, *SCHEDULE, "--max-iters", "3", "--resume")
    rows = rundir.read_metrics(first / "metrics.jsonl")
    assert [r["iter"] for r in rows if "loss" in r] == [0, 1, None, "4", 2]
    from bench.common import read_metrics
    assert read_metrics(str(first)) == rows

    def refused(name, make, message):
        out = tmp_path / f"odd-{len(os.listdir(tmp_path))}"
        shutil.copytree(first, out)
        make(out / name)
        before = snapshot(out)
        t0 = time.time()
        with pytest.raises(UserError, match=message):
            run(data_root, out, *SCHEDULE, "--max-iters", "4", "--resume")
        assert time.time() - t0 < 5 and snapshot(out) == before

    write = lambda text: lambda path: path.write_text(text)
    refused("metrics.jsonl", lambda p: (os.remove(p), os.mkdir(p)), "is a folder where the run's")
    refused("adapter", write("x"), "is a file where the run's adapter belongs")
    refused("lock", os.mkdir, "is a folder where the run's lock file belongs")
    for text in ("[1, 2]", "7", "{\"pid\": \"12\", \"host\": 3}", "not json"):
        refused("lock", write(text), r"lock holds no run's identity.*--take-over-lock")


def test_fuzz_a_seeded_slice():
    """The first cases of bench/fuzz.py's seed 30, each in a forked process: train.py,
    sample.py, memory.py and export.py with random flags and odd files in the run folder each
    exit 0 or refuse in one line, leave no half-written folder and change no file."""
    from bench import fuzz
    counts, bad = fuzz.fuzz(8, seed=30, log=lambda *a: None, torchrun=False)
    counts.pop("kinds")
    assert sum(row[0] for row in counts.values()) == 8 and not bad, bad


def test_fuzz_cap_leaves_cudas_address_space_alone(tmp_path):
    """A CUDA build of torch maps gigabytes of libraries and a CUDA context reserves ~10 GB of
    address space it never writes (pytorch#23441): a stand-in case reserves 16 GiB the same way
    (PROT_NONE) and must run under a 3 GB cap, which an address-space cap (RLIMIT_AS) refused.
    A case that writes 4 GiB is still stopped at once."""
    import multiprocessing
    from bench import fuzz
    ctx, cap = multiprocessing.get_context("forkserver"), 3 * 2**30
    script = tmp_path / "case.py"
    script.write_text("import mmap, sys\nimport torch\n"
                      "reserved = mmap.mmap(-1, 16 * 2**30, prot=0)  # as a CUDA context\n"
                      "x = torch.ones(2**27)  # 512 MiB written\n"
                      "if sys.argv[1:] == ['big']:\n    y = torch.ones(2**30)  # 4 GiB\n")
    rc, err = fuzz.run_case(ctx, str(script), [], str(tmp_path), 60, cap)
    assert rc == 0, err
    rc, err = fuzz.run_case(ctx, str(script), ["big"], str(tmp_path), 60, cap)
    assert rc == 1 and "can't allocate memory" in err, err


# ----------------------------------------------------------------------------------------------
# 30.4 --init-from a LoRA or QLoRA run

def val_losses(out):
    return [r["val_loss"] for r in rundir.read_metrics(out / "metrics.jsonl") if "val_loss" in r]


def test_init_from_a_checkpoint_takes_its_model_unless_a_flag_says_otherwise(data_root, tmp_path):
    """--init-from CKPT with no model flag builds the checkpoint's model (as --init-from gpt2
    reads config.json), where it refused 'use the same model flags'; a flag given that
    contradicts it is still refused in one line."""
    run(data_root, tmp_path / "pre", "--max-iters", "2")
    ckpt = list_checkpoints(tmp_path / "pre")[-1]
    bare = ["--device", "cpu", "--batch-size", "4", "--eval-iters", "1", "--dataset", "tiny",
            "--data-root", data_root, "--max-iters", "1", "--init-from", ckpt]
    train.main(bare + ["--out-dir", str(tmp_path / "ft")])
    assert val_losses(tmp_path / "ft")[0] == val_losses(tmp_path / "pre")[-1]
    with pytest.raises(UserError, match="another model .*n_embd 32 vs 48"):
        train.main(bare + ["--n-embd", "48", "--out-dir", str(tmp_path / "wide")])


def test_init_from_a_qlora_checkpoint(data_root, tmp_path, capsys):
    qlora = ["--lora", "--quantize", "nf4", "--double-quant", "--lora-targets", "q,v,mlp_fc"]
    run(data_root, tmp_path / "q", *SCHEDULE, *qlora, "--max-iters", "3",
        "--learning-rate", "3e-2")
    ckpt = list_checkpoints(tmp_path / "q")[-1]
    trained = val_losses(tmp_path / "q")[-1]
    # the same LoRA flags: the base as stored (its 4-bit codes) and the adapters
    run(data_root, tmp_path / "same", *qlora, "--max-iters", "1", "--init-from", ckpt)
    assert "its base as stored and its adapters" in capsys.readouterr().out
    assert val_losses(tmp_path / "same")[0] == trained
    fingerprints = []
    for name in ("q", "same"):  # the adapter names the base the first run trained on
        fingerprints.append(adapters.read_adapter(str(tmp_path / name / "adapter"))[1]
                            ["base_fingerprint"])
    assert fingerprints[0] == fingerprints[1]
    # any other flags: the model merged (base dequantized, adapters folded in)
    for name, flags in (("plain", []), ("r4", ["--lora", "--lora-rank", "4"])):
        run(data_root, tmp_path / name, "--max-iters", "1", "--init-from", ckpt, *flags)
        assert "its model merged" in capsys.readouterr().out
        assert abs(val_losses(tmp_path / name)[0] - trained) < 1e-4


# ----------------------------------------------------------------------------------------------
# 31.1 one checksum over the whole header, checked before anything is used

def tiny_checkpoint(folder, fmt="consolidated", header=None):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=8)
    model = GPT(cfg)
    zero = ZeRO(model, 0)
    header = {"config": {}, "model_args": vars(cfg), "meta": {"vocab_size": 8}, **(header or {})}
    return checked_ckpt.save(str(folder), 4, zero, model, GradScaler(), header, fmt, 2)


def flipped_files_refused(path, file, spans, read, all_bits_every=1):
    """Flip each byte of file in spans ([(start, stop, step)]) in turn, its lowest bit and, on
    every all_bits_every-th byte, all its bits: read(path) must refuse every one in one line.
    Returns how many bytes were flipped."""
    good, flipped = open(file, "rb").read(), 0
    fd = os.open(file, os.O_WRONLY)
    try:
        for start, stop, step in spans:
            for i in range(start, stop, step):
                for mask in (0x01, 0xFF)[:1 + (i % all_bits_every == 0)]:
                    os.pwrite(fd, bytes([good[i] ^ mask]), i)  # this byte flipped, the others as saved
                    with pytest.raises(UserError):
                        read(path)
                os.pwrite(fd, good[i:i + 1], i)
                flipped += 1
    finally:
        os.close(fd)
    assert open(file, "rb").read() == good
    return flipped


def read_all(path):
    """Every tensor of every file of a checkpoint, each checked."""
    reader = Reader(path)
    for i, crcs in enumerate(reader.header["crc"]):
        for key in crcs:
            reader.tensor(i, key)


def test_a_flipped_byte_anywhere_in_a_header_is_refused_before_any_is_read(tmp_path, monkeypatch):
    """The header's crc32 covers all of it (any change within 32 bits is caught, a property of
    the code): what can fail is a part the check leaves out or a read before the check. Every
    4th byte of the header (a field left out spans more than 4: its quoted key), every 8th of a
    shard's safetensors header and every 29th of its data, each flipped in turn (its lowest
    bit; all its bits on every 24th byte)."""
    opened, safe_open = [], checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda p, **k: opened.append(p) or safe_open(p, **k))
    path = tiny_checkpoint(tmp_path / "shard", "sharded")
    header = os.path.join(path, "checkpoint.json")  # not JSON, or its checksum fails
    spans = [(0, os.path.getsize(header), 4)]
    assert flipped_files_refused(path, header, spans, Reader, all_bits_every=24) > 5000
    assert opened == []  # refused before any tensor file was opened
    shard = os.path.join(path, "shard-00000.safetensors")
    head = 8 + int.from_bytes(open(shard, "rb").read(8), "little")
    flipped_files_refused(path, shard, [(0, head, 8), (head, os.path.getsize(shard), 29)],
                          read_all, all_bits_every=24)
    read_all(path)  # the files themselves read
    path = tiny_checkpoint(tmp_path / "cons")
    flipped_files_refused(path, os.path.join(path, "checkpoint.json"), [(0, 2000, 1)], Reader)
    Reader(path).weights()


def test_a_header_saved_before_extra_keys_reads_as_it_did(tmp_path):
    """A header as 0315d48 saved it (a format and a save_id, and delayed where extra_keys is
    now) reads: delayed false is no extra key, delayed true the weights in use ("in_use"),
    whose pieces it must then hold. (Checkpoints that 0315d48's train.py wrote, plain and
    --offload-optimizer delayed, resume bitwise here: checked by hand.)"""
    path = tiny_checkpoint(tmp_path / "c")
    file = os.path.join(path, "checkpoint.json")
    h = checked_ckpt.read_header(file)
    old = {k: v for k, v in h.items() if k != "extra_keys"}
    want = Reader(path).weights()
    checked_ckpt.write_header(file, dict(old, format="nanoZeRO", save_id="0" * 32, delayed=False))
    got = Reader(path).weights()
    assert all(torch.equal(want[k], got[k]) for k in want)
    checked_ckpt.write_header(file, dict(old, delayed=True))
    with pytest.raises(UserError, match="has no checksum of .*/in_use"):
        Reader(path)


def test_edited_fields_and_other_saves_files_are_refused(tmp_path):
    import json
    from safetensors.torch import save_file
    history = torch.rand(3, 17)
    fp8 = {"settings": {"scaling": "delayed", "history": 16}, "history": {"h.0": history}}
    path = tiny_checkpoint(tmp_path / "cons", header={"fp8": fp8})
    file = os.path.join(path, "checkpoint.json")
    good = json.load(open(file))
    rng = good["rng"][0]
    edits = [{"iter": 68}, {"opt_step": 5}, {"scaler": {**good["scaler"], "backoff_factor": 0.25}},
             {"rng": [{**rng, "torch": rng["torch"][:-8] + "AAAAAAAA"}]},
             {"fp8": {**good["fp8"], "settings": {"scaling": "delayed", "history": 8}}}]
    for edit in edits:  # valid JSON, every field well formed: only the checksum can tell
        json.dump({**good, **edit}, open(file, "w"))
        with pytest.raises(UserError, match="header fails its checksum"):
            Reader(path)
    json.dump(good, open(file, "w"))
    assert torch.equal(Reader(path).tensor(0, "fp8/h.0"), history)  # the histories: file 0's
    shard = os.path.join(path, "shard-00000.safetensors")
    with safe_open(shard, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    # a shard of another save: the same names and sizes, other values
    save_file({k: t + 1 if k.endswith("/master") else t for k, t in tensors.items()}, shard)
    with pytest.raises(UserError, match="master fails its checksum"):
        Reader(path).weights()
    save_file(tensors, shard)
    Reader(path).weights()


# ----------------------------------------------------------------------------------------------
# 31.2 the schedule kept on resume

def test_a_resume_keeps_the_saved_schedule(data_root, tmp_path, capsys):
    out = tmp_path / "out"
    run(data_root, out, "--max-iters", "6")  # --lr-decay-iters 6, --warmup-iters 0: derived
    capsys.readouterr()
    run(data_root, out, "--max-iters", "12", "--resume")
    assert ("schedule: warmup 0, cosine 3.00e-03 -> 1.00e-04 by iteration 6, then 1.00e-04 "
            "to --max-iters 12 (the checkpoint's") in capsys.readouterr().out
    lr = {r["iter"]: r["lr"] for r in rundir.read_metrics(out / "metrics.jsonl") if "lr" in r}
    assert [lr[i] for i in range(6, 12)] == [1e-4] * 6  # the decay ended at 6, as it was
    run(data_root, out, "--max-iters", "14", "--resume", "--lr-decay-iters", "14")
    assert "(changed: --lr-decay-iters 6 -> 14)" in capsys.readouterr().out
    lr = {r["iter"]: r["lr"] for r in rundir.read_metrics(out / "metrics.jsonl") if "lr" in r}
    assert lr[12] > 1e-4


# ----------------------------------------------------------------------------------------------
# 31.3 locks a restart can clear, taken before any work

def write_lock(out, **owner):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lock"), "w") as f:
        json.dump(owner, f)


def test_a_lock_names_its_run_and_a_dead_one_is_taken_over(data_root, tmp_path, capsys,
                                                                 monkeypatch):
    out = tmp_path / "out"
    run(data_root, out, *SCHEDULE, "--max-iters", "2")
    write_lock(out, pid=12345, host="elsewhere")  # another host: we cannot tell
    with pytest.raises(UserError, match="names pid 12345 on host elsewhere, which this host "
                       r"cannot look up; if none does, delete \S+lock or pass --take-over-lock"):
        run(data_root, out, *SCHEDULE, "--max-iters", "3", "--resume")
    run(data_root, out, *SCHEDULE, "--max-iters", "3", "--resume", "--take-over-lock")
    assert "took over" in capsys.readouterr().out
    # a live pid that is now another process (this test's own, started at another time)
    write_lock(out, pid=os.getpid(), host=socket.gethostname(), start_time=1)
    run(data_root, out, *SCHEDULE, "--max-iters", "4", "--resume")
    assert "is now another process" in capsys.readouterr().out
    # an earlier attempt of the same torchrun job (restarted on another node)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    write_lock(out, pid=12345, host="node-3", job="job-7", restart=0)
    run(data_root, out, *SCHEDULE, "--max-iters", "5", "--resume")
    assert "an earlier attempt (restart 0) of this torchrun job" in capsys.readouterr().out
    assert not os.path.exists(out / "lock")


def test_the_lock_comes_before_any_work(data_root, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "held"
        write_lock(out, pid=other.pid, host=socket.gethostname(),
                   start_time=rundir._start_time(other.pid))
        with pytest.raises(UserError, match=f"in use by the run of pid {other.pid}"):
            run(data_root, out, "--dataset", "nothing_here")  # refused before the data
    finally:
        other.kill()
        other.wait()
    with pytest.raises(UserError):  # a refused run leaves no empty --out-dir behind
        run(data_root, tmp_path / "never", "--n-embd", "30", "--n-head", "4")
    assert not os.path.exists(tmp_path / "never")
    # two runs started together (forked from the tests' warm server): one trains, the other
    # is refused in one line
    argv = TINY + ["--data-root", data_root, "--max-iters", "2", "--out-dir", str(tmp_path / "both")]
    ctx = multiprocessing.get_context("forkserver")
    runs = [ctx.Process(target=_cli, args=(argv, str(tmp_path / f"err-{i}"))) for i in range(2)]
    for p in runs:
        p.start()
    for p in runs:
        p.join(timeout=300)
    results = sorted((p.exitcode, open(tmp_path / f"err-{i}").read()) for i, p in enumerate(runs))
    assert [rc for rc, _ in results] == [0, 2], results
    assert results[1][1].count("\n") == 1 and ("in use by the run" in results[1][1]
                                               or "holds an earlier run" in results[1][1])


def _cli(argv, err, command="train"):
    """A command as its __main__ runs it (train.py: run.command; export.py, sample.py:
    their main's exit status), its stderr into the file err."""
    sys.stderr = open(err, "w", buffering=1)
    sys.stdout = open(os.devnull, "w")
    torch.set_num_threads(1)
    if command == "train":
        run_py.command(lambda: train.main(argv))
    sys.exit(importlib.import_module(command).main(argv))


# ----------------------------------------------------------------------------------------------
# 31.5 the tracebacks left: a failed adapter write, edited headers, sizes, out of memory

def test_a_failed_adapter_write_is_one_line_and_the_checkpoint_stays(data_root, tmp_path,
                                                                          monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(adapters, "save_adapter", full)
    out = tmp_path / "lora"
    with pytest.raises(UserError, match=r"could not write \S+adapter \(No space "
                       r"left on device\); the run is saved: \S+ckpt-0000002 holds the adapter"):
        run(data_root, out, *SCHEDULE, "--lora", "--max-iters", "2")
    Reader(list_checkpoints(out)[-1]).weights()  # intact


def test_headers_that_pass_the_checksum_are_still_checked(data_root, tmp_path):
    from test_validation import rewrite
    out = tmp_path / "fp8"
    fp8 = ["--bf16", "--fp8", "--fp8-scaling", "delayed", *SCHEDULE]
    run(data_root, out, *fp8, "--max-iters", "2")
    path = list_checkpoints(out)[-1]
    saved = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    good = Reader(path).header
    name = good["fp8"]["history"][0]
    rng = good["rng"][0]
    edits = [({"scaler": {**good["scaler"], "scale": 1e300}}, None, "scale is 1e\\+300"),
             ({"scaler": {**good["scaler"], "backoff_factor": 5.3e182}}, None, "backoff_factor"),
             ({"rng": [{**rng, "torch": rng["torch"][:100]}]}, None, "RNG states do not fit"),
             ({"rng": [{**rng, "torch": "not base64!"}]}, None, "RNG states do not fit"),
             ({"rng": [{**rng, "numpy": ["MT19937", 7, 0, 0, 0.0]}]}, None,
              "RNG states do not fit"),
             ({"rng": [{**rng, "python": [3, [1] * 9, None]}]}, None, "RNG states do not fit"),
             ({}, {f"fp8/{name}": torch.zeros(2, 5)}, f"amax history of {name} is not"),
             ({"fp8": {**good["fp8"], "history": good["fp8"]["history"][1:]}}, None,
              "FP8 linears differ"),
             ({"config": {**good["config"], "lr_decay_iters": "12"}}, None,
              "lr_decay_iters is '12'")]
    for edit, tensors, message in edits:
        for f, data in saved.items():  # each edit of the checkpoint as saved
            open(os.path.join(path, f), "wb").write(data)
        rewrite(path, tensors, **edit)  # sealed anew: only the checks behind the checksum tell
        with pytest.raises(UserError, match=message):
            run(data_root, out, *fp8, "--max-iters", "3", "--resume")


def test_sizes_are_checked_before_any_work(data_root, tmp_path, monkeypatch, capsys):
    with pytest.raises(UserError, match="--bucket-mb 1e\\+308: must be in"):
        parse_args(["--bucket-mb", "1e308"])
    with pytest.raises(UserError, match="--min-loss-scale 1e-300: must be in"):
        parse_args(["--min-loss-scale", "1e-300"])
    # a batch the memory cannot hold: one line before anything exists (the free memory faked)
    monkeypatch.setattr(run_py, "free_bytes", lambda device: 10**6)
    with pytest.raises(UserError, match="--batch-size 64 .* is free: lower --batch-size"):
        run(data_root, tmp_path / "big", "--batch-size", "64")
    assert not os.path.exists(tmp_path / "big")
    monkeypatch.undo()
    # out of memory mid-run (the allocator's error, faked): one line, the folder as it was

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "1000000000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(train, "estimate_loss", no_memory)
    argv = TINY + ["--data-root", data_root, "--out-dir", str(tmp_path / "oom")]
    status = run_py.run_main(lambda: train.main(argv), "train.py", (UserError,))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "out of memory" in err \
        and "lower --batch-size" in err
    assert not os.path.exists(tmp_path / "oom")


# ----------------------------------------------------------------------------------------------
# 31.6 memory.py's numbers bounded

@pytest.mark.parametrize("argv, message", [
    (["--params", "0"], "--params 0: use a number in"), (["--params", "nan"], "--params nan"),
    (["--params", "inf"], "--params inf"), (["--params", "1e30"], "--params 1e\\+30"),
    (["--params", "1e15", "--advise"], "--params 1e\\+15"),
    (["--world-size", "0"], "--world-size 0"), (["--vocab", "0"], "--vocab 0"),
    (["--n-layer", "100000"], "--n-layer is 100000"), (["--n-embd", "1000000"], "n-embd")])
def test_memory_py_numbers_are_bounded(argv, message):
    t0 = time.time()
    with pytest.raises(UserError, match=message):
        memory.main(argv)
    assert time.time() - t0 < 2


# ----------------------------------------------------------------------------------------------
# 31.7 a crc32 per tensor in the safetensors files we write

def flip_tensor_byte(path):
    data = bytearray(open(path, "rb").read())
    data[8 + int.from_bytes(data[:8], "little") + 5] ^= 0xFF  # in the first tensor's bytes
    open(path, "wb").write(data)


def test_safetensors_we_write_carry_a_crc32_per_tensor(tmp_path):
    import lora
    from safetensors.torch import save_file
    args = dict(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16, bias=True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**args))
    base = adapters.base_fingerprint(model)
    lora.apply_lora(model, rank=2, targets=("q", "v"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01) if p.requires_grad else None
    path = str(tmp_path / "adapter")  # PEFT's folder
    adapters.save_adapter(path, model, base)
    fresh = lambda: (torch.manual_seed(0), GPT(GPTConfig(**args)))[1]
    adapters.load_adapter(fresh(), path)
    flip_tensor_byte(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(UserError, match="fail their checksum"):
        adapters.load_adapter(fresh(), path)
    folder = str(tmp_path / "hf")  # an export's model.safetensors
    hf.save_hf(fresh().state_dict(), {**args, "dropout": 0.0}, folder)
    hf.load_pretrained(folder)
    flip_tensor_byte(os.path.join(folder, "model.safetensors"))
    with pytest.raises(UserError, match="fails its checksum"):
        hf.load_pretrained(folder)
    # a file from elsewhere has no checksums: read as it is
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    hf.load_pretrained(folder)


# ----------------------------------------------------------------------------------------------
# 51.1 files that are not files: one line before any is opened, never an open() that waits

def refused_in_time(argv, err, command="train", seconds=60):
    """`python COMMAND.py ARGV`, forked from the tests' warm server: exit 2 and one line on
    stderr, returned. A process still waiting after `seconds` (an open() on a FIFO never
    returns, and safetensors' reader retries through signals) is killed: the test fails."""
    p = multiprocessing.get_context("forkserver").Process(target=_cli,
                                                          args=(argv, str(err), command))
    p.start()
    p.join(timeout=seconds)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail(f"{command}.py {' '.join(map(str, argv))}: still waiting after {seconds} s")
    text = open(err).read()
    assert p.exitcode == 2 and text.count("\n") == 1, (p.exitcode, text)
    return text


def dangling(path):
    os.symlink(str(path) + ".gone", path)


ODD = {"a FIFO": os.mkfifo, "a folder": os.mkdir, "a dangling symlink": dangling}


def test_what_is_not_a_file_in_a_checkpoint_is_one_line(data_root, tmp_path):
    """A FIFO, a folder or a dangling symlink where a checkpoint's shard or checkpoint.json
    belongs: --resume, export.py and --init-from each say so in one line, the run's lock
    released and its folder as it was. A FIFO shard blocked train.py and export.py in open()
    for ever (safetensors retries on EINTR: a SIGTERM then left the lock behind)."""
    first = tmp_path / "first"
    run(data_root, first, *SCHEDULE, "--max-iters", "2")
    resume = TINY + SCHEDULE + ["--data-root", data_root, "--max-iters", "3", "--resume"]
    cases = [("shard-00000.safetensors", kind) for kind in ODD] + [("checkpoint.json", "a FIFO")]
    for i, (name, kind) in enumerate(cases):
        out = tmp_path / f"odd-{i}"
        shutil.copytree(first, out)
        path = os.path.join(list_checkpoints(out)[-1], name)
        os.remove(path)
        ODD[kind](path)
        before = snapshot(out)
        line = refused_in_time(resume + ["--out-dir", str(out)], tmp_path / f"err-{i}")
        assert f"{name} is {kind}, not a file" in line, line
        assert snapshot(out) == before  # nothing written, no lock left behind
    ckpt = list_checkpoints(tmp_path / "odd-0")[-1]  # the FIFO shard
    line = refused_in_time([ckpt, "--to", "safetensors", str(tmp_path / "w.safetensors")],
                           tmp_path / "err-export", "export")
    assert "shard-00000.safetensors is a FIFO" in line and not os.path.exists(tmp_path / "w")
    os.makedirs(tmp_path / "hf")  # and where export.py --to hf writes: config.json a FIFO
    os.mkfifo(tmp_path / "hf" / "config.json")
    line = refused_in_time([list_checkpoints(first)[-1], "--to", "hf", str(tmp_path / "hf")],
                           tmp_path / "err-hf", "export")
    assert "config.json is a FIFO, not a file" in line, line
    line = refused_in_time(TINY + ["--data-root", data_root, "--init-from", ckpt, "--out-dir",
                                   str(tmp_path / "new")], tmp_path / "err-init")
    assert "shard-00000.safetensors is a FIFO" in line and not os.path.exists(tmp_path / "new")


def test_what_is_not_a_file_where_the_log_or_the_lock_belongs_is_one_line(data_root,
                                                                          tmp_path):
    """A FIFO named metrics.jsonl held a resume at start-up for ever (opened to append, it
    waits for a reader); a FIFO named lock held the lock's read. Each is one line before any
    work now, the folder as it was and no lock of this run left; so is a dangling symlink."""
    first = tmp_path / "first"
    run(data_root, first, *SCHEDULE, "--max-iters", "2")
    resume = TINY + SCHEDULE + ["--data-root", data_root, "--max-iters", "3", "--resume"]
    for i, (name, kind) in enumerate([("metrics.jsonl", "a FIFO"), ("lock", "a FIFO"),
                                      ("metrics.jsonl", "a dangling symlink"),
                                      ("lock", "a dangling symlink")]):
        out = tmp_path / f"odd-{i}"
        shutil.copytree(first, out)
        if os.path.exists(out / name):
            os.remove(out / name)
        ODD[kind](out / name)
        before = snapshot(out)
        line = refused_in_time(resume + ["--out-dir", str(out)], tmp_path / f"err-{i}")
        assert f"{out / name} is {kind} where the run's" in line, line
        assert snapshot(out) == before  # nothing written, no lock of this run left behind


def test_what_is_not_a_file_in_an_adapter_or_a_model_to_start_from_is_one_line(data_root,
                                                                                 tmp_path):
    """sample.py --adapter FOLDER whose adapter_config.json is a FIFO, and --init-from
    (train.py, sample.py) a Hugging Face folder whose model.safetensors is a FIFO: each held
    its open() for ever; each is one line now, and train.py leaves no --out-dir behind."""
    run(data_root, tmp_path / "run", *SCHEDULE, "--max-iters", "2")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    os.mkfifo(adapter / "adapter_config.json")
    line = refused_in_time(["--ckpt", list_checkpoints(tmp_path / "run")[-1], "--adapter",
                            str(adapter), "--max-new-tokens", "1"], tmp_path / "err-a", "sample")
    assert "adapter_config.json is a FIFO, not a file" in line, line
    args = dict(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16, bias=True)
    folder = tmp_path / "hf"
    hf.save_hf(GPT(GPTConfig(**args)).state_dict(), {**args, "dropout": 0.0}, str(folder))
    os.remove(folder / "model.safetensors")
    os.mkfifo(folder / "model.safetensors")
    for command, argv in (("train", TINY + ["--data-root", data_root, "--out-dir",
                                            str(tmp_path / "new"), "--init-from", str(folder)]),
                          ("sample", ["--init-from", str(folder)])):
        line = refused_in_time(argv, tmp_path / f"err-{command}", command)
        assert "model.safetensors is a FIFO, not a file" in line, line
    assert not os.path.exists(tmp_path / "new")
