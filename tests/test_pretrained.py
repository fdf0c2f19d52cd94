"""Real models in and out, end to end: a Hugging Face GPT-2 -> train.py (ZeRO-3, LoRA, QLoRA) ->
export.py --to hf -> transformers / peft give our logits (fp32, to 1e-5); and the bad input of
each step is one line that writes nothing.

Offline: the GPT-2 is tiny and random (transformers builds it here; GPT-2's 50257-token vocabulary
at width 16, so that the data set can be real GPT-2 BPE); huggingface_hub is never called.
"""
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from machinery import hf
from machinery import adapters
import export as export_cli
from machinery import exporter
from machinery import pretrained
import sample
from checkpoint import list_checkpoints
from machinery.checked_ckpt import Reader  # exporter.rebuild takes the checked one
from conftest import ROOT, TEXT, run_train
from configurator import UserError
from configurator import parse_args
from model import GPT, GPTConfig
from data.loader import get_batch
from train import build
from train import main

transformers = pytest.importorskip("transformers", reason="pip install -r requirements-test.txt")
peft = pytest.importorskip("peft", reason="pip install -r requirements-test.txt")

IDX = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
RUN = ["--device", "cpu", "--dataset", "bpe", "--batch-size", "2", "--eval-iters", "2", "--eval-interval", "100",
       "--log-interval", "1", "--max-iters", "3", "--warmup-iters", "0"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(a Hugging Face GPT-2 folder, a GPT-2 BPE data root holding the data set "bpe")."""
    from data.prepare import prepare
    root = tmp_path_factory.mktemp("pretrained")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # nothing left at its init value: zero biases would hide a swap
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(root / "gpt2")
    (root / "text.txt").write_text(TEXT * 30)
    prepare(input_path=str(root / "text.txt"), tokenizer="gpt2", name="bpe",
            out_root=str(root / "data"))
    return str(root / "gpt2"), str(root / "data")


def theirs(model, idx=IDX):
    with torch.no_grad():
        return model.eval()(idx).logits


def ours(model, idx=IDX):
    with torch.no_grad():
        return model.eval()(idx, targets=idx)[0]  # with targets: the logits at every position


def train(gpt2, out, extra, nproc):
    run_train(["--init-from", gpt2[0], "--data-root", gpt2[1], "--out-dir", str(out)] + RUN
              + extra, nproc)
    return list_checkpoints(out)[-1]


def export(capsys, *argv):
    rc = export_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_zero3_run_exports_to_transformers(gpt2, tmp_path, capsys):
    """HF -> 2 ranks of ZeRO-3 with a cropped context, sharded checkpoint -> HF: the step-0 loss is
    transformers' on the same batches, and transformers reads the trained export as our logits."""
    ckpt = train(gpt2, tmp_path / "run", ["--zero", "3", "--block-size", "32",
                                          "--ckpt-format", "sharded", "--learning-rate", "1e-2"], 2)
    header = Reader(ckpt).header
    assert header["model_args"]["n_layer"] == 2 and header["model_args"]["block_size"] == 32
    base = transformers.GPT2LMHeadModel.from_pretrained(gpt2[0])
    val = np.memmap(os.path.join(gpt2[1], "bpe", "val.bin"), dtype=np.uint16, mode="r")
    cfg = header["config"]
    losses = []
    for k in range(cfg["eval_iters"]):  # data.loader.estimate_loss's batches of the val split
        x, y = get_batch(val, cfg["seed"] + 7919 * 2, k, 0, 0, 1, cfg["batch_size"], 32, 1)
        losses.append(F.cross_entropy(theirs(base, x).flatten(0, 1), y.flatten()).item())
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    first = [r for r in rows if r.get("iter") == 0 and "val_loss" in r][0]
    assert first["val_loss"] == pytest.approx(np.mean(losses), rel=1e-5)

    rc, out, err = export(capsys, ckpt, "--to", "hf", tmp_path / "hf")
    assert rc == 0 and "GPT2LMHeadModel" in out, err
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf",
                                                                output_loading_info=True)
    assert not any(info.values()), info
    model = GPT(GPTConfig(**header["model_args"]))
    model.load_weights(Reader(ckpt).weights())
    expected = ours(model)
    assert (expected - theirs(base)).abs().max() > 1e-3  # three steps moved the weights
    torch.testing.assert_close(theirs(loaded), expected, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_zero2_run_exports_a_peft_adapter(gpt2, tmp_path, capsys):
    """HF -> LoRA on 2 ranks of ZeRO-2 -> base + PEFT adapter: peft's logits are ours, and ours is
    the untouched HF base plus our own adapter file (its base fingerprint matches)."""
    ckpt = train(gpt2, tmp_path / "run", ["--zero", "2", "--lora", "--lora-alpha", "16",
                                          "--lora-targets", "q,v,mlp_fc",
                                          "--learning-rate", "3e-2"], 2)
    rc, out, err = export(capsys, ckpt, "--to", "hf", tmp_path / "hf")
    assert rc == 0 and "PEFT" in out and os.path.isdir(tmp_path / "hf" / "adapter"), err
    model = GPT(GPTConfig(**hf.read_config(gpt2[0])))  # as sample.py --init-from builds it
    hf.load_into(model, gpt2[0])
    base_logits = ours(model)
    adapters.load_adapter(model, str(tmp_path / "run" / "adapter"))
    expected = ours(model)
    assert (expected - base_logits).abs().max() > 1e-3  # the adapter moved the logits
    for adapter in (tmp_path / "hf" / "adapter", tmp_path / "run" / "adapter"):  # one format
        base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
        peft_model = peft.PeftModel.from_pretrained(base, adapter)
        torch.testing.assert_close(theirs(peft_model), expected, atol=1e-5, rtol=0)
    # sample.py: the exported folder as --ckpt (+ its adapter); the HF base plus the run's
    for argv in (["--ckpt", str(tmp_path / "hf")],
                 ["--ckpt", str(tmp_path / "hf"), "--adapter", tmp_path / "hf" / "adapter"],
                 ["--init-from", gpt2[0], "--adapter", tmp_path / "run" / "adapter"]):
        rc = sample.main([str(a) for a in argv] + ["--start", "To be", "--max-new-tokens", "4",
                                                    "--num-samples", "1"])
        out, err = capsys.readouterr()
        assert rc == 0 and out.startswith("To be"), err


def test_qlora_merge_exports_plain_weights(gpt2, tmp_path, capsys):
    """HF -> QLoRA (nf4 base, --grad-ckpt) -> --merge: transformers' logits are those of the model
    as it trained (nf4 dequantized on the fly, plus the adapter); --to safetensors keeps it as
    stored (the nf4 codes too), and load_weights reads that back exactly."""
    ckpt = train(gpt2, tmp_path / "run", ["--lora", "--quantize", "nf4", "--grad-ckpt",
                                          "--lora-alpha", "16", "--learning-rate", "3e-2"], 1)
    rc, out, err = export(capsys, ckpt, "--to", "hf", tmp_path / "hf", "--merge")
    assert rc == 0 and "merged" in out and "dequantized" in out, err
    assert not os.path.exists(tmp_path / "hf" / "adapter")
    trained = exporter.rebuild(Reader(ckpt))  # quantized base + LoRA, as it trained
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(theirs(loaded), ours(trained), atol=1e-5, rtol=0)

    rc, out, err = export(capsys, ckpt, "--to", "safetensors", tmp_path / "w.safetensors")
    assert rc == 0, err
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    assert weights["transformer.h.0.attn.c_attn.weight.codes"].dtype == torch.uint8
    again = exporter.rebuild(Reader(ckpt))
    again.load_weights(weights)
    assert torch.equal(ours(again), ours(trained))


def test_lora_fingerprint_is_the_fp32_base(gpt2):
    """A bf16 LoRA run names its base as sample.py loads it (fp32): the adapter fits."""
    cfg = parse_args(["--init-from", gpt2[0], "--lora", "--bf16", "--block-size", "16"])
    source, _ = pretrained.hf_flags(cfg)
    init = lambda config, device, dtype: (
        pretrained.load_hf(source, config, device, dtype, lora=True), None)
    model, _, _ = build(cfg, 50257, torch.device("cpu"), torch.bfloat16, init=init)
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    assert model.transformer.wpe.weight.shape[0] == 16  # cropped
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again after to_empty
    assert not model.lm_head.weight[50257:].any()  # model.py's padded rows
    fp32 = GPT(GPTConfig(**hf.read_config(gpt2[0])))
    hf.load_into(fp32, gpt2[0])
    assert model.base_id == adapters.base_fingerprint(fp32)


# ----------------------------------------------------------------------------------------------
# Bad input: one line, nothing written

def one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def broken_copy(gpt2, tmp_path, name, tensor=None, config=None):
    """A copy of the GPT-2 folder with one tensor removed or replaced, or its config edited."""
    folder = tmp_path / "broken"
    shutil.copytree(gpt2[0], folder)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    if name:
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            sd = {k: f.get_tensor(k) for k in f.keys()}
        if tensor is None:
            del sd[name]
        else:
            sd[name] = tensor
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("case, words", [
    ("no config", ["neither", "config.json"]), ("llama", ["llama", "not gpt2"]),
    ("missing", ["h.1.mlp.c_fc.bias", "missing"]), ("misshapen", ["h.1.mlp.c_fc.weight", "shape"]),
    ("char data", ["GPT-2 BPE", "--tokenizer gpt2", "--dataset shakespeare"]),
    ("--n-layer 3", ["--n-layer 3 contradicts", "n_layer 2"]),
    ("--block-size 128", ["--block-size 128", "smaller"])])
def test_bad_init_from(gpt2, data_root, tmp_path, case, words):
    source, argv = gpt2[0], ["--data-root", gpt2[1]] + RUN
    if case == "no config":
        (tmp_path / "empty").mkdir()
        source = str(tmp_path / "empty")
    elif case == "llama":
        source = broken_copy(gpt2, tmp_path, None, config={"model_type": "llama"})
    elif case in ("missing", "misshapen"):
        name = "transformer.h.1.mlp.c_fc." + ("bias" if case == "missing" else "weight")
        bad = None if case == "missing" else torch.zeros(16, 3)  # (in, out) is (16, 64)
        source = broken_copy(gpt2, tmp_path, name, bad)
    elif case == "char data":
        argv = ["--data-root", data_root] + RUN + ["--dataset", "tiny"]
    else:
        argv += case.split()
    with pytest.raises(UserError) as e:
        main(["--init-from", source, "--out-dir", str(tmp_path / "out")] + argv)
    one_line(e, *words)
    assert not os.path.exists(tmp_path / "out")


def test_unreachable_hub(gpt2, tmp_path, monkeypatch):
    def snapshot_download(*args, **kw):
        raise OSError("no network")
    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = snapshot_download
    monkeypatch.chdir(tmp_path)  # no ./gpt2-medium folder to find instead
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    with pytest.raises(UserError) as e:
        main(["--init-from", "gpt2-medium", "--data-root", gpt2[1]] + RUN)
    one_line(e, "no network", "--init-from ./gpt2-medium")
    with pytest.raises(UserError) as e:
        main(["--init-from", "no_such_folder", "--data-root", gpt2[1]] + RUN)
    one_line(e, "no such file or folder", "config.json")


def test_bad_export(gpt2, data_root, tmp_path, capsys):
    ckpt = train(gpt2, tmp_path / "run", ["--max-iters", "1"], 1)
    (tmp_path / "file").write_text("")
    cases = [([tmp_path / "nowhere", "--to", "hf", tmp_path / "o"], "no checkpoint at"),
             ([ckpt, "--to", "hf", tmp_path / "file" / "o"], "cannot write"),
             ([ckpt, "--to", "hf", tmp_path / "file"], "is a file"),
             ([ckpt, "--to", "hf", tmp_path / "o", "--merge"], "no LoRA adapter"),
             ([ckpt, "--to", "safetensors", tmp_path / "o", "--dtype", "bf16"], "--dtype")]
    for argv, words in cases:
        rc, out, err = export(capsys, *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1 and words in err, err
    with pytest.MonkeyPatch.context() as mp:  # --to hf without transformers: before any read
        mp.setitem(sys.modules, "transformers", None)
        rc, out, err = export(capsys, ckpt, "--to", "hf", tmp_path / "o")
    assert rc == 2 and err.count("\n") == 1 and "pip install transformers" in err, err
    # the command line itself: python export.py
    r = subprocess.run([sys.executable, "export.py", ckpt, "--to", "hf", str(tmp_path / "o"),
                        "--merge"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and r.stderr.startswith("export.py: error:"), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "o")
