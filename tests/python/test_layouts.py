"""Cache layouts and block-strided caches on the CPU, in every op.

- "hnd" ([N, K, B, D]) beside "vllm" and "nhd": kv_cache_shape, reshape_and_cache,
  decode, varlen, copy_blocks, swap_blocks, fp8 caches, against the float64 reference.
- Caches that are views: the key and value halves of one per-layer allocation
  [N, 2, ...] (interleaved per block) or [2, N, ...], and blocks padded apart. The whole
  allocation starts NaN, so a read of the other half or of a padding element shows, and
  after a write every element outside the written slots is checked to be untouched.
- The layout rule (a rank-4 cache without layout= is "nhd"; an "hnd" cache must be
  named) and the refusals of bad strides, which name the strides and what is allowed.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import pagedattn
from conftest import ALL_LAYOUTS, FP8_KV_CACHE_DTYPES, assert_close, np_dtype
from pagedattn.reference import paged_attention_ref, reshape_and_cache_ref

# How a pair of caches is stored: separate contiguous arrays, the halves of one
# [N, 2, ...] allocation (key and value blocks interleaved), the halves of [2, N, ...],
# or separate arrays whose blocks are padded apart (a block stride > one block).
STORAGES = ["contiguous", "n2", "2n", "padded"]
NAN_FP8 = 0x7F  # NaN in both fp8 formats


def cache_pair(num_blocks, block_size, kh, d, dtype, layout, storage, fill):
    """(key_cache, value_cache, backing arrays) of `layout`, stored as `storage`; every
    element of the backing arrays starts as `fill`."""
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, block_size, kh, d, dtype, layout)
    elems = int(np.prod(kshape[1:]))
    assert elems == int(np.prod(vshape[1:]))
    dtype = np.dtype(dtype)
    if storage == "contiguous":
        k, v = np.full(kshape, fill, dtype), np.full(vshape, fill, dtype)
        return k, v, [k, v]
    if storage == "n2":
        buf = np.full((num_blocks, 2, elems), fill, dtype)
        k, v = buf[:, 0].reshape(kshape), buf[:, 1].reshape(vshape)
        backing = [buf]
    elif storage == "2n":
        buf = np.full((2, num_blocks, elems), fill, dtype)
        k, v = buf[0].reshape(kshape), buf[1].reshape(vshape)
        backing = [buf]
    else:  # padded: 32 elements (a multiple of 16 bytes for every dtype) between blocks
        kb = np.full((num_blocks, elems + 32), fill, dtype)
        vb = np.full((num_blocks, elems + 64), fill, dtype)
        k, v = kb[:, :elems].reshape(kshape), vb[:, :elems].reshape(vshape)
        backing = [kb, vb]
    assert all(np.shares_memory(a, b) for a, b in ((k, backing[0]), (v, backing[-1]))), "not views"
    if num_blocks > 1 and storage != "2n":
        assert k.strides[0] > int(np.prod(kshape[1:])) * dtype.itemsize, "the view must be block-strided"
    return k, v, backing


def problem(rng, lens, *, layout, storage, dtype=np.float32, kh=2, group=2, d=32, block_size=4, kind="auto",
            q_lens=None):  # fmt: skip
    """Caches of `layout` / `storage` holding the used slots (written by the reference, or
    by the float64-checked CPU reshape_and_cache for fp8), a query and the index arrays."""
    dtype = np.dtype(dtype)
    lens = np.asarray(lens, np.int32)
    need = -(-lens // block_size)
    num_blocks = int(need.sum()) + 3
    fp8 = kind != "auto"
    cache_dt = np.uint8 if fp8 else dtype
    kc, vc, backing = cache_pair(num_blocks, block_size, kh, d, cache_dt, layout, storage, NAN_FP8 if fp8 else np.nan)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(lens), int(need.max(initial=0)) + 1), perm[-1], np.int32)  # padding: a NaN block
    slots, pos = [], 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[pos : pos + n]
        pos += n
        t = np.arange(lens[i])
        slots.append(tables[i, t // block_size].astype(np.int64) * block_size + t % block_size)
    slots = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    key = rng.standard_normal((len(slots), kh, d)).astype(dtype)
    value = rng.standard_normal((len(slots), kh, d)).astype(dtype)
    kw = dict(layout=layout)
    if fp8:
        kw.update(kv_cache_dtype=kind, k_scale=0.05, v_scale=0.03)
        pagedattn.reshape_and_cache(key * 3, value, kc, vc, slots, **kw)
    else:
        reshape_and_cache_ref(key, value, kc, vc, slots, layout=layout)
    rows = len(lens) if q_lens is None else int(np.sum(q_lens))
    query = rng.standard_normal((rows, kh * group, d)).astype(dtype)
    return query, kc, vc, tables, lens, kw, backing


def check_attention(query, kc, vc, tables, lens, kw, dtype, **extra):
    out = pagedattn.paged_attention(query, kc, vc, tables, lens, **kw, **extra)
    ref = paged_attention_ref(query, kc, vc, tables, lens, **kw, **extra)
    assert_close(out, ref, dtype)
    return out


# ---- kv_cache_shape ---------------------------------------------------------------------


def test_kv_cache_shape_hnd():
    assert pagedattn.kv_cache_shape(7, 16, 4, 80, "float16", "hnd") == ((7, 4, 16, 80), (7, 4, 16, 80))
    assert pagedattn.kv_cache_shape(7, 16, 4, 80, "float16", layout="nhd") == ((7, 16, 4, 80), (7, 16, 4, 80))
    assert "hnd" in pagedattn.supported()["layouts"]


# ---- hnd in every op --------------------------------------------------------------------


DTYPES = [d for d in ("float32", "float16", "bfloat16") if np_dtype(d) is not None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
def test_hnd_decode_matches_reference(rng, dtype, block_size):
    dt = np_dtype(dtype)
    lens = [0, 1, block_size - 1, block_size, block_size + 1, 5 * block_size + 2]
    lens = [n for n in lens if n >= 0]
    q, kc, vc, bt, sl, kw, _ = problem(rng, lens, layout="hnd", storage="contiguous", dtype=dt, d=64,
                                       block_size=block_size)  # fmt: skip
    out = check_attention(q, kc, vc, bt, sl, kw, dt)
    assert np.all(np.asarray(out)[0].astype(np.float64) == 0), "length 0 gives zeros"


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_hnd_decode_gqa_groups_and_odd_head_size(rng, group):
    q, kc, vc, bt, sl, kw, _ = problem(rng, [9, 30], layout="hnd", storage="contiguous", group=group, d=20,
                                       kh=3)  # fmt: skip
    check_attention(q, kc, vc, bt, sl, kw, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hnd_varlen_matches_reference(rng, dtype):
    dt = np_dtype(dtype)
    lens, q_lens = [5, 40, 1, 17], [5, 13, 1, 0]
    q, kc, vc, bt, sl, kw, _ = problem(rng, lens, layout="hnd", storage="contiguous", dtype=dt, d=64, q_lens=q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    check_attention(q, kc, vc, bt, sl, kw, dt, query_start_loc=qsl)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
def test_hnd_fp8_caches(rng, kind):
    q, kc, vc, bt, sl, kw, _ = problem(rng, [7, 33], layout="hnd", storage="contiguous", kind=kind, d=32)
    check_attention(q, kc, vc, bt, sl, kw, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hnd_reshape_and_cache_equals_reference(rng, dtype):
    dt = np_dtype(dtype)
    kc, vc, _ = cache_pair(6, 4, 3, 24, dt, "hnd", "contiguous", np.nan)
    kr, vr = kc.copy(), vc.copy()
    slots = np.array([0, 5, -1, 23, 9, 10], np.int64)
    key = rng.standard_normal((6, 3, 24)).astype(dt)
    value = rng.standard_normal((6, 3, 24)).astype(dt)
    pagedattn.reshape_and_cache(key, value, kc, vc, slots, layout="hnd")
    reshape_and_cache_ref(key, value, kr, vr, slots, layout="hnd")
    assert np.array_equal(kc, kr, equal_nan=True) and np.array_equal(vc, vr, equal_nan=True)
    assert np.array_equal(kc[5 // 4, :, 5 % 4], key[1]), "slot 5 is block 1, offset 1, every head"


# ---- block-strided caches (views) in every op and layout ---------------------------------


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_caches_decode_and_varlen(rng, layout, storage):
    lens, q_lens = [1, 4, 3, 13], [1, 3, 0, 6]
    q, kc, vc, bt, sl, kw, _ = problem(rng, lens, layout=layout, storage=storage, d=16)
    out = check_attention(q[: len(lens)], kc, vc, bt, sl, kw, np.float32)
    # The same problem in contiguous caches gives the same numbers, bit for bit.
    out_c = pagedattn.paged_attention(q[: len(lens)], np.ascontiguousarray(kc), np.ascontiguousarray(vc), bt, sl, **kw)
    assert np.array_equal(out, out_c)
    qv, kc2, vc2, bt2, sl2, kw2, _ = problem(rng, lens, layout=layout, storage=storage, d=16, q_lens=q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    check_attention(qv, kc2, vc2, bt2, sl2, kw2, np.float32, query_start_loc=qsl)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("storage", ["n2", "2n"])
def test_strided_caches_every_dtype(rng, dtype, storage):
    dt = np_dtype(dtype)
    for layout in ALL_LAYOUTS:
        q, kc, vc, bt, sl, kw, _ = problem(rng, [2, 11], layout=layout, storage=storage, dtype=dt, d=32, block_size=8)
        check_attention(q, kc, vc, bt, sl, kw, dt)


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_fp8_caches_write_and_read(rng, layout, kind):
    """fp8 writes into the halves of one [N, 2, ...] allocation store the bytes a contiguous
    cache gets, touch nothing else, and decode to the contiguous caches' numbers."""
    lens = [6, 19]
    seed = int(rng.integers(2**31))
    q, kc, vc, bt, sl, kw, backing = problem(np.random.default_rng(seed), lens, layout=layout, storage="n2", kind=kind)
    q2, kc2, vc2, *_ = problem(np.random.default_rng(seed), lens, layout=layout, storage="contiguous", kind=kind)
    assert np.array_equal(kc, kc2) and np.array_equal(vc, vc2)
    written = np.zeros(backing[0].shape, bool)
    written[:, 0] = (kc != NAN_FP8).reshape(kc.shape[0], -1)
    written[:, 1] = (vc != NAN_FP8).reshape(vc.shape[0], -1)
    assert np.all(backing[0][~written] == NAN_FP8)
    out = pagedattn.paged_attention(q, kc, vc, bt, sl, **kw)
    assert np.array_equal(out, pagedattn.paged_attention(q, kc2, vc2, bt, sl, **kw))
    check_attention(q, kc, vc, bt, sl, kw, np.float32)


@pytest.mark.parametrize("storage", ["n2", "2n", "padded"])
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_reshape_and_cache_writes_only_its_slots(rng, layout, storage):
    kc, vc, backing = cache_pair(5, 4, 2, 16, np.float16, layout, storage, np.nan)
    ref_k, ref_v = kc.copy(), vc.copy()
    slots = np.array([3, 0, -1, 19, 8], np.int32)
    key = rng.standard_normal((5, 2, 16)).astype(np.float16)
    value = rng.standard_normal((5, 2, 16)).astype(np.float16)
    before = [b.copy() for b in backing]
    pagedattn.reshape_and_cache(key, value, kc, vc, slots, layout=layout)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots, layout=layout)
    assert np.array_equal(kc, ref_k, equal_nan=True) and np.array_equal(vc, ref_v, equal_nan=True)
    # Nothing outside the views' slots changed: padding and the other half stay NaN.
    changed = sum(int(np.sum(~np.isnan(b))) - int(np.sum(~np.isnan(b0))) for b, b0 in zip(backing, before))
    assert changed == 2 * 4 * 2 * 16, "exactly the 4 real slots of key and value, every head and dim"


@pytest.mark.parametrize("storage", ["n2", "2n", "padded"])
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_copy_blocks(rng, layout, storage):
    kc, vc, backing = cache_pair(6, 4, 2, 16, np.float32, layout, storage, np.nan)
    kc[...] = rng.standard_normal(kc.shape)
    vc[...] = rng.standard_normal(vc.shape)
    before = [b.copy() for b in backing]
    want_k, want_v = kc.copy(), vc.copy()
    pairs = [(0, 3), (5, 1), (2, 2)]
    for s, d in pairs:
        want_k[d], want_v[d] = want_k[s], want_v[s]
    pagedattn.copy_blocks([kc], [vc], pairs)
    assert np.array_equal(kc, want_k) and np.array_equal(vc, want_v)
    # Padding (NaN) stays as it was: it is neither read into a block nor written.
    for b, b0 in zip(backing, before):
        assert np.array_equal(np.isnan(b), np.isnan(b0))


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_strided_swap_blocks(rng, layout):
    src, src_v, src_back = cache_pair(5, 4, 2, 8, np.float32, layout, "n2", np.nan)
    src[...] = rng.standard_normal(src.shape)
    dst, _, dst_back = cache_pair(7, 4, 2, 8, np.float32, layout, "padded", np.nan)
    pagedattn.swap_blocks(src, dst, [(0, 6), (4, 0), (2, 3)])
    for s, d in [(0, 6), (4, 0), (2, 3)]:
        assert np.array_equal(dst[d], src[s])
    assert np.isnan(dst[[1, 2, 4, 5]]).all()
    assert np.isnan(src_v).all(), "the value half of src is never read into dst, nor written"
    # strided -> contiguous and back gives the blocks unchanged
    flat = np.zeros((5,) + src.shape[1:], np.float32)
    pagedattn.swap_blocks(src, flat, [(i, i) for i in range(5)])
    assert np.array_equal(flat, src)


# ---- the layout rule and its errors ---------------------------------------------------------


def test_rank4_without_layout_keeps_meaning_nhd(rng):
    # dims 1 and 2 (16 and 2) both divide num_heads 16, so both readings fit: nhd is taken.
    q, kc, vc, bt, sl, kw, _ = problem(rng, [9, 20], layout="nhd", storage="contiguous", kh=2, group=8,
                                       block_size=16)  # fmt: skip
    out = pagedattn.paged_attention(q, kc, vc, bt, sl)
    assert np.array_equal(out, pagedattn.paged_attention(q, kc, vc, bt, sl, layout="nhd"))
    assert_close(out, paged_attention_ref(q, kc, vc, bt, sl), np.float32)


def test_hnd_cache_without_layout_is_refused_when_nhd_cannot_fit(rng):
    # hnd [N, K=2, B=3, D]: read as nhd, num_kv_heads would be 3, which does not divide 4 heads.
    q, kc, vc, bt, sl, kw, _ = problem(rng, [4, 5], layout="hnd", storage="contiguous", kh=2, group=2, block_size=3)
    with pytest.raises(ValueError, match=r'read as layout "nhd".*does not divide num_heads 4.*layout="hnd"'):
        pagedattn.paged_attention(q, kc, vc, bt, sl)
    with pytest.raises(ValueError, match=r"does not match the new keys' num_kv_heads 2.*layout=\"hnd\""):
        pagedattn.reshape_and_cache(np.zeros((1, 2, 32), np.float32), np.zeros((1, 2, 32), np.float32), kc, vc,
                                    np.zeros(1, np.int32))  # fmt: skip
    check_attention(q, kc, vc, bt, sl, kw, np.float32)  # named, it works


def test_layout_must_match_the_rank(rng):
    q, kc, vc, bt, sl, kw, _ = problem(rng, [3], layout="vllm", storage="contiguous")
    with pytest.raises(ValueError, match=r'key_cache: layout "hnd" expects 4 dimensions.*got 5'):
        pagedattn.paged_attention(q, kc, vc, bt, sl, layout="hnd")
    q, kc, vc, bt, sl, kw, _ = problem(rng, [3], layout="nhd", storage="contiguous")
    with pytest.raises(ValueError, match=r'key_cache: layout "vllm" expects 5 dimensions.*got 4'):
        pagedattn.paged_attention(q, kc, vc, bt, sl, layout="vllm")
    with pytest.raises(ValueError, match=r'layout: got "NHD", expected "vllm", "nhd" or "hnd"'):
        pagedattn.paged_attention(q, kc, vc, bt, sl, layout="NHD")
    with pytest.raises(TypeError, match="layout: expected a str"):
        pagedattn.reshape_and_cache(q[:, :2], q[:, :2], kc, vc, np.zeros(1, np.int32), layout=4)


def test_non_contiguous_blocks_are_refused_naming_the_strides(rng):
    kc, vc, _ = cache_pair(4, 4, 2, 8, np.float32, "nhd", "contiguous", 0.0)
    bad = np.transpose(kc, (0, 2, 1, 3))  # an hnd-shaped view of nhd memory: blocks not C-contiguous
    q = np.zeros((1, 4, 8), np.float32)
    bt, sl = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    msg = re.escape("key_cache: shape [4, 2, 4, 8] with strides [64, 8, 16, 1] (in elements) is not supported; "
                    "each block (dimensions 1..) must be C-contiguous and blocks must not overlap: strides "
                    "[s, 32, 8, 1] with a block stride s >= 64")  # fmt: skip
    with pytest.raises(ValueError, match=msg):
        pagedattn.paged_attention(q, bad, np.ascontiguousarray(bad), bt, sl, layout="hnd")
    with pytest.raises(ValueError, match=r"caches\[0\]: shape \[4, 2, 4, 8\] with strides \[64, 8, 16, 1\]"):
        pagedattn.copy_blocks([bad], [], [(0, 1)])
    with pytest.raises(ValueError, match=r"src: shape \[4, 2, 4, 8\] with strides \[64, 8, 16, 1\]"):
        pagedattn.swap_blocks(bad, np.zeros_like(vc), [(0, 1)])


def test_overlapping_blocks_are_refused(rng):
    buf = np.zeros(4 * 64, np.float32)
    # blocks of 64 elements only 32 apart: each block overlaps the next
    overlapping = np.lib.stride_tricks.as_strided(buf, (4, 4, 2, 8), (32 * 4, 64, 32, 4))
    with pytest.raises(ValueError, match=r"strides \[32, 16, 8, 1\].*block stride s >= 64"):
        pagedattn.copy_blocks([overlapping], [], [(0, 1)])
    kc, vc, _ = cache_pair(4, 4, 2, 8, np.float32, "nhd", "contiguous", 0.0)
    with pytest.raises(ValueError, match=r"key_cache: .*strides \[32, 16, 8, 1\]"):
        pagedattn.reshape_and_cache(np.zeros((1, 2, 8), np.float32), np.zeros((1, 2, 8), np.float32), overlapping,
                                    vc, np.zeros(1, np.int32))  # fmt: skip


def test_key_and_value_blocks_sharing_memory_are_refused():
    buf = np.zeros((5, 2, 64), np.float32)
    kc = buf[:, 0].reshape(5, 4, 2, 8)
    # value shifted by half a block: value block n overlaps key block n
    vc = np.lib.stride_tricks.as_strided(buf.reshape(-1)[32:], (5, 4, 2, 8), kc.strides)
    key = np.ones((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"value_cache overlaps key_cache in memory: a block of one shares bytes"):
        pagedattn.reshape_and_cache(key, key, kc, vc, np.zeros(1, np.int32))
    assert not buf.any(), "a refused call wrote"
    # the interleaved halves themselves are separate memory
    pagedattn.reshape_and_cache(key, 2 * key, kc, buf[:, 1].reshape(5, 4, 2, 8), np.zeros(1, np.int32))
    assert np.array_equal(buf[0, 0, :8], np.ones(8)) and np.array_equal(buf[0, 1, :8], 2 * np.ones(8))
