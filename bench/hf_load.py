"""
Host memory of --init-from a Hugging Face GPT-2: ours (hf.Weights, safe_open a tensor at a time
into a GPT built on the meta device) beside transformers' GPT2LMHeadModel.from_pretrained and a
copy into our GPT, the way a port by the library would go. Each load runs in a fresh process;
the figure is its peak resident memory (ru_maxrss) above what it held once torch, transformers
and model.py were imported. Then LoRA and an nf4 base, as train.build does for QLoRA.

    python -m bench.hf_load                 # tiny and gpt2 (124M) shapes, fp32 and bf16 (~1 min)
    python -m bench.hf_load --sizes medium  # gpt2-medium's shape (355M, ~3 min)

The GPT-2 is random (built from a config here, saved with save_pretrained in fp32, as the hub's
files are): no network. docs/lora.md quotes the table.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {"tiny": dict(n_layer=2, n_head=2, n_embd=16, n_positions=64),
         "gpt2": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024),
         "medium": dict(n_layer=24, n_head=16, n_embd=1024, n_positions=1024)}


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon, Linux), sampled every
    millisecond by a thread: tensors, not the pages of a memory-mapped file (safe_open maps
    the file; those pages are the page cache's, dropped under pressure, and ru_maxrss counts
    them)."""

    def __init__(self):
        self.base = self.peak = self.now()
        self.running = True
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    @staticmethod
    def now():
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("RssAnon:"))
        return int(line.split()[1]) / 1024  # kB -> MiB

    def poll(self):
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def mb(self):
        self.peak = max(self.peak, self.now())
        return self.peak - self.base


def child(way, folder, dtype_name):
    """One load in this process; prints the peak above the imports' in MB."""
    import torch
    import transformers  # noqa: F401  imported by both ways, so the baseline is the same
    from machinery import hf, pretrained
    from model import GPT, GPTConfig
    from lora import apply_lora
    from quant import quantize_base
    dtype = getattr(torch, dtype_name)
    config = GPTConfig(**hf.read_config(folder))
    anon = AnonPeak()  # the peak from here: what loading adds
    if way == "ours":
        model = pretrained.load_hf(folder, config, torch.device("cpu"), dtype)
    else:
        theirs = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=dtype)
        with torch.device("meta"):
            model = GPT(config)
        model = model.to(dtype=dtype).to_empty(device="cpu")
        model.transformer.wte.weight = model.lm_head.weight
        with torch.no_grad():
            model.lm_head.weight[config.vocab_size:] = 0.0
            params = dict(model.named_parameters())
            for name, t in theirs.state_dict().items():
                if name == "lm_head.weight" or name.endswith(hf.SKIP):
                    continue
                t = t.t() if name.endswith(hf.CONV1D) else t
                params[name][:len(t)].copy_(t)
        del theirs
    loaded = anon.mb()
    apply_lora(model, 8, 16.0, 0.0, ("q", "v"))
    quantize_base(model, "nf4", False)
    print(f"{loaded:.0f} {anon.mb():.0f}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.hf_load", description=__doc__.split("\n")[1])
    p.add_argument("--sizes", default="tiny,gpt2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(*args.child)
    import torch
    import transformers
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"{'size':6}{'params':>8}{'file MB':>9}{'dtype':>10}{'way':>17}"
          f"{'load MB':>9}{'+ QLoRA MB':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            torch.manual_seed(0)
            cfg = transformers.GPT2Config(**SIZES[size])
            model = transformers.GPT2LMHeadModel(cfg)
            folder = os.path.join(tmp, size)
            model.save_pretrained(folder)
            n = sum(p.numel() for p in model.parameters())
            mb = os.path.getsize(os.path.join(folder, "model.safetensors")) / 1e6
            del model
            for dtype in args.dtypes.split(","):
                for way in ("ours", "from_pretrained"):
                    r = subprocess.run([sys.executable, "-m", "bench.hf_load", "--child", way,
                                        folder, dtype], cwd=root, env=env, capture_output=True,
                                       text=True, check=True)
                    load, qlora = r.stdout.split()[-2:]
                    print(f"{size:6}{n / 1e6:>7.1f}M{mb:>9.0f}{dtype:>10}{way:>17}"
                          f"{load:>9}{qlora:>12}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
