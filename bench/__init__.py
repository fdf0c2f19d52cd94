"""
Benchmarks (not tests): each prints a markdown table and writes it into BENCHMARKS.md, which
also says how each one measures. Run them from the repository root, one at a time:

    python -m bench.loop        the loop's own overhead vs plain PyTorch; tokens/s per dtype
    python -m bench.costs       ZeRO stage x dtype x --grad-ckpt x LoRA beside DDP, FSDP2, ...
    python -m bench.quality     nanoGPT's CPU recipe over seeds: train.py vs a plain loop
    python -m bench.crossover   fp32 vs bf16 step time on a CPU as the model widens
    python -m bench.gpu         GPT-2 124M on one GPU: ms/iter, MFU, peak memory (--tiny on a CPU)
    python -m bench.nanogpt     our step time beside nanoGPT's own train.py (--nanogpt PATH)
    python -m bench.plots       redraw figures/ from a saved costs run
    python -m bench.accum       bf16 gradient accumulation in bf16 and in fp32, beside fp32
    python -m bench.lecture     the lecture's memory tables, computed by memory.py (not timed)
    python -m bench.zeropp      ZeRO++ on 4 ranks as 2 nodes x 2: bytes by link, loss, estimates
    python -m bench.fuzz        random flags and odd files against all four commands: no traceback

`python bench/NAME.py` works too. bench/common.py holds what they share.
"""
