"""Times the bf16 GQA decode (32/8 heads, d128, block 16) for a few shapes with CUDA
events, L2 flushed before each call; prints one line per (layout, batch, context)."""

import functools
import sys

import torch
from decode_case import gqa_case, time_us

import pagedattn

tag = sys.argv[1] if len(sys.argv) > 1 else ""
a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
copy_gbs = 2 * a.numel() / (time_us(functools.partial(b.copy_, a), reps=10) * 1e-6) / 1e9
del a, b
for layout in ("vllm", "nhd"):
    for batch, ctx in ((1, 16384), (32, 16384), (128, 4096), (8, 16384), (32, 1024)):
        q, kc, vc, bt, sl = gqa_case(layout, batch, ctx)
        prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=q.new_empty(q.shape))
        us = time_us(prep.run)
        nbytes = kc.numel() * 2 * 2 + q.numel() * 4
        print(f"{tag:10s} {layout:5s} b{batch:<4d} ctx{ctx:<6d} {us:9.1f} us {nbytes / us / 1e3:7.0f} GB/s "
              f"{100 * nbytes / us / 1e3 / copy_gbs:5.1f}% of copy {copy_gbs:.0f}")
        del kc, vc
