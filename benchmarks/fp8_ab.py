"""Times the fp8 decode shapes of fp8_decode_bench.py (pagedattn alone, both layouts, fp8 and
bf16 caches) with the pagedattn found on sys.path, one line per call in device_ab.sh's format,
so that builds can be compared side by side (GPU machine only).

    python3 benchmarks/fp8_ab.py TAG [--shapes=sub1,sub2] [--reps=30]
"""

import sys

from fp8_decode_bench import run, shapes
from small_shapes import parse_args


def main():
    opts, tag, only = parse_args(sys.argv[1:])
    selected = [s for s in shapes() if not only or any(k in s.name for k in only)]
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
