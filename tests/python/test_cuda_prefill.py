"""Varlen paged attention (chunked prefill, mixed batches) on CUDA.

Every output element is checked against float64 attention (computed with torch in
float64 on the GPU for the long shapes) and against the CPU path; caches hold NaN in
every slot no sequence owns. Covered: dtypes x layouts x block sizes, every head size
(tensor-core and CUDA-core kernels), GQA groups 1..8, q_i = 0, 1, = seq_len and around
tile boundaries, fp8 caches, ALiBi, custom scale, strided query / out, max_query_len
and its absence, the decode route, CUDA-graph replay with new metadata, a 16k-row
chunk over a 16k context, and bad metadata on the device (checked and unchecked).
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import BF16, CUDA_BLOCK_SIZES, CUDA_HEAD_SIZES, LAYOUTS, TOL, assert_close, make_problem, np_dtype
from pagedattn.reference import paged_attention_ref

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

DEV = torch.device("cuda", 0)
from torch_arrays import to_numpy, to_torch  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def varlen(
    rng,
    seq_lens,
    q_lens,
    *,
    dtype="float16",
    layout="vllm",
    num_heads=8,
    num_kv_heads=2,
    head_size=128,
    block_size=16,
    alibi=False,
    kv_cache_dtype="auto",
):
    """A varlen problem: caches (NaN outside used slots) as NumPy arrays, the query
    [T, H, D] and query_start_loc; fp8 caches are written by reshape_and_cache."""
    dt = np_dtype(dtype)
    pb = make_problem(rng, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                      block_size=block_size, dtype=dt, layout=layout, alibi=alibi)  # fmt: skip
    kw = {}
    if kv_cache_dtype != "auto":
        kw = dict(kv_cache_dtype=kv_cache_dtype, k_scale=0.05, v_scale=0.03)
        kshape, vshape = pagedattn.kv_cache_shape(pb.key_cache.shape[0], block_size, num_kv_heads, head_size,
                                                  "uint8", layout)  # fmt: skip
        kc, vc = np.full(kshape, 0x7F, np.uint8), np.full(vshape, 0x7F, np.uint8)  # 0x7f: NaN in both formats
        for i, n in enumerate(pb.seq_lens):
            t = np.arange(int(n))
            slots = pb.block_tables[i, t // block_size].astype(np.int64) * block_size + t % block_size
            k = (rng.standard_normal((int(n), num_kv_heads, head_size)) * 2.0).astype(dt)
            v = (rng.standard_normal((int(n), num_kv_heads, head_size)) * 1.2).astype(dt)
            pagedattn.reshape_and_cache(k, v, kc, vc, slots, **kw)
        pb.key_cache, pb.value_cache = kc, vc
    q_lens = np.asarray(q_lens, np.int64)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), num_heads, head_size)).astype(dt)
    return pb, query, qsl, kw


def run_cuda(pb, query, qsl, **kw):
    """The varlen call on CUDA (torch arrays), returned as NumPy."""
    alibi = kw.pop("alibi", pb.alibi_slopes)
    out = pagedattn.paged_attention(to_torch(query), to_torch(pb.key_cache), to_torch(pb.value_cache),
                                    to_torch(pb.block_tables), to_torch(pb.seq_lens), query_start_loc=to_torch(qsl),
                                    alibi_slopes=None if alibi is None else to_torch(alibi), **kw)  # fmt: skip
    return to_numpy(out)


def check(pb, query, qsl, dtype, kw=None, what="", **call_kw):
    kw = kw or {}
    out = run_cuda(pb, query, qsl, **kw, **call_kw)
    ref = paged_attention_ref(query, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens,
                              alibi_slopes=pb.alibi_slopes, query_start_loc=qsl, scale=call_kw.get("scale"),
                              **kw)  # fmt: skip
    assert_close(out, ref, dtype, what)
    cpu = pagedattn.paged_attention(query, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens,
                                    query_start_loc=qsl, alibi_slopes=pb.alibi_slopes, scale=call_kw.get("scale"),
                                    **kw)  # fmt: skip
    assert_close(out, np.asarray(cpu).astype(np.float64), dtype, what + " (against the CPU path)")
    return out


# Sequence lengths and query rows covering q = 0, 1, = seq_len, tile and block edges.
MIXED = ([1, 37, 64, 65, 200, 129, 17, 300], [1, 37, 0, 65, 64, 1, 16, 129])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", CUDA_BLOCK_SIZES)
def test_mixed_batch(rng, dtype, layout, block_size):
    if np_dtype(dtype) is None:
        pytest.skip("needs ml_dtypes")
    pb, q, qsl, kw = varlen(rng, *MIXED, dtype=dtype, layout=layout, block_size=block_size)
    check(pb, q, qsl, dtype, kw, f"{dtype} {layout} B={block_size}")


@pytest.mark.parametrize("head_size", CUDA_HEAD_SIZES + [72])  # 72: the CUDA-core kernel
@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_sizes(rng, head_size, layout):
    if layout == "vllm" and head_size % 8:
        pytest.skip("vllm layout needs head_size % 8 == 0")
    pb, q, qsl, kw = varlen(rng, [70, 5, 140], [70, 2, 33], head_size=head_size, layout=layout, dtype="float16")
    check(pb, q, qsl, "float16", kw, f"D={head_size}")


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gqa_groups_alibi_scale(rng, group, dtype):
    if np_dtype(dtype) is None:
        pytest.skip("needs ml_dtypes")
    pb, q, qsl, kw = varlen(rng, [90, 33, 257], [45, 33, 100], num_heads=2 * group, num_kv_heads=2, dtype=dtype,
                            alibi=True)  # fmt: skip
    check(pb, q, qsl, dtype, kw, f"G={group}", scale=0.07)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_caches(rng, kind, dtype, layout):
    if np_dtype(dtype) is None:
        pytest.skip("needs ml_dtypes")
    pb, q, qsl, kw = varlen(rng, *MIXED, dtype=dtype, layout=layout, kv_cache_dtype=kind)
    check(pb, q, qsl, dtype, kw, f"{kind} {dtype} {layout}")


def test_every_row_one_equals_decode(rng):
    pb, q, qsl, _ = varlen(rng, [5, 100, 1, 64], [1, 1, 1, 1], dtype="float16")
    args = [to_torch(a) for a in (q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
    dec = to_numpy(pagedattn.paged_attention(*args)).astype(np.float64)
    for mql in (None, 1):  # the varlen kernel, and the decode route (max_query_len=1, T == S)
        var = to_numpy(pagedattn.paged_attention(*args, query_start_loc=to_torch(qsl), max_query_len=mql))
        np.testing.assert_allclose(var.astype(np.float64), dec, atol=2e-3, rtol=2e-3)


def test_max_query_len_bound_and_strided(rng):
    pb, q, qsl, _ = varlen(rng, [300, 40], [150, 40], dtype="bfloat16" if BF16 is not None else "float16")
    dtype = str(q.dtype)
    ref = paged_attention_ref(q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, query_start_loc=qsl)
    # a strided query (every other head of a wider array) and a strided out
    tq = to_torch(q)
    wide = torch.zeros((tq.shape[0], 2 * tq.shape[1], tq.shape[2]), dtype=tq.dtype, device=DEV)
    wide[:, ::2] = tq
    out_wide = torch.full_like(wide, float("nan"))
    args = [to_torch(a) for a in (pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
    for mql in (None, 150, 1000):
        out_wide.fill_(float("nan"))
        pagedattn.paged_attention(wide[:, ::2], *args, query_start_loc=to_torch(qsl), max_query_len=mql,
                                  out=out_wide[:, ::2])  # fmt: skip
        assert_close(to_numpy(out_wide[:, ::2]), ref, dtype, f"max_query_len={mql}")
        assert torch.isnan(out_wide[:, 1::2]).all(), "wrote outside the strided out"


def test_long_chunk_16k(rng):
    """One 16384-row chunk over its 16384-token context (GQA 8/2, d128, bf16 or f16)."""
    dtype = "bfloat16" if BF16 is not None else "float16"
    n, H, K, D, B = 16384, 8, 2, 128, 16
    tdt = TORCH_DTYPES[dtype]
    g = torch.Generator(device=DEV).manual_seed(int(rng.integers(2**31)))
    k = torch.randn((n, K, D), generator=g, device=DEV).to(tdt)
    v = torch.randn((n, K, D), generator=g, device=DEV).to(tdt)
    q = torch.randn((n, H, D), generator=g, device=DEV).to(tdt)
    for layout in LAYOUTS:
        nb = n // B + 4
        kshape, vshape = pagedattn.kv_cache_shape(nb, B, K, D, dtype, layout)
        kc = torch.full(kshape, float("nan"), dtype=tdt, device=DEV)
        vc = torch.full(vshape, float("nan"), dtype=tdt, device=DEV)
        bt = torch.randperm(nb, device=DEV)[: n // B].to(torch.int32).reshape(1, -1)
        t = torch.arange(n, device=DEV)
        slots = bt[0, t // B].to(torch.int64) * B + t % B
        pagedattn.reshape_and_cache(k, v, kc, vc, slots)
        sl = torch.tensor([n], dtype=torch.int32, device=DEV)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        out = pagedattn.paged_attention(q, kc, vc, bt, sl, query_start_loc=qsl, max_query_len=n).to(torch.float64)
        # float64 reference on the GPU, 1024 rows at a time
        kk = k.to(torch.float64).repeat_interleave(H // K, dim=1)  # [n, H, D]
        vv = v.to(torch.float64).repeat_interleave(H // K, dim=1)
        worst = 0.0
        for lo in range(0, n, 1024):
            qq = q[lo : lo + 1024].to(torch.float64)
            s = torch.einsum("rhd,thd->hrt", qq, kk[: lo + 1024]) / D**0.5
            rows = torch.arange(lo, lo + 1024, device=DEV)[:, None]
            s = s.masked_fill(torch.arange(lo + 1024, device=DEV)[None, :] > rows, float("-inf"))
            ref = torch.einsum("hrt,thd->rhd", torch.softmax(s, dim=-1), vv[: lo + 1024])
            assert torch.isfinite(out[lo : lo + 1024]).all()
            worst = max(worst, (out[lo : lo + 1024] - ref).abs().max().item())
        atol, _ = TOL[dtype]
        assert worst <= atol, f"{layout}: max error {worst}"


def test_graph_replay_with_new_metadata(rng):
    """A fixed token budget captured once, replayed with other splits of it."""
    T = 96
    pb, q, qsl, _ = varlen(rng, [120, 60, 200], [40, 40, 16], dtype="float16")
    tq, kc, vc = to_torch(q), to_torch(pb.key_cache), to_torch(pb.value_cache)
    bt, sl, tqsl = to_torch(pb.block_tables), to_torch(pb.seq_lens), to_torch(qsl)
    out = torch.empty_like(tq)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pagedattn.paged_attention(tq, kc, vc, bt, sl, query_start_loc=tqsl, max_query_len=T, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            pagedattn.paged_attention(tq, kc, vc, bt, sl, query_start_loc=tqsl, max_query_len=T, out=out)
    # (every length stays within the blocks the tables hold: the rest of the pool is NaN)
    for q_lens, lens in (([40, 40, 16], [120, 60, 200]), ([1, 58, 37], [5, 60, 150]), ([0, 0, 96], [9, 1, 196])):
        new_qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        new_sl = np.asarray(lens, np.int32)
        new_q = rng.standard_normal(q.shape).astype(q.dtype)
        tqsl.copy_(to_torch(new_qsl))
        sl.copy_(to_torch(new_sl))
        tq.copy_(to_torch(new_q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(new_q, pb.key_cache, pb.value_cache, pb.block_tables, new_sl,
                                  query_start_loc=new_qsl)  # fmt: skip
        assert_close(to_numpy(out), ref, "float16", f"replay {q_lens}")


def test_bad_metadata_on_device(rng):
    pb, q, qsl, _ = varlen(rng, [50, 30], [20, 30], dtype="float16")
    args = [to_torch(a) for a in (q, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens)]
    cases = {
        "query_start_loc": np.array([0, 60, 50], np.int32),  # past T, decreasing
        "query rows": np.array([0, 20, 50], np.int32),  # fine; seq_lens below makes q > seq_len
    }
    bad_sl = pb.seq_lens.copy()
    bad_sl[1] = 10
    for name, bad in cases.items():
        sl = to_torch(bad_sl if name == "query rows" else pb.seq_lens)
        a = [args[0], args[1], args[2], args[3], sl]
        with pytest.raises(ValueError, match="query_start_loc"):
            pagedattn.paged_attention(*a, query_start_loc=to_torch(bad), check_block_tables=True)
        out = pagedattn.paged_attention(*a, query_start_loc=to_torch(bad))  # unchecked: no crash, NaN rows
        torch.cuda.synchronize()
        assert torch.isnan(out).any(), name
    bt = pb.block_tables.copy()
    bt[0, 1] = 10**6
    with pytest.raises(IndexError, match=r"block_tables\[0, 1\]"):
        pagedattn.paged_attention(args[0], args[1], args[2], to_torch(bt), args[4], query_start_loc=to_torch(qsl),
                                  check_block_tables=True)  # fmt: skip
    # a max_query_len smaller than a sequence's rows: recorded, NaN, never out of bounds
    with pytest.raises(ValueError, match="max_query_len"):
        pagedattn.paged_attention(*args, query_start_loc=to_torch(qsl), max_query_len=5, check_block_tables=True)
