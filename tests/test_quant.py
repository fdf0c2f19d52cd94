"""quant.py: the NF4 code table, quantization error and stored bits of int8 / NF4 / double
quantization, outlier blocks under double quantization, and the dequantizing linear."""
import pytest
import torch

import lora
import quant
from quant import quantized_bytes
from test_lora import ALL, C, batch, make_model


def test_nf4_code_values():
    # bitsandbytes' NF4 table (functional.py), which the QLoRA paper's construction produces
    bnb = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0]
    torch.testing.assert_close(quant.nf4_code(), torch.tensor(bnb), rtol=0, atol=2e-6)


def test_quantization_error_and_bytes():
    w = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    q8 = quant.QuantizedWeight(w, "int8")
    absmax = w.abs().amax(1)
    assert ((q8.dequantize() - w).abs().amax(1) <= absmax / 254 + 1e-7).all()
    # NF4 against uniform symmetric 4-bit absmax quantization, same blocks of 64 (Gaussian weights)
    blocks = w.view(-1, 64)
    scale = blocks.abs().amax(1, keepdim=True) / 7
    uniform = (torch.round(blocks / scale).clamp(-7, 7) * scale).view_as(w)
    nf4, nf4_dq = quant.QuantizedWeight(w, "nf4"), quant.QuantizedWeight(w, "nf4", double_quant=True)
    mse = lambda q: (q.dequantize() - w).pow(2).mean().item()
    assert mse(nf4) < 0.9 * (uniform - w).pow(2).mean().item()
    assert mse(nf4_dq) < 1.05 * mse(nf4)  # the 8-bit scales cost little accuracy
    # storage: codes packed two per byte; the bits per parameter that the QLoRA paper counts
    assert nf4.codes.dtype == torch.uint8 and nf4.codes.numel() == w.numel() // 2
    assert q8.codes.dtype == torch.int8 and q8.codes.numel() == w.numel()
    model = torch.nn.Module()
    model.a, model.b, model.c = q8, nf4, nf4_dq
    bits = {k: v["bits_per_param"] for k, v in quantized_bytes(model).items()}
    assert bits["a"] == pytest.approx(8 + 32 / 64)  # one fp32 scale per row of 64 inputs
    assert bits["b"] == pytest.approx(4 + 32 / 64)  # one fp32 absmax per block of 64
    assert bits["c"] == pytest.approx(4 + 8 / 64 + 64 / (64 * 256))  # 4.129


def test_quantized_base_backward_and_call_order():
    x = torch.randn(3, 5, C, requires_grad=True)
    qw = quant.QuantizedWeight(torch.randn(2 * C, C), "nf4", double_quant=True)
    y = quant.linear(x, qw, None)
    y.backward(torch.ones_like(y))
    dense = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(dense, qw.dequantize()).backward(torch.ones_like(y))
    torch.testing.assert_close(y, torch.nn.functional.linear(dense, qw.dequantize()))
    torch.testing.assert_close(x.grad, dense.grad)
    # apply_lora then quantize_base, or the other way round: the same model
    a, b = make_model(rank=4, targets=ALL), make_model()
    quant.quantize_base(a, "int8")
    quant.quantize_base(b, "int8")
    lora.apply_lora(b, rank=4, targets=ALL)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert torch.equal(a(batch()[0])[0], b(batch()[0])[0])
    # the block Linears' weights are buffers now: no parameter but biases, LayerNorms and LoRA
    assert {n.split(".")[-1] for n, _ in a.transformer.h.named_parameters() if "ln_" not in n} == \
        {"bias", "lora_A", "lora_B"}
    with pytest.raises(RuntimeError, match="quantized"):
        lora.merge_lora(a)


@pytest.mark.parametrize("outlier", [10, 300, 1000])
def test_double_quant_survives_outlier_blocks(outlier):
    """Two weight rows `outlier` times larger than the rest: the block scales then span a wide
    range. Double quantization must keep every decoded scale positive (no block's sign flips)
    and cost at most 1.2x the error of single quantization, overall and in every block."""
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    w[3] *= outlier
    w[50] *= outlier
    single, double = quant.QuantizedWeight(w, "nf4"), quant.QuantizedWeight(w, "nf4", True)
    err = lambda q: (q.dequantize() - w).abs().view(-1, 64).mean(1)  # per block of 64
    assert (double._absmax() > 0).all()
    assert err(double).mean() <= 1.2 * err(single).mean()
    assert (err(double) <= 1.2 * err(single) + 1e-6).all()
    assert (torch.sign(double.dequantize()) * torch.sign(w) >= 0).all()  # no sign flips
