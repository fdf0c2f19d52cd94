"""The CUDA paths. First what a CPU checks of them with a stand-in for a GPU machine (torch.cuda
says a device is there, and every entry that would create a CUDA context raises); then the
tests that run where a GPU is present (skipped otherwise). Multi-rank tests elsewhere stay on
gloo/CPU even there (--device cpu): one GPU cannot host two NCCL ranks. Tolerances here are
stated for fp32 with TF32 off; the NCCL test needs two GPUs."""
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import checkpoint
from conftest import ROOT, make_zero, run_distributed, zero_step
from model import GPT, GPTConfig
from precision import GradScaler

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# what torch.cuda does without a context: the count, and the seeds torch.manual_seed queues
# until one exists (torch.cuda._lazy_call)
CONTEXT_FREE = {"is_available", "device_count", "is_initialized", "_is_in_bad_fork",
                "_is_compiled", "_lazy_call", "manual_seed", "manual_seed_all", "seed", "seed_all"}


@pytest.fixture
def cuda_visible(monkeypatch):
    """A GPU machine's CUDA build, on a CPU: one device visible, and every other torch.cuda
    function (and every module's _lazy_init, which C++ calls before a device's first use)
    records its name and raises. Returns the list of names called."""
    calls = []

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"torch.cuda.{name}: a CUDA context on a CPU run")
        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, f in vars(torch.cuda).copy().items():
        if (inspect.isfunction(f) or name in ("Stream", "Event")) and name not in CONTEXT_FREE:
            monkeypatch.setattr(torch.cuda, name, refuse(name))
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.cuda") and module and hasattr(module, "_lazy_init"):
            monkeypatch.setattr(module, "_lazy_init", refuse("_lazy_init"))
    return calls


def test_a_cpu_run_never_touches_cuda(cuda_visible, data_root, tmp_path, monkeypatch):
    """--device cpu on a GPU machine: train, save, resume and train on, never calling into
    torch.cuda (a context holds ~500 MB on GPU 0 for every such process: the fuzz's cases, the
    test suite's runs). Only a CUDA run's checkpoint holds a CUDA generator's state, and a
    CPU run leaves one that an older save wrote alone."""
    from train import main
    argv = ["--device", "cpu", "--data-root", data_root, "--dataset", "tiny", "--n-layer", "1",
            "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "2",
            "--eval-iters", "1", "--dropout", "0.1", "--zero", "2", "--out-dir", str(tmp_path)]
    main(argv + ["--max-iters", "2"])
    saved = checkpoint.Reader(checkpoint.list_checkpoints(tmp_path)[-1]).header["rng"][0]
    assert "cuda" not in saved
    older = checkpoint.rng_state  # what a save before this fix wrote on a GPU machine
    monkeypatch.setattr(checkpoint, "rng_state", lambda device: dict(older(device), cuda=(
        "AAAAAAAAAAAAAAAAAAAAAA==")))
    main(argv + ["--max-iters", "4", "--resume", "--save-interval", "1"])
    main(argv + ["--max-iters", "5", "--resume"])  # resumed from a state with "cuda" in it
    assert cuda_visible == []
    # on a CUDA run the state is the run's device's, saved and restored alike
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.arange(16,
                                                                                 dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, device: cuda_visible.append(
        (t.tolist(), device)))
    gpu = torch.device("cuda", 0)
    checkpoint.set_rng_state(older(gpu), gpu)
    assert cuda_visible == [(list(range(16)), gpu)]


def test_no_cudnn_attention_puts_it_last_and_the_default_leaves_pytorchs_order(cuda_visible):
    """A GPU run's set-up (machinery/quirks.py): PyTorch's own order of SDPA's kernels by
    default (from torch 2.10 it puts cuDNN's attention first on Hopper / Blackwell itself),
    cuDNN's after the math kernel with --no-cudnn-attention; nothing on a CPU run."""
    from configurator import parse_args
    from machinery import quirks
    from torch.nn.attention import SDPBackend
    before = torch._C._get_sdp_priority_order()
    cuda = torch.device("cuda", 0)
    try:
        quirks.apply(parse_args([]), cuda)
        assert torch._C._get_sdp_priority_order() == before
        quirks.apply(parse_args(["--no-cudnn-attention"]), torch.device("cpu"))
        assert torch._C._get_sdp_priority_order() == before
        quirks.apply(parse_args(["--no-cudnn-attention"]), cuda)
        order = torch._C._get_sdp_priority_order()
        assert order[0] == int(SDPBackend.FLASH_ATTENTION)
        cudnn, math_ = int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.MATH)
        assert order.index(cudnn) > order.index(math_) and cuda_visible == []
    finally:
        quirks.KERNEL_ORDER.close()

@pytest.fixture(autouse=True)
def tf32_off():
    """The tolerances here are fp32's: TF32 off for each test, and back as it was after it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@needs_cuda
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
    # PyTorch's peak beside the device's count, once: the gap (the CUDA context) shows
    assert r.stdout.count("GPU memory: peak") == 1 and "outside PyTorch's allocator" in r.stdout
    assert all(row["cuda_used"] > row["cuda_max_reserved"] for row in steps)
    assert not any(row["skipped"] for row in steps[1:])
    r = subprocess.run([sys.executable, "sample.py", "--out-dir", str(tmp_path), "--device", "cuda", "--dtype", dtype,
                        "--max-new-tokens", "20", "--num-samples", "2"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@needs_cuda
def test_zero_stages_agree_on_cuda():
    """Every stage, one process on the GPU: the same weights after a few steps (fp32, TF32 off)."""
    results = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32)).cuda()
        zero = make_zero(model, stage, lr=1e-2)
        scaler = GradScaler(init_scale=1.0, dynamic=False, device="cuda")
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            x = torch.randint(0, 50, (4, 16), generator=g).cuda()
            zero.backward(model(x, x)[1])
            zero_step(zero, scaler, 1e-2, 1.0)
        results.append(checkpoint.state_dict(zero, model))
    for other in results[1:]:
        for k in results[0]:
            torch.testing.assert_close(other[k], results[0][k], rtol=1e-5, atol=1e-6)


@needs_cuda
def test_fp16_scaler_and_fused_step_on_cuda():
    """The dynamic scaler's state machine on the device: an injected inf skips the fused AdamW
    step on the GPU (weights, moments and step count unchanged) and halves the scale."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32)).cuda().half()
    zero = make_zero(model, 0, lr=1e-2)
    scaler = GradScaler(init_scale=2.0**10, device="cuda")
    x = torch.randint(0, 50, (4, 16), device="cuda")
    zero.backward(scaler.scale(model(x, x)[1]))
    before = [m.clone() for m in zero.master]
    zero.buckets[0].owned_grad()[0] = float("inf")
    _, skipped = zero_step(zero, scaler, 1e-2, 1.0)
    assert skipped and scaler.get_scale() == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before, zero.master))
    zero.backward(scaler.scale(model(x, x)[1]))
    assert not zero_step(zero, scaler, 1e-2, 1.0)[1]


def _nccl_zero3(rank, world_size):
    """Two GPUs, NCCL: ZeRO-3 gathers on their own process group (their own stream), and the
    result still equals ZeRO-0 on the same GPUs."""
    import torch.distributed as dist
    dist.destroy_process_group()  # the harness's gloo group: this test wants NCCL
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    torch.set_float32_matmul_precision("highest")
    out = []
    for stage in (0, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32)).cuda()
        zero = make_zero(model, stage, lr=1e-2, rank=rank, world_size=world_size)
        if stage == 3:  # a second communicator for the gathers
            assert zero.gather_group is not zero.group
        scaler = GradScaler(init_scale=1.0, dynamic=False, device="cuda")
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randint(0, 50, (4, 16), generator=g).cuda()
            zero.backward(model(x, x)[1])
            zero_step(zero, scaler, 1e-2, 1.0)
        out.append(checkpoint.state_dict(zero, model))
    if rank == 0:
        for k in out[0]:
            torch.testing.assert_close(out[1][k], out[0][k], rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_zero3_on_two_gpus_with_nccl():
    run_distributed(_nccl_zero3, 2)


@needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 units")
def test_fp8_without_compile_says_so_once(capsys):
    """Eager FP8 on a GPU: its casts cost more than its matmuls save (docs/fp8.md): one line."""
    from configurator import TrainConfig
    from train import build
    shape = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, dtype="bf16", fp8=True)
    for compile in (False, True):
        build(TrainConfig(**shape, compile=compile), 64, torch.device("cuda"), torch.bfloat16)
        assert capsys.readouterr().out.count("--fp8 without --compile") == (not compile)


@needs_cuda
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.compiles
def test_offload_under_compile_on_cuda(stage):
    """--compile --offload-activations on a GPU: pinned copies out and back on side streams,
    the saved views rebuilt with their strides; the same losses as without offloading."""
    from configurator import TrainConfig
    from train import build
    shape = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=4, compile=True)
    x = torch.randint(0, 64, (4, 64), device="cuda", generator=None)
    losses = []
    for offload in (False, True):
        torch.manual_seed(0)
        cfg = TrainConfig(**shape, zero=stage, offload_activations=offload)
        model, zero, scaler = build(cfg, 64, torch.device("cuda"), torch.float32)
        if offload:
            model.offload.min_bytes = 0  # every saved tensor moves
        for _ in range(2):
            loss = model(x, x)[1]
            zero.backward(loss)
            zero_step(zero, scaler, 1e-2, 1.0)
            losses.append(loss.item())
        if offload:
            assert model.offload.host_bytes > 0 and model.offload.in_flight_bytes == 0
    torch.testing.assert_close(losses[2:], losses[:2], rtol=0, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_on_cuda(stage, dtype):
    """--offload-optimizer on a GPU (beyond/offload_optimizer.py): the master and AdamW's moments
    pinned on the host, the device holding no optimizer side; the copies on a side stream fenced
    by events, plain and overlapped alike; the inf/NaN flag and the norm reduced on the device.
    The same run as the resident engine's: the norm's host sum may differ in its last bits."""
    from beyond.offload_optimizer import offload_engine
    from zero import ZeRO
    from zero3 import ZeRO3
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    cfg = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=64)
    x = torch.randint(0, 64, (4, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    runs = {}
    for mode in (None, "plain", "overlap"):
        torch.manual_seed(0)
        model = GPT(cfg).to("cuda", dtype)
        Engine = ZeRO3 if stage == 3 else ZeRO
        kwargs = {} if mode is None else {"overlap": mode == "overlap"}
        Engine = Engine if mode is None else offload_engine(Engine)
        zero = Engine(model, stage, lr=1e-2, bucket_mb=0.05, **kwargs)
        scaler = GradScaler(init_scale=2.0**12, dynamic=dtype == torch.float16, device="cuda")
        norms = []
        for step in range(3):
            for micro in range(2):
                loss = model(x[:, :-1], x[:, 1:])[1] / 2
                zero.backward(scaler.scale(loss), sync=micro == 1)
            norms.append(zero_step(zero, scaler, 1e-2, 0.05)[0])
        runs[mode] = (norms, [m.detach().cpu() for m in zero.master])
        if mode is not None:
            assert all(m.is_pinned() and m.device.type == "cpu" for m in zero.master)
            assert all(t.device.type == "cpu" for s in zero.opt.state.values()
                       for t in s.values())
            assert zero.state_bytes()["master"] == zero.state_bytes()["optimizer"] == 0
            assert zero.host_copies.d2h > 0 and zero.host_copies.h2d > 0
            # an inf in the host slice: found on the host, flagged on the device, skipped
            zero.backward(scaler.scale(model(x[:, :-1], x[:, 1:])[1]))
            before = [m.clone() for m in zero.master]
            grads = zero.master_grads()
            grads[0].view(-1)[0] = float("inf")
            found_inf = scaler.unscale_(grads)
            assert found_inf.device.type == "cuda" and found_inf.item() == 1.0
            zero.clip_grad_norm_(0.05)
            zero.step(1e-2, found_inf)
            zero.publish()
            assert all(torch.equal(m, b) for m, b in zip(zero.master, before))
    for mode in ("plain", "overlap"):
        torch.testing.assert_close(runs[mode][0], runs[None][0], rtol=1e-5, atol=0)
        for mine, ref in zip(runs[mode][1], runs[None][1]):
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    assert runs["plain"][1][0].equal(runs["overlap"][1][0])  # one arithmetic, two schedules


@needs_cuda
def test_a_cpu_run_creates_no_cuda_context(data_root, tmp_path):
    """--device cpu on this GPU machine: train, save, resume, and no CUDA context at the end
    (the CPU stand-in test above, for real)."""
    code = ("import sys, torch, train; train.main(sys.argv[1:]); "
            "assert not torch.cuda.is_initialized(), 'a CUDA context on a CPU run'")
    argv = ["--device", "cpu", "--data-root", data_root, "--dataset", "tiny", "--n-layer", "1",
            "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "2",
            "--eval-iters", "1", "--out-dir", str(tmp_path)]
    for extra in (["--max-iters", "2"], ["--max-iters", "4", "--resume"]):
        r = subprocess.run([sys.executable, "-c", code, *argv, *extra], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]


@needs_cuda
def test_sdpa_picks_cudnn_attention_where_preferred():
    """SDPA's choice on this GPU for a GPT-2 attention (bf16, causal, 64-wide heads,
    training): FlashAttention-2 with --no-cudnn-attention (machinery/quirks.py); PyTorch's own
    otherwise, and where that is cuDNN's (sm90 / sm100, cuDNN >= 9.15.1, torch >= 2.10) its
    forward and backward agree with the math kernel's to bf16's precision."""
    import torch.nn.functional as F
    from machinery import quirks
    from torch.nn.attention import SDPBackend, sdpa_kernel
    device = torch.device("cuda", torch.cuda.current_device())
    q, k, v = (torch.randn(4, 12, 1024, 64, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    choice = lambda: torch._fused_sdp_choice(q, k, v, is_causal=True)
    theirs = choice()
    try:
        if torch.__version__ >= "2.6":
            quirks.cudnn_attention_last()
            assert choice() == int(SDPBackend.FLASH_ATTENTION)
    finally:
        quirks.KERNEL_ORDER.close()
    if theirs != int(SDPBackend.CUDNN_ATTENTION):
        pytest.skip("PyTorch does not take cuDNN's attention first on this GPU / cuDNN / torch")
    outs = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel(backend):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(y.float().square().sum(), (q, k, v))
        outs.append([y.float()] + [g.float() for g in grads])
    for a, b in zip(*outs):
        assert ((a - b).norm() / b.norm()).item() < 2e-2

@needs_cuda
@pytest.mark.compiles
def test_the_chunked_loss_head_compiles_whole_on_cuda():
    """--chunked-loss --compile on a GPU: the head's fused path (its gradient a slice
    assignment while compiling) in one graph, no graph break; the same loss and gradients as
    eager, to bf16's precision."""
    import torch._dynamo
    from beyond import chunked_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=1000, n_layer=1, n_head=2, n_embd=64))
    model = model.cuda().bfloat16()  # 1000 tokens in 1024 padded columns: strided chunks
    model.cross_entropy = chunked_loss.cross_entropy
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 64), device="cuda")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    out = []
    for head in (model.head, torch.compile(model.head)):
        x.grad = model.lm_head.weight.grad = None
        loss = head(x, targets)[1]
        loss.backward()
        out.append((loss.float(), x.grad.float(), model.lm_head.weight.grad.float()))
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs + 1
    torch.testing.assert_close(out[1], out[0], rtol=2e-2, atol=2e-3)


@needs_cuda
def test_multi_tensor_and_stacked_steps_on_cuda():
    """Lion's foreach step equals its per-tensor arithmetic bitwise on the GPU too (the same
    element functions in multi-tensor kernels); Muon's Newton-Schulz on a stack of matrices
    (batched GEMM) stays within 1e-6 of each matrix alone (fp32, TF32 off)."""
    from beyond.lion import Lion
    from beyond.muon import newton_schulz
    from test_optim import lion_per_tensor
    torch.manual_seed(0)
    ps = [torch.randn(n, device="cuda") for n in (1000, 4097, 3)]
    ref, ref_m = [p.clone() for p in ps], [torch.zeros_like(p) for p in ps]
    opt = Lion([{"params": ps, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.99))
    for skip in (0.0, 1.0, 0.0):
        for p, r in zip(ps, ref):
            p.grad = torch.full_like(p, float("inf")) if skip else torch.randn_like(p)
            r.grad = p.grad.clone()
        opt.found_inf = torch.tensor(skip, device="cuda")
        opt.step()
        lion_per_tensor(ref, ref_m, 1e-2, (0.9, 0.99), 0.1, opt.found_inf)
        assert all(torch.equal(p, r) for p, r in zip(ps, ref))
        assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(ps, ref_m))
    G = torch.randn(4, 256, 1024, device="cuda")
    alone = torch.stack([newton_schulz(g) for g in G])
    torch.testing.assert_close(newton_schulz(G), alone, rtol=0, atol=1e-6)
