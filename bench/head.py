"""
The loss head's memory, measured: the textbook head beside ours (beyond/chunked_loss.py),
at GPT-2's vocabulary.

The textbook head slices the padded logits (a 16-bit copy), casts them to fp32 (a copy),
takes an fp32 log-softmax (kept for backward) and in backward makes the fp32 gradient, its
16-bit cast and a zero-padded copy. Ours keeps only the 16-bit logits and works in fp32 a chunk
of rows at a time. Each runs one forward and backward of the head alone (LM head matmul + loss,
bf16) in a fresh process, on the same inputs, and reports:

  saved     bytes autograd keeps for backward (every saved tensor's storage once, the weight
            left out): what meter.saved_activation_bytes counts in train.py
  peak      the process's peak resident memory during forward + backward, less what it held
            just before (inputs allocated, one warm-up run done): the working set at its peak
  ms        the wall time of one forward + backward

beside memory.py's terms for ours (activations.py: the logits, logsumexp and targets saved;
head_working_bytes for the transient peak).

Then the bytes a logit costs in memory traffic, from the logits to their gradient: every
kernel's reads and writes counted op by op (bench.common.KernelBytes, on the meta device, at
GPT-2's micro-batch of 16 x 1024 tokens): the textbook head, ours as the CPU runs it (a kernel
per step of a chunk), and ours as a GPU runs it (beyond/chunked_loss.py's fused path). On a
GPU the head is bound by memory, not FLOPs: the bytes give its time at the HBM's bandwidth.

    python -m bench.head                         # 4 x 1024 tokens, GPT-2's 50,257 tokens
    python -m bench.head --rows 1024 --no-write
    python -m bench.head --traffic               # the bytes per logit alone (counted: seconds)
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from machinery.activations import activation_bytes, head_working_bytes
from bench.common import (H100_HBM as HBM, KernelBytes, Stopwatch, command, parser,
                          report, table)
from beyond.chunked_loss import cross_entropy
from model import GPTConfig

WIDTH, VOCAB = 768, 50257
# the loss heads whose bytes are counted: (name, logits dtype, loss(logits, targets, vocab))
HEADS = [("textbook (F.cross_entropy)", torch.bfloat16,
          lambda l, t, v: F.cross_entropy(l[:, :v].float(), t, ignore_index=-1)),
         ("ours, eager (as on a CPU)", torch.bfloat16,
          lambda l, t, v: cross_entropy(l, t, v, fused=False)),
         ("ours, fused (a GPU, bf16)", torch.bfloat16,
          lambda l, t, v: cross_entropy(l, t, v, fused=True)),
         ("ours, fused (a GPU, fp16)", torch.float16,
          lambda l, t, v: cross_entropy(l, t, v, fused=True))]


def textbook(x, weight, targets, vocab):
    """The head as model.py had it: slice, fp32 copy, log-softmax in F.cross_entropy."""
    logits = (x @ weight.t())[..., :vocab]
    return F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1), ignore_index=-1)


def ours(x, weight, targets, vocab):
    return cross_entropy(x @ weight.t(), targets, vocab)


def bytes_per_logit(dtype, loss_of, rows, vocab):
    """(forward, backward) bytes read and written per logit by the loss's kernels, from the
    logits to their gradient (the LM head's matmuls left out), counted on the meta device."""
    padded = GPTConfig(vocab_size=vocab).padded_vocab
    logits = torch.empty(rows, padded, dtype=dtype, device="meta", requires_grad=True)
    targets = torch.zeros(rows, dtype=torch.long, device="meta")
    counter = KernelBytes()
    with counter:
        loss = loss_of(logits, targets, vocab)
        forward = counter.read + counter.written
        loss.backward()
    n = rows * padded
    return forward / n, (counter.read + counter.written - forward) / n


def traffic_table(vocab):
    """The bytes per logit of each head, and what they cost at GPT-2's micro-batch."""
    rows, padded = 16 * 1024, GPTConfig(vocab_size=vocab).padded_vocab
    out = []
    for name, dtype, loss_of in HEADS:
        fwd, bwd = bytes_per_logit(dtype, loss_of, rows, vocab)
        total = (fwd + bwd) * rows * padded
        out.append([name, f"{fwd:.0f}", f"{bwd:.0f}", f"{fwd + bwd:.0f}",
                     f"{total / 1e9:.1f}", f"{total / HBM * 1000:.1f}"])
    return table(["loss head", "forward B/logit", "backward B/logit", "total B/logit",
                  "GB a micro-step (16 x 1024)", "ms at 3.35 TB/s (prediction)"], out)


def resident():
    """This process's resident memory now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(which, rows, vocab=VOCAB):
    """In this process: one head's saved bytes, peak working set and time."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, n_embd=WIDTH)
    weight = (torch.randn(cfg.padded_vocab, WIDTH) * 0.02).bfloat16().requires_grad_()
    x = torch.randn(1, rows, WIDTH).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (1, rows))
    head = textbook if which == "textbook" else ours
    head(x, weight, targets, vocab).backward()  # warm-up: the allocator's pools are set up
    x.grad = weight.grad = None
    saved, seen = [0], set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr != weight.untyped_storage().data_ptr():
            seen.add(ptr)
            saved[0] += t.untyped_storage().nbytes()
        return t

    before = resident()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = head(x, weight, targets, vocab)
    loss.backward()
    ms = (time.perf_counter() - t0) * 1000
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    return {"saved": saved[0], "peak": peak - before, "ms": ms, "loss": loss.item()}


def run(which, rows, vocab):
    """measure() in a fresh process: the peak of one process is its own."""
    out = subprocess.run([sys.executable, "-m", "bench.head", "--child", which, "--rows",
                          str(rows), "--vocab", str(vocab)], check=True, capture_output=True,
                         text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = parser("head", __doc__)
    p.add_argument("--rows", type=int, default=4096, help="tokens in the batch (B x T)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="tokens in the vocabulary")
    p.add_argument("--traffic", action="store_true", help="only the bytes per logit")
    p.add_argument("--child", choices=("textbook", "ours"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rows < 1 or args.vocab < 2:
        p.error("--rows: at least 1, --vocab: at least 2")
    torch.set_num_threads(min(2, os.cpu_count()))
    if args.child:
        print(json.dumps(measure(args.child, args.rows, args.vocab)))
        return
    watch = Stopwatch()
    if args.traffic:
        body = ("Bytes each kernel of the loss reads and writes per logit, from the logits to "
                f"their gradient ({args.vocab:,} tokens padded to a multiple of 64), counted "
                "on the meta device; the time is what a bandwidth-bound head would take.")
        report(command("head", argv), "head-traffic", body, traffic_table(args.vocab), watch,
               not args.no_write, "The loss head's memory traffic")
        return
    results = {which: run(which, args.rows, args.vocab) for which in ("textbook", "ours")}
    cfg = GPTConfig(vocab_size=args.vocab, n_embd=WIDTH, block_size=args.rows)
    terms = activation_bytes(cfg, 1, args.rows, "bf16", device="cpu")["outside"]
    model_saved = sum(v for k, v in terms.items() if k.startswith(("logits", "logsumexp",
                                                                    "targets", "lm_head")))
    mb = lambda n: f"{n / 2**20:,.0f}"
    rows = [[w, mb(r["saved"]), mb(r["peak"]), f"{r['ms']:,.0f}", f"{r['loss']:.6f}"]
            for w, r in results.items()]
    rows.append(["memory.py for ours", mb(model_saved),
                 mb(model_saved + head_working_bytes(cfg, 1, args.rows, "bf16")), "-", "-"])
    body = table(["head", "saved for backward (MiB)", "peak working set (MiB)",
                  "ms (fwd + bwd)", "loss"], rows)
    t, o = results["textbook"], results["ours"]
    numbers = (f"{args.rows:,} tokens x {args.vocab:,} (padded {cfg.padded_vocab:,}) logits, "
               f"width {WIDTH}, bf16, CPU, one process each; ours saves "
               f"{t['saved'] / o['saved']:.1f}x less and peaks "
               f"{t['peak'] / max(o['peak'], 1):.1f}x lower; the two losses differ by "
               f"{abs(t['loss'] - o['loss']):.1e}.\n\nMemory traffic of the loss (bytes each "
               f"kernel reads and writes, per logit; {args.vocab:,} tokens padded to "
               f"{cfg.padded_vocab:,}):\n\n" + traffic_table(args.vocab))
    report(command("head", argv), "head", body, numbers, watch, not args.no_write,
           "The loss head's memory")


if __name__ == "__main__":
    main()
