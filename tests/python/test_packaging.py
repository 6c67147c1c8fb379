"""Packaging: one copy of each library in the installed distribution, the license as its
SPDX id, the stubs shipped, the type checkers in the test extra, and a build directory that
keeps the core library's objects when pip's isolated environment changes."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

import pagedattn
from fuzz import _asan_runtime_loaded

ROOT = Path(__file__).resolve().parents[2]


def _distribution():
    try:
        dist = importlib.metadata.distribution("pagedattn")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pagedattn is not installed as a distribution")
    files = dist.files or []
    if not any(PurePosixPath(str(f)).as_posix() == "pagedattn/__init__.py" for f in files):
        pytest.skip("an editable installation lists no package files")
    return dist, [PurePosixPath(str(f)) for f in files]


def test_the_library_is_installed_once():
    _, files = _distribution()
    libs = [str(f) for f in files if f.name.startswith("libpagedattn.so")]
    assert libs == ["pagedattn/lib/libpagedattn.so"], libs  # no .so.0 / .so.0.1.0 copies
    modules = [str(f) for f in files if f.name.startswith("_core") and f.suffix == ".so"]
    assert len(modules) == 1, modules


def test_the_module_finds_the_library_by_its_soname():
    lib = Path(pagedattn.__file__).parent / "lib" / "libpagedattn.so"
    if not lib.is_file() or shutil.which("readelf") is None:
        pytest.skip("needs an installed package and readelf")
    dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "[libpagedattn.so]" in dyn  # the soname is the one file the wheel holds


def test_license_metadata_is_the_spdx_id():
    dist, _ = _distribution()
    meta = dist.metadata
    assert meta.get("License-Expression") == "Apache-2.0"
    license_field = meta.get("License") or ""
    assert "Licensed under" not in license_field and len(license_field) < 100


def test_stubs_ship_with_the_distribution():
    _, files = _distribution()
    names = {str(f) for f in files}
    assert {"pagedattn/_core.pyi", "pagedattn/py.typed"} <= names


def test_test_extra_installs_the_type_checkers():
    dist, _ = _distribution()
    test_reqs = [r for r in dist.requires or [] if 'extra == "test"' in r]
    assert any(r.startswith("mypy") for r in test_reqs), test_reqs
    assert any(r.startswith("pyright") for r in test_reqs), test_reqs


@pytest.mark.slow
@pytest.mark.skipif(_asan_runtime_loaded(), reason="builds with the machine's tools: the plain pytest run covers it")
def test_core_objects_survive_a_cleared_cache(tmp_path):
    """What scikit-build-core does in a new isolated environment (every `pip install`):
    delete the top-level CMakeCache.txt and CMakeFiles/. The core library's objects must
    survive and Ninja must not compile them again."""
    cmake, ninja = shutil.which("cmake"), shutil.which("ninja")
    if cmake is None or ninja is None:
        pytest.skip("needs cmake and ninja")
    build = tmp_path / "build"
    configure = [cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DPAGEDATTN_CUDA=OFF"]  # fmt: skip
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL="2")

    def step(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert r.returncode == 0, f"{cmd[:3]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    step(configure)
    first = step([cmake, "--build", str(build), "--target", "pagedattn", "-j", "2"])
    assert "cpp/CMakeFiles/pagedattn.dir" in first  # the objects live below cpp/, not at the top
    objects = sorted((build / "cpp" / "CMakeFiles" / "pagedattn.dir").rglob("*.o"))
    assert objects
    stamps = {o: o.stat().st_mtime_ns for o in objects}
    (build / "CMakeCache.txt").unlink()
    shutil.rmtree(build / "CMakeFiles")
    step(configure)
    second = step([cmake, "--build", str(build), "--target", "pagedattn", "-j", "2"])
    assert "Building CXX object" not in second, second[-2000:]
    assert {o: o.stat().st_mtime_ns for o in objects} == stamps


@pytest.mark.skipif(_asan_runtime_loaded(), reason="measures the shipped build, not an instrumented one")
def test_the_installed_package_is_lean():
    """The library (with CUDA: sm_80 + sm_90 machine code and compute_90 PTX, compressed) and
    the whole package stay far below the 25 MB a wheel may take."""
    root = Path(pagedattn.__file__).resolve().parent
    lib = root / "lib" / "libpagedattn.so"
    if not lib.is_file():
        pytest.skip("no installed libpagedattn.so beside the package")
    assert lib.stat().st_size < 16 * 2**20, f"libpagedattn.so is {lib.stat().st_size / 2**20:.1f} MiB"
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 25 * 2**20, f"the package holds {total / 2**20:.1f} MiB"


plain_run_only = pytest.mark.skipif(_asan_runtime_loaded(), reason="uses the machine's tools: the plain run covers it")


def _configure_cuda(tmp_path, env):
    cmake, nvcc = shutil.which("cmake"), shutil.which("nvcc")
    if cmake is None or nvcc is None:
        pytest.skip("needs cmake and nvcc")
    r = subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path / "b"), "-DPAGEDATTN_CUDA=ON"],
                       capture_output=True, text=True, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
@plain_run_only
def test_cuda_configure_says_what_it_builds_and_for_which_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDAARCHS"}
    out = _configure_cuda(tmp_path, env)
    assert "pagedattn: compiling " in out and " CUDA files for " in out and "CPU only: -DPAGEDATTN_CUDA=OFF" in out
    if "from the GPUs of this machine" not in out:  # no GPU seen: the documented default list
        assert "architectures 80-real;90 (from the default list; no GPU seen)" in out


@pytest.mark.slow
@plain_run_only
def test_cudaarchs_environment_variable_picks_the_gpus(tmp_path):
    out = _configure_cuda(tmp_path, dict(os.environ, CUDAARCHS="90"))
    assert "architectures 90 (from the CUDAARCHS environment variable)" in out
    assert "for 1 architecture(s)" in out
