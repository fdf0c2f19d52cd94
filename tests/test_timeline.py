"""The lecture's order, read from the collective log (hangs.Recorder) on gloo: ZeRO-2's
reduce-scatters launched during backward, at most two in flight; ZeRO-3's next block gathered
while this one runs, and its weights freed after; stage 1's new weights waited for bucket by
bucket in the next forward. gloo checks the order, not the speed: it runs a reduce-scatter as
an all-reduce. Each test runs once on the engine and once on a deliberately serialized one,
and asserts that the serialized one breaks the order."""
import json
import os
import re

import pytest
import torch

import zero as zero_module
from conftest import make_zero, run_distributed, run_train
from data.loader import get_batch
from machinery import hangs, timeline
from precision import GradScaler
from test_train import TINY, run
from test_zero import B, DATA, LR, SEED, T, make_model
from train import update


def max_in_flight(events):
    """The most collectives launched and not yet waited for at any launch."""
    most = 0
    for e in events:
        alive = [o for o in events if o["launch"] <= e["launch"] and
                 (o["wait"] is None or o["wait"] > e["launch"])]
        most = max(most, len(alive))
    return most


def traced_step(rank, world_size, stage, **kw):
    """One traced micro-step; the recorder's events, with a mark at the end of each block's
    forward (after the engine's own hook) and of each block's backward."""
    hangs.install()  # its launch logs each collective while a recorder is set
    rec = hangs.recorder = hangs.Recorder()
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
    hangs.recorder = None
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
    assert max_in_flight(rs) <= zero_module.MAX_IN_FLIGHT


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


def _stage1_publish(rank, world_size, serialized):
    """Step 0 at ZeRO-1, its update publishing without waiting (train.update), then step 1's
    forward with a mark as each block's forward begins (after the engine's pre-hook on it,
    which waits for the buckets that block reads first). serialized: every bucket waited for
    as it is published, before the next forward begins."""
    mp = pytest.MonkeyPatch()
    if serialized:
        publish = zero_module.ZeRO.publish
        mp.setattr(zero_module.ZeRO, "publish", lambda self, wait=True: publish(self, True))
    hangs.install()
    rec = hangs.recorder = hangs.Recorder()
    model = make_model()
    zero = make_zero(model, 1, lr=LR, bucket_mb=0.002, rank=rank, world_size=world_size)
    blocks = list(model.transformer.h)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: rec.mark("forward_begin", block=i))
    for step in (0, 1):
        x, y = get_batch(DATA, SEED, step, 0, rank, world_size, B, T, 1)
        loss = model(x, y)[1]
        if step == 0:
            zero.backward(loss)
            update(zero, GradScaler(init_scale=1.0, dynamic=False), LR, 1.0)
    hangs.recorder = None
    mp.undo()
    block_of = {id(p): i for i, blk in enumerate(blocks) for p in blk.parameters()}
    first = {f"{b.label} (publish)": min(block_of.get(id(p), -1) for p in b.params)
             for b in zero.buckets}  # the first block that reads each bucket; -1: the root
    begins = {e["block"]: e["t"] for e in rec.events if e.get("what") == "forward_begin"}
    gathers = [e for e in rec.events if e.get("label") in first]
    assert len(gathers) == len(zero.buckets) >= 3
    for e in gathers:  # each bucket has landed before the first block that reads it begins
        if first[e["label"]] >= 0:
            assert e["done"] <= begins[first[e["label"]]], e
    later = [e for e in gathers if first[e["label"]] >= 1]
    assert later  # buckets that no block before block 1 reads: waited for inside the forward
    assert all(e["wait"] > begins[first[e["label"]] - 1] for e in later), \
        "the publish all-gathers were all waited for before the forward began"


@pytest.mark.parametrize("serialized", [False, True])
def test_stage1_waits_for_each_published_bucket_in_the_forward(serialized):
    if serialized:
        with pytest.raises(Exception, match="before the forward began"):
            run_distributed(_stage1_publish, 2, True)
    else:
        run_distributed(_stage1_publish, 2, False)


def test_train_trace_writes_the_log_the_profile_and_the_overlap(data_root, tmp_path):
    """train.py --trace on 2 gloo ranks at ZeRO-3: steps 2-3 traced (2 warm-up steps), a
    Chrome trace and a collective log per rank with each block's forward end and backward
    begin, and metrics.jsonl's trace rows whose exposed communication is the log's own sum;
    the recorder is off again after the window."""
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
    marks = [(e["what"], e["block"]) for e in log if e.get("block") is not None and e["step"] == 2]
    assert marks == [("forward_end", 0), ("forward_end", 1), ("backward_begin", 1),
                     ("backward_begin", 0)], marks  # compute beside them: 2 blocks, in order
    for r in traced:
        mine = timeline.per_step(log)[r["iter"]]
        assert abs(r["exposed_comm_ms"] - 1e3 * mine["exposed_s"]) < 1e-6
        assert 0 <= r["overlap"] <= 1
    assert hangs.recorder is None


class _Noted:
    """A collective's backend work whose wait() is noted."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _profiler_stops_with_nothing_in_flight(main, argv):
    """main(argv) with each traced collective's work noted, and torch.profiler's stop refused
    while one of them was never waited for."""
    noted, launched = [], hangs.Recorder.launched

    def noting(self, handle, tensor):
        handle.work = _Noted(handle.work)
        noted.append(handle.work)
        return launched(self, handle, tensor)

    def stop(self, *exc):
        assert all(n.waited for n in noted), "torch.profiler stopped with a collective in flight"
        return profile_exit(self, *exc)

    profile_exit = torch.profiler.profile.__exit__
    hangs.Recorder.launched = noting
    torch.profiler.profile.__exit__ = stop
    main(argv)


def test_the_profiler_stops_with_no_collective_in_flight(data_root, tmp_path):
    """--trace at ZeRO-2: the window's last step launches its publish all-gathers, waited for in
    the next forward; torch.profiler stopped with them in flight crashed a rank when they
    completed (SIGSEGV, about 1 run in 4 of debugging.md's command on torch 2.13). The tracer
    lands every collective of the window before it stops the profiler."""
    args = TINY + ["--data-root", data_root, "--dataset", "tiny", "--max-iters", "4",
                   "--eval-interval", "100", "--zero", "2", "--bucket-mb", "0.002",
                   "--trace", str(tmp_path / "trace"), "--trace-steps", "1",
                   "--out-dir", str(tmp_path)]
    run_train(args, 2, wrap=_profiler_stops_with_nothing_in_flight)


def _refused(main, argv):
    """main(argv) in a forked rank; the line it was refused with, to OUT/refused{rank}."""
    from configurator import UserError
    try:
        main(argv)
        line = None
    except UserError as e:
        line = str(e)
    out = argv[argv.index("--out-dir") + 1]
    with open(os.path.join(out, f"refused{os.environ['RANK']}"), "w") as f:
        json.dump(line, f)


def test_a_trace_target_that_cannot_be_a_folder_of_files_is_one_line(data_root, tmp_path):
    """--trace at a file, at a FIFO, under a file (a folder that cannot be made), or into a
    folder where a rank's file is a folder: one line before any work, on every rank. Before,
    the first three were a FileExistsError (NotADirectoryError) traceback on every rank once
    the model was built; in the last, rank 1's trace was never written, and nothing said so."""
    from configurator import UserError
    from train import main
    args = TINY + ["--data-root", data_root, "--dataset", "tiny", "--max-iters", "4",
                   "--eval-interval", "100", "--trace-steps", "1"]
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    for target, line in ((tmp_path / "file", "is not a folder"),
                         (tmp_path / "fifo", "is not a folder"),
                         (tmp_path / "file" / "trace", "cannot make this folder")):
        with pytest.raises(UserError, match=re.escape(f"--trace {target}") + f":? {line}"):
            main(args + ["--trace", str(target), "--out-dir", str(tmp_path / f"out-{target.name}")])
    trace = tmp_path / "trace"
    (trace / "trace_rank1.json").mkdir(parents=True)  # rank 1's, checked by rank 0 for all
    out = tmp_path / "run"
    out.mkdir()
    run_train(args + ["--trace", str(trace), "--out-dir", str(out)], 2, wrap=_refused)
    want = f"--trace: {trace / 'trace_rank1.json'} is not a regular file: move it away, or " \
           "give another folder"
    assert [json.load(open(out / f"refused{r}")) for r in (0, 1)] == [want] * 2
