"""Runs one decode shape a few times, for a profiler to capture (GPU machine only).

    python .ci/profile_decode.py [layout] [batch] [context]
"""

import sys

import torch

import pagedattn

layout = sys.argv[1] if len(sys.argv) > 1 else "vllm"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
context = int(sys.argv[3]) if len(sys.argv) > 3 else 16384
h, k, d, b = 32, 8, 128, 16
nb = batch * context // b
ks, vs = pagedattn.kv_cache_shape(nb, b, k, d, torch.bfloat16, layout)
kc = torch.randn(ks, dtype=torch.bfloat16, device="cuda")
vc = torch.randn(vs, dtype=torch.bfloat16, device="cuda")
q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
bt = torch.randperm(nb, device="cuda", dtype=torch.int32).reshape(batch, -1)
sl = torch.full((batch,), context, dtype=torch.int32, device="cuda")
out = torch.empty_like(q)
for _ in range(3):
    pagedattn.paged_attention(q, kc, vc, bt, sl, out=out)
torch.cuda.synchronize()
print("ok", layout, batch, context)
