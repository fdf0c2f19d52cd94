"""
The optimizer, built in one place: AdamW and SGD with momentum (torch's fused kernels), and Lion
(our own, a few elementwise lines). ZeRO (zero.py) hands it this rank's fp32 master slice; every
optimizer here is elementwise, so each stage can shard its state like the master weights.

  - Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization" (AdamW): two fp32 moments,
    8 bytes a parameter.
  - SGD with momentum (Polyak 1964; torch.optim.SGD): one fp32 buffer, 4 bytes a parameter.
  - Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms" (Lion), Algorithm 2: the
    update is the sign of an interpolation of the momentum and the gradient, one buffer, 4 bytes.

The ZeRO paper's (2 + 2 + K)Ψ takes its K from here: the fp32 master (4 bytes, 16-bit runs
only) plus STATE_BYTES. Every optimizer skips a step on the device when `found_inf` (a device
tensor, set on the optimizer as torch.amp.GradScaler sets it) is 1: the weights, the state and
any step count stay exactly as they were, and nothing waits for the device.

Start-up makes the state by the optimizer's own code, not with hand-written keys: one step that
found_inf skips (init_state). Checkpoints then save every state tensor by its key.
"""
import torch

OPTIMIZERS = ("adamw", "sgd", "lion")
STATE_BYTES = {"adamw": 8, "sgd": 4, "lion": 4}  # fp32 optimizer state per parameter


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2) with decoupled weight decay:
        update = sign(beta1 * m + (1 - beta1) * g)
        p      = p - lr * (update + weight_decay * p)
        m      = beta2 * m + (1 - beta2) * g
    The sign gives every coordinate a step of exactly lr: take a learning rate 3-10x smaller
    than AdamW's (the paper, Sec. 5), and a larger weight decay to keep lr * wd alike."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.found_inf = None

    @torch.no_grad()
    def step(self):
        skip = self.found_inf  # a device tensor: 1.0 skips the step, read by no one here
        keep = None if skip is None else 1.0 - skip
        for group in self.param_groups:
            (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if skip is None else torch.where(skip > 0, 0.0, p.grad)  # inf * 0
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = torch.lerp(g, m, beta1).sign_()  # beta1 * m + (1 - beta1) * g
                step = lr if keep is None else lr * keep  # 0 on a skipped step: p unchanged
                if wd:
                    p.mul_(1 - step * wd)
                p.add_(update * -step)
                m.add_((g - m) * ((1 - beta2) if keep is None else (1 - beta2) * keep))


def build(name, groups, lr, betas, eps):
    """The optimizer `name` over param groups (each with its weight_decay). betas: AdamW's and
    Lion's (beta1, beta2); SGD takes beta1 as its momentum."""
    if name == "adamw":  # fused: one multi-tensor kernel for the update, and it takes found_inf
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    if name == "sgd":  # weight decay as torch's SGD has it: coupled, added to the gradient
        return torch.optim.SGD(groups, lr=lr, momentum=betas[0], fused=True)
    if name == "lion":
        return Lion(groups, lr=lr, betas=betas)
    raise ValueError(f"unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")


@torch.no_grad()
def init_state(opt, params):
    """Make the optimizer's state now, by its own code: one step on zero gradients that
    found_inf skips. The kernels create what they keep (AdamW's moments and step count, SGD's
    momentum buffer, Lion's exp_avg) and change nothing else. SGD's fused kernel leaves a new
    momentum buffer unwritten on a skipped step (torch makes it with empty_like): zeroed here,
    which with dampening 0 is what its first real step would put there."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.found_inf = torch.ones((), dtype=torch.float32, device=params[0].device)
    opt.step()
    opt.found_inf = None
    for p in params:
        p.grad = None
        for key, t in opt.state[p].items():
            if torch.is_tensor(t) and t.dim() > 0:
                t.zero_()


def state_keys(opt, param):
    """The names of the per-element state tensors the optimizer keeps for param."""
    return sorted(k for k, t in opt.state[param].items() if torch.is_tensor(t) and t.dim() > 0)


def step_count(opt, param):
    """The optimizer's step count for param (AdamW's "step"), or None if it keeps none."""
    t = opt.state[param].get("step")
    return None if t is None else int(t.item())


def set_step_count(opt, params, step):
    """A resumed step count (AdamW's bias correction needs it), where the optimizer keeps one."""
    for p in params:
        if "step" in opt.state[p]:
            opt.state[p]["step"].fill_(step)
