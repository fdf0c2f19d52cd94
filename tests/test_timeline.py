"""The lecture's order, read from the collective log (collectives.Recorder) on gloo: ZeRO-2's
reduce-scatters launched during backward, at most two in flight; ZeRO-3's next block gathered
while this one runs, and its weights freed after. gloo checks the order, not the speed: it runs
a reduce-scatter as an all-reduce. Each test runs once on the engine and once on a
deliberately serialized one, and asserts that the serialized one breaks the order."""
import json

import pytest
import torch

import collectives
import zero as zero_module
from conftest import make_zero, run_distributed
from data.loader import get_batch
from machinery import timeline
from test_train import TINY, run
from test_zero import B, DATA, LR, SEED, T, make_model


def traced_step(rank, world_size, stage, **kw):
    """One traced micro-step; the recorder's events, with a mark at the end of each block's
    forward (after the engine's own hook) and of each block's backward."""
    rec = collectives.recorder = collectives.Recorder()
    model = make_model()
    zero = make_zero(model, stage, lr=LR, bucket_mb=0.002, rank=rank, world_size=world_size, **kw)
    freed = []
    for i, block in enumerate(model.transformer.h):
        def forward_end(m, args, out, i=i):
            rec.mark("forward_end", block=i)
            freed.append(all(p.untyped_storage().nbytes() == 0 for p in m.parameters()))
        block.register_forward_hook(forward_end)
        block.register_full_backward_hook(lambda m, gi, go, i=i: rec.mark("backward_end", block=i))
    x, y = get_batch(DATA, SEED, 0, 0, rank, world_size, B, T, 1)
    zero.backward(model(x, y)[1])
    collectives.recorder = None
    return rec.events, freed, zero


def serialize_reductions(mp):
    """The engine as it would be without hooks: no bucket launched during backward, so
    finish_backward launches every one after it (stage 2's _grad_ready only counts)."""
    mp.setattr(zero_module.ZeRO, "_grad_ready", lambda self, p: None)


def _zero2_order(rank, world_size, serialized):
    mp = pytest.MonkeyPatch()
    if serialized:
        serialize_reductions(mp)
    events, _, zero = traced_step(rank, world_size, 2)
    mp.undo()
    rs = [e for e in events if e["kind"] == "collective" and e["op"] == "reduce_scatter"]
    assert len(rs) == len(zero.buckets) >= 3
    ends = {e["block"]: e["t"] for e in events if e.get("what") == "backward_end"}
    # bucket 0 holds the last layers: launched before the backward of the first block ends
    assert rs[0]["launch"] < ends[0], "bucket 0's reduce-scatter waited for the whole backward"
    assert timeline.max_in_flight(rs) <= zero_module.MAX_IN_FLIGHT


@pytest.mark.parametrize("serialized", [False, True])
def test_zero2_reduce_scatters_launch_during_backward(serialized):
    if serialized:
        with pytest.raises(Exception, match="whole backward"):
            run_distributed(_zero2_order, 2, True)
    else:
        run_distributed(_zero2_order, 2, False)


def _zero3_prefetch(rank, world_size, prefetch):
    events, freed, _ = traced_step(rank, world_size, 3, prefetch=prefetch)
    assert freed and all(freed), "a block's gathered weights outlived its forward"
    forward = [e for e in events if e.get("what") == "forward_end" or
               (e["kind"] == "collective" and e["op"] == "all_gather")]
    first_end = [i for i, e in enumerate(forward) if e.get("what") == "forward_end"][0]
    gathers = [e for e in forward[:first_end] if e["kind"] == "collective"]
    # when block 0's forward ends, block 1's all-gather is already launched and not waited for
    in_flight = [e for e in gathers if e["wait"] is None or e["wait"] > forward[first_end]["t"]]
    assert in_flight, "block 1's all-gather was not launched before block 0's forward ended"


def test_zero3_prefetches_the_next_block_and_frees_the_last():
    run_distributed(_zero3_prefetch, 2, True)
    with pytest.raises(Exception, match="not launched before"):  # the serialized engine
        run_distributed(_zero3_prefetch, 2, False)


def test_train_trace_writes_the_log_the_profile_and_the_overlap(data_root, tmp_path):
    """train.py --trace on 2 gloo ranks at ZeRO-3: steps 2-3 traced (2 warm-up steps), a
    Chrome trace and a collective log per rank, and metrics.jsonl's trace rows whose exposed
    communication is the log's own sum; the recorder is off again after the window."""
    out, trace = tmp_path / "run", tmp_path / "run" / "trace"
    args = TINY + ["--data-root", data_root, "--dataset", "tiny", "--max-iters", "5",
                   "--eval-interval", "100", "--zero", "3", "--bucket-mb", "0.002",
                   "--trace", str(trace), "--trace-steps", "2"]
    rows = run(args, out, nproc=2)
    traced = [r for r in rows if r.get("event") == "trace"]
    assert [r["iter"] for r in traced] == [2, 3]
    for rank in (0, 1):
        assert json.load(open(trace / f"trace_rank{rank}.json"))["traceEvents"]
    log = timeline.read(trace / "collectives_rank0.jsonl")
    ops = [e for e in log if e["kind"] == "collective"]
    assert {e["step"] for e in ops} == {2, 3} and {"all_gather", "reduce_scatter"} <= {
        e["op"] for e in ops}
    assert all(e["micro"] >= 0 and e["bytes"] > 0 for e in ops)
    for r in traced:
        mine = timeline.per_step(log)[r["iter"]]
        assert abs(r["exposed_comm_ms"] - 1e3 * mine["exposed_s"]) < 1e-6
        assert 0 <= r["overlap"] <= 1
    assert collectives.recorder is None
