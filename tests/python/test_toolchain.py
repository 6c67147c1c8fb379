"""The library and its Python module built by a toolchain that links the C++ runtime
statically (as a g++ wrapper adding -static-libstdc++ does): every library error must
still raise its Python exception, and valid calls must work.

With two static copies of the runtime in one process (one in libpagedattn, one in the
module) and their symbols exported, the copies bind to each other's symbols and a caught
exception crashes the process. Each binary must keep its copy to itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import numpy as np
    import pagedattn
    q = np.zeros((2, 4, 64), np.float32)
    kc = np.zeros((4, 16, 2, 64), np.float32)
    cases = [
        (TypeError, lambda: pagedattn.paged_attention(q, kc, kc, np.zeros((2, 1), np.int64), np.ones(2, np.int32))),
        (IndexError,
         lambda: pagedattn.paged_attention(q, kc, kc, np.zeros((2, 1), np.int32), np.full(2, 99, np.int32))),
        (ValueError, lambda: pagedattn.BlockManager(0, 16)),
        (pagedattn.OutOfBlocksError, lambda: pagedattn.BlockManager(1, 16).add_sequence(1, list(range(40)))),
    ]
    for exc, call in cases:
        try:
            call()
        except exc as e:
            print("raised", type(e).__name__)
        else:
            raise AssertionError(f"no {exc.__name__}")
    pagedattn.copy_blocks([kc], [kc.copy()], [(0, 1)])  # a valid call
    out = pagedattn.paged_attention(q, kc, kc, np.zeros((2, 1), np.int32), np.ones(2, np.int32))
    assert np.isfinite(out).all()
    print("probe ok")
    """
)


@pytest.mark.slow
def test_static_cxx_runtime_build_raises_cleanly(tmp_path):
    nanobind = pytest.importorskip("nanobind")
    cxx = shutil.which("g++")
    cmake = shutil.which("cmake")
    if sys.platform != "linux" or cxx is None or cmake is None:
        pytest.skip("needs Linux, g++ and cmake")
    probe = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True)
    if not os.path.isabs(probe.stdout.strip()):
        pytest.skip("this g++ has no static libstdc++")
    wrapper = tmp_path / "g++-static-runtime"
    wrapper.write_text(f'#!/bin/sh\nexec {cxx} -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    build, pkg = tmp_path / "build", tmp_path / "pkg"
    env = dict(os.environ, CXX=str(wrapper))
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = [cmake, "-S", str(ROOT), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DPAGEDATTN_CUDA=OFF",
           "-DPAGEDATTN_PYTHON=ON", f"-Dnanobind_DIR={nanobind.cmake_dir()}",
           f"-DPython_EXECUTABLE={sys.executable}"]  # fmt: skip
    for cmd in (cfg, [cmake, "--build", str(build), "-j", "2"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert r.returncode == 0, f"{cmd[:3]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    shutil.copytree(ROOT / "python" / "pagedattn", pkg / "pagedattn")
    r = subprocess.run([cmake, "--install", str(build), "--prefix", str(pkg / "pagedattn")], capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lib = next((pkg / "pagedattn" / "lib").glob("libpagedattn.so*"))
    ldd = subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout
    assert "libstdc++" not in ldd, "the wrapper did not link the runtime statically; the test proves nothing"
    # Neither binary may export the runtime it carries (the crash's precondition, seen with
    # such a toolchain: the module's and the library's copies bound to each other).
    for binary in (lib, next((pkg / "pagedattn").glob("_core*.so"))):
        nm = subprocess.run(["nm", "-D", "--defined-only", str(binary)], capture_output=True, text=True).stdout
        leaked = [s for s in ("__cxa_throw", "__gxx_personality_v0", "_ZTISt12out_of_range", "_ZTISt9exception")
                  if any(line.split()[-1] == s for line in nm.splitlines() if line.strip())]  # fmt: skip
        assert not leaked, f"{binary.name} exports the C++ runtime's {leaked}"
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(pkg)))  # fmt: skip
    assert run.returncode == 0, f"exit code {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stdout.count("raised") == 4 and "probe ok" in run.stdout
