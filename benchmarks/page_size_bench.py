"""Page (block) size sweep on the GPU: decode and varlen prefill at page sizes 1, 16, 64, 256.

Shapes: the GQA decode suite of ``python -m pagedattn bench`` (32 query heads over 8 KV
heads, head size 128, bfloat16; batch 8 and 32 at 4k and 16k tokens) and the GQA prefill
shapes of benchmarks/prefill_bench.py (one 8k prompt; a 2k chunk over a 16k context),
in the "nhd", "hnd" and "vllm" layouts. Each sequence's pages are a random permutation
of the pool, so a small page size really scatters the context. Times are CUDA-event
medians after warm-up; the table gives microseconds and the time per byte of KV read
relative to page size 16 of the same shape and layout (1.00 = as fast; the target is
<= 1.10 from 16 up and <= 1.43, i.e. 70% of the speed, at page size 1).

With ``--cache fp8_e4m3`` (or fp8_e5m2) the caches hold fp8 codes with per-tensor scales:
the same shapes at half the KV bytes (the ratios are per byte of the fp8 cache).

    python benchmarks/page_size_bench.py [--json out.json] [--layouts nhd,hnd] [--pages 1,16,64,256]
                                         [--only decode] [--cache fp8_e4m3]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

import pagedattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefill_bench  # noqa: E402  (the benchmark folder is not a package)

DEV = torch.device("cuda")


def timed(fn, iters=30, warmup=5) -> float:
    return prefill_bench.timed(fn, iters, warmup)  # CUDA-event median, us


def make_case(seqs, heads, kv_heads, head_size, page, layout, g, cache="bfloat16"):
    """(query, caches, block tables, seq_lens, query_start_loc or None, KV bytes) for
    sequences given as (seq_len, q_len); q_len 1 everywhere is a decode. cache: "bfloat16",
    or an fp8 format (the caches then hold random finite codes of it, as uint8)."""
    dtype = torch.bfloat16
    need = [-(-n // page) for n, _ in seqs]
    nb = sum(need)
    fp8 = cache != "bfloat16"
    kshape, vshape = pagedattn.kv_cache_shape(nb, page, kv_heads, head_size, "uint8" if fp8 else "bfloat16", layout)
    if fp8:  # codes with the top exponent bit clear: finite in both formats
        kc = (torch.randint(0, 256, kshape, device=DEV, generator=g, dtype=torch.int32) & 0xB7).to(torch.uint8)
        vc = (torch.randint(0, 256, vshape, device=DEV, generator=g, dtype=torch.int32) & 0xB7).to(torch.uint8)
    else:
        kc = torch.randn(kshape, device=DEV, dtype=dtype, generator=g)
        vc = torch.randn(vshape, device=DEV, dtype=dtype, generator=g)
    perm = torch.randperm(nb, device=DEV, generator=g).to(torch.int32)
    bt = torch.zeros((len(seqs), max(need)), dtype=torch.int32, device=DEV)
    pos = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[pos : pos + n]
        pos += n
    lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=DEV)
    decode = all(q == 1 for _, q in seqs)
    rows = sum(q for _, q in seqs)
    query = torch.randn((rows, heads, head_size), device=DEV, dtype=dtype, generator=g)
    qsl = None
    if not decode:
        qsl = torch.tensor([0, *itertools.accumulate(q for _, q in seqs)], dtype=torch.int32, device=DEV)
    kv_bytes = sum(n for n, _ in seqs) * kv_heads * head_size * 2 * (1 if fp8 else 2)
    return query, kc, vc, bt, lens, qsl, kv_bytes


SHAPES = [
    ("decode gqa32/8 d128 bf16 b8 x4096", [(4096, 1)] * 8),
    ("decode gqa32/8 d128 bf16 b32 x4096", [(4096, 1)] * 32),
    ("decode gqa32/8 d128 bf16 b8 x16384", [(16384, 1)] * 8),
    ("decode gqa32/8 d128 bf16 b32 x16384", [(16384, 1)] * 32),
    ("prefill gqa32/8 d128 bf16 1 x 8192", [(8192, 8192)]),
    ("chunk 2048 over 16384 gqa32/8 d128 bf16", [(16384, 2048)]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--layouts", default="nhd,hnd,vllm")
    ap.add_argument("--pages", default="1,16,64,256")
    ap.add_argument("--only", default="", help="the shapes whose name contains this (e.g. decode)")
    ap.add_argument("--cache", default="bfloat16", choices=["bfloat16", "fp8_e4m3", "fp8_e5m2"])
    args = ap.parse_args()
    pages = [int(p) for p in args.pages.split(",")]
    layouts = args.layouts.split(",")
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    shapes = [(name, seqs) for name, seqs in SHAPES if args.only in name]
    for name, seqs in shapes:
        for layout in layouts:
            base = None
            for page in pages:
                q, kc, vc, bt, lens, qsl, kv_bytes = make_case(seqs, 32, 8, 128, page, layout, g, args.cache)
                kw = dict(layout=layout)
                if args.cache != "bfloat16":
                    kw.update(kv_cache_dtype=args.cache, k_scale=0.05, v_scale=0.05)
                if qsl is not None:
                    kw.update(query_start_loc=qsl, max_query_len=max(qn for _, qn in seqs))
                out = torch.empty_like(q)
                us = timed(functools.partial(pagedattn.paged_attention, q, kc, vc, bt, lens, out=out, **kw))
                per_byte = us / kv_bytes
                if page == 16:
                    base = per_byte
                rows.append({"shape": name, "layout": layout, "page": page, "cache": args.cache, "us": us,
                             "kv_bytes": kv_bytes, "us_per_byte": per_byte})  # fmt: skip
            for r in rows:
                if r["shape"] == name and r["layout"] == layout and base:
                    r["vs_page16"] = r["us_per_byte"] / base
    print(f"| shape | layout | {' | '.join(f'page {p} (us, x16)' for p in pages)} |")
    print(f"|---|---|{'---|' * len(pages)}")
    for name, _ in shapes:
        for layout in layouts:
            cells = []
            for page in pages:
                r = next(r for r in rows if r["shape"] == name and r["layout"] == layout and r["page"] == page)
                cells.append(f"{r['us']:.1f} ({r.get('vs_page16', float('nan')):.2f})")
            print(f"| {name} | {layout} | {' | '.join(cells)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
