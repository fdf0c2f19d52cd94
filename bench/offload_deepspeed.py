"""
ZeRO-Offload against DeepSpeed's own, on the CPU: ZeRO-2 with the optimizer in host memory,
2 gloo ranks, fp32, the same MLP (64 -> 256 -> 64), batches and schedule, clipping 1.0.
DeepSpeed's side is ZeRO-2 with "offload_optimizer": {"device": "cpu"}, which builds its
DeepSpeedCPUAdam; ours is beyond/offload_optimizer.py's OffloadZeRO with torch's fused AdamW.

    python -m bench.offload_deepspeed --ds-path DIR           # DIR: where deepspeed is installed
    python -m bench.offload_deepspeed --ds-path DIR --steps 40 --rounds 5
    python -m bench.offload_deepspeed --ds-path DIR --model gpt --bf16
    python -m bench.offload_deepspeed --ds-path DIR --model gpt --bf16 --clip 0   # no clipping
    python -m bench.offload_deepspeed --ds-path DIR --model gpt --bf16 --ds-adam torch

--model gpt trains our GPT (model.py, 2 layers of 64, shakespeare_char's batches as train.py
draws them) instead of the MLP; --bf16 runs both sides in bf16: DeepSpeed casts the module to
bf16 itself ("bf16": {"enabled": true}) and makes its fp32 master from those bf16 weights, so
ours does the same (the model cast first, no master_weights=: a 16-bit master, PITFALLS 24,
on both sides alike). --ds-adam torch steps DeepSpeed's side with torch's fused AdamW, ours,
instead of its DeepSpeedCPUAdam ("zero_force_ds_cpu_optimizer": false): with --clip 0 too,
what is left to differ is DeepSpeed's own arithmetic around the optimizer.

DeepSpeed is not a requirement of this repository: install it apart, for example with
`pip install --target DIR --no-deps deepspeed hjson ninja py-cpuinfo pydantic psutil msgpack
einops` (it builds its CPU Adam and shared-memory ops the first time, minutes). Each round
runs both sides, in alternating order, as torchrun processes. Printed: the largest loss
difference per step, and ms per step ours / DeepSpeed (the median over steps after 3 of
warm-up, the median over rounds).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, HIDDEN, BATCH, LR, CLIP, WARM = 64, 256, 16, 1e-2, 1.0, 3
LRS = {"mlp": LR, "gpt": 1e-3}  # the GPT at train.py's lr: at 1e-2 its loss spikes, and the
# spikes grow a last-bit difference of the two AdamW kernels to 1e-2 within 20 steps


def mlp():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, WIDTH))


def gpt():
    import torch
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=65,
                         dropout=0.0, bias=False))


def batches(steps, rank, world_size, kind):
    """Each step's (x, y) slice of this rank: the same global batch on both sides (gpt: of
    shakespeare_char, as data/loader.py draws it for train.py)."""
    import numpy as np
    import torch
    from data.loader import get_batch
    g = torch.Generator().manual_seed(1)
    per = BATCH // world_size
    data = np.memmap(os.path.join(ROOT, "data", "shakespeare_char", "train.bin"),
                     dtype=np.uint16, mode="r") if kind == "gpt" else None
    for step in range(steps):
        if kind == "gpt":
            yield get_batch(data, 1337, step, 0, rank, world_size, per, 32, 1)
            continue
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
        yield x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_of(model, x, y, kind):
    import torch
    return model(x, y)[1] if kind == "gpt" else torch.nn.functional.mse_loss(model(x), y)


def ours(steps, kind, bf16, clip):
    import torch
    import torch.distributed as dist
    from beyond.offload_optimizer import OffloadZeRO
    from precision import GradScaler
    from train import update
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = gpt() if kind == "gpt" else mlp()
    if bf16:  # the master from the bf16 weights, as DeepSpeed makes its own
        model = model.to(torch.bfloat16)
    zero = OffloadZeRO(model, 2, lr=LRS[kind], betas=(0.9, 0.95), weight_decay=0.0, rank=rank,
                       world_size=world_size)
    scaler = GradScaler(init_scale=1.0, dynamic=False)
    losses, ms = [], []
    for x, y in batches(steps, rank, world_size, kind):
        t = time.perf_counter()
        if bf16 and kind == "mlp":
            x, y = x.bfloat16(), y.bfloat16()
        loss = loss_of(model, x, y, kind)
        zero.backward(loss)
        update(zero, scaler, LRS[kind], clip)
        zero.wait_published()
        ms.append((time.perf_counter() - t) * 1000)
        losses.append(loss.item())
    return losses, ms


def deepspeed_side(steps, kind, bf16, clip, ds_adam="deepspeed"):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    model = gpt() if kind == "gpt" else mlp()
    cfg = {"train_micro_batch_size_per_gpu": BATCH // int(os.environ["WORLD_SIZE"]),
           "gradient_clipping": clip, "steps_per_print": 10**9, "bf16": {"enabled": bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": LRS[kind], "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    opt = None
    if ds_adam == "torch":  # ours, in DeepSpeed's place: its kernel out of the comparison
        import torch
        del cfg["optimizer"]
        cfg["zero_force_ds_cpu_optimizer"] = False
        opt = torch.optim.AdamW(model.parameters(), lr=LRS[kind], betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.0, fused=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg, optimizer=opt)
    losses, ms = [], []
    for x, y in batches(steps, engine.global_rank, engine.world_size, kind):
        t = time.perf_counter()
        if bf16 and kind == "mlp":
            x, y = x.bfloat16(), y.bfloat16()
        loss = loss_of(engine, x, y, kind)
        engine.backward(loss)
        engine.step()
        ms.append((time.perf_counter() - t) * 1000)
        losses.append(loss.item())
    return losses, ms


def worker(side, steps, out, kind, bf16, clip, ds_adam):
    import torch
    torch.set_num_threads(1)
    if side == "ours":
        losses, ms = ours(steps, kind, bf16, clip)
    else:
        losses, ms = deepspeed_side(steps, kind, bf16, clip, ds_adam)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "ms": ms}, f)
    import torch.distributed as dist
    dist.barrier()  # leave together: a rank exiting under gloo's threads can abort the other
    dist.destroy_process_group()


def run_side(side, steps, ds_path, port, kind="mlp", bf16=False, clip=CLIP,
             ds_adam="deepspeed"):
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([ROOT, ds_path]),
               PATH=os.pathsep.join([os.path.join(ds_path, "bin"), os.environ["PATH"]]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={port}", os.path.abspath(__file__), "--worker", side,
           "--steps", str(steps), "--out", out, "--model", kind, "--clip", str(clip),
           "--ds-adam", ds_adam] + (["--bf16"] if bf16 else [])
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{side} failed:\n{r.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="python -m bench.offload_deepspeed",
                                description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--ds-path", default="", help="the folder deepspeed is installed in")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--bf16", action="store_true", help="both sides in bf16 (fp32 masters)")
    p.add_argument("--clip", type=float, default=CLIP,
                   help="the gradient norm both sides clip to (0: no clipping)")
    p.add_argument("--ds-adam", choices=("deepspeed", "torch"), default="deepspeed",
                   help="DeepSpeed's side steps with its DeepSpeedCPUAdam, or torch's fused AdamW")
    p.add_argument("--worker", choices=("ours", "deepspeed"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.steps, a.out, a.model, a.bf16, a.clip, a.ds_adam)
    import socket
    ratios, diffs = [], None
    for i in range(a.rounds):
        runs = {}
        for side in ("ours", "deepspeed") if i % 2 == 0 else ("deepspeed", "ours"):
            with socket.socket() as s:  # a free port for this pair of ranks
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            runs[side] = run_side(side, a.steps, a.ds_path, port, a.model, a.bf16, a.clip,
                                  a.ds_adam)
        diffs = [abs(o - d) for o, d in zip(runs["ours"]["losses"], runs["deepspeed"]["losses"])]
        ms = {k: statistics.median(v["ms"][WARM:]) for k, v in runs.items()}
        ratios.append(ms["ours"] / ms["deepspeed"])
        print(f"round {i + 1}: ours {ms['ours']:.2f} ms a step, DeepSpeed {ms['deepspeed']:.2f}"
              f" ms: {ratios[-1]:.2f}")
    print("loss, ours and DeepSpeed's, per step:")
    for step, (o, d) in enumerate(zip(runs["ours"]["losses"], runs["deepspeed"]["losses"])):
        print(f"  {step:>3}  {o:.16f}  {d:.16f}  {abs(o - d):.1e}")
    print(f"largest loss difference {max(diffs):.2e}; ms per step ours / DeepSpeed: median "
          f"{statistics.median(ratios):.2f} over {a.rounds} rounds")


if __name__ == "__main__":
    main()
