"""Tests for sample.py on a tiny checkpoint written in train.py's format (fp32 state dict with
model.py's names, GPTConfig kwargs, the TrainConfig dict, iter_num, and meta.json's dict from
data/prepare.py), so no training run is needed. Errors must be one line on stderr, exit status 2,
no traceback; a checkpoint whose pickle carries code must be refused without running it."""
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import sample
from data.prepare import load_meta, prepare
from model import GPT, GPTConfig
from configurator import TrainConfig
from conftest import ROOT

TEXT = "abc cab bac\nbad dab cad\n" * 10  # vocabulary: "\n", " ", a, b, c, d
SEP = "\n" + "-" * 40 + "\n"  # what sample.py prints between samples


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Path of a ckpt.pt laid out as train.py saves it, with meta.json exactly as prepare.py writes it."""
    tmp = tmp_path_factory.mktemp("ckpt")
    (tmp / "tiny.txt").write_text(TEXT, encoding="utf-8")
    meta = load_meta(prepare(input_path=str(tmp / "tiny.txt"), out_root=str(tmp / "data")))
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=meta["vocab_size"], n_layer=2, n_head=2, n_embd=16, bias=False)
    model = GPT(cfg)
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    path = tmp / "out" / "ckpt.pt"
    path.parent.mkdir()
    torch.save({"model": state, "model_args": asdict(cfg), "config": asdict(TrainConfig()),
                "iter_num": 0, "meta": meta}, path)
    return str(path)


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
    # --out-dir finds ckpt.pt in it; FILE: reads the prompt from a file
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
    data = Path(ckpt).read_bytes()
    (tmp_path / "half.pt").write_bytes(data[:len(data) // 2])
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "half.pt")], capsys), "truncated")
    (tmp_path / "empty.pt").write_bytes(b"")
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "empty.pt")], capsys), "cannot read")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "other.pt")], capsys), "not a checkpoint")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--start", "abz"], capsys),
                          "not in the vocabulary", "'z'")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--start", ""], capsys), "prompt is empty")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--start", "FILE:" + str(tmp_path / "no.txt")], capsys),
                          "cannot read the prompt")
    assert_one_line_error(*run_main(["--ckpt", ckpt, "--dtype", "fp8"], capsys), "unknown dtype 'fp8'")
    # weights for another model: load_state_dict's many-line message, flattened
    state = torch.load(ckpt, weights_only=True)
    state["model_args"]["n_embd"] = 32
    torch.save(state, tmp_path / "wrong.pt")
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "wrong.pt")], capsys), "does not fit model.py")


class Payload:
    """Unpickling calls open(marker, "w"): code that runs on load and leaves a file behind."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_with_code_is_refused(ckpt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    ok = torch.load(ckpt, weights_only=True)
    path = tmp_path / "ckpt.pt"
    torch.save({**ok, "model": Payload(str(marker))}, path)
    assert_one_line_error(*run_main(["--ckpt", str(path)], capsys), "refused", "could run code")
    assert not marker.exists()
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
    state = torch.load(ckpt, weights_only=True)
    state["model"]["transformer.h.1.mlp.c_fc.weight"][3, 4] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    assert_one_line_error(*run_main(["--ckpt", str(tmp_path / "nan.pt")], capsys),
                          "weights hold inf/NaN (transformer.h.1.mlp.c_fc.weight)")
