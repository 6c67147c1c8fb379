"""The hand-written type stubs (python/pagedattn/_core.pyi) against the built module.

Every public name of pagedattn._core has a stub and every stub names something the module
has; every function and method takes the parameters its stub declares, in the same order,
with the same keyword-only split. The stubs type-check (mypy and pyright run in
test_readme.py over the README's examples, which use them).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pagedattn
from fuzz import _asan_runtime_loaded
from pagedattn import _core

STUB = Path(pagedattn.__file__).resolve().parent / "_core.pyi"
# Keyword options the stubs declare for paged_attention / PreparedDecode that a build may
# not have yet (varlen and chunked-prefill queries); any other difference is an error.
ANNOUNCED = {"query_start_loc", "max_query_len"}
DUNDERS = {"__init__", "__call__", "__len__", "__contains__"}


def _params(args: ast.arguments) -> tuple[list[str], list[str]]:
    positional = [a.arg for a in args.posonlyargs + args.args if a.arg not in ("self", "cls")]
    return positional, [a.arg for a in args.kwonlyargs]


def _stub_functions() -> dict[str, tuple[list[str], list[str]]]:
    """'name' or 'Class.method' -> (positional names, keyword-only names), from the stub file."""
    tree = ast.parse(STUB.read_text())
    found: dict[str, tuple[list[str], list[str]]] = {}

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.FunctionDef):
                decorators = {getattr(d, "id", getattr(d, "attr", "")) for d in node.decorator_list}
                if "property" in decorators:
                    found[prefix + node.name] = ([], [])
                    continue
                pos, kw = _params(node.args)
                old = found.get(prefix + node.name)
                if old is not None and old != (pos, kw):  # overloads: one parameter list
                    raise AssertionError(f"overloads of {prefix + node.name} declare different parameters")
                found[prefix + node.name] = (pos, kw)
            elif isinstance(node, ast.ClassDef):
                found[prefix + node.name] = ([], [])
                visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.AnnAssign,)) and isinstance(node.target, ast.Name):
                found[prefix + node.target.id] = ([], [])

    visit(tree.body, "")
    return found


def _runtime_signature(func) -> tuple[list[str], list[str]]:
    """(positional names, keyword-only names) of a compiled function or method."""
    nb_sig = getattr(func, "__nb_signature__", None)
    if nb_sig:
        sig_text = re.sub(r"\\\d+", "0", nb_sig[0][0])  # default values appear as \0, \1, ...
        fn = ast.parse(sig_text.replace("def ", "def f_", 1) + ": ...").body[0]
        return _params(fn.args)
    sig = inspect.signature(func)
    pos = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "$module")
    ]
    kw = [p.name for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY]
    return pos, kw


STUBS = _stub_functions()
STUB_HELPERS = {"SupportsDLPack", "Supported", "DecodePlan", "PrefixCacheStats"}  # typing-only classes


def _runtime_names() -> set[str]:
    names = set()
    for name in dir(_core):
        if name.startswith("_") and name != "__version__":
            continue
        names.add(name)
        obj = getattr(_core, name)
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            for attr, value in vars(obj).items():
                # a dunder counts when the module binds it (a class without a constructor
                # has only Python's refusing slot wrapper)
                if not attr.startswith("_") or (attr in DUNDERS and hasattr(value, "__nb_signature__")):
                    names.add(f"{name}.{attr}")
    return names


def test_every_public_name_has_a_stub_and_every_stub_exists():
    runtime = _runtime_names()
    stubbed = {n for n in STUBS if n.split(".")[0] not in STUB_HELPERS and n not in STUB_HELPERS}
    missing = sorted(runtime - stubbed)
    extra = sorted(stubbed - runtime)
    assert not missing, f"_core.pyi has no stub for: {missing}"
    assert not extra, f"_core.pyi declares names the module does not have: {extra}"


def _resolve(name: str):
    obj = _core
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


FUNCTIONS = sorted(n for n in _runtime_names()
                   if callable(_resolve(n)) and not isinstance(_resolve(n), type))  # fmt: skip


def test_functions_and_methods_are_found():
    assert {"paged_attention", "BlockManager.step", "PreparedDecode.run", "BlockManager.__init__"} <= set(FUNCTIONS)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_stub_parameters_match_the_module(name):
    obj = _resolve(name)
    assert name in STUBS, f"_core.pyi has no stub for {name}"
    stub_pos, stub_kw = STUBS[name]
    run_pos, run_kw = _runtime_signature(obj)
    assert stub_pos == run_pos, f"{name}: positional parameters {stub_pos} in the stub, {run_pos} in the module"
    ahead = [k for k in stub_kw if k not in run_kw]
    assert set(ahead) <= ANNOUNCED, f"{name}: the stub declares keywords the module lacks: {ahead}"
    assert [k for k in stub_kw if k in run_kw] == run_kw, (
        f"{name}: keyword-only parameters {stub_kw} in the stub, {run_kw} in the module"
    )


def test_stubs_and_marker_ship_with_the_package():
    root = STUB.parent
    assert (root / "py.typed").is_file()
    assert STUB.is_file()
    # the stub describes what a call returns, not Any: the array type of the query, NumPy
    # arrays from the block manager
    text = STUB.read_text()
    assert "-> _Array" in text and "def context_lens(self) -> Int32Array" in text


@pytest.mark.skipif(_asan_runtime_loaded(), reason="type checkers run in the plain pytest run")
def test_the_typed_modules_pass_pyright():
    """The stubs and the modules that re-export them type-check as they ship."""
    pytest.importorskip("pyright")
    root = STUB.parent
    files = [str(root / n) for n in ("_core.pyi", "__init__.py", "_api.py", "block_manager.py", "cache_ops.py")]
    env = dict(os.environ, PYRIGHT_PYTHON_IGNORE_WARNINGS="1")
    run = subprocess.run([sys.executable, "-m", "pyright", "--pythonpath", sys.executable, *files],
                         capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert "0 errors" in run.stdout
