"""
The optimizer, built in one place, from a name, a class or a function. ZeRO (zero.py) hands it
this rank's fp32 master: 1-D pieces of flat buckets, or a parameter's own shape where the rank
owns all of it. An elementwise optimizer shards like the master weights at every stage; one
whose step reads a tensor whole (Muon, Adafactor) needs each tensor whole on one rank, which
beyond/muon.py's WholeZeRO deals.

  - Loshchilov & Hutter 2019 (AdamW): two fp32 moments, 8 bytes a parameter
  - SGD with momentum (Polyak 1964): one fp32 buffer, 4 bytes
  - Lion (beyond/lion.py) and Muon (beyond/muon.py), techniques after the lecture: built there

The ZeRO paper's (2 + 2 + K)Ψ takes its K from here: the fp32 master (4 bytes, 16-bit runs
only) plus STATE_BYTES. A step with an inf/NaN gradient is skipped: on the device by an
optimizer that reads torch.amp's `found_inf` (`_step_supports_amp_scaling`: torch's fused
kernels, Lion, Muon), by the engine for any other, which then waits for the flag. The state
is made at start-up by the optimizer's own code (init_state); checkpoints save it by key.
"""
import torch

OPTIMIZERS = ("adamw", "sgd", "lion", "muon")  # --optimizer: the one list of names (muon's
# optimizer and layout are beyond/muon.py's: its WholeZeRO builds it)
STATE_BYTES = {"adamw": 8, "sgd": 4, "lion": 4, "muon": 4}  # fp32 state a parameter (Muon's
# matrices: a momentum; its embeddings, head and 1-D parameters take AdamW's 8)


# Our names' hyperparameters where the caller gives none (GPT-2/3's decay, AdamW's lr)
LR, WEIGHT_DECAY = 1e-3, 0.1


def matrices(name, p):
    """The GPT policy (GPT-3's, nanoGPT's): decay the matrices and embeddings, not the biases and
    norm gains. train.py passes it; our optimizer names take it by default."""
    return p.dim() >= 2


def param_groups(pieces, optimizer, weight_decay=None, decay=None):
    """The groups the optimizer is built over; pieces: (name, param, master) for each tensor.
    Our names: weight_decay (default WEIGHT_DECAY) on what decay(name, param) picks (default:
    matrices), none on the rest. A class or a function is the caller's own optimizer: one group,
    its own settings, unless weight_decay= or decay= is asked for. A group's value beats the
    constructor's, so an engine default here would override an SGD(weight_decay=0) in silence."""
    own = not isinstance(optimizer, str)
    if own and weight_decay is None and decay is None:
        return [{"params": [m for _, _, m in pieces]}]
    decay = decay or matrices
    if weight_decay is None:  # decay= alone, with the caller's optimizer: its own amount
        weight_decay = None if own else WEIGHT_DECAY
    picked = {"weight_decay": weight_decay} if weight_decay is not None else {}
    return [{"params": [m for n, p, m in pieces if decay(n, p)], **picked},
            {"params": [m for n, p, m in pieces if not decay(n, p)], "weight_decay": 0.0}]


def build(optimizer, groups, lr=None, betas=(0.9, 0.95), eps=1e-8):
    """The optimizer over param groups. `optimizer` is:
      a name   adamw | sgd (beta1 as its momentum), with lr (default LR), betas, eps
      a class  a torch.optim.Optimizer subclass, called as cls(groups), with lr= if given
      else     a function of the groups: functools.partial(torch.optim.SGD, lr=0.1), say
    """
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer(groups) if lr is None else optimizer(groups, lr=lr)
    if callable(optimizer):
        return optimizer(groups)
    lr = LR if lr is None else lr
    if optimizer == "adamw":  # fused: one multi-tensor kernel for the update, and found_inf
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    if optimizer == "sgd":  # weight decay as torch's SGD has it: coupled, added to the gradient
        return torch.optim.SGD(groups, lr=lr, momentum=betas[0], fused=True)
    if optimizer in ("lion", "muon"):  # techniques from after the lecture: beyond/ builds them
        raise ValueError(f"{optimizer} is built after the lecture (beyond/): use the engines "
                         "of machinery/engines.py, which know the name")
    raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}, "
                     "a torch.optim.Optimizer subclass or a function of the param groups")


def skip_on_host(opt):
    """Whether the engine must read found_inf and skip the step itself."""
    return not getattr(opt, "_step_supports_amp_scaling", False)


@torch.no_grad()
def init_state(opt, params):
    """Make the optimizer's state now, by its own code, changing no weight: one step on zero
    gradients, skipped by found_inf (or at lr 0, the weights put back), then the state zeroed:
    what its first real step would find (SGD's fused kernel leaves a new buffer unwritten)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    if skip_on_host(opt):
        saved, lrs = [p.clone() for p in params], [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
        opt.step()
        for p, old in zip(params, saved):
            p.copy_(old)
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
    else:
        opt.found_inf = torch.ones((), dtype=torch.float32, device=params[0].device)
        opt.step()
        opt.found_inf = None
    for p in params:
        p.grad = None
        for t in opt.state[p].values():
            if torch.is_tensor(t):
                t.zero_()  # per-element state, and a step count the lr-0 step advanced
