"""The layout a learner reads: the lecture at the top level (its lines printed), the import
directions that keep it there (the core reaches beyond/ only when a flag asks, configurator
imports nothing of ours, no cycles), and no drift between what the README, docs/ and the
docstrings name and what exists."""
import ast
import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import tokenize

import pytest

from conftest import ROOT

FOLDERS = ("machinery", "beyond")


def tracked(pattern="*.py"):
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    return files


def top_level():
    return sorted(f for f in tracked() if "/" not in f)


def module_name(path):
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


# ----------------------------------------------------------------------------------------------
# the top level's size, printed so that growth is seen (issue 36: structure, no line budget)

def test_the_top_level_is_at_most_15_files_and_its_size_is_printed(capsys):
    """Print each core file's lines and tokens per line (tinygrad's sz.py); at most 15 files."""
    rows, total = [], 0
    for f in top_level():
        source = read(f)
        lines = source.count("\n")
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                  if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                    tokenize.DEDENT, tokenize.COMMENT, tokenize.ENDMARKER)]
        code = sum(1 for line in source.splitlines() if line.strip())
        rows.append((f, lines, len(tokens) / max(code, 1)))
        total += lines
    with capsys.disabled():
        print(f"\n{'file':18}{'lines':>7}{'tokens/line':>13}")
        for f, n, tpl in rows:
            print(f"{f:18}{n:>7}{tpl:>13.1f}")
        print(f"{'total':18}{total:>7}")
    assert len(rows) <= 15, [f for f, _, _ in rows]


# ----------------------------------------------------------------------------------------------
# import directions

def imports(path):
    """(imported module, at module level?) of every import statement in the file."""
    tree, out = ast.parse(read(path)), []
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out += [(n, id(node) in top) for n in [node.module] + names]
    return out


def project_modules():
    return {module_name(f): f for f in tracked() if not f.startswith("tests/")}


def test_import_train_loads_no_post_lecture_module_and_no_hugging_face_code():
    code = ("import sys, train; print(' '.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('beyond', 'machinery') or m in "
            "('transformers', 'huggingface_hub', 'peft'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert not [m for m in loaded if m.startswith("beyond")], loaded
    assert not {"machinery.hf", "machinery.pretrained", "transformers", "huggingface_hub",
                "peft"} & set(loaded), loaded


def test_the_core_reaches_beyond_only_when_a_flag_asks_and_configurator_imports_nothing():
    ours = project_modules()
    for f in top_level():
        eager = [m for m, top in imports(f) if top and m.split(".")[0] == "beyond"]
        assert not eager, f"{f} imports {eager} at module level: import it where its flag is"
    mine = [m for m, _ in imports("configurator.py") if m in ours]
    assert not mine, f"configurator.py imports {mine}"


def test_no_import_cycle():
    ours = project_modules()
    graph = {}
    for name, f in ours.items():
        graph[name] = {m for m, _ in imports(f) if m in ours and m != name}
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError(" -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


# ----------------------------------------------------------------------------------------------
# no drift: every command and every `module.function` the text names exists

EXTERNAL = {"pytest", "venv", "pip", "torch.distributed.run"}  # python -m of other packages
OTHERS = {"setup.py"}  # files of other projects the text names
SUFFIXES = {"bin", "json", "jsonl", "pt", "md", "txt", "safetensors", "png", "tmp"}


def placeholder(name):
    """NAME, {module}, X: a pattern in the text, not a name."""
    return bool(re.search(r"[A-Z]{2,}|[{}]|^X\b", name))
SCRIPTS = ("train.py", "memory.py", "sample.py", "export.py", "data/prepare.py")


def texts():
    """(where, text) of the README, docs/ and every docstring and comment of the project."""
    out = [(f, read(f)) for f in ["README.md", "BENCHMARKS.md"] + tracked("docs/*.md")]
    for f in tracked():
        if f.startswith("tests/"):  # their docstrings name the files they make
            continue
        out.append((f, "\n".join(t.string for t in tokenize.generate_tokens(
            io.StringIO(read(f)).readline) if t.type in (tokenize.STRING, tokenize.COMMENT))))
    return out


def commands(text):
    """Each `python X.py ...` / `python -m X ...` / torchrun ... X.py line, as argv."""
    for line in text.splitlines():
        for m in re.finditer(r"(?:python3?|torchrun)\s[^`|;#\n]*", line):
            try:
                yield shlex.split(m.group(0).rstrip(".:; ),'\"\\"))
            except ValueError:
                continue


def flags_of(script):
    """The option strings a script's parser knows."""
    if script == "train.py":
        from machinery.flags import make_parser
        return set(make_parser()._option_string_actions)
    out = io.StringIO()  # main(["--help"]) in this process: no second start of Python and torch
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(script[:-3].replace("/", ".")).main(["--help"])
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", out.getvalue()))


def test_every_command_the_text_names_exists_with_its_flags():
    known = {s: flags_of(s) for s in SCRIPTS}
    bad = []
    for where, text in texts():
        for argv in commands(text):
            words = [w for w in argv[1:] if not w.startswith("-") and "=" not in w]
            if argv[0].startswith("python") and argv[1:2] == ["-m"] and len(argv) > 2:
                mod = argv[2].rstrip(":")
                if placeholder(mod):
                    continue
                if mod not in EXTERNAL and importlib.util.find_spec(mod) is None:
                    bad.append(f"{where}: python -m {mod}")
                continue
            script = next((w for w in words if w.endswith(".py")), None)
            if script is None or placeholder(script):
                continue
            if not os.path.isfile(os.path.join(ROOT, script)):
                bad.append(f"{where}: {script} does not exist")
            elif script in known:
                after = argv[argv.index(script) + 1:]
                unknown = [w.split("=")[0] for w in after if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)
                           and w.split("=")[0] not in known[script]]
                bad += [f"{where}: {script} has no {u}" for u in unknown]
    assert not bad, "\n".join(sorted(set(bad)))


MODULES = {module_name(f).split(".")[-1]: module_name(f) for f in tracked()
           if not f.startswith(("tests/", "bench/")) and not f.endswith("__init__.py")}
VARIABLES = {"model", "zero", "train", "checkpoint", "memory", "sample", "export", "data",
             "loss", "quant", "lora"}  # also names of objects in prose: `model.generate`


def tiny_gpt():
    from model import GPT, GPTConfig
    return GPT(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=8))


def tiny_zero():
    from zero import ZeRO
    return ZeRO(tiny_gpt(), 0)


INSTANCES = {"model": tiny_gpt, "zero": tiny_zero}  # `model.grad_ckpt`: an object's attribute


def resolves(obj, attrs):
    for a in attrs:
        if not hasattr(obj, a):
            return False
        obj = getattr(obj, a)
    return True


def test_every_module_function_the_text_names_exists():
    """`module.attr[.attr]` in backticks anywhere, and in docstrings and comments without
    them unless the module's name is also a common variable's (model.grad_ckpt); a bare
    `name.py` must be a file of ours."""
    files = {os.path.basename(f) for f in tracked()} | {f for f in tracked()}
    bad = []
    for where, text in texts():
        prose = not where.endswith(".py")
        for m in re.finditer(r"(?<![\w./])((?:machinery|beyond)/)?(\w+)\.py\b", text):
            name = (m.group(1) or "") + m.group(2) + ".py"
            if name not in files | OTHERS and not placeholder(name):
                bad.append(f"{where}: {name}")
        pattern = r"`([a-z_0-9]+(?:\.[A-Za-z_]\w*)+)" if prose else \
            r"(?<![\w.`/])([a-z_0-9]+(?:\.[A-Za-z_]\w*)+)"
        for m in re.finditer(pattern, text):
            first, *attrs = m.group(1).split(".")
            if first not in MODULES or attrs[0] == "py" or attrs[0] in SUFFIXES \
                    or (not prose and first in VARIABLES):
                continue
            if not resolves(importlib.import_module(MODULES[first]), attrs) and not (
                    first in INSTANCES and resolves(INSTANCES[first](), attrs)):
                bad.append(f"{where}: {m.group(1)}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_zero_2_end_to_end_reads_in_five_files():
    """The README's reading count: ZeRO-2 end to end is train.py's step, zero.py and what it
    imports of the lecture (collectives.py, optim.py), and precision.py's scaler."""
    ours = project_modules()
    lecture = {m for m, top in imports("zero.py") if top and m in ours and "." not in m
               and m not in FOLDERS}  # a one-line guard of machinery/ is no reading
    assert lecture == {"collectives", "optim"}, lecture
    assert {m for m, top in imports("train.py") if m in ("zero", "precision")} == \
        {"zero", "precision"}
