"""The package ships the product only: no test harness, no benchmark or probe scripts.

The harness (tests/python/harness/: the API fuzzer, the block-manager soak, the reference
block manager) and the scripts of benchmarks/ live in the repository, not in the package.
Checked twice: in the imported package's folder (whatever the installation: wheel, editable,
or the sanitizer run's copy on PYTHONPATH), and in the file list of the installed
distribution when the imported package is that distribution's, not an editable one.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path, PurePosixPath

import pytest

import pagedattn

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "python" / "harness"
BENCHMARKS = REPO / "benchmarks"


def _not_shipped() -> set:
    """File names that must not be in the package: every file of the harness and of benchmarks/."""
    names = {p.name for folder in (HARNESS, BENCHMARKS) for p in folder.iterdir() if p.is_file()}
    names.discard("README.md")
    return names


def test_the_not_shipped_list_is_complete():
    names = _not_shipped()
    assert {"fuzz.py", "bm_soak.py", "reference_block_manager.py", "block_manager_bench.py"} <= names
    assert {"device_round.sh", "tma_probe.py", "small_shapes.py"} <= names
    assert sorted(p.name for p in (REPO / ".ci").iterdir()) == ["run", "sanitize.sh"]  # .ci/ holds CI only


def test_imported_package_has_no_harness_or_probe_files():
    root = Path(pagedattn.__file__).resolve().parent
    names = _not_shipped()
    found = [
        str(Path(dirpath, f).relative_to(root))
        for dirpath, dirnames, files in os.walk(root)
        if "__pycache__" not in Path(dirpath).parts
        for f in files
        if f in names
    ]
    assert not found, f"{root} ships test harness or benchmark scripts: {found}"
    assert {"kernels.py", "cpu_decode.py", "host_cost.py"} <= {p.name for p in (root / "bench").iterdir()}


def _installed_distribution():
    try:
        dist = importlib.metadata.distribution("pagedattn")
    except importlib.metadata.PackageNotFoundError:
        return None, "pagedattn is not installed as a distribution (imported from a source folder)"
    direct = dist.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        return None, "an editable installation lists no package files"
    files = dist.files or []
    init = [f for f in files if PurePosixPath(str(f)).as_posix() == "pagedattn/__init__.py"]
    if not init or Path(dist.locate_file(init[0])).resolve() != Path(pagedattn.__file__).resolve():
        return None, "the imported pagedattn is not the installed distribution's"
    return dist, ""


def test_installed_distribution_lists_no_harness_or_probe_files():
    dist, why = _installed_distribution()
    if dist is None:
        pytest.skip(why)
    names = _not_shipped()
    paths = [PurePosixPath(str(f)) for f in dist.files]
    shipped = [str(p) for p in paths if p.name in names or {"tests", "benchmarks", ".ci"} & set(p.parts)]
    assert not shipped, f"the installed distribution ships: {shipped}"
    # and it does ship the product
    have = {str(p) for p in paths}
    assert {"pagedattn/__init__.py", "pagedattn/__main__.py", "pagedattn/reference.py"} <= have
    assert "pagedattn/bench/kernels.py" in have
