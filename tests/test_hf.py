"""hf.py against the references: transformers reads what we write and writes what we read, and
peft runs our LoRA adapters with our logits (to 1e-5 in fp32).

Offline: the models are tiny and random, built here from a config; huggingface_hub is never
called (the hub-name tests make its import fail, or replace it by a fake). transformers and peft
are test-only references (requirements-test.txt).
"""
import os
import sys
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from machinery import hf
import lora
from machinery import adapters
import quant
from model import GPT, GPTConfig
from configurator import UserError

try:  # the references; the bad-input tests below run without them
    import peft
    import transformers
except ImportError:
    peft = transformers = None
needs_refs = pytest.mark.skipif(transformers is None or peft is None,
                                reason="reference check: pip install -r requirements-test.txt")

ARGS = dict(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
IDX = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(0))
# peft calls transformers' renamed gradient-checkpointing query; not ours to fix
PEFT_DEPRECATION = "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"


def ours(model, idx=IDX):
    return model.eval()(idx, targets=idx)[0]  # with targets: the logits at every position


def theirs(model, idx=IDX):
    with torch.no_grad():
        return model.eval()(idx).logits


def random_gpt(seed=0, **kw):
    """Our GPT with every parameter random: zero biases and unit LayerNorms would hide a swap."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**ARGS, **kw}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_model():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=50,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None)
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_variant(model, folder, variant):
    if variant == "safetensors":
        model.save_pretrained(folder)
    elif variant == "sharded":
        model.save_pretrained(folder, max_shard_size="40KB")
        assert len([f for f in os.listdir(folder) if f.startswith("model-0")]) > 1
    elif variant == "bin":  # transformers 4's safe_serialization=False: the tied head saved too
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), os.path.join(folder, "pytorch_model.bin"))
    else:  # the hub's own gpt2 .bin: saved from GPT2Model (no prefix, no head), mask buffers kept
        model.config.save_pretrained(folder)
        sd = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()}
        del sd["lm_head.weight"]
        for i in range(2):
            sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32, dtype=torch.bool))
            sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        torch.save(sd, os.path.join(folder, "pytorch_model.bin"))


@needs_refs
@pytest.mark.parametrize("variant", ["safetensors", "sharded", "bin", "hub-bin"])
def test_load_transformers_files(hf_model, tmp_path, variant):
    save_variant(hf_model, tmp_path, variant)
    model_args, sd = hf.load_pretrained(str(tmp_path))
    assert model_args == ARGS
    model = GPT(GPTConfig(**model_args))
    model.load_weights(sd)  # the real vocabulary into the padded rows
    torch.testing.assert_close(ours(model), theirs(hf_model), atol=1e-5, rtol=0)


@needs_refs
def test_load_into_from_file_path(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    weights = str(tmp_path / "model.safetensors")  # a weights file, config.json beside it
    model = GPT(GPTConfig(**hf.read_config(weights)))
    hf.load_into(model, weights)
    torch.testing.assert_close(ours(model), theirs(hf_model), atol=1e-5, rtol=0)
    half = GPT(GPTConfig(**ARGS)).to(torch.bfloat16)  # copied in the model's dtype
    hf.load_into(half, weights)
    assert half.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16


@needs_refs
@pytest.mark.parametrize("bias", [True, False])
def test_save_hf_loads_in_transformers(tmp_path, bias):
    model = random_gpt(bias=bias)
    hf.save_hf(model.state_dict(), {**ARGS, "bias": bias}, tmp_path)
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    torch.testing.assert_close(theirs(loaded), ours(model), atol=1e-5, rtol=0)
    if bias:  # and our own reader reads it back exactly
        model_args, sd = hf.load_pretrained(str(tmp_path))
        assert model_args == ARGS
        V = ARGS["vocab_size"]  # the file holds the real vocabulary, not model.py's padding
        for k, v in model.state_dict().items():
            assert torch.equal(sd[k], v[:V] if k.endswith(("wte.weight", "lm_head.weight")) else v)


@needs_refs
def test_save_hf_bf16(tmp_path):
    model = random_gpt()
    hf.save_hf(model.state_dict(), ARGS, tmp_path, dtype=torch.bfloat16)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("transformer.h.0.attn.c_attn.weight").dtype == torch.bfloat16
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():  # ours rounded to bf16 the same way
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    torch.testing.assert_close(theirs(loaded), ours(model), atol=1e-5, rtol=0)


@needs_refs
@pytest.mark.filterwarnings(PEFT_DEPRECATION)
@pytest.mark.parametrize("targets", [("q", "v"), ("k",),
                                     ("q", "k", "v", "attn_out", "mlp_fc", "mlp_proj")])
def test_peft_adapter(tmp_path, targets):
    model = random_gpt()
    lora.apply_lora(model, rank=2, alpha=3.0, targets=targets)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.1)
    sd = model.state_dict()
    hf.save_hf({k: v for k, v in sd.items() if "lora_" not in k}, ARGS, tmp_path / "base")
    adapters.save_adapter(tmp_path / "adapter", model, adapters.base_fingerprint(sd))
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        no_adapter = theirs(base)
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    expected = ours(model)
    assert (expected - no_adapter).abs().max() > 1e-3  # the adapter changes the logits
    torch.testing.assert_close(theirs(peft_model), expected, atol=1e-5, rtol=0)
    lora.merge_lora(model)  # and merged, as sample.py would run it
    torch.testing.assert_close(ours(model), expected, atol=1e-5, rtol=0)
    again = random_gpt()  # and the same folder read back by us: the same adapter
    adapters.load_adapter(again, str(tmp_path / "adapter"))
    torch.testing.assert_close(ours(again), expected, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# Bad input: one line, nothing written

def one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_folder_without_config(tmp_path):
    hf.save_hf(random_gpt().state_dict(), ARGS, tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(UserError) as e:
        hf.load_pretrained(str(tmp_path))
    one_line(e, "config.json")
    with pytest.raises(UserError) as e:
        hf.load_pretrained(str(tmp_path / "empty"))
    one_line(e, "no such file")


@pytest.mark.parametrize("change, word", [
    (dict(model_type="llama"), "llama"), (dict(activation_function="relu"), "relu"),
    (dict(n_inner=100), "n_inner"), (dict(scale_attn_by_inverse_layer_idx=True), "inverse"),
    (dict(reorder_and_upcast_attn=True), "reorder"), (dict(n_head=5), "n_head")])
def test_not_gpt2_config(tmp_path, change, word):
    cfg = {**hf.model_args_to_gpt2_config(ARGS).to_dict(), **change}
    with pytest.raises(UserError) as e:
        hf.gpt2_config_to_model_args(cfg)
    one_line(e, word)


def test_config_round_trip():
    assert hf.gpt2_config_to_model_args(hf.model_args_to_gpt2_config(ARGS).to_dict()) == ARGS


def rewrite_weights(folder, name, tensor):
    path = folder / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    if tensor is None:
        del sd[name]
    else:
        sd[name] = tensor
    save_file(sd, path)


@pytest.mark.parametrize("tensor, words", [(None, ["h.1.mlp.c_fc.bias", "missing"]),
                                           (torch.zeros(32, 97), ["h.1.mlp.c_fc.weight", "shape"])])
def test_bad_tensors(tmp_path, tensor, words):
    hf.save_hf(random_gpt().state_dict(), ARGS, tmp_path)
    name = "transformer.h.1.mlp.c_fc." + ("bias" if tensor is None else "weight")
    rewrite_weights(tmp_path, name, tensor)
    with pytest.raises(UserError) as e:
        hf.load_pretrained(str(tmp_path))
    one_line(e, *words)
    with pytest.raises(UserError) as e:
        hf.load_into(GPT(GPTConfig(**ARGS)), str(tmp_path))  # checked before any copy
    one_line(e, *words)


def test_load_into_quantized_model(tmp_path):
    hf.save_hf(random_gpt().state_dict(), ARGS, tmp_path)
    model = GPT(GPTConfig(**ARGS))
    quant.quantize_base(model, "int8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError) as e:
        hf.load_into(model, str(tmp_path))
    one_line(e, "quantize_base")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unreadable_weights(tmp_path):
    hf.save_hf(random_gpt().state_dict(), ARGS, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError) as e:
        hf.load_pretrained(str(tmp_path))
    one_line(e, "unreadable")


@needs_refs
def test_untied_head(hf_model, tmp_path):
    save_variant(hf_model, tmp_path, "bin")
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert "lm_head.weight" in sd  # the tied head, saved twice: accepted (test above)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1  # a head of its own: not GPT-2
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError) as e:
        hf.load_pretrained(str(tmp_path))
    one_line(e, "tied")


def test_save_bad_input_writes_nothing(tmp_path):
    model = random_gpt()
    sd = model.state_dict()
    bad = [({k: v for k, v in sd.items() if k != "transformer.ln_f.bias"}, "ln_f.bias"),
           ({**sd, "transformer.wpe.weight": torch.zeros(7, 32)}, "wpe"),
           ({**sd, "transformer.h.0.attn.c_attn.lora_A": torch.zeros(2, 32)}, "LoRA")]
    for state, word in bad:
        with pytest.raises(UserError) as e:
            hf.save_hf(state, ARGS, tmp_path / "out")
        one_line(e, word)
    lora.apply_lora(model, rank=2, targets=("mlp_fc",))
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    state["transformer.h.0.mlp.c_fc.lora_A"] = torch.zeros(3, 32)
    state["transformer.h.0.mlp.c_fc.lora_B"] = torch.zeros(128, 3)
    with pytest.raises(ValueError) as e:  # lora_A of rank 3 where the settings say 2
        adapters.save_adapter(tmp_path / "out", model, "0" * 16, lora_state=state)
    one_line(e, "rank 2")
    assert not os.path.exists(tmp_path / "out")


def test_without_transformers_one_line_nothing_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(UserError) as e:
        hf.save_hf(random_gpt().state_dict(), ARGS, tmp_path / "out")
    one_line(e, "pip install transformers")
    assert not os.path.exists(tmp_path / "out")


def test_hub_name_without_huggingface_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./gpt2 folder to find instead
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    with pytest.raises(UserError) as e:
        hf.load_pretrained("gpt2")
    one_line(e, "not installed", "--local-dir gpt2", "./gpt2")


def test_hub_unreachable(tmp_path, monkeypatch):
    def snapshot_download(*args, **kw):
        raise OSError("no network\nsecond line")
    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = snapshot_download
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    with pytest.raises(UserError) as e:
        hf.load_pretrained("openai-community/gpt2-xl")
    one_line(e, "no network", "--local-dir gpt2-xl")
    with pytest.raises(UserError) as e:
        hf.load_pretrained("gpt3")
    one_line(e, "not one of")


def test_hub_name_found_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    hf.save_hf(random_gpt().state_dict(), ARGS, tmp_path / "gpt2")  # as if from `hf download`
    assert hf.read_config("gpt2") == ARGS

