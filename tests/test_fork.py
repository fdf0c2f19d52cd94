"""A fork in the test suite: tests/llama.py, a Llama-style model that declares its structure
(ARCH, LINEARS, blocks(), head()) and its module kinds' activation formulas, driven through the
engine unchanged -- train.py with model.py's GPT swapped for it, as a forker's edit would:
ZeRO stages 0-3 on 2 ranks against 1 process, LoRA on all its targets with an NF4 + double-
quantized base and checkpointing, a resharded resume, memory.py's estimate equal to what is
held and saved, MFU's path, and an architecture change refused on resume."""
import json
import os

import numpy as np
import pytest
import torch

import llama
from checkpoint import Reader, list_checkpoints
from conftest import make_zero, run_distributed, run_train
from machinery.activations import activation_bytes
from machinery.footprint import estimate
from model import GPTConfig
from machinery.meter import saved_activation_bytes
from configurator import UserError

CFG = dict(arch="llama", block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32,
           dropout=0.0, bias=False)
TINY = ["--device", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
        "16", "--eval-iters", "2", "--eval-interval", "1000", "--log-interval", "1",
        "--warmup-iters", "2", "--learning-rate", "3e-3", "--lr-decay-iters", "8",
        "--dataset", "tiny"]


def as_llama(main, argv):
    """What a fork's edit of model.py amounts to: model.GPT is the fork's model, and train.py
    (which imported it before the edit here) builds it."""
    import model
    import train
    model.GPT = train.GPT = llama.Llama
    main(argv)


def losses(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["iter"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_the_fork_trains_through_every_stage_lora_qlora_and_a_resharded_resume(data_root,
                                                                                tmp_path):
    args = TINY + ["--data-root", data_root, "--max-iters", "6"]
    run_train(args + ["--batch-size", "4", "--out-dir", str(tmp_path / "one")], 1, as_llama)
    one = losses(tmp_path / "one")
    assert one[5] < one[0]  # it learns
    for stage in (0, 1, 2, 3):
        out = tmp_path / f"z{stage}"
        run_train(args + ["--batch-size", "2", "--zero", str(stage), "--out-dir", str(out)], 2,
                  as_llama)
        np.testing.assert_allclose([losses(out)[i] for i in range(6)],
                                   [one[i] for i in range(6)], rtol=1e-4)
    head = Reader(list_checkpoints(tmp_path / "z3")[-1]).header
    assert head["model_args"]["arch"] == "llama" and "lm_head.weight" in head["shapes"]
    # resharded: ZeRO-3 on 2 ranks (sharded) for 3 steps, then ZeRO-1 on 1 rank to the end
    out = tmp_path / "resharded"
    run_train(args[:-1] + ["3", "--batch-size", "2", "--zero", "3", "--ckpt-format", "sharded",
                           "--out-dir", str(out)], 2, as_llama)
    run_train(args + ["--batch-size", "4", "--zero", "1", "--resume", "--out-dir", str(out)], 1,
              as_llama)
    np.testing.assert_allclose([losses(out)[i] for i in range(6)], [one[i] for i in range(6)],
                               rtol=1e-4)
    # QLoRA on every one of its targets, with checkpointing, sharded by ZeRO-3, and MFU's path
    out = tmp_path / "qlora"
    run_train(args + ["--batch-size", "2", "--zero", "3", "--lora", "--lora-targets", "all",
                      "--quantize", "nf4", "--double-quant", "--grad-ckpt", "--peak-tflops", "1",
                      "--out-dir", str(out)], 2, as_llama)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert any(r.get("mfu") for r in rows)  # num_params took no position embedding it lacks
    # the export writes GPT-2's layout: a Llama checkpoint is one line, not a missing tensor
    import export
    with pytest.raises(UserError, match="GPT-2's architecture only"):
        export.export(list_checkpoints(tmp_path / "one")[-1], "hf", str(tmp_path / "hf"))
    # the GPT-2 of model.py cannot continue a Llama run: the architecture differs
    import train
    with pytest.raises(UserError, match="arch llama vs gpt2"):
        train.main(args + ["--batch-size", "4", "--resume", "--out-dir", str(tmp_path / "one")])


def _state(rank, world_size):
    cfg = GPTConfig(**CFG)
    for lora, quantize in ((0, None), (4, None), (4, "nf4")):
        for stage in (0, 1, 2, 3):
            torch.manual_seed(0)
            model = llama.Llama(cfg)
            if lora:
                import lora as L
                import quant
                L.apply_lora(model, lora, targets="all")
                if quantize:
                    quant.quantize_base(model, quantize)
            held = make_zero(model, stage, rank=rank, world_size=world_size).state_bytes()
            est = estimate(cfg, world_size, stage, "fp32", lora_rank=lora, lora_targets="all",
                           quantize=quantize, rank=rank, build=llama.Llama)
            assert held == est["state"], (lora, quantize, stage, rank)


def test_memory_py_counts_what_the_fork_holds():
    run_distributed(_state, 2)


@pytest.mark.parametrize("lora", [0, 4])
@pytest.mark.parametrize("grad_ckpt", [False, True, "selective", "full/2"])
def test_memory_py_counts_what_the_fork_saves(lora, grad_ckpt):
    """Checkpointing off, every block, selective (its KEPT entries), every 2nd block: the fork's
    forward runs each as model.py's does, and its formulas count what it saves."""
    from beyond.activation_dial import setting
    grad_ckpt = setting(grad_ckpt) if isinstance(grad_ckpt, str) else grad_ckpt
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    model = llama.Llama(cfg)
    if lora:
        import lora as L
        L.apply_lora(model, lora, targets="all")
    model.grad_ckpt = grad_ckpt
    x, y = torch.randint(0, 40, (3, 16)), torch.randint(0, 40, (3, 16))
    out = [0]
    with saved_activation_bytes(model, out):
        model(x, y)
    est = activation_bytes(cfg, 3, 16, "fp32", grad_ckpt, lora, "all", device="cpu",
                           build=llama.Llama)
    assert est["total"] == out[0], (est, out[0])
    if not isinstance(grad_ckpt, bool):  # a dial setting (selective, every K-th block) keeps
        full = activation_bytes(cfg, 3, 16, "fp32", True, lora, "all", device="cpu",  # more
                                build=llama.Llama)["total"]  # than full checkpointing: it
        assert out[0] > full  # ran as itself


# ----------------------------------------------------------------------------------------------
# a fork's ways out, its one-line refusals, fp16

def fork_checkpoint(data_root, tmp_path, extra=()):
    out = tmp_path / "fork"
    run_train(TINY + ["--data-root", data_root, "--max-iters", "2", "--batch-size", "2",
                      "--out-dir", str(out), *extra], 1, as_llama)
    return out


def test_a_forks_ways_out_export_sample_and_memory(data_root, tmp_path, monkeypatch, capsys):
    """export.py --to safetensors, sample.py and memory.py on the fork's own model (model.py
    edited: model.GPT is the fork's), not GPT-2's."""
    import export
    import memory
    import model
    import sample
    monkeypatch.setattr(model, "GPT", llama.Llama)
    path = list_checkpoints(fork_checkpoint(data_root, tmp_path))[-1]
    target = str(tmp_path / "w.safetensors")
    assert export.main([path, "--to", "safetensors", target]) == 0 and os.path.exists(target)
    capsys.readouterr()
    assert sample.main(["--ckpt", path, "--max-new-tokens", "5", "--num-samples", "1"]) == 0
    assert "sampling from" in capsys.readouterr().err
    est = memory.main(["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size",
                       "16", "--vocab", "40"])
    assert est["psi"] == sum(p.numel() for p in llama.Llama(GPTConfig(**CFG)).parameters())


class NoBlocks(llama.Llama):
    """A fork that declares no blocks()."""
    blocks = None


def as_no_blocks(main, argv):
    import model
    import train
    model.GPT = train.GPT = NoBlocks
    main(argv)


def test_a_missing_declaration_is_one_line(data_root, tmp_path, monkeypatch):
    """A fork that declares no blocks() runs ZeRO 0-2; ZeRO-3 says what to declare."""
    import train
    from configurator import UserError
    args = TINY + ["--data-root", data_root, "--max-iters", "1", "--batch-size", "2"]
    run_train(args + ["--out-dir", str(tmp_path / "z2"), "--zero", "2"], 1, as_no_blocks)
    monkeypatch.setattr(train, "GPT", NoBlocks)
    with pytest.raises(UserError, match="NoBlocks declares no blocks"):
        train.main(args + ["--out-dir", str(tmp_path / "z3"), "--zero", "3"])


def test_the_fork_trains_in_fp16(data_root, tmp_path):
    """RMSNorm's statistics in fp32: fp16 steps are not all skipped, the loss falls."""
    out = tmp_path / "fp16"
    run_train(TINY + ["--data-root", data_root, "--max-iters", "6", "--batch-size", "4",
                      "--fp16", "--out-dir", str(out)], 1, as_llama)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert sum(r["skipped"] for r in steps) <= 2 and steps[-1]["loss"] < steps[0]["loss"]


def test_the_forks_adapter_is_a_peft_folder_that_loads_back(tmp_path):
    """The fork's LoRA modules (its own names, a fused q|k|v and a split MLP) convert to PEFT's
    folder and back by the layout the model declares: the same outputs, nn.Linear's layout."""
    import json
    import lora as L
    from machinery import adapters
    cfg = GPTConfig(**CFG)
    x = torch.randint(0, 40, (2, 16))
    torch.manual_seed(0)
    model = llama.Llama(cfg)
    L.apply_lora(model, 4, targets="q,v,mlp_down")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.1)
    adapters.save_adapter(tmp_path / "a", model, adapters.base_fingerprint(model))
    config = json.load(open(tmp_path / "a" / "adapter_config.json"))
    assert config["fan_in_fan_out"] is False and config["rank_pattern"] == {
        "self_attn.qkv_proj": 8}, config
    torch.manual_seed(0)
    fresh = llama.Llama(cfg)
    adapters.load_adapter(fresh, str(tmp_path / "a"))
    assert torch.equal(fresh.eval()(x, x)[0], model.eval()(x, x)[0])
