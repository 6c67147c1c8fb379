"""paged_attention on CUDA against the CPU path and the float64 reference.

A chosen grid (not a cartesian product): dtypes x layouts x block sizes x forced
kernel; every head size once (specialised and generic); GQA groups 1..32; ALiBi;
fp8 caches (e4m3 / e5m2, with scales) for every query dtype; lengths around block and
partition boundaries and a 32k context; strided query / out; CuPy arrays; CUDA-graph
capture and replay with new block tables and lengths; out-of-range block ids.
Caches are NaN-poisoned outside the used slots and every output element is checked.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pagedattn
from conftest import (
    CUDA_BLOCK_SIZES,
    CUDA_HEAD_SIZES,
    DTYPE_NAMES,
    FP8_KV_CACHE_DTYPES,
    LAYOUTS,
    TOL,
    assert_close,
    make_problem,
    np_dtype,
)
from pagedattn.reference import paged_attention_ref

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

DEV = torch.device("cuda", 0)
from torch_arrays import to_numpy, to_torch  # noqa: E402

NP_DTYPES = {name: np_dtype(name) for name in DTYPE_NAMES}


def fp8_problem(rng, seq_lens, *, kind, dtype, layout, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                k_scale=0.05, v_scale=0.03, alibi=False):
    """A make_problem()-style problem whose caches are fp8 (uint8), written by the CPU
    reshape_and_cache; unused slots hold 0x7f (NaN in both fp8 formats)."""
    base = make_problem(rng, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                        block_size=block_size, dtype=dtype, layout=layout, alibi=alibi)  # fmt: skip
    nblocks = base.key_cache.shape[0]
    kshape, vshape = pagedattn.kv_cache_shape(nblocks, block_size, num_kv_heads, head_size, "uint8", layout)
    kc = np.full(kshape, 0x7F, np.uint8)
    vc = np.full(vshape, 0x7F, np.uint8)
    slots = []
    for i, n in enumerate(base.seq_lens):
        t = np.arange(int(n))
        slots.append(base.block_tables[i, t // block_size].astype(np.int64) * block_size + t % block_size)
    slots = np.concatenate(slots)
    # values of a few units of the scale, so that the fp8 grid is exercised
    k_new = (rng.standard_normal((len(slots), num_kv_heads, head_size)) * 40 * k_scale).astype(dtype)
    v_new = (rng.standard_normal((len(slots), num_kv_heads, head_size)) * 40 * v_scale).astype(dtype)
    pagedattn.reshape_and_cache(k_new, v_new, kc, vc, slots, kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)
    base.key_cache, base.value_cache = kc, vc
    return base


def check(p, dtype, *, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, scale=None, kernel="auto", partition_size=0,
          cpu=True):
    """Runs p on CUDA (torch tensors); compares with the float64 reference and the CPU path."""
    dtype = np.dtype(dtype)
    kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, scale=scale)
    out_t = pagedattn.paged_attention(
        to_torch(p.query), to_torch(p.key_cache), to_torch(p.value_cache), to_torch(p.block_tables),
        to_torch(p.seq_lens), alibi_slopes=to_torch(p.alibi_slopes), kernel=kernel,
        partition_size=partition_size, **kw,
    )  # fmt: skip
    assert out_t.is_cuda and out_t.dtype == to_torch(p.query[:0]).dtype
    out = to_numpy(out_t)
    ref = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, **kw)
    assert_close(out, ref, dtype, "cuda vs float64 reference")
    if cpu:
        cpu_out = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, **kw)
        atol, rtol = TOL[dtype.name]
        np.testing.assert_allclose(out.astype(np.float64), np.asarray(cpu_out).astype(np.float64),
                                   atol=2 * atol, rtol=2 * rtol, err_msg="cuda vs cpu")  # fmt: skip
    zero = np.asarray(p.seq_lens) == 0
    assert np.all(out[zero].astype(np.float64) == 0), "length-0 sequences must give zeros"
    return out


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
@pytest.mark.parametrize("kernel", ["single_pass", "partitioned"])
def test_grid_lengths_around_blocks(rng, dtype, layout, block_size, kernel):
    b = block_size
    lens = [0, 1, b - 1, b, b + 1, 2 * b + 3, 300]
    p = make_problem(rng, lens, num_heads=8, num_kv_heads=2, head_size=128, block_size=b, dtype=NP_DTYPES[dtype],
                     layout=layout)  # fmt: skip
    check(p, NP_DTYPES[dtype], kernel=kernel, partition_size=64 if kernel == "partitioned" else 0)


# every specialised head size, and generic multiples of 8 at both ends and between
@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES + [8, 40, 72, 136, 248])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_head_size(rng, head_size, layout):
    dtype = NP_DTYPES["float16"] if head_size % 16 else NP_DTYPES["bfloat16"]
    p = make_problem(rng, [5, 77, 16], num_heads=4, num_kv_heads=2, head_size=head_size, dtype=dtype, layout=layout)
    check(p, dtype)


@pytest.mark.parametrize("head_size", [64, 96, 256, 40])
def test_head_sizes_float32(rng, head_size):
    p = make_problem(rng, [5, 77], num_heads=4, num_kv_heads=2, head_size=head_size, dtype=np.float32)
    check(p, np.float32)


@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (8, 2), (8, 1), (32, 2), (64, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gqa_groups(rng, heads, dtype):
    p = make_problem(rng, [1, 40, 130], num_heads=heads[0], num_kv_heads=heads[1], head_size=64,
                     dtype=NP_DTYPES[dtype])  # fmt: skip
    check(p, NP_DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["single_pass", "partitioned"])
def test_alibi(rng, dtype, layout, kernel):
    p = make_problem(rng, [1, 17, 300], num_heads=8, num_kv_heads=4, layout=layout, alibi=True, dtype=NP_DTYPES[dtype])
    check(p, NP_DTYPES[dtype], kernel=kernel, partition_size=128 if kernel == "partitioned" else 0)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_caches(rng, kind, dtype, layout):
    p = fp8_problem(rng, [0, 1, 15, 17, 250], kind=kind, dtype=NP_DTYPES[dtype], layout=layout)
    check(p, NP_DTYPES[dtype], kv_cache_dtype=kind, k_scale=0.05, v_scale=0.03)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [8, 32])
def test_fp8_block_sizes_and_odd_head(rng, layout, block_size):
    head = 80 if layout == "vllm" else 72  # vllm fp8 needs a multiple of x = 16
    p = fp8_problem(rng, [9, 100], kind="fp8_e4m3", dtype=NP_DTYPES["bfloat16"], layout=layout, head_size=head,
                    block_size=block_size, alibi=True)  # fmt: skip
    check(p, NP_DTYPES["bfloat16"], kv_cache_dtype="fp8_e4m3", k_scale=0.05, v_scale=0.03, kernel="partitioned",
          partition_size=32)  # fmt: skip


# Every specialised head size with fp8 caches: nhd heads whose D/8 is a multiple of 4 read
# their values with permuted dims (put back in order in the epilogue), the others byte by
# byte; 16 query heads per KV head fill both row halves of the tile, and a partitioned run
# crosses partition boundaries inside a sequence.
@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_every_head_size(rng, head_size, layout):
    for kind, dtype, kernel in (("fp8_e4m3", "bfloat16", "auto"), ("fp8_e5m2", "float16", "partitioned")):
        p = fp8_problem(rng, [1, 15, 17, 300], kind=kind, dtype=NP_DTYPES[dtype], layout=layout, num_heads=32,
                        num_kv_heads=2, head_size=head_size)  # fmt: skip
        check(p, NP_DTYPES[dtype], kv_cache_dtype=kind, k_scale=0.05, v_scale=0.03, kernel=kernel,
              partition_size=64 if kernel == "partitioned" else 0)  # fmt: skip


# fp8 caches with groups of up to 8 run the transposed kernels in CTAs of 8 warps or of 4,
# chosen per call from the grid: a grid that fills every multiprocessor's CTA slots in one
# round, with 1024 tokens or more per CTA, runs the full width. Grids of both kinds (a few
# CTAs, and about 1.5 per multiprocessor, where the full width's 2 per multiprocessor are
# nearly filled) against the float64 reference, single pass and partitioned (a sequence over
# several partitions), both fp8 formats, every layout.
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["single_pass", "partitioned"])
def test_fp8_both_cta_widths(rng, layout, kernel):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    K, B = 2, 16
    longest, ps = (2100, 1024) if kernel == "partitioned" else (1100, 0)
    max_blocks = -(-longest // B) + 2  # make_problem's table width (its 2 padding blocks)
    opts = dict(kernel=kernel, partition_size=ps, kv_cache_dtype="fp8_e4m3")
    nparts = pagedattn.decode_plan(1, 8, K, 128, B, max_blocks, "bfloat16", layout, **opts)["num_partitions"]
    widths = set()
    for S, kind, dtype in ((3, "fp8_e4m3", "bfloat16"), (-(-3 * sms // (2 * K * nparts)), "fp8_e5m2", "float16")):
        lens = rng.integers(1, longest + 1, S)
        lens[0], lens[-1] = longest, 0
        plan = pagedattn.decode_plan(S, 8, K, 128, B, max_blocks, dtype, layout, **dict(opts, kv_cache_dtype=kind))
        assert plan["ctas"] == S * K * nparts
        widths.add(plan["threads_per_cta"])
        p = fp8_problem(rng, lens.tolist(), kind=kind, dtype=NP_DTYPES[dtype], layout=layout, num_kv_heads=K)
        assert p.block_tables.shape[1] == max_blocks
        check(p, NP_DTYPES[dtype], kv_cache_dtype=kind, k_scale=0.05, v_scale=0.03, kernel=kernel, partition_size=ps)
    assert widths == {128, 256}, f"expected both CTA widths, planned {sorted(widths)}"


# bf16 queries over fp8 caches multiply in f16, each query row scaled by a power of two into
# f16's range first: rows of very large, very small and mixed magnitudes (and a zero row) must
# give the float64 reference's answer, both layouts, both fp8 formats.
@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_bf16_query_magnitudes(rng, layout, kind):
    p = fp8_problem(rng, [1, 40, 300], kind=kind, dtype=NP_DTYPES["bfloat16"], layout=layout, num_heads=16,
                    num_kv_heads=2, head_size=128)  # fmt: skip
    q = p.query.astype(np.float32)
    factors = [1e30, 1e-30, 3e4, 1e-3, 2.0**-120, 1e12, 0.0, 7.0]
    for h in range(q.shape[1]):
        q[:, h] *= factors[h % len(factors)]
    q[:, 3, :64] *= 1e6  # one row of mixed magnitudes: half its dims a million times the rest
    p.query = q.astype(p.query.dtype)
    assert np.isfinite(p.query.astype(np.float32)).all()
    check(p, NP_DTYPES["bfloat16"], kv_cache_dtype=kind, k_scale=0.05, v_scale=0.03)


@pytest.mark.parametrize("partition_size", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_partition_boundaries(rng, partition_size, dtype):
    P = partition_size
    lens = [1, P - 1, P, P + 1, 2 * P - 1, 2 * P + 1, 5 * P + 3]
    p = make_problem(rng, lens, num_heads=8, num_kv_heads=2, head_size=64, dtype=NP_DTYPES[dtype])
    check(p, NP_DTYPES[dtype], kernel="partitioned", partition_size=P)


@pytest.mark.parametrize("kernel", pagedattn.supported()["kernels"])
def test_long_context_32k(rng, kernel):
    p = make_problem(rng, [32768, 1000], num_heads=8, num_kv_heads=2, head_size=64, dtype=NP_DTYPES["bfloat16"])
    check(p, NP_DTYPES["bfloat16"], kernel=kernel, cpu=False)


def test_seed_shapes(rng):
    p = make_problem(rng, [196] * 5, num_heads=12, num_kv_heads=12, head_size=64, dtype=np.float16)
    check(p, np.float16)
    p = make_problem(rng, [204], num_heads=56, num_kv_heads=56, head_size=128, dtype=np.float16)
    check(p, np.float16)


def test_explicit_scale(rng):
    p = make_problem(rng, [40, 7], num_heads=4, num_kv_heads=1, dtype=np.float16)
    check(p, np.float16, scale=0.37)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_strided_query_and_out(rng, dtype):
    dt = NP_DTYPES[dtype]
    p = make_problem(rng, [3, 50, 129], num_heads=8, num_kv_heads=2, head_size=64, dtype=dt)
    tdt = to_torch(p.query[:0]).dtype
    big_q = torch.full((3, 16, 64), float("nan"), dtype=tdt, device=DEV)
    big_q[:, ::2] = to_torch(p.query)
    q = big_q[:, ::2]
    big_o = torch.full((3, 8, 2, 64), float("nan"), dtype=tdt, device=DEV)
    o = big_o[:, :, 1]
    assert not q.is_contiguous() and not o.is_contiguous()
    res = pagedattn.paged_attention(q, to_torch(p.key_cache), to_torch(p.value_cache), to_torch(p.block_tables),
                                    to_torch(p.seq_lens), out=o)  # fmt: skip
    assert res is o
    ref = paged_attention_ref(*p.args())
    assert_close(to_numpy(o.contiguous()), ref, dt)
    assert torch.isnan(big_o[:, :, 0]).all(), "the kernel wrote outside the strided output"


def test_cupy_arrays(rng):
    cupy = pytest.importorskip("cupy")
    p = make_problem(rng, [0, 33, 200], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16)
    args = [cupy.asarray(a) for a in p.args()]
    out = pagedattn.paged_attention(*args)
    assert isinstance(out, cupy.ndarray)
    assert_close(cupy.asnumpy(out), paged_attention_ref(*p.args()), np.float16)
    s = cupy.cuda.Stream(non_blocking=True)
    out2 = cupy.empty_like(out)
    pagedattn.paged_attention(*args, out=out2, stream=s, kernel="partitioned", partition_size=64)
    s.synchronize()
    assert_close(cupy.asnumpy(out2), paged_attention_ref(*p.args()), np.float16)


@pytest.mark.parametrize("use_workspace", [True, False])
def test_cuda_graph_replay_with_new_tables(rng, use_workspace):
    S, H, K, D, B, M = 4, 16, 4, 128, 16, 40
    nblocks = S * M + 4
    dt = NP_DTYPES["bfloat16"]
    first = make_problem(rng, [300, 1, 17, 600], num_heads=H, num_kv_heads=K, head_size=D, block_size=B, dtype=dt,
                         num_blocks=nblocks, pad_blocks=M - 38)  # fmt: skip
    assert first.block_tables.shape == (S, M)
    q = to_torch(first.query)
    kc, vc = to_torch(first.key_cache), to_torch(first.value_cache)
    bt, sl = to_torch(first.block_tables), to_torch(first.seq_lens)
    out = torch.empty_like(q)
    ws = None
    if use_workspace:
        size = pagedattn.decode_workspace_size(S, H, K, D, B, M, "bfloat16", kernel="partitioned", partition_size=64)
        assert size > 0
        ws = torch.empty(size, dtype=torch.uint8, device=DEV)
    kw = dict(out=out, kernel="partitioned", partition_size=64, workspace=ws)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream (sizes its pool when no workspace)
        pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)
    for lens in ([5, 640, 0, 33], [640, 640, 640, 640], [1, 2, 3, 4]):
        # new problem in the same buffers: new tables, lengths, queries and cache contents
        p = make_problem(rng, lens, num_heads=H, num_kv_heads=K, head_size=D, block_size=B, dtype=dt,
                         num_blocks=nblocks, pad_blocks=M - max(-(-n // B) for n in lens))  # fmt: skip
        q.copy_(to_torch(p.query))
        kc.copy_(to_torch(p.key_cache))
        vc.copy_(to_torch(p.value_cache))
        bt.copy_(to_torch(p.block_tables))
        sl.copy_(to_torch(p.seq_lens))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(to_numpy(out), paged_attention_ref(*p.args()), dt, f"graph replay {lens}")


def test_cuda_graph_torch_recipe_without_workspace(rng):
    """PyTorch's capture recipe with no workspace=: warm up on a side stream, then capture
    with torch.cuda.graph on its own capture stream (whose scratch pool never saw these
    shapes; the scratch, over the pools' 4 MB minimum, becomes graph-owned memory); replay
    with new tables, lengths and contents; a second graph of the same call replays too,
    and eager calls on the warm-up stream still run."""
    S, H, K, D, B, M = 8, 32, 2, 128, 16, 256
    nblocks = S * M + 4
    dt = NP_DTYPES["bfloat16"]
    first = make_problem(rng, [4096, 1, 17, 600, 2000, 0, 4000, 33], num_heads=H, num_kv_heads=K, head_size=D,
                         block_size=B, dtype=dt, num_blocks=nblocks, pad_blocks=0)  # fmt: skip
    assert first.block_tables.shape == (S, M)
    need = pagedattn.decode_workspace_size(S, H, K, D, B, M, "bfloat16", kernel="partitioned", partition_size=64)
    assert need > 4 << 20
    q = to_torch(first.query)
    kc, vc = to_torch(first.key_cache), to_torch(first.value_cache)
    bt, sl = to_torch(first.block_tables), to_torch(first.seq_lens)
    out = torch.empty_like(q)
    kw = dict(out=out, kernel="partitioned", partition_size=64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_close(to_numpy(out), paged_attention_ref(*first.args()), dt, "warm-up")
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    for g in graphs:
        with torch.cuda.graph(g):
            pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)
    for i, lens in enumerate(([5, 4096, 0, 33, 64, 65, 1000, 4095], [1, 2, 3, 4, 5, 6, 7, 8], [4096] * 8)):
        p = make_problem(rng, lens, num_heads=H, num_kv_heads=K, head_size=D, block_size=B, dtype=dt,
                         num_blocks=nblocks, pad_blocks=M - max(-(-n // B) for n in lens))  # fmt: skip
        for src, dst in zip(p.args(), (q, kc, vc, bt, sl)):
            dst.copy_(to_torch(src))
        out.fill_(float("nan"))
        graphs[i % 2].replay()
        torch.cuda.synchronize()
        assert_close(to_numpy(out), paged_attention_ref(*p.args()), dt, f"graph {i % 2} replay {lens}")
    out.fill_(float("nan"))
    with torch.cuda.stream(side):
        pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)
    side.synchronize()
    assert_close(to_numpy(out), paged_attention_ref(*p.args()), dt, "eager after capture")


def test_prepared_run_on_streams_and_in_a_graph(rng):
    """PreparedDecode.run on its own stream, on a torch stream object, and captured in a
    CUDA graph that is replayed after the lengths change."""
    p = make_problem(rng, [700, 3, 129], num_heads=16, num_kv_heads=4, head_size=128, dtype=np.float16,
                     extra_blocks=8)  # fmt: skip
    q, kc, vc, bt, sl = (to_torch(a) for a in p.args())
    out = torch.full_like(q, float("nan"))
    prep = pagedattn.prepare_decode(q, kc, vc, bt, sl, out=out, kernel="partitioned", partition_size=128)
    assert prep.run() is out
    torch.cuda.synchronize()
    assert_close(to_numpy(out), paged_attention_ref(*p.args()), np.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    out.fill_(float("nan"))
    s.wait_stream(torch.cuda.current_stream())
    assert prep.run(stream=s) is out
    s.synchronize()
    assert_close(to_numpy(out), paged_attention_ref(*p.args()), np.float16)
    with pytest.raises(TypeError, match="stream"):
        prep.run(stream="current")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        prep.run(stream=s)  # the stream fixed when prepared is not the capture stream
    lens = np.array([650, 1, 0], np.int32)  # shorter: only written slots are read
    sl.copy_(torch.from_numpy(lens))
    p.seq_lens[...] = lens
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_close(to_numpy(out), paged_attention_ref(*p.args()), np.float16)


def test_workspace_size_and_errors(rng):
    assert pagedattn.decode_workspace_size(8, 32, 8, 128, 16, 64, "bfloat16", kernel="single_pass") == 0
    n = pagedattn.decode_workspace_size(8, 32, 8, 128, 16, 64, "bfloat16", kernel="partitioned", partition_size=256)
    assert n >= 8 * 32 * 4 * (128 + 2) * 4
    p = make_problem(rng, [300, 200], num_heads=8, num_kv_heads=2, head_size=64, dtype=np.float16)
    args = [to_torch(a) for a in p.args()]
    small = torch.empty(16, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="workspace"):
        pagedattn.paged_attention(*args, kernel="partitioned", partition_size=64, workspace=small)
    with pytest.raises(ValueError, match="partition_size"):
        pagedattn.paged_attention(*args, kernel="partitioned", partition_size=40)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])  # tensor-core and CUDA-core kernels
def test_out_of_range_block_ids(rng, dtype):
    p = make_problem(rng, [40, 70, 33], num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)
    nblocks = p.key_cache.shape[0]
    bad = p.block_tables.copy()
    bad[1, 2] = nblocks + 5  # inside sequence 1's 5 blocks
    args = [to_torch(a) for a in (p.query, p.key_cache, p.value_cache, bad, p.seq_lens)]
    with pytest.raises(IndexError, match=r"block_tables\[1, 2\]"):
        pagedattn.paged_attention(*args, check_block_tables=True)
    out = to_numpy(pagedattn.paged_attention(*args))  # unchecked: never reads outside; NaN marks it
    assert np.isnan(out[1].astype(np.float32)).all()
    ref = paged_attention_ref(*p.args())
    assert_close(out[[0, 2]], ref[[0, 2]], dtype, "other sequences are unaffected")
    bad_len = p.seq_lens.copy()
    bad_len[2] = p.block_tables.shape[1] * 16 + 1
    args = [to_torch(a) for a in (p.query, p.key_cache, p.value_cache, p.block_tables, bad_len)]
    with pytest.raises(IndexError, match=r"seq_lens\[2\]"):
        pagedattn.paged_attention(*args, check_block_tables=True, kernel="partitioned", partition_size=64)
    good = pagedattn.paged_attention(*[to_torch(a) for a in p.args()], check_block_tables=True)
    assert_close(to_numpy(good), ref, dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])  # tensor-core and CUDA-core kernels
@pytest.mark.parametrize("kernel", ["single_pass", "partitioned"])  # single pass, partitioned + reduce
def test_each_error_flag_names_its_entry(rng, dtype, kernel):
    """Each flag of the error record (block id, sequence length) in each kernel and form:
    the error names the entry, its value and the allowed range, and the next checked call
    (which reuses the record) starts clean."""
    p = make_problem(rng, [40, 70, 33], num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)
    nblocks = p.key_cache.shape[0]
    kw = dict(check_block_tables=True, kernel=kernel, partition_size=32 if kernel == "partitioned" else 0)
    bad = p.block_tables.copy()
    bad[2, 1] = -4  # a block id inside sequence 2's 3 blocks
    args = [to_torch(a) for a in (p.query, p.key_cache, p.value_cache, bad, p.seq_lens)]
    with pytest.raises(IndexError, match=rf"block_tables\[2, 1\] = -4 is outside \[0, num_blocks = {nblocks}\)"):
        pagedattn.paged_attention(*args, **kw)
    bad_len = p.seq_lens.copy()
    bad_len[0] = -1
    max_len = p.block_tables.shape[1] * 16
    args = [to_torch(a) for a in (p.query, p.key_cache, p.value_cache, p.block_tables, bad_len)]
    msg = rf"seq_lens\[0\] = -1 is outside \[0, max_blocks_per_seq \* block_size = {max_len}\]"
    with pytest.raises(IndexError, match=msg):
        pagedattn.paged_attention(*args, **kw)
    good = pagedattn.paged_attention(*[to_torch(a) for a in p.args()], **kw)
    assert_close(to_numpy(good), paged_attention_ref(*p.args()), dtype)


def test_checked_calls_on_two_streams_report_their_own_entry(rng):
    """Two threads run checked calls at the same time, each on its own stream with its own
    bad block id: every call must raise, naming its own entry (a record shared by the
    streams could be reset, or written, by the other call between zeroing and read-back)."""
    p = make_problem(rng, [3000, 2500, 4000, 1200], num_heads=16, num_kv_heads=4, head_size=128, dtype=np.float16)
    q, kc, vc, sl = (to_torch(a) for a in (p.query, p.key_cache, p.value_cache, p.seq_lens))
    nblocks = p.key_cache.shape[0]
    entries = {"a": (1, 100, nblocks + 5), "b": (2, 200, -9)}  # (seq, column, bad id) per thread
    tables = {}
    for name, (seq, col, value) in entries.items():
        bt = p.block_tables.copy()
        bt[seq, col] = value  # inside the sequence: its length covers the column
        assert col * 16 < p.seq_lens[seq]
        tables[name] = to_torch(bt)
    streams = {name: torch.cuda.Stream() for name in entries}
    outs = {name: torch.empty_like(q) for name in entries}
    for s in streams.values():
        s.wait_stream(torch.cuda.current_stream())
    barrier = threading.Barrier(len(entries))
    failures = []

    def worker(name):
        seq, col, value = entries[name]
        own = f"block_tables[{seq}, {col}] = {value} "
        barrier.wait()
        for i in range(60):
            try:
                pagedattn.paged_attention(q, kc, vc, tables[name], sl, out=outs[name], check_block_tables=True,
                                          stream=streams[name].cuda_stream)  # fmt: skip
            except IndexError as e:
                if own not in str(e):
                    failures.append(f"{name} call {i}: {e}")
            else:
                failures.append(f"{name} call {i}: no error raised")

    threads = [threading.Thread(target=worker, args=(name,)) for name in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not failures, failures[:5]
    ref = paged_attention_ref(*p.args())
    for name, (seq, _, _) in entries.items():  # the other sequences are still right
        keep = [s for s in range(len(p.seq_lens)) if s != seq]
        assert_close(to_numpy(outs[name])[keep], ref[keep], np.float16, f"stream {name}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("block_size", [8, 16])
def test_padding_entries_never_read(rng, dtype, block_size):
    """Table entries past a sequence's last block may hold anything, even invalid ids."""
    p = make_problem(rng, [17, 3], num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype, pad_blocks=3,
                     block_size=block_size)  # fmt: skip
    bt = p.block_tables.copy()
    bt[0, -(-17 // block_size) :] = -7  # past sequence 0's last block
    bt[1, 1:] = 10**9
    out = pagedattn.paged_attention(to_torch(p.query), to_torch(p.key_cache), to_torch(p.value_cache), to_torch(bt),
                                    to_torch(p.seq_lens), check_block_tables=True)  # fmt: skip
    assert_close(to_numpy(out), paged_attention_ref(*p.args()), dtype)


def test_repeatable(rng):
    """Same inputs, same bits: no race between warps or partitions."""
    p = make_problem(rng, [3000, 50], num_heads=32, num_kv_heads=8, head_size=128, dtype=NP_DTYPES["bfloat16"])
    args = [to_torch(a) for a in p.args()]
    a = pagedattn.paged_attention(*args)
    for _ in range(3):
        assert torch.equal(pagedattn.paged_attention(*args), a)


@pytest.mark.parametrize("heads", [(32, 8), (32, 2), (8, 8), (64, 2)])
def test_partitioned_pool_and_workspace_agree(rng, heads):
    """Partitioned form with the pooled scratch and with a caller's workspace; lengths at
    partition edges, a bad block id, a bad length, shapes alternating on one stream;
    64 / 2 heads has two head tiles per KV head, 31 partitions one sequence."""
    H, K = heads
    P = 64
    shapes = ([0, 1, P - 1, P, P + 1, 3 * P + 5, 7 * P], [9 * P + 1, 2, 2 * P], [31 * P + 3])
    for lens in shapes + shapes:
        p = make_problem(rng, lens, num_heads=H, num_kv_heads=K, head_size=128, dtype=NP_DTYPES["bfloat16"])
        args = [to_torch(a) for a in p.args()]
        ref = paged_attention_ref(*p.args())
        pooled = pagedattn.paged_attention(*args, kernel="partitioned", partition_size=P)
        S, M = p.block_tables.shape
        ws = torch.empty(pagedattn.decode_workspace_size(S, H, K, 128, 16, M, "bfloat16", kernel="partitioned",
                                                          partition_size=P), dtype=torch.uint8, device=DEV)  # fmt: skip
        two = pagedattn.paged_attention(*args, kernel="partitioned", partition_size=P, workspace=ws)
        assert_close(to_numpy(pooled), ref, NP_DTYPES["bfloat16"], f"pooled scratch {lens}")
        assert_close(to_numpy(two), ref, NP_DTYPES["bfloat16"], f"caller workspace {lens}")
    # invalid inputs in the partitioned form: NaN for the affected sequence only
    p = make_problem(rng, [5 * P, 3 * P + 1, 2 * P], num_heads=H, num_kv_heads=K, head_size=128,
                     dtype=NP_DTYPES["bfloat16"])  # fmt: skip
    bt, sl = p.block_tables.copy(), p.seq_lens.copy()
    bt[0, 7] = 10**6
    sl[2] = -3
    args = (to_torch(p.query), to_torch(p.key_cache), to_torch(p.value_cache), to_torch(bt), to_torch(sl))
    out = to_numpy(pagedattn.paged_attention(*args, kernel="partitioned", partition_size=P))
    assert np.isnan(out[0].astype(np.float32)).all() and np.isnan(out[2].astype(np.float32)).all()
    assert_close(out[1:2], paged_attention_ref(*p.args())[1:2], NP_DTYPES["bfloat16"], "unaffected sequence")


def test_automatic_plan_fills_the_gpu():
    """A batch of one with a long context is spread over (about) every multiprocessor;
    a batch that already fills the GPU, and the seeds' short contexts, use no scratch."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def plan(S, H, K, D, ctx, **kw):
        return pagedattn.decode_plan(S, H, K, D, 16, -(-ctx // 16), "bfloat16", **kw)

    for ctx in (4096, 16384, 32768):
        info = plan(1, 32, 8, 128, ctx)
        assert 0.45 * sms <= info["ctas"] <= 4 * sms, (ctx, info, sms)
        assert info["ctas"] == 8 * info["num_partitions"] and info["head_tiles"] == 1
        assert info["num_partitions"] * info["partition_size"] >= ctx
        assert info["reduce_kernel"] and info["workspace_bytes"] >= 32 * info["num_partitions"] * 130 * 4
    big = plan(4 * sms, 32, 8, 128, 4096)
    assert big["num_partitions"] == 1 and big["workspace_bytes"] == 0 and big["ctas"] == 32 * sms
    for S, H, K, D, ctx in ((5, 12, 12, 64, 196), (1, 56, 56, 128, 204)):  # the seeds' shapes
        assert not plan(S, H, K, D, ctx)["reduce_kernel"]
    forced = plan(1, 32, 8, 128, 4096, kernel="partitioned", partition_size=512)
    assert forced["reduce_kernel"] and forced["num_partitions"] == 8 and forced["partition_size"] == 512
    assert plan(1, 32, 8, 128, 4096, kernel="single_pass")["num_partitions"] == 1
    assert plan(1, 32, 8, 128, 4096)["workspace_bytes"] == pagedattn.decode_workspace_size(
        1, 32, 8, 128, 16, 256, "bfloat16")  # fmt: skip


def test_graph_replay_after_the_pool_grows(rng):
    """A graph captured on a stream whose pool already fits the call, replayed after an
    eager call on the same stream grew (freed and replaced) that pool: the graph owns its
    scratch, so the replay is right and memory allocated since is left alone."""
    S, H, K, D, B, M = 4, 32, 2, 128, 16, 128
    dt = NP_DTYPES["bfloat16"]
    p = make_problem(rng, [2048, 1, 700, 2000], num_heads=H, num_kv_heads=K, head_size=D, block_size=B, dtype=dt,
                     num_blocks=S * M + 4, pad_blocks=0)  # fmt: skip
    q, kc, vc, bt, sl = (to_torch(a) for a in p.args())
    out = torch.empty_like(q)
    kw = dict(out=out, kernel="partitioned", partition_size=64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)  # the pool now fits this call
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)
        # A much larger partitioned call on the same stream grows the pool.
        big = make_problem(rng, [8192] * 16, num_heads=H, num_kv_heads=K, head_size=D, block_size=B, dtype=dt)
        big_args = [to_torch(a) for a in big.args()]
        big_out = pagedattn.paged_attention(*big_args, kernel="partitioned", partition_size=16)
        s.synchronize()
        assert_close(to_numpy(big_out), paged_attention_ref(*big.args()), dt, "large eager call")
        canaries = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(64)]  # may reuse freed memory
        out.fill_(float("nan"))
        g.replay()
        s.synchronize()
    assert_close(to_numpy(out), paged_attention_ref(*p.args()), dt, "replay after the pool grew")
    assert all(bool((c == 7.0).all()) for c in canaries), "a replay wrote into memory the pool had freed"
