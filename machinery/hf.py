"""
Hugging Face's GPT-2 files in and out: safetensors' own reader and writer for the weights,
transformers' GPT2Config for the config.json written, huggingface_hub for a hub name.

The HF layout of GPT-2 (transformers' GPT2LMHeadModel) differs from model.py's in three ways:
  - Conv1D, not nn.Linear: the four matmul weights of a block (attn.c_attn, attn.c_proj, mlp.c_fc,
    mlp.c_proj) are stored (in, out), the transpose of nn.Linear's (out, in). Biases and LayerNorm
    parameters are the same either way.
  - The head is tied to the token embedding, so files hold wte once and no lm_head.weight (old
    .bin files may hold both, equal). Some files also hold the causal mask as `attn.bias` and
    `attn.masked_bias`: buffers, not weights; we skip them (`attn.c_attn.bias` is a weight).
  - Key prefixes: GPT2LMHeadModel writes `transformer.h.0.ln_1.weight`, but the hub's own `gpt2`
    files were saved from GPT2Model and say `h.0.ln_1.weight`. We accept both, write the former.

Why the way in is not transformers' from_pretrained: it builds a whole GPT2LMHeadModel first,
a second copy of a 16-bit model beside ours (docs/lora.md has the measurement, by
`python -m bench.hf_load`). safe_open reads one tensor at a time into the GPT we built on the
meta device. And config.json
is read as JSON and checked here: GPT2Config takes what model.py cannot run (n_inner=100,
activation_function="relu") without a word, so the checks would be ours either way.
"""
import importlib
import json
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from machinery.adapters import KEY, fingerprint_tensors
from model import GPTConfig
from machinery.validate import check_hf_types, check_model_args, crc
from configurator import UserError

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SKIP = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older transformers versions
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a GPT-2 export may be in
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")




def _one_line(e):
    return f"{type(e).__name__}: {e}".splitlines()[0]


# ----------------------------------------------------------------------------------------------
# Configs

def gpt2_config_to_model_args(cfg):
    """A config.json dict -> GPTConfig kwargs; a UserError for any GPT-2 variant model.py
    can't run."""
    get = lambda k, default: default if cfg.get(k) is None else cfg[k]
    try:  # "1e-5" or 2.0 is another program's config, not a GPT-2 we can read
        check_hf_types(cfg)
    except ValueError as e:
        raise UserError(f"config.json: {e}") from None
    if cfg.get("model_type") != "gpt2":
        raise UserError(f"model_type {cfg.get('model_type')!r} is not gpt2")
    act = get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):  # both are tanh-GELU, model.py's activation
        raise UserError(f"activation_function {act!r}: only gelu_new / gelu_pytorch_tanh "
                        "are GPT-2's")
    unsupported = [k for k in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                               "add_cross_attention") if cfg.get(k)]
    unsupported += [] if get("scale_attn_weights", True) else ["scale_attn_weights=false"]
    unsupported += [] if get("tie_word_embeddings", True) else ["tie_word_embeddings=false"]
    n_embd = get("n_embd", 768)
    if get("n_inner", 4 * n_embd) != 4 * n_embd:
        unsupported.append(f"n_inner={cfg['n_inner']} (model.py's MLP is 4*n_embd={4 * n_embd})")
    if abs(get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        unsupported.append(f"layer_norm_epsilon={cfg['layer_norm_epsilon']} (model.py uses 1e-5)")
    if unsupported:
        raise UserError(f"GPT-2 config with unsupported features: {', '.join(unsupported)}")
    args = dict(block_size=get("n_positions", 1024), vocab_size=get("vocab_size", 50257),
                n_layer=get("n_layer", 12), n_head=get("n_head", 12), n_embd=n_embd,
                dropout=float(get("resid_pdrop", 0.0)), bias=True)  # GPT-2 uses 0.1 everywhere
    try:  # sizes within validate.BOUNDS: 10^5 layers is one line now, not minutes of building
        check_model_args(args)
    except ValueError as e:
        raise UserError(f"config.json: {_one_line(e)}") from None
    return args


def library(name, needed_for):
    """import name, or UserError with the line that installs it (an optional dependency)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UserError(f"{needed_for} needs {name}, which is not installed: "
                        f"pip install {name}") from None


def model_args_to_gpt2_config(model_args, dtype=torch.float32):
    """GPTConfig kwargs -> transformers' GPT2Config (written by its own save_pretrained)."""
    transformers = library("transformers", "writing a Hugging Face GPT-2")
    a, d = model_args, model_args.get("dropout", 0.0)
    eot = 50256 if a["vocab_size"] > 50256 else None  # <|endoftext|>, where the vocabulary has it
    config = transformers.GPT2Config(
        n_positions=a["block_size"], vocab_size=a["vocab_size"], n_layer=a["n_layer"],
        n_head=a["n_head"], n_embd=a["n_embd"], resid_pdrop=d, embd_pdrop=d, attn_pdrop=d,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=eot,
        eos_token_id=eot, architectures=["GPT2LMHeadModel"])
    config.dtype = dtype
    return config


def expected_shapes(model_args):
    """Our state dict's names and shapes (nn.Linear layout) for these GPTConfig kwargs; the tied
    lm_head.weight is left out, it is transformer.wte.weight."""
    C, V, T = model_args["n_embd"], model_args["vocab_size"], model_args["block_size"]
    out = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}
    for i in range(model_args["n_layer"]):
        for name, shape in (("ln_1", (C,)), ("attn.c_attn", (3 * C, C)), ("attn.c_proj", (C, C)),
                            ("ln_2", (C,)), ("mlp.c_fc", (4 * C, C)), ("mlp.c_proj", (C, 4 * C))):
            out[f"transformer.h.{i}.{name}.weight"] = shape
            out[f"transformer.h.{i}.{name}.bias"] = shape[:1]
    out["transformer.ln_f.weight"] = out["transformer.ln_f.bias"] = (C,)
    return out


# ----------------------------------------------------------------------------------------------
# Weights in

def locate(source, cache_dir=None):
    """A local folder or weights file as is; a hub name (gpt2, openai-community/gpt2-xl, ...)
    that is not a local path is downloaded with huggingface_hub (optional) and its folder returned.
    Callers that read twice (read_config, then load_into) can locate once and pass the result."""
    source = os.fspath(source)
    if os.path.exists(source):
        return source
    repo = source if "/" in source else f"openai-community/{source}"
    if repo.split("/")[0] != "openai-community" or repo.split("/")[1] not in HUB_NAMES:
        raise UserError(f"{source}: no such file or folder, and not one of {', '.join(HUB_NAMES)}:"
                        " pass a folder holding a GPT-2's config.json and model.safetensors")
    short = repo.split("/")[1]
    hint = (f"download it on a connected machine (`hf download {repo} --local-dir {short}`) "
            f"and pass the folder, e.g. --init-from ./{short}")
    try:
        from huggingface_hub import snapshot_download  # optional: only hub names need it
    except ImportError:
        raise UserError(f"{source}: huggingface_hub is not installed (pip install "
                        f"huggingface_hub); {hint}") from None
    try:
        files = ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*"]
        return snapshot_download(repo, cache_dir=cache_dir, allow_patterns=files)
    except Exception as e:  # offline, unreachable, rate-limited: one message for all
        raise UserError(f"{source}: cannot download ({_one_line(e)}); {hint}") from None


def _folder_and_files(path):
    """(folder holding config.json, [weights files]) for a folder or a weights file."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        found = [f for f in WEIGHT_FILES if os.path.exists(os.path.join(path, f))]
        if not found:
            raise UserError(f"{path}: no {', '.join(WEIGHT_FILES)} in this folder")
        path = os.path.join(path, found[0])  # index before single file, safetensors before .bin
    if path.endswith(".index.json"):
        try:
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except Exception as e:
            raise UserError(f"{path}: unreadable shard index ({_one_line(e)})") from None
        return folder, [os.path.join(folder, s) for s in shards]
    return folder, [path]


def check_weights(source, cache_dir=None):
    """read_config, and every weights file's tensor names and shapes against it, from the
    files' headers alone: before a model is built at the size config.json claims."""
    with Weights(source, cache_dir) as w:
        return w.model_args


def read_config(source, cache_dir=None):
    """GPTConfig kwargs from the config.json of a folder (or beside a weights file)."""
    folder, _ = _folder_and_files(locate(source, cache_dir))
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise UserError(f"{folder}: no config.json (a Hugging Face model folder has one)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except Exception as e:
        raise UserError(f"{path}: unreadable ({_one_line(e)})") from None
    return gpt2_config_to_model_args(cfg)


def _open(path, stack):
    """{name: (shape, reader)} of one weights file. Shapes come from the safetensors header; a
    tensor's bytes are read when its reader is called. A .bin is memory-mapped instead (old
    non-zip .bin files cannot be, and are read whole)."""
    try:
        if path.endswith(".safetensors"):  # ours keep a crc32 per tensor: checked when read
            f = stack.enter_context(safe_open(path, framework="pt"))
            crcs = json.loads((f.metadata() or {}).get(KEY, "{}")).get("crc32")
            return {k: (tuple(f.get_slice(k).get_shape()),
                        lambda k=k: _checked(path, crcs, k, f.get_tensor(k))) for k in f.keys()}
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        return {k: (tuple(t.shape), lambda k=k: sd[k]) for k, t in sd.items()}
    except Exception as e:
        raise UserError(f"{path}: unreadable ({_one_line(e)})") from None


def crc32(t):
    """A tensor's bytes' crc32 (validate.crc), 8 hex digits: what our files keep to see a
    flipped byte."""
    return f"{crc(t.cpu()):08x}"


def _checked(path, crcs, name, t):
    if crcs is not None and crcs.get(name) != crc32(t):  # a file from elsewhere has none
        raise UserError(f"{path}: {name} fails its checksum (crc32 {crc32(t)}, saved "
                        f"{crcs.get(name)}): its bytes changed")
    return t


def _read_plan(files, model_args, stack):
    """Check every file's names and shapes against the config before reading any data; returns
    [(our name, reader, transpose)], lm_head (if present) last so that wte comes before it."""
    readers = {}
    for path in files:
        for name, (shape, read) in _open(path, stack).items():
            if name.endswith(SKIP):
                continue
            key = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
            readers[key] = (name, path, shape, read)
    plan, want = [], expected_shapes(model_args)
    for ours, shape in want.items():
        if ours not in readers:
            raise UserError(f"{files[0]}: tensor {ours.removeprefix('transformer.')} is missing")
        name, path, got, read = readers[ours]
        transpose = ours.endswith(CONV1D)
        shape = shape[::-1] if transpose else shape  # the file holds (in, out)
        if got != shape:
            raise UserError(f"{path}: tensor {name} has shape {got}, the config says {shape}")
        plan.append((ours, read, transpose))
    extra = sorted(set(readers) - set(want) - {"lm_head.weight"})
    if extra:
        raise UserError(f"{files[0]}: unexpected tensor {extra[0]} (not GPT2LMHeadModel's)")
    if "lm_head.weight" in readers:  # a tied head saved twice: checked equal to wte when read
        plan.append(("lm_head.weight", readers["lm_head.weight"][3], False))
    return plan


class Weights:
    """A Hugging Face GPT-2's weights (a folder, a weights file or a hub name), every name and
    shape checked against its config.json from the files' headers alone. w[name] reads one
    tensor from its file, in model.py's layout and fp32: never a whole copy of the model in
    host memory. Iterates in model order, lm_head.weight last where a file holds the tied head
    twice. The files stay open until close (or the with block's end)."""

    def __init__(self, source, cache_dir=None):
        self.source = locate(source, cache_dir)
        self.model_args = read_config(self.source)
        self.stack = ExitStack()
        _, files = _folder_and_files(self.source)
        self.plan = {ours: (read, tr) for ours, read, tr
                     in _read_plan(files, self.model_args, self.stack)}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()

    def __contains__(self, name):
        return name in self.plan

    def __iter__(self):
        return iter(self.plan)

    def __getitem__(self, name):
        read, transpose = self.plan[name]
        try:
            t = read().float()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{self.source}: cannot read {name} ({_one_line(e)})") from None
        return t.t() if transpose else t


def _check_tied(head, wte):
    if not torch.equal(head.to(wte.device, wte.dtype), wte):
        raise UserError("lm_head.weight differs from transformer.wte.weight: GPT-2's head is tied")


def load_pretrained(source, cache_dir=None):
    """(GPTConfig kwargs, state dict in model.py's names, fp32) from a folder, a weights file or a
    hub name. lm_head.weight and transformer.wte.weight are the same tensor, as in GPT's own."""
    sd = {}
    with Weights(source, cache_dir) as w:
        for ours in w:
            if ours == "lm_head.weight":
                _check_tied(w[ours], sd["transformer.wte.weight"])
            else:  # contiguous, and not a view of a mapped file
                t = w[ours]
                sd[ours] = torch.empty(t.shape).copy_(t)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return w.model_args, sd


@torch.no_grad()
def load_into(model, source, cache_dir=None):
    """Copy the weights into an existing GPT's parameters, tensor by tensor, in the model's dtype
    and device: host memory never holds more than the model and one tensor. The model must have
    been built from read_config(source) (LoRA applied or not; not yet quantized), or with a
    smaller block_size: its position embedding then gets the file's first rows (nanoGPT's
    crop_block_size). On an UserError from a tensor read, the model is partly overwritten.
    Returns the GPTConfig kwargs."""
    with Weights(source, cache_dir) as w:
        have = {k: getattr(model.config, k) for k in w.model_args if k != "dropout"}
        if any(have[k] != w.model_args[k] for k in have if k != "block_size") \
                or have["block_size"] > w.model_args["block_size"]:
            raise UserError(f"{source} is {w.model_args}, the model is {have}: build it from "
                            "read_config")
        params = dict(model.named_parameters())
        missing = [k for k in expected_shapes(w.model_args) if k not in params]
        if missing:  # a quantized weight is a module of buffers, not a parameter
            raise UserError(f"the model has no parameter {missing[0]}: load before quantize_base")
        for ours in w:
            t, target = w[ours], params["transformer.wte.weight" if ours == "lm_head.weight"
                                        else ours]
            # the first rows of each: model.py pads the embedding with rows of zeros, and a
            # cropped position embedding has fewer rows than the file's
            n = min(len(t), len(target))
            if ours == "lm_head.weight":
                _check_tied(t, target[:n])
            else:
                target[:n].copy_(t[:n])
    return w.model_args


def base_fingerprint(source, cache_dir=None):
    """adapters.base_fingerprint of GPT(read_config(source)) loaded from source in fp32 (what
    sample.py loads as this base), read a tensor at a time: a 16-bit or cropped run names its
    base without ever holding an fp32 copy of the model."""
    with Weights(source, cache_dir) as w:
        rows = GPTConfig(**w.model_args).padded_vocab

        def read(name):  # as GPT holds it: model.py's padded rows as zeros, the head tied
            t = w["transformer.wte.weight" if name == "lm_head.weight" else name]
            if name in ("lm_head.weight", "transformer.wte.weight"):
                t = torch.cat([t, t.new_zeros(rows - len(t), t.shape[1])])
            return t

        names = sorted(set(w) | {"lm_head.weight"})  # GPT's state dict has both
        return fingerprint_tensors((name, read(name)) for name in names)


# ----------------------------------------------------------------------------------------------
# Weights out

def save_hf(state_dict, model_args, out_dir, dtype=torch.float32):
    """Write config.json + model.safetensors that transformers' GPT2LMHeadModel.from_pretrained
    loads, in dtype (fp32, bf16 or fp16). Every name and shape is checked before anything is
    written. A bias=False model gets zero biases: a zero bias adds nothing, so the logits are
    the same, and refusing would leave such models no way out. safetensors' save_file takes
    every tensor at once: the transposed matmul weights are a second copy of most of the model
    while it writes (the export holds the model already; host memory, never a GPU's)."""
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype}: use one of {', '.join(map(str, DTYPES))}")
    lora = [k for k in state_dict if "lora_" in k]
    if lora:
        raise UserError(f"{lora[0]} is a LoRA tensor: export the base (merged with "
                        "lora.merge_lora, lora_ keys dropped), or the adapter with "
                        "adapters.save_adapter")
    try:
        GPTConfig(**model_args)
    except (TypeError, ValueError) as e:
        raise UserError(f"model_args: {_one_line(e)}") from None
    V = model_args["vocab_size"]  # a model's own state dict holds model.py's padded rows: cut them
    state_dict = {k: v[:V] if k in ("transformer.wte.weight", "lm_head.weight") else v
                  for k, v in state_dict.items()}
    want = expected_shapes(model_args)
    for name, shape in want.items():
        zero_bias = name.endswith(".bias") and not model_args.get("bias", True)
        t = state_dict.get(name)
        if (t is None and not zero_bias) or (t is not None and tuple(t.shape) != shape):
            got = "missing" if t is None else f"of shape {tuple(t.shape)}"
            raise UserError(f"state dict: {name} is {got}, the model args say {shape}")
    extra = sorted(set(state_dict) - set(want) - {"lm_head.weight"})
    if extra:
        raise UserError(f"state dict: unexpected tensor {extra[0]} (not one of GPT's)")
    if "lm_head.weight" in state_dict:
        _check_tied(state_dict["lm_head.weight"], state_dict["transformer.wte.weight"])
    config = model_args_to_gpt2_config(model_args, dtype)  # before a byte: transformers is there
    tensors = {}
    for name, shape in want.items():
        t = state_dict.get(name)
        t = torch.zeros(shape) if t is None else t.detach().cpu()
        tensors[name] = (t.t() if name.endswith(CONV1D) else t).to(dtype).contiguous()
    crcs = json.dumps({"crc32": {k: crc32(t) for k, t in tensors.items()}}, sort_keys=True)
    os.makedirs(out_dir, exist_ok=True)  # other files in out_dir (a tokenizer) stay
    tmp = os.path.join(out_dir, f".model.safetensors.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": "pt", KEY: crcs})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))  # the old file or the new one
    config.save_pretrained(out_dir)  # config.json, as the installed transformers writes it
