"""A hang names itself: one rank stops issuing collectives (--hang-at, hangs.watch), and
every other rank leaves within the timeout with one line naming the collective (its op and
bucket or block), the step and micro-step, and the rank that never arrived. On 2 and 4 gloo
ranks at every stage (the engine driven directly), and once end to end under torchrun, whose
last checkpoint before the hang resumes. Every process here is bounded: a regression fails
the test, it cannot hang the suite."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import collectives
from conftest import ROOT, free_port, make_zero, run_train, zero_step
from data.loader import get_batch
from machinery import hangs
from precision import GradScaler
from test_train import TINY
from test_zero import B, CLIP, DATA, LR, SEED, T, make_model

TIMEOUT = 2.0  # seconds a collective waits here; hangs.grace(TIMEOUT) = 1 s to hear the others
HANG_AT = 1  # the step the last rank stops at (step 0 runs whole: every collective once)
# its own timeout, or (a rare race) a peer's, which closed the connection first
TIMED_OUT = rf"(timed out after {TIMEOUT:g} s|failed \([^)]*\))"


class Stuck(Exception):
    """The hung rank's way out of its step, once the others have named it."""


def _until_named(world_size, seconds):
    """hangs.hang for these tests: the stuck rank waits until the others have named it
    (hangs.exchange's read count), not the full sleep the real one takes."""
    def hang(step, rank, timeout):
        store, deadline = dist.distributed_c10d._get_default_store(), time.monotonic() + seconds
        try:
            while store.add(hangs.KEY + "read", 0) < world_size - 1 and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        except RuntimeError:  # rank 0, the store's host, has read and left
            pass
        raise Stuck
    return hang


def _steps(model, zero, rank, world_size, steps):
    """Steps 0 .. steps-1 of the engine on the test data, as train.py's loop takes them."""
    scaler = GradScaler(init_scale=1.0, dynamic=False)
    for step in range(steps):
        x, y = get_batch(DATA, SEED, step, 0, rank, world_size, B, T, 1)
        zero.backward(model(x, y)[1])
        zero_step(zero, scaler, LR, CLIP)


def _hang_once(rank, world_size, stage):
    """Steps 0 and 1 of ZeRO `stage` with --hang-at 1: this rank's one line, or None on the
    rank that hung."""
    model = make_model()
    zero = make_zero(model, stage, lr=LR, bucket_mb=0.002, rank=rank, world_size=world_size)
    cfg = SimpleNamespace(hang_at=HANG_AT, collective_timeout=TIMEOUT, max_iters=HANG_AT + 1)
    hangs.watch(model, cfg, rank, world_size, grad_accum=1, start_it=0)
    try:
        _steps(model, zero, rank, world_size, HANG_AT + 1)
    except Stuck:
        assert rank == world_size - 1
        return None
    except hangs.CollectiveTimeout as e:
        return hangs.name_hang(e)
    raise AssertionError(f"rank {rank} ran step {HANG_AT} through: nobody hung")


def _one_stage(rank, world_size, stage, port, out):
    """ZeRO `stage` in a process group of its own (a timed-out gloo group is broken for good):
    this rank's line and how long it took, to OUT/rank{rank}-stage{stage}.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    pytest.MonkeyPatch().setattr(hangs, "hang", _until_named(world_size, 3 * TIMEOUT))
    hangs.install(TIMEOUT)
    dist.init_process_group("gloo")
    t0 = time.monotonic()
    line = _hang_once(rank, world_size, stage)
    with open(os.path.join(out, f"rank{rank}-stage{stage}.json"), "w") as f:
        json.dump([line, time.monotonic() - t0], f)
    os._exit(0)  # no interpreter teardown with gloo's broken pairs behind


def spawn_bounded(fn, world_size, args, seconds):
    """fn(rank, world_size, *args) on world_size processes; killed and failed after seconds."""
    spawn_together([(fn, world_size, args)], seconds)


def spawn_together(jobs, seconds):
    """Each (fn, world_size, args) of jobs on its own processes, all at once: a hang test
    mostly waits out timeouts, so two of them side by side take the time of one."""
    contexts = [mp.start_processes(fn, args=(world_size, *args), nprocs=world_size, join=False,
                                   start_method="forkserver") for fn, world_size, args in jobs]
    deadline = time.monotonic() + seconds
    try:
        for context in contexts:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise AssertionError(f"still running after {seconds} s: a hang")
    finally:
        for p in (p for context in contexts for p in context.processes):
            if p.is_alive():
                p.kill()


def run_bounded(cmd, seconds):
    """The command's CompletedProcess; past `seconds` every process it started is killed (its
    session: torchrun's ranks too, whose SIGTERM only asks for a save) and the test fails."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError(f"still running after {seconds} s: a hang")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


# the line each waiting rank prints, at every stage: the op and the bucket or block of the first
# collective step 1 waits for (stage 0-2: the last bucket's reduction in backward; ZeRO-3: the
# root unit's gather before the embeddings), the step and micro-step, and who never arrived
FIRST = {0: "all_reduce of bucket 0", 1: "reduce_scatter of bucket 0",
         2: "reduce_scatter of bucket 0", 3: "all_gather of root"}


@pytest.mark.slow
def test_a_hang_names_the_collective_the_step_and_the_missing_rank(tmp_path):
    """On 2 and 4 ranks, every stage, all at once (their waits overlap)."""
    for world_size in (2, 4):
        (tmp_path / str(world_size)).mkdir()
    spawn_together([(_one_stage, world_size, (stage, free_port(), str(tmp_path / str(world_size))))
                    for world_size in (2, 4) for stage in range(4)], seconds=120)
    for world_size in (2, 4):
        check_every_stage(world_size, tmp_path / str(world_size))


def check_every_stage(world_size, tmp_path):
    last = world_size - 1
    waiting = "rank 0" if world_size == 2 else f"ranks 0-{last - 1}"
    for rank in range(world_size):
        for stage in range(4):
            line, seconds = json.load(open(tmp_path / f"rank{rank}-stage{stage}.json"))
            if rank == last:
                assert line is None
                continue
            assert re.fullmatch(
                rf"rank {rank}: {FIRST[stage]} at step {HANG_AT}, micro-step 0 \(collective #\d+\)"
                rf" {TIMED_OUT}: rank {last} never arrived \(in no collective: "
                rf"busy, stuck or gone\) \({waiting} waited, --collective-timeout {TIMEOUT:g}\)",
                line), (stage, line)
            assert seconds < 4 * TIMEOUT + 5, (stage, seconds)  # bounded, not hours


def _one_rank_killed(rank, world_size, port, out):
    """Steps 0-1 of ZeRO-2; rank 1 is SIGKILLed in step 1's backward. The others' lines. The
    store lives outside the ranks, as torchrun's agent keeps it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    hangs.install(30.0)  # a lost peer, not a timeout: the survivors fail at once, or in a cascade
    dist.init_process_group("gloo")
    model = make_model()
    zero = make_zero(model, 2, lr=LR, bucket_mb=0.002, rank=rank, world_size=world_size)
    if rank == 1:
        model.register_full_backward_hook(lambda m, gi, go: os.kill(os.getpid(), signal.SIGKILL)
                                          if hangs.position.step == 1 else None)
    hangs.watch(model, SimpleNamespace(hang_at=-1, collective_timeout=30.0, max_iters=2), rank,
                world_size, grad_accum=1, start_it=0)
    line = None
    try:
        _steps(model, zero, rank, world_size, 2)
    except hangs.CollectiveTimeout as e:
        line = hangs.name_hang(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(line, f)
    os._exit(0)


@pytest.mark.slow
def test_a_killed_rank_is_named_gone_and_no_survivor_is_called_absent(tmp_path):
    """4 ranks, rank 1 SIGKILLed mid-step: gloo fails the collective on each survivor at a
    different moment (rank 1's neighbours at once, a rank behind them only once they leave),
    so a roll call alone heard too few: rank 0 said 'ranks 1, 3 never arrived', rank 3 'ranks
    0-2'. A rank whose process ended is named gone; a survivor that did not answer (still
    waiting, or leaving) is not called absent."""
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    context = mp.start_processes(_one_rank_killed, args=(4, port, str(tmp_path)),
                                 nprocs=4, join=False, start_method="forkserver")
    deadline = time.monotonic() + 90
    for p in context.processes:  # not context.join: it stops the others when rank 1 dies
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [p.pid for p in context.processes if p.is_alive()]
    for p in context.processes:
        p.kill()
    del agent
    assert not alive, "still running after 90 s: a hang"
    for rank in (0, 2, 3):
        line = json.load(open(tmp_path / f"rank{rank}.json"))
        assert re.fullmatch(rf"rank {rank}: reduce_scatter of bucket \d+ at step 1, micro-step 0 "
                            r"\(collective #\d+\) failed \(.*\): rank 1 is gone \(its process "
                            r"ended: killed, crashed or left\).*", line), line
        assert "never arrived" not in line and "gone" not in line.split("rank 1 is gone")[1], line


def _slow_first_step(rank, world_size, port, out):
    """Steps 0-2 of ZeRO-2 with the last rank 1.5 timeouts late in step 0 (a compile, the first
    NCCL connections, an allocator warming up) and again in step 2: its peers wait the first
    out and name the second."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    hangs.install(TIMEOUT)
    dist.init_process_group("gloo")
    model = make_model()
    zero = make_zero(model, 2, lr=LR, bucket_mb=0.002, rank=rank, world_size=world_size)
    hangs.watch(model, SimpleNamespace(hang_at=-1, collective_timeout=TIMEOUT, max_iters=3),
                rank, world_size, grad_accum=1, start_it=0)
    late = lambda m, args: time.sleep(1.5 * TIMEOUT) if hangs.position.step in (0, 2) \
        and rank == world_size - 1 else None
    model.register_forward_pre_hook(late)  # after watch's: the step is set
    result = None
    try:
        _steps(model, zero, rank, world_size, 3)
    except hangs.CollectiveTimeout as e:
        result = (e.where["step"], e.timed_out, hangs.timeout_s)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.mark.slow
def test_the_first_step_may_be_slow_then_the_timeout_holds(tmp_path):
    """--collective-timeout holds from the run's second step on: the first (inductor's compile
    takes minutes, and not the same minutes on every rank) waits the start-up allowance
    (hangs.START_S). Before, a rank late in step 0 by 1.5 timeouts stopped a healthy
    run there; late in step 2 it is still named within the timeout."""
    spawn_bounded(_slow_first_step, 2, (free_port(), str(tmp_path)), seconds=120)
    step, timed_out, limit = json.load(open(tmp_path / "rank0.json"))
    assert step == 2 and timed_out and limit == TIMEOUT


def test_hang_at_is_refused_where_nothing_would_hang():
    """--hang-at on one rank, at the run's first step (it waits the start-up allowance, not
    --collective-timeout) or at none it runs (before a resume's start, at --max-iters or
    after, below -1): one line each. Before, all but the first ran through in silence."""
    from configurator import UserError, parse_args
    for hang_at, world_size, start_it in ((3, 1, 0), (0, 2, 0), (4, 2, 4), (2, 2, 4), (10, 2, 0)):
        cfg = SimpleNamespace(hang_at=hang_at, collective_timeout=TIMEOUT, max_iters=10)
        with pytest.raises(UserError, match=f"--hang-at {hang_at}"):
            hangs.watch(torch.nn.Linear(1, 1), cfg, 0, world_size, 1, start_it)
    for flag in ("--hang-at", "--nan-at"):
        with pytest.raises(UserError, match=f"{flag} must be a step, or -1 for none"):
            parse_args([flag, "-2"])
    cfg = SimpleNamespace(hang_at=5, collective_timeout=TIMEOUT, max_iters=10)
    hangs.watch(torch.nn.Linear(1, 1), cfg, 0, 2, 1, 4)  # the first step after a resume's


def test_a_collective_timeout_no_step_can_meet_is_refused():
    """--collective-timeout 1e-9 (or 0.001) was accepted, and the run died after its first step
    on every rank, blaming 'a slow link, a backend fault'. A floor of 1 s: one line."""
    from configurator import UserError, parse_args
    for seconds in ("1e-9", "0.001", "0.5", "0", "-3", "nan", "inf"):
        with pytest.raises(UserError, match=r"--collective-timeout \S+: must be 1 to 1048576 s"):
            parse_args(["--collective-timeout", seconds])
    assert parse_args(["--collective-timeout", "1"]).collective_timeout == 1


def test_a_rank_in_another_collective_is_named_with_where_it_waits():
    """The report's logic on its own: the ranks that answered with another seq wait elsewhere,
    those that did not answer are in no collective; a collective called on torch.distributed
    directly is placed after the last of ours."""
    here = dict(op="reduce_scatter", label="bucket 2", step=7, micro=1, seq=40)
    there = dict(op="all_reduce", label="norm", step=7, micro=1, seq=41)
    assert hangs.ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    assert hangs.describe(there) == "all_reduce of norm at step 7, micro-step 1 " \
                                          "(collective #41)"
    assert hangs.describe(dict(there, step=-1)) == "all_reduce of norm before training " \
                                                         "(collective #41)"
    error = hangs.CollectiveTimeout(here, RuntimeError("[x.cc:1] Connection closed by peer"))
    assert str(error) == ("reduce_scatter of bucket 2 at step 7, micro-step 1 (collective #40) "
                          "failed (Connection closed by peer)")
    reset = hangs.CollectiveTimeout(here, RuntimeError(  # a killed peer, gloo's words
        "[../gloo/transport/tcp/pair.cc:553] Read error [127.0.0.1]:41861: Connection reset by "
        "peer. This is typically caused by a crash of the peer"))
    assert str(reset).endswith("failed (Read error [127.0.0.1]:41861: Connection reset by peer)")
    heard = {0: here, 1: here, 3: there}
    mp_patch = pytest.MonkeyPatch()
    for key, value in dict(step=3, micro=-1, seq=12).items():  # an evaluation at step 3
        mp_patch.setattr(hangs.position, key, value)
    mp_patch.setattr(hangs, "timeout_s", None)  # an earlier run in this process may have set one
    direct = hangs.CollectiveTimeout(None, RuntimeError("Timed out waiting 2000ms"))
    assert str(direct) == ("a torch.distributed collective at step 3 (collective #12) failed "
                           "(Timed out waiting 2000ms)")  # no timeout known: the backend's words
    mp_patch.setattr(hangs, "exchange", lambda mine, rank, world_size, seconds: (heard, set()))
    mp_patch.setattr(dist, "get_rank", lambda: 0)
    mp_patch.setattr(dist, "get_world_size", lambda: 5)
    try:
        line = hangs.name_hang(error)
    finally:
        mp_patch.undo()
    assert line == ("rank 0: reduce_scatter of bucket 2 at step 7, micro-step 1 (collective #40) "
                    "failed (Connection closed by peer): ranks 2, 4 never arrived (in no "
                    "collective: busy, stuck or gone); rank 3 never arrived (waiting in "
                    "all_reduce of norm at step 7, micro-step 1 (collective #41)) (ranks 0-1 "
                    "waited)")


def test_a_rank_that_leaves_once_named_is_not_called_gone(monkeypatch):
    """Rank 0 hosts the store and stays until the others have read; the rank it named may end
    meanwhile (the test's stuck rank leaves once named, a stuck one is killed by torchrun).
    Its line says what it knew when its listening ended: never arrived, not gone (CI saw
    'rank 3 is gone' here once, from a 4-rank hang whose rank 3 left as rank 1 read)."""
    alive = {pid: True for pid in range(100, 104)}

    class Store:
        def __init__(self):
            self.kv = {f"{hangs.KEY}pid/{r}": f"{socket.gethostname()} {100 + r}".encode()
                       for r in range(4)}
            self.kv.update({f"{hangs.KEY}{r}": json.dumps(dict(seq=12)).encode() for r in (1, 2)})
            self.read = 1  # rank 2 has read; rank 1 reads just after rank 0

        def set(self, key, value):
            self.kv[key] = value.encode()

        def get(self, key):
            return self.kv[key]

        def check(self, keys):
            return all(k in self.kv for k in keys)

        def add(self, key, n):
            self.read += n
            if n and self.read == 2:  # rank 1's read comes next: rank 3, named by all, ends
                self.read, alive[103] = 3, False
                return 2
            return self.read

    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda store=Store(): store)
    monkeypatch.setattr(hangs, "_alive", lambda pid: alive[pid])
    heard, gone = hangs.exchange(dict(seq=12), 0, 4, 0.2)
    assert sorted(heard) == [0, 1, 2] and gone == set()


def test_install_takes_the_launch_point_and_nccl_gets_its_flight_recorder(monkeypatch):
    """hangs.install: collectives.launch is its own from then on, and on NCCL the Flight
    Recorder's settings are set under both names, a user's own (under either name) left
    alone; gloo gets none."""
    monkeypatch.setattr(collectives, "launch", collectives.launch)  # undone after the test
    for name in ("timeout_s", "_steady"):
        monkeypatch.setattr(hangs, name, getattr(hangs, name))
    names = [n for row in hangs.FLIGHT_RECORDER for n in row[:2]]
    env = {k: v for k, v in os.environ.items() if k not in names}
    monkeypatch.setattr(os, "environ", dict(env))
    hangs.install(7.5, "gloo")  # the first step waits the allowance
    assert collectives.launch is hangs.launch and hangs.timeout_s == hangs.START_S
    assert not set(names) & set(os.environ)
    monkeypatch.setattr(os, "environ", dict(env, TORCH_FR_BUFFER_SIZE="50"))  # the user's
    hangs.install(7200, "nccl", out_dir="/r")
    assert hangs.timeout_s == 7200
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/r/nccl_trace_rank_"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/r/nccl_trace_rank_"
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in \
        os.environ


@pytest.mark.slow
def test_train_py_under_torchrun_exits_naming_the_hang_and_its_checkpoint_resumes(
        data_root, tmp_path):
    """torchrun, 2 gloo ranks, ZeRO-2, a checkpoint every 2 steps, rank 1 stuck at step 5:
    rank 0 prints one line and exits 3 within the timeout; ckpt 4, the last before the hang,
    resumes to the end."""
    out = tmp_path / "run"
    args = TINY + ["--data-root", data_root, "--dataset", "tiny", "--zero", "2",
                   "--max-iters", "8", "--eval-interval", "100", "--save-interval", "2",
                   "--collective-timeout", "3", "--out-dir", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", "train.py"] + args + ["--hang-at", "5"]
    r = run_bounded(cmd, seconds=150)  # torchrun's start included; the hang itself: 3 + 1 s
    assert r.returncode != 0
    ours = [line for line in r.stderr.splitlines() if line.startswith("train.py: error: rank 0")]
    assert len(ours) == 1, r.stderr[-3000:]
    assert re.fullmatch(r"train.py: error: rank 0: reduce_scatter of bucket 0 at step 5, "
                        r"micro-step 0 \(collective #\d+\) (timed out after 3 s|failed \(.*\)): "
                        r"rank 1 never arrived .*", ours[0]), ours[0]
    assert 'train.py", line' not in r.stderr  # no traceback of ours
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert max(r["iter"] for r in rows if "loss" in r) == 4  # step 5 never finished
    # the last checkpoint before the hang is whole: a resume goes on from it to the end
    run_train(args + ["--resume"], 2)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    resumed = [r for r in rows if r.get("event") == "resume"]
    assert [r["iter"] for r in resumed] == [4] and "ckpt-0000004" in resumed[0]["from"]
    assert max(r["iter"] for r in rows if "loss" in r) == 7


def _named(main, argv):
    """main(argv) in a forked rank of train.py; its one line (name_hang's, or the hung rank's
    own) to OUT/line{rank}, then out at once (gloo's broken pairs behind)."""
    from configurator import UserError
    try:
        main(argv)
        line = None
    except hangs.CollectiveTimeout as e:
        line = hangs.name_hang(e)
    except UserError as e:
        line = str(e)
    out = argv[argv.index("--out-dir") + 1]
    with open(os.path.join(out, f"line{os.environ['RANK']}"), "w") as f:
        json.dump(line, f)
    os._exit(0)


@pytest.mark.slow
def test_a_hang_at_a_resumed_runs_second_step_is_named(data_root, tmp_path):
    """4 ranks at ZeRO-3 resumed from step 2, the last rank stopped at step 3, the resume's
    second step (its first waits the start-up allowance): every other rank names it within
    the timeout, the stopped rank says so."""
    from conftest import _train_rank
    args = TINY + ["--data-root", data_root, "--dataset", "tiny", "--zero", "3",
                   "--eval-interval", "100", "--out-dir", str(tmp_path)]
    run_train(args + ["--max-iters", "2"], 4)
    argv = args + ["--max-iters", "5", "--resume", "--hang-at", "3", "--collective-timeout",
                   str(TIMEOUT)]
    spawn_bounded(_train_rank, 4, (free_port(), argv, _named), seconds=120)
    for rank in range(3):
        line = json.load(open(tmp_path / f"line{rank}"))
        assert re.fullmatch(
            rf"rank {rank}: all_gather of root at step 3, micro-step 0 \(collective #\d+\) "
            rf"{TIMED_OUT}: rank 3 never arrived \(in no collective: busy, stuck or gone\) "
            rf"\(ranks 0-2 waited, --collective-timeout {TIMEOUT:g}\)", line), line
    assert json.load(open(tmp_path / "line3")).startswith("--hang-at 3: rank 3 issued no")


def test_every_group_waits_the_runs_timeout(monkeypatch):
    """Whoever made a group (dist.init_process_group, collectives.gather_group, ZeRO++'s node
    and cross-node groups): its first collective gives it the start-up allowance, its first
    after warmed_up() --collective-timeout. dist.new_group without a timeout gave ZeRO++'s
    groups torch's default (30 min on gloo, 10 on NCCL): a hang in an hpZ gather outwaited
    the flag."""
    from beyond import zeropp
    made, given = [], []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append(ranks) or tuple(ranks))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout",
                        lambda timeout, group: given.append((group, timeout)), raising=False)
    monkeypatch.setattr(dist, "set_timeout", lambda timeout, group: given.append(
        (group, timeout)), raising=False)
    done = lambda *args, **kwargs: SimpleNamespace(wait=lambda: True)  # a collective, landed
    for name in ("all_reduce", "all_to_all_single", "barrier"):
        monkeypatch.setattr(dist, name, done)
    monkeypatch.setattr(zeropp, "_node_groups", {})
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store",
                        lambda: SimpleNamespace(set=lambda key, value: None))
    monkeypatch.setattr(collectives, "launch", collectives.launch)  # undone after the test
    for name in ("timeout_s", "_steady"):
        monkeypatch.setattr(hangs, name, getattr(hangs, name))
    hangs.install(7.0)
    mine = zeropp.node_groups(4, 2, rank=1)
    assert mine == ((0, 1), (1, 3))
    assert made == [[0, 1], [2, 3], [0, 2], [1, 3]]
    x, traffic, start = torch.zeros(4), SimpleNamespace(count=lambda *a: None), hangs.START_S
    steps = []
    for _ in range(2):  # the first step, then the next after warmed_up()
        collectives.all_reduce_sum(x, 4, label="norm")
        for group in mine:
            zeropp.all_to_all(x.clone(), x, traffic, 2, group)
        steps.append(list(given))
        given.clear()
        hangs.warmed_up(4)
    seconds = lambda s: [(None, timedelta(seconds=s)), ((0, 1), timedelta(seconds=s)),
                         ((1, 3), timedelta(seconds=s))]
    assert steps == [seconds(start), seconds(7)], steps


def test_a_clean_exit_destroys_the_process_group_and_a_failed_one_leaves_it(tmp_path):
    """hangs.leave_at_exit (install registers it): at a clean interpreter exit the process
    group is destroyed while the interpreter is whole (a loop of one's own that never destroys
    it could abort at exit: docs/forking.md); after an uncaught exception it is left alone (a
    barrier would wait for peers that may never come)."""
    code = ("import atexit, sys, torch.distributed as dist\n"
            "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
            "from machinery import hangs\n"
            "hangs.install()\n"  # before the group, as train.py calls it
            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', "
            "rank=0, world_size=1)\n"
            "if sys.argv[1] == 'fail':\n    raise SystemError('a rank that failed')\n")
    for how, destroyed in (("clean", True), ("fail", False)):
        r = subprocess.run([sys.executable, "-c", code, how], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert f"initialized at exit: {not destroyed}" in r.stdout, (how, r.stdout, r.stderr)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter_tensor", "all_to_all_single", "broadcast", "broadcast_object_list",
               "barrier", "reduce_scatter_single", "all_gather_single")


def _raw_collectives(main, argv):
    """main(argv) with every torch.distributed collective the project calls, bypassing
    collectives.py, recorded with its caller once training has begun; written to OUT/rank."""
    import inspect
    raw = []

    def recording(name, f):
        def call(*args, **kwargs):
            caller = inspect.stack()[1]
            if hangs.position.step >= 0 and not caller.filename.endswith("collectives.py"):
                raw.append(f"{os.path.relpath(caller.filename, ROOT)}:{caller.lineno} {name}")
            return f(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, recording(name, getattr(dist, name)))
    main(argv)
    out = argv[argv.index("--out-dir") + 1]
    with open(os.path.join(out, f"raw{os.environ['RANK']}.json"), "w") as f:
        json.dump(raw, f)


@pytest.mark.slow
def test_every_collective_of_a_step_is_counted_and_named(data_root, tmp_path):
    """Once training has begun, every collective goes through collectives.py: counted in
    position.seq and labelled. One that bypassed it (the scaler's found-inf all-reduce, every
    step; the evaluation's; FP8's amaxes; a save's barrier; the replica check) was named 'a
    torch.distributed collective' with the next seq, which a rank that skipped a counted
    collective also reports: the two read as 'waiting together', and the culprit went unnamed."""
    args = TINY + ["--data-root", data_root, "--dataset", "tiny", "--zero", "2", "--bf16",
                   "--fp8", "--fp8-scaling", "delayed", "--n-embd", "16", "--block-size", "16",
                   "--max-iters", "3", "--eval-interval", "2", "--save-interval", "2",
                   "--out-dir", str(tmp_path)]
    run_train(args, 2, wrap=_raw_collectives)
    for rank in range(2):
        assert json.load(open(tmp_path / f"raw{rank}.json")) == [], rank
