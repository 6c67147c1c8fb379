"""``python -m pagedattn``: a self-check and short demo of the decode API.

Options:
  --cmake-dir     print the folder to pass as pagedattn_DIR to CMake and exit
  --include-dir   print the C++ include folder and exit
  --device        cpu | cuda | auto (default: cuda when this build and a CUDA array
                  library (CuPy or torch) are available, else cpu)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pagedattn
from pagedattn.reference import paged_attention_ref


def _cuda_lib():
    """The first installed array library that can put arrays on a CUDA GPU."""
    for name in ("cupy", "torch"):
        try:
            mod = __import__(name)
        except ImportError:
            continue
        try:
            if name == "cupy" and mod.cuda.runtime.getDeviceCount() > 0:
                return name, mod
            if name == "torch" and mod.cuda.is_available():
                return name, mod
        except Exception:  # a library present but without a usable GPU
            continue
    return None, None


def _random_problem(rng, num_seqs, num_heads, num_kv_heads, head_size, block_size, seq_len, dtype):
    max_blocks = -(-seq_len // block_size)
    num_blocks = num_seqs * max_blocks + 4
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype)
    key_cache = rng.standard_normal(kshape).astype(dtype)
    value_cache = rng.standard_normal(vshape).astype(dtype)
    query = rng.standard_normal((num_seqs, num_heads, head_size)).astype(dtype)
    perm = rng.permutation(num_blocks)[: num_seqs * max_blocks]
    block_tables = perm.reshape(num_seqs, max_blocks).astype(np.int32)
    seq_lens = np.full(num_seqs, seq_len, dtype=np.int32)
    return query, key_cache, value_cache, block_tables, seq_lens


def run_demo(device: str, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    shapes = [
        ("OPT-125m-like: 5 seqs x 196 tokens, 12 heads, head size 64", (5, 12, 12, 64, 16, 196)),
        ("grouped-query 32/8 heads, head size 128: 16 seqs x 4096 tokens", (16, 32, 8, 128, 16, 4096)),
    ]
    lib_name, lib = (None, None)
    if device == "cuda":
        lib_name, lib = _cuda_lib()
        if lib is None:
            print("error: --device cuda needs CuPy or torch with a visible GPU", file=sys.stderr)
            return 2
    print(f"pagedattn {pagedattn.__version__}: device {device}"
          + (f" (arrays through {lib_name})" if lib_name else f" ({pagedattn._core.num_threads()} CPU threads)"))
    ok = True
    for title, (s, h, k, d, b, length) in shapes:
        arrays = _random_problem(rng, s, h, k, d, b, length, np.float16)

        def move(a, _lib=lib, _name=lib_name):
            if _lib is None:
                return a
            return _lib.asarray(a) if _name == "cupy" else _lib.from_numpy(a).cuda()

        dev_arrays = [move(a) for a in arrays]
        out = pagedattn.paged_attention(*dev_arrays)
        reps = 3 if device == "cpu" else 20
        if lib_name == "torch":
            lib.cuda.synchronize()
        elif lib_name == "cupy":
            lib.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            pagedattn.paged_attention(*dev_arrays, out=out)
        if lib_name == "torch":
            lib.cuda.synchronize()
        elif lib_name == "cupy":
            lib.cuda.runtime.deviceSynchronize()
        dt = (time.perf_counter() - t0) / reps
        host_out = np.asarray(out.get() if lib_name == "cupy" else (out.cpu().numpy() if lib_name else out))
        ref = paged_attention_ref(*arrays)
        err = float(np.linalg.norm(host_out.astype(np.float64) - ref) / np.linalg.norm(ref))
        kv_bytes = 2 * s * length * k * d * 2
        good = bool(np.isfinite(err) and err < 2e-3)
        ok &= good
        print(f"  {title}\n    {dt * 1e3:8.3f} ms/call, {kv_bytes / dt / 1e9:7.2f} GB/s of KV read, "
              f"relative error vs float64 {err:.1e}: {'ok' if good else 'MISMATCH'}")
    print("self-check passed" if ok else "self-check FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedattn", description=__doc__.splitlines()[0])
    parser.add_argument("--cmake-dir", action="store_true", help="print pagedattn_DIR for CMake and exit")
    parser.add_argument("--include-dir", action="store_true", help="print the C++ include folder and exit")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmake_dir:
        print(pagedattn.cmake_dir())
        return 0
    if args.include_dir:
        print(pagedattn.include_dir())
        return 0
    device = args.device
    if device == "auto":
        device = "cuda" if pagedattn.built_with_cuda() and _cuda_lib()[1] is not None else "cpu"
    return run_demo(device, args.seed)


if __name__ == "__main__":
    sys.exit(main())
