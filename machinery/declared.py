"""
Guards what the commands read off a model: its declaration, or a default, or one line.

train.py, sample.py, export.py, memory.py, the console and the checkpoints read a few things
off the model. model.py's GPT declares them all. A fork declares what its flags need
(validate.check_declarations says which, before any work), and for the rest the commands call
here, each in one line: the default where one is natural, else one line that names what to
declare. docs/forking.md has the whole table.

  CONFIG            the config dataclass the model is built from (default: model.GPTConfig)
  config            the instance the model keeps: checkpoints save it as model_args
  stored_shapes()   each tensor's shape as files hold it (default: the state dict's, a tied
                    tensor once)
  config.n_embd     what bounds a LoRA rank (width(); default: the narrowest side of LINEARS)
  load_weights(sd)  a state dict in, as files hold it (default: a copy by stored_shapes)
  num_params()      the console's count (default: every parameter once)
  flops_per_token() MFU's numerator (default: none, so MFU is not shown)
  generate(...)     sample.py's loop (default: model.py's loop over forward's logits)
"""
import contextlib
from dataclasses import asdict, fields, is_dataclass

import torch

from configurator import UserError

# train.py's model flags: a flag given whose field the model's config lacks changes nothing
MODEL_FLAGS = ("block_size", "n_layer", "n_head", "n_embd", "dropout", "bias")


# ----------------------------------------------------------------------------------------------
# the config: built from train.py's flags, saved as model_args, rebuilt from a file

def config_class(cls):
    """The dataclass cls is built from: its CONFIG, else model.py's GPTConfig."""
    import model  # when called: a fork's model.py may import this module at its own import
    return getattr(cls, "CONFIG", None) or model.GPTConfig


def config_of_flags(cls, flags, vocab_size):
    """The config train.py's flags describe, for model class cls: each field named like a
    flag (TrainConfig) takes the flag's value, vocab_size the data's, arch the class's ARCH;
    the rest keep their defaults. A UserError, one line, for a config without vocab_size, a
    model flag given that has no field, or a shape the config refuses."""
    config = config_class(cls)
    names = {f.name for f in fields(config)}
    if "vocab_size" not in names:
        raise UserError(f"{config.__name__} has no field vocab_size: train.py sets it to the "
                        "data's vocabulary (docs/forking.md)")
    lost = [k for k in MODEL_FLAGS if k in getattr(flags, "explicit", ()) and k not in names]
    if lost:
        raise UserError(f"--{lost[0].replace('_', '-')}: {config.__name__} has no field "
                        f"{lost[0]}, so the flag would change nothing; drop it")
    values = {n: getattr(flags, n) for n in names if hasattr(flags, n)}
    values.update(vocab_size=vocab_size, **({"arch": cls.ARCH} if "arch" in names else {}))
    try:
        return config(**values)
    except (TypeError, ValueError) as e:
        raise UserError(f"{config.__name__}: {e}")


def config_for(cls, config):
    """config as the dataclass cls is built from: itself, or that class made from the fields
    of the same name (memory's check at start-up describes the flags' model as a GPTConfig).
    A ValueError when that class refuses them."""
    want = config_class(cls)
    if isinstance(config, want):
        return config
    names = {f.name for f in fields(want)}
    values = {k: v for k, v in asdict(config).items() if k in names}
    if "arch" in names and hasattr(cls, "ARCH"):
        values["arch"] = cls.ARCH
    try:
        return want(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{want.__name__}: {e}")


def build(cls, args, shapes=None):
    """The model a file's model_args describe (sample.py, export.py): its architecture, keys
    and sizes checked against cls's ARCH, its config's fields and validate.BOUNDS before
    anything is built; for a fork, against the file's tensors too (shapes: {name: shape}). A
    ValueError, one line."""
    config, args = config_class(cls), dict(args)
    arch, ours = args.get("arch"), getattr(cls, "ARCH", None)
    if arch is not None and ours is not None and arch != ours:
        raise ValueError(f"it holds a {arch!r} model, model.py builds {ours!r}: use the code "
                         "that trained it")
    if "arch" not in {f.name for f in fields(config)}:  # model_args() added it: the ARCH
        args.pop("arch", None)
    from machinery.validate import check_model_args  # it imports model.py: when called
    check_model_args(args, config)
    if shapes is not None and arch != "gpt2":  # (GPT-2's: validate.check_shapes_fit)
        check_holds(_make(cls, config, args, "meta"), shapes)
    return _make(cls, config, args)


def _make(cls, config, args, device=None):
    try:
        with torch.device(device) if device else contextlib.nullcontext():
            return cls(config(**args))
    except (TypeError, AttributeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{cls.__name__}({config.__name__}(...)) failed: {e}")


def check_holds(meta_model, shapes):
    """A fork's config has fields no bound knows (d_model, n_experts): the model its file's
    model_args describe, built on the meta device (nothing allocated), must be one its tensors
    hold, each of its tensors there at its shape (a quantized one as its pieces, NAME.codes),
    before the real one is built. A header edited to 10^5 wide would allocate first."""
    from checkpoint import stored_shapes  # it imports model.py: when called
    for name, shape in stored_shapes(meta_model).items():
        held = shapes.get(name)
        if held is None and any(k.startswith(f"{name}.") for k in shapes):
            continue  # a quantized base: its codes and scales
        if held is None or list(held) != list(shape):
            raise ValueError(f"its model_args describe {name} as {list(shape)}, its tensors "
                             f"hold {'none' if held is None else list(held)}")


def check_model(model, flags):
    """After train.py builds the model: what the run's flags will set on it, it keeps. A model
    that never reads grad_ckpt would train without checkpointing, and say nothing."""
    name = type(model).__name__
    if not is_dataclass(getattr(model, "config", None)):
        raise UserError(f"{name} keeps no self.config (a dataclass): the console, memory.py "
                        "and the checkpoints read it (docs/forking.md)")
    needs = {"grad_ckpt": (flags.grad_ckpt != "none", "--grad-ckpt sets it; the block loop "
                           "reads it (copy model.py's)"),
             "cross_entropy": (flags.chunked_loss, "--chunked-loss sets it; the loss head "
                               "calls it (model.py's head)")}
    for attr, (needed, why) in needs.items():
        if needed and not hasattr(model, attr):
            raise UserError(f"{name} has no self.{attr}: {why} (docs/forking.md)")
    if flags.lora or flags.fp8:  # each path of its LINEARS, in every block
        from machinery.validate import declared_linears  # it imports model.py: when called
        declared_linears(model)


# ----------------------------------------------------------------------------------------------
# the weights as files hold them

def load_weights(model, weights):
    """The model's load_weights, else model.py's: a copy of every stored tensor into its own,
    the tied one once. A ValueError names a tensor that does not fit."""
    if hasattr(model, "load_weights"):
        return model.load_weights(weights)
    import model as model_py  # when called: a fork's model.py may import this module
    return model_py.load_weights(model, weights)


def width(model):
    """What bounds a LoRA rank (a larger one lowers no rank): the config's n_embd, else the
    narrowest side of the linear layers LINEARS declares in the first block (a fork's config
    may name its width otherwise)."""
    n = getattr(getattr(model, "config", None), "n_embd", None)
    if n is not None:
        return n
    block = model.blocks()[0]
    return min(min(block.get_submodule(path).weight.shape) for path, _ in model.LINEARS)


# ----------------------------------------------------------------------------------------------
# the console and sample.py

def num_params(model):
    """The console's parameter count: the model's num_params(non_embedding=False), else every
    parameter once (parameters() already counts a tied tensor once)."""
    if hasattr(model, "num_params"):
        return model.num_params(non_embedding=False)
    return sum(p.numel() for p in model.parameters())


def estimate_mfu(model, tokens_per_sec, peak_flops):
    """Model FLOPs utilisation: the model's estimate_mfu, else its flops_per_token() over the
    peak. None (not shown) without a peak, or for a model that declares neither: no count
    of its FLOPs is natural (6N leaves out attention, which depends on its layers)."""
    if hasattr(model, "estimate_mfu"):
        return model.estimate_mfu(tokens_per_sec, peak_flops)
    if not peak_flops or not hasattr(model, "flops_per_token"):
        return None
    return model.flops_per_token() * tokens_per_sec / peak_flops


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
    """The model's generate, else model.py's loop over forward's logits, the context cut to the
    config's block_size where it has one: for a forward that gives (logits, loss)."""
    if hasattr(model, "generate"):
        return model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k,
                              generator=generator)
    out = model(idx[:, -1:])
    if not (isinstance(out, tuple) and len(out) == 2):
        raise UserError(f"{type(model).__name__}(idx) gives {type(out).__name__}, not "
                        "(logits, loss): sample.py samples from the logits, or declare "
                        "generate() (docs/forking.md)")
    block = getattr(getattr(model, "config", None), "block_size", None)
    import model as model_py  # when called: a fork's model.py may import this module
    return model_py.generate(model, idx, max_new_tokens, temperature, top_k, generator, block)
