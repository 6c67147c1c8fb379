"""Times the bf16 GQA decode (32/8 heads, d128, block 16) for a few shapes with CUDA
events, L2 flushed before each call; prints one line per (layout, batch, context)."""

import statistics
import sys

import torch

import pagedattn

tag = sys.argv[1] if len(sys.argv) > 1 else ""
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
b = torch.empty_like(a)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(10):
    s.record(); b.copy_(a); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
copy_gbs = 2 * a.numel() / (statistics.median(ts) * 1e-3) / 1e9
del a, b
for layout in ("vllm", "nhd"):
    for batch, ctx in ((1, 16384), (32, 16384), (128, 4096), (8, 4096)):
        h, k, d, bs = 32, 8, 128, 16
        nb = batch * ctx // bs
        ks, vs = pagedattn.kv_cache_shape(nb, bs, k, d, torch.bfloat16, layout)
        kc = torch.randn(ks, dtype=torch.bfloat16, device="cuda")
        vc = torch.randn(vs, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
        bt = torch.randperm(nb, device="cuda", dtype=torch.int32).reshape(batch, -1)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out)
        for _ in range(3):
            prep.run()
        times = []
        for _ in range(25):
            flush.zero_()
            torch.cuda._sleep(200000)
            s.record(); prep.run(); e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        us = statistics.median(times)
        nbytes = kc.numel() * 2 * 2 + q.numel() * 4
        print(f"{tag:10s} {layout:5s} b{batch:<4d} ctx{ctx:<6d} {us:9.1f} us {nbytes / us / 1e3:7.0f} GB/s "
              f"{100 * nbytes / us / 1e3 / copy_gbs:5.1f}% of copy {copy_gbs:.0f}")
        del kc, vc
