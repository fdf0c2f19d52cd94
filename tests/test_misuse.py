"""A loop of one's own that misuses the engine (#41): every misuse either means what plain
PyTorch means (the same calls on one process, equal to 1e-6) or is refused in one line on every
rank, at every stage 0-3 on 2 gloo ranks. docs/forking.md's table is this file's ROWS."""
import functools
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

from conftest import make_zero, run_distributed
from test_any_loop import Toy, ToyBlocks, batch

STEPS = 3
# a forker's optimizers, no engine hyperparameter passed: their own settings hold
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=False)


class Plain:
    """The calls a loop makes on the engine, on one process with torch's own optimizer."""

    def __init__(self, model, optimizer):
        self.model, self.opt = model, optimizer(model.parameters())

    def finish_backward(self):
        pass

    def step(self):
        self.opt.step()

    def no_sync(self):
        return nullcontext()

    def clip_grad_norm_(self, max_norm):
        return nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


# -- the rows: one training step of a loop, written once for the engine and for one process --
# `e` is the engine or Plain; loss(micro) runs the forward of micro-step `micro`

def correct(model, e, loss):  # docs/forking.md's loop
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    e.step()


def step_without_finish(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.step()


def two_finished_backwards(model, e, loss):
    model.zero_grad()
    for micro in range(2):
        loss(micro).backward()
        e.finish_backward()
    e.step()


def two_backwards_one_finish(model, e, loss):
    model.zero_grad()
    for micro in range(2):
        loss(micro).backward()
    e.finish_backward()
    e.step()


def two_losses_then_two_backwards(model, e, loss):
    model.zero_grad()
    first, second = loss(0), loss(1)
    first.backward()
    second.backward()
    e.step()


def grad_replaced_after_finish(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    model.out.weight.grad = model.out.weight.grad * 2
    e.step()


def grad_set_after_finish(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    model.out.weight.grad = torch.full_like(model.out.weight, 0.1)
    e.step()


def grad_replaced_before_finish(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    model.out.weight.grad = model.out.weight.grad * 2
    e.finish_backward()
    e.step()


def grad_scaled_in_place(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    model.out.weight.grad.mul_(2)
    e.step()


def grad_written_through_out(model, e, loss):  # p.grad only as a keyword argument
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    torch.mul(torch.ones_like(model.out.weight), 2, out=model.out.weight.grad)
    e.step()


def zero_grad_in_place_each_step(model, e, loss):  # torch < 2.0's default, still common
    model.zero_grad(set_to_none=False)
    loss(0).backward()
    e.finish_backward()
    e.step()


def zero_grad_before_finish(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    model.zero_grad()
    e.finish_backward()
    e.step()


def zero_grad_between_micro_steps(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    model.zero_grad()  # plain PyTorch: only the second micro-step's gradient is left
    loss(1).backward()
    e.finish_backward()
    e.step()


def zero_grad_before_step(model, e, loss):
    loss(0).backward()
    e.finish_backward()
    model.zero_grad()
    e.step()


def torch_clip(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    e.step()


def torch_clip_before_finish(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    e.finish_backward()
    e.step()


def engine_clip(model, e, loss):  # the right call: zero.clip_grad_norm_, like torch's on one
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    e.clip_grad_norm_(0.05)
    e.step()


def no_sync_every_micro_step(model, e, loss):
    model.zero_grad()
    for micro in range(2):  # the last one included: the sync happens at step()
        with e.no_sync():
            loss(micro).backward()
            e.finish_backward()
    e.step()


def finish_twice(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    e.finish_backward()
    e.step()


def backward_after_clip(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    e.clip_grad_norm_(0.05)
    loss(1).backward()
    e.step()


def grad_set_between_micro_steps(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    model.out.weight.grad = torch.full_like(model.out.weight, 0.1)  # the gradient so far
    loss(1).backward()
    e.finish_backward()
    e.step()


def grad_scaled_between_micro_steps(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    model.out.weight.grad.mul_(2)
    loss(1).backward()
    e.finish_backward()
    e.step()


def backward_twice_retaining_the_graph(model, e, loss):  # one forward, its gradient twice
    model.zero_grad()
    once = loss(0)
    once.backward(retain_graph=True)
    once.backward()
    e.finish_backward()
    e.step()


def step_twice(model, e, loss):
    model.zero_grad()
    loss(0).backward()
    e.finish_backward()
    e.step()
    e.step()


# row -> None (equal to one process) or what the one-line refusal says, at every stage
ROWS = {
    correct: None,
    step_without_finish: None,
    two_finished_backwards: None,
    two_backwards_one_finish: None,
    two_losses_then_two_backwards: None,
    grad_replaced_after_finish: "out.weight.grad was",
    grad_set_after_finish: "out.weight.grad was",
    grad_replaced_before_finish: "out.weight.grad was",
    grad_scaled_in_place: "out.weight.grad was",
    grad_written_through_out: "out.weight.grad was",
    zero_grad_in_place_each_step: None,
    zero_grad_before_finish: "zero_grad",
    zero_grad_between_micro_steps: None,
    zero_grad_before_step: "zero_grad",
    torch_clip: "clip_grad_norm_",
    torch_clip_before_finish: "clip_grad_norm_",
    engine_clip: None,
    no_sync_every_micro_step: None,
    finish_twice: None,
    backward_after_clip: "backward after",
    step_twice: "no gradient since the last step",
    backward_twice_retaining_the_graph: None,
    grad_set_between_micro_steps: None,
    grad_scaled_between_micro_steps: None,
}


def losses(model, step, rank, world_size):
    """loss(micro): the forward of micro-step `micro` of `step` on this rank's slice of the
    global batch (on one process, world_size == 1 here and every rank's slice at once)."""
    def loss(micro):
        x, y = batch(10 * step + micro, rank, world_size)
        return nn.functional.cross_entropy(model(x), y)
    return loss


def one_process(row, optimizer, world_size):
    torch.manual_seed(0)
    model = ToyBlocks()
    e = Plain(model, optimizer)
    for step in range(STEPS):
        def loss(micro, step=step):
            x, y = (torch.cat(t) for t in zip(*(batch(10 * step + micro, r, world_size)
                                                 for r in range(world_size))))
            return nn.functional.cross_entropy(model(x), y)
        row(model, e, loss)
    return [p.detach().clone() for p in model.parameters()]


def weights(zero, model, stage):
    """Every parameter's full value: each rank's own at stages 0-2 (replicas must agree), rank
    0's gathered at stage 3 (every rank calls this; the others get None)."""
    if stage == 3:
        from checkpoint import state_dict
        full = state_dict(zero, model)
        return full and [full[n] for n, _ in model.named_parameters()]
    zero.wait_published()
    return [p.detach().clone() for p in model.parameters()]


def run_row(row, optimizer, stage, rank, world_size):
    """The row's loop through the engine: ('equal', max |dw| against one process),
    ('refused', the message) or ('error', another exception)."""
    torch.manual_seed(0)
    model = (ToyBlocks if stage == 3 else Toy)()
    zero = make_zero(model, stage, optimizer=optimizer, rank=rank, world_size=world_size,
                     bucket_mb=1e-4)
    try:
        for step in range(STEPS):
            row(model, zero, losses(model, step, rank, world_size))
    except RuntimeError as e:  # the engine's one line
        return "refused", str(e)
    except Exception as e:  # anything else is a traceback the loop did not deserve
        return "error", f"{type(e).__name__}: {e}"
    got, want = weights(zero, model, stage), one_process(row, optimizer, world_size)
    return "equal", max([(a - b).abs().max().item() for a, b in zip(got or [], want)] or [0.0])


# where a stage differs from ROWS: at stage 1 p.grad is the bucket's view, partly reduced
# (this rank's slice) and partly not, so it has no one value to change or keep; at stages 2-3
# p.grad is a HeldGrad
OTHERWISE = {grad_set_between_micro_steps: {1: "out.weight.grad was"},
             grad_scaled_between_micro_steps: {1: "out.weight.grad was",
                                               2: "out.weight.grad was",
                                               3: "out.weight.grad was"}}


def expected(row, stage):
    return OTHERWISE.get(row, {}).get(stage, ROWS[row])


def check_rows(rank, world_size, rows, optimizers):
    """Every row at every stage, on this rank; what went otherwise, all of it, in one assert."""
    wrong = []
    for row in rows:
        for stage in (0, 1, 2, 3):
            refusal = expected(row, stage)
            for optimizer in optimizers if refusal is None else optimizers[:1]:
                what, value = run_row(row, optimizer, stage, rank, world_size)
                if refusal is None:
                    right = what == "equal" and value <= 1e-6
                else:
                    right = what == "refused" and refusal in value and "\n" not in value
                if not right:
                    wrong.append((row.__name__, optimizer.func.__name__, stage, what, value))
    assert not wrong, "\n".join(map(str, wrong))


@pytest.mark.slow
def test_every_misuse_means_one_process_or_one_line_at_every_stage():
    run_distributed(check_rows, 2, list(ROWS), [SGD, ADAMW])


def docs_blocks():
    """docs/forking.md's loop (the first python block of "The engine in your own loop") and its
    WholeZeRO line (the first of "Any optimizer")."""
    import os
    import re
    from conftest import ROOT
    text = open(os.path.join(ROOT, "docs", "forking.md"), encoding="utf-8").read()
    first = lambda title: re.search(r"```python\n(.*?)```", text[text.index(title):], re.S)[1]
    return first("## The engine in your own loop"), first("## Any optimizer")


def plain_loop(optimizer, world_size):
    """The docs' loop on one process: torch's optimizer, the global batch."""
    torch.manual_seed(0)
    model = Toy()
    opt = optimizer(model.parameters())
    for step in range(STEPS):
        model.zero_grad()
        x, y = (torch.cat(t) for t in zip(*(batch(step, r, world_size)
                                             for r in range(world_size))))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def check_docs_loops(rank, world_size):
    loop, whole = docs_blocks()
    env = {"MyModel": Toy, "device": "cpu", "rank": rank, "world_size": world_size,
           "batches": [batch(step, rank, world_size) for step in range(STEPS)]}
    exec(loop, env)  # the loop as the page shows it: AdamW(lr=3e-4, weight_decay=0.1)
    env["zero"].wait_published()
    want = plain_loop(functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1),
                      world_size)
    for a, b in zip(env["model"].parameters(), want):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6)
    # WholeZeRO with Adafactor, its own lr: the page's line, then the same loop
    env.update(torch=torch)
    exec("torch.manual_seed(0)\nmodel = MyModel()\n" + whole
         + loop[loop.index("for x, y in batches:"):], env)
    env["zero"].wait_published()
    want = plain_loop(torch.optim.Adafactor, world_size)
    for a, b in zip(env["model"].parameters(), want):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6)


def test_the_docs_loops_equal_one_process():
    run_distributed(check_docs_loops, 2)
