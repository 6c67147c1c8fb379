"""CPU decode benchmark: pagedattn's CPU backend against a NumPy gather-and-softmax
baseline, in the same process, on the same inputs.

    python -m pagedattn.bench.cpu_decode [--json FILE] [--reps N]

Reports time per call (median), GB/s of KV cache read (keys + values of every token
once), and the speed-up over the baseline. The baseline gathers each sequence's pages
into dense float32 arrays and runs softmax(q k^T) v with NumPy: what one would write
without a paged kernel.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

import pagedattn

SHAPES = [
    # name, num_seqs, num_heads, num_kv_heads, head_size, block_size, seq_len, dtype
    ("OPT-125m 5x196 (12 heads, d64, fp16)", 5, 12, 12, 64, 16, 196, "float16"),
    ("OPT-30B 1x204 (56 heads, d128, fp16)", 1, 56, 56, 128, 16, 204, "float16"),
    ("GQA 32/8 d128 fp16, 16x4096", 16, 32, 8, 128, 16, 4096, "float16"),
    ("GQA 32/8 d128 fp32, 16x4096", 16, 32, 8, 128, 16, 4096, "float32"),
]


def make_inputs(rng, s, h, k, d, b, length, dtype, layout="vllm"):
    max_blocks = -(-length // b)
    num_blocks = s * max_blocks + 8
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, b, k, d, dtype, layout)
    key_cache = rng.standard_normal(kshape, dtype=np.float32).astype(dtype)
    value_cache = rng.standard_normal(vshape, dtype=np.float32).astype(dtype)
    query = rng.standard_normal((s, h, d), dtype=np.float32).astype(dtype)
    tables = rng.permutation(num_blocks)[: s * max_blocks].reshape(s, max_blocks).astype(np.int32)
    lens = np.full(s, length, dtype=np.int32)
    return query, key_cache, value_cache, tables, lens


def numpy_baseline(query, key_cache, value_cache, tables, lens):
    """Gather the pages of every sequence, then dense float32 attention with NumPy."""
    s, h, d = query.shape
    _, k, dx, b, x = key_cache.shape
    out = np.empty((s, h, d), dtype=query.dtype)
    scale = np.float32(1.0 / np.sqrt(d))
    for i in range(s):
        n = int(lens[i])
        nb = -(-n // b)
        blocks = tables[i, :nb]
        keys = key_cache[blocks].astype(np.float32)  # [nb, k, d/x, b, x]
        keys = keys.transpose(1, 0, 3, 2, 4).reshape(k, nb * b, d)[:, :n]  # [k, n, d]
        vals = value_cache[blocks].astype(np.float32).transpose(1, 0, 3, 2).reshape(k, nb * b, d)[:, :n]
        q = query[i].astype(np.float32).reshape(k, h // k, d)  # [k, g, d]
        logits = np.matmul(q, keys.transpose(0, 2, 1)) * scale  # [k, g, n]
        logits -= logits.max(axis=-1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=-1, keepdims=True)
        out[i] = np.matmul(p, vals).reshape(h, d)
    return out


def time_call(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(reps: int = 5, seed: int = 0, log=None):
    """One row per shape of SHAPES; log(text), when given, hears of each shape as it starts."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (name, s, h, k, d, b, length, dtype) in enumerate(SHAPES):
        if log is not None:
            log(f"[{i + 1}/{len(SHAPES)}] {name}")
        args = make_inputs(rng, s, h, k, d, b, length, np.dtype(dtype))
        out = np.empty_like(args[0])
        t_pa = time_call(lambda a=args, o=out: pagedattn.paged_attention(*a, out=o), reps)
        t_np = time_call(lambda a=args: numpy_baseline(*a), max(1, reps // 2))
        err = float(np.abs(out.astype(np.float32) - numpy_baseline(*args).astype(np.float32)).max())
        kv_bytes = 2 * s * length * k * d * np.dtype(dtype).itemsize
        rows.append(dict(shape=name, pagedattn_ms=t_pa * 1e3, numpy_ms=t_np * 1e3, kv_bytes=kv_bytes,
                         pagedattn_gbps=kv_bytes / t_pa / 1e9, numpy_gbps=kv_bytes / t_np / 1e9,
                         speedup=t_np / t_pa, max_abs_diff=err))  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedattn.bench.cpu_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    rows = run(args.reps, log=lambda text: print(text, file=sys.stderr, flush=True))
    print(f"pagedattn {pagedattn.__version__} CPU decode, {pagedattn._core.num_threads()} threads, "
          f"{platform.machine()} {platform.processor() or ''}".rstrip())
    print(f"{'shape':40s} {'pagedattn':>12s} {'GB/s':>7s} {'NumPy':>12s} {'GB/s':>7s} {'speed-up':>8s}")
    for r in rows:
        print(f"{r['shape']:40s} {r['pagedattn_ms']:9.3f} ms {r['pagedattn_gbps']:7.2f} "
              f"{r['numpy_ms']:9.3f} ms {r['numpy_gbps']:7.2f} {r['speedup']:7.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=pagedattn._core.num_threads(), rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
