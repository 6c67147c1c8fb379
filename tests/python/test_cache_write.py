"""reshape_and_cache on the CPU: layouts, dtypes, padding slots, strided inputs, fp8 rounding."""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import DTYPES, FP8_KV_CACHE_DTYPES, LAYOUTS, dtype_id
from pagedattn.reference import fp8_decode, reshape_and_cache_ref


def caches(num_blocks, block_size, kh, d, dtype, layout):
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, block_size, kh, d, dtype, layout)
    fill = 0x7F if np.dtype(dtype) == np.uint8 else np.nan  # 0x7f is NaN in both fp8 formats
    return np.full(kshape, fill, dtype=dtype), np.full(vshape, fill, dtype=dtype)


def same(a, b):
    """Bitwise equality, NaN included."""
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=dtype_id)
def test_matches_reference(rng, dtype, layout, slot_dtype):
    nb, bs, kh, d, t = 6, 16, 3, 64, 40
    kc, vc = caches(nb, bs, kh, d, dtype, layout)
    kc_ref, vc_ref = kc.copy(), vc.copy()
    key = rng.standard_normal((t, kh, d)).astype(dtype)
    value = rng.standard_normal((t, kh, d)).astype(dtype)
    slots = rng.choice(nb * bs, size=t, replace=False).astype(slot_dtype)
    slots[::7] = -1  # padding
    pagedattn.reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    assert same(kc, kc_ref) and same(vc, vc_ref)
    # untouched slots stay NaN
    assert np.isnan(kc.astype(np.float32)).sum() == (nb * bs - (slots >= 0).sum()) * kh * d


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_key_value_from_fused_kv(rng, layout):
    nb, bs, kh, d, t = 4, 8, 2, 32, 20
    kv = rng.standard_normal((t, 2, kh, d)).astype(np.float16)
    key, value = kv[:, 0], kv[:, 1]
    assert not key.flags.c_contiguous
    kc, vc = caches(nb, bs, kh, d, np.float16, layout)
    kc_ref, vc_ref = kc.copy(), vc.copy()
    slots = rng.permutation(nb * bs)[:t].astype(np.int64)
    pagedattn.reshape_and_cache(key, value, kc, vc, slots)
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    assert same(kc, kc_ref) and same(vc, vc_ref)


def test_empty_is_noop():
    kc, vc = caches(2, 16, 1, 64, np.float32, "vllm")
    before = kc.copy()
    pagedattn.reshape_and_cache(np.zeros((0, 1, 64), np.float32), np.zeros((0, 1, 64), np.float32), kc, vc,
                                np.zeros(0, np.int32))  # fmt: skip
    assert same(kc, before)


def _rne_reference_fp8(x: np.ndarray, kind: str) -> np.ndarray:
    """Nearest representable fp8 value (ties to even code), saturating: brute force over all codes."""
    table = fp8_decode(np.arange(256, dtype=np.uint8), kind)
    finite = np.where(np.isfinite(table))[0]
    vals = table[finite]
    maxv = np.nanmax(vals)
    xs = np.clip(x.astype(np.float64), -maxv, maxv)
    diff = np.abs(xs[..., None] - vals[None, :])
    best = diff.min(axis=-1, keepdims=True)
    cand = np.where(diff == best, finite[None, :], 1 << 20)
    # among ties pick the even mantissa (even code), preferring the sign of x for zero
    even = np.where(cand % 2 == 0, cand, 1 << 20).min(axis=-1)
    any_ = cand.min(axis=-1)
    code = np.where(even < (1 << 20), even, any_)
    res = table[code]
    return np.where(res == 0, 0.0, res) * 1.0


@pytest.mark.parametrize("kind", FP8_KV_CACHE_DTYPES)
def test_fp8_rounding_is_nearest_even_and_saturating(rng, kind):
    d = 64
    x = np.concatenate([
        rng.standard_normal(4000) * 10.0 ** rng.integers(-4, 4, 4000),
        np.array([1e9, -1e9, np.inf, -np.inf, 448.0, 449.0, 57344.0, 60000.0, 0.0]),
    ]).astype(np.float32)  # fmt: skip
    n = -(-len(x) // d) * d
    x = np.concatenate([x, np.ones(n - len(x), np.float32)]).reshape(-1, 1, d)
    kc, vc = caches(len(x), 1, 1, d, np.uint8, "nhd")
    slots = np.arange(len(x), dtype=np.int32)
    pagedattn.reshape_and_cache(x, x, kc, vc, slots, kv_cache_dtype=kind, k_scale=1.0, v_scale=1.0)
    got = fp8_decode(kc.reshape(-1), kind)
    want = _rne_reference_fp8(x.reshape(-1), kind)
    np.testing.assert_array_equal(got, want)


def test_fp8_nan_stays_nan():
    x = np.full((1, 1, 16), np.nan, np.float32)
    kc, vc = caches(1, 1, 1, 16, np.uint8, "nhd")
    pagedattn.reshape_and_cache(x, x, kc, vc, np.zeros(1, np.int32), kv_cache_dtype="fp8_e4m3")
    assert np.isnan(fp8_decode(kc, "fp8_e4m3")).all()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.itemsize == 2], ids=dtype_id)
def test_output_rounding_matches_numpy_bit_for_bit(rng, dtype):
    """Two tokens with identical keys get weight 1/2 each, so the float32 result is
    (v1 + v2) * 0.5 exactly; its rounding to the output dtype must equal NumPy's
    (float16) / ml_dtypes' (bfloat16) round-to-nearest-even, bit for bit."""
    d, kh = 64, 1
    kshape, vshape = pagedattn.kv_cache_shape(1, 2, kh, d, dtype, "nhd")
    kc = np.empty(kshape, dtype)
    kc[0, 1] = kc[0, 0] = rng.standard_normal((kh, d)).astype(dtype)
    vc = (rng.standard_normal(vshape) * 2.0 ** rng.integers(-20, 12, vshape)).astype(dtype)
    q = rng.standard_normal((1, 1, d)).astype(dtype)
    out = pagedattn.paged_attention(q, kc, vc, np.zeros((1, 1), np.int32), np.full(1, 2, np.int32))
    f32 = (vc[0, 0, 0].astype(np.float32) + vc[0, 1, 0].astype(np.float32)) * np.float32(0.5)
    want = f32.astype(dtype)
    assert same(out[0, 0], want)
