"""
The lecture's tables, computed with memory.py's formulas (the estimate the tests hold to
measurement; nothing here is timed): bytes per value, training bytes per parameter with Adam,
the 1B example (where "about 80 GB" comes from), and what each technique saves per GPU.

    python -m bench.lecture

Sizes are decimal, as the lecture counts them: 1 GB = 1e9 bytes.
"""
import os
import sys

if __package__ in (None, ""):  # run as a script: import from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machinery.activations import BYTES
from machinery.footprint import QUANT_BYTES, estimate, model_state_bytes
from memory import max_batch
from machinery.estimator import GB, fmt, shape_for, table

# the lecture's techniques, each on top of the ones above it:
# (name, dtype, ZeRO stage, activation checkpointing, LoRA rank, quantize)
TECHNIQUES = [("fp32, Adam", "fp32", 0, False, 0, None),
              ("bf16 mixed precision", "bf16", 0, False, 0, None),
              ("+ ZeRO-1", "bf16", 1, False, 0, None), ("+ ZeRO-2", "bf16", 2, False, 0, None),
              ("+ ZeRO-3", "bf16", 3, False, 0, None),
              ("+ activation checkpointing", "bf16", 3, True, 0, None),
              ("LoRA q,v r=8 (ZeRO-3, ckpt)", "bf16", 3, True, 8, None),
              ("QLoRA nf4 (ZeRO-3, ckpt)", "bf16", 3, True, 8, "nf4")]


def lecture():
    print("Bytes per value:")
    notes = {"bf16": "fp32's 8 exponent bits, 7 of mantissa",
             "fp16": "5 exponent bits: needs the loss scaler",
             "nf4": f"+ an fp32 absmax per 64 values: {QUANT_BYTES['nf4']:g} as we store it"}
    table([[d, f"{v:g}", notes.get(d, "")] for d, v in BYTES.items()], ["dtype", "bytes", ""])
    print("Training bytes per parameter with Adam, model_state_bytes(1, ...):")
    f32, b16 = model_state_bytes(1, 0, 1, "fp32"), model_state_bytes(1, 0, 1, "bf16")
    names = {"params": "weights", "grads": "gradients", "master": "fp32 master weights",
             "optimizer": "Adam m and v", "total": "model state"}
    table([[v, f32[k], b16[k]] for k, v in names.items()] + [["activations", "b*s*h*L", "(below)"]],
          ["", "fp32", "bf16/fp16 mixed"])
    psi, s = 10**9, 2048
    cfg = shape_for(psi, block=s)
    full = {d: max_batch(lambda b: estimate(cfg, dtype=d, batch=b, psi=psi)["peak"] <= 80 * GB)
            for d in ("fp32", "bf16")}  # the largest micro-batch an 80 GB GPU holds, no headroom
    print("The 1B example. The lecture notes: 4 bytes to hold a weight + 20 to train it, then "
          f"'about 80 GB'.\nThe arithmetic: 24 bytes x 1e9 parameters = {24 * psi / GB:.0f} GB, "
          f"not 80. Weights, gradients and Adam\ntake 16 bytes x 1e9 = {16 * psi / GB:.0f} GB "
          "(fp32 and mixed alike); what fills a GPU is activations, which\ngrow with batch x "
          f"sequence, not with parameters. A 1B GPT (L={cfg.n_layer}, h={cfg.n_embd}, "
          f"a={cfg.n_head}, vocab {cfg.vocab_size}), {s} tokens,\none GPU: 80 GB is full at "
          f"micro-batch {full['fp32']} in fp32, {full['bf16']} in bf16.")
    rows = []
    for b in (1, 4, 8, 16):
        e32, e16 = estimate(cfg, batch=b, psi=psi), estimate(cfg, dtype="bf16", batch=b, psi=psi)
        rows.append([b] + [fmt(x) for x in (e32["activations"]["total"], e32["peak"],
                                             e16["activations"]["total"], e16["peak"])])
    table(rows, ["micro-batch", "activations fp32", "peak fp32", "activations bf16", "peak bf16"])
    print(f"What each technique saves, per GPU (the 1B GPT, micro-batch 8 x {s} tokens):")
    rows = []
    for name, dt, st, ck, r, q in TECHNIQUES:
        e1, e8 = [estimate(cfg, n, st, dt, 8, None, ck, r, quantize=q, psi=psi) for n in (1, 8)]
        rows.append([name] + [fmt(x) for x in (e1["state"]["total"], e1["activations"]["total"],
                                                e1["peak"], e8["state"]["total"], e8["peak"])])
    table(rows, ["", "state, 1 GPU", "activations", "peak, 1 GPU", "state, 8 GPUs", "peak, 8 GPUs"])
    print("Model state on N GPUs: 16 bytes per parameter -> 4 + 12/N (ZeRO-1), 2 + 14/N (ZeRO-2), "
          "16/N (ZeRO-3).\nMixed precision shrinks activations and traffic, not model state. LoRA "
          "trains almost nothing; its\nfrozen base costs 2 bytes per parameter (0.56 in NF4), "
          "whole on every GPU up to ZeRO-2, sharded by ZeRO-3.")


if __name__ == "__main__":
    lecture()
