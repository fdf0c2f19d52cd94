"""Tests for sample.py on a tiny checkpoint saved as train.py saves it (machinery/checked_ckpt.py:
the model's fp32 masters, its GPTConfig kwargs, the TrainConfig dict and meta.json's dict from
data/prepare.py), so no training run is needed. Errors must be one line on stderr, exit status 2,
no traceback; a pickle that carries code is never opened."""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import save_file

import model as model_py
import sample
from data.prepare import load_meta, prepare
from machinery import checked_ckpt, hf
from model import GPT, GPTConfig
from configurator import TrainConfig
from conftest import ROOT, make_zero

TEXT = "abc cab bac\nbad dab cad\n" * 10  # vocabulary: "\n", " ", a, b, c, d
SEP = "\n" + "-" * 40 + "\n"  # what sample.py prints between samples


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Path of a checkpoint folder saved as train.py saves it, with meta.json exactly as
    prepare.py writes it."""
    tmp = tmp_path_factory.mktemp("ckpt")
    (tmp / "tiny.txt").write_text(TEXT, encoding="utf-8")
    meta = load_meta(prepare(input_path=str(tmp / "tiny.txt"), out_root=str(tmp / "data")))
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=meta["vocab_size"], n_layer=2, n_head=2, n_embd=16, bias=False)
    model = GPT(cfg)
    header = {"config": asdict(TrainConfig()), "model_args": asdict(cfg), "meta": meta}
    return checked_ckpt.save(str(tmp / "out"), 0, make_zero(model, 0), model, header=header)


def split_samples(stdout):
    assert stdout.endswith(SEP)
    return stdout[:-len(SEP)].split(SEP)


def run_main(argv, capsys):
    rc = sample.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, *fragments):
    assert rc == 2 and out == ""
    assert err.startswith("sample.py: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def test_cli_prints_samples(ckpt):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see conftest.one_thread()
    r = subprocess.run([sys.executable, "sample.py", "--ckpt", ckpt, "--max-new-tokens", "20",
                        "--num-samples", "2", "--start", "ab"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    samples = split_samples(r.stdout)
    assert len(samples) == 2
    for s in samples:
        # one character per token: the prompt plus 20 new characters, all from the vocabulary
        assert s.startswith("ab") and len(s) == 22 and set(s) <= set(TEXT), repr(s)


def test_main_in_process(ckpt, tmp_path, capsys):
    args = ["--ckpt", ckpt, "--max-new-tokens", "30", "--num-samples", "3", "--start", "cab"]
    rc, out, _ = run_main(args, capsys)
    assert rc == 0
    samples = split_samples(out)
    assert len(samples) == 3 and all(s.startswith("cab") and len(s) == 33 for s in samples)
    assert len(set(samples)) > 1  # a batch of samples, not one sample three times
    assert run_main(args, capsys)[1] == out  # same seed, same text
    assert run_main(args + ["--seed", "1"], capsys)[1] != out
    # greedy: every sample is the same; top_k=1 is greedy too
    greedy = run_main(args + ["--temperature", "0"], capsys)[1]
    assert len(set(split_samples(greedy))) == 1
    assert run_main(args + ["--top-k", "1", "--seed", "5"], capsys)[1] == greedy
    # --out-dir finds the newest checkpoint in it; FILE: reads the prompt from a file
    (tmp_path / "prompt.txt").write_text("d a\n", encoding="utf-8")
    rc, out, _ = run_main(["--out-dir", os.path.dirname(ckpt), "--start", f"FILE:{tmp_path / 'prompt.txt'}",
                           "--max-new-tokens", "5", "--num-samples", "1"], capsys)
    assert rc == 0 and split_samples(out)[0].startswith("d a\n")
    # 16-bit weights on the CPU (the LayerNorm and the sampling still run in fp32)
    rc, out, _ = run_main(args + ["--dtype", "bf16"], capsys)
    assert rc == 0 and all(set(s) <= set(TEXT) for s in split_samples(out))


def test_missing_checkpoint_cli(tmp_path):
    """The real command line: exit status 2 and one line, no traceback."""
    r = subprocess.run([sys.executable, "sample.py", "--out-dir", str(tmp_path / "nowhere")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert_one_line_error(r.returncode, r.stdout, r.stderr, "no checkpoint in", "ckpt-NNNNNNN",
                          "python train.py --out-dir")


def test_errors_in_process(ckpt, tmp_path, capsys):
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "none.pt")], capsys),
                          "no checkpoint at", "train")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")  # a file is no checkpoint
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "other.pt")], capsys),
                          "is a file, not a checkpoint", "ckpt-NNNNNNN folders")
    (tmp_path / "folder").mkdir()  # nor is a folder without checkpoint.json
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "folder")], capsys), "folder")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--start", "abz"], capsys),
                          "not in the vocabulary", "'z'")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--start", ""], capsys), "prompt is empty")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--start", "FILE:" + str(tmp_path / "no.txt")], capsys),
                          "cannot read the prompt")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--dtype", "fp8"], capsys), "unknown dtype 'fp8'")

def test_weights_that_do_not_fit_an_edited_model_py_are_one_line(ckpt, capsys, monkeypatch):
    """model.py edited since the save (a parameter added): load_state_dict's many-line message,
    flattened into one."""
    class Grown(GPT):
        def __init__(self, config):
            super().__init__(config)
            self.extra = torch.nn.Parameter(torch.zeros(3))

    monkeypatch.setattr(model_py, "GPT", Grown)
    assert_one_line_error(*run_main(["--ckpt", ckpt], capsys), "does not fit model.py", "extra")


class Payload:
    """Unpickling calls open(marker, "w"): code that runs on load and leaves a file behind."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_with_code_is_never_opened(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt.pt"  # nanoGPT's name
    torch.save({"model": Payload(str(marker)), "model_args": {}, "meta": {}}, path)
    assert_one_line_error(*run_main(["--ckpt", str(path)], capsys), "not a checkpoint")
    (tmp_path / "out").mkdir()
    os.replace(path, tmp_path / "out" / "ckpt.pt")  # where an --out-dir once kept it
    assert_one_line_error(*run_main(["--out-dir", str(tmp_path / "out")], capsys),
                          "no checkpoint in")
    assert not marker.exists()
    path = tmp_path / "out" / "ckpt.pt"
    # the payload is live: an unsafe load runs it (so the refusal above is what saved us)
    torch.load(path, weights_only=False)["model"].close()
    assert marker.exists()


def test_numbers_and_sizes_are_checked_before_any_work(ckpt, tmp_path, capsys):
    """Issues 30 and 31: samples x tokens against the free memory, before any is allocated; a
    temperature whose logits / T overflow, a seed no generator takes, NaN weights: one line."""
    cases = [(["--num-samples", "100000000"], "lower --num-samples or --max-new-tokens"),
             (["--max-new-tokens", "100000000000"], "needs about"),
             (["--temperature", "nan"], "--temperature nan"),
             (["--temperature", "1e-300"], "--temperature 1e-300: use 0 (greedy)"),
             (["--temperature", "inf"], "--temperature inf"),
             (["--seed", str(10**23)], "--seed 100000000000000000000000"),
             (["--seed", "-1"], "--seed -1"), (["--top-k", "-1"], "--top-k must be at least 0"),
             (["--max-new-tokens", "-1"], "--max-new-tokens must be at least 0")]
    for argv, fragment in cases:
        t0 = time.time()
        assert_one_line_error(*run_main(["--ckpt", ckpt, "--max-new-tokens", "4"] + argv, capsys),
                              fragment)
        assert time.time() - t0 < 5
    rc, out, err = run_main(["--ckpt", ckpt, "--max-new-tokens", "4", "--temperature", "1e-4"],
                            capsys)  # the smallest temperature still samples
    assert rc == 0 and len(split_samples(out)) == 3
    # a Hugging Face GPT-2 holding a NaN (a checkpoint of ours refuses to save one), by hand
    args = dict(block_size=16, vocab_size=50257, n_layer=1, n_head=2, n_embd=16, bias=True)
    sd = GPT(GPTConfig(**args)).state_dict()
    tensors = {k: (t.t() if k.endswith(hf.CONV1D) else t[:50257]).contiguous()
               for k, t in sd.items() if k != "lm_head.weight"}
    tensors["transformer.h.0.mlp.c_fc.weight"][4, 3] = float("nan")
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 16,
         "vocab_size": 50257}))
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "hf")], capsys),
                          "weights hold inf/NaN (transformer.h.0.mlp.c_fc.weight)")
