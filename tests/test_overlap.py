"""What many GPUs need that one GPU and gloo hide: the reductions in flight at once (each holds a
bucket's full-size gradient temporary until it is waited for), one gather group per process, one
reduce precision for every stage, and the publish / prefetch gathers overlapping the forward.

gloo frees a collective's buffers early and one process copies locally, so these tests watch
the engine itself: they wrap the collectives' work handles and count the ones not yet waited
for, and count the process groups made."""
import pytest
import torch
import torch.distributed as dist

import collectives
from machinery import footprint
import zero as zero_module
from conftest import make_zero, run_distributed
from data.loader import get_batch
from precision import GradScaler
from test_zero import B, DATA, LR, SEED, T, make_model


class Watched:
    """A work handle that knows whether it has been waited for."""

    def __init__(self, work, nbytes, log):
        self.work, self.nbytes, self.log = work, nbytes, log
        log.append(self)

    def wait(self):
        if self in self.log:
            self.log.remove(self)
        return self.work.wait()


def watch_reductions(monkeypatch, seen):
    """Every gradient collective's handle wrapped; seen gets (handles outstanding, their input
    bytes) at every launch, the new one included."""
    outstanding = []

    def wrap(launch, flat_arg):
        def launched(*args, **kwargs):
            work = launch(*args, **kwargs)
            if work is not None:
                flat = args[flat_arg]
                Watched(work, flat.numel() * flat.element_size(), outstanding)
                seen.append((len(outstanding), sum(w.nbytes for w in outstanding)))
                return outstanding[-1]
            return work
        return launched

    monkeypatch.setattr(zero_module, "reduce_scatter_grads",
                        wrap(collectives.reduce_scatter_grads, 1))
    monkeypatch.setattr(zero_module, "all_reduce_grads", wrap(collectives.all_reduce_grads, 0))


def _bounded(rank, world_size):
    mp = pytest.MonkeyPatch()
    for stage in (0, 1, 2, 3):
        seen = []
        watch_reductions(mp, seen)
        model = make_model(torch.bfloat16)
        zero = make_zero(model, stage, lr=LR, bucket_mb=0.002, rank=rank, world_size=world_size)
        x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
        zero.backward(model(x, y)[1])
        launched = len(seen)
        assert launched == len(zero.buckets) >= 3, (stage, launched)
        # never more than two reductions (and two buckets of temporaries) alive at once
        assert max(n for n, _ in seen) <= zero_module.MAX_IN_FLIGHT, (stage, seen)
        if stage >= 2:  # memory.py's term for them bounds what was held
            sizes = [b.numel for b in zero.buckets]
            allowed = footprint.reduce_in_flight_bytes(sizes, stage, world_size, "bf16")
            assert 0 < max(nbytes for _, nbytes in seen) <= allowed, (seen, allowed)
        mp.undo()
    mp.undo()


def test_at_most_two_bucket_reductions_in_flight():
    run_distributed(_bounded, 2)


def _one_gather_group(rank, world_size):
    made = []
    mp = pytest.MonkeyPatch()
    new_group = dist.new_group
    mp.setattr(dist, "new_group", lambda *a, **k: made.append(1) or new_group(*a, **k))
    # the GPU's choice, on gloo: a separate gather group (here a second gloo group)
    mp.setattr(collectives, "separate_gather_stream", lambda device: True)
    make_zero(make_model(), 0, rank=rank, world_size=world_size)
    assert made == []  # stage 0 never all-gathers
    engines = [make_zero(make_model(), stage, rank=rank, world_size=world_size, bucket_mb=0.002)
               for stage in (1, 2, 3, 2)]
    assert len(made) == 1  # made once, shared by every engine
    assert len({id(z.gather_group) for z in engines}) == 1
    assert engines[0].gather_group is not None  # not the default group: a group of its own
    mp.undo()


def test_one_gather_group_per_process():
    run_distributed(_one_gather_group, 2)
    assert collectives.gather_group(None, torch.device("cpu"), 1) is None  # one rank: no group


def _reduce_precision(rank, world_size):
    """bf16 weights, fp32 gradient accumulation, the gradients reduced in fp32 or in bf16 at
    every stage, against one fp32 process on the whole batch: fp32 on the wire lands closer,
    and every reduced element costs 4 bytes instead of 2."""
    ref = one_process_grads(world_size)
    for stage in (0, 1, 2, 3):
        errors, nbytes = {}, {}
        for reduce in (torch.float32, torch.bfloat16):
            model = make_model(torch.bfloat16)
            zero = make_zero(model, stage, bucket_mb=0.002, rank=rank, world_size=world_size,
                             reduce_dtype=reduce, fp32_grad_accum=True)
            for micro in range(2):
                x, y = get_batch(DATA, SEED, 0, micro, rank, world_size, B, T, 2)
                zero.backward(model(x, y)[1] / 2, sync=micro == 1)
            zero.master_grads()
            pieces = [{(s.name, s.lo, s.hi): s.master.grad.reshape(-1) for s in zero.segments}]
            pieces = pieces * world_size
            dist.all_gather_object(pieces, pieces[0])
            grads = {name: torch.zeros(g.numel()) for name, g in ref.items()}
            for piece in pieces:
                for (name, lo, hi), g in piece.items():
                    grads[name][lo:hi] = g
            mine, full = torch.cat(list(grads.values())), torch.cat(list(ref.values()))
            errors[reduce] = ((mine - full).norm() / full.norm()).item()
            reduced = zero.traffic.all_reduce + zero.traffic.reduce_scatter
            nbytes[reduce] = zero.traffic.bytes
        assert nbytes[torch.float32] - nbytes[torch.bfloat16] == 2 * reduced, (stage, nbytes)
        assert errors[torch.float32] < errors[torch.bfloat16], (stage, errors)


def one_process_grads(world_size):
    """{name: the fp32 model's mean gradient over the global batch}, flattened."""
    model = make_model()
    for micro in range(2):
        x, y = get_batch(DATA, SEED, 0, micro, 0, 1, B * world_size, T, 2)
        (model(x, y)[1] / 2).backward()
    return {n: p.grad.reshape(-1) for n, p in model.named_parameters()}


def test_one_reduce_precision_at_every_stage():
    run_distributed(_reduce_precision, 2)


def _publish_overlaps(rank, world_size):
    """Stages 1-2: publish(wait=False) leaves the all-gathers in flight; each block's
    pre-forward waits for the buckets it reads first, root buckets at the model's; the weights
    and losses are bitwise those of a publish that waits."""
    for stage in (1, 2):
        runs = {}
        for wait in (True, False):
            model = make_model(torch.bfloat16)
            zero = make_zero(model, stage, lr=LR, bucket_mb=0.0005, rank=rank,
                             world_size=world_size)
            scaler, losses = GradScaler(init_scale=1.0, dynamic=False), []
            for step in range(3):
                x, y = get_batch(DATA, SEED, step, 0, rank, world_size, B, T, 1)
                loss = model(x, y)[1]
                losses.append(loss.item())
                zero.backward(loss)
                found_inf = scaler.unscale_(zero.master_grads())
                zero.clip_grad_norm_(1.0)
                zero.step(LR, found_inf)
                zero.publish(wait=wait)
                if not wait:
                    assert len(zero.publishing) == len(zero.buckets)  # all in flight
                zero.zero_grad()
            waits = []
            model.transformer.h[0].register_forward_pre_hook(
                lambda m, a: waits.append(len(zero.publishing)))
            model(x, y)
            assert not zero.publishing  # the forward waited for all of them
            if not wait:  # block 0 started with the later blocks' gathers still in flight
                assert waits[0] > 0, waits
            runs[wait] = (losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        assert runs[True][0] == runs[False][0]
        assert torch.equal(runs[True][1], runs[False][1])


def test_publish_overlaps_the_next_forward():
    run_distributed(_publish_overlaps, 2)


def _zero3_prefetch(rank, world_size):
    """ZeRO-3 starts block 0's gather at the model's pre-forward and the last block's at the end
    of the forward (before the loss head's backward); the traffic per step is unchanged."""
    model = make_model()
    zero = make_zero(model, 3, lr=LR, rank=rank, world_size=world_size)
    arriving = {}
    model.transformer.wte.register_forward_pre_hook(
        lambda m, a: arriving.update(first=zero.units[0].buckets[0].arriving is not None))
    x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
    loss = model(x, y)[1]
    last = zero.units[-1].buckets[0]
    assert arriving["first"]
    assert last.arriving is not None or last.gathered
    zero.traffic = collectives.Traffic()
    zero.backward(loss)
    assert zero.gathered_bytes == 0


def test_zero3_prefetches_the_first_and_last_block():
    run_distributed(_zero3_prefetch, 2)


def test_zero3_gathers_the_root_once_a_step():
    """ZeRO-3's root unit (embeddings, ln_f, the tied head) changes only at the step: gathered
    at the first micro-step's forward, kept through the others (backward(sync=False)), freed
    after the last, so 4 micro-steps gather it once, not 4 times. Between micro-steps only
    the root is held; a step whose last backward was never synced frees it when it begins,
    a loop that stops mid-step at publish."""
    model = make_model()
    zero = make_zero(model, 3, lr=LR)
    gathers, launch = [], zero._launch_gather
    zero._launch_gather = lambda b: (gathers.append(b.unit.root), launch(b))[1]
    root = sum(b.flat.numel() * b.flat.element_size() for b in zero.root.buckets)
    for step in range(2):
        for micro in range(4):
            x, y = get_batch(DATA, SEED, step, micro, 0, 1, B, T, 4)
            zero.backward(model(x, y)[1] / 4, sync=micro == 3)
            assert zero.gathered_bytes == (root if micro < 3 else 0)
        zero.master_grads()
        zero.step(LR)
        zero.publish()
        assert gathers.count(True) == step + 1 and gathers.count(False) == 2 * 2 * 4 * (step + 1)
    zero.backward(model(x, y)[1], sync=False)  # a loop of one's own that stops mid-step
    assert zero.gathered_bytes == root
    zero.publish()
    assert zero.gathered_bytes == 0


def test_stage2_copies_a_buckets_gradients_in_one_multi_tensor_op():
    """ZeRO-2's temporary flat gradient of a bucket: one torch._foreach_copy_ (one kernel on a
    GPU) instead of a copy_ per parameter; the padding and an unused parameter zero; the
    same bytes as copying one by one, and every .grad freed (the engine's storage-less
    HeldGrad, or None where there was none)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    zero = make_zero(make_model(torch.bfloat16), 2, lr=LR, bucket_mb=1)
    b = max(zero.buckets, key=lambda b: len(b.params))
    want = torch.zeros(b.numel, dtype=torch.bfloat16)
    for i, (p, offset) in enumerate(zip(b.params, b.offsets)):
        p.grad = None if i == 1 else torch.randn_like(p)
        if p.grad is not None:
            want[offset:offset + p.numel()] = p.grad.reshape(-1)
    assert len(b.params) > 3
    with Ops():
        flat = zero._grads_to_flat(b)
    from machinery.guard import HeldGrad
    assert torch.equal(flat, want)
    assert all(p.grad is None or isinstance(p.grad, HeldGrad) for p in b.params)
    assert "copy_" not in seen and seen.count("_foreach_copy_") == 1, seen
