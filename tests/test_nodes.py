"""Two nodes that share no disk, on one machine: each "node" in its own working directory with
its own data root and its own (relative) --out-dir, and one rank with LOCAL_RANK 0. Under
torchrun (--nnodes 2, rendezvous on localhost) each node prepares the data itself and the run
trains and saves. Ranks forked as train_rank starts them (faster) then resume: from a
checkpoint only node 0 holds, every rank stops with the same one line; with it copied to
node 1, both resume from the checkpoint rank 0 chose. Before, node 1's rank exited in silence
while node 0's waited in a collective, and a resume sent the ranks into different
collectives: each would hang."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, free_port, run_train

ARGS = ["--device", "cpu", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--block-size", "16", "--batch-size", "2", "--eval-iters", "1", "--eval-interval",
        "100", "--log-interval", "1", "--dataset", "shakespeare_char", "--out-dir", "out"]


@pytest.mark.slow
def test_two_nodes_under_torchrun_prepare_their_own_data(tmp_path):
    port, procs = free_port(), []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc_per_node=1", f"--node_rank={node}", "--master_addr=127.0.0.1",
               f"--master_port={port}", os.path.join(ROOT, "train.py"), *ARGS,
               "--max-iters", "2", "--data-root", str(cwd / "data")]
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))
    try:
        runs = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("the two nodes hung")
    finally:
        for p in procs:
            p.kill()
            p.stderr.close()
    assert [code for code, _ in runs] == [0, 0], runs
    for node in (0, 1):  # each node's first rank prepared the built-in data set
        assert (tmp_path / f"node{node}" / "data" / "shakespeare_char" / "val.bin").is_file()
    assert (tmp_path / "node0" / "out" / "ckpt-0000002").is_dir()  # rank 0 saved, on node 0
    assert not (tmp_path / "node1" / "out").exists()


def as_two_nodes(main, argv):
    """In a forked rank: its own node (working directory, data root, LOCAL_RANK 0); the line
    of a refused run goes to a file beside it."""
    base, rank = argv[-1], os.environ["RANK"]
    node = os.path.join(base, f"node{rank}")
    os.makedirs(node, exist_ok=True)
    os.chdir(node)
    os.environ["LOCAL_RANK"] = "0"
    try:
        main(argv[:-1] + ["--data-root", os.path.join(node, "data")])
    except Exception as e:  # every rank must raise the same one line
        with open("error.txt", "w") as f:
            f.write(f"{type(e).__name__}: {e}")


def test_resume_from_a_checkpoint_one_node_lacks(tmp_path):
    base = str(tmp_path)
    run_train(ARGS + ["--max-iters", "4", base], 2, wrap=as_two_nodes)
    assert not os.path.exists(os.path.join(base, "node0", "error.txt"))
    run_train(ARGS + ["--max-iters", "6", "--resume", base], 2, wrap=as_two_nodes)
    lines = [open(os.path.join(base, f"node{r}", "error.txt")).read() for r in (0, 1)]
    assert lines == ["UserError: rank 1 of 2: no checkpoint at out/ckpt-0000004; every "
                     "rank reads the checkpoint it resumes from: copy it into each node's "
                     "--out-dir, or put --out-dir on a disk the nodes share"] * 2
    for r in (0, 1):
        os.remove(os.path.join(base, f"node{r}", "error.txt"))
    # copied to node 1, the checkpoint rank 0 chose resumes on both
    shutil.copytree(tmp_path / "node0" / "out" / "ckpt-0000004",
                    tmp_path / "node1" / "out" / "ckpt-0000004")
    run_train(ARGS + ["--max-iters", "6", "--resume", base], 2, wrap=as_two_nodes)
    assert not any(os.path.exists(os.path.join(base, f"node{r}", "error.txt")) for r in (0, 1))
    rows = [json.loads(line) for line in open(tmp_path / "node0" / "out" / "metrics.jsonl")]
    assert [r["iter"] for r in rows if r.get("event") == "resume"] == [4]
    assert sorted(r["iter"] for r in rows if "loss" in r) == list(range(6))
