"""The CUDA paths of the single-rank code, run when a GPU is present (skipped otherwise).
Multi-rank tests stay on gloo even there: one GPU cannot host two NCCL ranks."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from model import GPT, GPTConfig
from precision import GradScaler
from zero import ZeRO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")




@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 3])
def test_train_and_sample_on_cuda(data_root, tmp_path, dtype, stage):
    if dtype == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    args = ["--device", "cuda", "--dtype", dtype, "--zero", str(stage), "--data-root", data_root, "--dataset", "tiny",
            "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
            "--max-iters", "30", "--eval-interval", "100", "--eval-iters", "2", "--log-interval", "1",
            "--learning-rate", "3e-3", "--warmup-iters", "2", "--grad-ckpt", "--out-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, "train.py"] + args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    steps = [row for row in rows if "loss" in row]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    assert all(row["cuda_max_mem"] > 0 for row in steps)
    assert not any(row["skipped"] for row in steps[1:])
    r = subprocess.run([sys.executable, "sample.py", "--out-dir", str(tmp_path), "--device", "cuda", "--dtype", dtype,
                        "--max-new-tokens", "20", "--num-samples", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_zero_stages_agree_on_cuda():
    """Every stage, one process on the GPU: the same weights after a few steps (fp32, TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32)).cuda()
        zero = ZeRO(model, stage, lr=1e-2)
        scaler = GradScaler(init_scale=1.0, dynamic=False)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            x = torch.randint(0, 50, (4, 16), generator=g).cuda()
            zero.backward(model(x, x)[1])
            zero.step(1e-2, scaler, 1.0)
        results.append(zero.full_state_dict(model))
    for other in results[1:]:
        for k in results[0]:
            torch.testing.assert_close(other[k], results[0][k], rtol=1e-5, atol=1e-6)
