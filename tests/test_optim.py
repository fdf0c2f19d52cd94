"""The pluggable optimizer (optim.py, beyond/lion.py): Lion against its paper's update, written out; every
optimizer skipping a step on the device exactly; the state made by the optimizer's own code;
and --optimizer sgd / lion through ZeRO stages 0-3 on 2 ranks: k steps + save + resume + k
steps == 2k steps bitwise, model state == the ZeRO paper's (2 + 2 + K)Ψ with the optimizer's K,
and a resume under another optimizer refused in one line."""
import pytest
import torch

import checkpoint
from machinery import checked_ckpt
import optim
from beyond.lion import Lion
from beyond.muon import MuonAdamW
from conftest import make_zero, run_distributed, zero_step
from data.loader import get_batch
from precision import GradScaler
from test_zero import B, DATA, SEED, T, make_model
from zero import zero_formula
from configurator import UserError


def lion_reference(p, g, m, lr, betas, wd):
    """Chen et al. 2023, Algorithm 2, one tensor, plainly."""
    c = betas[0] * m + (1 - betas[0]) * g
    p = p - lr * (torch.sign(c) + wd * p)
    m = betas[1] * m + (1 - betas[1]) * g
    return p, m


def test_lion_is_the_papers_update_and_skips_exactly():
    torch.manual_seed(0)
    p = torch.randn(50)
    opt = Lion([{"params": [p], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.99))
    ref_p, ref_m = p.clone(), torch.zeros(50)
    for step in range(4):
        g = torch.randn(50)
        p.grad = g.clone()
        opt.step()
        ref_p, ref_m = lion_reference(ref_p, g, ref_m, 1e-2, (0.9, 0.99), 0.1)
        torch.testing.assert_close(p, ref_p, rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_m, rtol=0, atol=1e-7)
    before, m = p.clone(), opt.state[p]["exp_avg"].clone()
    p.grad = torch.full((50,), float("inf"))  # an overflowed step: found_inf skips it
    opt.found_inf = torch.ones(())
    opt.step()
    assert torch.equal(p, before) and torch.equal(opt.state[p]["exp_avg"], m)


def lion_per_tensor(ps, ms, lr, betas, wd, skip):
    """Lion's step one tensor at a time, as it was before its foreach form."""
    keep = None if skip is None else 1.0 - skip
    for p, m in zip(ps, ms):
        g = p.grad if skip is None else torch.where(skip > 0, 0.0, p.grad)
        update = torch.lerp(g, m, betas[0]).sign_()
        step = lr if keep is None else lr * keep
        if wd:
            p.mul_(1 - step * wd)
        p.add_(update * -step)
        m.add_((g - m) * ((1 - betas[1]) if keep is None else (1 - betas[1]) * keep))


def test_lions_step_is_multi_tensor_and_bitwise_the_per_tensor_one():
    """Lion steps a group's tensors with torch._foreach_* (one kernel a line of the update on a
    GPU, not one a tensor): no per-tensor lerp, sign or add is dispatched, and the weights and
    momenta equal the per-tensor arithmetic bitwise, through a skipped step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    ps = [torch.randn(n) for n in (5, 7, 9)]
    ref, ref_m = [p.clone() for p in ps], [torch.zeros_like(p) for p in ps]
    opt = Lion([{"params": ps, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.99))
    for skip in (None, torch.zeros(()), torch.ones(()), torch.zeros(())):
        for p, r in zip(ps, ref):  # a skipped step's gradients overflowed
            p.grad = torch.full_like(p, float("inf")) if skip else torch.randn_like(p)
            r.grad = p.grad.clone()
        opt.found_inf, seen = skip, []
        with Ops():
            opt.step()
        lion_per_tensor(ref, ref_m, 1e-2, (0.9, 0.99), 0.1, skip)
        assert all(torch.equal(p, r) for p, r in zip(ps, ref))
        assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(ps, ref_m))
        assert not {"lerp", "sign_", "add_"} & set(seen) and seen.count("_foreach_lerp") == 1


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_state_is_made_by_the_optimizer_and_a_first_skip_changes_nothing(name):
    """init_state makes what the optimizer keeps (its own keys) and changes nothing: after it,
    the first real steps equal a fresh optimizer's. fused SGD's buffer made by a skipped step
    is garbage until zeroed (the case a first fp16 overflow would hit)."""
    torch.manual_seed(0)
    grads = [torch.randn(20) for _ in range(3)]
    runs = []
    for init in (False, True):
        p = torch.ones(20)
        groups, hyper = [{"params": [p], "weight_decay": 0.0}], dict(lr=1e-2, betas=(0.9, 0.95),
                                                                    eps=1e-8)
        # Muon's is built with its layout (beyond/muon.py's WholeZeRO), AdamW on a 1-D tensor
        opt = MuonAdamW(groups, **hyper) if name == "muon" else \
            Lion(groups, lr=1e-2, betas=(0.9, 0.95)) if name == "lion" else \
            optim.build(name, groups, **hyper)
        if init:
            optim.init_state(opt, [p])
            assert checkpoint.opt_state_keys(opt, p) == {"adamw": ["exp_avg", "exp_avg_sq"],
                                                "sgd": ["momentum_buffer"],
                                                "lion": ["exp_avg"],  # muon: AdamW for
                                                "muon": ["exp_avg", "exp_avg_sq"]}[name]  # 1-D
            assert torch.equal(p, torch.ones(20))
        for g in grads:
            p.grad = g.clone()
            opt.step()
        runs.append(p.clone())
    assert torch.equal(runs[0], runs[1])


def _resume_and_state(rank, world_size, tmp):
    header = {"config": {"dtype": "fp32", "loss_scale": "none"}, "meta": {"vocab_size": 13},
              "model_args": {}}
    for name in ("sgd", "lion"):
        for stage in (0, 1, 2, 3):
            def engine():
                model = make_model()
                return model, make_zero(model, stage, lr=1e-2, bucket_mb=0.002, rank=rank,
                                        world_size=world_size, optimizer=name)

            def train(model, zero, scaler, steps):
                for step in steps:
                    x, y = get_batch(DATA, SEED, step, 0, rank, world_size, B, T, 1)
                    zero.backward(model(x, y)[1])
                    zero_step(zero, scaler, 1e-2, 1.0)

            model, zero = engine()
            # the paper's (2 + 2 + K)Ψ / sharding with this optimizer's K (fp32: 4 + 4 + K)
            held, paper = zero.state_bytes(), zero_formula(zero.psi, stage, world_size,
                                                           torch.float32, name)
            pad = sum(b.numel for b in zero.buckets) - zero.psi
            assert abs(held["optimizer"] - paper["optimizer_side"]) <= 4 * pad, (name, stage)
            scaler = GradScaler(init_scale=1.0, dynamic=False)
            train(model, zero, scaler, range(6))
            whole = checkpoint.state_dict(zero, model)
            model, zero = engine()
            train(model, zero, scaler, range(3))
            out = f"{tmp}/{name}{stage}"
            fmt = "sharded" if stage % 2 else "consolidated"
            path = checked_ckpt.save(out, 3, zero, model, scaler, header, fmt, 1)
            model, zero = engine()
            checked_ckpt.restore(path, zero, model, scaler, {"optimizer": name}, {}, None)
            train(model, zero, scaler, range(3, 6))
            resumed = checkpoint.state_dict(zero, model)
            if rank == 0:
                for k in whole:
                    assert torch.equal(whole[k], resumed[k]), (name, stage, k)
            if stage == 3:  # another optimizer cannot carry this state on
                _, other = engine()
                with pytest.raises(UserError, match="--optimizer"):
                    checked_ckpt.restore(path, other, model, scaler, {"optimizer": "adamw"},
                                         {}, None)


def test_sgd_and_lion_resume_bitwise_at_every_stage(tmp_path):
    run_distributed(_resume_and_state, 2, str(tmp_path))
