"""The sizes a reader can hold, checked so that they cannot drift: no line over 100
characters, no function over 80 lines (train.py's main over 120), every source file opening
with a docstring (presets in config/ are `name = value` lines only), and the README's
per-file line counts equal to `wc -l`. The top level's total is tests/test_layout.py's."""
import ast
import os
import re
import subprocess

import pytest

from conftest import ROOT


def sources():
    """The project's Python files outside tests/ (git's list: what a clone holds)."""
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    files = [f for f in out.stdout.split() if not f.startswith("tests/")]
    if not files:
        pytest.skip("not a git checkout")
    return files


def lines(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read().splitlines()


def test_lines_are_short():
    long_lines = [f"{f}:{i + 1}" for f in sources() for i, line in enumerate(lines(f))
                  if len(line) > 100]
    assert not long_lines, long_lines[:10]


def test_functions_are_short_and_files_say_what_they_are():
    too_long, undocumented = [], []
    for f in sources():
        tree = ast.parse("\n".join(lines(f)))
        if lines(f) and not f.startswith("config/") and not ast.get_docstring(tree):
            undocumented.append(f)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                limit = 120 if (f, node.name) == ("train.py", "main") else 80
                if n > limit:
                    too_long.append(f"{f}:{node.lineno} {node.name}: {n} lines")
    assert not too_long and not undocumented, (too_long, undocumented)


def test_readme_line_counts_are_wc_l():
    """The README's tree gives each file's length (`path.py  N  what it is`), docs/ quote it as
    `file.py` (N lines): N must be its length, and the tree must list every .py file of the
    top level, beyond/ and machinery/."""
    docs = [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))]
    readme = "".join(open(os.path.join(ROOT, f), encoding="utf-8").read()
                     for f in ["README.md"] + docs if f.endswith(".md"))
    quoted = re.findall(r"`([\w/.]+\.py)` \((\d[\d,]*) lines\)", readme)
    quoted += re.findall(r"^([\w/]+\.py) +(\d+)  ", readme, flags=re.M)
    listed = {f for f, _ in quoted}
    ours = [f for f in sources() if not f.endswith("__init__.py")
            and ("/" not in f or f.split("/")[0] in ("beyond", "machinery"))]
    missing = [f for f in ours if f not in listed]
    assert not missing, f"the README's tree does not list {missing}"
    wrong = [(f, n, len(lines(f))) for f, n in quoted if int(n.replace(",", "")) != len(lines(f))]
    assert not wrong, f"README line counts drifted (file, README, wc -l): {wrong}"
