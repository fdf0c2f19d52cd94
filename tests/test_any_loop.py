"""The engine as a forker uses it (#28): in a plain PyTorch loop (model.zero_grad() with its
default set_to_none, loss.backward(), finish_backward(), step()), on a model that is not a GPT,
with torch's own optimizers, against one process with the same optimizer; gradients that are
not the bucket's views are reduced, not dropped; an fp32 master seeded from fp32 values; ranks
that start apart refused in one line."""
import functools

import pytest
import torch
import torch.nn as nn

from conftest import make_zero, run_distributed, zero_step
from precision import GradScaler
from machinery.engines import WholeZeRO, ZeRO, ZeRO3

STEPS, B, D = 4, 4, 8


class Toy(nn.Module):
    """Not a GPT: no transformer.h, no blocks(), a loss of its own."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(3)])
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


class ToyBlocks(Toy):
    """ZeRO-3 gathers a block at a time: the toy declares its blocks."""

    def blocks(self):
        return list(self.layers)


def batch(step, rank=0, world_size=1):
    """This rank's slice of the global batch of step (world_size * B rows)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(world_size * B, D, generator=g), torch.randint(0, 3, (world_size * B,),
                                                                       generator=g)
    return x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]


OPTIMIZERS = {"sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
              "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0,
                                         fused=False),
              # factors each matrix's statistics and scales by whole-tensor norms
              "adafactor": functools.partial(torch.optim.Adafactor, lr=1e-2)}


def one_process(name, world_size):
    """The same optimizer in one process, on the global batch: every rank's slice."""
    torch.manual_seed(0)
    model = ToyBlocks()
    opt = OPTIMIZERS[name](model.parameters())
    for step in range(STEPS):
        model.zero_grad()
        x, y = (torch.cat(t) for t in zip(*(batch(step, r, world_size)
                                             for r in range(world_size))))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_plain_loop(rank, world_size):
    """The loop a forker writes, at every stage, with torch.optim.SGD, AdamW(fused=False) and
    Adafactor: equal to one process with the same optimizer, to 1e-6 (fp32). Adafactor goes to
    beyond/muon.py's WholeZeRO, dealt whole tensors at stages 1-2 (tensors of a shape N a
    bucket, or all in one; either way every rank owns some), and to its WholeZeRO3 at stage 3,
    each unit's tensors dealt whole."""
    runs = [(name, stage, 1e-4) for name in OPTIMIZERS for stage in (0, 1, 2, 3)]
    for name, stage, bucket_mb in runs + [("adafactor", 1, 1.0), ("adafactor", 2, 1.0)]:
        want = one_process(name, world_size)
        torch.manual_seed(0)
        model = (ToyBlocks if stage == 3 else Toy)()
        zero = make_zero(model, stage, optimizer=OPTIMIZERS[name], weight_decay=0.0,
                         rank=rank, world_size=world_size, bucket_mb=bucket_mb)
        if name == "adafactor":  # whole tensors, and which rank owns how many
            assert all(s.whole for s in zero.segments)
            every = [len(zero.segments)] * world_size
            if world_size > 1:
                torch.distributed.all_gather_object(every, len(zero.segments))
            owners = sum(n > 0 for n in every)
            assert sum(every) == (8 * world_size if stage == 0 else 8)
            assert owners == world_size, every
        for step in range(STEPS):
            model.zero_grad()  # set_to_none, PyTorch's default
            x, y = batch(step, rank, world_size)
            nn.functional.cross_entropy(model(x), y).backward()
            zero.finish_backward()
            zero.step()  # the optimizer's own lr; published before the next forward
        if stage == 3:
            from checkpoint import state_dict
            full = state_dict(zero, model)
            got = [full[n] for n, _ in model.named_parameters()] if rank == 0 else None
        else:
            zero.wait_published()
            got = [p.detach() for p in model.parameters()]
        for a, b in zip(got or [], want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=(name, stage, bucket_mb))


def test_a_plain_loop_with_torch_optimizers_equals_one_process():
    run_distributed(check_plain_loop, 2)


def adafactor_run(stage, rank, world_size, steps, path=None, save=None):
    """Adafactor through the engine, in one bucket (every rank owns some whole tensors), on
    steps; restored from path first, saved in format save after. Returns the master weights."""
    import checkpoint
    from machinery import checked_ckpt
    torch.manual_seed(0)
    model = (ToyBlocks if stage == 3 else Toy)()  # the same tensors, by the same names
    zero = make_zero(model, stage, optimizer=OPTIMIZERS["adafactor"], weight_decay=0.0,
                     rank=rank, world_size=world_size, bucket_mb=1.0)
    scaler, header = GradScaler(init_scale=1.0, dynamic=False), \
        {"config": {"dtype": "fp32", "loss_scale": "none"}, "meta": {}, "model_args": {}}
    if path:
        checked_ckpt.restore(path, zero, model, scaler, {}, {}, None)
    for step in steps:  # the global batch of 2 ranks: on one rank, all of it
        model.zero_grad()
        x, y = (torch.cat(t) for t in zip(*(batch(step, r, 2) for r in range(2)
                                            if world_size == 1 or r == rank)))
        nn.functional.cross_entropy(model(x), y).backward()
        zero.finish_backward()
        zero.step()
    if save:
        return checked_ckpt.save(save[0], steps[-1] + 1, zero, model, scaler, header,
                                 save[1], 1)
    return checkpoint.state_dict(zero, model)


def check_adafactor_resume(rank, world_size, tmp):
    """Adafactor's per-tensor statistics (a row and a column mean a matrix, not per element)
    survive a checkpoint: k + save + resume + k == 2k bitwise, consolidated and sharded, at
    every stage (ZeRO-3: beyond/muon.py's WholeZeRO3, each unit's tensors dealt whole)."""
    half = STEPS // 2
    for stage in (0, 1, 2, 3):
        want = adafactor_run(stage, rank, world_size, range(STEPS))
        for fmt in ("consolidated", "sharded"):
            out = f"{tmp}/n{world_size}s{stage}{fmt}"
            path = adafactor_run(stage, rank, world_size, range(half), save=(out, fmt))
            got = adafactor_run(stage, rank, world_size, range(half, STEPS), path=path)
            for k in want or {}:
                assert torch.equal(want[k], got[k]), (stage, fmt, k)
    if rank == 0:
        torch.save(want, f"{tmp}/want.pt")


def test_adafactor_resumes_exactly_and_on_another_world_size(tmp_path):
    run_distributed(check_adafactor_resume, 2, str(tmp_path))
    want = torch.load(tmp_path / "want.pt")  # 2 ranks, stage 3, STEPS steps
    for stage, other in ((1, 2), (2, 1), (3, 2), (3, 0)):  # resumed by one rank, another stage
        path = f"{tmp_path}/n2s{stage}sharded/ckpt-{STEPS // 2:07d}"
        got = adafactor_run(other, 0, 1, range(STEPS // 2, STEPS), path=path)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=(stage, k))


def check_set_to_none(rank, world_size):
    """Stages 0-1 reduce the bucket their gradients are views of: a p.grad made afresh after
    model.zero_grad() (set_to_none) is copied in, with the lecture's own calls too."""
    for stage in (0, 1):
        want = one_process("sgd", world_size)
        torch.manual_seed(0)
        model = Toy()
        zero = make_zero(model, stage, optimizer="sgd", betas=(0.9, 0.95), weight_decay=0.0,
                         rank=rank, world_size=world_size)  # SGD's momentum: beta1
        scaler = GradScaler(init_scale=1.0, dynamic=False)
        for step in range(STEPS):
            model.zero_grad()
            x, y = batch(step, rank, world_size)
            zero.backward(nn.functional.cross_entropy(model(x), y))
            zero_step(zero, scaler, 0.1, 0.0)
        for a, b in zip(model.parameters(), want):
            torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6, msg=stage)


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradients_set_to_none_are_reduced_not_dropped(world_size):
    run_distributed(check_set_to_none, world_size)


def test_a_gradient_replaced_after_backward_is_refused_not_ignored():
    model = Toy()
    zero = ZeRO(model, 0, optimizer=OPTIMIZERS["sgd"])
    x, y = batch(0)
    nn.functional.cross_entropy(model(x), y).backward()
    zero.finish_backward()
    model.out.weight.grad = model.out.weight.grad * 2  # a new tensor: the bucket never sees it
    with pytest.raises(RuntimeError, match="out.weight.grad was replaced after loss.backward()"):
        zero.step()


def test_optimizers_by_name_class_and_function_and_the_skip():
    """torch's for-loop AdamW (which refuses found_inf) skips an inf step through the engine;
    Adafactor, a class, factors the whole matrices WholeZeRO's stage 0 hands it and equals one
    process; lr=None keeps the optimizer's own."""
    torch.manual_seed(0)
    model = Toy()
    zero = ZeRO(model, 0, optimizer=OPTIMIZERS["adamw"], weight_decay=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    nn.functional.cross_entropy(model(x), y).backward()
    zero.finish_backward()
    zero.step(found_inf=torch.ones(()))  # an overflow: skipped, nothing moved
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    runs = []
    for engine in (False, True):
        torch.manual_seed(0)
        model = Toy()
        if engine:
            zero = WholeZeRO(model, 0, optimizer=torch.optim.Adafactor, weight_decay=0.0,
                             lr=1e-2)
            assert zero.opt.param_groups[0]["lr"] == 1e-2 and zero.optimizer_name == "Adafactor"
        else:
            opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.0)
        for step in range(STEPS):
            model.zero_grad()
            x, y = batch(step)
            nn.functional.cross_entropy(model(x), y).backward()
            if engine:
                zero.finish_backward()
                zero.step()
            else:
                opt.step()
        if engine:
            zero.wait_published()
            assert any("row_var" in st for st in zero.opt.state.values())  # a matrix, whole
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def check_doors(rank, world_size):
    """Ranks seeded apart: refused in one line, or rank 0's weights on every rank with
    broadcast_from=0 (as DDP), training as one process from rank 0's model. The parameters
    instead of a module (torch's ZeroRedundancyOptimizer(params, ...)): a loop of
    zero_grad(), backward(), step() equals one process at stages 0-2, weights published."""
    sgd = OPTIMIZERS["sgd"]
    torch.manual_seed(rank)  # each rank its own seed: a fork that forgot to seed alike
    with pytest.raises(ValueError, match="rank 1 holds other initial weights than rank 0"):
        ZeRO(Toy(), 1, rank=rank, world_size=world_size)
    for stage, params in ((0, False), (1, True), (2, False), (2, True)):
        torch.manual_seed(rank if not params else 0)
        model = Toy()
        zero = ZeRO(model.parameters() if params else model, stage, optimizer=sgd, rank=rank,
                    world_size=world_size, broadcast_from=None if params else 0)
        for step in range(STEPS):
            model.zero_grad()
            x, y = batch(step, rank, world_size)
            nn.functional.cross_entropy(model(x), y).backward()
            zero.step()  # finishes the backward; with parameters, publishes at once
        if not params:
            zero.wait_published()
        for a, b in zip(model.parameters(), one_process("sgd", world_size)):
            torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6, msg=(stage, params))


def test_the_engines_doors():
    """The ways in a forker expects, each a tested one line where it is not taken: ranks
    apart and broadcast_from, parameters for a module (run on 2 ranks), ZeRO(model, 3)
    naming the stage-3 engine, a class or a function of the groups given its own settings,
    Muon on a model without blocks()."""
    run_distributed(check_doors, 2)
    with pytest.raises(ValueError, match="declare Toy.blocks()"):
        make_zero(Toy(), 3)
    with pytest.raises(ValueError, match=r"not 3: stage 3 shards the weights too, "
                       r"machinery.engines.ZeRO3"):
        ZeRO(ToyBlocks(), 3)
    with pytest.raises(ValueError, match=r"machinery.engines.WholeZeRO3 \(the same arguments\)"):
        WholeZeRO(ToyBlocks(), 3, optimizer="muon")
    from machinery.engines import WholeZeRO3, offloaded
    for Engine in (ZeRO3, WholeZeRO3, offloaded(ZeRO3)):
        with pytest.raises(ValueError, match="pass the model, not its parameters"):
            Engine(ToyBlocks().parameters(), 3)
    with pytest.raises(ValueError, match="declare Toy.blocks().*the LM head"):
        WholeZeRO(Toy(), 1, optimizer="muon")  # its head, an nn.Linear, would go to Muon
    # a class or a function: one group, the optimizer's own settings, unless asked for more
    for optimizer, wd in ((OPTIMIZERS["sgd"], 0.0), (torch.optim.AdamW, 0.01)):
        groups = ZeRO(Toy(), 1, optimizer=optimizer).opt.param_groups
        assert len(groups) == 1 and groups[0]["weight_decay"] == wd
    assert ZeRO(Toy(), 1, optimizer=torch.optim.Adagrad).opt.param_groups[0]["lr"] == 1e-2
    asked = ZeRO(Toy(), 1, optimizer=OPTIMIZERS["sgd"], weight_decay=0.1).opt.param_groups
    assert [g["weight_decay"] for g in asked] == [0.1, 0.0]  # the matrices, the rest
    own = ZeRO(Toy(), 1, optimizer=torch.optim.AdamW, decay=lambda n, p: "out" in n)
    assert [g["weight_decay"] for g in own.opt.param_groups] == [0.01, 0.0]
    named = ZeRO(Toy(), 1).opt.param_groups  # our names: the GPT policy
    assert [g["weight_decay"] for g in named] == [0.1, 0.0] and named[0]["lr"] == 1e-3


def test_an_optimizer_that_reads_whole_tensors_is_refused_by_zero_in_one_line():
    """zero.ZeRO hands flat pieces: Muon, or a class that is not elementwise (Adafactor, a
    partial's class too), is refused at every stage in one line that names WholeZeRO; an
    elementwise class or a function of the groups is stepped as flat pieces. WholeZeRO deals
    Muon's block matrices whole and anything else's every tensor."""
    for optimizer in ("muon", torch.optim.Adafactor, OPTIMIZERS["adafactor"]):
        for stage in (0, 1, 2):
            with pytest.raises(ValueError, match="steps each tensor whole, and zero.ZeRO steps "
                               "flat pieces of buckets: use machinery.engines.WholeZeRO"):
                ZeRO(Toy(), stage, optimizer=optimizer)
    assert ZeRO(Toy(), 1, optimizer=OPTIMIZERS["sgd"]).optimizer_name == "SGD"  # a partial's class
    by_function = ZeRO(Toy(), 1, optimizer=lambda g: torch.optim.SGD(g, lr=0.1))
    assert by_function.optimizer_name == "<lambda>"
    model = ToyBlocks()
    whole = WholeZeRO(model, 1, optimizer=lambda g: torch.optim.Adafactor(g, lr=1e-2))
    assert whole.dealt == {id(p) for p in model.parameters()} and not whole.matrices
    assert all(s.whole for s in whole.segments)
    muon = WholeZeRO(ToyBlocks(), 1, optimizer="muon")  # the blocks' matrices, grouped
    assert len(muon.matrices) == 3 and [g["matrices"] for g in muon.opt.param_groups] == \
        [False, False, True, True]


@pytest.mark.parametrize("fresh", [True, False])
def test_the_fp32_master_starts_at_the_fp32_values(fresh, tmp_path):
    """--bf16 from the fp32 init, and --init-from X --bf16 with X's fp32 weights: the master
    holds the fp32 values, not their bf16 rounding (which loses up to 2^-9 relative)."""
    from configurator import parse_args
    from model import GPT
    from train import build, model_config
    cfg = parse_args(["--bf16", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
                      "--block-size", "16", "--zero", "1"])
    torch.manual_seed(cfg.seed)
    source = GPT(model_config(cfg, 40)).state_dict()  # what build draws, in fp32
    weights = None
    if not fresh:  # other weights, with bits bf16 cannot hold
        weights = {k: v + 1e-4 * torch.randn_like(v) for k, v in source.items()}
        source = weights
    def init(config, device, dtype):  # machinery/run.py's, for --init-from: the weights given
        model = GPT(config)
        model.load_weights(weights)
        return model.to(device=device, dtype=dtype), weights

    _, zero, _ = build(cfg, 40, torch.device("cpu"), torch.bfloat16, init=None if fresh else init)
    rounded = 0
    for s in zero.segments:
        want = source[s.name].reshape(-1)[s.lo:s.hi]
        assert torch.equal(s.master.reshape(-1), want), s.name
        rounded += not torch.equal(want.bfloat16().float(), want)
    assert rounded >= len(zero.segments) // 2  # bf16 rounds them: the test can fail
