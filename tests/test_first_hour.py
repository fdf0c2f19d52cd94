"""A newcomer's first hour, from a fresh clone and the README: `python train.py --max-iters 50`
then `python sample.py` with no other flag; --help that shows defaults, choices and sections;
a short run that decays its learning rate over its own length; a console that prints the
lecture's numbers (the model-state table, the traffic beside the paper's, iter i/N and an ETA,
a running evaluation); memory.py --advise ending in a command train.py runs as estimated.
Checked for their content, not as golden text."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_train
from configurator import parse_args
from memory import main as memory_main


@pytest.mark.slow
def test_a_short_run_then_sample_with_no_other_flag(tmp_path):
    run = lambda *argv: subprocess.run([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:]],
                                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # as README
    r = run("train.py", "--max-iters", "50")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "iter 49/50" in r.stdout and "ETA" in r.stdout and "evaluating" in r.stdout
    assert "model state per rank" in r.stdout and "ZeRO paper" in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines() if line.startswith("  "))
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    lrs = [row["lr"] for row in rows if "lr" in row]
    assert lrs[-1] < 2e-4  # decayed over the run's own 50 steps, not 2000: min_lr is 1e-4
    s = run("sample.py", "--max-new-tokens", "20", "--num-samples", "1")
    assert s.returncode == 0, s.stderr
    assert "ckpt-0000050" in s.stderr and "iteration 50" in s.stderr
    assert len(s.stdout.strip()) > 20


def test_help_shows_defaults_choices_and_sections():
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    out = " ".join(r.stdout.split())  # argparse wraps lines
    assert "(default: 2000)" in out and "(default: adamw)" in out  # --max-iters, --optimizer
    assert "{fp32|bf16|fp16}" in out and "{0|1|2|3}" in out
    for section in ("I/O:", "model:", "batch:", "the optimizer and its schedule:"):
        assert section in r.stdout


def test_max_iters_alone_sets_the_decay_and_presets_keep_theirs():
    from machinery.run import fit_schedule
    cfg = fit_schedule(parse_args(["--max-iters", "50"]))
    assert cfg.lr_decay_iters == 50 and cfg.warmup_iters <= 5
    cfg = fit_schedule(parse_args(["--max-iters", "50", "--lr-decay-iters", "400",
                                   "--warmup-iters", "30"]))
    assert (cfg.lr_decay_iters, cfg.warmup_iters) == (400, 30)
    cfg = fit_schedule(parse_args(["--config", "config/gpt2_124m.py", "--max-iters", "100"]))
    assert cfg.lr_decay_iters == 600000  # the preset sets its own schedule


def console_to_file(main, argv):
    """Each rank's console into OUT_DIR/console-RANK.txt (forked ranks write to the fork
    server's own stdout, which pytest's capture does not see)."""
    import contextlib
    path = os.path.join(argv[argv.index("--out-dir") + 1], f"console-{os.environ['RANK']}.txt")
    with open(path, "w") as f, contextlib.redirect_stdout(f):
        main(argv)


def test_two_ranks_print_the_traffic_beside_the_paper(data_root, tmp_path):
    run_train(["--device", "cpu", "--data-root", data_root, "--dataset", "tiny", "--n-layer", "1",
               "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "2",
               "--max-iters", "2", "--eval-iters", "1", "--log-interval", "1", "--zero", "2",
               "--out-dir", str(tmp_path)], 2, console_to_file)
    out = "".join(open(tmp_path / f"console-{r}.txt").read() for r in range(2))
    assert out.count("traffic per step and rank") == 1  # once, by rank 0
    assert "Ψ measured" in out and "in the ZeRO paper" in out


def test_advise_prints_a_command_that_runs_what_it_estimated(capsys):
    cmd = memory_main(["--params", "7e9", "--world-size", "8", "--gpu-mem", "80GB", "--advise",
                       "--host-mem", "64GB"])
    out = capsys.readouterr().out
    assert "--n-layer 32 --n-embd 4096 --n-head 32" in cmd  # a 7B's shape, not 33 x 4224
    assert "--dataset shakespeare" in cmd  # GPT-2 BPE, the vocabulary estimated
    assert "--ckpt-format sharded" in cmd  # 12 bytes x 7e9 > half of a 64 GB host
    assert "nearest standard" in out
    flags = cmd.split("train.py", 1)[1].split()
    cfg = parse_args(flags)  # train.py takes every flag of it
    assert (cfg.n_layer, cfg.n_embd, cfg.dataset, cfg.ckpt_format) == (32, 4096, "shakespeare",
                                                                       "sharded")
