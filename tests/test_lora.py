"""LoRA, adapter files and training over a quantized (QLoRA) base, alone and under ZeRO.

Tiny fp32 models on the CPU. The multi-rank test compares LoRA training under ZeRO stages 1-3
(stage 3 with activation checkpointing: the frozen-weights-under-recompute case) with one
process running torch.optim.AdamW on the global batch, as tests/test_zero.py does.
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import checkpoint
import lora
from machinery import adapters, validate
import quant
from conftest import make_zero, run_distributed, zero_step
from model import GPT, GPTConfig
from precision import GradScaler
from data.loader import get_batch
from zero import ZeRO
from configurator import UserError

CFG = dict(block_size=16, vocab_size=17, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
B, T, ACCUM, STEPS, LR, CLIP, SEED = 2, 16, 2, 3, 1e-2, 0.03, 99
DATA = np.random.default_rng(0).integers(0, 17, 4000).astype(np.uint16)
C = CFG["n_embd"]
ALL = ("q", "k", "v", "attn_out", "mlp_fc", "mlp_proj")  # GPT's LINEARS: every slice


def make_model(seed=0, **lora_kw):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG))
    if lora_kw:
        lora.apply_lora(model, **lora_kw)
    return model


def batch(step=0, micro=0, rank=0, world_size=1, b=B, accum=1):
    return get_batch(DATA, SEED, step, micro, rank, world_size, b, T, accum)


def train(model, steps, stage=0, lr=LR, fixed_batch=False):
    """ZeRO on one rank (no process group needed): returns the losses."""
    zero = ZeRO(model, stage, lr=lr, bucket_mb=0.002)
    scaler, losses = GradScaler(init_scale=1.0, dynamic=False), []
    for step in range(steps):
        loss = model(*batch(0 if fixed_batch else step))[1]
        zero.backward(loss)
        zero_step(zero, scaler, lr, CLIP)
        losses.append(loss.item())
    return zero, losses


def lora_numel(model):
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_parse_targets():
    assert validate.parse_targets("v, q") == ("q", "v")  # the LINEARS' order, spaces allowed
    assert validate.parse_targets("all") == ALL
    assert validate.parse_targets(["mlp_fc"]) == ("mlp_fc",)
    for bad in ("q,x", "", "qkv"):
        with pytest.raises(ValueError, match="attn_out, mlp_fc"):
            validate.parse_targets(bad)
    # apply_lora takes the names; a name the model lacks is its own plain ValueError
    for bad in (("q", "x"), (), "q,v"):
        with pytest.raises(ValueError, match="name some of"):
            lora.apply_lora(make_model(), targets=bad)
    assert make_model(targets=("v", "q")).lora_settings["targets"] == ["q", "v"]  # LINEARS' order


def test_a_path_the_blocks_lack_is_one_line_before_lora():
    """A fork's LINEARS naming a layer its blocks lack: declared.check_model's one line after the
    build, before apply_lora would meet it (an AttributeError from inside)."""
    from configurator import TrainConfig
    from machinery import declared
    model = make_model()
    model.LINEARS = (("attn.c_attn", ("q", "k", "v")), ("mlp.fc", ("fc",)))
    for flags in (TrainConfig(lora=True), TrainConfig(fp8=True)):
        with pytest.raises(ValueError, match="names 'mlp.fc', which block 0 does not have"):
            declared.check_model(model, flags)
    declared.check_model(make_model(), TrainConfig(lora=True))  # GPT's own: every path there


def test_zero_delta_at_init_and_only_lora_trains():
    x, y = batch()
    base = make_model()
    ref_logits, _ = base(x, y)
    model = make_model()
    names = lora.apply_lora(model, rank=4, alpha=8.0, targets=ALL)
    assert len(names) == 4 * CFG["n_layer"]
    assert set(base.state_dict()) <= set(model.state_dict())  # model.py's names survive
    logits, loss = model(x, y)
    assert torch.equal(logits, ref_logits)  # B = 0: the model is the base, bitwise
    loss.backward()
    for n, p in model.named_parameters():
        assert p.requires_grad == ("lora_" in n) and (p.grad is not None) == ("lora_" in n), n
    assert all(m.lora_B.grad.abs().sum() > 0 for m in model.modules() if isinstance(m, lora.LoRALinear))
    c_attn = model.transformer.h[0].attn.c_attn
    assert c_attn.lora_A.shape == (3 * 4, C) and c_attn.lora_B.shape == (3 * C, 4)
    assert c_attn.scaling == 2.0
    with pytest.raises(ValueError, match="already"):
        lora.apply_lora(model)
    # LoRA tensors take the base's dtype (no 16-bit forward here: slow on this CPU)
    half = make_model().to(torch.bfloat16)
    lora.apply_lora(half)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_zero_holds_only_lora_and_qv_leaves_k_untouched():
    model = make_model(rank=4, targets=("q", "v"))
    w0 = model.transformer.h[1].attn.c_attn.weight.detach().clone()
    zero, _ = train(model, steps=4, stage=1)
    assert zero.psi == lora_numel(model) == CFG["n_layer"] * 2 * (4 * C + C * 4)
    assert sum(v.numel() for g in zero.opt.param_groups for v in g["params"]) == zero.psi
    c_attn = model.transformer.h[1].attn.c_attn
    effective = c_attn.weight + c_attn.delta_weight()  # the weight the model computes with
    assert torch.equal(c_attn.weight, w0)  # the base never moves
    assert torch.equal(effective[C:2 * C], w0[C:2 * C])  # k: exactly zero delta
    assert (effective[:C] - w0[:C]).abs().max() > 1e-4  # q and v trained
    assert (effective[2 * C:] - w0[2 * C:]).abs().max() > 1e-4
    x = torch.randn(3, C)  # and in the forward path: the k outputs are the base's, bitwise
    k_base = torch.nn.functional.linear(x, w0[C:2 * C], c_attn.bias[C:2 * C])
    assert torch.equal(c_attn(x)[:, C:2 * C], k_base)


def test_merge_unmerge():
    model = make_model(rank=4, alpha=4.0, targets=ALL)
    train(model, steps=3)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, _ = batch(5)
    model.eval()
    with torch.no_grad():
        unmerged = model(x)[0]
        lora.merge_lora(model)
        assert model.transformer.h[0].attn.c_attn.merged
        merged = model(x)[0]
        w = model.transformer.h[0].mlp.c_fc.weight
        assert (w - weights["transformer.h.0.mlp.c_fc.weight"]).abs().max() > 1e-4  # B @ A is in
        lora.merge_lora(model)  # a second merge is a no-op
        assert torch.equal(model(x)[0], merged)
        lora.unmerge_lora(model)
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, weights[n], rtol=0, atol=1e-6, msg=n)


def test_merge_in_bf16_and_dropout():
    # bf16 weight: the delta is added in fp32 and rounded once (no 16-bit matmul here: slow on CPU)
    half = make_model().to(torch.bfloat16)
    lora.apply_lora(half, rank=4, targets=("q", "v"))
    m = half.transformer.h[0].attn.c_attn
    torch.nn.init.normal_(m.lora_B)
    w0 = m.weight.detach().clone()
    m.merge()
    assert torch.equal(m.weight, (w0.float() + m.delta_weight()).to(torch.bfloat16))
    # dropout acts on the LoRA input only: in eval mode the model is the dropout-free one
    x = batch()[0]
    a, b = make_model(rank=4, dropout=0.5), make_model(rank=4)
    for m in (a, b):
        torch.nn.init.normal_(m.transformer.h[0].attn.c_attn.lora_B, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(a.train()(x)[0], a(x)[0])
    assert torch.equal(a.eval()(x)[0], b.eval()(x)[0])


@torch.no_grad()
def remove_adapter(model):
    """Back to the base: B = 0 makes every delta exactly zero, outputs bitwise the base's."""
    if any(m.merged for m in lora.lora_modules(model)):
        raise RuntimeError("unmerge_lora(model) before removing the adapter")
    for m in lora.lora_modules(model):
        m.lora_B.zero_()


def test_adapter_save_load_swap(tmp_path):
    x, _ = batch(7)
    run = lambda m: m.eval()(x)[0].detach()
    base_out = run(make_model())
    paths, outs = {}, {}
    for name, seed in (("A", 1), ("B", 2)):  # two adapters on the same base
        model = make_model(rank=4, targets=("q", "v", "mlp_fc"))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        paths[name], outs[name] = str(tmp_path / name), run(model)
        adapters.save_adapter(paths[name], model, adapters.base_fingerprint(model))
    assert not (outs["A"] == base_out).all()
    assert sorted(os.listdir(tmp_path / "A")) == ["adapter_config.json",  # PEFT's folder
                                                  "adapter_model.safetensors"]

    model = make_model()  # no LoRA yet: load_adapter applies it from the file's settings
    assert torch.equal(run(model), base_out)
    assert adapters.load_adapter(model, paths["A"])["targets"] == ["q", "v", "mlp_fc"]
    assert torch.equal(run(model), outs["A"])
    adapters.load_adapter(model, os.path.join(paths["B"], "adapter_model.safetensors"))  # its file
    assert torch.equal(run(model), outs["B"])
    remove_adapter(model)
    assert torch.equal(run(model), base_out)  # back to the base, bitwise

    with pytest.raises(UserError, match="trained on base"):
        adapters.load_adapter(make_model(seed=1), paths["A"])  # another base
    with pytest.raises(UserError, match="settings"):
        adapters.load_adapter(make_model(rank=8, targets=("q", "v", "mlp_fc")), paths["A"])
    other = make_model(rank=4, targets=("q", "v", "mlp_fc"))
    other.lora_settings["rank"] = 8  # settings that claim a match, shapes that do not
    with pytest.raises(UserError, match="settings"):
        adapters.load_adapter(other, paths["A"])
    weights = os.path.join(paths["A"], "adapter_model.safetensors")
    with open(weights, "r+b") as f:  # a corrupt file: half of it
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(UserError, match="not a readable adapter"):
        adapters.load_adapter(make_model(), paths["A"])
    from safetensors.torch import save_file
    other = str(tmp_path / "other" / "adapter.safetensors")  # a file beside no PEFT config
    os.makedirs(os.path.dirname(other))
    save_file(adapters.adapter_state(model.state_dict()), other, {"base_fingerprint": "0" * 16})
    with pytest.raises(UserError, match="not a readable adapter folder"):
        adapters.load_adapter(make_model(), other)


def edited(folder, config=None, tensors=None, meta=None):
    """The adapter folder rewritten: its adapter_config.json, tensors or metadata replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = os.path.join(folder, "adapter_model.safetensors")
    with safe_open(path, framework="pt") as f:
        have, have_meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors(have) if tensors else have, path, meta if meta is not None else have_meta)
    if config:
        cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
        json.dump({**cfg, **config}, open(os.path.join(folder, "adapter_config.json"), "w"))


def test_edited_or_lying_adapters_are_one_line(tmp_path):
    """PEFT's files carry what peft runs (adapter_config.json, the tensors) and what we check
    (the settings, base, vocabulary and crc32s in the metadata): each edit is one line."""
    model = make_model(rank=4, targets=("q", "v", "attn_out"))
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.lora_B.add_(1.0)
    fp = adapters.base_fingerprint(model)
    good = str(tmp_path / "good")
    adapters.save_adapter(good, model, fp, "char:x")
    cfg = json.load(open(os.path.join(good, "adapter_config.json")))
    assert cfg["rank_pattern"] == {"attn.c_attn": 8}  # q and v: one rank-8 adapter of c_attn
    assert cfg["alpha_pattern"] == {"attn.c_attn": 2.0}
    qkv = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"

    def off_block(t):  # a value where lora.py's k slice has no adapter
        t[qkv][C:2 * C] = 1.0
        return t
    from safetensors import safe_open
    with safe_open(os.path.join(good, "adapter_model.safetensors"), framework="pt") as f:
        ours = json.loads(f.metadata()["nanozero"])
    crcs = lambda t: {"nanozero": json.dumps(  # the checksum made to agree
        {**ours, "tensors": adapters.fingerprint_tensors(sorted(t.items()))})}
    cases = [(dict(config={"r": 16}), "adapter_config.json's r 16"),
             (dict(config={"target_modules": ["attn.c_attn"]}), "target_modules"),
             (dict(meta={"format": "pt"}), "no base fingerprint"),  # PEFT's own, from elsewhere
             (dict(tensors=off_block), "fail their checksum"),
             (dict(tensors=lambda t: {k: v for k, v in t.items() if "h.1.attn.c_proj" not in k}),
              "fail their checksum")]
    for kw, message in cases:
        folder = str(tmp_path / f"case{len(os.listdir(tmp_path))}")
        shutil.copytree(good, folder)
        edited(folder, **kw)
        with pytest.raises(UserError, match=message) as e:
            adapters.load_adapter(make_model(), folder)
        assert "\n" not in str(e.value)
    for change, message in ((off_block, "not block-diagonal"),
                            (lambda t: {k: v for k, v in t.items() if "h.1.attn.c_proj" not in k},
                             "do not fit its LoRA modules")):
        folder = str(tmp_path / f"case{len(os.listdir(tmp_path))}")
        shutil.copytree(good, folder)
        t = {}
        edited(folder, tensors=lambda have: t.update(change(have)) or t)
        edited(folder, meta=crcs(t))
        with pytest.raises(UserError, match=message):
            adapters.load_adapter(make_model(), folder)
    with pytest.raises(UserError, match="vocabulary char:x"):
        adapters.load_adapter(make_model(), good, vocab="char:y")
    adapters.load_adapter(make_model(), good, vocab="char:x")  # the untouched one fits


def test_adapter_shape_mismatch(tmp_path):
    model = make_model(rank=4, targets=("q",))
    state = adapters.adapter_state(model.state_dict())
    state["transformer.h.0.attn.c_attn.lora_A"] = torch.zeros(3, C)
    with pytest.raises(ValueError, match="rank 4"):  # nothing written for a bad state
        adapters.save_adapter(str(tmp_path / "bad"), model, adapters.base_fingerprint(model),
                              lora_state=state)
    assert not os.path.exists(tmp_path / "bad")
    path = str(tmp_path / "other")  # an adapter of another width
    wide = GPT(GPTConfig(**{**CFG, "n_embd": 64}))
    lora.apply_lora(wide, rank=4, targets=("q",))
    adapters.save_adapter(path, wide, adapters.base_fingerprint(make_model()))
    with pytest.raises(UserError, match="shapes differ"):
        adapters.load_adapter(make_model(), path)


def test_qlora_lowers_the_loss():
    """30 steps on one fixed batch of random tokens. The frozen ln_f and tied head cap the logits
    (|logit| <~ 0.7 at this init), so the loss cannot fall far below ~2.1 from ln(17) = 2.83."""
    model = make_model(rank=8, alpha=16.0, targets=ALL)
    quant.quantize_base(model, "nf4", double_quant=True)
    zero, losses = train(model, steps=30, fixed_batch=True)
    assert zero.psi == lora_numel(model)  # the quantized base is nowhere in the optimizer
    assert losses[-1] < 0.85 * losses[0], losses  # measured 2.84 -> 2.25
    _, dense = train(make_model(rank=8, alpha=16.0, targets=ALL), steps=30, fixed_batch=True)
    assert abs(losses[-1] - dense[-1]) < 0.05  # QLoRA tracks LoRA on the unquantized base


# ----------------------------------------------------------------------------------------------
# Several ranks: LoRA under ZeRO stages 1-3, against one process with torch.optim.AdamW

# Adam's first step maps g to ~sign(g): an entry with |g| near eps (1e-8) turns the last-bit
# differences of another summation order into update differences up to lr * dg / eps (measured:
# 2.3e-5 for an entry of |g| = 9e-9 among a median of 1e-3). LoRA's B = 0 makes it worse: A's
# first gradient comes a step later and depends on B's sign-like first step. So this test starts
# mid-training (B random, the same on every rank) and uses eps = 1e-6 on both sides, which bounds
# the effect below 1e-6 (measured worst 1.1e-6 over 10 data seeds); every reduction, shard,
# gather, the accumulation and the (active) clipping are still compared.
EPS, LORA_KW = 1e-6, dict(rank=4, alpha=4.0, targets=ALL)


def lora_model(mode=None):
    model = make_model(**LORA_KW)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    if mode:
        quant.quantize_base(model, mode, double_quant=True)
    return model


def reference(world_size, mode=None):
    model = lora_model(mode)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1)  # all 2-D
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = batch(step, micro, 0, 1, B * world_size, ACCUM)
            (model(x, y)[1] / ACCUM).backward()
        assert torch.nn.utils.clip_grad_norm_(params, CLIP) > CLIP  # clipping is active
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}


def _lora_under_zero(rank, world_size):
    refs = {None: reference(world_size), "nf4": reference(world_size, "nf4")}
    # stage 3 with activation checkpointing: the recompute re-runs each block's forward over its
    # re-gathered frozen weights and LoRA shards; and over an NF4 base
    for stage, ckpt, mode in ((1, False, None), (2, False, None), (3, False, None), (3, True, None),
                              (3, True, "nf4")):
        model, ref = lora_model(mode), refs[mode]
        model.grad_ckpt = ckpt
        zero = make_zero(model, stage, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, bucket_mb=0.002,
                         rank=rank, world_size=world_size)
        for group in zero.opt.param_groups:
            group["eps"] = EPS
        scaler = GradScaler(init_scale=1.0, dynamic=False)
        for step in range(STEPS):
            for micro in range(ACCUM):
                x, y = batch(step, micro, rank, world_size, B, ACCUM)
                zero.backward(model(x, y)[1] / ACCUM, sync=micro == ACCUM - 1)
            zero_step(zero, scaler, LR, CLIP)
        if stage == 3:  # the frozen base is sharded too: between steps no rank holds it whole
            frozen = [b for u in zero.all_units for b in u.buckets if b.frozen]
            assert frozen and all(b.flat.untyped_storage().nbytes() == 0
                                  and b.shard.numel() * world_size == b.numel for b in frozen)
            dtypes = {b.flat.dtype for b in frozen}  # nf4 codes and double-quantized scale codes
            assert dtypes == ({torch.float32, torch.uint8} if mode else {torch.float32})
        full = checkpoint.state_dict(zero, model)  # a collective: every rank calls it
        if rank != 0:
            continue
        adapter = adapters.adapter_state(full)
        assert adapter.keys() == ref.keys()
        for n, t in adapter.items():  # full shapes, not ZeRO-3's shape-[0] shards
            torch.testing.assert_close(t, ref[n], rtol=1e-5, atol=5e-6, msg=f"stage {stage} {n}")
        assert adapters.base_fingerprint(full) == adapters.base_fingerprint(lora_model(mode))  # base intact
        if stage == 3:
            with pytest.raises(UserError, match="ZeRO-3"):
                adapters.adapter_state(model.state_dict())


def test_lora_under_zero_world_2():
    run_distributed(_lora_under_zero, 2)
