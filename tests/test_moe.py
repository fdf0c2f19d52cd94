"""A Mixture of Experts in a loop of one's own (#50): tests/moe.py's blocks return (hidden,
router_logits), a balance loss reads every block's router, and an expert no token chose has no
gradient. Each row is one training step of a forker's loop, at stages 0-3 on 2 gloo ranks:
equal to one process (to 1e-6) or refused in one line on every rank. docs/forking.md's
contract table is these rows."""
import functools

import pytest
import torch
import torch.nn as nn

import checkpoint
from machinery import checked_ckpt
from conftest import make_zero, run_distributed
from moe import Expert, MoEConfig, TinyMoE, moe_batch

STEPS = 4
# weight decay and momentum: an expert stepped with a zero gradient still moves
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=False)


class Plain:
    """The calls a loop makes on the engine, on one process with torch's own optimizer.
    unused="zero": a parameter without a gradient is stepped with zeros, as DDP (and the
    engine by default) steps it; "skip": not stepped, as plain PyTorch."""

    def __init__(self, model, unused):
        self.model, self.unused = model, unused
        self.optimizer = ADAMW(model.parameters())
        self.idle = 0  # steps in which some parameter had no gradient anywhere

    def finish_backward(self):
        pass

    def step(self):
        idle = [p for p in self.model.parameters() if p.requires_grad and p.grad is None]
        self.idle += bool(idle)
        for p in idle if self.unused == "zero" else ():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()


# -- the rows: one step of a loop, for the engine and for one process alike ----------------------
# loss(apart) runs this rank's forward: the summed loss, or (lm, balance) apart; `kept` carries
# what a row keeps from step to step (a scheduler)

def summed(model, e, loss, step, kept):  # docs/forking.md's loop
    model.zero_grad()
    loss().backward()
    e.finish_backward()
    e.step()


def lm_then_balance(model, e, loss, step, kept):
    model.zero_grad()
    lm, balance = loss(apart=True)
    lm.backward(retain_graph=True)
    (model.config.balance * balance).backward()
    e.step()


def balance_then_lm(model, e, loss, step, kept):
    model.zero_grad()
    lm, balance = loss(apart=True)
    (model.config.balance * balance).backward(retain_graph=True)
    lm.backward()
    e.step()


def expert_frozen_mid_run(model, e, loss, step, kept):
    if step == 1:
        model.layers[0].experts[1].requires_grad_(False)
    summed(model, e, loss, step, kept)


def expert_replaced_mid_run(model, e, loss, step, kept):
    if step == 1:
        torch.manual_seed(1)
        model.layers[0].experts[0] = Expert(model.config)
    summed(model, e, loss, step, kept)


def parameter_added_mid_run(model, e, loss, step, kept):
    if step == 1:
        model.layers[1].gain = nn.Parameter(torch.ones(()))
    summed(model, e, loss, step, kept)


def router_unfrozen_mid_run(model, e, loss, step, kept):
    if step == 1:
        model.layers[0].router.requires_grad_(True)
    summed(model, e, loss, step, kept)


router_unfrozen_mid_run.before = lambda model: model.layers[0].router.requires_grad_(False)


def added_then_saved(model, e, loss, step, kept):
    summed(model, e, loss, step, kept)
    if step == 1:
        model.layers[1].gain = nn.Parameter(torch.ones(()))
        checkpoint.save(kept["tmp"], step, e, model)


def scheduled(model, e, loss, step, kept):
    if step == 0:
        kept["schedule"] = torch.optim.lr_scheduler.StepLR(e.optimizer, 1, gamma=0.5)
    summed(model, e, loss, step, kept)
    kept["schedule"].step()


def optimizer_stepped_behind_the_engine(model, e, loss, step, kept):
    model.zero_grad()
    loss().backward()
    e.finish_backward()
    e.optimizer.step()


# row -> None (equal to one process) or what its one line says, at every stage. row.before(model),
# if there is one, runs before the engine is built
ROWS = {
    summed: None,
    lm_then_balance: None,
    balance_then_lm: None,
    expert_frozen_mid_run: None,
    expert_replaced_mid_run: "layers.0.experts.0.up.weight was replaced after the engine",
    parameter_added_mid_run: "layers.1.gain was added after the engine",
    router_unfrozen_mid_run: "layers.0.router.weight was made trainable after the engine",
    added_then_saved: "layers.1.gain was added after the engine",
    scheduled: None,
    optimizer_stepped_behind_the_engine: "outside zero.step()",
}


BOTH = (summed, expert_frozen_mid_run)  # run with unused="skip" too: idle experts, a frozen one


def losses(model, step, ranks, world_size):
    """loss(apart): the forward of `ranks`' slices of step's global batch, each apart (a balance
    loss is a statistic of its batch: DDP's is each rank's), their mean."""
    def loss(apart=False):
        every = [model(*moe_batch(step, r, world_size), apart=apart)[1] for r in ranks]
        if apart:
            return tuple(sum(parts) / len(ranks) for parts in zip(*every))
        return sum(every) / len(ranks)
    return loss


@functools.cache
def one_process(row, unused, world_size, tmp):
    torch.manual_seed(0)
    model = TinyMoE()
    getattr(row, "before", lambda model: None)(model)
    e, kept = Plain(model, unused), {"tmp": tmp}
    for step in range(STEPS):
        row(model, e, losses(model, step, range(world_size), world_size), step, kept)
    return model.state_dict(), e.idle


def run_row(row, unused, stage, rank, world_size, tmp):
    """('equal', max |dw| against one process), ('refused', the message) or ('error', ...)."""
    torch.manual_seed(0)
    model = TinyMoE()
    getattr(row, "before", lambda model: None)(model)  # what the model is when the engine is built
    zero = make_zero(model, stage, optimizer=ADAMW, rank=rank, world_size=world_size,
                     bucket_mb=2e-3, unused=unused)
    kept = {"tmp": f"{tmp}/{row.__name__}{stage}"}
    try:
        for step in range(STEPS):
            row(model, zero, losses(model, step, [rank], world_size), step, kept)
        got = checkpoint.state_dict(zero, model)  # rank 0's, the others None
    except RuntimeError as e:  # the engine's one line
        return "refused", str(e)
    except Exception as e:  # anything else is a traceback the loop did not deserve
        return "error", f"{type(e).__name__}: {e}"
    if ROWS[row] is not None:
        return "ran", "without its line"
    want, idle = one_process(row, unused, world_size, tmp)
    if row is summed:  # the rows test what they claim: an expert idle in some step, everywhere
        assert idle > 0
    return "equal", max([(got[k] - want[k]).abs().max().item() for k in got or {}] or [0.0])


def check_memory(rank, world_size):
    """memory.py's model state for a model with no activation formula (tests/moe.py declares
    none) = what the engine holds, at every stage: the activations alone are unknown."""
    from machinery.footprint import estimate
    for stage in (0, 1, 2, 3):
        e = estimate(MoEConfig(), world_size, stage, "fp32", rank=rank, build=TinyMoE)
        assert e["activations"]["missing"].startswith("memory.py counts activations")
        torch.manual_seed(0)
        zero = make_zero(TinyMoE(), stage, rank=rank, world_size=world_size)
        assert e["state"]["total"] == zero.state_bytes()["total"], stage


def check_rows(rank, world_size, rows, tmp):
    check_memory(rank, world_size)
    wrong = []
    for row in rows:
        for stage in (0, 1, 2, 3):
            for unused in ("zero", "skip") if row in BOTH else ("zero",):
                what, value = run_row(row, unused, stage, rank, world_size, tmp)
                if ROWS[row] is None:
                    right = what == "equal" and value <= 1e-6
                else:
                    right = what == "refused" and ROWS[row] in value and "\n" not in value
                if not right:
                    wrong.append((row.__name__, unused, stage, what, value))
    assert not wrong, "\n".join(map(str, wrong))


@pytest.mark.slow
def test_a_mixture_of_experts_loop_means_one_process_or_one_line_at_every_stage(tmp_path):
    """The rows, and memory.py's model state for the MoE (check_memory)."""
    run_distributed(check_rows, 2, list(ROWS), str(tmp_path))


@pytest.mark.compiles
def test_what_the_engine_is_built_on_is_checked_in_one_line(tmp_path):
    """A model compiled whole before ZeRO-3 is built (its hooks would be traced: torch's storage
    error), or after a stage 1-3 engine is (a dynamo RecursionError); unused= other than "zero"
    or "skip"; a checkpoint of another model restored in a loop of one's own says what a loop
    can do, not train.py's flags alone."""
    with pytest.raises(ValueError, match="compile each block's forward instead"):
        make_zero(torch.compile(TinyMoE()), 3)
    model = TinyMoE()
    make_zero(model, 1)
    with pytest.raises(RuntimeError, match="compile each block's forward instead"):
        torch.compile(model)(*moe_batch(0))
    with pytest.raises(ValueError, match="unused='none'"):
        make_zero(TinyMoE(), 0, unused="none")
    from configurator import UserError
    torch.manual_seed(0)
    model = TinyMoE()
    path = checked_ckpt.save(str(tmp_path), 1, make_zero(model, 0), model)
    other = TinyMoE(MoEConfig(n_expert=4))
    with pytest.raises(UserError, match="build the model it was saved from"):
        checked_ckpt.restore(path, make_zero(other, 0), other)


def mid_run_change(model):
    """The change: a fresh expert, and a gain that nothing reads."""
    torch.manual_seed(1)
    model.layers[0].experts[0] = Expert(model.config)
    model.layers[1].gain = nn.Parameter(torch.ones(()))


def check_mid_run_recipe(rank, world_size):
    """The surgery line's recipe, mid-run: checkpoint.state_dict before the change, loaded into
    a new model on rank 0, the change, a new engine with broadcast_from=0 (its optimizer state
    new) = one process that builds a new torch optimizer there, at stages 0 and 3."""
    for stage in (0, 3):
        torch.manual_seed(0)
        model, plain = TinyMoE(), TinyMoE()
        plain.load_state_dict(model.state_dict())
        zero, e = make_zero(model, stage, optimizer=ADAMW, rank=rank, world_size=world_size), \
            Plain(plain, "zero")
        for step in range(4):
            if step == 2:  # the change
                full = checkpoint.state_dict(zero, model)  # rank 0's
                model = TinyMoE()
                if rank == 0:
                    model.load_state_dict(full)
                mid_run_change(model)
                zero = make_zero(model, stage, optimizer=ADAMW, rank=rank,
                                 world_size=world_size, broadcast_from=0)
                mid_run_change(plain)
                e = Plain(plain, "zero")
            summed(model, zero, losses(model, step, [rank], world_size), step, {})
            summed(plain, e, losses(plain, step, range(world_size), world_size), step, {})
        got, want = checkpoint.state_dict(zero, model), plain.state_dict()
        for k, v in (got or {}).items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=1e-6, msg=(stage, k))


def test_the_mid_run_change_the_line_names_equals_one_process():
    run_distributed(check_mid_run_recipe, 2)
