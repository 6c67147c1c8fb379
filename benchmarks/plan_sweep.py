"""Times each benchmark shape (vllm layout) at the automatic plan, single pass and a
range of partition counts, to fit the planner's model to measurements (GPU machine only).

    python3 benchmarks/plan_sweep.py [--shapes=sub1,sub2] [--nps=1,2,3,4]
"""

import sys

import torch
from small_shapes import parse_args, suite_cases

import pagedattn
from pagedattn.bench.kernels import Timer

NPS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)


def main():
    opts, _, only = parse_args(sys.argv[1:])
    nps = [int(x) for x in opts["nps"].split(",")] if "nps" in opts else NPS
    timer = Timer(torch, 15, 2, "read")
    for sh, (q, kc, vc, bt, sl) in suite_cases(only):
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
        print(f"{sh.name:22s} " + " ".join(row), flush=True)
        del q, kc, vc, out


if __name__ == "__main__":
    main()
