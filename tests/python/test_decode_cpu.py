"""paged_attention on the CPU against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import BF16, DTYPES, FP8_KV_CACHE_DTYPES, LAYOUTS, assert_close, dtype_id, make_problem
from pagedattn.reference import paged_attention_ref


def run_and_check(p, dtype, **kw):
    out = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes, **kw)
    ref = paged_attention_ref(*p.args(), alibi_slopes=p.alibi_slopes, scale=kw.get("scale"))
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype)
    assert_close(out, ref, dtype)
    return out


def test_seed_opt_125m(rng):
    """The seeds' OPT-125m run: 12 heads, head size 64, block size 16, five sequences of
    196 tokens whose block tables count down from block 999."""
    seq_lens = [196] * 5
    per_seq = -(-196 // 16)
    tables = (999 - np.arange(5 * per_seq)).reshape(5, per_seq).astype(np.int32)
    p = make_problem(rng, seq_lens, num_heads=12, num_kv_heads=12, head_size=64, block_size=16,
                     dtype=np.float16, block_tables=tables, num_blocks=1000)  # fmt: skip
    run_and_check(p, np.float16)


def test_seed_opt_30b(rng):
    p = make_problem(rng, [204], num_heads=56, num_kv_heads=56, head_size=128, block_size=16, dtype=np.float16)
    run_and_check(p, np.float16)


@pytest.mark.parametrize("heads", [(32, 8), (8, 1), (8, 2), (4, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_query(rng, heads, layout):
    p = make_problem(rng, [1, 33, 100], num_heads=heads[0], num_kv_heads=heads[1], head_size=64, layout=layout)
    run_and_check(p, np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_lengths_around_block_boundaries(rng, dtype, layout, block_size):
    b = block_size
    lens = [0, 1, b - 1, b, b + 1, 2 * b, 3 * b + 5, 517]
    p = make_problem(rng, lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=b, dtype=dtype, layout=layout)
    out = run_and_check(p, dtype)
    assert np.all(out[0] == 0), "a sequence of length 0 must yield zeros"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alibi(rng, layout):
    p = make_problem(rng, [1, 17, 300], num_heads=8, num_kv_heads=4, layout=layout, alibi=True)
    run_and_check(p, np.float32)


def test_alibi_changes_result(rng):
    p = make_problem(rng, [50], num_heads=4, num_kv_heads=4, alibi=True)
    with_alibi = pagedattn.paged_attention(*p.args(), alibi_slopes=p.alibi_slopes)
    without = pagedattn.paged_attention(*p.args())
    assert not np.allclose(with_alibi, without)


def test_long_context(rng):
    p = make_problem(rng, [8191, 4097], num_heads=8, num_kv_heads=2, head_size=128, dtype=np.float16)
    run_and_check(p, np.float16)


def test_explicit_scale(rng):
    p = make_problem(rng, [40, 7], num_heads=4, num_kv_heads=1)
    run_and_check(p, np.float32, scale=0.37)


@pytest.mark.parametrize("head_size", [8, 16, 40, 72, 80, 96, 112, 192, 256])
def test_head_sizes_vllm(rng, head_size):
    p = make_problem(rng, [3, 70], num_heads=4, num_kv_heads=2, head_size=head_size, dtype=np.float16)
    run_and_check(p, np.float16)


@pytest.mark.parametrize("head_size,block_size", [(1, 1), (3, 5), (17, 7), (100, 64), (33, 128)])
def test_any_head_and_block_size_nhd(rng, head_size, block_size):
    p = make_problem(rng, [1, block_size, 2 * block_size + 1], num_heads=6, num_kv_heads=3, head_size=head_size,
                     block_size=block_size, layout="nhd")  # fmt: skip
    run_and_check(p, np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_query_and_out(rng, layout):
    """query as the Q part of a fused QKV tensor, output into a strided view."""
    h, kh, d = 8, 2, 64
    p = make_problem(rng, [5, 60, 31], num_heads=h, num_kv_heads=kh, head_size=d, layout=layout)
    qkv = rng.standard_normal((3, h + 2 * kh, d)).astype(np.float32)
    query = qkv[:, :h, :]
    assert not query.flags.c_contiguous
    big_out = np.full((3, h, 2 * d), np.nan, dtype=np.float32)
    out_view = big_out[:, :, :d]
    res = pagedattn.paged_attention(query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, out=out_view)
    assert res is out_view
    ref = paged_attention_ref(query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens)
    assert_close(out_view, ref, np.float32)
    assert np.isnan(big_out[:, :, d:]).all(), "wrote outside the out view"


def test_out_is_returned_and_filled(rng):
    p = make_problem(rng, [9, 12], dtype=np.float16)
    out = np.full(p.query.shape, np.nan, dtype=np.float16)
    res = pagedattn.paged_attention(*p.args(), out=out)
    assert res is out
    assert_close(out, paged_attention_ref(*p.args()), np.float16)


def test_empty_batch(rng):
    p = make_problem(rng, [5])
    q = p.query[:0]
    out = pagedattn.paged_attention(q, p.key_cache, p.value_cache, p.block_tables[:0], p.seq_lens[:0])
    assert out.shape == (0, 4, 64)


def test_padding_entries_are_never_read(rng):
    """Padding entries of the block table may hold any value, even out of range."""
    p = make_problem(rng, [16, 20], block_size=16)
    p.block_tables[0, 1:] = -7
    p.block_tables[1, 2:] = 10**6
    run_and_check(p, np.float32)


def test_read_only_inputs(rng):
    p = make_problem(rng, [33, 3])
    for a in p.args():
        a.flags.writeable = False
    run_and_check(p, np.float32)


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes not installed")
def test_bfloat16_output_dtype(rng):
    p = make_problem(rng, [19], dtype=BF16)
    out = pagedattn.paged_attention(*p.args())
    assert out.dtype == BF16


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=dtype_id)
def test_fp8_cache_decode(rng, kind, layout, dtype):
    """fp8 caches written by reshape_and_cache and read by decode, with scales."""
    b, kh, h, d = 16, 2, 8, 64
    lens = np.array([1, 15, 16, 17, 90], dtype=np.int32)
    need = -(-lens // b)
    num_blocks = int(need.sum()) + 2
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, b, kh, d, "fp8_e4m3", layout)
    # 0x7f is NaN in both fp8 formats: poison every slot first.
    key_cache = np.full(kshape, 0x7F, dtype=np.uint8)
    value_cache = np.full(vshape, 0x7F, dtype=np.uint8)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(lens), int(need.max()) + 1), perm[-1], dtype=np.int32)
    pos, slots = 0, []
    for i, n in enumerate(need):
        tables[i, :n] = perm[pos : pos + n]
        pos += n
        t = np.arange(lens[i])
        slots.append(tables[i, t // b].astype(np.int64) * b + t % b)
    slots = np.concatenate(slots)
    k_scale, v_scale = 0.05, 0.02
    key = (rng.standard_normal((len(slots), kh, d)) * 3).astype(dtype)
    value = rng.standard_normal((len(slots), kh, d)).astype(dtype)
    pagedattn.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_cache_dtype=kind,
                                k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    query = rng.standard_normal((len(lens), h, d)).astype(dtype)
    out = pagedattn.paged_attention(query, key_cache, value_cache, tables, lens, kv_cache_dtype=kind,
                                    k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    # Reference over the dequantised cache contents: checks the decode path exactly.
    ref = paged_attention_ref(query, key_cache, value_cache, tables, lens, kv_cache_dtype=kind,
                              k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert_close(out, ref, dtype)
    # And against the unquantised keys/values: the fp8 error stays within a pinned bound.
    exact = np.zeros_like(ref)
    for i in range(len(lens)):
        sel = np.arange(int(lens[:i].sum()), int(lens[: i + 1].sum()))
        exact[i] = pagedattn.reference.dense_attention(query[i], key[sel].astype(np.float64),
                                                       value[sel].astype(np.float64), 1 / np.sqrt(d))
    rel = np.linalg.norm(out.astype(np.float64) - exact) / np.linalg.norm(exact)
    assert rel < (0.06 if kind == "fp8_e4m3" else 0.12), rel


def test_prepared_decode_reruns_with_new_contents(rng):
    """Validate once, change query / block tables / lengths in place, run again."""
    p = make_problem(rng, [40, 17, 3], num_heads=8, num_kv_heads=2, dtype=np.float16, extra_blocks=6)
    prepared = pagedattn.prepare_decode(*p.args())
    out = prepared.run()
    assert out is prepared.out
    assert_close(out, paged_attention_ref(*p.args()), np.float16)
    p.query[...] = rng.standard_normal(p.query.shape).astype(np.float16)
    p.seq_lens[...] = [2, 11, 0]  # shorter than written, so only filled slots are read
    assert_close(prepared(), paged_attention_ref(*p.args()), np.float16)
    # A block id that became invalid is still caught on the host.
    p.block_tables[1, 0] = 10**6
    with pytest.raises(IndexError, match=r"block_tables\[1, 0\]"):
        prepared.run()


def test_prepared_decode_stream_argument(rng):
    """run(stream=...) takes an int handle (0 on the CPU) or a stream object; anything else
    is a TypeError naming the argument, raised before any work."""
    p = make_problem(rng, [20, 5], num_heads=4, num_kv_heads=2, dtype=np.float32)
    prepared = pagedattn.prepare_decode(*p.args())
    ref = paged_attention_ref(*p.args())
    for stream in (None, 0, np.int64(0)):
        prepared.out[...] = np.nan
        assert prepared.run(stream) is prepared.out
        assert_close(prepared.out, ref, np.float32)

    class Proto:  # the __cuda_stream__ protocol: (version, handle)
        def __cuda_stream__(self):
            return (0, 0)

    prepared.out[...] = np.nan
    assert prepared.run(stream=Proto()) is prepared.out
    assert_close(prepared.out, ref, np.float32)
    prepared.out[...] = np.nan
    for bad in ("default", 1.5, -1):
        with pytest.raises(TypeError, match="stream"):
            prepared.run(stream=bad)
    assert np.isnan(prepared.out).all()  # nothing ran


def test_prepared_decode_validates_at_prepare_time(rng):
    p = make_problem(rng, [4])
    with pytest.raises(TypeError, match="seq_lens: expected dtype int32"):
        pagedattn.prepare_decode(p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens.astype(np.int64))


@pytest.mark.parametrize("varlen", [False, True])
def test_float16_outputs_round_to_nearest_even(rng, varlen):
    """Every float16 output is its float32 value rounded to nearest, ties to even (the
    vectorised conversion of the output rows): with a zero query both of a sequence's two
    keys weigh 1/2, so each output is (v1 + v2) / 2 exactly in float32, half of them ties
    between two float16 values. The value pairs cover every finite float16 bit pattern as
    v1 (subnormals, the largest values, both signs); a NaN value gives NaN."""
    S, K, D, B = 64, 8, 128, 16
    finite = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = finite[np.isfinite(finite)]
    v1 = np.resize(rng.permutation(finite), S * K * D)
    v1[: D // 2] = np.nan  # a NaN in the first sequence's first row
    step = rng.integers(-1, 2, v1.shape).astype(np.int32)  # a neighbour (or itself): ties both ways
    v2 = ((v1.view(np.uint16).astype(np.int32) + step) & 0xFFFF).astype(np.uint16).view(np.float16)
    v2[~np.isfinite(v2)] = v1[~np.isfinite(v2)]
    kshape, vshape = pagedattn.kv_cache_shape(S, B, K, D, np.float16, "nhd")
    kc = np.full(kshape, np.nan, np.float16)
    vc = np.full(vshape, np.nan, np.float16)
    kc[:, :2] = rng.standard_normal((S, 2, K, D)).astype(np.float16)
    vc[:, 0] = v1.reshape(S, K, D)
    vc[:, 1] = v2.reshape(S, K, D)
    query = np.zeros((S, K, D), np.float16)
    tables = np.arange(S, dtype=np.int32)[:, None]
    lens = np.full(S, 2, np.int32)
    kw = {"query_start_loc": np.arange(S + 1, dtype=np.int32), "max_query_len": 1} if varlen else {}
    out = pagedattn.paged_attention(query, kc, vc, tables, lens, **kw)
    want = ((v1.astype(np.float32) + v2.astype(np.float32)) / np.float32(2)).astype(np.float16).reshape(S, K, D)
    nan = np.isnan(want)
    assert nan.sum() == D // 2 and np.isnan(out[nan]).all()
    # bit for bit, but for the sign of a zero (the sums start from +0, so -0 + -0 gives +0)
    np.testing.assert_array_equal(np.where(want == 0, 0, out).view(np.uint16)[~nan],
                                  np.where(want == 0, 0, want).view(np.uint16)[~nan])  # fmt: skip
    assert (out[want == 0] == 0).all()
