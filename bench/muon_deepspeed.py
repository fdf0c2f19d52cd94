"""
Muon at ZeRO-3 against DeepSpeed's, on the CPU: our GPT, 2 gloo ranks, fp32, the same
batches of shakespeare_char and the same hyperparameters. Ours is beyond/muon.py's
WholeZeRO3 (each block matrix dealt whole to one rank: no communication of its own);
DeepSpeed's is ZeRO-3 with "optimizer": {"type": "Muon"} (its stage 3 all-gathers each Muon
matrix's gradient and momentum, orthogonalises round robin, all-gathers the updates).

    python -m bench.muon_deepspeed --ds-path DIR              # DIR: where deepspeed is installed
    python -m bench.muon_deepspeed --ds-path DIR --ns gram    # DeepSpeed's own default variant

DeepSpeed is not a requirement of this repository: install it apart, for example with
`pip install --target DIR --no-deps deepspeed hjson ninja py-cpuinfo pydantic psutil msgpack
einops`. Both sides run eager (TORCHDYNAMO_DISABLE=1: DeepSpeed wraps muon_update in
torch.compile, which recompiles per shape and fuses the iteration into other roundings).

What is pinned so that both compute one Muon (--ns pinned, the default):
  - the Newton-Schulz variant: DeepSpeed's stage 3 defaults to "gram" (Tri Dao's Gram
    iteration, in fp16 where the accelerator has it, with a restart at step 2); pinned is its
    "standard" quintic, the one beyond/muon.py runs, with its compute dtype (bf16 on a CPU
    accelerator: original_muon.ns_compute_dtype) set to fp32, ours. --ns gram / standard
    leave DeepSpeed's choice as it is: the difference they make, measured
  - the update's size: DeepSpeed scales the orthogonal factor by sqrt(max(1, rows / cols))
    (Jordan's), we by 0.2 * sqrt(max(rows, cols)) (Moonlight's, to share AdamW's lr). Each
    matrix shape gets a param group of its own whose lr is ours times the ratio, and whose
    weight decay keeps lr * wd ours
  - which tensors Muon steps: DeepSpeed tags every >= 2-D parameter whose name lacks "embed"
    or "lm_head", GPT's wte and wpe included; re-tagged here to beyond.muon.block_matrices
  - no clipping: DeepSpeed's stage 3 takes the norm over the Muon update it has already
    written into the gradient partitions (_apply_muon_to_accumulated_grads), we over the
    gradient, before Muon: different arithmetic whenever a clip fires
Not pinned: AdamW for the embeddings and gains (DeepSpeed's MuonWithAuxAdam steps them with
its FusedAdam, here its CPU build, ours with torch's fused AdamW: last-bit differences), and
the order of the rounding in lr * scale * O. Each round runs both sides, in alternating order, as
torchrun processes; printed: the loss per step and its difference, and ms per step ours /
DeepSpeed's (the median over steps after 3 of warm-up, the median over rounds).
"""
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=65, dropout=0.0,
             bias=False)
BATCH, LR, WD, BETAS, EPS, MOMENTUM, WARM = 8, 2e-3, 0.1, (0.9, 0.95), 1e-8, 0.95, 3


def gpt():
    import torch
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**SHAPE))


def batches(steps, rank, world_size):
    """Each step's slice of this rank: the same global batch of BATCH sequences on both sides,
    drawn as train.py draws them (data/loader.py)."""
    import numpy as np
    from data.loader import get_batch
    data = np.memmap(os.path.join(ROOT, "data", "shakespeare_char", "train.bin"),
                     dtype=np.uint16, mode="r")
    for step in range(steps):
        yield get_batch(data, 1337, step, 0, rank, world_size, BATCH // world_size,
                        SHAPE["block_size"], 1)


def ours(steps):
    import torch.distributed as dist
    from beyond.muon import WholeZeRO3
    from precision import GradScaler
    from train import update
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = gpt()
    zero = WholeZeRO3(model, 3, optimizer="muon", lr=LR, betas=BETAS, eps=EPS,
                      weight_decay=WD, rank=rank, world_size=world_size)
    scaler = GradScaler(init_scale=1.0, dynamic=False)
    losses, ms = [], []
    for x, y in batches(steps, rank, world_size):
        t = time.perf_counter()
        loss = model(x, y)[1]
        zero.backward(loss)
        update(zero, scaler, LR, 0.0)  # no clipping (the docstring says why)
        zero.wait_published()
        ms.append((time.perf_counter() - t) * 1000)
        losses.append(loss.item())
    return losses, ms


def deepspeed_groups(model):
    """DeepSpeed's param groups, set to our arithmetic: AdamW's two (weight decay on the
    embeddings, not on the gains), and one Muon group a matrix shape, whose lr turns
    DeepSpeed's scale sqrt(max(1, r / c)) into ours, 0.2 * sqrt(max(r, c))."""
    from beyond.muon import block_matrices
    mats = block_matrices(model)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if id(p) not in mats and p.dim() >= 2],
               "weight_decay": WD},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    for shape in sorted({tuple(p.shape) for p in params if id(p) in mats}):
        rows, cols = shape
        lr = LR * 0.2 * math.sqrt(max(rows, cols)) / math.sqrt(max(1.0, rows / cols))
        groups.append({"params": [p for p in params if id(p) in mats and p.shape == shape],
                       "lr": lr, "weight_decay": WD * LR / lr})
    return groups


def deepspeed_side(steps, ns):
    import deepspeed
    import torch
    from beyond.muon import block_matrices
    from deepspeed.runtime.zero.muon import original_muon
    if ns == "pinned":  # the standard quintic, in fp32: beyond/muon.py's newton_schulz
        original_muon.ns_compute_dtype = lambda method="gram": torch.float32
    tag = deepspeed.set_optimizer_flags

    def our_tags(config, model):  # Muon for the block matrices, AdamW for wte and wpe too
        tag(config, model)
        mats = block_matrices(model)
        for p in model.parameters():
            p.use_muon = id(p) in mats

    deepspeed.set_optimizer_flags = our_tags
    deepspeed.init_distributed(dist_backend="gloo")
    model = gpt()
    cfg = {"train_micro_batch_size_per_gpu": BATCH // int(os.environ["WORLD_SIZE"]),
           "gradient_clipping": 0.0, "steps_per_print": 10**9,
           "optimizer": {"type": "Muon", "params": {
               "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
               "momentum": MOMENTUM, "ns_method": "gram" if ns == "gram" else "standard"}},
           "zero_optimization": {"stage": 3, "reduce_scatter": False}}  # Muon refuses it
    engine, *_ = deepspeed.initialize(model=model, model_parameters=deepspeed_groups(model),
                                      config=cfg)
    losses, ms = [], []
    for x, y in batches(steps, engine.global_rank, engine.world_size):
        t = time.perf_counter()
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        ms.append((time.perf_counter() - t) * 1000)
        losses.append(loss.item())
    return losses, ms


def worker(side, steps, ns, out):
    import torch
    torch.set_num_threads(1)
    losses, ms = ours(steps) if side == "ours" else deepspeed_side(steps, ns)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "ms": ms}, f)
    import torch.distributed as dist
    dist.barrier()  # leave together: a rank exiting under gloo's threads can abort the other
    dist.destroy_process_group()


def run_side(side, steps, ns, ds_path, port):
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join([ROOT, ds_path]),
               PATH=os.pathsep.join([os.path.join(ds_path, "bin"), os.environ["PATH"]]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={port}", os.path.abspath(__file__), "--worker", side,
           "--steps", str(steps), "--ns", ns, "--out", out]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{side} failed:\n{r.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    import argparse
    import socket
    p = argparse.ArgumentParser(prog="python -m bench.muon_deepspeed",
                                description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--ds-path", default="", help="the folder deepspeed is installed in")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ns", choices=("pinned", "standard", "gram"), default="pinned",
                   help="DeepSpeed's Newton-Schulz: ours (standard, fp32), or its own choice")
    p.add_argument("--worker", choices=("ours", "deepspeed"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.steps, a.ns, a.out)
    if a.steps <= WARM or a.rounds < 1:
        p.error(f"--steps {a.steps} --rounds {a.rounds}: more than {WARM} steps, 1 round or more")
    ratios, runs = [], {}
    for i in range(a.rounds):
        for side in ("ours", "deepspeed") if i % 2 == 0 else ("deepspeed", "ours"):
            with socket.socket() as s:  # a free port for this pair of ranks
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            runs[side] = run_side(side, a.steps, a.ns, a.ds_path, port)
        ms = {k: statistics.median(v["ms"][WARM:]) for k, v in runs.items()}
        ratios.append(ms["ours"] / ms["deepspeed"])
        print(f"round {i + 1}: ours {ms['ours']:.2f} ms a step, DeepSpeed {ms['deepspeed']:.2f}"
              f" ms: {ratios[-1]:.2f}", flush=True)
    pairs = list(zip(runs["ours"]["losses"], runs["deepspeed"]["losses"]))
    print(f"loss, ours and DeepSpeed's (--ns {a.ns}), per step:")
    for step, (o, d) in enumerate(pairs):
        print(f"  {step:>3}  {o:.10f}  {d:.10f}  {o - d:+.1e}")
    diffs = [abs(o - d) for o, d in pairs]
    print(f"largest loss difference {max(diffs):.2e} (last step {diffs[-1]:.2e}); ms per step "
          f"ours / DeepSpeed: median {statistics.median(ratios):.2f} over {a.rounds} rounds")


if __name__ == "__main__":
    main()
