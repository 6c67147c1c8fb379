"""Times chosen (version, partition size) settings of multi-wave decode shapes side by side,
to check the planner's choice against its alternatives (GPU machine only).

    python3 benchmarks/plan_check.py
"""

import torch
from small_shapes import case

import pagedattn
from pagedattn.bench.kernels import Timer

KERNELS = ("auto", "single_pass", "partitioned")  # by the old version number 0, 1, 2

CASES = [  # name, S, H, K, D, dtype, ctx, [(version, partition_size), ...]
    ("gqa b32 x4096", 32, 32, 8, 128, torch.bfloat16, 4096, [(0, 0), (1, 0), (2, 1376)]),
    ("gqa b32 x16384", 32, 32, 8, 128, torch.bfloat16, 16384, [(0, 0), (2, 976), (2, 5472), (1, 0)]),
    ("gqa b128 x1024", 128, 32, 8, 128, torch.bfloat16, 1024, [(0, 0), (2, 352), (2, 512), (1, 0)]),
    ("gqa b128 x16384", 128, 32, 8, 128, torch.bfloat16, 16384, [(0, 0), (2, 3280), (2, 5472), (1, 0)]),
    ("mha b64 x2048", 64, 32, 32, 128, torch.float16, 2048, [(0, 0), (2, 688), (2, 1024), (1, 0)]),
]


def main():
    timer = Timer(torch, 20, 3, "read")
    for name, S, H, K, D, dt, ctx, configs in CASES:
        q, kc, vc, bt, sl = case(S, H, K, D, dt, ctx)
        out = torch.empty_like(q)
        for version, psize in configs:
            prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, kernel=KERNELS[version], partition_size=psize)
            print(f"{name:16s} v{version} p{psize:<5d} {timer.gpu_us(prep.run):9.1f} us", flush=True)
        del kc, vc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
