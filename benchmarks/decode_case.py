"""Shared set-up of the decode tuning and profiling scripts (GPU machine only):
a grouped-query bf16 decode problem (32/8 heads, head size 128, block size 16) and a
CUDA-event timer that evicts L2 and queues each call behind a GPU spin."""

import statistics

import torch

import pagedattn

H, K, D, BS = 32, 8, 128, 16


def gqa_case(layout, batch, ctx):
    """(query, key_cache, value_cache, block_tables, seq_lens) on the GPU, blocks scattered."""
    nb = batch * ctx // BS
    ks, vs = pagedattn.kv_cache_shape(nb, BS, K, D, torch.bfloat16, layout)
    kc = torch.randn(ks, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn(vs, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    bt = torch.randperm(nb, device="cuda", dtype=torch.int32).reshape(batch, -1)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, sl


_flush = None


def time_us(fn, reps=25, warmup=3):
    """Median GPU time of fn() in microseconds, L2 flushed before each call."""
    global _flush
    if _flush is None:
        _flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _flush.zero_()
        torch.cuda._sleep(200000)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)
