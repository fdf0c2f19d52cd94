"""
Mixed precision: the 16-bit dtypes and a dynamic loss scaler.

Micikevicius et al. 2018, "Mixed Precision Training", Sec. 3, three rules:
  1. The optimizer updates an fp32 master copy of the weights: an update below
     ~2^-11 of a weight rounds away in fp16, ~2^-8 in bf16. ZeRO shards it with the
     optimizer (zero.py): _new_master makes each rank's fp32 slice, master_grads casts the
     16-bit gradient slice up, step() updates the master, publish() casts it down into
     the working weights. In fp32 the weights are the master: no copy.
  2. Loss scaling: fp16 has 5 exponent bits, gradients below 2^-24 flush to zero.
     Multiply the loss by S and every gradient grows by S (the chain rule); divide
     by S in fp32 before the update. bf16 has fp32's 8 exponent bits: no scale,
     but every step is still checked for inf/NaN (a fixed scale of 1.0).
  3. Sums (norms, softmax, loss, gradient reductions) accumulate in fp32.

The dynamic scaler, as torch.amp.GradScaler, bit for bit:
  - start high (2^16); a step with an inf/NaN gradient is skipped, the scale halved
  - after growth_interval clean steps in a row it doubles (never to inf)
  - a floor, min_scale (as DeepSpeed): an overflow there is no overflow but a NaN,
    and `exhausted` stops the run; a fixed scale gives up after FIXED_GIVE_UP
    skips in a row, else a run that never moves would end "successfully"

Under ZeRO each rank holds a slice of the gradients: the found-inf flag is
all-reduced (MAX) so that all ranks skip together. A rank that skipped alone would
diverge, or hang in an all-gather the others never enter. torch.amp.GradScaler
does not do this for you.

Everything stays on the device (the scale, the counter, the flag; the optimizer
skips on the device): a step never waits for the GPU. A skipped step still counts
as an iteration, as in nanoGPT. Log the skips, under bf16 too: a run whose steps
are all skipped looks healthy but never moves.
"""
import torch
import torch.distributed as dist

from collectives import all_reduce_max

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


def set_tf32():
    """fp32 matmuls on TF32 tensor cores (Ampere and newer: 10 mantissa bits, fp32's range).
    Through torch.set_float32_matmul_precision, the API torch.compile's inductor reads: the
    per-backend one of torch 2.9 (matmul.fp32_precision) makes the legacy getters raise
    "mix of the legacy and new APIs" (pytorch#166387), and --compile with them."""
    torch.set_float32_matmul_precision("high")


class GradScaler:
    """Loss scaler for one optimizer: torch.amp.GradScaler's defaults and arithmetic, on the
    device, plus the cross-rank found-inf all-reduce and a floor. dynamic=False keeps the scale
    fixed (1.0 for bf16 and fp32), yet still finds inf/NaN so that the step is skipped.

    Per step: loss -> scale(loss) -> backward; found_inf = unscale_(fp32 grads); clip; the
    optimizer step, skipped where found_inf; update(found_inf)."""
    FIXED_GIVE_UP = 10  # a fixed scale: this many skipped steps in a row set `exhausted`

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, dynamic=True, min_scale=1.0, device="cpu", group=None):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and min_scale > 0.0):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1 and min_scale > 0")
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.dynamic, self.group = growth_interval, dynamic, group
        self.min_scale = min_scale if dynamic else 0.0  # a fixed scale has no floor to hit
        self._scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)  # clean steps
        self.exhausted = torch.zeros((), dtype=torch.bool, device=device)  # overflowed at floor
        self._skips = torch.zeros((), dtype=torch.int32, device=device)  # overflows in a row

    def scale(self, loss):
        # loss must be fp32 (the model upcasts logits before the cross-entropy): 2^16 overflows fp16
        return loss * self._scale

    @torch.no_grad()
    def unscale_(self, grads):
        """Divide fp32 gradients (the master gradients, or a ZeRO rank's fp32 slice) by the scale
        in place. Returns found_inf: a device tensor, 1.0 when any rank's gradients hold an
        inf/NaN, else 0.0."""
        if any(g.dtype == torch.float16 for g in grads):  # 1/scale would underflow them again
            raise ValueError("Attempting to unscale FP16 gradients: unscale fp32 master grads.")
        # checked where the gradients are (on the host under beyond/offload_optimizer.py), the
        # flag then on the scale's device, the process group's (NCCL reduces no host tensor)
        where = grads[0].device if grads else self._scale.device
        found_inf = torch.zeros((), dtype=torch.float32, device=where)
        # as torch: the reciprocal in fp64, rounded to fp32, then an fp32 multiply (bit for bit)
        inv_scale = self._scale.double().reciprocal().float().to(where)
        # one fused pass over all gradients, the kernel torch's own scaler runs: for each g, set
        # found_inf if g holds an inf/NaN, then g *= inv_scale. As a Python loop it would be
        # g.isfinite().all() and g.mul_(inv_scale) per tensor: the same, 15x slower on CPU.
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        found_inf = found_inf.to(self._scale.device)
        if dist.is_initialized():  # all skip together
            all_reduce_max(found_inf, dist.get_world_size(self.group), self.group,
                           label="found_inf")
        return found_inf

    @torch.no_grad()
    def update(self, found_inf):
        """Adapt the scale after a step: torch's _amp_update_scale_, written out with tensors.
        Products are taken in fp64 and rounded to fp32 once, as torch's kernel does."""
        overflow = found_inf > 0
        if not self.dynamic:  # a fixed scale cannot back off: FIXED_GIVE_UP overflows in a row
            self._skips.copy_(torch.where(overflow, self._skips + 1, 0))  # and it always will
            self.exhausted |= self._skips >= self.FIXED_GIVE_UP
            return
        self.exhausted |= overflow & (self._scale <= self.min_scale)
        tracker = torch.where(overflow, 0, self._growth_tracker + 1)
        grow = tracker == self.growth_interval
        grown = (self._scale.double() * self.growth_factor).float()
        backed_off = (self._scale.double() * self.backoff_factor).float()
        new_scale = torch.where(grow & torch.isfinite(grown), grown, self._scale)  # never to inf
        new_scale = torch.where(overflow, backed_off.clamp(min=self.min_scale), new_scale)
        self._scale.copy_(new_scale)
        self._growth_tracker.copy_(torch.where(grow, 0, tracker))

    def get_scale(self):
        return self._scale.item()  # waits for the device: for logging steps only

    def state_dict(self):
        # plain python numbers: torch.load(weights_only=True) reads them; keys as in torch's
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(self._growth_tracker.item()), "dynamic": self.dynamic,
                "min_scale": self.min_scale}

    def load_state_dict(self, sd):
        self._scale.fill_(float(sd["scale"]))
        self._growth_tracker.fill_(int(sd["_growth_tracker"]))
        self.growth_factor, self.backoff_factor = sd["growth_factor"], sd["backoff_factor"]
        self.growth_interval, self.dynamic = sd["growth_interval"], sd["dynamic"]
        self.min_scale = sd.get("min_scale", self.min_scale)
