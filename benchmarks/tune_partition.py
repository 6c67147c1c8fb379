"""Sweeps the forced partition size of the partitioned (v2) decode for small batches."""

from decode_case import gqa_case, time_us

import pagedattn

KERNELS = ("auto", "single_pass", "partitioned")  # by the old version number 0, 1, 2

for batch, ctx in ((1, 16384), (8, 4096), (1, 4096)):
    q, kc, vc, bt, sl = gqa_case("vllm", batch, ctx)
    out = q.new_empty(q.shape)
    for version, psize in [(0, 0), (1, 0)] + [(2, p) for p in (64, 128, 256, 512, 1024, 2048)]:
        prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, kernel=KERNELS[version], partition_size=psize)
        us = time_us(prep.run)
        nbytes = kc.numel() * 4
        print(f"vllm b{batch} ctx{ctx} v{version} p{psize}: {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s")
