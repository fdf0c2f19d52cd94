"""A fork in the test suite: tests/llama.py, a Llama-style model that declares its structure
(ARCH, LINEARS, blocks(), head()) and its module kinds' activation formulas, driven through the
engine unchanged -- train.py with model.py's GPT swapped for it, as a forker's edit would:
ZeRO stages 0-3 on 2 ranks against 1 process, LoRA on all its targets with an NF4 + double-
quantized base and checkpointing, a resharded resume, memory.py's estimate equal to what is
held and saved, MFU's path, and an architecture change refused on resume."""
import dataclasses
import functools
import json
import os
import shutil

import numpy as np
import pytest
import torch

import llama
import mlpfork
import tinyfork
from checkpoint import Reader, list_checkpoints
from machinery import checked_ckpt
from conftest import make_zero, run_distributed, run_train
from machinery.activations import activation_bytes
from machinery.footprint import estimate
from model import GPTConfig
from machinery.meter import saved_activation_bytes
from machinery.validate import targets_of
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
                L.apply_lora(model, lora, targets=targets_of(model.LINEARS))
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
        L.apply_lora(model, lora, targets=targets_of(model.LINEARS))
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
    args = TINY + ["--data-root", data_root, "--max-iters", "1", "--batch-size", "2"]
    run_train(args + ["--out-dir", str(tmp_path / "z2"), "--zero", "2"], 1, as_no_blocks)
    monkeypatch.setattr(train, "GPT", NoBlocks)
    with pytest.raises(ValueError, match="NoBlocks declares no blocks"):
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
    L.apply_lora(model, 4, targets=("q", "v", "mlp_down"))
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


# ----------------------------------------------------------------------------------------------
# a fork that is not a GPT (tests/tinyfork.py): every way in and out, or one line

TINYFORK = dict(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
FORK_ARGS = TINY[:4] + ["--n-head", "4"] + TINY[6:]  # 4 query heads over 2 K/V heads


def as_tinyfork(main, argv):
    """model.py edited to build tests/tinyfork.py's model: model.GPT is TinyFork."""
    import model
    import train
    model.GPT = train.GPT = tinyfork.TinyFork
    main(argv)


@pytest.mark.slow
def test_a_fork_that_is_not_a_gpt_trains_through_train_py_and_resumes(data_root, tmp_path,
                                                                      monkeypatch, capsys):
    """train.py on TinyFork (its own config, a tied head, no num_params, no FLOPs count): one
    process, ZeRO-1 and ZeRO-3 on 2 ranks alike; ZeRO-3 sharded for 2 steps resumed by ZeRO-2
    on 1 rank to the end, the same losses; its own config in the header (n_kv_head)."""
    import model
    import train
    args = FORK_ARGS + ["--data-root", data_root, "--max-iters", "4"]
    monkeypatch.setattr(model, "GPT", tinyfork.TinyFork)
    monkeypatch.setattr(train, "GPT", tinyfork.TinyFork)
    train.main(args + ["--batch-size", "4", "--peak-tflops", "1",
                       "--out-dir", str(tmp_path / "one")])
    out = capsys.readouterr().out
    args_ = Reader(list_checkpoints(tmp_path / "one")[-1]).header["model_args"]
    assert args_ == {"arch": "tinyfork", **TINYFORK, "vocab_size": 54}, args_  # the data's
    cfg = tinyfork.TinyConfig(**{**TINYFORK, "vocab_size": 54})
    n = sum(p.numel() for p in tinyfork.TinyFork(cfg).parameters())  # the tied tensor once
    assert f"model: {n:,} parameters" in out and "MFU not shown: TinyFork declares no" in out
    one = losses(tmp_path / "one")
    assert one[3] < one[0]
    for stage in (1, 3):
        out = tmp_path / f"z{stage}"
        run_train(args + ["--batch-size", "2", "--zero", str(stage), "--out-dir", str(out)], 2,
                  as_tinyfork)
        np.testing.assert_allclose([losses(out)[i] for i in range(4)],
                                   [one[i] for i in range(4)], rtol=1e-4)
    head = Reader(list_checkpoints(tmp_path / "z3")[-1]).header
    assert head["model_args"] == args_ and "lm_head.weight" not in head["shapes"]  # tied
    out = tmp_path / "resumed"
    run_train(args[:-1] + ["2", "--batch-size", "2", "--zero", "3", "--ckpt-format", "sharded",
                           "--out-dir", str(out)], 2, as_tinyfork)
    run_train(args + ["--batch-size", "4", "--zero", "2", "--resume", "--out-dir", str(out)], 1,
              as_tinyfork)
    np.testing.assert_allclose([losses(out)[i] for i in range(4)], [one[i] for i in range(4)],
                               rtol=1e-4)


def test_a_fork_that_is_not_a_gpt_samples_exports_and_is_estimated(data_root, tmp_path,
                                                                   monkeypatch, capsys):
    """sample.py (the default generate), export.py --to safetensors (the default stored shapes:
    the tied tensor once) and memory.py (its config's n_kv_head, its formulas on its classes)
    on TinyFork; memory.py's activations equal what it saves, with and without LoRA, at every
    checkpointing setting."""
    import export
    import memory
    import model
    import sample
    from beyond.activation_dial import setting
    from machinery import declared
    from model import GPT
    from safetensors.torch import load_file
    monkeypatch.setattr(model, "GPT", tinyfork.TinyFork)
    out = tmp_path / "fork"
    run_train(FORK_ARGS + ["--data-root", data_root, "--max-iters", "2", "--batch-size", "2",
                           "--out-dir", str(out)], 1, as_tinyfork)
    path = list_checkpoints(out)[-1]
    target = str(tmp_path / "w.safetensors")
    assert export.main([path, "--to", "safetensors", target]) == 0
    written, stored = load_file(target), Reader(path).weights()
    assert written.keys() == stored.keys() and "tok.weight" in written
    assert all(torch.equal(written[k], stored[k]) for k in written)
    capsys.readouterr()
    assert sample.main(["--ckpt", path, "--max-new-tokens", "5", "--num-samples", "2",
                        "--temperature", "0"]) == 0
    text = capsys.readouterr()
    assert "sampling from" in text.err and text.out.count("-" * 40) == 2
    monkeypatch.setattr(model, "GPT", GPT)  # model.py's own GPT-2 cannot sample it: one line
    assert sample.main(["--ckpt", path, "--max-new-tokens", "5"]) == 2
    assert "holds a 'tinyfork' model, model.py builds 'gpt2'" in capsys.readouterr().err
    monkeypatch.setattr(model, "GPT", tinyfork.TinyFork)
    # a header edited (and resealed) to a width its tensors do not have: one line before the
    # model is built at that width (GPT-2's is held by validate.check_shapes_fit; a fork's
    # fields have no bounds: built first, a header could ask for any size)
    edited = tmp_path / "edited"
    shutil.copytree(path, edited)
    header = json.load(open(edited / "checkpoint.json"))
    header.pop("header_crc")
    checked_ckpt.write_header(str(edited / "checkpoint.json"),
                             {**header, "model_args": {**header["model_args"], "n_embd": 2048}})
    monkeypatch.setattr(model, "GPT", Built)
    with pytest.raises(UserError, match=r"describe tok.weight as \[54, 2048\], its tensors "
                                        r"hold \[54, 32\]"):
        export.export(str(edited), "safetensors", str(tmp_path / "e.safetensors"))
    assert sample.main(["--ckpt", str(edited), "--max-new-tokens", "5"]) == 2
    assert "describe tok.weight as [54, 2048]" in capsys.readouterr().err
    assert Built.builds == [(2048, "meta")] * 2, Built.builds  # never allocated at 2048 wide
    monkeypatch.setattr(model, "GPT", tinyfork.TinyFork)
    cfg = tinyfork.TinyConfig(**TINYFORK)
    fork = tinyfork.TinyFork(cfg)  # MFU: unknown, unless it counts its FLOPs
    assert declared.estimate_mfu(fork, 1e3, 1e12) is None
    fork.flops_per_token = lambda: 6e3
    assert declared.estimate_mfu(fork, 1e3, 1e12) == pytest.approx(6e-6)
    est = memory.main(["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size",
                       "16", "--vocab", "40"])
    assert est["psi"] == sum(p.numel() for p in tinyfork.TinyFork(cfg).parameters())
    for lora in (0, 4):
        for grad_ckpt in (False, True, setting("selective"), setting("full/2")):
            torch.manual_seed(0)
            fork = tinyfork.TinyFork(cfg)
            if lora:
                import lora as L
                L.apply_lora(fork, lora, targets=targets_of(fork.LINEARS))
            fork.grad_ckpt = grad_ckpt
            x, y = torch.randint(0, 40, (3, 16)), torch.randint(0, 40, (3, 16))
            saved = [0]
            with saved_activation_bytes(fork, saved):
                fork(x, y)
            want = activation_bytes(cfg, 3, 16, "fp32", grad_ckpt, lora, "all", device="cpu",
                                    build=tinyfork.TinyFork)
            assert want["total"] == saved[0], (lora, grad_ckpt, want, saved[0])


class Built(tinyfork.TinyFork):
    """TinyFork that records each build's width and the device its weights went to."""
    builds = []

    def __init__(self, config):
        super().__init__(config)
        Built.builds.append((config.n_embd, self.tok.weight.device.type))


def _own_loop(rank, world_size, tmp):
    """docs/forking.md's recipe for a loop of one's own: checked_ckpt.save(out_dir, it, zero,
    model) and checked_ckpt.restore(path, zero, model) (machinery/checked_ckpt.py, checkpoint.py's
    save and restore with every file checked), nothing more. k + resume + k == 2k
    bitwise at ZeRO-2 (consolidated) and ZeRO-3 (sharded) on TinyFork with torch's AdamW class
    (restored with config {"optimizer": "adamw"}, as a user may name it); its own config in
    the header, another one refused in one line; memory.py's model state for it, stages 0-3,
    equals what ZeRO holds, the optimizer a class."""
    import dataclasses
    import checkpoint
    from machinery import checked_ckpt
    opt = functools.partial(torch.optim.AdamW, lr=1e-2, fused=False)
    cfg = tinyfork.TinyConfig(**TINYFORK)

    def run(stage, steps, path=None, save=None, config=cfg):
        torch.manual_seed(0)
        model = tinyfork.TinyFork(config)
        zero = make_zero(model, stage, optimizer=opt, rank=rank, world_size=world_size)
        if path:
            checked_ckpt.restore(path, zero, model, config={"optimizer": "adamw"})
        for step in steps:
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 40, (world_size * 2, 17), generator=g)[2 * rank:2 * rank + 2]
            model.zero_grad()
            model(idx[:, :-1], idx[:, 1:])[1].backward()
            zero.finish_backward()
            zero.step()
        if save:
            return checked_ckpt.save(f"{tmp}/s{stage}", steps[-1] + 1, zero, model, fmt=save)
        return checkpoint.state_dict(zero, model)

    for stage, fmt in ((2, "consolidated"), (3, "sharded")):
        straight = run(stage, range(4))
        path = run(stage, range(2), save=fmt)
        resumed = run(stage, range(2, 4), path=path)
        if rank == 0:
            assert all(torch.equal(straight[k], resumed[k]) for k in straight), stage
            assert Reader(path).header["model_args"] == {"arch": "tinyfork", **TINYFORK}
    with pytest.raises(UserError, match="another model .*n_kv_head 2 vs 4"):
        run(2, range(2, 4), path=path, config=dataclasses.replace(cfg, n_kv_head=4))
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        held = make_zero(tinyfork.TinyFork(cfg), stage, optimizer=opt, rank=rank,
                         world_size=world_size).state_bytes()
        est = estimate(cfg, world_size, stage, "fp32", rank=rank, build=tinyfork.TinyFork,
                       optimizer=opt)
        assert held == est["state"], (stage, rank, held, est["state"])


def test_a_forks_own_loop_saves_and_resumes_exactly(tmp_path):
    run_distributed(_own_loop, 2, str(tmp_path))


class NoFormula(tinyfork.TinyFork):
    """A fork that says nothing of what it saves for backward."""
    SAVED = None


class NoConfig(tinyfork.TinyFork):
    """A fork that keeps no self.config."""

    def __init__(self, config):
        super().__init__(config)
        del self.config


@dataclasses.dataclass
class NoVocabConfig:
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 32
    block_size: int = 16


class NoVocab(tinyfork.TinyFork):
    CONFIG = NoVocabConfig


class LogitsOnly(torch.nn.Module):
    """forward(idx) gives logits alone, and no generate()."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 5)

    def forward(self, idx, targets=None):
        return self.embed(idx)


def test_what_a_fork_does_not_declare_is_one_line(data_root, tmp_path, monkeypatch, capsys):
    """A fork's gaps, each one line naming what to declare, before any step: a model flag its
    config lacks, --compile without head(), --chunked-loss without self.cross_entropy, no
    self.config, no vocab_size; memory.py without the fork's formulas (its model state, the
    activations one line; --advise refused) and with GPT's formula wrongly found for it
    (model.GPT bound to the fork's class when activations.py imported it); sample.py's
    default generate on a forward that gives no (logits, loss). An optimizer class is counted
    by memory.py, not a KeyError; a name it does not know is one line."""
    import memory
    import model
    import train
    from machinery import activations, declared
    from machinery.footprint import state_bytes_per_param
    args = FORK_ARGS + ["--data-root", data_root, "--max-iters", "1", "--batch-size", "2"]
    cases = [(tinyfork.TinyFork, ["--bias"], "--bias: TinyConfig has no field bias"),
             (tinyfork.TinyFork, ["--dropout", "0.1"], "--dropout: TinyConfig has no field"),
             (tinyfork.TinyFork, ["--compile"], "TinyFork declares no head"),
             (tinyfork.TinyFork, ["--chunked-loss"], "TinyFork has no self.cross_entropy"),
             (NoConfig, [], "NoConfig keeps no self.config"),
             (NoVocab, [], "NoVocabConfig has no field vocab_size")]
    for i, (cls, flags, message) in enumerate(cases):
        monkeypatch.setattr(train, "GPT", cls)
        monkeypatch.setattr(model, "GPT", cls)
        with pytest.raises((UserError, ValueError), match=message):  # run_main's one line
            train.main(args + flags + ["--out-dir", str(tmp_path / str(i))])
        assert not os.path.exists(tmp_path / str(i) / "metrics.jsonl")
    shape = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "16"]
    monkeypatch.setattr(model, "GPT", NoFormula)
    memory.main(shape)  # the model state, and the activations unknown in one line
    out = capsys.readouterr().out
    assert "model state" in out and "Activations: unknown" in out
    assert "NoFormula declares none; set NoFormula.SAVED" in out
    with pytest.raises(UserError, match="--advise: .*NoFormula declares none"):
        memory.main(shape + ["--advise"])
    monkeypatch.setitem(activations.SAVED, NoFormula, activations.gpt)
    with pytest.raises(ValueError, match="formula for NoFormula failed .*declare NoFormula.SAVED"):
        memory.main(shape)
    with pytest.raises(UserError, match=r"LogitsOnly\(idx\) gives Tensor, not \(logits, loss\)"):
        declared.generate(LogitsOnly(), torch.zeros(1, 2, dtype=torch.long), 3)
    adamw, sgd = torch.optim.AdamW, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert [state_bytes_per_param(o) for o in (adamw, "AdamW", sgd, torch.optim.SGD)] == \
        [8, 8, 4, 0]
    with pytest.raises(ValueError, match="optimizer 'adam': memory.py knows adamw"):
        state_bytes_per_param("adam")


# ----------------------------------------------------------------------------------------------
# the documented way in: model.py edited, in a fresh interpreter

EDITED = """
import contextlib, io, json, sys
sys.path[:0] = [{tmp!r}, {tests!r}]
import model                             # the copy in tmp: model.py + the forker's last line
assert model.GPT.__name__ == "MLPFork"
import export, memory, sample, train     # each imports model.GPT at its own import
from checkpoint import list_checkpoints
from configurator import UserError
args = {args!r}
train.main(args + ["--out-dir", {tmp!r} + "/plain"])
train.main(args + ["--lora", "--lora-targets", "up,down", "--quantize", "nf4",
                   "--out-dir", {tmp!r} + "/qlora"])
assert sample.main(["--ckpt", list_checkpoints({tmp!r} + "/plain")[-1],
                    "--max-new-tokens", "3"]) == 0
assert export.main([list_checkpoints({tmp!r} + "/qlora")[-1], "--to", "safetensors",
                    {tmp!r} + "/w.safetensors"]) == 0
shape = ["--n-layer", "2", "--block-size", "16", "--vocab", "54"]
with contextlib.redirect_stdout(io.StringIO()) as printed:
    memory.main(shape + ["--lora", "--lora-targets", "down"])
    command = memory.main(shape + ["--advise", "--gpu-mem", "8GB"])
lines = {{"first": printed.getvalue().splitlines()[0], "command": command}}
for flags in (["--n-embd", "64"], ["--lora"]):  # a size its config lacks; LoRA's default q,v
    for main, rest in ((memory.main, shape), (train.main, args)):
        try:
            main(rest + flags + ["--out-dir", {tmp!r} + "/refused"])
        except (UserError, ValueError) as e:  # run_main's one line
            lines[flags[0] + " " + main.__module__] = str(e)
print(json.dumps(lines))
"""


@pytest.mark.slow
def test_a_fork_brought_in_as_the_docs_say_reaches_every_command(data_root, tmp_path):
    """docs/forking.md: "put your class there under that name ... by ending it with `from
    mymodel import MyModel as GPT`". The other tests assign model.GPT after the commands are
    imported; here model.py is edited, so that lora.py, memory.py and the rest read the fork
    when they are imported, as a forker's copy does. tests/mlpfork.py declares no n_embd or
    n_head (its d_model), LINEARS that are a block's own children, and no head(): train.py
    (plain, and QLoRA on both its linears), sample.py, export.py --to safetensors of the QLoRA
    checkpoint and memory.py (--advise's command names no flag its config lacks) work; a flag
    its config lacks and LoRA's default targets it has not are one line in memory.py and
    train.py alike. Failed before: `import train` raised AttributeError (lora.py read
    GPT.LINEARS at import); memory.py raised AttributeError on cfg.n_embd, took --n-embd 64
    without a word and printed --n-embd 128 --n-head 4 in --advise's command; LoRA on a
    LINEARS path without a dot raised 'not enough values to unpack'; the export of the QLoRA
    checkpoint said "its LoRA flags are not valid ('n_embd')"."""
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    with open(os.path.join(root, "model.py")) as f:
        source = f.read()
    (tmp_path / "model.py").write_text(source + "\nfrom mlpfork import MLPFork as GPT  # noqa\n")
    args = TINY[:2] + ["--n-layer", "2", "--block-size", "16"] + TINY[10:] + [
        "--data-root", data_root, "--max-iters", "2", "--batch-size", "2"]
    script = EDITED.format(tmp=str(tmp_path), tests=tests, args=args)
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["first"].startswith("MLPFork: ") and "(n_layer=2, d_model=32, vocab 54" in \
        got["first"], got
    assert got["command"].startswith("python train.py --n-layer 2 --block-size 16 "), got
    assert "--n-embd" not in got["command"] and "--n-head" not in got["command"], got
    for module in ("memory", "train"):
        assert "--n-embd: MLPConfig has no field n_embd" in got[f"--n-embd {module}"], got
        assert "unknown LoRA target(s) ['q', 'v']: use 'all' or a comma list of up, down" in \
            got[f"--lora {module}"], got


def test_a_forks_model_py_may_import_machinery_declared(tmp_path):
    """A forker's model.py that imports machinery.declared (its default generate, say) at its
    own import, with memory.py imported first: was 'cannot import name ... from partially
    initialized module machinery.declared' (declared imported model.py at its top)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "model.py")) as f:
        source = f.read()
    (tmp_path / "model.py").write_text(
        source + "\nfrom machinery.declared import generate as default_generate  # noqa\n")
    script = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {root!r}]; import memory, train"
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_linears_that_are_a_blocks_own_children_take_lora_quantization_and_fp8():
    """LINEARS paths without a dot ("up": the block's own child) are replaced by LoRA, the
    quantized base and FP8 alike (each split the path at its last dot: 'not enough values to
    unpack' before); a config with no n_embd bounds a LoRA rank by the narrowest linear."""
    import lora as L
    import quant
    from beyond.fp8 import FP8Linear, convert
    from machinery import declared
    x = torch.randint(0, 40, (2, 16))
    for change in ("lora", "quantize", "fp8"):
        torch.manual_seed(0)
        fork = mlpfork.MLPFork(mlpfork.MLPConfig(vocab_size=40))
        names = (L.apply_lora(fork, 4, targets=targets_of(fork.LINEARS)) if change == "lora" else
                 quant.quantize_base(fork, "nf4") if change == "quantize" else convert(fork))
        assert names == ["layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"]
        kind = {"lora": L.LoRALinear, "quantize": quant.QuantLinear, "fp8": FP8Linear}[change]
        assert all(isinstance(b.up, kind) and isinstance(b.down, kind) for b in fork.blocks())
        assert fork(x, x)[1].isfinite()
    assert declared.width(mlpfork.MLPFork(mlpfork.MLPConfig(d_model=24))) == 24  # up: 24x48
