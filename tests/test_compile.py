"""--compile: torch.compile on each block's attention and MLP (CPU inductor; gcc compiles the
kernels), under every ZeRO stage, with activation checkpointing (full, and selective: its
per-op policy runs around the compiled block) and LoRA. The hooks that drive ZeRO stay outside
the compiled regions, so: the same losses as eager, no recompilation after
the first step, and the gradient collectives still launched during backward, interleaved with
the blocks' backward as in eager mode. One process (the stages' collectives are local copies
on one rank), one small shape, so that every configuration reuses the same few graphs."""
import pytest
import torch
import torch._dynamo
from torch.utils.checkpoint import CheckpointPolicy

from conftest import zero_step
from configurator import TrainConfig
from train import build

SHAPE = dict(n_layer=3, n_head=2, n_embd=32, block_size=16, batch_size=4, dropout=0.0,
             lora_targets="all", bucket_mb=0.0001)
VOCAB = 50
pytestmark = pytest.mark.compiles  # conftest.py deals these to one worker


def batches(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (4, 16), generator=g) for _ in range(n)]


def losses(model, zero, scaler, xs):
    out = []
    for x in xs:
        loss = model(x, x)[1]
        zero.backward(loss)
        zero_step(zero, scaler, 1e-2, 1.0)
        out.append(loss.item())
    return out


def graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_blocks_train_like_eager(stage):
    xs = batches(4)
    # (full checkpointing with LoRA too was a fourth set of graphs: 15 s of a cold compile)
    for grad_ckpt, lora in (("none", False), ("full", False), ("selective", True)):
        cfg = TrainConfig(**SHAPE, zero=stage, grad_ckpt=grad_ckpt, lora=lora)
        eager = losses(*build(cfg, VOCAB, torch.device("cpu"), torch.float32), xs)
        model, zero, scaler = build(TrainConfig(**{**vars(cfg), "compile": True}), VOCAB,
                                    torch.device("cpu"), torch.float32)
        compiled = losses(model, zero, scaler, xs[:1])  # the first step compiles
        before = graphs()
        compiled += losses(model, zero, scaler, xs[1:])
        assert graphs() == before, (stage, grad_ckpt, lora)  # and no later step recompiles
        assert graphs() > 0  # something was compiled at all
        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


def _events(compile):
    """The order in which, during one backward, ZeRO-2 launches bucket reductions and the
    gradient of each block's output arrives (i.e. that block's backward begins)."""
    cfg = TrainConfig(**SHAPE, zero=2, compile=compile)
    model, zero, _ = build(cfg, VOCAB, torch.device("cpu"), torch.float32)
    events, reduce = [], zero._reduce

    def logged_reduce(bucket):
        events.append("reduce")
        reduce(bucket)

    def mark(i):
        def hook(module, args, out):
            out.register_hook(lambda grad: events.append(f"block {i} backward"))
        return hook

    zero._reduce = logged_reduce
    for i, block in enumerate(model.transformer.h):
        block.register_forward_hook(mark(i))
    x = batches(1)[0]
    for _ in range(2):  # the second backward: compiled and warm
        events.clear()
        zero.backward(model(x, x)[1])
    return events


def test_gradient_collectives_overlap_backward_when_compiled():
    eager, compiled = _events(False), _events(True)
    assert compiled == eager
    # reductions are launched between the blocks' backward passes, not all after the last one
    first_block_done = compiled.index("block 0 backward")
    assert compiled[:first_block_done].count("reduce") >= 2, compiled


def test_selective_keeps_its_matmuls_when_compiled(monkeypatch):
    """--grad-ckpt selective --compile: the checkpoint is inside the compiled forward, so the
    policy decides on the traced graph's ops and keeps every matmul's output. Around a compiled
    block it saw the kernels' aten.mm.out and kept none: full's recompute, selective's name.
    What the compiled blocks save lies between eager's full and none."""
    from beyond import activation_dial
    from machinery.meter import saved_activation_bytes
    torch._dynamo.reset()  # trace afresh: the policy runs while tracing
    decisions, policy = [], activation_dial._selective

    def recording(ctx, func, *args, **kwargs):
        decisions.append((func, policy(ctx, func, *args, **kwargs)))
        return decisions[-1][1]

    monkeypatch.setattr(activation_dial, "_selective", recording)
    x, saved = batches(1)[0], {}
    for grad_ckpt, compile in (("none", False), ("full", False), ("selective", True)):
        cfg = TrainConfig(**{**SHAPE, "lora_targets": "q,v"}, grad_ckpt=grad_ckpt,
                          compile=compile)
        model, zero, _ = build(cfg, VOCAB, torch.device("cpu"), torch.float32)
        zero.backward(model(x, x)[1])  # the decisions of a run: no measuring mode around it
        n = len(decisions)
        out = [0]
        with saved_activation_bytes(model, out):
            loss = model(x, x)[1]
        zero.backward(loss)
        saved[grad_ckpt] = out[0]
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    kept = [d for f, d in decisions[:n] if f in matmuls]  # a block's graph is traced, not each
    assert len(kept) >= 4 and set(kept) == {CheckpointPolicy.MUST_SAVE}, decisions  # 4 linears
    assert not [f for f, _ in decisions[:n] if f._overloadname == "out"], decisions
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_the_loss_heads_gpu_path_compiles_whole(monkeypatch):
    """--chunked-loss --compile on a GPU: the head's fused path (forced here, on a CPU) in one
    graph, no graph break. It wrote each chunk's gradient with torch.mul(out=) into a strided
    view (the padded columns), which dynamo refuses: 2 breaks, 3 graphs, the whole head eager.
    The loss and the gradients equal the eager fused path's."""
    from beyond import chunked_loss
    from model import GPT, GPTConfig
    monkeypatch.setattr(chunked_loss, "fused_kernels", lambda logits: True)
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 24 * VOCAB)  # 3 chunks of 24 rows
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=32))
    model.cross_entropy = chunked_loss.cross_entropy  # 50 tokens in 64 padded columns
    x = torch.randn(4, 16, 32, requires_grad=True)
    targets = batches(1)[0]
    targets[0, :3] = -1  # ignored positions
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    breaks, before = sum(counters["graph_break"].values()), graphs()
    out = []
    for head in (model.head, torch.compile(model.head)):
        x.grad = model.lm_head.weight.grad = None
        loss = head(x, targets)[1]
        loss.backward()
        out.append((loss, x.grad, model.lm_head.weight.grad))
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    assert graphs() == before + 1
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-6)


def test_every_block_shares_one_graph(monkeypatch):
    """--compile on 4 blocks: one graph for the blocks (their weights are its inputs), one for
    the loss head, and no recompilation. torch 2.4 specialises a graph on each module unless
    torch._dynamo.config.inline_inbuilt_nn_modules is on (2.5's default; torchtitan#508): one
    compile a block. machinery/quirks.py turns it on where the version needs it: checked with
    2.4's version and default faked, since later versions ignore the flag."""
    import warnings
    from torch.torch_version import TorchVersion
    from machinery import quirks
    torch._dynamo.reset()
    before = graphs()
    cfg = TrainConfig(**{**SHAPE, "n_layer": 4}, compile=True)
    model, zero, _ = build(cfg, VOCAB, torch.device("cpu"), torch.float32)
    x = batches(1)[0]
    for _ in range(2):
        zero.backward(model(x, x)[1])
    assert graphs() == before + 2
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.4.1"))
    config = torch._dynamo.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the flag's deprecation, in later ones
        was, config.inline_inbuilt_nn_modules = config.inline_inbuilt_nn_modules, False
        try:
            quirks.apply(cfg, torch.device("cpu"))
            assert config.inline_inbuilt_nn_modules
        finally:
            config.inline_inbuilt_nn_modules = was
