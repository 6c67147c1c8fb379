"""Small decode shapes on the GPU: forced single pass, partition sizes, and both L2
eviction modes of the benchmark timer, in one process (GPU machine only).

    python3 benchmarks/small_shapes.py [--quick] [--shapes=sub1,sub2] [--psizes=64,128] [tag]
"""

import sys

import torch

import pagedattn
from pagedattn.bench.kernels import Timer

KERNELS = ("auto", "single_pass", "partitioned")  # by the old version number 0, 1, 2

SHAPES = [  # name, S, H, K, D, dtype, ctx
    ("opt-125m 5x196", 5, 12, 12, 64, torch.float16, 196),
    ("opt-30b 1x204", 1, 56, 56, 128, torch.float16, 204),
    ("gqa b1 x1024", 1, 32, 8, 128, torch.bfloat16, 1024),
    ("gqa b1 x4096", 1, 32, 8, 128, torch.bfloat16, 4096),
    ("gqa b1 x16384", 1, 32, 8, 128, torch.bfloat16, 16384),
    ("gqa b8 x1024", 8, 32, 8, 128, torch.bfloat16, 1024),
    ("gqa b8 x16384", 8, 32, 8, 128, torch.bfloat16, 16384),
    ("gqa b128 x1024", 128, 32, 8, 128, torch.bfloat16, 1024),
]
BS = 16


def case(S, H, K, D, dt, ctx, layout="vllm"):
    per = -(-ctx // BS)
    nb = S * per
    ks, vs = pagedattn.kv_cache_shape(nb, BS, K, D, dt, layout)
    kc = torch.randn(ks, dtype=dt, device="cuda")
    vc = torch.randn(vs, dtype=dt, device="cuda")
    q = torch.randn(S, H, D, dtype=dt, device="cuda")
    bt = torch.randperm(nb, device="cuda", dtype=torch.int32).reshape(S, per)
    sl = torch.full((S,), ctx, dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, sl


def parse_args(argv):
    """(--key=value options, the words that are not options joined as a tag, the --shapes filter)."""
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    tag = " ".join(a for a in argv if not a.startswith("--"))
    return opts, tag, [k for k in opts.get("shapes", "").split(",") if k]


def suite_cases(only, layout="vllm"):
    """(shape, inputs) for each shape of the benchmark suite whose name contains a word of `only`."""
    from pagedattn.bench.kernels import SHAPES

    for sh in SHAPES:
        if only and not any(k in sh.name for k in only):
            continue
        dt = getattr(torch, sh.dtype)
        yield sh, case(sh.batch, sh.num_heads, sh.num_kv_heads, sh.head_size, dt, sh.context, layout)
        torch.cuda.empty_cache()


def main():
    quick = "--quick" in sys.argv
    opts, tag, only = parse_args(sys.argv[1:])
    psizes = [int(x) for x in opts.get("psizes", "32,64,128,256,512").split(",")]
    timers = {m: Timer(torch, 40, 5, m) for m in (("read",) if quick else ("read", "write"))}
    for name, S, H, K, D, dt, ctx in SHAPES:
        if only and not any(k in name for k in only):
            continue
        q, kc, vc, bt, sl = case(S, H, K, D, dt, ctx)
        out = torch.empty_like(q)
        ref = pagedattn.paged_attention(q, kc, vc, bt, sl, kernel="single_pass")
        configs = [(0, 0)] if quick else [(0, 0), (1, 0)] + [(2, p) for p in psizes]
        for version, psize in configs:
            if psize and psize >= ctx:
                continue
            prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, kernel=KERNELS[version], partition_size=psize)
            prep.run()
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 2e-2, f"{name} v{version} p{psize}: max abs diff {err}"
            cols = " ".join(f"{m}-flush {t.gpu_us(prep.run):7.2f} us" for m, t in timers.items())
            print(f"{tag} {name:16s} v{version} p{psize:<4d} {cols}", flush=True)


if __name__ == "__main__":
    main()
