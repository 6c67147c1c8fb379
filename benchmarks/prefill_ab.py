"""Times varlen shapes (pagedattn alone, both layouts) with the pagedattn found on sys.path,
one line per call in device_ab.sh's format, so that builds (or run-time switches) compare
side by side (GPU machine only):

    PA_AB_SCRIPT=prefill_ab.py bash benchmarks/device_ab.sh
    python3 benchmarks/prefill_ab.py TAG [--shapes=1x8192,mixed] [--iters=40]

Each call is timed with CUDA events after warm-up, the median of --iters calls, three
times; the least of the three medians is printed (prefill_bench.py's single median moved
by 2-5% between processes on an H200).
"""

import functools
import sys

import torch
from prefill_bench import Shape, make_inputs, mixed_shapes, timed
from small_shapes import parse_args

import pagedattn

BF16, F16 = torch.bfloat16, torch.float16
SHAPES = {
    "1x8192": Shape("1 x 8192", [(8192, 8192)], 32, 8, 128, BF16),
    "8x1024": Shape("8 x 1024", [(1024, 1024)] * 8, 32, 8, 128, BF16),
    "chunk": Shape("chunk 2048 over 14336", [(16384, 2048)], 32, 8, 128, BF16),
    "mixed": mixed_shapes(127, BF16)[0],
    "seed": Shape("seed step 2", [(485, 1), (484, 456)], 12, 12, 64, F16),
    "mha": Shape("MHA 4 x 2048", [(2048, 2048)] * 4, 32, 32, 128, F16),
}


def main():
    opts, tag, only = parse_args(sys.argv[1:])
    iters = int(opts.get("iters", 40))
    g = torch.Generator(device="cuda").manual_seed(0)
    for key, sh in SHAPES.items():
        if only and key not in only:
            continue
        for layout in ("vllm", "nhd"):
            q, kc, vc, bt, sl, qsl = make_inputs(sh, layout, g)
            mq = max(nq for _, nq in sh.seqs)
            kw = dict(query_start_loc=qsl, max_query_len=mq, out=torch.empty_like(q))
            call = functools.partial(pagedattn.paged_attention, q, kc, vc, bt, sl, **kw)
            us = min(timed(call, iters=iters, warmup=5) for _ in range(3))
            print(f"{tag:8s} {key} {layout} {us:9.2f} us", flush=True)
            del q, kc, vc, kw, call
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
