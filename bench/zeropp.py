"""
ZeRO++ on 4 gloo ranks standing for 2 nodes x 2: bytes per step by collective and link beside
the paper's volumes, the val loss after N steps beside plain ZeRO-3, the step time here, and
what the measured bytes would cost on a cluster (an estimate).

    python -m bench.zeropp                                   # 200 steps a row, bf16, seed 1337
    python -m bench.zeropp --steps 20 --seeds 1 --no-write   # a smoke run

Each row is train.py under torchrun (--zero 3 --node-size 2 --zeropp ...), read back from its
metrics.jsonl. One host has no slow link: the step time here shows what quantization costs in
compute, not what it saves on a wire. BENCHMARKS.md's "zeropp" section says how it measures.
"""
import os
import socket
import statistics
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Stopwatch, comma_list, command, parser, report, run_train, table
from beyond.zeropp import expected_by_link, expected_bytes

ROWS = [("ZeRO-3", "", 4), ("+qwz", "qwz", 4), ("+hpz", "hpz", 4), ("+qgz (int4)", "qgz", 4),
        ("all (int4)", "qwz,hpz,qgz", 4), ("all (int8 gradients)", "qwz,hpz,qgz", 8)]
RANKS, NODE = 4, 2
# the cluster of the estimate: 8 GPUs a node on NVLink, nodes on one link each
GPUS_PER_NODE, NVLINK_GBS = 8, 450.0  # GB/s per GPU and direction (H100 NVLink 4: 900 both ways)
NODE_LINKS_GBITS = (100, 400)  # Gb/s per node, shared by its 8 GPUs' cross-node bytes
MODELS = {"GPT-2 124M": 124e6, "7B": 7e9}


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(zeropp, bits, seed, steps, dtype, tmp):
    """One row's train.py run: its metrics.jsonl rows."""
    flags = ["--device", "cpu", "--zero", "3", "--node-size", str(NODE), "--dtype", dtype,
             "--max-iters", str(steps), "--lr-decay-iters", str(steps), "--warmup-iters",
             str(min(100, steps // 10)), "--eval-interval", str(steps), "--eval-iters", "20",
             "--log-interval", "10", "--seed", str(seed), "--qgz-bits", str(bits)]
    flags += ["--zeropp", zeropp] if zeropp else []
    launcher = ["-m", "torch.distributed.run", f"--nproc_per_node={RANKS}",
                f"--master_port={free_port()}"]
    out = os.path.join(tmp, f"{zeropp or 'zero3'}-{bits}-{seed}")
    return run_train(flags, out, launcher, threads=1)


def summarize(rows):
    """(bytes by collective/link of a step, val loss at the end, median ms per step, Ψ)."""
    steps = [r for r in rows if "comm_by" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    psi = [r["psi"] for r in rows if r.get("event") == "model_state"][0]
    return steps[0]["comm_by"], val, statistics.median(r["ms"] for r in steps[1:]), psi


def cluster_ms(intra, inter, psi_here, psi):
    """ms per micro-step of a model of psi parameters moving our measured bytes per parameter:
    intra-node bytes at NVLink speed, cross-node bytes (8 GPUs' worth through the node's one
    link), no overlap. {link Gb/s: ms}."""
    scale = psi / psi_here
    nvlink = intra * scale / (NVLINK_GBS * 1e9)
    return {g: 1e3 * (nvlink + GPUS_PER_NODE * inter * scale / (g / 8 * 1e9))
            for g in NODE_LINKS_GBITS}


def theory_ratio(parts, bits, psi):
    plain = expected_by_link(psi, RANKS, NODE)["inter"]
    return expected_by_link(psi, RANKS, NODE, parts, qgz_bits=bits)["inter"] / plain


def main(argv=None):
    p = parser("zeropp", __doc__)
    p.add_argument("--steps", type=int, default=200, help="training steps per row")
    p.add_argument("--seeds", default="1337", help="comma list of seeds; each row runs each")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                   help="working precision (the paper's: 16 bits)")
    args = p.parse_args(argv)
    seeds = comma_list(p, "--seeds", args.seeds, kind=int)
    if args.steps < 20:
        p.error("--steps: at least 20 (the step time is the median of logged steps)")
    watch, found = Stopwatch(), {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, zeropp, bits in ROWS:
            for seed in seeds:
                found[name, seed] = summarize(run_row(zeropp, bits, seed, args.steps,
                                                      args.dtype, tmp))
                print(f"{name}, seed {seed}: val loss {found[name, seed][1]:.4f}", flush=True)
    body, numbers = tables(found, seeds, args)
    report(command("zeropp", argv), "zeropp", body, numbers, watch, not args.no_write,
           "ZeRO++ on 4 ranks as 2 nodes x 2")


def tables(found, seeds, args):
    """The two markdown tables: bytes and loss here; the cluster estimate."""
    first = seeds[0]
    plain_by, _, _, psi = found["ZeRO-3", first]
    link = lambda by, which: sum(v for k, v in by.items() if k.endswith(which))
    plain_inter = link(plain_by, "inter")
    rows, cluster = [], []
    for name, zeropp, bits in ROWS:
        by, _, _, _ = found[name, first]
        parts = tuple(zeropp.split(",")) if zeropp else ()
        vals = [found[name, s][1] for s in seeds]
        plain_vals = [found["ZeRO-3", s][1] for s in seeds]
        delta = statistics.mean((v - q) / q for v, q in zip(vals, plain_vals))
        ms = statistics.median(found[name, s][2] for s in seeds)
        kib = lambda key: f"{by.get(key, 0) / 1024:.0f}"
        rows.append([name, kib("all_gather/inter"), kib("all_gather/intra"),
                     kib("reduce_scatter/inter"), kib("all_to_all/inter"),
                     kib("all_to_all/intra"), f"{link(by, 'inter') / plain_inter:.3f}",
                     f"{theory_ratio(parts, bits, psi):.3f}",
                     " / ".join(f"{v:.4f}" for v in vals), f"{delta:+.2%}", f"{ms:.0f}"])
        for model, n in MODELS.items():
            est = cluster_ms(link(by, "intra"), link(by, "inter"), psi, n)
            cluster.append([name, model] + [f"{est[g]:,.0f}" for g in NODE_LINKS_GBITS])
    head = ["row", "all-gather inter KiB", "all-gather intra KiB", "reduce-scatter inter KiB",
            "all-to-all inter KiB", "all-to-all intra KiB", "inter / ZeRO-3 (measured)",
            "inter / ZeRO-3 (expected)", f"val loss @{args.steps} (seeds {args.seeds})",
            "vs ZeRO-3", "ms/step here"]
    est_head = ["row", "model"] + [f"est. ms/micro-step, nodes at {g} Gb/s"
                                   for g in NODE_LINKS_GBITS]
    theory = ", ".join(f"{k[0]} {k[1]} {v / psi:.2f}Ψ" for k, v in
                       expected_bytes(psi, RANKS, NODE, ("qwz", "hpz", "qgz")).items())
    numbers = (f"Ψ = {psi:,} (the CPU demo model), {args.dtype}, 4 ranks as 2 nodes x 2, one "
               f"micro-step a step; bytes of one step of one rank, as zeropp.LinkTraffic counts "
               f"them. Expected for all three with int4 (zeropp.expected_bytes: the paper's "
               f"volumes, counted as we count): {theory}.\n\n"
               f"**Estimate, not a measurement**: the measured bytes per parameter scaled to "
               f"each model, on {GPUS_PER_NODE} GPUs a node at {NVLINK_GBS:.0f} GB/s NVLink "
               f"per GPU, the node's cross-node bytes ({GPUS_PER_NODE} GPUs' worth) through one "
               f"link, no overlap with compute; our k = {NODE} volumes (at k = 8 qgZ's "
               f"cross-node hop is 4x smaller still).\n\n" + table(est_head, cluster))
    return table(head, rows), numbers


if __name__ == "__main__":
    main()
