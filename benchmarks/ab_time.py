"""Times every benchmark shape (automatic plan; vllm layout unless --layout=nhd) with the
pagedattn found on sys.path; run once per build with the same arguments to compare builds
side by side (GPU machine only).

    python3 benchmarks/ab_time.py TAG [--shapes=sub1,sub2] [--reps=30] [--layout=nhd]
"""

import sys

import torch
from small_shapes import parse_args, suite_cases

import pagedattn
from pagedattn.bench.kernels import Timer

# The forced single pass, in the keywords of the build under test (kernel= since the
# options object; version=1 before it), so that any two builds compare.
SINGLE_PASS = {"kernel": "single_pass"} if "kernels" in pagedattn.supported() else {"version": 1}


def main():
    opts, tag, only = parse_args(sys.argv[1:])
    timer = Timer(torch, int(opts.get("reps", 30)), 3, "read")
    layout = opts.get("layout", "vllm")
    for sh, (q, kc, vc, bt, sl) in suite_cases(only, layout):
        out = torch.empty_like(q)
        prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out)
        ref = pagedattn.paged_attention(q, kc, vc, bt, sl, **SINGLE_PASS)
        prep.run()
        torch.cuda.synchronize()
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 2e-2, f"{sh.name}: max abs diff {err} against the single pass"
        print(f"{tag:8s} {sh.name:22s} {timer.gpu_us(prep.run):9.2f} us", flush=True)
        if sh.name.startswith("opt-30b"):  # the floor: the same launch with every length 0
            sl.zero_()
            prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out)
            print(f"{tag:8s} {'opt-30b lengths 0':22s} {timer.gpu_us(prep.run):9.2f} us", flush=True)
        del q, kc, vc, out, ref
    if not only or any(k in "torch floor" for k in only):  # for scale: one tiny torch kernel
        small = torch.empty(1024, dtype=torch.float32, device="cuda")
        print(f"{tag:8s} {'torch zero_ 4 KB':22s} {timer.gpu_us(small.zero_):9.2f} us", flush=True)


if __name__ == "__main__":
    main()
