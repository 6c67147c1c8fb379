"""Sweeps the forced partition size of the partitioned (v2) decode for small batches."""

import statistics

import torch

import pagedattn

flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for layout in ("vllm",):
    for batch, ctx in ((1, 16384), (8, 4096), (1, 4096)):
        h, k, d, bs = 32, 8, 128, 16
        nb = batch * ctx // bs
        ks, vs = pagedattn.kv_cache_shape(nb, bs, k, d, torch.bfloat16, layout)
        kc = torch.randn(ks, dtype=torch.bfloat16, device="cuda")
        vc = torch.randn(vs, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
        bt = torch.randperm(nb, device="cuda", dtype=torch.int32).reshape(batch, -1)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        for version, psize in [(0, 0), (1, 0)] + [(2, p) for p in (64, 128, 256, 512, 1024, 2048)]:
            prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, version=version, partition_size=psize)
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
            nbytes = kc.numel() * 4
            print(f"{layout} b{batch} ctx{ctx} v{version} p{psize}: {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s")
