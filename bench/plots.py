"""
The README's charts, drawn from a costs run (matplotlib, an optional dependency):
figures/memory.png (the bytes each rank holds, stacked by kind, per dtype), traffic.png
(elements sent per step, measured beside the ZeRO paper) and loss.png (metrics.jsonl curves).

    python -m bench.costs --plot                         # measure, then draw
    python -m bench.costs --save costs.json              # measure and keep the results ...
    python -m bench.plots --costs costs.json             # ... then (re)draw them
    python -m bench.plots --costs costs.json --runs out-a out-b   # your own runs' loss curves
    python -m bench.plots --timeline out/trace           # a train.py --trace run's timeline

Without --runs the loss curves come from short train.py runs of every stage on the costs run's
ranks (the same seed and batches: ZeRO changes nothing, so the curves lie on one another).
"""
import importlib.util
import json
import os
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from bench.common import ROOT, parser, read_metrics, run_train
from zero import traffic_formula

PARTS = (("params", "weights"), ("grads", "gradients"), ("master", "fp32 master"),
         ("optimizer", "Adam moments"), ("act", "activations (one micro-step)"))
# memory.py --advise's order: each ZeRO stage, then activation checkpointing, LoRA, QLoRA
LADDER = ["ddp", "s0", "s1", "s2", "s3", "s3+ckpt", "s3+ckpt+lora", "s3+ckpt+qlora"]
TICKS = {"ckpt": "ckpt", "lora": "LoRA", "qlora": "QLoRA"}


def add_plot_flags(p, switch=True):
    """--plot (when switch), --plot-dir, --runs, --curve-iters."""
    if switch:
        p.add_argument("--plot", action="store_true", help="also draw the PNG charts "
                       "(needs matplotlib)")
    p.add_argument("--plot-dir", default="figures", help="where the charts go")
    p.add_argument("--runs", nargs="+", metavar="OUT_DIR", help="--plot: the loss curves of "
                   "these runs' metrics.jsonl (default: a short train.py run per stage)")
    p.add_argument("--curve-iters", type=int, default=300,
                   help="--plot: steps of each stage's loss-curve run")


def check_plot_flags(p, args, switch=True):
    """Errors in the charts' flags, and a missing matplotlib, before any long run. switch: p
    has --plot (else it always draws)."""
    if switch and args.runs and not args.plot:
        p.error("--runs: the loss curves of --plot; add --plot")
    if switch and not args.plot:
        return
    missing = [d for d in args.runs or [] if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        p.error(f"--runs: no metrics.jsonl in {', '.join(missing)}")
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit(f"{p.prog}: error: the charts are drawn with matplotlib, an optional "
                 "dependency: .venv/bin/pip install matplotlib"
                 + (" (or run without --plot)" if switch else ""))


def loss_curves(runs, stages, world_size, dtype, iters):
    """{label: metrics.jsonl rows}: of the given run folders, or of a short train.py run of each
    stage on world_size ranks."""
    curves = {}
    if runs:
        for folder in runs:
            curves[os.path.basename(os.path.normpath(folder))] = read_metrics(folder)
        return curves
    preset = ["--config", "config/shakespeare_char.py"] if torch.cuda.is_available() else []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            launcher = ["-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={world_size}"]
            flags = [*preset, "--zero", str(stage), "--dtype", dtype, "--max-iters", str(iters),
                     "--log-interval", "5", "--eval-interval", str(max(1, iters // 4)),
                     "--eval-iters", "20"]
            print(" ".join(launcher + ["train.py"] + flags), flush=True)
            rows = run_train(flags, os.path.join(tmp, f"zero{stage}"), launcher)
            curves[f"ZeRO-{stage}, {dtype}, N={world_size}"] = rows
    return curves


def memory_chart(plt, costs):
    """Stacked bytes per rank of the ladder's configurations, one panel per dtype."""
    results = costs["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, res in zip(axes[0], results):
        keys = [k for k in LADDER if k in res["info"]]
        bottom = np.zeros(len(keys))
        for part, label in PARTS:
            held = []
            for k in keys:
                info = res["info"][k]
                held.append((info.get("act") if part == "act" else info["bytes"][part]) or 0)
            mib = np.array(held) / 2**20
            ax.bar(range(len(keys)), mib, bottom=bottom, label=label)
            bottom += mib
        for x, top in enumerate(bottom):
            ax.text(x, top, f"{top:.1f}", ha="center", va="bottom", fontsize=8)
        ddp = "DDP\n(fp32 +\nautocast)" if res["dtype"] != "fp32" else "DDP"
        ticks = [ddp if k == "ddp" else "\n+ ".join([f"ZeRO-{k[1]}"] +
                 [TICKS[p] for p in k.split("+")[1:]]) for k in keys]
        ax.set_xticks(range(len(keys)), ticks, fontsize=8)
        ax.set_ylabel("MiB per rank")
        ax.set_title(f"{res['dtype']}, N={costs['world_size']}, Ψ={res['psi']:,}")
        ax.legend(fontsize=8)
    fig.suptitle("Memory per rank, measured\n"
                 "(each ZeRO stage, then activation checkpointing, LoRA, QLoRA)")
    return fig


def traffic_chart(plt, costs):
    """Elements sent per rank per step, measured beside the paper, for the plain stages."""
    res, world_size = costs["results"][0], costs["world_size"]
    keys = [k for k in ("s0", "s1", "s2", "s3") if k in res["info"]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    measured = [res["info"][k]["traffic"] / res["psi"] for k in keys]
    theory = [traffic_formula(res["psi"], int(k[1]), world_size) / res["psi"] for k in keys]
    ax.bar(np.arange(len(keys)) - 0.2, measured, 0.4, label="measured (our collectives)")
    ax.bar(np.arange(len(keys)) + 0.2, theory, 0.4, label="ZeRO paper")
    ax.set_xticks(range(len(keys)), [f"ZeRO-{k[1]}" for k in keys])
    ax.set_ylabel("elements sent per rank per step / Ψ")
    ax.set_title(f"Communication per step, {res['dtype']}, N={world_size}")
    ax.legend()
    return fig


def loss_chart(plt, curves):
    """Train (lines) and validation (dots) loss of each run."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for n, (label, rows) in enumerate(curves.items()):
        steps = [(r["iter"], r["loss"]) for r in rows if r.get("loss") is not None]
        evals = [(r["iter"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        # curves that coincide (the stages do the same math) stay visible: each later one thinner
        line, = ax.plot(*zip(*steps), label=f"{label}: train", linewidth=max(0.6, 3.5 - 0.9 * n))
        if evals:
            ax.plot(*zip(*evals), "o--", color=line.get_color(), label=f"{label}: val",
                    markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    same = all(k.startswith("ZeRO-") for k in curves)
    ax.set_title("Loss curves from metrics.jsonl"
                 + (" (ZeRO stages: the same math, one curve)" if same else ""))
    ax.legend(fontsize=7)
    return fig


def draw(costs, curves, folder):
    """memory.png, traffic.png, loss.png into folder; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")  # files, no window
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    charts = [("memory.png", memory_chart(plt, costs)), ("traffic.png", traffic_chart(plt, costs)),
              ("loss.png", loss_chart(plt, curves))]
    paths = []
    for name, fig in charts:
        fig.tight_layout()
        paths.append(os.path.join(folder, name))
        fig.savefig(paths[-1], dpi=110)
    plt.close("all")
    return paths


def plot_costs(args, world_size, results):
    """--plot: the charts of a costs run (args: its flags)."""
    stages = sorted({int(k[1]) for k in results[0]["info"] if k.startswith("s")})
    curves = loss_curves(args.runs, stages, world_size, results[0]["dtype"], args.curve_iters)
    costs = {"world_size": world_size, "results": results}
    for path in draw(costs, curves, os.path.join(ROOT, args.plot_dir)):
        print(f"wrote {path}")


OP_COLORS = {"reduce_scatter": "tab:orange", "all_reduce": "tab:red", "all_gather": "tab:blue",
             "all_to_all": "tab:purple"}


def timeline_chart(plt, logs, title):
    """One traced step per rank (the window's last: warm): a compute lane (the host not waiting
    on a collective; ticks where block i's forward ends, f<i>, and its backward begins, b<i>)
    and a communication lane (each collective launched to landed, its waited part dark:
    exposed)."""
    from machinery import timeline
    fig, ax = plt.subplots(figsize=(9, 1.2 + 1.1 * len(logs)))
    step = max(e["step"] for e in logs[0])
    t0 = min(e.get("t", e.get("launch")) for e in logs[0] if e["step"] == step)
    ticks = []
    for rank, events in enumerate(logs):
        events = [e for e in events if e["step"] == step]
        marks = {e["what"]: e["t"] for e in events if e["kind"] == "mark"}
        ops = [e for e in events if e["kind"] == "collective" and e["done"] is not None]
        y_comp, y_comm = 2 * rank + 1, 2 * rank
        busy, t = [], marks["step_begin"]
        for e in sorted(ops, key=lambda e: e["wait"]):
            if e["wait"] > t:
                busy.append((t - t0, e["wait"] - t))
            t = max(t, e["done"])
        busy.append((t - t0, marks["step_end"] - t))
        ax.broken_barh([(1e3 * a, 1e3 * w) for a, w in busy], (y_comp - 0.35, 0.7),
                       color="tab:green")
        for e in events:  # each block's forward end (f) and backward begin (b), tracer's marks
            if e.get("what") in ("forward_end", "backward_begin"):
                x = 1e3 * (e["t"] - t0)
                ax.vlines(x, y_comp - 0.35, y_comp + 0.35, color="black", lw=0.6)
                ax.text(x, y_comp + 0.37, f"{e['what'][0]}{e['block']}", fontsize=5,
                        ha="center", va="bottom")
        for e in ops:
            c = OP_COLORS[e["op"]]
            ax.broken_barh([(1e3 * (e["launch"] - t0), 1e3 * (e["done"] - e["launch"]))],
                           (y_comm - 0.35, 0.7), facecolor=c, alpha=0.35, edgecolor=c)
            ax.broken_barh([(1e3 * (e["wait"] - t0), 1e3 * (e["done"] - e["wait"]))],
                           (y_comm - 0.35, 0.7), facecolor=c)
        ticks += [(y_comm, f"rank {rank} comm"), (y_comp, f"rank {rank} compute")]
        s = timeline.per_step(events)[step]
        ax.text(1e3 * (marks["step_end"] - t0), y_comp, f"  overlap {100 * s['overlap']:.0f}%",
                va="center", fontsize=7)
    ax.set_xlim(right=ax.get_xlim()[1] * 1.12)  # room for the overlap labels
    ax.set_yticks([y for y, _ in ticks], [n for _, n in ticks])
    ax.set_xlabel(f"ms since step {step} began (host clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color="tab:green", label="compute")] + \
        [plt.Rectangle((0, 0), 1, 1, color=c, label=op) for op, c in OP_COLORS.items()
         if any(e.get("op") == op for events in logs for e in events)]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_title(title + " (pale: in flight; dark: waited for, exposed)", fontsize=9)
    return fig


def plot_timeline(folder, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from machinery import timeline
    paths = sorted(f for f in os.listdir(folder) if f.startswith("collectives_rank"))
    logs = [timeline.read(os.path.join(folder, f)) for f in
            sorted(paths, key=lambda f: int(f[len("collectives_rank"):-len(".jsonl")]))]
    fig = timeline_chart(plt, logs, title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close("all")
    print(f"wrote {out}")


def main(argv=None):
    p = parser("plots", __doc__, writes=False)
    p.add_argument("--costs", metavar="FILE",
                   help="the results of python -m bench.costs --save FILE")
    p.add_argument("--timeline", metavar="DIR", help="a train.py --trace DIR run: one compute "
                   "and one communication lane per rank, into --plot-dir/--name")
    p.add_argument("--name", default="timeline.png", help="--timeline: the picture's file name")
    p.add_argument("--title", default="train.py --trace", help="--timeline: its title")
    add_plot_flags(p, switch=False)
    args = p.parse_args(argv)
    if args.timeline:
        if not os.path.isfile(os.path.join(args.timeline, "collectives_rank0.jsonl")):
            p.error(f"--timeline {args.timeline}: no collectives_rank0.jsonl in it "
                    "(train.py --trace DIR writes them)")
        return plot_timeline(args.timeline, os.path.join(args.plot_dir, args.name), args.title)
    if not args.costs:
        p.error("give --costs FILE or --timeline DIR")
    if not os.path.isfile(args.costs):
        p.error(f"--costs {args.costs}: no such file (python -m bench.costs --save FILE)")
    check_plot_flags(p, args, switch=False)
    with open(args.costs) as f:
        costs = json.load(f)
    plot_costs(args, costs["world_size"], costs["results"])


if __name__ == "__main__":
    main()
