"""CPU varlen (chunked-prefill) benchmark: pagedattn.paged_attention(query_start_loc=...) on
the CPU against a NumPy per-sequence masked-softmax baseline, in the same process, on the
same paged inputs.

    python benchmarks/cpu_prefill_bench.py [--reps N] [--json FILE] [--quick]

The baseline is what one writes without a paged prefill kernel: gather the sequence's
pages with fancy indexing into dense float32 K / V, scores = Q K^T per KV head's group by
one batched matmul, the causal mask (lower-right: the q rows are the sequence's last
tokens), softmax, @ V, cast to the output dtype. The two run alternately (--reps pairs
after a warm-up call each; each pagedattn call after --settle seconds of sleep, so that the
baseline's OpenBLAS threads have stopped spinning) so both see the same machine load; the speed-up is the median of
the per-pair ratios, times are medians. CPU time (all threads of the process) is reported
too: on a shared machine it is the steadier measure of work. TFLOP/s counts the exact causal
(query, key) pairs x 4 x head_size x num_heads (what the masked baseline also has to
deliver, though it computes the masked half too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np

import pagedattn

try:
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes comes with the test extra
    _BF16 = None

# name, query rows per sequence, seq_len per sequence, num_heads, num_kv_heads, head_size
SHAPES = [
    ("prompt 1 x 2048, GQA 32/8 d128", [2048], [2048], 32, 8, 128),
    ("chunk 512 over 1536 cached, GQA 32/8 d128", [512], [2048], 32, 8, 128),
    ("seed step 2: decode at 485 + 456-token chunk over 28 (12 heads d64)", [1, 456], [485, 484], 12, 12, 64),
]
QUICK_SHAPES = [("prompt 1 x 512, GQA 32/8 d128", [512], [512], 32, 8, 128)]
BLOCK_SIZE = 16


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        if _BF16 is None:
            raise SystemExit("bfloat16 needs ml_dtypes")
        return _BF16
    return np.dtype(name)


def make_inputs(rng, q_lens, seq_lens, h, k, d, dtype, layout):
    b = BLOCK_SIZE
    max_blocks = max(-(-n // b) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 4
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, b, k, d, dtype.name, layout)
    key_cache = rng.standard_normal(kshape, dtype=np.float32).astype(dtype)
    value_cache = rng.standard_normal(vshape, dtype=np.float32).astype(dtype)
    tables = rng.permutation(num_blocks)[: len(seq_lens) * max_blocks].reshape(len(seq_lens), max_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), h, d), dtype=np.float32).astype(dtype)
    return query, key_cache, value_cache, tables.astype(np.int32), np.asarray(seq_lens, np.int32), qsl


def numpy_baseline(query, key_cache, value_cache, tables, seq_lens, qsl, layout):
    """Per sequence: gather pages, dense float32 masked softmax attention."""
    t, h, d = query.shape
    out = np.empty_like(query)
    scale = np.float32(1.0 / np.sqrt(d))
    for i in range(len(seq_lens)):
        lo, hi, n = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        if hi == lo:
            continue
        blocks = tables[i, : -(-n // BLOCK_SIZE)]
        if layout == "vllm":  # [N, K, D/x, B, x] -> [L, K, D]; [N, K, D, B] -> [L, K, D]
            kc = key_cache[blocks]
            nb, k, dx, bs, x = kc.shape
            keys = kc.transpose(0, 3, 1, 2, 4).reshape(nb * bs, k, d)[:n]
            values = value_cache[blocks].transpose(0, 3, 1, 2).reshape(nb * bs, k, d)[:n]
        else:  # [N, B, K, D]
            keys = key_cache[blocks].reshape(-1, key_cache.shape[2], d)[:n]
            values = value_cache[blocks].reshape(-1, key_cache.shape[2], d)[:n]
        k = keys.shape[1]
        g = h // k
        q = query[lo:hi].astype(np.float32).reshape(hi - lo, k, g, d).transpose(1, 2, 0, 3)  # [K, G, q, D]
        kt = keys.astype(np.float32).transpose(1, 2, 0)[:, None]  # [K, 1, D, L]
        v = values.astype(np.float32).transpose(1, 0, 2)[:, None]  # [K, 1, L, D]
        s = (q @ kt) * scale  # [K, G, q, L]
        rows = np.arange(n - (hi - lo), n)[:, None]
        s[..., np.arange(n)[None, :] > rows] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        o = s @ v  # [K, G, q, D]
        out[lo:hi] = o.transpose(2, 0, 1, 3).reshape(hi - lo, h, d).astype(query.dtype)
    return out


def causal_flops(q_lens, seq_lens, h, d) -> int:
    pairs = sum(q * n - q * (q - 1) // 2 for q, n in zip(q_lens, seq_lens))
    return 4 * pairs * h * d


def interleaved(lib, base, reps: int, settle: float = 0.0) -> tuple:
    """Times lib and base alternately (after one warm-up call each), so that both see the
    same machine load: (median lib s, median base s, median of the per-pair ratios,
    median lib CPU s, median base CPU s). CPU time counts every thread of the process.
    `settle` seconds of sleep before each lib call let the baseline's worker threads go idle
    first: OpenBLAS's threads spin for a while after each call (about 0.1 s by default), and
    on a 2-core machine that spinning takes a core from the next call. The baseline runs
    right after lib, as before (lib's pool threads block when idle; measured unchanged)."""
    lib()
    base()
    tl, tb, ratios, cl, cb = [], [], [], [], []

    def timed(fn, pause):
        time.sleep(pause)
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(reps):
        t_lib, c_lib = timed(lib, settle)
        t_base, c_base = timed(base, 0.0)
        tl.append(t_lib)
        tb.append(t_base)
        cl.append(c_lib)
        cb.append(c_base)
        ratios.append(t_base / t_lib)
    med = statistics.median
    return med(tl), med(tb), med(ratios), med(cl), med(cb)


def run_case(rng, shape, dtype_name, layout, reps, settle):
    name, q_lens, seq_lens, h, k, d = shape
    dtype = np_dtype(dtype_name)
    query, kc, vc, tables, lens, qsl = make_inputs(rng, q_lens, seq_lens, h, k, d, dtype, layout)
    out = np.empty_like(query)

    def lib():
        pagedattn.paged_attention(query, kc, vc, tables, lens, query_start_loc=qsl, out=out)

    def base():
        return numpy_baseline(query, kc, vc, tables, lens, qsl, layout)

    # The two agree (a wrong kernel must not get a speed-up).
    lib()
    ref = base().astype(np.float32)
    err = float(np.max(np.abs(out.astype(np.float32) - ref)))
    if err > {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}[dtype_name]:
        raise SystemExit(f"{name} {dtype_name} {layout}: pagedattn and the baseline differ by {err}")
    t_lib, t_base, ratio, c_lib, c_base = interleaved(lib, base, reps, settle)
    flops = causal_flops(q_lens, seq_lens, h, d)
    return {
        "shape": name,
        "dtype": dtype_name,
        "layout": layout,
        "pagedattn_ms": t_lib * 1e3,
        "numpy_ms": t_base * 1e3,
        "speedup": ratio,
        "pagedattn_cpu_ms": c_lib * 1e3,
        "numpy_cpu_ms": c_base * 1e3,
        "cpu_time_ratio": c_base / c_lib,
        "pagedattn_tflops": flops / t_lib / 1e12,
        "max_abs_diff": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--layouts", default="nhd,vllm")
    ap.add_argument("--settle", type=float, default=0.3,
                    help="seconds of sleep before each timed pagedattn call, so that the baseline's worker "
                         "threads (OpenBLAS's spin after each call) no longer run during it (0: none)")  # fmt: skip
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()  # fmt: skip
    except OSError:
        commit = ""
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, commit {commit or '?'}, "
          f"settle {args.settle} s")  # fmt: skip
    print(f"{'shape':<72} {'dtype':<9} {'layout':<6} {'pagedattn ms':>12} {'numpy ms':>10} {'x':>6} "
          f"{'TFLOP/s':>8} {'CPU-time x':>10}")  # fmt: skip
    results = []
    for shape in shapes:
        for dtype_name in args.dtypes.split(","):
            for layout in args.layouts.split(","):
                r = run_case(rng, shape, dtype_name, layout, args.reps, args.settle)
                results.append(r)
                print(
                    f"{r['shape']:<72} {r['dtype']:<9} {r['layout']:<6} {r['pagedattn_ms']:>12.1f} "
                    f"{r['numpy_ms']:>10.1f} {r['speedup']:>6.1f} {r['pagedattn_tflops']:>8.3f} "
                    f"{r['cpu_time_ratio']:>10.1f}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "cpus": os.cpu_count(), "settle_s": args.settle, "results": results}, f,
                      indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
