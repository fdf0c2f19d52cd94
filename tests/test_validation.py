"""Nothing silently wrong, nothing lost: every file and flag is checked before it is used.

One test per kind of bad input: another vocabulary of the same size, flipped or missing tensor
bytes, two runs on one folder, a cut-off metrics.jsonl, configs, adapters and headers that
claim absurd sizes, edited exports, flags out of range, and the wording of the refusals. Runs
are tiny and in-process (train.main); a CLI's one-line form is checked by calling its main."""
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
from machinery import hf
import lora
from machinery import adapters
import export
from machinery import pretrained
from machinery import rundir
import sample
from machinery import checked_ckpt, validate
from checkpoint import list_checkpoints
from machinery.checked_ckpt import Reader
from configurator import UserError
from configurator import parse_args
from conftest import ROOT, TEXT, free_port, make_zero
from data.prepare import prepare
from model import GPT, GPTConfig
from precision import GradScaler
from train import main

TINY = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
        "32", "--batch-size", "4", "--eval-iters", "1", "--eval-interval", "1000",
        "--log-interval", "1", "--warmup-iters", "1", "--learning-rate", "3e-3",
        "--lr-decay-iters", "12", "--dataset", "tiny", "--max-iters", "2", "--save-interval", "1"]


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory):
    """Two finished runs, each with ckpt-0000001 and ckpt-0000002: consolidated, and a sharded
    LoRA run (which also wrote an adapter)."""
    root = tmp_path_factory.mktemp("runs")
    main(TINY + ["--data-root", data_root, "--out-dir", str(root / "cons")])
    main(TINY + ["--data-root", data_root, "--out-dir", str(root / "shard"), "--lora",
                 "--ckpt-format", "sharded"])
    return root


def copy_run(runs, name, tmp_path):
    out = tmp_path / name
    shutil.copytree(runs / name, out)
    return out


def resume(data_root, out, *extra):
    main(TINY + ["--data-root", data_root, "--out-dir", str(out), "--resume", "--max-iters", "3"]
         + (["--lora", "--ckpt-format", "sharded"] if out.name == "shard" else []) + list(extra))


# ----------------------------------------------------------------------------------------------
# 1. the vocabulary itself, not its size

def test_another_vocabulary_of_the_same_size_is_refused(data_root, runs, tmp_path):
    other = tmp_path / "data"
    (other).mkdir()
    text = (TEXT * 100)[:40000]
    assert "z" in text and "~" not in text
    (other / "input.txt").write_text(text.replace("z", "~"))  # 'z' -> '~': as many characters
    prepare(input_path=str(other / "input.txt"), name="tiny", out_root=str(other))
    out = copy_run(runs, "cons", tmp_path)
    with pytest.raises(UserError, match="another vocabulary"):
        resume(str(other), out)
    with pytest.raises(UserError, match="another vocabulary"):
        main(TINY + ["--data-root", str(other), "--init-from", str(list_checkpoints(out)[-1]),
                     "--out-dir", str(tmp_path / "new")])
    # --input into the base's vocabulary keeps working: its text is encoded in the base's ids
    (tmp_path / "notes.txt").write_text(TEXT[:3000])
    main(TINY + ["--data-root", str(other), "--init-from", str(list_checkpoints(out)[-1]),
                 "--input", str(tmp_path / "notes.txt"), "--out-dir", str(tmp_path / "tuned"),
                 "--max-iters", "1"])
    assert list_checkpoints(tmp_path / "tuned")
    # the adapter names its vocabulary; loading it onto a model of another one is refused
    adapter = str(runs / "shard" / "adapter")
    meta = Reader(list_checkpoints(runs / "shard")[-1]).header["meta"]
    assert adapters.read_adapter(adapter)[1]["vocab"] == validate.vocab_id(meta)
    model = GPT(GPTConfig(**Reader(list_checkpoints(runs / "cons")[-1]).header["model_args"]))
    with pytest.raises(UserError, match="vocabulary"):
        adapters.load_adapter(model, adapter, vocab="char:0123456789abcdef")


# ----------------------------------------------------------------------------------------------
# 2-3. every byte checked, every element from the file

def flip_bytes_of(path, tensor):
    """Flip 4 bytes in the middle of a tensor's bytes inside a safetensors file."""
    data = bytearray(open(path, "rb").read())
    raw = tensor.contiguous().numpy().tobytes()
    at = data.find(raw[:256])
    assert at > 0
    for i in range(at + 400, at + 404):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def rewrite(path, tensors=None, **fields):
    """Checkpoint folder path as a writer with a bug would leave it: file 0's tensors replaced
    or added (`tensors`, their crc32 in the header fitting them), header fields replaced
    (`fields`), sealed anew: every checksum fits, only the checks behind them can tell."""
    meta = os.path.join(path, checkpoint.HEADER)
    h = json.loads(json.dumps({**checked_ckpt.read_header(meta), **fields}))  # a copy
    if tensors:
        file = os.path.join(path, h["files"][0])
        with safe_open(file, framework="pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
        saved.update(tensors)
        checked_ckpt.write_shard(file, saved)
        h["crc"][0].update(checked_ckpt.checksums(tensors))
    checked_ckpt.write_header(meta, h)


def test_flipped_tensor_bytes_fail_their_checksum(data_root, runs, tmp_path):
    name = "transformer.wte.weight"
    for run, key in (("cons", "master"), ("shard", "value")):
        out = copy_run(runs, run, tmp_path)
        path = os.path.join(list_checkpoints(out)[-1], "shard-00000.safetensors")
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(f"{name}/{key}")
        flip_bytes_of(path, t)
        with pytest.raises(UserError, match=r"fails its checksum.*resume from .*ckpt-0000001"):
            resume(data_root, out)


def test_a_tensor_shorter_than_its_shape_is_refused(data_root, runs, tmp_path):
    name = "transformer.h.0.mlp.c_fc.weight"  # 4,096 elements
    for run, key in (("cons", "master"), ("shard", "value")):  # a whole tensor; a shard's piece
        out = copy_run(runs, run, tmp_path)
        path = list_checkpoints(out)[-1]
        with safe_open(os.path.join(path, "shard-00000.safetensors"), framework="pt") as f:
            short = f.get_tensor(f"{name}/{key}")[:100].clone()
        rewrite(path, {f"{name}/{key}": short})
        with pytest.raises(UserError, match=f"holds {key} of shape .100., not .4096."):
            resume(data_root, out)


# ----------------------------------------------------------------------------------------------
# 4-5. one writer per folder; a log that survives

def write_lock(out, pid):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lock"), "w") as f:
        json.dump({"pid": pid, "host": socket.gethostname()}, f)


def test_one_writer_per_out_dir(data_root, runs, tmp_path, capsys):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = copy_run(runs, "cons", tmp_path)
        before = sorted(os.listdir(out))
        write_lock(out, other.pid)  # a live run holds the folder
        with pytest.raises(UserError, match=f"in use by the run of pid {other.pid}"):
            resume(data_root, out)
        assert sorted(os.listdir(out)) == sorted(before + ["lock"])  # nothing written
        # its save in progress is not "stale"; a dead run's is cleared
        for name, pid in (("ckpt-0000007.tmp", other.pid), ("ckpt-0000008.tmp", 1 << 22)):
            os.makedirs(out / name)
            with open(out / name / "owner.json", "w") as f:
                json.dump({"pid": pid, "host": socket.gethostname()}, f)
        os.makedirs(out / "ckpt-0000009.tmp")  # crashed before naming its owner
        rundir.clear_stale_saves(str(out))
        assert sorted(n for n in os.listdir(out) if n.endswith(".tmp")) == ["ckpt-0000007.tmp"]
    finally:
        other.kill()
        other.wait()
    write_lock(out, other.pid)  # now dead: taken over with a note, released at the end
    resume(data_root, out)
    assert f"took over {out / 'lock'} from pid {other.pid}" in capsys.readouterr().out
    assert not os.path.exists(out / "lock") and max(map(str, list_checkpoints(out))).endswith("3")


class FullDisk:
    """metrics.jsonl on a full disk: every write fails with ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


def test_metrics_jsonl_survives_a_cut_line_and_a_full_disk(data_root, runs, tmp_path, capsys,
                                                            monkeypatch):
    out = copy_run(runs, "cons", tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"iter": 2, "loss": 3.8')  # a write cut short by a crash
    before = open(out / "metrics.jsonl").read()
    resume(data_root, out)
    assert "its last line was cut short" in capsys.readouterr().out
    text = open(out / "metrics.jsonl").read()
    assert text.startswith(before + "\n")  # appended after the cut line, nothing truncated
    rows = rundir.read_metrics(out / "metrics.jsonl")  # the cut line skipped
    assert rows[-1]["event"] == "end" and [r["iter"] for r in rows if "loss" in r] == [0, 1, 2]
    full = tmp_path / "full"  # (/dev/full as metrics.jsonl is a device: refused at start)
    monkeypatch.setattr(rundir, "open", lambda path, mode="r", *args, **kwargs: FullDisk()
                        if path.endswith("metrics.jsonl") and "a" in mode
                        else open(path, mode, *args, **kwargs), raising=False)
    main(TINY + ["--data-root", data_root, "--out-dir", str(full)])
    printed = capsys.readouterr().out
    assert printed.count("cannot write") == 1 and "No space left on device" in printed
    assert [os.path.basename(c) for c in list_checkpoints(full)] == ["ckpt-0000001",
                                                                    "ckpt-0000002"]


# ----------------------------------------------------------------------------------------------
# 6-9. sizes validated before anything is allocated

def quick(fn, error, match):
    """fn() raises error matching match, in well under a second."""
    t0 = time.time()
    with pytest.raises(error, match=match):
        fn()
    assert time.time() - t0 < 1.0


HF_ARGS = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
               bias=True)


def test_hf_configs_are_checked_before_the_model_is_built(tmp_path):
    folder = str(tmp_path / "hf")
    hf.save_hf(GPT(GPTConfig(**HF_ARGS)).state_dict(), HF_ARGS, folder)
    good = json.load(open(os.path.join(folder, "config.json")))
    edits = [({"n_layer": 10**5}, "n_layer is 100000"), ({"n_embd": 10**6}, "n_embd is 1000000"),
             ({"n_layer": 2.0}, "n_layer is 2.0, not an integer"),
             ({"resid_pdrop": "x"}, "resid_pdrop is 'x', not a number"),
             ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon is '1e-5'"),
             ({"vocab_size": 50257.0}, "vocab_size is 50257.0")]
    for edit, message in edits:
        json.dump({**good, **edit}, open(os.path.join(folder, "config.json"), "w"))
        quick(lambda: hf.read_config(folder), UserError, message)
    # a config that does not fit its weights: refused from the headers, before any model exists
    json.dump({**good, "n_layer": 3}, open(os.path.join(folder, "config.json"), "w"))
    cfg = parse_args(["--init-from", folder, "--device", "cpu"])
    quick(lambda: pretrained.open_init(cfg), UserError, "h.2.ln_1.weight is missing")


def adapter_file(tmp_path, settings=None, vocab=None):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**HF_ARGS))
    lora.apply_lora(model, rank=4, targets=("q", "v"))
    path = str(tmp_path / "adapter")
    adapters.save_adapter(path, model, adapters.base_fingerprint(model), vocab)
    if settings is not None:  # the same tensors under edited settings
        weights = os.path.join(path, "adapter_model.safetensors")
        with safe_open(weights, framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        ours = json.loads(meta["nanozero"])
        save_file(tensors, weights, {"nanozero": json.dumps({**ours, "settings": settings})})
    return path


def test_adapter_settings_are_checked_before_apply_lora(tmp_path):
    ok = {"rank": 4, "alpha": 1.0, "dropout": 0.0, "targets": ["q", "v"]}
    edits = [({"rank": 0}, "rank 0"), ({"targets": ["q", "x"]}, "targets"),
             ({"extra": 1}, "settings .* are not"), ({"alpha": "2"}, "alpha '2'"),
             ({"rank": 10**9}, "rank 1000000000")]
    for edit, message in edits:
        path = adapter_file(tmp_path, {**ok, **edit})
        torch.manual_seed(0)
        fresh = GPT(GPTConfig(**HF_ARGS))  # the adapter's own base
        quick(lambda: adapters.load_adapter(fresh, path), UserError, message)
    torch.manual_seed(0)
    base = GPT(GPTConfig(**HF_ARGS))
    adapters.load_adapter(base, adapter_file(tmp_path, ok, vocab="char:x"), vocab="char:x")  # fits


def test_edited_checkpoint_headers_are_one_line(runs, tmp_path):
    out = copy_run(runs, "shard", tmp_path)
    path = list_checkpoints(out)[-1]
    good = checked_ckpt.read_header(os.path.join(path, checkpoint.HEADER))
    name = "transformer.h.0.attn.c_attn.lora_A"
    lo, hi = good["layout"][0][name]
    scaler = {k: v for k, v in good["scaler"].items() if k != "scale"}
    meta, rng = good["meta"], good["rng"][0]
    stoi = {**meta["stoi"], meta["itos"][0]: 1, meta["itos"][1]: 0}  # two ids swapped
    edits = [({"layout": [{**good["layout"][0], name: [lo + 8, hi + 8]}]}, "do not cover"),
             ({"meta": {**meta, "stoi": stoi}}, "stoi that is not itos read backwards"),
             ({"rng": [{**rng, "numpy": ["MT19937", 7, 0, 0, 0.0]}]}, "RNG states do not fit"),
             ({"opt_step": "7"}, "opt_step is '7'"), ({"scaler": scaler}, "loss scaler"),
             ({"iter": -3}, "iter -3"), ({"opt_step": -7}, "opt_step -7"),
             ({"world_size": 5}, "world_size 5 but 1 RNG states"),
             ({"files": ["../../shard-00000.safetensors"]}, "files is"),
             ({"crc": [{}]}, "has no checksum of"),
             ({"shapes": {**good["shapes"], "../../..": [4]}}, "'../../..'")]
    for edit, message in edits:  # each sealed with its checksum: the checks behind it
        rewrite(path, **{**good, **edit})
        quick(lambda: Reader(path), UserError, message)


def test_exports_check_model_args_and_write_only_the_models_names(runs, tmp_path, capsys):
    out = copy_run(runs, "cons", tmp_path)
    path = list_checkpoints(out)[-1]
    good = checked_ckpt.read_header(os.path.join(path, checkpoint.HEADER))
    files = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    target = str(tmp_path / "w.safetensors")

    def refused(message, tensors=None, **edit):
        rewrite(path, tensors, **{**good, **edit})  # each edit of the header as saved
        t0 = time.time()
        assert export.main([path, "--to", "safetensors", target]) == 2
        assert time.time() - t0 < 1.0 and not os.path.exists(target)
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err

    refused("n_layer is 100000", model_args={**good["model_args"], "n_layer": 10**5})
    refused("n_layer 3, the tensors", model_args={**good["model_args"], "n_layer": 3})
    # a consistent header that names a tensor no GPT has
    refused("holds evil.weight, which this model lacks", {"evil.weight/master": torch.zeros(4)},
            shapes={**good["shapes"], "evil.weight": [4]},
            layout=[{**good["layout"][0], "evil.weight": [0, 4]}])
    for f, data in files.items():  # the checkpoint as saved: it exports
        open(os.path.join(path, f), "wb").write(data)
    assert export.main([path, "--to", "safetensors", target]) == 0


# ----------------------------------------------------------------------------------------------
# 10-11. flags in range; a run that cannot step stops; NaN weights are never saved

BAD_FLAGS = [("--learning-rate", "-1"), ("--learning-rate", "nan"), ("--learning-rate", "inf"),
             ("--lora-dropout", "2"), ("--beta1", "1.5"), ("--beta2", "-0.1"),
             ("--bucket-mb", "nan"), ("--loss-scale", "nan"), ("--loss-scale", "inf"),
             ("--lora-alpha", "0"), ("--lora-alpha", "-4"), ("--weight-decay", "-1"),
             ("--grad-clip", "-1"), ("--warmup-iters", "-1"), ("--lr-decay-iters", "-1"),
             ("--min-lr", "-1"), ("--peak-tflops", "-5"), ("--min-loss-scale", "nan"),
             ("--dropout", "inf")]


@pytest.mark.parametrize("flag, value", BAD_FLAGS)
def test_flags_out_of_range_are_one_line(flag, value):
    with pytest.raises(UserError, match=f"^{flag} "):
        parse_args(["--lora", flag, value])


def test_a_fixed_scale_that_always_overflows_stops_and_nan_is_never_saved(data_root,
                                                                              tmp_path):
    out = tmp_path / "fp16"
    with pytest.raises(UserError, match="overflowed at the fixed loss scale 1e\\+09"):
        main(TINY + ["--data-root", data_root, "--out-dir", str(out), "--fp16", "--loss-scale",
                     "1e9", "--max-iters", "20", "--save-interval", "15"])
    assert list_checkpoints(out) == []
    torch.manual_seed(0)
    model = GPT(GPTConfig(**HF_ARGS))
    zero = make_zero(model, 1, rank=0, world_size=1)
    with torch.no_grad():
        zero.segments[0].master[3] = float("inf")
    header = {"config": {}, "model_args": HF_ARGS, "meta": {"vocab_size": 50}}
    with pytest.raises(UserError, match="master weights hold inf/NaN"):
        checked_ckpt.save(str(tmp_path / "nan"), 1, zero, model, GradScaler(), header,
                          "consolidated", 1)
    assert list_checkpoints(tmp_path / "nan") == []


# ----------------------------------------------------------------------------------------------
# 12. the refusals' wording

def test_empty_values_are_spelled_out():
    assert validate.as_flag("--quantize", "") == "no --quantize"
    assert validate.as_flag("--lora", None) == "no --lora"
    header = {"model_args": {}, "shapes": {}, "config": {"lora": True, "quantize": "",
                                                          "lora_targets": "q,v"}}
    config = {"lora": True, "quantize": "nf4", "lora_targets": "q,v"}
    with pytest.raises(UserError, match="saved with no --quantize, this run has --quantize "
                                         "nf4: drop --quantize to resume"):
        validate.check_compatible(header, {}, None, "ckpt", config)


def test_every_cli_usage_error_is_one_line(capsys):
    for cli, argv in ((export, ["ckpt", "--to", "bogus", "out"]),
                      (sample, ["--num-samples", "0"])):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "usage" not in err, err


@pytest.mark.slow
def test_under_torchrun_one_rank_prints_a_refusal(data_root, runs, tmp_path):
    out = copy_run(runs, "cons", tmp_path)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", "train.py"] + TINY +
                       ["--data-root", data_root, "--out-dir", str(out), "--resume",
                        "--n-embd", "48"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode != 0
    assert r.stderr.count("train.py: error:") == 1 and "another model" in r.stderr, r.stderr
