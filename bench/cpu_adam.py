"""
The CPU step of --offload-optimizer (beyond/offload_optimizer.py): torch's AdamW on the host,
in elements per second per core, three ways: fused=True (one kernel over every tensor),
foreach (multi-tensor ops, a pass per op) and per-tensor (a Python loop, a pass per op per
tensor). Best of --repeats steps on flat fp32 buffers of --numel (64 tensors for per-tensor).

    python -m bench.cpu_adam                         # 1 thread, then every core
    python -m bench.cpu_adam --numel 16777216 --threads 1,2
    python -m bench.cpu_adam --ds-path DIR           # and DeepSpeedCPUAdam, installed in DIR

It also says whether each gives the same bits as fused (the engine's choice, optim.build):
the offloaded engine equals the resident one only with the same kernel. --ds-path adds
DeepSpeed's own CPU Adam (ZeRO-Offload's kernel, AVX-512 / AVX2 C++ built at first use:
minutes), in AdamW mode on the same flat buffer; DeepSpeed is not a requirement of this
repository (install it apart as bench/offload_deepspeed.py says).
"""
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.common import comma_list, parser

KINDS = {"fused": {"fused": True}, "foreach": {"foreach": True},
         "per-tensor": {"foreach": False}}


def adamw_rate(kind, numel, repeats, pieces=64):
    """(elements per second, the weights after repeats + 1 steps) of one AdamW kind."""
    g = torch.Generator().manual_seed(0)
    n = numel // pieces * pieces
    params = [t.clone() for t in torch.randn(n, generator=g).split(n // pieces)]
    grads = list(torch.randn(n, generator=g).split(n // pieces))
    if kind != "per-tensor":  # one flat tensor, as the engine's master slice of a bucket
        params, grads = [torch.cat(params)], [torch.cat(grads)]
    for p, grad in zip(params, grads):
        p.grad = grad
    if kind == "DeepSpeedCPUAdam":  # ZeRO-Offload's kernel, AdamW's decoupled decay
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(params, lr=1e-3, weight_decay=0.1, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **KINDS[kind])
    opt.step()  # the state is made here: not timed
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t)
    return n / best, torch.cat([p.detach().reshape(-1) for p in params])


def main(argv=None):
    p = parser("cpu_adam", __doc__, writes=False)
    p.add_argument("--numel", type=int, default=2**22, help="elements stepped")
    p.add_argument("--repeats", type=int, default=5, help="timed steps (the best counts)")
    p.add_argument("--threads", default=f"1,{os.cpu_count()}", help="thread counts to try")
    p.add_argument("--ds-path", help="a folder where deepspeed is installed: DeepSpeedCPUAdam too")
    a = p.parse_args(argv)
    threads = comma_list(p, "--threads", a.threads, kind=int)
    kinds = list(KINDS)
    if a.ds_path:
        if not os.path.isdir(os.path.join(a.ds_path, "deepspeed")):
            p.error(f"--ds-path {a.ds_path}: no deepspeed package there (pip install --target)")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        sys.path.insert(0, a.ds_path)
        kinds.append("DeepSpeedCPUAdam")
    print(f"torch {torch.__version__}, AdamW on {a.numel:,} fp32 elements, "
          f"{os.cpu_count()} cores visible")
    for n in threads:
        torch.set_num_threads(n)
        results = {kind: adamw_rate(kind, a.numel, a.repeats) for kind in kinds}
        for kind, (rate, weights) in results.items():
            same = torch.equal(weights, results["fused"][1])
            print(f"  {n:>2} thread(s)  {kind:16} {rate / 1e6:8.1f} M elements/s, "
                  f"{rate / n / 1e6:8.1f} per core; bits {'=' if same else '!='} fused")


if __name__ == "__main__":
    main()
