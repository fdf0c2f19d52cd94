"""memory.py --measure: train.py's build() and train_step() on fake tensors and the fake process
group, as rank r of N (machinery/measure.py). What the engine holds is the ZeRO paper's formula
at the padded size, to the byte, at 8, 64 and 1,024 ranks; what it sends is traffic_formula's;
2 real gloo ranks measure what fake N = 2 does; the scale-only paths (Muon's dealing at N = 8,
a bucket plan at 70B's widths, offload's host bytes at 405B's) as memory.py counts them. Each
measurement destroys its fake process group: the tests run in pytest's own process."""
import re

import pytest
import torch
import torch.distributed as dist

import train
from configurator import UserError, parse_args
from conftest import run_distributed
from machinery import measure
from machinery.footprint import for_run
from memory import main
from zero import traffic_formula, zero_formula

# GPT-2's shape (its vocabulary, bias, a tied head; one block), 36 wide: odd bucket sizes, so
# every N pads; buckets of ~2,000 elements: several in the block
GPT2_SHAPED = ["--n-layer", "1", "--n-embd", "36", "--n-head", "4", "--block-size", "32",
               "--bias", "--dataset", "shakespeare", "--batch-size", "2", "--bucket-mb", "0.004"]
VOCAB = 50257


def flags(*more):
    return parse_args(GPT2_SHAPED + ["--bf16", "--no-fp32-grad-accum", *more])


@pytest.mark.parametrize("world_size", [8, 64, 1024])
def test_state_is_the_papers_at_the_padded_size_and_traffic_its_formula(world_size):
    """The last rank (its slices hold the padding) of each stage: weights, gradients and the
    optimizer side are zero_formula's of the padded elements P, less AdamW's 8 bytes for each
    padding element of its own; the step sends traffic_formula(P) (stage 3: less the root
    unit's skipped gathers), over 2 micro-steps."""
    rank, accum = world_size - 1, 2
    for stage in range(4):
        m = measure.measure_rank(flags("--zero", str(stage), "--grad-accum", str(accum)), VOCAB,
                                 world_size, rank)
        z = m.zero
        P, own = measure.padding(z)
        assert 0 <= P - z.psi < world_size * len(z.buckets)
        assert (P > z.psi) == (stage > 0), (stage, P - z.psi)  # stage 0 pads nothing
        paper = zero_formula(P, stage, world_size, torch.bfloat16)
        assert m.state["params"] == paper["params"], stage
        assert m.state["grads"] == paper["grads"], stage
        assert m.state["master"] + m.state["optimizer"] == paper["optimizer_side"] - 8 * own
        assert measure.at_padded_size(z, P, own)["total"] == m.state["total"]
        expected = traffic_formula(P, stage, world_size, accum)
        if stage == 3:  # the root unit: gathered once a step, never re-gathered in backward
            expected -= (2 * accum - 1) * z.root.buckets[0].numel
        assert m.traffic.elements == expected, stage
    assert not dist.is_initialized()  # nothing of the fake group left for the next test


def real_step(rank, world_size, fake):
    """2 gloo ranks, real tensors: train.build and train_step measured as measure_rank does."""
    for stage, (state, traffic, by, peak) in fake[rank].items():
        tc = flags("--zero", str(stage), "--grad-accum", "2")
        tracker = measure.step_tracker()
        with tracker:
            model, zero, scaler = train.build(tc, VOCAB, torch.device("cpu"), torch.bfloat16,
                                              rank, world_size, 2)
        measure.count_afresh(zero, tc.node_size or world_size)

        def batch():
            x = torch.randint(0, VOCAB, (tc.batch_size, tc.block_size))
            return x, x

        with tracker:
            train.train_step(model, zero, scaler, tc, batch, 2, tc.learning_rate)
        assert zero.state_bytes() == state, stage
        assert (zero.traffic.elements, zero.traffic.by) == (traffic, by), stage
        assert tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] == peak, stage


@pytest.mark.slow
def test_fake_and_real_ranks_measure_alike():
    """Fake N = 2 and two real gloo ranks, every stage: the same model state, the same traffic
    by collective, the same peak, to the byte."""
    fake = {r: {} for r in range(2)}
    for rank in range(2):
        for stage in range(4):
            m = measure.measure_rank(flags("--zero", str(stage), "--grad-accum", "2"), VOCAB, 2,
                                     rank)
            fake[rank][stage] = (m.state, m.traffic.elements, m.traffic.by, m.peak)
    run_distributed(real_step, 2, fake)


GPT2_124M = ["--config", "config/gpt2_124m.py", "--batch-tokens", "0", "--batch-size", "1",
             "--bf16"]


def test_muon_deals_whole_matrices_at_eight_ranks():
    """WholeZeRO3 on GPT-2 124M's shapes at N = 8, the real engine built and stepped as the
    rank that memory.py says owns the most optimizer state: each unit as beyond.muon.zero3_cost
    lays it out (a block padded 166.3%, its docstring's table), every parameter in one rank's
    slice, this rank the one holding the most (ranks_that_differ), its state memory.py's."""
    from beyond.muon import zero3_cost
    tc = parse_args(GPT2_124M + ["--zero", "3", "--optimizer", "muon"])
    with torch.device("meta"):
        shapes = train.GPT(train.model_config(tc, VOCAB))
    layout, _, state = zero3_cost(shapes, 8)
    owner = state.index(max(state))
    m = measure.measure_rank(tc, VOCAB, 8, owner)
    z = m.zero
    units = [(sum(p.numel() for p in u.buckets[0].params), u.buckets[0].numel)
             for u in [z.root] + z.units]
    assert units == layout
    block, block_padded = units[1]
    assert f"{block_padded / block - 1:.1%}" == "166.3%"
    real = measure.real_per_rank(z)
    assert sum(real) == z.psi and real[owner] == max(real) > min(real)
    assert owner in measure.ranks_that_differ(z)
    assert m.state == for_run(tc, train.model_config(tc, VOCAB), 8, owner)["state"]


def test_a_bucket_plan_at_70b_widths():
    """Two blocks 8,192 wide, at 1,024 ranks: each matrix a bucket of its own (4h x h = 268M
    elements, over --bucket-mb's 13M), as footprint.bucket_sizes plans them. memory.py's peak
    bounds the measured one at stages 2 and 3, where the gradients of the bucket being packed
    sit beside the two reductions in flight (without them it fell under the measurement)."""
    from machinery.footprint import bucket_sizes, param_numels
    for stage in (2, 3):
        tc = parse_args(["--n-layer", "2", "--n-embd", "8192", "--n-head", "64", "--block-size",
                         "2048", "--batch-size", "1", "--bf16", "--zero", str(stage)])
        cfg = train.model_config(tc, VOCAB)
        m = measure.measure_rank(tc, VOCAB, 1024, 1023)
        real = [sum(p.numel() for p in b.params) for b in m.zero.buckets]
        planned = bucket_sizes(param_numels(cfg), stage, "bf16", tc.bucket_mb)
        assert (real if stage == 2 else sorted(real)) == \
            (planned if stage == 2 else sorted(planned))
        assert 4 * 8192 * 8192 in real or stage == 3  # c_fc's weight, a bucket alone
        est = for_run(tc, cfg, 1024, 1023, device="cpu")
        assert est["state"] == m.state
        assert m.peak <= est["peak"] <= 1.25 * m.peak, (stage, m.peak, est["peak"])


def test_offload_host_bytes_at_405b_widths():
    """--offload-optimizer at Llama 3 405B's width (16,384; two blocks) on 1,024 ranks: the
    host holds the fp32 master, AdamW's moments, an fp32 gradient slice and a bf16 staging
    slice of the padded slice it owns, as footprint.offload_host_bytes counts them; PCIe
    carries that slice down and up, as pcie_formula says."""
    tc = parse_args(["--n-layer", "2", "--n-embd", "16384", "--n-head", "128", "--block-size",
                     "2048", "--batch-size", "1", "--bf16", "--zero", "3",
                     "--offload-optimizer"])
    m = measure.measure_rank(tc, VOCAB, 1024, 1023)
    P, own = measure.padding(m.zero)
    owned = P // 1024
    assert m.host == {"master": 4 * owned, "optimizer": 8 * (owned - own), "grads": 4 * owned,
                      "staging": 2 * owned, "total": 18 * owned - 8 * own}
    assert m.host == for_run(tc, train.model_config(tc, VOCAB), 1024, 1023)["host"]
    assert (m.copies.d2h, m.copies.h2d) == (2 * owned, 2 * owned)
    assert m.state["master"] == m.state["optimizer"] == 0  # on the host


@pytest.mark.parametrize("head", [[], ["--no-chunked-loss"]])
def test_memory_pys_peak_is_the_measured_one(head):
    """GPT-2 124M's head, ZeRO-2 on 8 ranks: memory.py's peak (the CPU run's) is the measured one, but
    for a few scalars. Its loss head was 64 MB low with the chunked loss (two fp32 chunks, not
    three: the last chunk's softmax is alive while the next one's is made) and 0.8 GB high with
    model.py's plain head (an fp32 copy of the logits that backward no longer holds)."""
    tc = parse_args(GPT2_124M + ["--zero", "2", "--n-layer", "2", *head])  # its head, 2 blocks
    m = measure.measure_rank(tc, VOCAB, 8, 7)
    est = for_run(tc, train.model_config(tc, VOCAB), 8, 7, device="cpu")
    assert abs(m.peak - est["peak"]) < 2**20, (m.peak, est["peak"])


def test_cli_measures_and_names_the_ranks_that_differ(capsys):
    """memory.py --measure prints, for rank 0 and the last slice, the measured model state
    beside memory.py's and the paper's, the traffic, the padding, and what it skipped."""
    main(GPT2_SHAPED + ["--bf16", "--zero", "2", "--world-size", "64", "--measure"])
    out = capsys.readouterr().out
    assert "rank 0 of 64 (the most parameters)" in out
    assert "rank 63 of 64 (the fewest parameters: the last slice)" in out
    assert "the paper at Ψ + " in out and not re.search(r"own padding [+-]", out)
    assert ("note: the same-weights check (machinery.guard.check_same_weights) reads values"
            in out)
    rows = [line.split() for line in out.splitlines() if line.startswith("  model state")]
    assert len(rows) == 2 and all(r[2:4] == r[4:6] for r in rows), rows  # measured = memory.py


def test_advise_measures_its_own_command(capsys):
    """--advise --measure: the command --advise prints, measured (its world size and stage)."""
    cmd = main(["--n-layer", "2", "--n-embd", "2048", "--n-head", "16", "--block-size", "2048",
                "--dataset", "shakespeare", "--world-size", "8", "--gpu-mem", "8GB", "--advise",
                "--measure", "--rank", "7"])
    out = capsys.readouterr().out
    assert cmd.startswith("torchrun --nproc_per_node=8 ") and "--zero " in cmd
    assert out.index(cmd) < out.index("the command above, measured:")
    stage, batch = cmd.split("--zero ")[1].split()[0], cmd.split("--batch-size ")[1].split()[0]
    assert "rank 7 of 8 (" in out and f"ZeRO-{stage}, bf16" in out
    assert f"1 micro-step(s) of {batch} x 2048 tokens" in out


@pytest.mark.parametrize("argv, line", [
    (GPT2_SHAPED + ["--world-size", "12"], "--world-size 12 is not a whole number of 8-GPU"),
    (GPT2_SHAPED + ["--world-size", "16", "--rank", "16"], "--rank 16: ranks run from 0 to 15"),
    (GPT2_SHAPED + ["--world-size", "16", "--rank", "1,x"], "--rank 1,x: give ranks as numbers"),
    (["--params", "70e9", "--world-size", "8", "--zero", "3"], "even ZeRO-3 over 8 GPU"),
    (GPT2_SHAPED + ["--world-size", "16", "--grad-accum", "12000"],
     "--measure would run 24,000 blocks"),
    (GPT2_SHAPED + ["--world-size", "131072"], "--world-size 131,072: --measure keeps"),
    (GPT2_SHAPED + ["--world-size", "8", "--bucket-mb", "0.00001"], "buckets, over the 200,000"),
    (GPT2_SHAPED + ["--optimizer", "adafactor"], "Adafactor is no train.py --optimizer"),
    (GPT2_SHAPED + ["--compile"], "--measure runs the eager step on fake tensors"),
])
def test_bad_input_is_one_line_before_any_work(argv, line):
    with pytest.raises(UserError, match=re.escape(line)):
        main(argv + ["--measure"])
    assert not dist.is_initialized()


FORK_WITHOUT_FORMULA = """
import sys
from tests import tinyfork
for kind in (tinyfork.TinyFork, tinyfork.Attention, tinyfork.MLP):
    del kind.SAVED  # a fork that declares no activation formula
import model
model.GPT = tinyfork.TinyFork  # as docs/forking.md brings a fork in: before memory.py's imports
import runpy
sys.argv = ["memory.py", "--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size",
            "16", "--vocab", "40", "--world-size", "4", "--zero", "2"] + sys.argv[1:]
runpy.run_path("memory.py", run_name="__main__")  # the command, its errors one line
"""


def test_a_fork_without_an_activation_formula_is_measured(tmp_path):
    """memory.py counts activations by formulas, and a fork with none (an MoE's routed experts
    have no closed form) is one line there; --measure needs none: the step's own saved tensors
    and transients, measured (#50)."""
    import subprocess
    import sys
    from conftest import ROOT
    script = tmp_path / "fork.py"
    script.write_text(FORK_WITHOUT_FORMULA)
    run = lambda *argv: subprocess.run([sys.executable, str(script), *argv], cwd=ROOT,
                                       capture_output=True, text=True, timeout=300,
                                       env={**__import__("os").environ, "PYTHONPATH": ROOT})
    out = run("--measure")
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"the peak \(MemTracker\): the model state and [\d.]+ [KM]B of activations",
                     out.stdout), out.stdout
    assert re.search(r"adamw state +[\d.]+ [KM]B +- +[\d.]+ [KM]B", out.stdout), out.stdout
    refused = run()
    assert refused.returncode == 2 and "declare TinyFork.SAVED" in refused.stderr, refused.stderr
