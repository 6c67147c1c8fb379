"""Runs one varlen (prefill) shape a few times, for a profiler to capture (GPU machine only).

    python benchmarks/profile_prefill.py [pagedattn|sdpa] [layout] [shape]

shape: 1x8192 (GQA 32/8 d128 bf16, one causal prompt), 8x1024, chunk (2048 over 14336) or
mha (MHA 32 x d128 f16, 4 x 2048). "sdpa" runs PyTorch's scaled_dot_product_attention on
contiguous K/V of the same shape instead (the "no paging" reference of prefill_bench.py), so
that a profiler can show its kernel's launch (grid, threads, registers, shared memory) and
rates beside ours.
"""

import sys

import torch
from prefill_bench import Shape, make_inputs, sdpa_rows

import pagedattn

SHAPES = {
    "1x8192": Shape("1 x 8192", [(8192, 8192)], 32, 8, 128, torch.bfloat16),
    "8x1024": Shape("8 x 1024", [(1024, 1024)] * 8, 32, 8, 128, torch.bfloat16),
    "chunk": Shape("chunk 2048 over 14336", [(16384, 2048)], 32, 8, 128, torch.bfloat16),
    "mha": Shape("MHA 4 x 2048", [(2048, 2048)] * 4, 32, 32, 128, torch.float16),
}

system = sys.argv[1] if len(sys.argv) > 1 else "pagedattn"
layout = sys.argv[2] if len(sys.argv) > 2 else "nhd"
sh = SHAPES[sys.argv[3] if len(sys.argv) > 3 else "1x8192"]
g = torch.Generator(device="cuda").manual_seed(0)
if system == "sdpa":  # one call per sequence, as prefill_bench.py times it
    def rand(rows, heads):
        return torch.randn((rows, heads, sh.D), device="cuda", dtype=sh.dtype, generator=g)

    seqs = [(rand(nq, sh.H), rand(n, sh.K), rand(n, sh.K)) for n, nq in sh.seqs]
    for _ in range(3):
        for q, k, v in seqs:
            sdpa_rows(q, k, v)
else:
    q, kc, vc, bt, sl, qsl = make_inputs(sh, layout, g)
    out = torch.empty_like(q)
    mq = max(nq for _, nq in sh.seqs)
    for _ in range(3):
        pagedattn.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=mq, out=out)
torch.cuda.synchronize()
print("ok", system, layout, sh.name)
