"""bench/'s plumbing (the benchmarks themselves are not tests): flag errors, --plot without
matplotlib, the charts, the cost table's judgements, the BENCHMARKS.md writer, our step against
train.py's, and smoke runs of the quick benchmarks (gpu.py --tiny, crossover.py, nanogpt.py
against a fake nanoGPT checkout)."""
import importlib
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from bench import common, costs, nanogpt, plots

# (module, argv) -> a one-line usage error about that flag
BAD_FLAGS = [("costs", ["--lora", "lora,full"]), ("costs", ["--stages", "0,4"]),
             ("costs", ["--stages", "0,x"]), ("costs", ["--dtypes", "fp8"]),
             ("costs", ["--runs", "out"]), ("loop", ["--steps", "0"]),
             ("quality", ["--seeds", "1,b"]), ("quality", ["--max-iters", "5"]),
             ("crossover", ["--widths", "130"]), ("gpu", ["--configs", "s1"]),
             ("nanogpt", []), ("plots", ["--costs", "no-such.json"]),
             ("head", ["--rows", "0"]), ("zeropp", ["--steps", "5"]),
             ("zeropp", ["--seeds", "1,b"]), ("fp8", ["--steps", "5"]),
             ("fp8", ["--models", "x"]), ("optimizers", ["--zero3-ranks", "5"]),
             ("optimizers", ["--optimizers", "adafactor"]), ("muon_deepspeed", ["--steps", "2"]),
             ("cpu_adam", ["--ds-path", "/nonexistent"])]


def run_main(module, argv):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"bench.{module}").main(argv)
    return e.value


@pytest.mark.parametrize("module, argv", BAD_FLAGS)
def test_bad_flags(capsys, module, argv):
    assert run_main(module, argv).code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m bench.{module}: error: --"), err


def test_nanogpt_says_where_to_get_it(capsys, tmp_path):
    for argv in ([], ["--nanogpt", str(tmp_path)]):
        assert run_main("nanogpt", argv).code == 2
        assert "git clone https://github.com/karpathy/nanoGPT" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_gpu_without_a_gpu_points_to_tiny(capsys):
    assert run_main("gpu", []).code == 2
    assert "--tiny" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "matplotlib" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    e = run_main("costs", ["--plot", "--no-write"])  # refused before any measurement
    assert "pip install matplotlib" in str(e.code) and "\n" not in str(e.code)


def test_plot_runs_without_metrics(tmp_path, capsys):
    assert run_main("costs", ["--plot", "--runs", str(tmp_path)]).code == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_charts(tmp_path):
    pytest.importorskip("matplotlib")
    psi = 1000

    def held(stage):
        return {"params": 4 * psi / (2 if stage == 3 else 1),
                "grads": 4 * psi / (2 if stage >= 2 else 1),
                "master": 0, "optimizer": 8 * psi / (2 if stage >= 1 else 1)}

    info = {}
    for k in ("ddp", "s0", "s1", "s2", "s3", "s3+ckpt", "s3+ckpt+lora"):
        info[k] = {"bytes": held(int(k[1]) if k[0] == "s" else 0), "act": 5000,
                   "traffic": (3 if k[:2] == "s3" else 2) * psi}
    results = {"world_size": 2, "results": [{"dtype": "fp32", "psi": psi, "info": info}]}
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"event": "model_state"}] + [{"iter": i, "loss": 4 - i / 10} for i in range(10)] + \
        [{"iter": 10, "train_loss": 3.0, "val_loss": 3.1}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    curves = plots.loss_curves([str(run)], [0], 2, "fp32", 10)
    assert list(curves) == ["run"] and len(curves["run"]) == len(rows)
    paths = plots.draw(results, curves, str(tmp_path / "figures"))
    assert [os.path.basename(p) for p in paths] == ["memory.png", "traffic.png", "loss.png"]
    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 10_000


def test_cost_rows_compare_with_memory_py_and_pair_ratios():
    """The table's judgements: an estimate equal to the measurement reads "exact", one a byte off
    says so; a time ratio is the median of per-round ratios (a slow round of both cancels), and a
    target is judged on that ratio."""
    from machinery.footprint import estimate
    from train import model_config
    cfg, vocab = costs.costs_config(), 65
    gpt = model_config(cfg, vocab)
    info, psi = {}, estimate(gpt)["psi"]
    for key in ("ddp", "zro", "fsdp", "s0", "s3", "s3+ckpt", "s0+lora"):
        stage, ckpt, lora = costs.parse_key(key) if key[0] == "s" else (0, False, "off")
        est = estimate(gpt, 2, stage, "fp32", cfg.batch_size, cfg.block_size, ckpt,
                       8 if lora != "off" else 0)
        state = {k: v for k, v in est["state"].items() if k != "total"}
        info[key] = {"bytes": state, "act": est["activations"]["total"], "traffic": 2 * psi,
                     "peaks": [0, 0]}
    info["s3"]["bytes"]["params"] += 1  # one byte more than memory.py says
    # rounds: the machine is 2x slower in round 2 for everyone; s0 is 1.05x DDP in each round
    rounds = {k: [100.0, 200.0, 100.0] for k in info}
    rounds["s0"] = [105.0, 210.0, 105.0]
    rounds["s3"] = [90.0, 250.0, 90.0]  # 0.9x FSDP in two rounds of three: met
    res = [{"dtype": "fp32", "psi": psi, "rounds": rounds, "info": info}]
    rows, missed = costs.cost_rows(res, 2, vocab)
    by = {r[0]: r for r in rows}
    assert by["ours, ZeRO-0"][3] == "exact" and by["ours, ZeRO-3"][3] == "-1 B"
    assert by["ours, ZeRO-0"][6] == "exact"  # activations
    assert by["ours, ZeRO-0"][11] == "1.05× DDP" and by["ours, ZeRO-0"][12].endswith("met")
    assert by["ours, ZeRO-3"][11] == "0.90× FSDP2"
    assert by["ours, ZeRO-0 + LoRA"][4] == "-"  # the paper has no formula for a frozen base
    assert missed == []
    rounds["s0"] = [120.0, 240.0, 120.0]
    assert costs.cost_rows(res, 2, vocab)[1] == ["ours, ZeRO-0 (fp32): ≤ 1.10× DDP"]


def test_write_section_keeps_the_prose_around_the_markers(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## Loop\n\nHow it measures.\n\n<!-- bench:loop -->\nold\n"
                    "<!-- /bench:loop -->\n\nAfter.\n")
    common.write_section("loop", "new \\1 table", str(path))  # backslashes stay as they are
    common.write_section("gpu", "first", str(path), heading="GPT-2 124M on one GPU")
    text = path.read_text()
    assert "How it measures.\n\n<!-- bench:loop -->\nnew \\1 table\n<!-- /bench:loop -->" in text
    assert "old" not in text and "After." in text
    assert text.endswith("## GPT-2 124M on one GPU\n\n<!-- bench:gpu -->\nfirst\n"
                         "<!-- /bench:gpu -->\n")


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_our_step_is_train_py_step(data_root, tmp_path, dtype):
    """common.our_step is what train.py's loop runs on a step: the same losses, to the bit."""
    from configurator import parse_args
    from data.prepare import load_meta
    from precision import DTYPES
    from train import build
    from machinery.run import fit_schedule
    from train import get_lr, main
    argv = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
            "--batch-size", "4", "--eval-iters", "1", "--eval-interval", "100", "--max-iters", "4",
            "--log-interval", "1", "--warmup-iters", "2", "--learning-rate", "3e-3",
            "--data-root", data_root, "--dataset", "tiny", "--dtype", dtype,
            "--out-dir", str(tmp_path), "--device", "cpu"]
    main(argv)
    with open(tmp_path / "metrics.jsonl") as f:
        logged = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    cfg = fit_schedule(parse_args(argv))
    folder = os.path.join(data_root, "tiny")
    data = np.memmap(os.path.join(folder, "train.bin"), dtype=np.uint16, mode="r")
    vocab = load_meta(folder)["vocab_size"]
    cpu = torch.device("cpu")
    model, zero, scaler = build(cfg, vocab, cpu, DTYPES[dtype])
    ours = []
    for it in range(cfg.max_iters):
        x, y = common.batch(data, cfg, it, cpu)
        loss, _ = common.our_step(model, zero, scaler, cfg, x, y, get_lr(it, cfg))
        ours.append(loss.item())
    assert ours == logged


@pytest.mark.slow
def test_gpu_tiny_and_crossover_smoke(capsys):
    run_main_ok("gpu", ["--tiny", "--configs", "plain,s0,s3,s0+ckpt", "--steps", "1",
                        "--rounds", "1", "--warmup", "1", "--no-write"])
    out = capsys.readouterr().out
    assert "ours: ZeRO-3" in out and "--tiny: a smoke run" in out
    run_main_ok("crossover", ["--widths", "32", "--steps", "1", "--rounds", "2", "--no-write"])
    out = capsys.readouterr().out
    assert "bf16 matrix units" in out and "| 32 |" in out


@pytest.mark.slow
def test_head_smoke(capsys):
    """Both heads in their own processes: ours saves less for backward, and the loss agrees.
    The bytes per logit: the GPU's fused path moves less than the eager one (a 4k vocabulary:
    GPT-2's 50k in bf16 takes a minute on a CPU without bf16 units)."""
    run_main_ok("head", ["--rows", "128", "--vocab", "4096", "--no-write"])
    out = capsys.readouterr().out
    per_logit = {line.split("|")[1].strip(): float(line.split("|")[4]) for line in
                 out.splitlines() if line.startswith(("| ours, ", "| textbook ("))
                 and len(line.split("|")) > 7}
    assert per_logit["ours, eager (as on a CPU)"] == 66  # the count, every kernel
    assert per_logit["ours, fused (a GPU, bf16)"] < per_logit["ours, eager (as on a CPU)"] / 1.9
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
            if line.startswith("| textbook") or line.startswith("| ours")}
    assert float(rows["ours"][2].replace(",", "")) < float(rows["textbook"][2].replace(",", ""))
    assert abs(float(rows["ours"][5]) - float(rows["textbook"][5])) < 1e-5


def run_main_ok(module, argv):
    importlib.import_module(f"bench.{module}").main(argv)


FAKE_TRAIN = """import sys
steps = int([a for a in sys.argv if a.startswith("--max_iters=")][0].split("=")[1])
for i in range(steps + 1):
    print(f"iter {i}: loss {4 - i / 100:.4f}, time {30 + i % 3:.2f}ms, mfu -100.00%")
"""
FAKE_PREPARE = """import numpy as np
text = open("input.txt").read()
stoi = {c: i for i, c in enumerate(sorted(set(text)))}
n = int(len(text) * 0.9)
np.array([stoi[c] for c in text[:n]], dtype=np.uint16).tofile("train.bin")
np.array([stoi[c] for c in text[n:]], dtype=np.uint16).tofile("val.bin")
"""


@pytest.mark.slow
def test_nanogpt_against_a_fake_checkout(tmp_path, capsys):
    """Prepares the checkout's data from our copy, runs both sides in turn, parses nanoGPT's
    per-iteration lines and our metrics.jsonl."""
    fake = tmp_path / "nanoGPT"
    (fake / "data" / "shakespeare_char").mkdir(parents=True)
    (fake / "train.py").write_text(FAKE_TRAIN)
    (fake / "data" / "shakespeare_char" / "prepare.py").write_text(FAKE_PREPARE)
    nanogpt.main(["--nanogpt", str(fake), "--rounds", "1", "--steps", "12", "--no-write"])
    out = capsys.readouterr().out
    assert (fake / "data" / "shakespeare_char" / "input.txt").stat().st_size == 1115394
    assert "| 0 |" in out and "| median |" in out
    assert "nanoGPT: ms/step" in out and "| 31.0 |" in out  # iters 10, 11, 12: 31, 32, 30 ms


def test_fp8_casts_are_timed_and_counted_without_their_products():
    """bench.fp8 --casts: the casts of one linear timed beside its matmuls, with the FP8
    products stubbed out (and put back after), and their bytes counted on the meta device:
    each cast passes over its tensor several times (fp32 copy, scale, clamp, cast)."""
    from bench import fp8 as bench_fp8
    from beyond import fp8
    real = fp8._scaled_mm
    (M, K, N, ms, ratio), = bench_fp8.cast_times(torch.device("cpu"), [(32, 32, 48)], 1)
    assert fp8._scaled_mm is real and set(ms) == {"fp32", "bf16", "casts"}
    elements = 32 * 32 + 48 * 32 + 32 * 48  # x, w, the output gradient
    assert bench_fp8.cast_bytes(M, K, N) > 10 * elements


def test_muon_deepspeed_pins_deepspeeds_groups_to_our_muon():
    """bench.muon_deepspeed without DeepSpeed: the param groups it hands DeepSpeed's Muon cover
    every parameter once; Muon's are beyond.muon.block_matrices, one group a shape, whose lr
    times DeepSpeed's scale sqrt(max(1, r / c)) is ours, LR x 0.2 sqrt(max(r, c)), and whose
    lr x weight decay is ours; AdamW's keep our decay split (embeddings yes, gains no)."""
    import math
    from beyond.muon import block_matrices
    from bench import muon_deepspeed as md
    model = md.gpt()
    groups = md.deepspeed_groups(model)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    mats, muon = block_matrices(model), groups[2:]
    assert {id(p) for g in muon for p in g["params"]} == mats and len(muon) == 4  # GPT's shapes
    for g in muon:
        rows, cols = g["params"][0].shape
        theirs = g["lr"] * math.sqrt(max(1.0, rows / cols))
        assert math.isclose(theirs, md.LR * 0.2 * math.sqrt(max(rows, cols)), rel_tol=1e-12)
        assert math.isclose(g["lr"] * g["weight_decay"], md.LR * md.WD, rel_tol=1e-12)
    assert groups[0]["weight_decay"] == md.WD and groups[1]["weight_decay"] == 0.0
    assert all(p.dim() < 2 for p in groups[1]["params"])
