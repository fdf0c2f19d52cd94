"""Mixed precision: the 16-bit dtypes and a dynamic loss scaler.

Micikevicius et al. 2018, "Mixed Precision Training" (ICLR): (1) the optimizer updates an fp32
master copy of the weights (an update below ~2^-11 of a weight rounds away in fp16, ~2^-8 in bf16);
(2) loss scaling: fp16 has 5 exponent bits, so gradients below 2^-24 flush to zero; multiplying the
loss by S shifts every gradient up by S (chain rule), dividing by S in fp32 before the update undoes
it; (3) sums (layer norm, softmax, loss, gradient reductions) accumulate in fp32. The masters live
in zero.py; this file holds the scaler.

bf16 has fp32's 8 exponent bits, so its gradients do not underflow and need no scale: under bf16
(and fp32) the scaler runs with a fixed scale of 1.0 but still checks every step for inf/NaN.

Dynamic loss scaling (Sec. 3.2), as torch.amp.GradScaler does it, bit for bit: start high (2^16);
a step whose gradients hold an inf/NaN is skipped and the scale halved; after growth_interval clean
steps in a row it doubles (never to inf).

Under ZeRO each rank holds only a slice of the gradients, so the found-inf flag is all-reduced
(MAX) before the decision: all ranks skip together. A rank that skipped alone would diverge, or hang
in an all-gather the others never enter. torch.amp.GradScaler does not do this for you.

A skipped step still counts as an iteration: the iteration counter and the LR schedule advance, as
with torch.amp.GradScaler in nanoGPT's train.py, so the run length and schedule do not depend on
how many steps overflowed and all ranks agree on the iteration. Log `scaler.skipped`, under bf16
too: a run whose steps are all skipped looks healthy while no weight ever moves.
"""
import math

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(name, device):
    """'fp32' / 'bf16' / 'fp16' -> torch dtype, or a ValueError saying what to do instead."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    # pre-Ampere GPUs only emulate bf16 (slowly): refuse rather than quietly run slow
    if (name == "bf16" and torch.device(device).type == "cuda"
            and not torch.cuda.is_bf16_supported(including_emulation=False)):
        raise ValueError("this GPU has no native bf16 (needs Ampere or newer): use fp16 or fp32")
    return DTYPES[name]


def _fp32(x):
    """Round a python float to the nearest fp32 value: torch keeps its scale in an fp32 tensor."""
    return torch.tensor(x, dtype=torch.float32).item()


def has_inf_or_nan(tensors):
    return any(not bool(t.isfinite().all()) for t in tensors if t is not None)


def grad_zero_frac(tensors):
    """Fraction of entries that are exactly zero. Under fp16 a rising value means that gradients
    underflow: the loss scale is too low."""
    tensors = [t for t in tensors if t is not None]
    zeros = sum(int((t == 0).sum()) for t in tensors)
    return zeros / max(1, sum(t.numel() for t in tensors))


class GradScaler:
    """Loss scaler with torch.amp.GradScaler's defaults and method names, plus the found-inf
    all-reduce. dynamic=False keeps the scale fixed (1.0 for bf16), yet still detects and skips."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, dynamic=True, process_group=None):
        assert growth_factor > 1.0 and backoff_factor < 1.0
        self._scale = _fp32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.dynamic = growth_interval, dynamic
        self.process_group = process_group
        self._growth_tracker = 0  # clean steps in a row since the scale last changed
        self._stage = {}  # id(optimizer) -> "unscaled" | "stepped", cleared by update()
        self._found = {}  # id(optimizer) -> did its gradients (on any rank) hold an inf/NaN?
        self.found_inf = False  # any inf/NaN this iteration (kept after update() for logging)
        self.skipped = False  # did the last step() skip optimizer.step()?

    def get_scale(self):
        return self._scale

    def scale(self, loss):
        # loss must be fp32 (the model upcasts logits before the cross-entropy): 2^16 overflows fp16
        return loss * self._scale

    @torch.no_grad()
    def unscale_(self, optimizer):
        """Divide the optimizer's gradients (fp32 masters, or a ZeRO rank's fp32 slice) by the
        scale in place, and agree with all ranks on whether any of them holds an inf/NaN."""
        key = id(optimizer)
        if key in self._stage:  # as torch: once per optimizer per iteration, before step()
            raise RuntimeError(f"unscale_() has already been called (stage {self._stage[key]}) "
                               "on this optimizer since the last update().")
        if not self._stage:
            self.found_inf = False  # the first optimizer of a new iteration
        params = [p for group in optimizer.param_groups for p in group["params"]]
        device = params[0].device if params else "cpu"
        found = torch.zeros(1, device=device)
        # as torch: the reciprocal in fp64, rounded to fp32, then an fp32 multiply (bit for bit)
        inv_scale = torch.full((1,), _fp32(1.0 / self._scale), device=device)
        grads = [p.grad for p in params if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):  # 1/scale would underflow them again
            raise ValueError("Attempting to unscale FP16 gradients: unscale fp32 master grads.")
        # one fused pass over all gradients, the kernel torch's own scaler runs: for each g, set
        # found if g holds an inf/NaN, then g *= inv_scale. Written as a Python loop it is
        # g.isfinite().all() and g.mul_(inv_scale) per tensor: the same result, 15x slower on CPU
        # and several kernel launches per tensor on a GPU.
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
        if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)  # PITFALLS 2
        self._found[key] = bool(found.item())
        self.found_inf = self.found_inf or self._found[key]
        self._stage[key] = "unscaled"

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step() on unscaled gradients, or None (skipped) if any rank found inf/NaN."""
        if self._stage.get(id(optimizer)) == "stepped":
            raise RuntimeError("step() has already been called since the last update().")
        if id(optimizer) not in self._stage:
            self.unscale_(optimizer)
        self._stage[id(optimizer)] = "stepped"
        self.skipped = self._found[id(optimizer)]
        return None if self.skipped else optimizer.step(*args, **kwargs)  # skip: no state changes

    def update(self):
        """Adapt the scale (torch's _amp_update_scale_); a fixed scaler only ends the iteration."""
        if not self._stage:
            raise RuntimeError("update() before unscale_() or step(): no inf checks were recorded.")
        found_inf = any(self._found.values())
        self._stage, self._found = {}, {}
        if not self.dynamic:
            return
        if found_inf:
            self._scale = _fp32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
        elif self._growth_tracker + 1 == self.growth_interval:
            grown = _fp32(self._scale * self.growth_factor)
            if math.isfinite(grown):  # an inf scale would overflow every later step
                self._scale = grown
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1

    def state_dict(self):
        # plain python numbers: torch.load(weights_only=True) reads them; keys as in torch's
        return {"scale": self._scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker, "dynamic": self.dynamic}

    def load_state_dict(self, sd):
        self._scale = float(sd["scale"])
        self.growth_factor, self.backoff_factor = sd["growth_factor"], sd["backoff_factor"]
        self.growth_interval, self._growth_tracker = sd["growth_interval"], sd["_growth_tracker"]
        self.dynamic = sd["dynamic"]
