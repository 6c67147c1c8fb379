"""Builds and runs, against the installed package, the C++ tests (through ctest) and a
consumer project that finds pagedattn with find_package."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import pagedattn

ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")


def _configure_and_build(src: pathlib.Path, build: pathlib.Path) -> None:
    env = dict(os.environ)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
         f"-Dpagedattn_DIR={pagedattn.cmake_dir()}"],
        check=True, env=env, capture_output=True, text=True,
    )  # fmt: skip
    subprocess.run(["cmake", "--build", str(build), "-j", "2"], check=True, env=env, capture_output=True, text=True)


def test_cmake_dir_cli_prints_config_folder():
    out = subprocess.run([sys.executable, "-m", "pagedattn", "--cmake-dir"], check=True, capture_output=True, text=True)
    folder = pathlib.Path(out.stdout.strip())
    assert (folder / "pagedattnConfig.cmake").is_file()
    assert (folder / "pagedattnTargets.cmake").is_file()
    inc = pathlib.Path(pagedattn.include_dir())
    assert (inc / "pagedattn" / "pagedattn.hpp").is_file()


@needs_cmake
def test_consumer_project_builds_and_runs(tmp_path):
    try:
        _configure_and_build(ROOT / "tests" / "consumer", tmp_path / "consumer")
    except subprocess.CalledProcessError as e:
        pytest.fail(f"consumer build failed:\n{e.stdout}\n{e.stderr}")
    run = subprocess.run([str(tmp_path / "consumer" / "consumer")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "consumer ok" in run.stdout


@needs_cmake
def test_cpp_unit_tests_pass_under_ctest(tmp_path):
    build = tmp_path / "cpptests"
    try:
        _configure_and_build(ROOT / "tests" / "cpp", build)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"C++ test build failed:\n{e.stdout}\n{e.stderr}")
    run = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "100% tests passed" in run.stdout  # ctest's summary line (its wording varies by version)


def test_type_stubs_are_shipped():
    pkg = pathlib.Path(pagedattn.__file__).parent
    assert (pkg / "py.typed").is_file()
    stub = (pkg / "_core.pyi").read_text()
    for name in ("def paged_attention(", "def reshape_and_cache(", "def kv_cache_shape("):
        assert name in stub, f"{name} missing from the generated stubs"
