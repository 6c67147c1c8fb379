"""The Python examples of the README and of docs/*.md run, and type-check with mypy and
pyright against the package's stubs, so the documentation cannot drift from the library.

Each ```python block of README.md and docs/*.md is a self-contained program. A block that imports a module
this environment lacks (torch without PyTorch installed) is skipped, in the run and in the
type checks alike. The README's install and test commands are checked too: CI runs them.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz import _asan_runtime_loaded

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> list[str]:
    return [code for doc in DOCS for code in re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M)]


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:  # not installed, or hidden (the sanitizer run hides torch)
        return False
    return True


def _missing_modules(code: str) -> list[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            # the whole dotted name: pagedattn.jax is missing from a build without its handlers
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if not _importable(n))


# The type checkers run in the plain pytest run; under the sanitizer run's preloaded ASan
# runtime they would run Node.js and mypy's compiled modules with it, which tests nothing
# of pagedattn.
needs_plain_run = pytest.mark.skipif(_asan_runtime_loaded(), reason="type checkers run in the plain pytest run")


BLOCKS = _blocks()


def _runnable() -> list[tuple[int, str]]:
    return [(i, code) for i, code in enumerate(BLOCKS) if not _missing_modules(code)]


def test_docs_have_python_examples():
    assert len(BLOCKS) >= 8
    assert any("paged_attention(" in b for b in BLOCKS) and any("BlockManager(" in b for b in BLOCKS)
    readme = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert any("paged_attention(" in b for b in readme)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    code = BLOCKS[index]
    missing = _missing_modules(code)
    if missing:
        pytest.skip(f"example {index} needs {', '.join(missing)}")
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"documentation example {index} failed:\n{code}\n{run.stderr[-3000:]}"


def _write_runnable(folder: Path) -> list[str]:
    files = []
    for i, code in _runnable():
        path = folder / f"readme_example_{i}.py"
        path.write_text(code)
        files.append(str(path))
    return files


@needs_plain_run
def test_readme_examples_pass_mypy(tmp_path):
    pytest.importorskip("mypy")
    files = _write_runnable(tmp_path)
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / ".mypy_cache"),
                          "--python-executable", sys.executable, "--no-error-summary", *files],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, f"mypy on the documentation's examples:\n{run.stdout}{run.stderr}"


@needs_plain_run
def test_readme_examples_pass_pyright(tmp_path):
    pytest.importorskip("pyright")
    files = _write_runnable(tmp_path)
    # pyright finds pagedattn through this Python; without Node.js on the PATH it uses the
    # one its nodejs extra installs.
    env = dict(os.environ, PYRIGHT_PYTHON_IGNORE_WARNINGS="1")  # no look-up of a newer pyright
    run = subprocess.run([sys.executable, "-m", "pyright", "--pythonpath", sys.executable, *files],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert run.returncode == 0, f"pyright on the documentation's examples:\n{run.stdout[-5000:]}{run.stderr[-2000:]}"
    assert f"{len(files)} source file" in run.stdout or "0 errors" in run.stdout


@needs_plain_run
def test_stubs_catch_a_wrong_example(tmp_path):
    """The type checks can fail: a misuse the stubs describe is reported."""
    pytest.importorskip("mypy")
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import numpy as np\nimport pagedattn\n"
        "m = pagedattn.BlockManager(16, 16)\n"
        "md = m.step([0])\n"
        "x: str = md.context_lens\n"  # an int32 array, not a str
        "pagedattn.paged_attention(1, 2, 3, 4, 5)\n"  # ints are not arrays
    )
    run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / ".mypy_cache"),
                          "--python-executable", sys.executable, str(bad)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 1
    assert "bad.py:5: error" in run.stdout and "bad.py:6: error" in run.stdout


def test_readme_gives_the_ci_commands():
    text = README.read_text()
    assert 'pip install ".[test]" && pytest' in text  # .ci/run runs this command
    assert "pip install . && python -m pagedattn" in text
    assert "-Ccmake.define.PAGEDATTN_CUDA=OFF" in text  # the CPU-only build
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install ".[test]" && pytest' in ci


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_doc_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
        assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def test_readme_stays_short():
    # a screenful of what a user needs; the API reference lives in docs/, developer notes in
    # CONTRIBUTING.md, tables in BENCHMARKS.md
    assert len(README.read_text()) < 16_000
