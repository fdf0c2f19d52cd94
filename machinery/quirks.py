"""
What a torch version or a GPU needs that the lecture does not teach, set before the model is built
(machinery/run.py calls apply()).

  - torch.compile on torch 2.4: one graph for all the blocks (their weights its inputs) only with
    dynamo's inlining of built-in modules, 2.5's default (torchtitan#508); else a compile a block
  - SDPA's attention kernels: PyTorch orders them itself, and from torch 2.10 puts cuDNN's
    attention first on sm90 / sm100 with cuDNN >= 9.15.1 (check_prefer_cudnn_attention):
    reported 1.7-2.3x faster for training shapes on Hopper (transformers#48163), opt-in before
    after bugs (pytorch#138522). --no-cudnn-attention puts it last: FlashAttention-2 first
"""
import contextlib

import torch

# sdpa_kernel's context, held open for the process: left (or garbage-collected), it would
# restore the order it found
KERNEL_ORDER = contextlib.ExitStack()


def apply(cfg, device):
    if cfg.compile:
        inline_modules()
    if device.type == "cuda" and not cfg.cudnn_attention:
        cudnn_attention_last()


def inline_modules():
    """Dynamo inlines nn.Module calls (2.5's default; later versions warn that it is on)."""
    if torch.__version__ < "2.5":
        torch._dynamo.config.inline_inbuilt_nn_modules = True


def cudnn_attention_last():
    """SDPA's kernel order for this process with cuDNN's attention last (torch >= 2.6: sdpa_kernel's
    set_priority; before, cuDNN's was never first)."""
    if torch.__version__ < "2.6":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
             SDPBackend.CUDNN_ATTENTION]
    KERNEL_ORDER.enter_context(sdpa_kernel(order, set_priority=True))
