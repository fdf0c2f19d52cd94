"""memory.py held to measurement: the model-state estimate equals what ZeRO allocates, to the
byte, on 1 and 2 ranks; the activation estimate is within 15% of what train.py's
saved_activation_bytes measures (on CPU it is exact); the CLI prints the lecture's tables and
a command train.py accepts.
"""
import math
import shlex

import pytest
import torch

import lora
from machinery import estimator
from configurator import UserError, parse_args
from conftest import make_zero, run_distributed
from machinery.activations import BYTES, activation_bytes
from machinery.footprint import bucket_sizes, estimate, model_state_bytes, param_numels
from memory import advise, main
from model import GPT, GPTConfig
from machinery.meter import saved_activation_bytes
from zero import zero_formula

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# n_embd 9: every bucket has an odd size, so on 2 ranks the last one owns padding
SMALL = dict(block_size=7, vocab_size=13, n_layer=2, n_head=3, n_embd=9, dropout=0.0, bias=True)


def param_count(n_layer, n_embd, n_head, vocab, block, bias=True, pad_vocab=64):
    """GPT-2's closed form (the estimate counts the model itself, not this):
    = GPT(...).num_params(non_embedding=False). Per block 12h^2 of matmuls (qkv 3h^2, attention
    output h^2, MLP 4h^2 + 4h^2), two LayerNorm gains, and with bias 9h of Linear biases + 2h of
    LayerNorm biases. n_head splits the width but adds nothing."""
    h = n_embd
    block_params = 12 * h * h + 2 * h + (11 * h if bias else 0)
    vocab = math.ceil(vocab / pad_vocab) * pad_vocab  # model.py pads the embedding's rows
    return vocab * h + block * h + n_layer * block_params + (2 * h if bias else h)


@pytest.mark.parametrize("shape", [
    dict(n_layer=12, n_embd=768, n_head=12, vocab=50257, block=1024, bias=True),  # GPT-2 124M
    dict(n_layer=4, n_embd=128, n_head=4, vocab=65, block=64, bias=False),  # the CPU demo preset
    dict(n_layer=3, n_embd=10, n_head=2, vocab=13, block=8, bias=True),
])
def test_param_count_is_gpt_num_params(shape):
    cfg = GPTConfig(block_size=shape["block"], vocab_size=shape["vocab"], n_layer=shape["n_layer"],
                    n_head=shape["n_head"], n_embd=shape["n_embd"], bias=shape["bias"])
    with torch.device("meta"):  # shapes only, nothing allocated
        model = GPT(cfg)
    assert param_count(**shape) == model.num_params(non_embedding=False)
    assert sum(n for _, n in param_numels(cfg)) == param_count(**shape)
    assert [n for _, n in param_numels(cfg)] == [p.numel() for p in model.parameters()]
    if shape["n_embd"] == 768:  # GPT-2's 124,439,808, plus 47 padded rows of 768
        assert param_count(**shape) == 124_439_808 + 47 * 768


def check_state(rank, world_size):
    """estimate == ZeRO.state_bytes() for every stage, dtype, bucket layout, with a frozen wpe."""
    for dtype in DTYPES:
        for stage in range(4):
            for bucket_mb, freeze in ((25.0, False), (0.0003, False), (0.0003, True)):
                torch.manual_seed(0)
                cfg = GPTConfig(**SMALL)
                model = GPT(cfg).to(DTYPES[dtype])
                if freeze:  # a frozen parameter: outside ZeRO's gradient and optimizer buffers
                    model.transformer.wpe.weight.requires_grad_(False)
                    params = [p for i, p in enumerate(param_numels(cfg)) if i != 1]  # wte, wpe, ...
                    buckets = bucket_sizes(params, stage, dtype, bucket_mb)
                    wpe = cfg.block_size * cfg.n_embd  # 63: under ZeRO-3 a root bucket of its own, padded
                    est = model_state_bytes(sum(buckets), stage, world_size, dtype, buckets, rank, frozen_psi=wpe,
                                            frozen_layout=[(wpe, BYTES[dtype])])
                else:
                    est = estimate(cfg, world_size, stage, dtype, bucket_mb=bucket_mb, rank=rank)["state"]
                    buckets = bucket_sizes(param_numels(cfg), stage, dtype, bucket_mb)
                zero = make_zero(model, stage, bucket_mb=bucket_mb, rank=rank, world_size=world_size)
                assert sorted(sum(p.numel() for p in b.params) for b in zero.buckets) == sorted(buckets)
                assert est == zero.state_bytes(), (dtype, stage, bucket_mb, freeze, rank)
                assert stage == 3 or bucket_mb == 25.0 or len(buckets) > 3  # several buckets exercised
            # 16-bit with fp32 gradient accumulation: the accumulating gradient buffer is fp32
            torch.manual_seed(0)
            model = GPT(GPTConfig(**SMALL)).to(DTYPES[dtype])
            zero = make_zero(model, stage, bucket_mb=0.0003, rank=rank, world_size=world_size,
                             fp32_grad_accum=dtype != "fp32")
            est = estimate(GPTConfig(**SMALL), world_size, stage, dtype, bucket_mb=0.0003, rank=rank,
                           fp32_grad_accum=True)
            assert est["state"] == zero.state_bytes(), (dtype, stage, rank)


def test_model_state_exact_one_rank():
    check_state(0, 1)


def test_model_state_exact_two_ranks():
    run_distributed(check_state, 2)


def check_whole_state(rank, world_size):
    """Muon and torch's Adafactor on beyond/muon.py's layout (WholeZeRO at stages 0-2,
    WholeZeRO3 at 3): each tensor dealt whole to one rank, every slice padded to the longest.
    The estimate equals what the engine allocates, Adafactor's row and column means included,
    and its buffers' elements, padding included, are the engine's."""
    import functools
    adafactor = functools.partial(torch.optim.Adafactor, lr=1e-2)
    for name, optimizer in (("muon", "muon"), ("adafactor", adafactor)):
        for dtype in DTYPES:
            for stage in range(4):
                torch.manual_seed(0)
                model = GPT(GPTConfig(**SMALL)).to(DTYPES[dtype])
                zero = make_zero(model, stage, bucket_mb=0.0003, rank=rank,
                                 world_size=world_size, optimizer=optimizer)
                est = estimate(GPTConfig(**SMALL), world_size, stage, dtype, bucket_mb=0.0003,
                               rank=rank, optimizer=name)
                case = (name, dtype, stage, rank)
                assert est["state"] == zero.state_bytes(), case
                buffers = zero.buckets if stage < 3 else [u.buckets[0] for u in zero.all_units]
                assert est["padded"] == sum(b.numel for b in buffers), case
                assert (est["padded"] > est["psi"]) == (stage > 0), case  # odd sizes: padded


def test_muon_and_adafactor_state_exact_two_and_three_ranks():
    run_distributed(check_whole_state, 2)
    run_distributed(check_whole_state, 3)


def test_cli_counts_adafactor_on_its_layout(capsys):
    """memory.py --optimizer adafactor (not a train.py optimizer): the state on the dealt
    layout and its padding printed; a bare --params or --lora is refused in one line (its state
    is a row and a column mean per matrix: counted on the shapes)."""
    flags = ["--n-layer", "2", "--n-embd", "9", "--n-head", "3", "--block-size", "7",
             "--vocab", "13", "--bias", "--world-size", "2", "--zero", "3"]
    e = main(flags + ["--optimizer", "adafactor"])
    out = capsys.readouterr().out
    assert f"the buffers hold {e['padded']:,} elements for {e['psi']:,} parameters" in out
    assert e["state"] == estimate(GPTConfig(**SMALL), 2, 3, "fp32", optimizer="adafactor")["state"]
    for bad in (["--params", "1e9"], ["--lora"]):
        with pytest.raises(UserError, match="--optimizer adafactor is counted on the model's"):
            main(flags + bad + ["--optimizer", "adafactor"])
    lines, cmd = advise(GPTConfig(**SMALL), 2, 1e10, "bf16", optimizer="adafactor")
    assert "Adafactor is not a train.py --optimizer" in lines[-1] and "--lora" not in cmd
    # where the plan offloads (a 7B on one 80 GB GPU), what to build says so, and the CPU step
    # is priced at AdamW's rate, named as such (was: 'build beyond.muon.WholeZeRO', 'CPU AdamW')
    seven = GPTConfig(block_size=2048, vocab_size=50257, n_layer=32, n_head=32, n_embd=4096)
    lines, cmd = advise(seven, 1, 80e9, "bf16", optimizer="adafactor")
    assert "8 B/parameter, the lecture's is AdamW's 16;" in lines[1], lines[1]
    assert "--offload-optimizer" in cmd and "of CPU adafactor (at AdamW's rate) a step" in \
        lines[-2], lines
    assert "build beyond.offload_optimizer.offload_engine(beyond.muon.WholeZeRO) with " \
        "optimizer=torch.optim.Adafactor" in lines[-1], lines


@pytest.mark.parametrize("prefetch", [True, False])
def test_zero3_gathered_units(prefetch):
    """The ZeRO-3 working set: the root plus one block, plus the prefetched next one."""
    torch.manual_seed(0)
    cfg = GPTConfig(**{**SMALL, "n_layer": 3})
    model = GPT(cfg)
    zero = make_zero(model, 3, prefetch=prefetch)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    zero.backward(model(x, x)[1])
    assert zero.peak_gathered_bytes == estimate(cfg, stage=3, prefetch=prefetch)["gathered"]


@pytest.mark.parametrize("dtype,shape,batch,seq", [
    ("fp32", dict(n_layer=2, n_head=4, n_embd=64, vocab_size=65, bias=True), 3, 32),
    ("fp32", dict(n_layer=3, n_head=2, n_embd=48, vocab_size=101, bias=False), 2, 24),
    ("bf16", dict(n_layer=1, n_head=2, n_embd=32, vocab_size=50, bias=True), 2, 16),  # 16-bit matmuls are slow on CPU
])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_activation_estimate_matches_measurement(dtype, shape, batch, seq, grad_ckpt):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=seq, dropout=0.0, **shape)
    model = GPT(cfg).to(DTYPES[dtype])
    model.grad_ckpt = grad_ckpt
    # two tensors (not two views of one: the measurement counts whole storages), as in train.py
    x, y = torch.randint(0, cfg.vocab_size, (batch, seq)), torch.randint(0, cfg.vocab_size, (batch, seq))
    out = [0]
    with saved_activation_bytes(model, out):
        model(x, y)
    est = activation_bytes(cfg, batch, seq, dtype, grad_ckpt, device="cpu")["total"]
    print(f"{dtype} {shape} b={batch} s={seq} grad_ckpt={grad_ckpt}: estimate {est}, measured {out[0]}")
    assert est == out[0]  # on CPU, to the byte (LayerNorm's statistics in the input's dtype)


LORA_CFG = dict(block_size=24, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)


def lora_model(dtype, targets, quantize=None):
    import quant
    torch.manual_seed(0)
    model = GPT(GPTConfig(**LORA_CFG)).to(DTYPES[dtype])
    lora.apply_lora(model, rank=4, targets=targets)
    if quantize:
        quant.quantize_base(model, quantize)
    return model


@pytest.mark.parametrize("targets", [("q", "v"), ("attn_out",),
                                     ("q", "k", "v", "attn_out", "mlp_fc", "mlp_proj")])
@pytest.mark.parametrize("grad_ckpt", [False, True])
def test_lora_activations(targets, grad_ckpt):
    """Under LoRA the base is frozen: autograd skips the inputs only a weight's gradient needs, and
    in the first layer everything before the first adapter."""
    model = lora_model("fp32", targets)
    model.grad_ckpt = grad_ckpt
    x, y = torch.randint(0, 40, (3, 24)), torch.randint(0, 40, (3, 24))
    out = [0]
    with saved_activation_bytes(model, out):
        model(x, y)
    est = estimate(GPTConfig(**LORA_CFG), batch=3, grad_ckpt=grad_ckpt, lora_rank=4, lora_targets=targets,
                   device="cpu")
    assert est["activations"]["total"] == out[0]  # on CPU, to the byte
    assert est["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_lora_state(rank, world_size):
    """ZeRO holds the adapters' state; the frozen base, in its dtype or quantized (its codes and
    scales, buffers that ZeRO.state_bytes() counts with the weights), is whole on every rank up to
    stage 2 and sharded with its unit by stage 3: memory.py's estimate equals it to the byte."""
    for quantize in (None, "nf4"):
        for stage in range(4):
            for dtype in DTYPES:
                model = lora_model(dtype, ("q", "v"), quantize)
                held = make_zero(model, stage, rank=rank, world_size=world_size).state_bytes()
                est = estimate(GPTConfig(**LORA_CFG), world_size, stage, dtype, lora_rank=4, quantize=quantize,
                               rank=rank)
                assert held == est["state"], (quantize, stage, dtype, rank)


def test_lora_model_state_one_rank():
    check_lora_state(0, 1)


def test_lora_model_state_two_ranks():
    run_distributed(check_lora_state, 2)


def test_checkpointing_is_korthikanti_2sbh():
    """With full recomputation a layer keeps 2*s*b*h bytes in 16 bits, as Korthikanti et al. count."""
    cfg = GPTConfig(block_size=2048, vocab_size=50257, n_layer=24, n_head=16, n_embd=2048)
    assert activation_bytes(cfg, 8, 2048, "bf16", grad_ckpt=True)["per_layer"] == 2 * 2048 * 8 * 2048


def test_lecture_tables(capsys):
    from bench.lecture import lecture
    lecture()
    out = capsys.readouterr().out
    for text in ("Bytes per value", "nf4      0.5", "24 bytes x 1e9 parameters = 24 GB, not 80",
                 "16 bytes x 1e9 = 16 GB", "+ ZeRO-3", "+ activation checkpointing", "QLoRA"):
        assert text in out, text


def test_cli_estimate(capsys):
    """memory.py takes train.py's own flags: the preset's --grad-accum 5 in bf16 accumulates in
    fp32 (train.py's default), 2 more bytes per gradient element than the paper's 16-bit ones."""
    flags = ["--config", "gpt2_124m", "--dtype", "bf16", "--world-size", "8", "--zero", "2",
             "--gpu-mem", "80GB"]
    e = main(flags + ["--no-fp32-grad-accum"])
    out = capsys.readouterr().out
    assert "124,475,904 parameters" in out and "fits" in out and "logits (b*s*padded vocab" in out
    psi = 124_475_904  # GPT-2 124M with its vocabulary padded to 50,304
    assert e["state"]["total"] == pytest.approx(zero_formula(psi, 2, 8, torch.bfloat16)["total"],
                                                rel=1e-6)
    assert main(flags)["state"]["grads"] == e["state"]["grads"] * 2  # fp32: 4 bytes, not 2
    with pytest.raises(UserError):
        main(["--params", "1e9", "--gpu-mem", "80XB"])
    for bare in ("24", "80"):  # a number alone was bytes: "0.0 GB usable", every plan refused
        with pytest.raises(UserError, match=f"--gpu-mem {bare}: give its unit, e.g. {bare}GB"):
            main(["--params", "1e9", "--gpu-mem", bare])
    with pytest.raises(UserError):
        main(["--n-layer", "2", "--n-embd", "10", "--n-head", "3"])  # 10 is not divisible by 3


def test_advise_prints_a_command_train_py_accepts(capsys):
    cmd = main(["--config", "gpt2_124m", "--world-size", "8", "--gpu-mem", "80GB", "--advise"])
    out = capsys.readouterr().out
    assert cmd.startswith("torchrun --nproc_per_node=8 train.py ") and cmd in out
    cfg = parse_args(shlex.split(cmd.split("train.py", 1)[1]))  # flags that exist, values that parse
    assert (cfg.zero, cfg.dtype, cfg.n_layer) == (2, "bf16", 12) and cfg.batch_size > 12
    # does not fit one GPU (20 B/parameter, broken down), but ZeRO-2 does, at micro-batch 4
    # with model.py's plain loss head (5 with --chunked-loss): its 16-bit weights fit whole,
    # for the traffic of data parallelism (the lecture's flowchart jumped to ZeRO-3)
    cmd = main(["--params", "7e9", "--world-size", "8", "--gpu-mem", "80GB", "--advise"])
    out = capsys.readouterr().out
    cfg = parse_args(shlex.split(cmd.split("train.py", 1)[1]))
    assert (cfg.zero, cfg.batch_size, cfg.dtype) == (2, 4, "bf16")
    assert ("= weights 14.00 + gradients 14.00 + master and optimizer 84.00: 16 B/parameter, "
            "the lecture's; + 28.00 in the optimizer step") in out and ": 20 B/parameter" in out
    assert "3. ZeRO-2 on 8 GPUs" in out and "4. ZeRO-3 on 8 GPUs" in out
    assert "5. a sequence moves Ψ/4 on ZeRO-2, 3Ψ/5 on ZeRO-3: ZeRO-2" in out
    assert "6. the lecture's flowchart goes to ZeRO-3" in out
    # ... ZeRO-3 where the 16-bit weights do not fit, then checkpointing, then LoRA: on
    # ZeRO-3, which shards the frozen base too
    cmd = main(["--params", "70e9", "--world-size", "8", "--gpu-mem", "80GB", "--advise"])
    assert "--zero 3" in cmd and cmd.endswith("--grad-ckpt --lora --lora-rank 8 --lora-targets q,v")
    assert "3. ZeRO-2 on 8 GPUs: its model state alone needs 262.50 GB" in capsys.readouterr().out
    # on one GPU the bf16 base alone (140 GB) does not fit: QLoRA
    lines, cmd = advise(estimator.shape_for(70e9), 1, 80e9, psi=int(70e9))
    assert cmd.endswith("--grad-ckpt --lora --lora-rank 8 --lora-targets q,v --quantize nf4")
    lines, cmd = advise(estimator.shape_for(70e9), 1, 24e9, psi=int(70e9))
    assert cmd is None and "does not fit" in lines[-1]


def test_zero3_activations_count_no_weights():
    """Under ZeRO-3 each forward gathers a block's weights into fresh memory: the counter must
    still know them for weights, so that every stage measures the same activations."""
    measured = []
    for stage in (0, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        zero = make_zero(model, stage)
        x = torch.randint(0, SMALL["vocab_size"], (2, SMALL["block_size"]))
        out = [0]
        with saved_activation_bytes(model, out):
            loss = model(x, x)[1]
        zero.backward(loss)
        measured.append(out[0])
    assert measured[0] == measured[1] > 0


@pytest.mark.parametrize("flags", [["--zero", "2"], ["--zero", "1", "--lora"],
                                   ["--zero", "0", "--optimizer", "sgd"]])
def test_the_memory_check_calls_memory_pys_estimate(flags, monkeypatch):
    """One estimator (footprint.for_run): its model state equals what the engine holds, to the
    byte; check_memory refuses, in one line, the run whose half peak by that same estimate
    exceeds the free memory, and lets pass the one a byte under it."""
    from configurator import UserError
    from machinery import run
    from machinery.footprint import for_run
    from train import build
    cfg = parse_args(["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                      "--batch-size", "3", "--device", "cpu", *flags])
    model, zero, _ = build(cfg, 40, torch.device("cpu"), torch.float32)
    assert for_run(cfg, model.config, 1, 0, device="cpu")["state"] == zero.state_bytes()
    shape = GPTConfig(block_size=16, vocab_size=1, n_layer=2, n_head=2, n_embd=32,
                      bias=cfg.bias)  # before the data: the smallest vocabulary
    half = for_run(cfg, shape, 1, device="cpu")["peak"] / 2
    monkeypatch.setattr(run, "free_bytes", lambda device: half)
    run.check_memory(cfg, torch.device("cpu"))  # fits, just
    monkeypatch.setattr(run, "free_bytes", lambda device: half - 1)
    with pytest.raises(UserError, match="--batch-size 3 x --block-size 16 on 2 x 32: this cpu "
                       "needs over"):
        run.check_memory(cfg, torch.device("cpu"))


def test_nccl_communicators_are_counted_where_they_are(monkeypatch, capsys):
    """NCCL's communicators hold GPU memory outside torch's allocator, an allowance of
    footprint.NCCL_BYTES each (an estimate, NVIDIA/nccl#864): 1 a rank at stage 0, 2 at stages
    1-3 (the gather group), 4 under ZeRO++ on two nodes, none on one GPU or on gloo. The peak
    counts them, memory.py prints them, and --advise's plan follows."""
    from machinery import footprint
    cfg = estimator.shape_for(7e9)
    est = lambda **run: estimate(cfg, psi=int(7e9), dtype="bf16", **run)
    assert [est(world_size=8, stage=s)["communicators"] for s in range(4)] == [1, 2, 2, 2]
    assert est(world_size=16, stage=3, zeropp=("hpz",), node_size=8)["communicators"] == 4
    assert est(world_size=16, stage=3, zeropp=("hpz",), node_size=16)["communicators"] == 2
    assert est()["nccl"] == est(world_size=8, stage=2, device="cpu")["nccl"] == 0
    counted = est(world_size=8, stage=2)
    assert counted["nccl"] == 2 * footprint.NCCL_BYTES > 0
    main(["--params", "7e9", "--world-size", "8", "--zero", "2", "--dtype", "bf16"])
    assert "NCCL communicators" in capsys.readouterr().out
    # a GPU run's console, once: PyTorch's peak beside the device's count (cudaMemGetInfo),
    # the communicators counted on the node size the run found (torchrun's, by default)
    from types import SimpleNamespace
    from machinery.report import communicators, memory_line
    run = SimpleNamespace(traffic=SimpleNamespace(node_size=8), device=torch.device("cuda"))
    flags = parse_args(["--zero", "3", "--zeropp", "hpz"])
    assert communicators(flags, 16, run) == 4 and communicators(flags, 8, run) == 2
    line = memory_line(30 * 2**30, 32 * 2**30, 36.5 * 2**30, 80 * 2**30, 2)
    assert "peak 30.00 GiB allocated, 32.00 GiB reserved" in line
    assert "36.50 of 80.00 GiB in use: 4.50 GiB outside PyTorch's allocator" in line
    assert line.endswith("memory.py allows 2 NCCL communicator(s) 2.98 GiB of it, an estimate")
    advised = [advise(cfg, 8, 27e9, psi=int(7e9))[1], advise(cfg, 1, 80e9, psi=int(7e9))[1]]
    monkeypatch.setattr(footprint, "NCCL_BYTES", 0)
    assert est(world_size=8, stage=2)["peak"] == counted["peak"] - counted["nccl"]
    # 27 GB GPUs: full checkpointing at micro-batch 5, where without NCCL selective fit
    assert advised[0].endswith("--batch-size 5 --grad-ckpt")
    assert advise(cfg, 8, 27e9, psi=int(7e9))[1].endswith("--batch-size 1 --grad-ckpt selective")
    assert advise(cfg, 1, 80e9, psi=int(7e9))[1] == advised[1]  # one GPU: no communicator


def test_out_of_memory_on_several_gpus_names_nccl(monkeypatch):
    """A CUDA out-of-memory error on several ranks says memory.py counts NCCL's communicators,
    which PyTorch's allocator (and so its message) never sees; one GPU or a CPU: not a word."""
    from machinery.run import out_of_memory
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    cpu = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9")
    assert "NCCL" not in out_of_memory(cuda)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert "NCCL's communicators included (1 a rank at ZeRO-0, 2 at stages 1-3, 4 under ZeRO++" \
        " across nodes; ~1.6 GB each" in out_of_memory(cuda)  # footprint.nccl_communicators
    assert "NCCL" not in out_of_memory(cpu) and "lower --batch-size" in out_of_memory(cpu)


def test_advise_keeps_one_gpu_where_nccls_allowance_leaves_several_no_room():
    """A small model on small GPUs: one holds it, but on two each rank also joins NCCL's
    communicators (3.2 GB allowed), and no micro-batch fits. --advise says so and prints the
    one-GPU command; before, it said "does not fit ... fits on 1 of these GPUs" and gave no
    command."""
    cfg = GPTConfig(**SMALL)
    lines, cmd = advise(cfg, 2, 2e9)
    assert "one GPU, not 2: on 2 each rank joins NCCL's communicators" in lines[-1], lines
    assert cmd.startswith("python train.py ") and "--zero" not in cmd, cmd
    b = int(cmd.split("--batch-size ")[1].split()[0])
    one = lambda b: estimate(cfg, 1, 0, "bf16", batch=b, chunked_loss=True)  # advise's
    assert estimator.fits(one(b), 2e9) and (b == 4096 or not estimator.fits(one(b + 1), 2e9))
    lines, cmd = advise(cfg, 2, 10e9)  # room for NCCL: ZeRO-2 on both, as before
    assert cmd.startswith("torchrun --nproc_per_node=2 train.py") and "--zero 2" in cmd
