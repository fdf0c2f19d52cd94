"""The layout a learner reads, asserted as structure, not as a line budget: the engine imports
only the engine, train.py leans on at most two machinery modules, each lecture claim is defined
in a lecture file, a default run loads nothing from beyond/, no cycles; every file's lines and
tokens printed so growth is seen; and no drift between what the README, docs/, the benchmarks,
the tests and the docstrings name and what exists."""
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
ENGINE = ("zero.py", "zero3.py", "collectives.py", "precision.py", "optim.py")
# the reading order of the README: the five files ZeRO-2 needs end to end, then ZeRO-3, LoRA,
# QLoRA and checkpoints; nanoGPT's model.py + train.py beside it (`wc -l` and this file's token
# count on karpathy/nanoGPT at 3adf61e: 666 lines, 4,120 tokens)
ZERO2 = ("train.py", "zero.py", "collectives.py", "precision.py", "optim.py")
READING = ZERO2 + ("zero3.py", "lora.py", "quant.py", "checkpoint.py")
LECTURE = READING + ("model.py",)  # hold their technique and nothing else


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
# sizes, printed (tinygrad's sz.py): growth is seen, not capped

def size(path):
    """(lines, tokens) of a Python file: tokens as tinygrad's sz.py counts them (no comments,
    no layout tokens)."""
    source = read(path)
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                tokenize.DEDENT, tokenize.COMMENT, tokenize.ENDMARKER)]
    return source.count("\n"), len(tokens)


def test_sizes_are_printed_and_the_top_level_stays_few_files(capsys):
    """Each file's lines and tokens, by folder, and the reading order's beside nanoGPT's:
    printed so growth is seen (the product beside the lesson it serves), never capped. What
    holds: the top level stays a lecture of few files."""
    groups = {"lecture": top_level(), **{d: [f for f in tracked() if f.startswith(d + "/")]
                                         for d in FOLDERS}}
    totals = {}
    with capsys.disabled():
        for group, files in groups.items():
            print(f"\n{group:26}{'lines':>7}{'tokens':>8}")
            rows = [(f, *size(f)) for f in files]
            for f, lines, tokens in rows:
                print(f"{f:26}{lines:>7}{tokens:>8}")
            totals[group] = tuple(map(sum, zip(*[r[1:] for r in rows])))
            print(f"{'total':26}{totals[group][0]:>7}{totals[group][1]:>8}")
        for name, files in (("ZeRO-2 end to end", ZERO2), ("the reading order", READING)):
            lines, tokens = map(sum, zip(*[size(f) for f in files]))
            print(f"{name} ({', '.join(files)}): {lines:,} lines, {tokens:,} tokens "
                  "(nanoGPT's model.py + train.py: 666 lines, 4,120 tokens)")
    assert len(top_level()) <= 15, top_level()


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


def test_the_engine_imports_only_the_engine():
    """zero.py, zero3.py, collectives.py, precision.py and optim.py read alone: nothing of ours
    outside them, at any level (a post-lecture layout extends the engine from beyond/, as
    zero3.py extends zero.py; the engine never reaches out to it)."""
    ours, engine = project_modules(), {module_name(f) for f in ENGINE}
    for f in ENGINE:
        outside = sorted({m.split(".")[0] if m.split(".")[0] in FOLDERS + ("data",) else m
                          for m, _ in imports(f) if m in ours} - engine)
        assert not outside, f"{f} imports {outside}: the engine imports only the engine"


def test_train_py_reaches_machinery_through_the_run_and_the_engine_factory():
    """train.py's imports, at any level: the lecture's files, beyond/ where a flag asks, and of
    machinery/ only the run object (machinery/run.py: the loop's side work) and the engine
    factory (machinery/engines.py)."""
    machinery = {m.split(".")[1] for m, _ in imports("train.py")
                 if m.startswith("machinery.") and m.count(".") >= 1}
    assert machinery <= {"run", "engines"}, sorted(machinery)


# words of the product: a user's mistake, a hang, the run's one-line errors
PRODUCT = re.compile(r"\b(UserError|HeldGrad|phase|STEPPED|timeout|CollectiveTimeout)\b", re.I)


def test_the_lecture_names_no_product():
    """The engine files name no phase, HeldGrad, timeout or UserError (the guard and the hang
    layer attach from machinery/), and no lecture file raises a UserError: the product checks
    a user's input before the engine is built; the lesson's own errors are plain ones."""
    named = {f: sorted(set(m.lower() for m in PRODUCT.findall(read(f)))) for f in ENGINE}
    assert not {f: n for f, n in named.items() if n}, named
    raising = [f for f in LECTURE if "UserError" in read(f)]
    assert not raising, raising


COMMANDS = ("train.py", "sample.py", "memory.py", "export.py")
# a ValueError caught only to be raised again as a UserError of the same words
REWRAP = re.compile(r"except \(?[\w, ]*ValueError[\w, ]*\)? as (\w+):\s*\n\s*raise UserError\("
                    r"str\(\1\)\)")


def test_one_place_turns_a_value_error_into_the_one_line():
    """machinery/run.py's run_main is every command's one place where an error a user can fix
    (a UserError, or the ValueError of any check) becomes one line: each command runs through
    it, and no module catches a ValueError only to raise its words again as a UserError."""
    assert all(re.search(r"\b(run_main|command)\(", read(c)) for c in COMMANDS)
    rewrapped = [f for f in tracked() if not f.startswith("tests/") and REWRAP.search(read(f))]
    assert not rewrapped, rewrapped


def test_a_default_run_loads_nothing_from_beyond(data_root, tmp_path):
    """train.py at the default flags, from its start-up table to its last checkpoint, and
    train.build at --zero 2 --bf16: every module loaded is the lecture's or the machinery's.
    beyond/ is reached only when a flag asks (test_the_core_reaches_beyond_only_...)."""
    tiny = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8"]
    code = ("import sys, torch, train; from configurator import parse_args; "
            "from precision import DTYPES\n"
            f"train.main({tiny + ['--max-iters', '2', '--eval-iters', '1', '--batch-size', '2', '--data-root', data_root, '--dataset', 'tiny', '--out-dir', str(tmp_path), '--device', 'cpu']!r})\n"
            f"cfg = parse_args({tiny + ['--zero', '2', '--bf16']!r})\n"
            "train.build(cfg, 65, torch.device('cpu'), DTYPES[cfg.dtype])\n"
            "print('beyond:', *(m for m in sys.modules if m.split('.')[0] == 'beyond'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "beyond:", out.stdout.splitlines()[-1]


# Each claim of the lecture, defined in the lecture file that teaches it and nowhere else: the
# stage formulas the start-up table prints, the resharding a resume runs, the same-weights check,
# the schedule, the bits of a quantized weight.
CLAIMS = {"zero.py": ("zero_formula", "traffic_formula", "NaiveZeRO"),
          "checkpoint.py": ("owned_pieces", "full_tensors", "state_piece", "rng_state"),
          "train.py": ("get_lr", "train_step", "update"),
          "quant.py": ("quantized_bytes",)}


def defined(path):
    return {n.name for n in ast.parse(read(path)).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_each_lecture_claim_is_defined_in_its_lecture_file_only():
    elsewhere = {f: defined(f) for f in tracked() if not f.startswith("tests/")}
    for home, names in CLAIMS.items():
        assert set(names) <= elsewhere[home], (home, set(names) - elsewhere[home])
        for f, there in elsewhere.items():
            assert f == home or not set(names) & there, f"{f} defines {set(names) & there}"


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

EXTERNAL = {"pytest", "venv", "pip", "torch.distributed.run"}  # other packages' -m modules
OTHERS = {"setup.py", "sz.py", "functional.py"}  # files of other projects the text names
SUFFIXES = {"bin", "json", "jsonl", "pt", "md", "txt", "safetensors", "png", "tmp"}


def placeholder(name):
    """NAME, {module}, X: a pattern in the text, not a name."""
    return bool(re.search(r"[A-Z]{2,}|[{}]|^X\b", name))
SCRIPTS = ("train.py", "memory.py", "sample.py", "export.py", "data/prepare.py")


FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def texts():
    """(where, text) of the README, docs/ and every docstring and comment of the project, the
    benchmarks' and the tests' too; a Markdown file's fenced code blocks apart, as code
    (`where` ends in ":code"): a name in them needs no backticks to be checked."""
    out = []
    for f in ["README.md", "BENCHMARKS.md"] + tracked("docs/*.md"):
        text = read(f)
        out += [(f, FENCE.sub("", text)), (f + ":code", "\n".join(FENCE.findall(text)))]
    for f in tracked():
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
        from configurator import make_parser
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
             "loss", "quant", "lora", "run"}  # also names of objects in prose: `model.generate`


def tiny_gpt():
    from model import GPT, GPTConfig
    return GPT(GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=1, n_embd=8))


def tiny_zero():
    from machinery.engines import ZeRO  # what a loop of one's own holds: guarded
    return ZeRO(tiny_gpt(), 0)


INSTANCES = {"model": tiny_gpt, "zero": tiny_zero}  # `model.grad_ckpt`: an object's attribute
# attributes a flag sets on the model after it is built, where that flag's code says so
SET_LATER = {"model.offload": "beyond/offload.install_offload",
             "model.base_id": "train.build, --lora", "model.lora_settings": "lora.apply_lora"}


def resolves(obj, attrs):
    for a in attrs:
        if not hasattr(obj, a):
            return False
        obj = getattr(obj, a)
    return True


def test_every_module_function_the_text_names_exists():
    """`module.attr[.attr]` in backticks in prose, bare in fenced code blocks, docstrings and
    comments (there a common variable's name, model.grad_ckpt, is resolved on a GPT or a
    ZeRO, or skipped); a bare `name.py` must be a file of ours."""
    files = {os.path.basename(f) for f in tracked()} | {f for f in tracked()}
    bad = []
    for where, text in texts():
        prose = not where.endswith((".py", ":code"))
        # a bare `name.py`: a file of ours (the tests' name the files they make: not checked)
        for m in re.finditer(r"(?<![\w./])((?:machinery|beyond)/)?(\w+)\.py\b",
                             "" if where.startswith("tests/") else text):
            name = (m.group(1) or "") + m.group(2) + ".py"
            if name not in files | OTHERS and not placeholder(name):
                bad.append(f"{where}: {name}")
        pattern = r"`([a-z_0-9]+(?:\.[A-Za-z_]\w*)+)" if prose else \
            r"(?<![\w.`/])([a-z_0-9]+(?:\.[A-Za-z_]\w*)+)"
        for m in re.finditer(pattern, text):
            first, *attrs = m.group(1).split(".")
            if first not in MODULES or attrs[0] == "py" or attrs[0] in SUFFIXES \
                    or (where.endswith(".py") and first in VARIABLES and first not in INSTANCES):
                continue
            if m.group(1) in SET_LATER:
                continue
            if not resolves(importlib.import_module(MODULES[first]), attrs) and not (
                    first in INSTANCES and resolves(INSTANCES[first](), attrs)):
                bad.append(f"{where}: {m.group(1)}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_every_test_the_docs_name_exists():
    """`test_file.py::test_name` in the README and docs/ (the fault tables): a test that runs."""
    bad = []
    for f in ["README.md", "BENCHMARKS.md"] + tracked("docs/*.md"):
        for m in re.finditer(r"(test_\w+\.py)::(test_\w+)", read(f)):
            path = os.path.join(ROOT, "tests", m.group(1))
            if not os.path.isfile(path) or not re.search(rf"^def {m.group(2)}\(", read(
                    os.path.join("tests", m.group(1))), re.M):
                bad.append(f"{f}: {m.group(0)}")
    assert not bad, "\n".join(bad)


def test_zero_2_end_to_end_reads_in_five_files():
    """The README's reading count: ZeRO-2 end to end is train.py's step, zero.py (built by
    machinery/engines.py, the one place that picks an engine) and what it imports of the
    lecture (collectives.py, optim.py), and precision.py's scaler."""
    ours = project_modules()
    lecture = {m for m, top in imports("zero.py") if top and m in ours and "." not in m
               and m not in FOLDERS}
    assert lecture == {"collectives", "optim"}, lecture
    assert "precision" in {m for m, top in imports("train.py")}
    assert "zero" in {m for m, top in imports("machinery/engines.py") if top}
