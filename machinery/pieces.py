"""
What each rank owns of the model state, and the whole of it assembled one bucket at a time:
the pieces a checkpoint is written from (checkpoint.py) and read back into.

A piece is a (tensor name, element range) of a flattened tensor, with its values: the fp32
master weight and every optimizer state tensor by its key (trainable), or the value (frozen).
Nothing here knows a world size: the same pieces rebuild any stage on any number of ranks.
"""
from contextlib import contextmanager
import random

import numpy as np
import torch

from collectives import Traffic, all_gather_object, all_gather_params

def rng_state():
    """Every generator's state as plain bytes and numbers (weights_only-loadable): an exact
    resume draws the same dropout masks."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state().numpy().tobytes(),
             "numpy": [kind, keys.tobytes(), pos, has_gauss, gauss], "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def set_rng_state(state):
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    torch.set_rng_state(as_tensor(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(as_tensor(state["cuda"]))


def stored_shapes(model):
    """{name: shape} of every tensor as files hold it: the model's own declaration (GPT's
    leaves out the zero rows its vocabulary is padded with), else each tensor's shape, the
    tied one under its first name."""
    if hasattr(model, "stored_shapes"):
        return model.stored_shapes()
    shapes, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            shapes[name] = list(t.shape)
    return shapes


def stored(shapes, name, lo, hi):
    """[lo, hi) of a flattened tensor, cut to what the checkpoint stores of it."""
    return lo, min(hi, int(np.prod(shapes[name])))


def state_piece(t, n):
    """n elements of optimizer state for a piece of n elements: per-element state as it is; a
    statistic of a whole tensor shaped otherwise (Adafactor's row and column means, only ever
    of whole tensors: zero.py deals them whole) flat in the first elements, zeros after."""
    flat = t.reshape(-1)
    return flat[:n] if len(flat) >= n else torch.cat([flat, flat.new_zeros(n - len(flat))])


def owned_pieces(zero, shapes):
    """This rank's pieces, copied to the host: {name: {"lo", "hi", "master", each optimizer state
    key}} for trainable tensors and {name: {"lo", "hi", "value"}} for frozen ones. Up to stage 2
    the frozen tensors are whole on every rank, at stage 0 all tensors: rank 0 owns them."""
    out = {}
    for s in zero.segments if zero.stage >= 1 or zero.rank == 0 else ():
        lo, hi = stored(shapes, s.name, s.lo, s.hi)
        if lo < hi:
            state, n = zero.opt.state[s.master], hi - lo
            out[s.name] = {"lo": lo, "hi": hi, "master": s.flat[:n].detach().cpu().clone(),
                           **{k: state_piece(state[k], n).cpu().clone()
                              for k in opt_state_keys(zero.opt, s.master)}}
    if zero.stage == 3 or zero.rank == 0:
        for name, lo, hi, values in zero.frozen_pieces():
            lo, stop = stored(shapes, name, lo, hi)
            if lo < stop:
                out[name] = {"lo": lo, "hi": stop, "value": values[:stop - lo].cpu().clone()}
    return out


@contextmanager
def _gathered(zero, b, owned):
    """Every rank's `owned` piece of bucket b (hi - lo elements, any dtype) all-gathered into one
    full flat tensor (a collective), counted in zero.gathered_bytes while it exists."""
    full = torch.empty(b.numel, dtype=owned.dtype, device=owned.device)
    nbytes = full.numel() * full.element_size()
    zero.gathered_bytes += nbytes
    zero.peak_gathered_bytes = max(zero.peak_gathered_bytes, zero.gathered_bytes)
    try:
        if zero.stage == 0:  # every rank owns everything
            full.copy_(owned)
        else:
            work = all_gather_params(full, owned, Traffic(), zero.world_size, zero.gather_group)
            if work is not None:
                work.wait()
        yield full
    finally:
        zero.gathered_bytes -= nbytes


def state_keys(zero):
    """{tensor name: the optimizer's state keys} for every trainable tensor, as the optimizer
    made them (AdamW: exp_avg, exp_avg_sq; SGD and Muon's matrices: momentum_buffer;
    Adafactor's matrices: row_var, col_var), agreed by every rank: a checkpoint saves each, by
    key (state_piece). A collective."""
    mine = {s.name: opt_state_keys(zero.opt, s.master) for s in zero.segments}
    keys = {}
    for every in all_gather_object(mine, zero.world_size):
        keys.update(every)
    return keys


def optimizer_header(zero):
    """The optimizer's name, per-element state keys and step count, agreed by every rank (a
    rank that owns nothing but padding has neither keys nor a count)."""
    counts = [step_count(zero.opt, s.master) for s in zero.segments]
    every = all_gather_object(max((c for c in counts if c is not None), default=None),
                              zero.world_size)
    return {"optimizer": zero.optimizer, "state_keys": state_keys(zero),
            "opt_step": max((c for c in every if c is not None), default=0)}


def full_tensors(zero, shapes, keys, keys_of=None):
    """Every tensor whole (as model.stored_shapes() says), by name, on rank 0's host ({} on the
    other ranks): {name: {key: tensor}}, owned_pieces' keys; a state key only for the tensors
    that have it (keys_of: state_keys()). A collective: buckets are gathered one at a time,
    each on the host before the next is gathered."""
    out = {}

    def host(name, flat):  # the stored part of a tensor, on the host
        return flat[:int(np.prod(shapes[name]))].view(shapes[name]).cpu().clone()

    for b in zero.buckets:
        for key in keys:
            owned = torch.zeros(b.hi - b.lo, dtype=torch.float32, device=zero.device)
            has = lambda name: key == "master" or key in (keys_of or {}).get(name, ())
            if not any(has(zero.names[id(p)]) for p in b.params):
                continue  # the same collectives on every rank: keys_of is agreed
            for s in b.segments:
                if has(s.name):
                    src = s.flat if key == "master" else zero.opt.state[s.master][key]
                    owned[s.start:s.start + s.hi - s.lo] = state_piece(src, s.hi - s.lo)
            with _gathered(zero, b, owned) as full:
                if zero.rank == 0:
                    for p, offset in zip(b.params, b.offsets):
                        name = zero.names[id(p)]
                        if has(name):
                            out.setdefault(name, {})[key] = host(name, full[offset:offset
                                                                            + p.numel()])
    frozen = [b for u in zero.all_units for b in u.buckets if b.frozen] if zero.stage == 3 else []
    for b in frozen:  # ZeRO-3's frozen buckets: their shards gathered the same way
        with _gathered(zero, b, b.shard) as full:
            if zero.rank == 0:
                for t, offset in zip(b.params, b.offsets):
                    name = zero.names[id(t)]
                    out[name] = {"value": host(name, full[offset:offset + t.numel()])}
    if zero.stage < 3 and zero.rank == 0:
        for t in zero.frozen:
            out[zero.names[id(t)]] = {"value": host(zero.names[id(t)], t.detach().reshape(-1))}
    return out


def opt_state_keys(opt, param):
    """The names of the state tensors the optimizer keeps for param (not its scalar step)."""
    return sorted(k for k, t in opt.state[param].items() if torch.is_tensor(t) and t.dim() > 0)


def step_count(opt, param):
    """The optimizer's step count for param (AdamW's "step"), or None if it keeps none."""
    t = opt.state[param].get("step")
    return None if t is None else int(t.item() if torch.is_tensor(t) else t)


def set_step_count(opt, params, step):
    """A resumed step count (AdamW's bias correction needs it), where the optimizer keeps one."""
    for p in params:
        if torch.is_tensor(opt.state[p].get("step")):
            opt.state[p]["step"].fill_(step)
