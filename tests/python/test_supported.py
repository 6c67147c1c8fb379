"""pagedattn.supported() is the library's one list of what it supports, and it tells the truth.

Every listed dtype, layout and kv-cache dtype works, in every combination, in a small CPU
decode checked against the float64 reference; the CPU limits are exact (the limit works, one
past it is refused); values outside the lists are refused with a typed error that names the
listed values; the CUDA head and block sizes are the ones the host-side checks accept.
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import SUPPORTED, assert_close, np_dtype
from pagedattn.reference import paged_attention_ref

LIST = (list, tuple)
KEYS = {
    "dtypes": LIST,
    "kv_cache_dtypes": LIST,
    "layouts": LIST,
    "cuda_head_sizes": LIST,
    "cuda_head_size_align": int,
    "cuda_max_head_size": int,
    "cuda_block_sizes": LIST,
    "cpu_max_head_size": int,
    "cpu_max_block_size": int,
    "max_context_tokens": int,
}
NAN_FP8 = 0x7F  # NaN in both fp8 formats


def test_shape_of_the_lists():
    assert set(SUPPORTED) >= set(KEYS), sorted(SUPPORTED)
    for key, kind in KEYS.items():
        value = SUPPORTED[key]
        assert isinstance(value, kind), key
        if kind is LIST:
            assert value and len(set(value)) == len(value), f"{key}: empty or repeated entries {value}"
    assert "auto" in SUPPORTED["kv_cache_dtypes"]
    assert list(SUPPORTED["cuda_head_sizes"]) == sorted(SUPPORTED["cuda_head_sizes"])
    align, top = SUPPORTED["cuda_head_size_align"], SUPPORTED["cuda_max_head_size"]
    assert all(d % align == 0 and 0 < d <= top for d in SUPPORTED["cuda_head_sizes"])
    assert SUPPORTED["cuda_head_sizes"][-1] == top
    assert pagedattn.supported() == SUPPORTED  # a fresh copy, the same content


def _decode(rng, dtype_name, layout, kv_cache_dtype, *, head_size=16, block_size=8, lens=(1, 8, 19)):
    """A small CPU decode through reshape_and_cache and paged_attention; returns (out, ref, dtype)."""
    dtype = np_dtype(dtype_name)
    if dtype is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    fp8 = kv_cache_dtype != "auto"
    kh, h = 2, 4
    lens = np.asarray(lens, np.int32)
    need = -(-lens // block_size)
    num_blocks = int(need.sum()) + 2
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, block_size, kh, head_size,
                                              kv_cache_dtype if fp8 else dtype, layout)  # fmt: skip
    poison = (lambda shape: np.full(shape, NAN_FP8, np.uint8)) if fp8 else (lambda shape: np.full(shape, np.nan, dtype))
    key_cache, value_cache = poison(kshape), poison(vshape)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(lens), int(need.max()) + 1), perm[-1], np.int32)  # padding: a poisoned block
    slots, pos = [], 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[pos : pos + n]
        pos += n
        t = np.arange(lens[i])
        slots.append(tables[i, t // block_size].astype(np.int64) * block_size + t % block_size)
    slots = np.concatenate(slots)
    scales = dict(k_scale=0.05, v_scale=0.02, layout=layout) if fp8 else dict(layout=layout)
    key = (rng.standard_normal((len(slots), kh, head_size)) * (3 if fp8 else 1)).astype(dtype)
    value = rng.standard_normal((len(slots), kh, head_size)).astype(dtype)
    pagedattn.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_cache_dtype=kv_cache_dtype, **scales)
    query = rng.standard_normal((len(lens), h, head_size)).astype(dtype)
    out = pagedattn.paged_attention(query, key_cache, value_cache, tables, lens, kv_cache_dtype=kv_cache_dtype,
                                    **scales)  # fmt: skip
    ref = paged_attention_ref(query, key_cache, value_cache, tables, lens, kv_cache_dtype=kv_cache_dtype, **scales)
    return out, ref, dtype


@pytest.mark.parametrize("kv_cache_dtype", SUPPORTED["kv_cache_dtypes"])
@pytest.mark.parametrize("layout", SUPPORTED["layouts"])
@pytest.mark.parametrize("dtype_name", SUPPORTED["dtypes"])
def test_every_listed_combination_decodes_on_cpu(rng, dtype_name, layout, kv_cache_dtype):
    out, ref, dtype = _decode(rng, dtype_name, layout, kv_cache_dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype, f"{dtype_name} {layout} {kv_cache_dtype}")


@pytest.mark.parametrize("layout", SUPPORTED["layouts"])
def test_cpu_head_size_limit_is_exact(rng, layout):
    top = SUPPORTED["cpu_max_head_size"]
    out, ref, dtype = _decode(rng, "float32", layout, "auto", head_size=top, lens=(3,))
    assert_close(out, ref, dtype, f"head size {top}")
    over = top + 16  # a multiple of the vllm layout's x, so only the limit can refuse it
    with pytest.raises(ValueError, match=rf"head_size {over}\b.*{top}"):
        _decode(rng, "float32", layout, "auto", head_size=over, lens=(3,))


@pytest.mark.parametrize("layout", SUPPORTED["layouts"])
def test_cpu_block_size_limit_is_exact(rng, layout):
    top = SUPPORTED["cpu_max_block_size"]
    out, ref, dtype = _decode(rng, "float32", layout, "auto", block_size=top, lens=(1, top + 1))
    assert_close(out, ref, dtype, f"block size {top}")
    with pytest.raises(ValueError, match=rf"block_size {top + 1}\b.*{top}"):
        _decode(rng, "float32", layout, "auto", block_size=top + 1, lens=(3,))


def _names_all(message: str, values) -> bool:
    return all(str(v) in message for v in values)


def test_unlisted_layout_is_refused_with_the_list():
    with pytest.raises(ValueError, match="layout") as e:
        pagedattn.kv_cache_shape(4, 16, 2, 64, "float16", "bhnd")
    assert _names_all(str(e.value), SUPPORTED["layouts"]), str(e.value)


def test_unlisted_dtype_is_refused_with_the_list():
    with pytest.raises(TypeError, match="dtype") as e:
        pagedattn.kv_cache_shape(4, 16, 2, 64, "float64")
    assert _names_all(str(e.value), SUPPORTED["dtypes"]), str(e.value)
    q = np.zeros((1, 1, 16), np.float64)
    with pytest.raises(TypeError, match="float64"):
        pagedattn.paged_attention(q, np.zeros((2, 8, 1, 16)), np.zeros((2, 8, 1, 16)), np.zeros((1, 1), np.int32),
                                  np.ones(1, np.int32))  # fmt: skip


def test_unlisted_kv_cache_dtype_is_refused_with_the_list():
    kshape, vshape = pagedattn.kv_cache_shape(2, 8, 1, 16, "fp8_e4m3", "nhd")
    kc, vc = np.zeros(kshape, np.uint8), np.zeros(vshape, np.uint8)
    q = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype") as e:
        pagedattn.paged_attention(q, kc, vc, np.zeros((1, 1), np.int32), np.ones(1, np.int32), kv_cache_dtype="int8")
    assert _names_all(str(e.value), SUPPORTED["kv_cache_dtypes"]), str(e.value)


# ---- CUDA sizes: the host-side checks of decode_plan (the same validation as a decode call) ----
def _cuda_verdict(head_size: int, block_size: int):
    """None when the CUDA checks accept the sizes (refused only for a missing backend or
    device), else the ValueError they raised."""
    try:
        # The "nhd" layout takes any head size, so only the CUDA lists decide.
        pagedattn.decode_plan(2, 8, 8, head_size, block_size, 4, "float16", layout="nhd")
    except ValueError as e:
        # Sizes and options pass; only the build or the machine lacks CUDA.
        if "no CUDA backend" in str(e) or "is not a usable CUDA device" in str(e):
            return None
        return e
    return None


def _refused(head_size: int, block_size: int) -> ValueError:
    verdict = _cuda_verdict(head_size, block_size)
    if verdict is None and not pagedattn.built_with_cuda():
        pytest.skip("this build checks CUDA sizes only once it has a CUDA backend")
    assert isinstance(verdict, ValueError), f"head_size {head_size}, block_size {block_size} accepted"
    return verdict


def test_listed_cuda_sizes_are_accepted():
    block = SUPPORTED["cuda_block_sizes"][0]
    for d in SUPPORTED["cuda_head_sizes"]:
        assert _cuda_verdict(d, block) is None, f"listed head size {d} refused: {_cuda_verdict(d, block)}"
    # the generic kernel: every multiple of the alignment up to the maximum
    align, top = SUPPORTED["cuda_head_size_align"], SUPPORTED["cuda_max_head_size"]
    for d in range(align, top + 1, align):
        assert _cuda_verdict(d, block) is None, f"head size {d} refused: {_cuda_verdict(d, block)}"
    for b in SUPPORTED["cuda_block_sizes"]:
        assert _cuda_verdict(SUPPORTED["cuda_head_sizes"][0], b) is None, f"listed block size {b} refused"


def test_unlisted_cuda_sizes_are_refused_with_the_list():
    block = SUPPORTED["cuda_block_sizes"][0]
    align, top = SUPPORTED["cuda_head_size_align"], SUPPORTED["cuda_max_head_size"]
    for d in (align // 2, top + align, top + 1):
        e = _refused(d, block)
        assert f"head_size {d}" in str(e) and _names_all(str(e), SUPPORTED["cuda_head_sizes"]), str(e)
    unlisted_block = next(b for b in (4, 64, 12) if b not in SUPPORTED["cuda_block_sizes"])
    e = _refused(SUPPORTED["cuda_head_sizes"][0], unlisted_block)
    assert f"block_size {unlisted_block}" in str(e) and _names_all(str(e), SUPPORTED["cuda_block_sizes"]), str(e)
