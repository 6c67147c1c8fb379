"""A representative sample of CUDA calls for compute-sanitizer (memcheck / racecheck):
every kernel family, both layouts, 16-bit / float32 / fp8 caches, v1 and v2, ALiBi,
GQA and an odd head size; outputs checked against the float64 reference."""

import sys

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tests/python")
import pagedattn  # noqa: E402
from conftest import BF16, assert_close, make_problem  # noqa: E402
from pagedattn.reference import paged_attention_ref  # noqa: E402

rng = np.random.default_rng(7)
quick = sys.argv[1:] == ["racecheck"]


def t(a):
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()


def back(x):
    x = x.cpu()
    return x.view(torch.uint16).numpy().view(BF16) if x.dtype == torch.bfloat16 else x.numpy()


cases = [
    dict(dtype=np.float16, layout="vllm", block_size=16, head_size=128, kernel="single_pass"),
    dict(dtype=BF16, layout="nhd", block_size=8, head_size=80, kernel="partitioned"),
    dict(dtype=np.float32, layout="vllm", block_size=32, head_size=64, kernel="partitioned"),
    dict(dtype=np.float32, layout="nhd", block_size=16, head_size=40, kernel="single_pass"),
]
if quick:
    cases = cases[:2]
for c in cases:
    p = make_problem(
        rng,
        [0, 1, 33, 190],
        num_heads=8,
        num_kv_heads=2,
        head_size=c["head_size"],
        block_size=c["block_size"],
        dtype=c["dtype"],
        layout=c["layout"],
        alibi=True,
    )
    out = pagedattn.paged_attention(
        *[t(a) for a in p.args()], alibi_slopes=t(p.alibi_slopes), kernel=c["kernel"], partition_size=64
    )
    torch.cuda.synchronize()
    assert_close(back(out), paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes), c["dtype"], str(c))

# page sizes from 1 to 256, the hnd layout, and the variants (a window over NaN slots,
# soft cap, sinks), in decode and varlen calls
for layout, bs, kern in (("nhd", 1, "partitioned"), ("hnd", 4, "single_pass"), ("vllm", 64, "partitioned"),
                         ("hnd", 256, "auto"), ("vllm", 2, "auto")):  # fmt: skip
    p = make_problem(rng, [0, 1, 37, 300], num_heads=8, num_kv_heads=2, head_size=64, block_size=bs,
                     dtype=np.float16, layout=layout)  # fmt: skip
    sinks = rng.standard_normal(8).astype(np.float32)
    var = dict(sliding_window=24, soft_cap=20.0)
    out = pagedattn.paged_attention(*[t(a) for a in p.args()], layout=layout, kernel=kern, partition_size=64,
                                    sinks=t(sinks), **var)  # fmt: skip
    torch.cuda.synchronize()
    ref = paged_attention_ref(*p.args(), layout=layout, sinks=sinks, **var)
    assert_close(back(out), ref, np.float16, f"variants {layout} page {bs}")
    q_lens = np.array([0, 1, 20, 150], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), 8, 64)).astype(np.float16)
    args = [query, *p.args()[1:]]
    out = pagedattn.paged_attention(*[t(a) for a in args], layout=layout, query_start_loc=t(qsl),
                                    max_query_len=150, sinks=t(sinks), **var)  # fmt: skip
    torch.cuda.synchronize()
    ref = paged_attention_ref(*args, layout=layout, query_start_loc=qsl, sinks=sinks, **var)
    assert_close(back(out), ref, np.float16, f"varlen variants {layout} page {bs}")

# fp8 caches written by the CUDA reshape_and_cache, read by decode
for layout, head in (("vllm", 64), ("nhd", 72)):
    kshape, vshape = pagedattn.kv_cache_shape(6, 16, 2, head, "uint8", layout)
    kc = torch.zeros(kshape, dtype=torch.uint8, device="cuda")
    vc = torch.zeros(vshape, dtype=torch.uint8, device="cuda")
    k = torch.randn(40, 2, head, dtype=torch.float16, device="cuda")
    v = torch.randn(40, 2, head, dtype=torch.float16, device="cuda")
    slots = torch.arange(40, dtype=torch.int64, device="cuda")
    slots[5] = -1
    pagedattn.reshape_and_cache(k, v, kc, vc, slots, kv_cache_dtype="fp8_e5m2", k_scale=0.1, v_scale=0.2)
    q = torch.randn(2, 8, head, dtype=torch.float16, device="cuda")
    bt = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0]], dtype=torch.int32, device="cuda")
    sl = torch.tensor([37, 20], dtype=torch.int32, device="cuda")
    out = pagedattn.paged_attention(
        q, kc, vc, bt, sl, kv_cache_dtype="fp8_e5m2", k_scale=0.1, v_scale=0.2, kernel="partitioned", partition_size=16
    )
    ref = paged_attention_ref(
        q.cpu().numpy(),
        kc.cpu().numpy(),
        vc.cpu().numpy(),
        bt.cpu().numpy(),
        sl.cpu().numpy(),
        kv_cache_dtype="fp8_e5m2",
        k_scale=0.1,
        v_scale=0.2,
    )
    assert_close(out.cpu().numpy(), ref, np.float16, f"fp8 {layout}")

# fp8 at the transposed kernels' full CTA width (8 warps): a grid of about 1.5 CTAs per
# multiprocessor, 1152 tokens per CTA (the sample above runs the narrow width)
S, NB = -(-3 * torch.cuda.get_device_properties(0).multi_processor_count // 4), 72
kshape, vshape = pagedattn.kv_cache_shape(NB * S, 16, 2, 128, "uint8", "vllm")
kc = torch.zeros(kshape, dtype=torch.uint8, device="cuda")
vc = torch.zeros(vshape, dtype=torch.uint8, device="cuda")
k = torch.randn(16 * NB * S, 2, 128, dtype=torch.bfloat16, device="cuda")
v = torch.randn(16 * NB * S, 2, 128, dtype=torch.bfloat16, device="cuda")
slots = torch.arange(16 * NB * S, dtype=torch.int64, device="cuda")
pagedattn.reshape_and_cache(k, v, kc, vc, slots, kv_cache_dtype="fp8_e4m3", k_scale=0.1, v_scale=0.2)
q = torch.randn(S, 8, 128, dtype=torch.bfloat16, device="cuda")
bt = torch.randperm(NB * S, device="cuda").to(torch.int32).reshape(S, NB)
sl = torch.randint(1, 16 * NB + 1, (S,), dtype=torch.int32, device="cuda")
plan = pagedattn.decode_plan(S, 8, 2, 128, 16, NB, "bfloat16", "vllm", kv_cache_dtype="fp8_e4m3")
assert plan["threads_per_cta"] == 256, plan
out = pagedattn.paged_attention(q, kc, vc, bt, sl, kv_cache_dtype="fp8_e4m3", k_scale=0.1, v_scale=0.2)
ref = paged_attention_ref(
    back(q), kc.cpu().numpy(), vc.cpu().numpy(), bt.cpu().numpy(), sl.cpu().numpy(),
    kv_cache_dtype="fp8_e4m3", k_scale=0.1, v_scale=0.2,
)  # fmt: skip
assert_close(back(out), ref, BF16, "fp8 full width")

# lengths at partition boundaries (v2 with 64-token partitions) and a 1-token tail
p = make_problem(
    rng,
    [63, 64, 65, 128, 129],
    num_heads=8,
    num_kv_heads=1,
    head_size=128,
    block_size=16,
    dtype=np.float16,
    layout="vllm",
)
out = pagedattn.paged_attention(*[t(a) for a in p.args()], kernel="partitioned", partition_size=64)
torch.cuda.synchronize()
assert_close(back(out), paged_attention_ref(*p.args()), np.float16, "partition boundaries")

# out-of-range block ids and lengths: the kernel must stay inside the cache, mark the
# affected sequence with NaN, and (checking mode) raise IndexError naming the entry
p = make_problem(rng, [40, 40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=np.float16)
bt = p.block_tables.copy()
bt[1, 1] = 10**6
args = [t(p.query), t(p.key_cache), t(p.value_cache), t(bt), t(p.seq_lens)]
out = pagedattn.paged_attention(*args)
torch.cuda.synchronize()
res = back(out)
assert np.isnan(res[1].astype(np.float32)).all(), "a sequence with a bad block id must come out as NaN"
assert_close(res[:1], paged_attention_ref(*p.args())[:1], np.float16, "good sequence next to a bad one")
try:
    pagedattn.paged_attention(*args, check_block_tables=True)
    raise AssertionError("check_block_tables=True did not raise")
except IndexError as e:
    assert "block_tables[1, 1] = 1000000" in str(e), str(e)
sl = p.seq_lens.copy()
sl[0] = 10**6
try:
    pagedattn.paged_attention(
        t(p.query), t(p.key_cache), t(p.value_cache), t(p.block_tables), t(sl), check_block_tables=True
    )
    raise AssertionError("check_block_tables=True did not raise for a bad length")
except IndexError as e:
    assert "seq_lens[0]" in str(e), str(e)

# varlen (chunked prefill / mixed batch): tensor-core and CUDA-core kernels, fp8, both
# layouts, the mixed route (single-row sequences on the decode kernels) and bad metadata
for dtype, layout, head, kind in (
    (np.float16, "vllm", 128, "auto"),
    (BF16, "nhd", 64, "fp8_e4m3"),
    (np.float32, "nhd", 40, "auto"),
    (np.float16, "nhd", 96, "auto"),
):
    if quick and dtype is np.float32:
        continue
    p = make_problem(
        rng,
        [1, 70, 130, 9],
        num_heads=8,
        num_kv_heads=2,
        head_size=head,
        block_size=16,
        dtype=dtype,
        layout=layout,
        alibi=True,
    )
    kw = {}
    if kind != "auto":
        kw = dict(kv_cache_dtype=kind, k_scale=0.05, v_scale=0.05)
        kshape, vshape = pagedattn.kv_cache_shape(p.key_cache.shape[0], 16, 2, head, "uint8", layout)
        kc, vc = np.full(kshape, 0x7F, np.uint8), np.full(vshape, 0x7F, np.uint8)
        for i, n in enumerate(p.seq_lens):
            tok = np.arange(int(n))
            slots = p.block_tables[i, tok // 16].astype(np.int64) * 16 + tok % 16
            kv = rng.standard_normal((2, int(n), 2, head)).astype(dtype)
            pagedattn.reshape_and_cache(kv[0], kv[1], kc, vc, slots, **kw)
        p.key_cache, p.value_cache = kc, vc
    qsl = np.array([0, 1, 41, 171, 172], np.int32)  # 1, 40, 130 (all of it) and 1 rows
    q = rng.standard_normal((172, 8, head)).astype(dtype)
    args = [t(q), t(p.key_cache), t(p.value_cache), t(p.block_tables), t(p.seq_lens)]
    out = pagedattn.paged_attention(*args, query_start_loc=t(qsl), alibi_slopes=t(p.alibi_slopes), **kw)
    torch.cuda.synchronize()
    ref = paged_attention_ref(
        q,
        p.key_cache,
        p.value_cache,
        p.block_tables,
        p.seq_lens,
        query_start_loc=qsl,
        alibi_slopes=p.alibi_slopes,
        **kw,
    )
    assert_close(back(out), ref, dtype, f"varlen {layout} D={head} {kind}")
    bad = qsl.copy()
    bad[2] = 500  # past T: the kernels must stay inside the query and output
    out = pagedattn.paged_attention(*args, query_start_loc=t(bad), alibi_slopes=t(p.alibi_slopes), **kw)
    torch.cuda.synchronize()
    try:
        pagedattn.paged_attention(*args, query_start_loc=t(bad), check_block_tables=True, **kw)
        raise AssertionError("check_block_tables=True did not raise for a bad query_start_loc")
    except ValueError as e:
        assert "query_start_loc" in str(e), str(e)

# the Hopper varlen kernel's persistent grid (items from a device counter): 6 prompts of 512,
# 8 KV heads x 2, enough items for it on a GPU of up to 168 multiprocessors; twice, so the
# second call runs on the counters the first left zeroed
for layout in ("nhd", "vllm"):
    p = make_problem(rng, [512] * 6, num_heads=16, num_kv_heads=8, head_size=64, block_size=16, dtype=np.float16,
                     layout=layout)  # fmt: skip
    qsl = np.arange(0, 7 * 512, 512, dtype=np.int32)
    q = rng.standard_normal((6 * 512, 16, 64)).astype(np.float16)
    args = [t(q), t(p.key_cache), t(p.value_cache), t(p.block_tables), t(p.seq_lens)]
    ref = paged_attention_ref(q, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, query_start_loc=qsl)
    for i in range(1 if quick else 2):
        out = pagedattn.paged_attention(*args, query_start_loc=t(qsl))
        torch.cuda.synchronize()
        assert_close(back(out), ref, np.float16, f"persistent varlen {layout} call {i}")

# block copy / swap
cache = torch.randn(8, 2, 64, 16, dtype=torch.float16, device="cuda")
pagedattn.copy_blocks([cache], [cache.clone()], [(0, 5), (1, 6)])
host = torch.zeros(8, 2, 64, 16, dtype=torch.float16, pin_memory=True)
pagedattn.swap_blocks(cache, host, [(5, 0), (6, 1)])
torch.cuda.synchronize()
assert torch.equal(host[0].cuda(), cache[0])
print("sample ok")
