"""
Guards the command line: every TrainConfig field a flag, presets read without running them,
and every refusal one line.

  1. Every field becomes a flag: `zero` -> --zero, `grad_ckpt` -> --grad-ckpt, with its
     help text, choices and range from the field (configurator.py).
  2. Precedence: the dataclass defaults < a preset file (--config) < explicit flags.
  3. A preset is a file of plain `name = value` lines, parsed with `ast`, never executed
     (nanoGPT's configurator exec()s Python files).
"""
import argparse
import ast
import os
from dataclasses import fields

from configurator import ROOT, ConfigError, TrainConfig, check_config


def load_preset(path):
    """A preset is a file of plain `name = literal` lines; parsed, never executed."""
    for cand in (path, path + ".py", os.path.join(ROOT, "config", path),
                 os.path.join(ROOT, "config", path + ".py")):
        if os.path.isfile(cand):
            path = cand
            break
    else:
        raise ConfigError(f"no preset {path!r}: see the files in config/")
    known = {f.name: f for f in fields(TrainConfig)}
    out = {}
    with open(path) as f:
        source = f.read()
    for node in ast.parse(source, path).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise ConfigError(f"{path}:{node.lineno}: presets hold only `name = value` lines")
        name = node.targets[0].id
        if name not in known:
            raise ConfigError(f"{path}:{node.lineno}: unknown setting {name!r}")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise ConfigError(f"{path}:{node.lineno}: {name} must be a literal value")
        ftype = known[name].type
        if ftype is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not ftype:
            choices = known[name].metadata["choices"]
            hint = f" ({', '.join(map(repr, choices))})" if choices else ""
            raise ConfigError(f"{path}:{node.lineno}: {name} must be {ftype.__name__}{hint}, "
                              f"got {value!r}")
        out[name] = value
    return out


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one-line ConfigErrors."""

    def error(self, message):  # one line, no usage dump
        raise ConfigError(message)


# --help groups the flags as TrainConfig's sections above: the first field of each
SECTIONS = {"out_dir": "I/O", "lora": "LoRA and a quantized frozen base", "n_layer": "model",
            "batch_size": "batch", "optimizer": "the optimizer and its schedule",
            "device": "system: precision, parallelism, memory"}


def make_parser(description="Train a GPT with nanoZeRO."):
    """Every TrainConfig field as a flag, grouped by section, its help ending in the default a
    run gets without a preset (memory.py adds its own flags to the same parser). The flags'
    own defaults stay None: a preset then fills what no flag set."""
    p = OneLineParser(description=description, allow_abbrev=False)
    p.add_argument("--config", help="a preset from config/, e.g. config/shakespeare_char.py; "
                   "its values replace these defaults, explicit flags win over both")
    group = p
    for f in fields(TrainConfig):
        if f.name in SECTIONS:
            group = p.add_argument_group(SECTIONS[f.name])
        flag, shown = "--" + f.name.replace("_", "-"), f.default
        help = f"{f.metadata['help']} (default: {'none' if shown == '' else shown})"
        if f.type is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help)
            continue
        choices = f.metadata["choices"] or ()
        names = "|".join(str(c) for c in choices if c != "")
        group.add_argument(flag, type=f.type, default=None, help=help,
                           metavar=f"{{{names}}}" if names else f.type.__name__.upper(),
                           **f.metadata["argparse"])  # --grad-ckpt's nargs and const
        if f.name == "grad_ckpt":
            group.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_const",
                               const="none", help="the same as --grad-ckpt none")
        if f.name == "dtype":
            group.add_argument("--bf16", action="store_true", help="shortcut for --dtype bf16")
            group.add_argument("--fp16", action="store_true", help="shortcut for --dtype fp16")
    return p


def parse_args(argv=None):
    return config_from(make_parser().parse_args(argv))


def config_from(args):
    """The TrainConfig of parsed flags: defaults < the preset < the flags, then checked."""
    values = load_preset(args.config) if args.config else {}
    values.update({k: v for k, v in vars(args).items()
                   if v is not None and k in TrainConfig.__dataclass_fields__})
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 conflict: pick one")
    for short in ("bf16", "fp16"):
        if getattr(args, short):
            if args.dtype not in (None, short):
                raise ConfigError(f"--{short} conflicts with --dtype {args.dtype}: pick one")
            values["dtype"] = short
    given = frozenset(values)  # a preset's or a flag's: train.fit_schedule derives the rest
    cfg = TrainConfig(**values)
    # the fields a preset or a flag set: --init-from a Hugging Face model takes the model's
    # shape from its config.json, and must know a flag that contradicts it from a default; a
    # short run's schedule follows --max-iters, a resume keeps the checkpoint's unless one is
    # given (train.fit_schedule, train.keep_schedule)
    cfg.explicit = given
    check_config(cfg)
    return cfg
