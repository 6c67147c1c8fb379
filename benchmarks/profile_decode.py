"""Runs one decode shape a few times, for a profiler to capture (GPU machine only).

    python benchmarks/profile_decode.py [layout] [batch] [context]
"""

import sys

import torch
from decode_case import gqa_case

import pagedattn

layout = sys.argv[1] if len(sys.argv) > 1 else "vllm"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
context = int(sys.argv[3]) if len(sys.argv) > 3 else 16384
q, kc, vc, bt, sl = gqa_case(layout, batch, context)
out = torch.empty_like(q)
for _ in range(3):
    pagedattn.paged_attention(q, kc, vc, bt, sl, out=out)
torch.cuda.synchronize()
print("ok", layout, batch, context)
