"""Shared test helpers: a free port and a way to run a function on N gloo ranks.

Multi-process tests spawn real processes (torch.multiprocessing) on the gloo backend, each
on a port the OS hands out, never a fixed one. Group several checks into one spawned
function: starting processes is the slow part.
"""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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
    dist.barrier()  # leave together: gloo can abort a rank that tears down while a peer still works
    dist.destroy_process_group()


def run_distributed(fn, world_size, *args):
    """Run fn(rank, world_size, *args) on world_size gloo processes; an exception in any
    rank fails the test. fn must be a module-level function (it is pickled)."""
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       join=True, start_method="spawn")


@pytest.fixture
def port():
    return free_port()
