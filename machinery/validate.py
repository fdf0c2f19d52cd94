"""
What a file claims is checked before anything is built from it or copied out of it.

A checkpoint header, a Hugging Face config.json or an adapter's metadata is data from disk: it
may be cut short, edited or written by another program. Each check here is cheap (types,
ranges, sums over the header) and runs before the claim is used to allocate memory, build a
model or copy elements, so a file that claims 10^5 layers or a LoRA rank of 10^9 is one line at
once, not minutes of work and a 256 GB allocation. Every function raises ValueError with the
line to print; the caller puts its own file name and error class in front.

Also here: what a path is before it is opened (file_kind: a FIFO, a folder or a device where a
file belongs is one line, never an open() that waits for ever), the crc32 of a tensor's bytes
(about 7 GB/s on one CPU core: small beside writing the bytes), and the identity of a
vocabulary (two character sets of 65 characters are not the same vocabulary).
"""
import base64
import binascii
import hashlib
import math
import os
import random
import re
import stat
import zlib
from dataclasses import fields

import numpy as np
import torch

import collectives
import optim
from configurator import SCHEDULE, UserError
import model as model_py  # model.GPT when called: a fork's edit of model.py is read
from data.prepare import check_meta
from model import GPTConfig

# the largest model a config or header may describe: GPT-2 xl is 48 x 1600 over 1024 positions
# and 50257 tokens; these leave ample room and still build in seconds, never minutes
BOUNDS = {"n_layer": 1024, "n_head": 1024, "n_embd": 65536, "block_size": 2**20,
          "vocab_size": 2**20, "pad_vocab": 2**16}
NAME = re.compile(r"[A-Za-z_]\w*(\.\w+)*")  # model.py's tensor names: transformer.h.0.ln_1.weight


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def file_kind(path):
    """What is at path, asked before it is opened: None (nothing), "a file" (a regular file, or
    a symlink to one), "a folder", "a FIFO", "a socket", "a device", "a dangling symlink".
    open() on a FIFO waits for a writer for ever, and safetensors' reader retries through
    signals, so not even SIGTERM ends it; a device or a folder is no file of ours either.
    Everything a run opens is asked first: anything but a file is one line."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # (a path through a file: nothing there)
        return "a dangling symlink" if os.path.islink(path) else None
    except OSError as e:  # a symlink loop
        return f"unreadable ({e.strerror})"
    kinds = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "a device")


def crc(t):
    """crc32 of a tensor's bytes as they lie in memory (or in a memory-mapped file)."""
    t = t.detach().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy()) if t.numel() else 0


def vocab_id(meta):
    """A vocabulary's identity: the tokenizer's name for GPT-2 BPE, a hash of the characters in
    id order for a character vocabulary ('3' replaced by '~' is another vocabulary)."""
    if not isinstance(meta, dict):
        return None
    if meta.get("tokenizer") == "char" and meta.get("itos") is not None:
        chars = "".join(meta["itos"])
        return "char:" + hashlib.sha256(chars.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{meta.get('tokenizer')}:{meta.get('vocab_size')}"


# ----------------------------------------------------------------------------------------------
# model shapes

def check_model_args(args, config=GPTConfig):
    """A model config's keyword arguments from a file: within BOUNDS where it names those sizes,
    and, given the dataclass the model is built from (config), only its fields, which build it.
    config=None (a checkpoint's header, before a model is known): the bounds alone; the keys are
    the model's to judge (a fork's config has fields GPTConfig lacks)."""
    if not isinstance(args, dict):
        raise ValueError(f"model_args is {type(args).__name__}, not a dict")
    known = {f.name for f in fields(config)} if config is not None else set(args)
    extra = sorted(set(args) - known)
    if extra:
        raise ValueError(f"model_args has an unknown key {extra[0]!r}: {config.__name__} has "
                         "no such field")
    for name, limit in BOUNDS.items():
        value = args.get(name, 1)
        if not is_int(value) or not 1 <= value <= limit:
            raise ValueError(f"model_args {name} is {value!r}: want an integer in [1, {limit}]")
    if not is_number(args.get("dropout", 0.0)) or not isinstance(args.get("bias", True), bool):
        raise ValueError(f"model_args dropout {args.get('dropout')!r} / bias "
                         f"{args.get('bias')!r}: want a number and true / false")
    if config is None:
        return
    try:
        config(**args)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model_args: {e}")


def check_shapes_fit(args, shapes):
    """The model a header's model_args describe must be the one its shapes hold: as many blocks,
    that width, context and vocabulary (so the model can be built at the size of the file).
    GPT-2's names only: a fork's model (another arch), built on the meta device, is held to
    its tensors by declared.check_holds."""
    if args.get("arch", "gpt2") != "gpt2":
        return
    blocks = {int(m.group(1)) for m in map(re.compile(r"transformer\.h\.(\d+)\.").match, shapes)
              if m}
    if blocks != set(range(args["n_layer"])):
        raise ValueError(f"model_args say n_layer {args['n_layer']}, the tensors hold "
                         f"{len(blocks)} blocks")
    want = {"transformer.wpe.weight": [args["block_size"], args["n_embd"]],
            "transformer.wte.weight": [args["vocab_size"], args["n_embd"]]}
    for name, shape in want.items():
        if shapes.get(name) != shape:
            raise ValueError(f"model_args say {name} is {shape}, the tensors say "
                             f"{shapes.get(name)}")


def check_hf_types(cfg):
    """A Hugging Face config.json's numbers: integers where GPT-2 has them, finite numbers."""
    if not isinstance(cfg, dict):
        raise ValueError(f"it holds {type(cfg).__name__}, not an object")
    ints = ("n_layer", "n_head", "n_embd", "n_positions", "n_ctx", "vocab_size", "n_inner")
    floats = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon")
    for keys, ok, want in ((ints, is_int, "an integer"), (floats, is_number, "a number")):
        bad = [k for k in keys if cfg.get(k) is not None and not ok(cfg[k])]
        if bad:
            raise ValueError(f"{bad[0]} is {cfg[bad[0]]!r}, not {want}")


# ----------------------------------------------------------------------------------------------
# checkpoint headers (checked_ckpt.py calls these before reading any tensor)

SCALER = {"scale": "number", "growth_factor": "number", "backoff_factor": "number",
          "growth_interval": "int", "_growth_tracker": "int", "dynamic": "bool",
          "min_scale": "number"}
FP32 = torch.finfo(torch.float32)
# what precision.GradScaler can hold: an fp32 scale of fp32's normal range (a smaller one makes
# every gradient zero, a larger one inf), int32 counters, a backoff that shrinks it
SCALER_RANGES = {"scale": (FP32.tiny, FP32.max), "growth_factor": (1.0, 2.0**16),
                 "backoff_factor": (0.0, 1.0), "growth_interval": (1, 2**31 - 1),
                 "_growth_tracker": (0, 2**31 - 1), "min_scale": (0.0, FP32.max)}


def _check_scaler(s):
    if not isinstance(s, dict) or set(s) != set(SCALER):
        raise ValueError(f"the loss scaler state has keys {sorted(s) if isinstance(s, dict) else s}"
                         f", not {sorted(SCALER)}")
    kinds = {"number": is_number, "int": is_int, "bool": lambda x: isinstance(x, bool)}
    for key, kind in SCALER.items():
        lo, hi = SCALER_RANGES.get(key, (None, None))
        if not kinds[kind](s[key]) or (lo is not None and not lo <= s[key] <= hi):
            raise ValueError(f"the loss scaler's {key} is {s[key]!r}: want a {kind}"
                             + (f" in [{lo:g}, {hi:g}]" if lo is not None else ""))
    if s["growth_factor"] == 1.0 or s["backoff_factor"] in (0.0, 1.0):
        raise ValueError(f"the loss scaler's growth {s['growth_factor']!r} / backoff "
                         f"{s['backoff_factor']!r}: want growth > 1 and 0 < backoff < 1")
    if s["_growth_tracker"] >= s["growth_interval"]:
        raise ValueError(f"the loss scaler's _growth_tracker {s['_growth_tracker']} is not below "
                         f"its growth_interval {s['growth_interval']}")


# the run's schedule in a header's config: numbers >= 0 where present (a resume keeps them)


FILE = re.compile(r"shard-\d{5}\.safetensors")  # the only names a header may make us open


def check_header(h):
    """checkpoint.json's header: types, ranges, files of our names, a layout whose pieces tile
    each tensor exactly once and name only its tensors, a crc32 of every piece the layout
    implies (checkpoint.py's keys, and the engine's extra_keys), one RNG state per rank of
    world_size, each one its generators take (whatever world size resumes: not only those
    set), a vocabulary as data/prepare.py writes it (sample.py encodes by its stoi and decodes
    by its itos)."""
    names = lambda x: isinstance(x, list) and all(isinstance(k, str) for k in x)
    keys = lambda x: isinstance(x, dict) and all(isinstance(n, str) and names(k)
                                                 for n, k in x.items())
    for key, ok, want in (("iter", is_int, "an integer"), ("opt_step", is_int, "an integer"),
                          ("world_size", is_int, "an integer"), ("stage", is_int, "0-3"),
                          ("optimizer", lambda x: isinstance(x, str), "a name"),
                          ("state_keys", keys, "lists of names by tensor"),
                          ("extra_keys", names, "a list of names")):
        if key not in h or not ok(h[key]):
            raise ValueError(f"{key} is {h.get(key)!r}: want {want}")
    if h["iter"] < 0 or h["opt_step"] < 0 or h["world_size"] < 1 or h["stage"] not in range(4):
        raise ValueError(f"iter {h['iter']}, opt_step {h['opt_step']}, world_size "
                         f"{h['world_size']}, stage {h['stage']}: out of range")
    for key in ("config", "model_args", "meta", "shapes"):
        if not isinstance(h.get(key), dict):
            raise ValueError(f"{key} is {type(h.get(key)).__name__}, not a dict")
    _check_scaler(h.get("scaler"))
    for key in SCHEDULE:
        if key in h["config"] and not (is_number(h["config"][key]) and h["config"][key] >= 0):
            raise ValueError(f"config {key} is {h['config'][key]!r}: want a number >= 0")
    shapes = h["shapes"]
    for name, shape in shapes.items():
        if not isinstance(name, str) or not NAME.fullmatch(name) or not isinstance(shape, list) \
                or not all(is_int(n) and n >= 0 for n in shape):
            raise ValueError(f"tensor {name!r} has shape {shape!r}: want a name of model.py's "
                             "kind and a list of sizes")
    if not isinstance(h.get("frozen"), list) or not set(h["frozen"]) <= set(shapes):
        raise ValueError("frozen names tensors the checkpoint does not hold")
    check_model_args(h["model_args"], None)  # its keys and check_shapes_fit: where a model
    # is built from it (declared.build), or resumes it (check_compatible)
    files = h.get("files")
    if not names(files) or not files or not all(map(FILE.fullmatch, files)) \
            or len(set(files)) != len(files):
        raise ValueError(f"files is {files!r}: want shard-NNNNN.safetensors names")
    _check_layout(h.get("layout"), shapes, len(files))
    _check_crcs(h, files)
    if not isinstance(h.get("rng"), list) or len(h["rng"]) != h["world_size"]:
        raise ValueError(f"world_size {h['world_size']} but "
                         f"{len(h['rng']) if isinstance(h.get('rng'), list) else 'no'} "
                         "RNG states")
    for state in h["rng"]:
        check_rng(state)
    if h["meta"].get("tokenizer") in ("char", "gpt2") and check_meta(h["meta"]):
        raise ValueError(f"its meta {check_meta(h['meta'])}")


def _check_crcs(h, files):
    """One {"TENSOR/KEY": crc32} per file, with every piece its layout implies; the fp8
    histories' names, each a tensor of file 0."""
    crcs = h.get("crc")
    if not isinstance(crcs, list) or len(crcs) != len(files) or not all(
            isinstance(c, dict) and all(is_int(v) for v in c.values()) for c in crcs):
        raise ValueError("crc is not one table of checksums per file")
    for i, layout in enumerate(h["layout"]):
        for name in layout:
            want = ("value",) if name in h["frozen"] else ("master", *keys_of(h, name),
                                                           *h["extra_keys"])
            missing = [k for k in want if f"{name}/{k}" not in crcs[i]]
            if missing:
                raise ValueError(f"{files[i]} has no checksum of {name}/{missing[0]}")
    fp8 = h.get("fp8")
    if fp8 is not None and (not isinstance(fp8, dict) or not isinstance(fp8.get("settings"), dict)
                            or not isinstance(fp8.get("history"), list)
                            or not all(f"fp8/{n}" in crcs[0] for n in fp8["history"]
                                       if isinstance(n, str))):
        raise ValueError("its FP8 state is not the one a save writes")


def _check_layout(layout, shapes, n_files):
    if not isinstance(layout, list) or len(layout) != n_files:
        raise ValueError(f"{n_files} files but a layout of "
                         f"{len(layout) if isinstance(layout, list) else 'no'}")
    pieces = {name: [] for name in shapes}
    for r, ranges in enumerate(layout):
        if not isinstance(ranges, dict):
            raise ValueError(f"file {r}'s layout is not a dict")
        for name, span in ranges.items():
            if name not in pieces or not isinstance(span, (tuple, list)) or len(span) != 2 \
                    or not all(is_int(x) for x in span):
                raise ValueError(f"file {r}'s layout has {name!r}: {span!r}")
            pieces[name].append(tuple(span))
    for name, spans in pieces.items():  # sorted, each piece must start where the last ended
        end, numel = 0, math.prod(shapes[name])
        for lo, hi in sorted(spans):
            if lo != end or hi <= lo:
                break
            end = hi
        if end != numel or len(spans) != len(set(spans)):
            raise ValueError(f"the layout's pieces of {name} do not cover [0, {numel}) exactly "
                             f"once: {sorted(spans)[:4]}")


def keys_of(header, name):
    """The optimizer state keys a checkpoint holds for a trainable tensor."""
    return tuple(header["state_keys"].get(name, ()))


def check_rng(state, device=None):
    """One rank's saved RNG states (checkpoint.rng_state's JSON), each set on a generator of
    its own first: a state of the wrong size, type or value is refused before the run's are set.
    A CUDA state's bytes are checked against a CUDA device's generator where device is one
    (the run that restores it), as base64 otherwise."""
    if not isinstance(state, dict) or not {"torch", "numpy", "python"} <= set(state) \
            or not set(state) <= {"torch", "numpy", "python", "cuda"}:
        raise ValueError("its RNG states are not the ones a save writes")
    try:
        as_bytes = lambda s: torch.frombuffer(bytearray(base64.b64decode(s, validate=True)),
                                              dtype=torch.uint8)
        torch.Generator().set_state(as_bytes(state["torch"]))
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos,
                                           has_gauss, gauss))
        version, words, gauss_next = state["python"]
        random.Random().setstate((version, tuple(words), gauss_next))
        cuda = as_bytes(state["cuda"]) if "cuda" in state else None
        if cuda is not None and device is not None and device.type == "cuda" and \
                len(cuda) != torch.cuda.get_rng_state(device).numel():
            raise ValueError("a CUDA state of another size")
    except (TypeError, ValueError, RuntimeError, OverflowError, IndexError, binascii.Error) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise ValueError(f"its RNG states do not fit the generators ({why})")


# ----------------------------------------------------------------------------------------------
# adapters (adapters.load_adapter calls this before apply_lora)

def check_adapter(settings, n_embd, known):
    """An adapter's settings (rank, alpha, dropout, targets) against their types and ranges,
    before any LoRA module is made from them: a rank is at most the model's width (a larger one
    cannot lower any rank). The tensors' shapes are checked against them in adapters.py."""
    keys = {"rank", "alpha", "dropout", "targets"}
    if not isinstance(settings, dict) or set(settings) != keys:
        got = sorted(settings) if isinstance(settings, dict) else settings
        raise ValueError(f"its settings {got} are not {sorted(keys)}")
    r, alpha, dropout, targets = (settings[k] for k in ("rank", "alpha", "dropout", "targets"))
    if not is_int(r) or not 1 <= r <= n_embd:
        raise ValueError(f"rank {r!r}: want an integer in [1, {n_embd}] (the model's width)")
    if not is_number(alpha) or alpha <= 0 or not is_number(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"alpha {alpha!r}, dropout {dropout!r}: want alpha > 0, "
                         "dropout in [0, 1)")
    if not isinstance(targets, list) or not targets or not set(targets) <= set(known) \
            or not all(isinstance(t, str) for t in targets):  # known: the model's (a fork's)
        raise ValueError(f"targets {targets!r}: want a list of {', '.join(known)}")


# ----------------------------------------------------------------------------------------------
# resuming: the same model, vocabulary and settings

# the run flags that change which tensors exist or what they mean: they must match to resume
SETTINGS = {"lora": "--lora", "lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha",
            "lora_targets": "--lora-targets", "quantize": "--quantize",
            "double_quant": "--double-quant"}


def as_flag(flag, value):
    """("--lora-rank", 8): "--lora-rank 8"; ("--lora", False): "--no-lora"; an empty value
    ("" or None): "no --quantize", never "--quantize " with nothing after it."""
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    if value is None or value == "":
        return f"no {flag}"
    return f"{flag} {value}"


def check_compatible(header, model_args, vocab_meta, path, config=None, shapes=None):
    """A checkpoint of another model, vocabulary, LoRA or quantization setting cannot continue
    this run: one line naming the difference and what to change."""
    theirs = header.get("model_args", {})
    diff = [f"{k} {theirs.get(k)} vs {v}" for k, v in model_args.items()
            if k != "dropout" and theirs.get(k) != v]
    if model_args:  # a field this model's config lacks (model_args {}: the tensors alone)
        diff += [f"{k} {theirs[k]} vs none" for k in theirs if k not in model_args]
    if diff:
        raise UserError(f"{path} is for another model ({', '.join(diff)} here): build the "
                        "model it was saved from (train.py: the same model flags), or start "
                        "afresh elsewhere (train.py: another --out-dir)")
    old_vocab, new_vocab = vocab_id(header.get("meta")), vocab_id(vocab_meta)
    if vocab_meta is not None and old_vocab != new_vocab:
        raise UserError(f"{path} was trained on another vocabulary ({old_vocab}, the data is "
                        f"{new_vocab}): the same ids would mean other tokens; use its data set")
    saved = header.get("config", {})
    # the optimizer as named to this run: --optimizer adamw, or torch.optim.AdamW's "AdamW"
    mine = (config or {}).get("optimizer")
    if mine is not None and str(header.get("optimizer")).lower() != str(mine).lower():
        trained = header.get("optimizer")
        raise UserError(f"{path} was trained with optimizer {trained}, this run's is "
                        f"{config.get('optimizer')}: its state would not carry over; build the "
                        f"engine with {trained} (train.py: --optimizer {trained}) to resume it, "
                        "or start afresh elsewhere (train.py: another --out-dir)")
    for key, flag in SETTINGS.items() if config is not None else ():
        mine, old = config.get(key), saved.get(key)
        if key == "lora_targets" and config.get("lora") and saved.get("lora"):
            mine, old = ",".join(parse_targets(mine)), ",".join(parse_targets(old))
        if key != "lora" and not (config.get("lora") or saved.get("lora")):
            continue  # no LoRA on either side: its settings are unused
        if mine != old:
            old, mine = as_flag(flag, old), as_flag(flag, mine)
            fix = f"drop {flag}" if old.startswith("no ") else f"pass {old}"
            raise UserError(f"{path} was saved with {old}, this run has {mine}: {fix} to "
                            "resume it, or use another --out-dir")
    for name, shape in (shapes or {}).items():
        if header["shapes"].get(name) != shape:
            raise UserError(f"{path}: {name} is {header['shapes'].get(name)} there and "
                            f"{shape} here: another model or LoRA setting")
    extra = set(header.get("shapes", {})) - set(shapes or header.get("shapes", {}))
    if extra:
        raise UserError(f"{path} holds {sorted(extra)[0]}, which this model lacks")


# ----------------------------------------------------------------------------------------------
# a fork's model: what the flags read off it (docs/forking.md)

DECLARATIONS = {
    "ARCH": "its architecture's name, which checkpoints carry",
    "blocks": "its repeated layers in forward order, for ZeRO-3's units, --compile, "
              "checkpointing, LoRA and FP8",
    "LINEARS": "each block's linear layers, for LoRA, --quantize and FP8",
    "head": "the final norm, LM head and loss, for --compile",
}


def check_declarations(cls, cfg):
    """The model class declares what this run's flags will read off it: else one line."""
    need = {"ARCH": True,
            "blocks": cfg.zero == 3 or cfg.compile or cfg.grad_ckpt != "none" or cfg.lora
            or cfg.fp8, "LINEARS": cfg.lora or cfg.fp8, "head": cfg.compile}
    missing = [name for name, needed in need.items()
               if needed and getattr(cls, name, None) is None]
    if missing:
        raise ValueError(f"{cls.__name__} declares no {missing[0]}: "
                         f"{DECLARATIONS[missing[0]]} (see docs/forking.md)")


def check_optimizer(name):
    """--optimizer: a ValueError, one line, before any work, for a name optim.build() lacks."""
    if name not in optim.OPTIMIZERS:
        raise ValueError(f"--optimizer {name}: use one of {', '.join(optim.OPTIMIZERS)}")


def check_run(cfg, model_class):
    """What a run's flags ask of the optimizer and the model class, checked before any work: a
    ValueError, one line."""
    check_declarations(model_class, cfg)  # a fork's model: what the flags read off it
    check_optimizer(cfg.optimizer)
    if cfg.lora:  # names of the model's declared LINEARS
        parse_targets(cfg.lora_targets, model_class.LINEARS)


# ----------------------------------------------------------------------------------------------
# LoRA's targets: the model's declared linear layers and the names of their output slices

def declared_linears(model):
    """The model's LINEARS, (path in a block, output slices), each path checked in every block:
    what is missing is one line naming what to declare."""
    linears = getattr(model, "LINEARS", None)
    if linears is None or not hasattr(model, "blocks"):
        raise ValueError(f"{type(model).__name__} declares no LINEARS or blocks(): LoRA and "
                         "quantization find the layers to change there (see model.py's GPT)")
    for i, block in enumerate(model.blocks()):
        for path, _ in linears:
            try:
                block.get_submodule(path)
            except AttributeError:
                raise ValueError(f"{type(model).__name__}.LINEARS names {path!r}, which block {i}"
                                 " does not have: declare the paths of its linear layers")
    return linears


def targets_of(linears):
    """The names LoRA can target: every output slice of the model's declared LINEARS."""
    return tuple(name for _, slices in linears for name in slices)


def parse_targets(spec, linears=None):
    """'q,v' | 'all' | ('q', 'v') -> a tuple of the model's target names (targets_of(linears);
    by default model.GPT's, read when called: a fork's, where model.py was edited), in their
    order. A ValueError, one line, for a name it lacks or a model class that declares none."""
    if linears is None:
        linears = getattr(model_py.GPT, "LINEARS", None)
        if linears is None:
            raise ValueError(f"{model_py.GPT.__name__} declares no LINEARS: each block's linear "
                             "layers, for LoRA, --quantize and FP8 (see docs/forking.md)")
    TARGETS = targets_of(linears)
    if spec == "all":
        names = TARGETS
    else:
        parts = spec.split(",") if isinstance(spec, str) else spec
        names = [s.strip() for s in parts]
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise ValueError(f"unknown LoRA target(s) {bad or spec!r}: "
                         f"use 'all' or a comma list of {', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in names)


# ----------------------------------------------------------------------------------------------
# what every rank must agree on

def agree(flag, device, world_size):
    """True on every rank when it is True on any (one tiny all-reduce)."""
    t = torch.tensor([float(flag)], device=device)
    return bool(collectives.all_reduce_max(t, world_size, label="agree").item())


def agreed_error(errors, hint):
    """The one line every rank raises, from each rank's error or None (all_gather_object's
    list); None when no rank failed. When some failed and others did not (nodes that share
    no disk), it names the first that failed and adds hint: what every node must have."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return None
    r, e = failed[0]
    return e if len(failed) == len(errors) else f"rank {r} of {len(errors)}: {e}; {hint}"
