"""CPU cache-write speed: reshape_and_cache into fp8 caches against plain (same-dtype)
caches, in elements (keys + values) written per second, and quantize_fp8 alone.

    python benchmarks/cpu_fp8_write_bench.py [--tokens 2048] [--repeat 20] [--json out.json]

The best of --repeat timed calls after one warm-up call; PAGEDATTN_CPU_ISA=generic
measures the scalar encoder, PAGEDATTN_NUM_THREADS the thread count.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import numpy as np

import pagedattn

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bfloat16 rows are skipped
    BF16 = None


def best_seconds(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    t, k, d, b = a.tokens, a.kv_heads, a.head_size, a.block_size
    nblocks = -(-t // b)
    slots = rng.permutation(nblocks * b)[:t].astype(np.int64)
    elements = 2 * t * k * d
    rows = []
    dtypes = [np.dtype(np.float32), np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])
    for dt in dtypes:
        key = rng.standard_normal((t, k, d)).astype(dt)
        value = rng.standard_normal((t, k, d)).astype(dt)
        for layout in pagedattn.supported()["layouts"]:
            for kind in ("auto", "fp8_e4m3", "fp8_e5m2"):
                cdt = dt if kind == "auto" else np.dtype(np.uint8)
                ks, vs = pagedattn.kv_cache_shape(nblocks, b, k, d, cdt, layout)
                kc, vc = np.zeros(ks, cdt), np.zeros(vs, cdt)
                kw = {} if kind == "auto" else dict(kv_cache_dtype=kind, k_scale=0.5, v_scale=0.25)
                s = best_seconds(
                    functools.partial(pagedattn.reshape_and_cache, key, value, kc, vc, slots, **kw), a.repeat
                )
                rows.append(dict(op="reshape_and_cache", dtype=str(dt), layout=layout, cache=kind,
                                 melem_per_s=elements / s / 1e6, us=s * 1e6))  # fmt: skip
        if hasattr(pagedattn, "quantize_fp8"):
            codes = np.zeros(key.shape, np.uint8)
            s = best_seconds(functools.partial(pagedattn.quantize_fp8, key, codes, scale=0.5), a.repeat)
            rows.append(dict(op="quantize_fp8", dtype=str(dt), layout="-", cache="fp8_e4m3",
                             melem_per_s=key.size / s / 1e6, us=s * 1e6))  # fmt: skip
            back = np.zeros(key.shape, dt)
            s = best_seconds(functools.partial(pagedattn.dequantize_fp8, codes, back, scale=0.5), a.repeat)
            rows.append(dict(op="dequantize_fp8", dtype=str(dt), layout="-", cache="fp8_e4m3",
                             melem_per_s=key.size / s / 1e6, us=s * 1e6))  # fmt: skip
    isa = os.environ.get("PAGEDATTN_CPU_ISA", "default")
    print(f"tokens {t}, kv heads {k}, head size {d}, block size {b}; PAGEDATTN_CPU_ISA={isa}; "
          f"threads {os.environ.get('PAGEDATTN_NUM_THREADS', os.cpu_count())}")  # fmt: skip
    print("| op | dtype | layout | cache | M elements/s | us |")
    print("|---|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['dtype']} | {r['layout']} | {r['cache']} | {r['melem_per_s']:.0f} | {r['us']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(tokens=t, kv_heads=k, head_size=d, block_size=b, isa=isa, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
