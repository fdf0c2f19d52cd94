"""
Lion: the sign of an interpolation of momentum and gradient, one fp32 buffer a parameter (4
bytes: optim.STATE_BYTES). Built by optim.build("lion").

  - Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2
"""
import torch


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2) with decoupled weight decay:
        update = sign(beta1 * m + (1 - beta1) * g)
        p      = p - lr * (update + weight_decay * p)
        m      = beta2 * m + (1 - beta2) * g
    The sign gives every coordinate a step of exactly lr: take a learning rate 3-10x smaller
    than AdamW's (the paper, Sec. 5), and a larger weight decay to keep lr * wd alike."""
    _step_supports_amp_scaling = True  # reads found_inf: skips on the device
    elementwise = True  # every element alone: zero.py may step flat pieces of buckets

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.found_inf = None

    @torch.no_grad()
    def step(self):
        """The update above, each line one multi-tensor kernel over a group's tensors
        (torch._foreach_*: the same arithmetic, element for element, in fewer launches)."""
        skip = self.found_inf  # a device tensor: 1.0 skips the step, read by no one here
        keep, gone = (None, None) if skip is None else (1.0 - skip, skip > 0)
        for group in self.param_groups:
            (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            # a skipped step's inf/NaN gradient made 0 (inf * 0 is NaN): one kernel a tensor,
            # there is no foreach where
            gs = [p.grad if skip is None else torch.where(gone, 0.0, p.grad) for p in ps]
            ms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in ps]
            update = torch._foreach_lerp(gs, ms, beta1)  # beta1 * m + (1 - beta1) * g
            torch._foreach_sign_(update)
            step = lr if keep is None else lr * keep  # 0 on a skipped step: p unchanged
            if wd:
                torch._foreach_mul_(ps, 1 - step * wd)
            torch._foreach_mul_(update, -step)
            torch._foreach_add_(ps, update)
            diff = torch._foreach_sub(gs, ms)  # m += (g - m) * (1 - beta2)
            torch._foreach_mul_(diff, (1 - beta2) if keep is None else (1 - beta2) * keep)
            torch._foreach_add_(ms, diff)
