"""
The engines a user builds: the lecture's (zero.py's ZeRO, zero3.py's ZeRO3) and those after it
(beyond/: Muon's whole matrices, ZeRO++, the optimizer on the host), each with machinery/guard.py's
layer over it. A loop of one's own imports them from here (docs/forking.md):

    from machinery.engines import ZeRO          # stages 0-2; ZeRO3, WholeZeRO, WholeZeRO3 too

and train.py builds the one its flags ask for with make_engine. The classes of beyond/ are
imported when first asked for: a run that uses none loads nothing from there.
"""
import importlib
import os

import torch

import optim
import zero
import zero3
from machinery.guard import guarded
from precision import DTYPES

ZeRO = guarded(zero.ZeRO)
ZeRO3 = guarded(zero3.ZeRO3)
LATER = {"WholeZeRO": "beyond.muon", "WholeZeRO3": "beyond.muon", "WholeZeROpp": "beyond.muon",
         "ZeROpp": "beyond.zeropp"}


def __getattr__(name):
    """machinery.engines.WholeZeRO and the others of beyond/, guarded, imported when asked for."""
    if name not in LATER:
        raise AttributeError(f"module 'machinery.engines' has no attribute {name!r}")
    return guarded(getattr(importlib.import_module(LATER[name]), name))


def lecture(Engine):
    """The engine class under the guard (Engine itself if it has none)."""
    return Engine.__bases__[1] if Engine.__module__ == __name__ else Engine


def offloaded(Engine, delayed=False):
    """Engine (any of the above) with the fp32 master and the optimizer in host memory
    (beyond/offload_optimizer.py, ZeRO-Offload; delayed: its one-step delayed update), guarded."""
    from beyond.offload_optimizer import offload_engine
    return guarded(offload_engine(lecture(Engine), delayed=delayed))


def make_engine(cfg, model, dtype, rank, world_size, grad_accum, source=None):
    """The engine train.py's flags ask for, guarded: ZeRO 0-2 or 3; for Muon, whose matrices
    must be whole, the same stages dealing them whole (beyond/muon.py); ZeRO++; any of them
    with the optimizer in host memory. source: the fp32 values the master starts from."""
    Engine, extra = (zero3.ZeRO3, {"prefetch": cfg.prefetch}) if cfg.zero == 3 else (zero.ZeRO, {})
    muon = cfg.optimizer == "muon"
    if muon:
        from beyond.muon import WholeZeRO, WholeZeRO3
        Engine = WholeZeRO3 if cfg.zero == 3 else WholeZeRO
    node_size = cfg.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % node_size:
        raise ValueError(f"--node-size {node_size} does not divide the world size {world_size}")
    if cfg.zeropp:
        from beyond.muon import WholeZeROpp
        from beyond.zeropp import ZeROpp, parse_zeropp
        Engine = WholeZeROpp if muon else ZeROpp
        extra.update(zeropp=parse_zeropp(cfg.zeropp), node_size=node_size,
                     qgz_bits=cfg.qgz_bits)
    if cfg.offload_optimizer != "none":  # the master and the optimizer on the host
        from beyond.offload_optimizer import host_threads, offload_engine
        Engine = offload_engine(Engine, delayed=cfg.offload_optimizer == "delayed")
        extra.update(overlap=cfg.offload_optimizer != "plain")
        host_threads(model, world_size)
    # the GPT policy, given explicitly: --weight-decay on the matrices and embeddings
    engine = guarded(Engine)(
        model, cfg.zero, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay, decay=optim.matrices, bucket_mb=cfg.bucket_mb, rank=rank,
        world_size=world_size, reduce_dtype=DTYPES.get(cfg.reduce_dtype),
        fp32_grad_accum=cfg.fp32_grad_accum and grad_accum > 1 and dtype != torch.float32,
        optimizer=cfg.optimizer, master_weights=source, **extra)
    if cfg.zero == 3:  # bytes by link, beside ZeRO++'s theory (report.py)
        from beyond.zeropp import LinkTraffic
        engine.traffic = LinkTraffic(node_size=node_size)
    return engine

