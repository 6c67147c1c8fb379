"""Times each benchmark shape (vllm layout) at the automatic plan, single pass and a
range of partition counts, to fit the planner's model to measurements (GPU machine only).

    python3 benchmarks/plan_sweep.py [--shapes=sub1,sub2] [--nps=1,2,3,4]
    python3 benchmarks/plan_sweep.py --grid=48x4096,64x4096 [--layout=nhd] [--nps=...]

--grid times GQA 32/8 d128 bf16 calls of the given batch x context instead of the suite
(shapes between the suite's, where a grid fills part of a second round of CTAs).
"""

import sys

import torch
from small_shapes import case, parse_args, suite_cases

import pagedattn
from pagedattn.bench.kernels import Shape, Timer

NPS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)


def grid_cases(grid, layout):
    """(shape, inputs) of GQA 32/8 d128 bf16 at each "batch x context" of `grid`."""
    for item in grid.split(","):
        b, c = (int(x) for x in item.split("x"))
        sh = Shape(f"gqa32/8 b{b} x{c}", b, c, 32, 8, 128, "bfloat16")
        yield sh, case(b, 32, 8, 128, torch.bfloat16, c, layout)
        torch.cuda.empty_cache()


def main():
    opts, _, only = parse_args(sys.argv[1:])
    nps = [int(x) for x in opts["nps"].split(",")] if "nps" in opts else NPS
    timer = Timer(torch, 15, 2, "read")
    layout = opts.get("layout", "vllm")
    for sh, (q, kc, vc, bt, sl) in grid_cases(opts["grid"], layout) if "grid" in opts else suite_cases(only, layout):
        out = torch.empty_like(q)
        auto = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out)
        row = [f"auto {timer.gpu_us(auto.run):.1f}"]
        seen = set()
        for np_ in (1,) + tuple(nps):
            per = -(-sh.context // np_)  # tokens per partition, then rounded up to 16
            ps = max(64, -(-per // 16) * 16)
            if np_ > 1 and (ps >= sh.context or ps in seen):
                continue
            seen.add(ps)
            if np_ == 1:
                prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, kernel="single_pass")
            else:
                prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, kernel="partitioned", partition_size=ps)
            row.append(f"{-(-sh.context // ps) if np_ > 1 else 1}:{ps}={timer.gpu_us(prep.run):.1f}")
        print(f"{sh.name:22s} {layout} " + " ".join(row), flush=True)
        del q, kc, vc, out


if __name__ == "__main__":
    main()
