"""Tests for model.py on the CPU with tiny configs: shapes, causality, weight tying, GPT-2's
initialisation, the parameter count and MFU formula (checked by hand on GPT-2 124M), config
errors, generate(), activation checkpointing and the padded vocabulary."""
import math

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig

from machinery.report import peak_flops


TINY = dict(block_size=16, vocab_size=11, n_layer=2, n_head=2, n_embd=16, dropout=0.0)


def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def tokens(B, T, seed=1, vocab=TINY["vocab_size"]):
    return torch.randint(vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_output_shapes():
    model = tiny()
    idx = tokens(3, 10)
    logits, loss = model(idx, targets=tokens(3, 10, seed=2))
    assert logits.shape == (3, 10, TINY["vocab_size"])  # training: every position
    assert loss.shape == () and torch.isfinite(loss)
    # at init the logits are near zero, so the loss is near ln(vocab)
    assert abs(loss.item() - math.log(TINY["vocab_size"])) < 0.5
    logits, loss = model(idx)
    assert logits.shape == (3, 1, TINY["vocab_size"]) and loss is None  # inference: last position only


def test_causality():
    """Changing the token at position t never changes the logits at positions < t."""
    model = tiny().eval()
    idx = tokens(2, TINY["block_size"])
    targets = torch.zeros_like(idx)  # passing targets makes forward return every position's logits
    with torch.no_grad():
        base, _ = model(idx, targets)
        for t in range(idx.size(1)):
            changed = idx.clone()
            changed[:, t] = (changed[:, t] + 1) % TINY["vocab_size"]
            logits, _ = model(changed, targets)
            # masked positions enter as exact zeros after the softmax, so earlier rows are bitwise equal
            assert torch.equal(logits[:, :t], base[:, :t]), f"position {t} leaked backwards"
            assert not torch.equal(logits[:, t], base[:, t])  # and the test can see a change


def test_weight_tying():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    # the state dict names the tied tensor twice; num_params counts it once
    d, V = TINY["n_embd"], model.config.padded_vocab
    by_name = sum(t.numel() for t in model.state_dict().values())
    assert model.num_params(non_embedding=False) == by_name - V * d
    assert model.num_params(non_embedding=True) == by_name - V * d - TINY["block_size"] * d
    # and it stays tied through training: a gradient step moves both names together
    _, loss = model(tokens(2, 8), tokens(2, 8, seed=3))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    assert torch.equal(model.state_dict()["lm_head.weight"], model.state_dict()["transformer.wte.weight"])


def test_init_statistics():
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=n_layer, n_head=4, n_embd=256))
    checked = 0
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):  # residual projections: 0.02 / sqrt(2 * n_layer)
            assert p.std().item() == pytest.approx(0.02 / math.sqrt(2 * n_layer), rel=0.1), name
        elif p.dim() == 2:  # c_attn, c_fc, wte (= lm_head), wpe
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name
        elif name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # every bias, Linear and LayerNorm
            assert name.endswith(".bias") and torch.equal(p, torch.zeros_like(p)), name
        if p.dim() == 2:
            assert abs(p.mean().item()) < 0.002, name
        checked += 1
    assert checked == len(list(model.parameters()))


def test_param_count_and_mfu_gpt2_124m():
    cfg = GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)
    with torch.device("meta"):  # shapes only: no 500 MB of weights, no init time
        model = GPT(cfg)
    V, T, L, H, d = cfg.padded_vocab, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd
    assert V == 50304  # 50257 rounded up to a multiple of 64, as nanoGPT pads it
    per_layer = (2 * 2 * d                  # ln_1, ln_2: weight and bias
                 + 3 * d * d + 3 * d        # c_attn
                 + d * d + d                # attn c_proj
                 + 4 * d * d + 4 * d        # c_fc
                 + 4 * d * d + d)           # mlp c_proj
    total = V * d + T * d + L * per_layer + 2 * d  # wte (= lm_head, once), wpe, blocks, ln_f
    assert total == 124_439_808 + 47 * d  # GPT-2 small, "124M", and its 47 padded rows
    assert model.num_params(non_embedding=False) == total
    assert model.num_params(non_embedding=True) == total - T * d == 123_689_472  # nanoGPT: 123.69M

    # PaLM appendix B: 6N + 12*L*H*Q*T, Q the head size
    flops = 6 * 123_689_472 + 12 * L * H * (d // H) * T
    assert flops == 855_383_040
    assert model.flops_per_token() == flops
    tps, peak = 150_000.0, 989e12
    assert model.estimate_mfu(tps, peak) == pytest.approx(flops * tps / peak, rel=1e-12)
    assert model.estimate_mfu(tps, None) is None and model.estimate_mfu(tps, 0) is None

    bf16, fp32 = torch.bfloat16, torch.float32
    assert peak_flops("NVIDIA H100 80GB HBM3", bf16) == 989e12  # the SXM part
    assert peak_flops("NVIDIA H100 PCIe", bf16) == 756e12
    assert peak_flops("NVIDIA H100 NVL", torch.float16) == 835e12
    assert peak_flops("NVIDIA H200", fp32) == 495e12  # fp32 matmuls run as TF32: half the peak
    assert peak_flops("NVIDIA A100-SXM4-80GB", bf16) == 312e12  # not the A10 entry, a prefix of it
    assert peak_flops("NVIDIA A10", bf16) == 125e12
    assert peak_flops("NVIDIA A10G", bf16) is None  # no data sheet: not the A10's figure
    assert peak_flops("NVIDIA H800", bf16) == 989e12 and peak_flops("NVIDIA H20", bf16) == 148e12
    assert peak_flops("NVIDIA GB200", bf16) == 2500e12 and peak_flops("NVIDIA B200", bf16) == 2250e12
    assert peak_flops("NVIDIA L4", bf16) == 121e12 and peak_flops("NVIDIA L40", bf16) == 181e12
    assert peak_flops("Some Unknown Accelerator", bf16) is None
    assert peak_flops(None, bf16) is None  # no GPU


def test_config_errors():
    with pytest.raises(ValueError, match=r"n_embd=10 is not divisible by n_head=3"):
        GPTConfig(n_embd=10, n_head=3)
    for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
        with pytest.raises(ValueError, match=rf"{name}=0 must be at least 1"):
            GPTConfig(**{**TINY, name: 0})
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)


def test_too_long_sequence():
    model = tiny()
    with pytest.raises(ValueError, match=r"length 17 is longer than block_size=16"):
        model(tokens(1, TINY["block_size"] + 1))


def test_generate():
    model = tiny().eval()
    prompt = tokens(2, 5)
    gen = lambda seed, **kw: model.generate(prompt, 30, generator=torch.Generator().manual_seed(seed), **kw)
    out = gen(7, temperature=1.0, top_k=5)
    # 5 + 30 tokens: past block_size=16, so generate() must crop its context
    assert out.shape == (2, 35) and torch.equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < TINY["vocab_size"]
    assert torch.equal(gen(7, temperature=1.0, top_k=5), out)  # same seed, same tokens
    assert not torch.equal(gen(8, temperature=1.0, top_k=5), out)
    # top_k=1 leaves one candidate, whatever the temperature: greedy decoding
    greedy = model.generate(prompt, 30, temperature=0.0)
    assert torch.equal(gen(9, temperature=1.5, top_k=1), greedy)
    # greedy is the argmax of a plain forward, token by token
    logits, _ = model(greedy[:, :5])
    assert torch.equal(greedy[:, 5], logits[:, -1].argmax(-1))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_grad_ckpt_same_loss_and_grads(dropout):
    model = tiny(dropout=dropout)
    x, y = tokens(4, 16), tokens(4, 16, seed=2)
    recomputed = []
    # a pre-hook: non-reentrant checkpointing stops the recompute as soon as it has every saved
    # tensor back, before the block's own forward hooks would run
    model.transformer.h[0].register_forward_pre_hook(lambda *a: recomputed.append(1))

    def loss_and_grads(grad_ckpt):
        model.grad_ckpt = grad_ckpt
        model.zero_grad(set_to_none=True)
        recomputed.clear()
        torch.manual_seed(123)  # same dropout masks; checkpoint replays the RNG in its recompute
        _, loss = model(x, y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(recomputed)

    loss0, grads0, calls0 = loss_and_grads(False)
    loss1, grads1, calls1 = loss_and_grads(True)
    assert (calls0, calls1) == (1, 2)  # with the flag, backward runs block 0's forward again
    # fp32 on the CPU: the recompute does the very same ops on the same inputs, so bitwise equal
    assert torch.equal(loss0, loss1)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name


def test_padded_vocabulary_changes_nothing_but_speed():
    """The rows past the vocabulary (11 -> 64 here) hold zeros, get no gradient and stay zero
    under AdamW; the loss and the logits equal an unpadded model's with the same weights."""
    padded, plain = tiny(), tiny(pad_vocab=1)
    assert padded.transformer.wte.weight.shape[0] == 64 and plain.config.padded_vocab == 11
    with torch.no_grad():
        for p, q in zip(padded.parameters(), plain.parameters()):
            p[:q.shape[0]].copy_(q)  # all of p, but for the embedding's padded rows
    assert (padded.lm_head.weight[11:] == 0).all()
    idx, targets = tokens(3, 10), tokens(3, 10, seed=2)
    opt = torch.optim.AdamW(padded.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        (l1, loss1), (l2, loss2) = padded(idx, targets), plain(idx, targets)
        assert l1.shape == l2.shape == (3, 10, 11)
        torch.testing.assert_close(loss1, loss2, rtol=1e-6, atol=1e-6)
        loss1.backward()
        assert (padded.lm_head.weight.grad[11:] == 0).all()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # follow the same update in the plain model
            for p, q in zip(padded.parameters(), plain.parameters()):
                q.copy_(p[:q.shape[0]])
    assert (padded.lm_head.weight[11:] == 0).all()
    assert padded.eval().generate(idx[:, :3], 20).max() < 11  # sampling never draws a padded id


@pytest.mark.parametrize("fused", [False, True])
def test_chunked_loss_head_equals_the_textbook_head(monkeypatch, fused):
    """beyond/chunked_loss.py's cross-entropy (fp32 softmax a chunk of rows at a time, the padded columns out)
    against the textbook head (slice, fp32 copy, F.cross_entropy) in fp32: the loss and both
    gradients to 1e-6, with several chunks and an ignored target; no gradient reaches the
    padded rows of the head. fused: CUDA's path (one-pass softmax kernels, here in fp32, where
    the CPU has them too)."""
    from beyond import chunked_loss
    torch.manual_seed(0)
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 3 * 65)  # three rows a chunk: 14 chunks
    monkeypatch.setattr(chunked_loss, "fused_kernels", lambda logits: fused)
    cfg = GPTConfig(block_size=8, vocab_size=65, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg)
    x = torch.randint(0, 65, (5, 8))
    y = torch.randint(0, 65, (5, 8))
    y[0, 3] = -1  # ignored, as F.cross_entropy's ignore_index
    logits, ours = model(x, y)
    ours.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    h = model.transformer.drop(model.transformer.wte(x) + model.transformer.wpe(torch.arange(8)))
    for block in model.transformer.h:
        h = block(h)
    h = model.transformer.ln_f(h)
    ref_logits = model.lm_head(h)[..., :65]
    ref = F.cross_entropy(ref_logits.float().view(-1, 65), y.view(-1), ignore_index=-1)
    ref.backward()
    assert abs(ours.item() - ref.item()) < 1e-6
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert not grads["transformer.wte.weight"][65:].any()  # the padded rows: no gradient


def test_fused_loss_head_in_bf16_equals_the_chunked_one(monkeypatch):
    """A GPU's path (one softmax kernel a chunk, the bf16 gradient written from the product)
    run on the CPU: the loss and the gradient of the CPU's path."""
    from beyond import chunked_loss
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 3 * 128)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 9, 128, generator=g) * 3).bfloat16()
    targets = torch.randint(0, 100, (2, 9), generator=g)
    targets[1, 2] = -1
    out = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        loss = chunked_loss.cross_entropy(x, targets, 100, fused=fused)
        loss.backward()
        out.append((loss, x.grad))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=0, atol=1e-4)  # bf16 gradients
    assert not out[1][1][..., 100:].any()


def test_top_k_sampling_masks_without_a_boolean_index(monkeypatch):
    """generate's top-k cut is masked_fill_: a boolean-mask assignment (index_put) syncs the host
    once per token on a GPU. Same tokens as the boolean form for one seed."""
    torch.manual_seed(0)
    model = tiny().eval()
    idx = torch.zeros(2, 1, dtype=torch.long)
    bool_keys = []
    setitem = torch.Tensor.__setitem__

    def recording(self, key, value):
        if isinstance(key, torch.Tensor) and key.dtype == torch.bool:
            bool_keys.append(key.shape)
        return setitem(self, key, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", recording)
    gen = torch.Generator().manual_seed(1)
    out = model.generate(idx, 6, temperature=0.8, top_k=5, generator=gen)
    assert bool_keys == []
    monkeypatch.undo()
    # the reference: the boolean form, step by step with the same generator
    gen, ref = torch.Generator().manual_seed(1), idx
    with torch.no_grad():
        for _ in range(6):
            logits = model(ref)[0][:, -1, :] / 0.8
            v, _ = torch.topk(logits, 5)
            logits[logits < v[:, [-1]]] = -float("inf")
            ref = torch.cat((ref, torch.multinomial(F.softmax(logits, -1), 1, generator=gen)), 1)
    assert torch.equal(out, ref)
