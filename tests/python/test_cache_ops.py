"""copy_blocks / swap_blocks on host arrays (run everywhere, no GPU needed), and the
validation of their arguments."""

from __future__ import annotations

import re

import numpy as np
import pytest

import pagedattn
from conftest import BF16, LAYOUTS


def layer_caches(rng, layers, num_blocks=10, dtype=np.float32, layout="vllm"):
    keys, values = [], []
    for _ in range(layers):
        kshape, vshape = pagedattn.kv_cache_shape(num_blocks, 16, 2, 64, dtype, layout)
        keys.append(rng.standard_normal(kshape).astype(dtype))
        values.append(rng.standard_normal(vshape).astype(dtype))
    return keys, values


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mapping_dtype", [np.int64, np.int32])
def test_copy_blocks_all_layers(rng, layout, mapping_dtype):
    keys, values = layer_caches(rng, 3, layout=layout)
    before_k = [k.copy() for k in keys]
    before_v = [v.copy() for v in values]
    pairs = np.array([[0, 5], [2, 7], [9, 1]], dtype=mapping_dtype)
    pagedattn.copy_blocks(keys, values, pairs)
    for k, v, k0, v0 in zip(keys, values, before_k, before_v):
        expect_k, expect_v = k0.copy(), v0.copy()
        for s, d in pairs:
            expect_k[d] = k0[s]
            expect_v[d] = v0[s]
        assert np.array_equal(k, expect_k) and np.array_equal(v, expect_v)


def test_copy_blocks_list_of_pairs_and_bf16(rng):
    if BF16 is None:
        pytest.skip("needs ml_dtypes")
    keys, values = layer_caches(rng, 1, dtype=BF16)
    k0 = keys[0].copy()
    pagedattn.copy_blocks(keys, values, [(3, 4)])
    assert np.array_equal(keys[0][4].view(np.uint16), k0[3].view(np.uint16))
    assert np.array_equal(keys[0][:4].view(np.uint16), k0[:4].view(np.uint16))


def test_copy_blocks_empty_mapping(rng):
    keys, values = layer_caches(rng, 2)
    k0 = keys[0].copy()
    pagedattn.copy_blocks(keys, values, [])
    assert np.array_equal(keys[0], k0)


def test_copy_blocks_errors(rng):
    keys, values = layer_caches(rng, 2)
    with pytest.raises(IndexError, match=r"block_mapping\[1, 1\] = 10"):
        pagedattn.copy_blocks(keys, values, [(0, 1), (2, 10)])
    with pytest.raises(IndexError, match=r"block_mapping\[0, 0\] = -1"):
        pagedattn.copy_blocks(keys, values, [(-1, 1)])
    with pytest.raises(ValueError, match=r"\[num_pairs, 2\]"):
        pagedattn.copy_blocks(keys, values, np.zeros((2, 3), np.int64))
    with pytest.raises(TypeError, match="int64 or int32"):
        pagedattn.copy_blocks(keys, values, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        pagedattn.copy_blocks([keys[0][:, :, ::2]], [], [(0, 1)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_blocks_single_arrays_are_one_layer(rng, layout):
    """copy_blocks(key_cache, value_cache, pairs) with bare arrays copies whole blocks of
    those two caches; an array is never taken for a list of per-layer caches."""
    (k,), (v,) = layer_caches(rng, 1, layout=layout)
    k0, v0 = k.copy(), v.copy()
    pagedattn.copy_blocks(k, v, [(3, 5)])
    ek, ev = k0.copy(), v0.copy()
    ek[5], ev[5] = k0[3], v0[3]
    assert np.array_equal(k, ek) and np.array_equal(v, ev)
    # Mixed forms, and an empty list of value caches.
    (k2,), (v2,) = layer_caches(rng, 1, layout=layout)
    k20 = k2.copy()
    pagedattn.copy_blocks(k2, [v2], [(1, 0)])
    assert np.array_equal(k2[0], k20[1]) and np.array_equal(k2[1:], k20[1:])
    k3 = k0.copy()
    pagedattn.copy_blocks(k3, [], np.array([[2, 6]], np.int64))
    ek3 = k0.copy()
    ek3[6] = k0[2]
    assert np.array_equal(k3, ek3)


def test_copy_and_swap_refuse_what_is_not_a_cache(rng):
    (k,), (v,) = layer_caches(rng, 1)
    with pytest.raises(TypeError, match="key_caches: expected a cache array or a sequence of them, got int"):
        pagedattn.copy_blocks(5, [v], [(0, 1)])
    with pytest.raises(TypeError, match=r"key_caches\[1\]: expected a writable array"):
        pagedattn.copy_blocks([k, "v"], [], np.array([[0, 1]], np.int64))
    with pytest.raises(TypeError, match="value_caches: expected a cache array or a sequence of them, got int"):
        pagedattn.copy_blocks([k], 3, np.array([[0, 1]], np.int64))
    dst = np.zeros_like(k)
    with pytest.raises(TypeError, match="src: expected one cache array .* got list; swap_blocks moves the blocks"):
        pagedattn.swap_blocks([k], dst, [(0, 1)])
    with pytest.raises(TypeError, match="dst: expected one cache array .* got tuple"):
        pagedattn.swap_blocks(k, (dst,), [(0, 1)])
    assert not dst.any()


def mapping_inside(cache: np.ndarray, block: int, pairs) -> np.ndarray:
    """An int64 [P, 2] view whose memory is block `block` of `cache`, holding `pairs`."""
    flat = cache[block].reshape(-1).view(np.int64)
    m = flat[: 2 * len(pairs)].reshape(len(pairs), 2)
    m[:] = pairs
    return m


def test_copy_blocks_refuses_a_mapping_inside_a_cache(rng):
    keys, values = layer_caches(rng, 2)
    for where, cache in (("caches[1]", keys[1]), ("caches[3]", values[1])):
        # The first pair would overwrite the mapping's own block before the second is read.
        mapping = mapping_inside(cache, 4, [[0, 4], [2, 9]])
        snap = [c.copy() for c in keys + values]
        with pytest.raises(ValueError, match=rf"{re.escape(where)} overlaps block_mapping in memory"):
            pagedattn.copy_blocks(keys, values, mapping)
        assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(snap, keys + values))


def test_swap_blocks_refuses_a_mapping_inside_src_or_dst_and_overlapping_arrays(rng):
    src = rng.standard_normal((6, 4, 8)).astype(np.float32)
    dst = np.zeros((6, 4, 8), np.float32)
    inside_dst = mapping_inside(dst, 1, [[0, 1], [2, 3]])
    inside_src = mapping_inside(src, 5, [[0, 1]])
    snap_src, snap_dst = src.copy(), dst.copy()
    with pytest.raises(ValueError, match="dst overlaps block_mapping"):
        pagedattn.swap_blocks(src, dst, inside_dst)
    with pytest.raises(ValueError, match="src overlaps block_mapping"):
        pagedattn.swap_blocks(src, dst, inside_src)
    assert np.array_equal(dst, snap_dst) and np.array_equal(src, snap_src)
    whole = rng.standard_normal((8, 4, 8)).astype(np.float32)
    before = whole.copy()
    with pytest.raises(ValueError, match="dst overlaps src in memory"):
        pagedattn.swap_blocks(whole[0:6], whole[2:8], [(0, 0)])
    assert np.array_equal(whole, before)


def test_copy_blocks_refuses_repeated_and_chained_destinations(rng):
    keys, values = layer_caches(rng, 2)
    snap = [c.copy() for c in keys + values]
    with pytest.raises(ValueError, match=r"block_mapping\[2\]: destination block 5 is also the destination of pair 0"):
        pagedattn.copy_blocks(keys, values, [(0, 5), (1, 6), (2, 5)])
    with pytest.raises(ValueError, match=r"block_mapping\[0\]: destination block 5 is also the source of pair 1"):
        pagedattn.copy_blocks(keys, values, [(0, 5), (5, 7)])
    with pytest.raises(ValueError, match=r"block_mapping\[1\]: destination block 3 is also the source of pair 0"):
        pagedattn.copy_blocks(keys, values, np.array([(3, 8), (1, 3)], np.int32))
    assert all(np.array_equal(a, b) for a, b in zip(snap, keys + values)), "a refused call changed a cache"
    # A pair (b, b) is a no-op: other pairs may read b.
    pagedattn.copy_blocks(keys, values, [(2, 2), (2, 4)])
    assert np.array_equal(keys[0][4], snap[0][2]) and np.array_equal(keys[0][2], snap[0][2])


def test_copy_blocks_refuses_caches_that_share_a_block(rng):
    """A copy into one cache would change another's source (the result depended on the
    order of the caches); the key and value halves of one [N, 2, ...] allocation, whose
    blocks interleave without sharing, stay accepted."""
    buf = rng.standard_normal(6 * 64).astype(np.float32)
    snap = buf.copy()
    with pytest.raises(ValueError, match=r"caches\[0\] overlaps caches\[1\]"):
        pagedattn.copy_blocks([buf.reshape(6, 64)], [buf.reshape(12, 32)], [(2, 5)])
    keys, values = layer_caches(rng, 3)
    with pytest.raises(ValueError, match=r"caches\[1\] overlaps caches\[4\]"):  # one layer's key cache twice
        pagedattn.copy_blocks(keys, [values[0], keys[1], values[2]], [(2, 5)])
    with pytest.raises(ValueError, match=r"caches\[0\] overlaps caches\[3\]"):  # a view of another layer's
        pagedattn.copy_blocks(keys, [keys[0][3:], values[1], values[2]], [(0, 1)])
    assert np.array_equal(buf, snap), "a refused call changed a cache"
    kv = rng.standard_normal((10, 2, 16, 2, 64)).astype(np.float32)  # [N, 2, B, K, D]: nhd halves
    want = kv.copy()
    want[7] = want[1]
    pagedattn.copy_blocks([kv[:, 0]], [kv[:, 1]], [(1, 7)])
    np.testing.assert_array_equal(kv, want)


def test_copy_blocks_checks_the_mapping_without_caches(rng):
    """The lists are caches to copy, whatever their lengths (every cache of both gets the
    pairs); with no cache at all the mapping is still checked."""
    keys, values = layer_caches(rng, 2)
    snap = [c.copy() for c in keys + values[:1]]
    pagedattn.copy_blocks(keys, values[:1], [(0, 1)])
    for c, s in zip(keys + values[:1], snap):
        np.testing.assert_array_equal(c[1], s[0])
    with pytest.raises(TypeError, match="block_mapping"):
        pagedattn.copy_blocks([], [], "not a mapping")
    with pytest.raises(ValueError, match="block_mapping"):
        pagedattn.copy_blocks([], [], np.zeros((3, 3), np.int64))
    pagedattn.copy_blocks([], [], [(0, 1)])  # no caches: nothing to copy


def test_swap_blocks_destinations(rng):
    src = rng.standard_normal((6, 4, 8)).astype(np.float32)
    dst = np.zeros((6, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"block_mapping\[1\]: destination block 1 is also the destination of pair 0"):
        pagedattn.swap_blocks(src, dst, [(0, 1), (2, 1)])
    assert not dst.any()
    # Separate arrays: a destination index may equal a source index.
    pagedattn.swap_blocks(src, dst, [(0, 1), (1, 0)])
    assert np.array_equal(dst[1], src[0]) and np.array_equal(dst[0], src[1])
    # The same array as src and dst: no chains.
    same = src.copy()
    with pytest.raises(ValueError, match=r"block_mapping\[0\]: destination block 1 is also the source of pair 1"):
        pagedattn.swap_blocks(same, same, [(0, 1), (1, 2)])
    assert np.array_equal(same, src)
    pagedattn.swap_blocks(same, same, [(0, 4), (1, 5)])
    assert np.array_equal(same[4], src[0]) and np.array_equal(same[5], src[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swap_blocks_host(rng, layout):
    keys, _ = layer_caches(rng, 1, num_blocks=8, layout=layout)
    src = keys[0]
    dst = np.full((5,) + src.shape[1:], np.nan, np.float32)
    pairs = [(7, 0), (1, 3), (2, 4)]
    pagedattn.swap_blocks(src, dst, pairs)
    for s, d in pairs:
        assert np.array_equal(dst[d], src[s])
    assert np.isnan(dst[[1, 2]]).all(), "blocks not in the mapping stay untouched"


def test_swap_blocks_consecutive_runs(rng):
    src = rng.standard_normal((12, 4, 8)).astype(np.float16)
    dst = np.zeros((12, 4, 8), np.float16)
    pairs = [(0, 4), (1, 5), (2, 6), (9, 0), (10, 1)]
    pagedattn.swap_blocks(src, dst, np.array(pairs, np.int32))
    assert np.array_equal(dst[4:7], src[0:3]) and np.array_equal(dst[0:2], src[9:11])
    assert np.all(dst[[2, 3, 7, 8, 9, 10, 11]] == 0)


def test_swap_blocks_errors(rng):
    src = rng.standard_normal((4, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="block shape"):
        pagedattn.swap_blocks(src, np.zeros((4, 2, 4), np.float32), [(0, 0)])
    with pytest.raises(TypeError, match="dtype"):
        pagedattn.swap_blocks(src, np.zeros((4, 2, 8), np.float16), [(0, 0)])
    with pytest.raises(IndexError, match=r"block_mapping\[0, 1\] = 4"):
        pagedattn.swap_blocks(src, np.zeros((4, 2, 8), np.float32), [(0, 4)])


@pytest.mark.parametrize("name", ["decode_workspace_size", "decode_plan"])
def test_decode_queries_without_cuda_or_bad_args(name):
    """Both host-side queries share their validation, and each names itself in errors."""
    fn = getattr(pagedattn, name)
    if not pagedattn._core.with_cuda:
        with pytest.raises(ValueError, match=f"{name}: this build of pagedattn has no CUDA backend"):
            fn(1, 8, 2, 64, 16, 4, "float16")
    with pytest.raises(ValueError, match=rf"{name}: num_heads 8 \(query\) must be a multiple of num_kv_heads 3"):
        fn(1, 8, 3, 64, 16, 4, "float16")
    with pytest.raises(ValueError, match="head_size 65"):
        fn(1, 8, 2, 65, 16, 4, "float16")
    with pytest.raises(ValueError, match='kernel: got "v2", expected "auto", "single_pass" or "partitioned"'):
        fn(1, 8, 2, 64, 16, 4, "float16", kernel="v2")
    # What paged_attention refuses, the queries refuse with the same check: the "vllm"
    # layout of an fp8 cache (x = 16) cannot hold head size 72, the "nhd" layout can.
    vllm_x16 = f"{name}: head_size 72 does not fit the \"vllm\" layout, which needs a multiple of x = 16"
    with pytest.raises(ValueError, match=vllm_x16):
        fn(1, 8, 2, 72, 16, 4, "float16", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="k_scale: must be a finite positive number"):
        fn(1, 8, 2, 72, 16, 4, "float16", layout="nhd", kv_cache_dtype="fp8_e4m3", k_scale=-1.0)
    with pytest.raises(TypeError, match=f"{name}\\(\\) got an unexpected keyword argument 'version'"):
        fn(1, 8, 2, 64, 16, 4, "float16", version=2)
    with pytest.raises(TypeError, match="num_seqs: expected an integer, got float 1.5"):
        fn(1.5, 8, 2, 64, 16, 4, "float16")
