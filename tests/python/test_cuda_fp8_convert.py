"""quantize_fp8 / dequantize_fp8 and fp8 cache writes on CUDA against the host path
(itself checked bit for bit against exact references in test_fp8_convert.py)."""

from __future__ import annotations

import numpy as np
import pytest
from fp8_reference import FORMATS, KINDS

import pagedattn
from conftest import BF16, DTYPE_NAMES

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or not pagedattn._core.with_cuda:
    pytest.skip("needs a CUDA device and pagedattn built with CUDA", allow_module_level=True)

DEV = torch.device("cuda", 0)
from torch_arrays import to_torch  # noqa: E402

NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
WIDE = [n for n in DTYPE_NAMES if NP.get(n) is not None]


def to_numpy(t, dtype):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy().astype(dtype, copy=False)


def same_values(got, want) -> bool:
    """Bit for bit where not NaN (so the sign of zero counts), NaN where NaN. (NaN payloads
    may differ: the GPU's float conversions give the canonical NaN.)"""
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    nan = np.isnan(w)
    return bool(np.array_equal(np.isnan(g), nan) and np.array_equal(g[~nan], w[~nan]) and
                np.array_equal(np.signbit(g[~nan]), np.signbit(w[~nan])))  # fmt: skip


def values(rng, n) -> np.ndarray:
    mags = rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n).astype(np.float64))
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448.0, 464.0, 57344.0, 61440.0, 1e30, 2.0**-10,
               3 * 2.0**-11, 2.0**-17]  # fmt: skip
    return np.concatenate([special, mags])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("scale", [1.0, 0.37, 1.0e-3])
def test_quantize_matches_cpu(rng, kind, dtype, scale):
    with np.errstate(over="ignore"):
        x = (values(rng, 100_000) * scale).astype(NP[dtype])
    want = np.zeros(x.shape, np.uint8)
    pagedattn.quantize_fp8(x, want, scale=scale, fp8_dtype=kind)
    xt = to_torch(x)
    for start, stop in ((0, x.size), (1, 1 + 13), (3, x.size - 5), (8, 8 + 64)):  # aligned and not, tails
        out = torch.full((stop - start,), 0x55, dtype=torch.uint8, device=DEV)
        assert pagedattn.quantize_fp8(xt[start:stop], out, scale=scale, fp8_dtype=kind) is out
        torch.cuda.synchronize()
        got = out.cpu().numpy()
        bad = np.flatnonzero(got != want[start:stop])[:4]
        assert bad.size == 0, (start, stop, [(x[start + i], hex(got[i]), hex(want[start + i])) for i in bad])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
def test_quantize_keeps_the_sign_of_nan_and_zero(kind, dtype):
    """Every input dtype, the vector groups, the scalar tail and an unaligned view: -NaN,
    -0 and -inf keep their sign in the code, on the host and on CUDA. (On the GPU a float16
    -> float32 conversion is an f16 add, whose NaN result is the positive canonical NaN.)"""
    max_code, nan_code = FORMATS[kind]
    cases = [(np.nan, nan_code), (-np.nan, 0x80 | nan_code), (0.0, 0x00), (-0.0, 0x80), (np.inf, max_code),
             (-np.inf, 0x80 | max_code), (-1.0e30, 0x80 | max_code)]  # fmt: skip
    with np.errstate(over="ignore"):
        x = np.tile(np.array([c[0] for c in cases]), 3).astype(NP[dtype])  # 21: two groups of 8 and a tail
    want = np.tile(np.array([c[1] for c in cases], np.uint8), 3)
    assert np.array_equal(np.signbit(x.astype(np.float64)), want >= 0x80)  # the inputs carry the signs
    host = np.zeros(x.shape, np.uint8)
    pagedattn.quantize_fp8(x, host, scale=0.5, fp8_dtype=kind)
    assert [hex(c) for c in host] == [hex(c) for c in want]
    xt = to_torch(x)
    for start in (0, 1):  # 16-byte aligned (vector path), then not (scalar only)
        out = torch.full((x.size - start,), 0x55, dtype=torch.uint8, device=DEV)
        pagedattn.quantize_fp8(xt[start:], out, scale=0.5, fp8_dtype=kind)
        torch.cuda.synchronize()
        assert [hex(c) for c in out.cpu().numpy()] == [hex(c) for c in want[start:]], start


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-120, 6.0e35])
def test_dequantize_matches_cpu(kind, dtype, scale):
    codes = np.tile(np.arange(256, dtype=np.uint8), 41)  # 10496 codes: the vector path and a tail
    want = np.zeros(codes.shape, NP[dtype])
    pagedattn.dequantize_fp8(codes, want, scale=scale, fp8_dtype=kind)
    ct = to_torch(codes)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    for start, stop in ((0, codes.size), (1, 1 + 300), (5, codes.size - 3)):
        out = torch.full((stop - start,), float("nan"), dtype=tdt, device=DEV)
        pagedattn.dequantize_fp8(ct[start:stop], out, scale=scale, fp8_dtype=kind)
        torch.cuda.synchronize()
        assert same_values(to_numpy(out, NP[dtype]), want[start:stop]), (start, stop)


def test_explicit_stream_and_shapes(rng):
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    want = np.zeros(x.shape, np.uint8)
    pagedattn.quantize_fp8(x, want, scale=0.5, fp8_dtype="fp8_e5m2")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xt = to_torch(x)
        out = torch.empty(x.shape, dtype=torch.uint8, device=DEV)
    pagedattn.quantize_fp8(xt, out, scale=0.5, fp8_dtype="fp8_e5m2", stream=s)
    back = torch.empty(x.shape, dtype=torch.float32, device=DEV)
    pagedattn.dequantize_fp8(out, back, scale=0.5, fp8_dtype="fp8_e5m2", stream=s.cuda_stream)
    s.synchronize()
    assert np.array_equal(out.cpu().numpy(), want)
    host = np.zeros(x.shape, np.float32)
    pagedattn.dequantize_fp8(want, host, scale=0.5, fp8_dtype="fp8_e5m2")
    assert np.array_equal(back.cpu().numpy(), host)


def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="dst is on cuda:0 but src is on cpu"):
        pagedattn.quantize_fp8(np.zeros(4, np.float32), torch.zeros(4, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match="dst is on cpu but src is on cuda:0"):
        pagedattn.dequantize_fp8(torch.zeros(4, dtype=torch.uint8, device=DEV), np.zeros(4, np.float32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
def test_cuda_cache_writes_are_quantize_fp8_codes(rng, kind, dtype):
    t, k, d, b = 45, 2, 64, 16
    key = (rng.standard_normal((t, k, d)) * np.exp2(rng.integers(-12, 12, (t, k, d)))).astype(NP[dtype])
    value = (rng.standard_normal((t, k, d)) * 300).astype(NP[dtype])
    kshape, vshape = pagedattn.kv_cache_shape(3, b, k, d, np.uint8, "nhd")
    kc = torch.full(kshape, 0x7F, dtype=torch.uint8, device=DEV)
    vc = torch.full(vshape, 0x7F, dtype=torch.uint8, device=DEV)
    slots = torch.arange(t, dtype=torch.int64, device=DEV)
    kt, vt = to_torch(key), to_torch(value)
    pagedattn.reshape_and_cache(kt, vt, kc, vc, slots, kv_cache_dtype=kind, k_scale=0.37, v_scale=1.75)
    want_k = torch.empty((t, k, d), dtype=torch.uint8, device=DEV)
    want_v = torch.empty((t, k, d), dtype=torch.uint8, device=DEV)
    pagedattn.quantize_fp8(kt, want_k, scale=0.37, fp8_dtype=kind)
    pagedattn.quantize_fp8(vt, want_v, scale=1.75, fp8_dtype=kind)
    torch.cuda.synchronize()
    assert torch.equal(kc.view(-1, k, d)[:t], want_k)
    assert torch.equal(vc.view(-1, k, d)[:t], want_v)
    host = np.zeros((t, k, d), np.uint8)
    pagedattn.quantize_fp8(key, host, scale=0.37, fp8_dtype=kind)
    assert np.array_equal(want_k.cpu().numpy(), host)


@pytest.mark.parametrize("layout", ["vllm", "nhd"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
def test_cuda_cache_writes_keep_the_sign_of_nan_and_zero(kind, dtype, layout):
    """-NaN, -0 and -inf written into an fp8 cache keep their sign, as quantize_fp8 and the
    host write keep it (a float16 -NaN taken through float32 on the GPU would lose it)."""
    max_code, nan_code = FORMATS[kind]
    cases = [(np.nan, nan_code), (-np.nan, 0x80 | nan_code), (0.0, 0x00), (-0.0, 0x80), (np.inf, max_code),
             (-np.inf, 0x80 | max_code), (-1.0e30, 0x80 | max_code), (1.0, None)]  # fmt: skip
    t, k, d, b = 3, 2, 64, 16
    with np.errstate(over="ignore"):
        key = np.resize(np.array([c[0] for c in cases]), (t, k, d)).astype(NP[dtype])
    value = -key
    kshape, vshape = pagedattn.kv_cache_shape(1, b, k, d, np.uint8, layout)
    kw = dict(kv_cache_dtype=kind, k_scale=0.5, v_scale=0.5)
    slots = np.arange(t, dtype=np.int64)
    kc_h, vc_h = np.full(kshape, 0x55, np.uint8), np.full(vshape, 0x55, np.uint8)  # slots no token writes: 0x55
    pagedattn.reshape_and_cache(key, value, kc_h, vc_h, slots, **kw)
    kc = torch.full(kshape, 0x55, dtype=torch.uint8, device=DEV)
    vc = torch.full(vshape, 0x55, dtype=torch.uint8, device=DEV)
    pagedattn.reshape_and_cache(to_torch(key), to_torch(value), kc, vc, to_torch(slots), **kw)
    torch.cuda.synchronize()
    assert np.array_equal(kc.cpu().numpy(), kc_h)
    assert np.array_equal(vc.cpu().numpy(), vc_h)
    # and the host codes are the expected ones: -NaN a NaN code with the sign bit set
    codes = np.zeros(key.shape, np.uint8)
    pagedattn.quantize_fp8(key, codes, scale=0.5, fp8_dtype=kind)
    flat = codes.reshape(-1)
    for i, (_, want) in enumerate(cases):
        if want is not None:
            assert flat[i] == want, (cases[i], hex(flat[i]))
