"""Times the fp8 decode shapes of fp8_decode_bench.py (pagedattn alone, both layouts, fp8 and
bf16 caches) with the pagedattn found on sys.path, one line per call in device_ab.sh's format,
so that builds can be compared side by side (GPU machine only).

    python3 benchmarks/fp8_ab.py TAG [--shapes=sub1,sub2] [--reps=30] [--set=small|all]
    python3 benchmarks/fp8_ab.py --sweep [--shapes=...] [--nps=1,2,3,4]

--sweep times each fp8 shape and layout at the automatic plan and at the given partition
counts instead (the planner's choice against the best fixed plan).
"""

import sys

from fp8_decode_bench import run, shapes
from small_shapes import parse_args

from pagedattn.bench.kernels import Shape


def small_shapes():
    """Calls under 512 MB, where a grid may not fill the GPU (--set=small)."""
    out = [Shape(f"gqa32/8 b{b} x{c}", b, c, 32, 8, 128, "bfloat16") for b, c in
           ((1, 1024), (1, 4096), (1, 16384), (4, 4096), (8, 1024), (16, 2048), (128, 512))]  # fmt: skip
    out.append(Shape("mha32 b8 x2048", 8, 2048, 32, 32, 128, "bfloat16"))
    out.append(Shape("gqa64/8 d64 b16 x4096", 16, 4096, 64, 8, 64, "bfloat16"))
    return out


def sweep(only, nps, reps):
    import torch
    from fp8_decode_bench import _fp8_caches

    import pagedattn
    from pagedattn.bench.kernels import Timer, _make_inputs

    timer = Timer(torch, reps, 3, "read")
    for i, shape in enumerate(s for s in shapes() if not only or any(k in s.name for k in only)):
        inp = _make_inputs(torch, shape, seed=99 + i)
        fp8 = _fp8_caches(torch, inp, shape)
        q, tables, lens, ctx = inp["q"], inp["tables"], inp["lens"], shape.context
        out = torch.empty_like(q)
        for layout in ("vllm", "nhd"):
            kw = dict(out=out, kv_cache_dtype="fp8_e4m3", k_scale=fp8["k_scale"], v_scale=fp8["v_scale"])
            args = (q, fp8[f"k_{layout}"], fp8[f"v_{layout}"], tables, lens)
            row = [f"auto {timer.gpu_us(pagedattn.prepare_decode(*args, **kw).run):.1f}"]
            for np_ in nps:
                per = -(-ctx // np_)  # tokens per partition, rounded up to 16
                ps = max(64, -(-per // 16) * 16)
                plan = dict(kernel="single_pass") if np_ == 1 else dict(kernel="partitioned", partition_size=ps)
                row.append(f"{np_}:{timer.gpu_us(pagedattn.prepare_decode(*args, **kw, **plan).run):.1f}")
            name = shape.name.split(" (")[0].replace("gqa32/8 ", "")
            print(f"sweep {name} {layout}-fp8 " + " ".join(row), flush=True)
        del inp, fp8, out
        torch.cuda.empty_cache()


def main():
    opts, tag, only = parse_args(sys.argv[1:])
    if "--sweep" in sys.argv:
        nps = [int(x) for x in opts.get("nps", "1,2,3,4,6,8").split(",")]
        return sweep(only, nps, int(opts.get("reps", 20)))
    pool = {"small": small_shapes(), "all": shapes() + small_shapes()}.get(opts.get("set", ""), shapes())
    selected = [s for s in pool if not only or any(k in s.name for k in only)]
    result = run(selected, int(opts.get("reps", 30)), 3, use_flashinfer=False)
    for r in result["rows"]:
        if "gpu_us" not in r:
            raise SystemExit(f"{r['shape']} {r['impl']}: {r.get('error')}")
        # fp8 against the bf16 cache of the same (dequantized) values: a wrong kernel shows here
        assert r["max_abs_diff_vs_bf16"] < 2e-2, f"{r['shape']} {r['impl']}: diff {r['max_abs_diff_vs_bf16']}"
        name = r["shape"].split(" (")[0].replace("gqa32/8 ", "")
        print(f"{tag:8s} {name} {r['impl'].replace('pagedattn-', '')} {r['gpu_us']:9.2f} us", flush=True)


if __name__ == "__main__":
    main()
