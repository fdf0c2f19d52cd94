"""
Reading a prepared data set: memory-mapped token ids, and the batches of every step.

The global batch of step t is a function of (seed, t) alone, and rank r of N takes its slice of
it (micro-step-major, then rank): N ranks see exactly the batches one rank sees with an N-times
larger micro-batch, a resumed run sees the batches the uninterrupted one would have, and no
sampler state needs saving. Batches keeps one batch ahead: it is cut, pinned and on its way to
the GPU (non_blocking) while the GPU still works on the one before. estimate_loss scores a model
on fixed batches of each split, the same on any world size.
"""
import hashlib
import math
import os

import numpy as np
import torch

from collectives import all_gather_object, all_reduce_sum
from configurator import UserError
from data.prepare import DATASETS, load_meta, prepare, rebuild_command
from machinery.validate import agreed_error
from machinery.validate import file_kind, vocab_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_tokens(data, seed, step, micro, rank, world_size, batch_size, block_size, grad_accum):
    """This rank's sequences of one micro-step, each one token longer than the block: (B, T+1)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ix = torch.randint(len(data) - block_size, (grad_accum * world_size * batch_size,), generator=g)
    start = (micro * world_size + rank) * batch_size  # micro-step-major, then rank
    ix = ix[start:start + batch_size].numpy()
    return torch.from_numpy(np.stack([data[i:i + block_size + 1] for i in ix]).astype(np.int64))


def get_batch(*args):
    """get_tokens' sequences as inputs and next-token targets: (B, T) each, views of one."""
    xy = get_tokens(*args)
    return xy[:, :-1], xy[:, 1:]


class Batches:
    """This rank's batches in order, from step start_it on, one batch ahead."""

    def __init__(self, data, cfg, rank, world_size, grad_accum, device, start_it):
        self.data, self.cfg, self.rank, self.world_size = data, cfg, rank, world_size
        self.grad_accum, self.device = grad_accum, device
        self.pos, self.ahead = (start_it, 0), None

    def _load(self, it, micro):
        xy = get_tokens(self.data, self.cfg.seed, it, micro, self.rank, self.world_size,
                        self.cfg.batch_size, self.cfg.block_size, self.grad_accum)
        if self.device.type == "cuda":  # page-locked: the copy can run while the GPU computes.
            # The whole contiguous (B, T+1) tensor: a strided view (x or y) would be copied
            # through a pageable temporary, and the copy would not overlap anything
            xy = xy.pin_memory()
        xy = xy.to(self.device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]  # sliced on the device

    def next(self):
        batch = self.ahead or self._load(*self.pos)
        it, micro = self.pos
        self.pos = (it, micro + 1) if micro + 1 < self.grad_accum else (it + 1, 0)
        self.ahead = self._load(*self.pos)
        return batch


# what a rank that lacks the data, while others have it, is told: nodes share no disk
SHARE_DATA = ("every node needs the data: prepare it on each node (a built-in data set or "
              "--input FILE is prepared by each node's first rank), or give --data-root a disk "
              "they share")


def load_data(cfg, rank, world_size, base_meta=None):
    """Memory-map train.bin / val.bin, preparing the data set first if it is missing (the
    built-in ones, or --input FILE in base_meta's vocabulary). The first rank of each node
    prepares (LOCAL_RANK 0: nodes need not share a disk), the others wait. Then every rank
    checks the folder it reads (check_folder); a rank whose data is missing or broken stops
    every rank with one line, rather than leave them waiting in a collective."""
    if cfg.input:
        cfg.dataset = os.path.splitext(os.path.basename(cfg.input))[0]
    data_dir = os.path.join(ROOT, cfg.data_root, cfg.dataset)  # an absolute data_root wins
    fix = rebuild_command(data_dir, cfg.input or None)
    # nothing there: prepared first; anything else (a FIFO...) is check_folder's one line
    missing, error = file_kind(os.path.join(data_dir, "val.bin")) is None, None
    if missing and not cfg.input and cfg.dataset not in DATASETS:
        error = f"no prepared data in {data_dir}: run {fix}"
    elif (missing or cfg.input) and int(os.environ.get("LOCAL_RANK", rank)) == 0:
        try:  # a built-in data set in its own vocabulary: check_vocab compares it with the model's
            prepare(dataset="shakespeare_char" if cfg.input else cfg.dataset,
                    input_path=cfg.input or None, out_root=os.path.join(ROOT, cfg.data_root),
                    base_meta=base_meta if cfg.input else None)
        except UserError as e:
            error = str(e)
    # every rank's outcome, gathered (a barrier too: each node's preparation is done)
    error = agreed_error(all_gather_object(error, world_size), SHARE_DATA)
    if error is None:
        try:
            meta = check_folder(data_dir, cfg.block_size, cfg.input or None)
        except UserError as e:
            error = str(e)
    error = agreed_error(all_gather_object(error, world_size), SHARE_DATA)
    if error:
        raise UserError(error)
    train = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.uint16, mode="r")
    return train, val, meta


def check_folder(data_dir, block_size, input_path=None):
    """A prepared folder as prepare() writes it, checked before anything is memory-mapped:
    each of its files a file (not a FIFO, a folder...), meta.json (load_meta), then each .bin
    file there, not empty, of whole uint16 ids, holding the tokens meta.json counts, and more
    than a block of them. Returns meta; a UserError, one
    line naming the file and the data/prepare.py command that writes it again, otherwise."""
    if not os.path.isdir(data_dir):
        raise UserError(f"no prepared data in {data_dir}: run "
                        f"{rebuild_command(data_dir, input_path)}")
    fix = f"rebuild it with {rebuild_command(data_dir, input_path)}"
    for name in ("meta.json", "train.bin", "val.bin"):  # before any is opened: a FIFO waits
        kind = file_kind(os.path.join(data_dir, name))  # for ever, a folder is no data
        if kind not in (None, "a file"):
            raise UserError(f"{os.path.join(data_dir, name)} is {kind}, not a file: {fix}")
    meta = load_meta(data_dir, input_path)
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        try:
            size = os.path.getsize(path)
        except OSError:
            raise UserError(f"no {path}: {fix}")
        if size == 0:
            raise UserError(f"{path} is empty: {fix}")
        if size % 2:  # np.memmap would raise "not a multiple of the data-type size"
            raise UserError(f"{path} has {size:,} bytes, an odd number: not uint16 ids "
                            f"(a copy cut short?); {fix}")
        counted = meta.get(f"{split}_tokens")
        if counted is not None and size != 2 * counted:
            raise UserError(f"{path} holds {size // 2:,} tokens, meta.json says {counted:,} "
                            f"(cut short, or written by another preparation): {fix}")
        if size // 2 <= block_size + 1:
            raise UserError(f"{data_dir} has too few tokens for --block-size {block_size} "
                            f"({split}.bin: {size // 2:,}): a smaller --block-size, or more text")
    return meta


# sha256 reads the ids in chunks of 4 Mi tokens (8 MiB), each chunk's max beside it (about 5%
# of the time). Cost: about 1 s a GB from the page cache (0.22-0.45 s for 300 MB in three runs
# on this project's 2-core AMD EPYC, which has SHA-NI); a cold disk adds its read time, and
# OpenWebText's 17 GB train.bin would take some 15-20 s at start-up. Measured with
#   head -c 300000000 /dev/urandom > /tmp/x.bin && python -c "import time, numpy as np;
#   from types import SimpleNamespace as S; from data.loader import data_identity as d;
#   m = np.memmap('/tmp/x.bin', np.uint16); t = time.time(); d(S(input=''), m, m[:9],
#   {'tokenizer': 'gpt2', 'vocab_size': 65536}, 1); print(time.time() - t)"
# Every rank hashes the files it reads: nodes need not share a disk, so each checks its own.
CHUNK = 1 << 22


def data_identity(cfg, train, val, meta, world_size):
    """What a resume must train on again: each .bin file's size in bytes and the sha256 of its
    bytes, and the vocabulary's identity (JSON: it goes into the checkpoint's header). Every
    rank reads its own files whole: an id outside the vocabulary, on any rank, stops every rank
    with one line (the embedding would fail on it mid-run, on a GPU as a device-side assert)."""
    identity, error = {"vocab": vocab_id(meta)}, None
    for split, tokens in (("train", train), ("val", val)):
        digest, top = hashlib.sha256(), 0
        for i in range(0, len(tokens), CHUNK):
            part = tokens[i:i + CHUNK]
            digest.update(part)  # the file's bytes, as the memmap reads them
            top = max(top, int(part.max()))
        identity[f"{split}.bin"] = {"bytes": tokens.nbytes, "sha256": digest.hexdigest()}
        if top >= meta["vocab_size"] and error is None:
            error = (f"{tokens.filename} holds id {top}, but meta.json's vocabulary has "
                     f"{meta['vocab_size']} tokens (from another preparation?): rebuild it "
                     f"with {rebuild_command(os.path.dirname(tokens.filename), cfg.input or None)}")
    error = agreed_error(all_gather_object(error, world_size), SHARE_DATA)
    if error:
        raise UserError(error)
    return identity


def changed_data(saved, identity, path, world_size):
    """How the data a checkpoint was saved on (its header's "data") differs from the data
    every rank has now (data_identity): one line, the same on every rank, or None. A
    checkpoint from before data identities has none: nothing to compare."""
    changes = []
    if saved is not None and not isinstance(saved, dict):
        changes.append(f"its data identity is a {type(saved).__name__}, not a dict")
    for key, now in identity.items() if isinstance(saved, dict) else ():
        was = saved.get(key)
        if was == now:
            continue
        if key == "vocab":
            changes.append(f"vocabulary {was} -> {now}")
        elif isinstance(was, dict) and was.get("bytes") == now["bytes"]:
            changes.append(f"{key} has other bytes of the same size (sha256 "
                           f"{str(was.get('sha256'))[:12]}... -> {now['sha256'][:12]}...)")
        else:
            # a header is data from disk: a size that is not a number is printed as "?"
            size = was.get("bytes") if isinstance(was, dict) else None
            size = f"{size:,}" if isinstance(size, int) else "?"
            changes.append(f"{key} {size} -> {now['bytes']:,} bytes")
    line = f"the data changed since {path} was saved: {'; '.join(changes)}" if changes else None
    return agreed_error(all_gather_object(line, world_size),
                        "every node needs the data the run trained on")


@torch.no_grad()
def estimate_loss(model, train, val, cfg, rank, world_size, device):
    """Mean loss over eval_iters fixed batches per split; rank r takes batches r, r+N, ...
    so the estimate is the same on any world size. Every rank runs the same number of forwards
    (a spare one is not counted): under ZeRO-3 each forward is a series of collectives."""
    model.eval()
    out = {}
    for si, (split, data) in enumerate((("train", train), ("val", val))):
        total = torch.zeros(2, dtype=torch.float64, device=device)  # nccl: device tensors only
        for k in range(rank, math.ceil(cfg.eval_iters / world_size) * world_size, world_size):
            x, y = get_batch(data, cfg.seed + 7919 * (si + 1), k, 0, 0, 1, cfg.batch_size,
                             cfg.block_size, 1)
            _, loss = model(x.to(device), y.to(device))
            if k < cfg.eval_iters:
                total += torch.stack([loss.double(), torch.ones_like(total[0])])
        all_reduce_sum(total, world_size, label=f"the {split} loss")
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out
