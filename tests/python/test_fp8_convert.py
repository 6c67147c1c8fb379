"""quantize_fp8 / dequantize_fp8 on the CPU: bit for bit against exact references
(fp8_reference.py) and ml_dtypes, midpoints of value / scale, saturation, NaN, the
vectorised encoder against the scalar one, reshape_and_cache's fp8 writes, and errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from fp8_reference import FORMATS, KINDS, encode_exact, round_exact

import pagedattn
from conftest import BF16, DTYPE_NAMES

ml_dtypes = pytest.importorskip("ml_dtypes")
ML = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
WIDE = [n for n in DTYPE_NAMES if NP.get(n) is not None]


def quantize(x, scale, kind):
    out = np.full(np.shape(x), 0x55, np.uint8)
    assert pagedattn.quantize_fp8(x, out, scale=scale, fp8_dtype=kind) is out
    return out


def f64(a) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling NaNs of float16 inputs stay NaN
        return np.asarray(a).astype(np.float64)


def same_values(got, want) -> bool:
    """Equal as float64, NaN where NaN, and the sign of zeros too."""
    got, want = f64(got), f64(want)
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan], want[~nan]) and
                np.array_equal(np.signbit(got[~nan]), np.signbit(want[~nan])))  # fmt: skip


def odd_values(rng, n) -> np.ndarray:
    """Magnitudes from far below the least fp8 subnormal to far above the largest, both
    signs, and the special values."""
    mags = rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n).astype(np.float64))
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e30, -1e30,
               2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-16, 2.0**-17, 3 * 2.0**-18, 2.0**-6, 2.0**-14]  # fmt: skip
    return np.concatenate([mags, special])


# --------------------------------------------------------------------------------------
# dequantize: every code
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.1e-3, 2.0**-120, 6.0e35])
def test_dequantize_every_code_rounds_once(kind, dtype, scale):
    codes = np.arange(256, dtype=np.uint8)
    out = np.zeros(256, NP[dtype])
    assert pagedattn.dequantize_fp8(codes, out, scale=scale, fp8_dtype=kind) is out
    exact = pagedattn.reference.fp8_decode(codes, kind) * float(np.float32(scale))  # exact: 4 + 24 bits
    assert same_values(out, round_exact(exact, dtype))
    if scale == 1.0:  # every fp8 value is exact in every output dtype: ml_dtypes agrees bit for bit
        assert same_values(out, codes.view(ML[kind]).astype(np.float64))


def test_dequantize_rounds_the_exact_product_not_a_float32_one():
    """A code * scale that float32 rounds onto a bfloat16 midpoint: rounding that float32
    again would go the wrong way; dequantize rounds the exact product once."""
    scale = np.array(1065906631, np.uint32).view(np.float32)[()]  # 1.06597221: 1.125 * scale is one
    codes = np.arange(256, dtype=np.uint8)
    exact = pagedattn.reference.fp8_decode(codes, "fp8_e4m3") * float(scale)
    twice = f64(exact.astype(np.float32).astype(BF16)) if BF16 is not None else None
    out = np.zeros(256, np.float32)
    pagedattn.dequantize_fp8(codes, out, scale=float(scale), fp8_dtype="fp8_e4m3")
    assert same_values(out, exact.astype(np.float32))
    if BF16 is not None:
        bf = np.zeros(256, BF16)
        pagedattn.dequantize_fp8(codes, bf, scale=float(scale), fp8_dtype="fp8_e4m3")
        want = round_exact(exact, "bfloat16")
        assert same_values(bf, want)
        assert not same_values(twice, want), "the test lost its double-rounding cases"


# --------------------------------------------------------------------------------------
# quantize: random, midpoints, saturation, NaN
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("scale", [1.0, 0.37, 7.5, 1.0e-3])
def test_quantize_matches_exact_reference_and_ml_dtypes(rng, kind, dtype, scale):
    with np.errstate(over="ignore"):  # beyond float16: infinities, which saturate too
        x = (odd_values(rng, 3000) * scale).astype(NP[dtype])
    got = quantize(x.reshape(-1, 7) if x.size % 7 == 0 else x, scale, kind).reshape(-1)
    want = encode_exact(x, scale, kind)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:10]
    # ml_dtypes rounds to fp8 to nearest even but neither saturates nor keeps infinities
    # finite: clip first (NaN passes through the clip). It rounds a float64 through
    # float32, so it is a reference only where the quotient is a float32.
    q = np.clip(f64(x) / float(np.float32(scale)), -MAX[kind], MAX[kind])
    exact32 = (q.astype(np.float32) == q) | np.isnan(q)
    assert np.count_nonzero(exact32) >= 10  # at least the special values
    assert np.array_equal(got[exact32], q[exact32].astype(ML[kind]).view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_special_values(kind):
    max_code, nan_code = FORMATS[kind]
    top = MAX[kind]
    sub = 2.0**-9 if kind == "fp8_e4m3" else 2.0**-16  # least subnormal
    step = 32.0 if kind == "fp8_e4m3" else 8192.0  # spacing below the largest finite value
    cases = [
        (np.nan, nan_code), (-np.nan, 0x80 | nan_code), (np.inf, max_code), (-np.inf, 0x80 | max_code),
        (top, max_code), (top + step / 2, max_code), (1e30, max_code), (-1e30, 0x80 | max_code),
        (top - step / 2, max_code & ~1),  # a tie between max - step and max: the even code of the two
        (0.0, 0x00), (-0.0, 0x80), (sub / 2, 0x00), (-sub / 2, 0x80),  # ties to the even code 0
        (sub * 0.75, 0x01), (sub * 1.5, 0x02), (sub * 2.5, 0x02),
    ]  # fmt: skip
    x = np.array([c[0] for c in cases], np.float32)
    assert quantize(x, 1.0, kind).tolist() == [c[1] for c in cases]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_quantize_keeps_signs_from_16_bit_inputs(kind, dtype):
    """NaN, infinities and zeros keep their sign from float16 / bfloat16 inputs too (a
    conversion through an add would return the positive canonical NaN)."""
    max_code, nan_code = FORMATS[kind]
    cases = [(np.nan, nan_code), (-np.nan, 0x80 | nan_code), (np.inf, max_code), (-np.inf, 0x80 | max_code),
             (0.0, 0x00), (-0.0, 0x80), (1.0, None), (-1.0, None)]  # fmt: skip
    x = np.array([c[0] for c in cases], np.float32)
    x16 = x.astype(np.float16) if dtype == "float16" else x.astype(ml_dtypes.bfloat16)
    assert np.signbit(x16.astype(np.float32)).tolist() == [False, True, False, True, False, True, False, True]
    got = pagedattn.quantize_fp8(x16, np.empty(x16.shape, np.uint8), fp8_dtype=kind).tolist()
    assert got[:6] == [c[1] for c in cases[:6]]
    assert got[7] == 0x80 | got[6]  # -1 is +1 with the sign bit


def _midpoints(kind: str) -> np.ndarray:
    """Every midpoint between two adjacent positive finite fp8 values."""
    vals = pagedattn.reference.fp8_decode(np.arange(FORMATS[kind][0] + 1, dtype=np.uint8), kind)
    return (vals[:-1] + vals[1:]) / 2


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_midpoints_of_value_over_scale_round_to_even(kind):
    """value / scale exactly an fp8 midpoint, for scales with short significands (so value
    = midpoint * scale is a float32): ties go to the even code; value * (1 / scale) rounds
    1 / scale first and lands beside the midpoint for some of them."""
    mids = _midpoints(kind)
    scales = np.array([1.0, 0.75, 1.25, 3.0, 0.1015625, 5.5, 1.0 / 3.0], np.float64)
    scales = scales.astype(np.float32).astype(np.float64)
    scales = scales[[np.array_equal((mids * s).astype(np.float32), mids * s) for s in scales]]
    assert len(scales) >= 5
    inverse_differs = 0
    for s in scales:
        x = np.concatenate([mids, -mids]) * s
        got = quantize(x.astype(np.float32), float(s), kind)
        want = encode_exact(x.astype(np.float32), float(s), kind)
        assert np.array_equal(got, want), (s, np.flatnonzero(got != want)[:5])
        assert np.all(got % 2 == 0)  # every tie went to the even code
        by_inverse = encode_exact((x.astype(np.float32) * np.float32(1.0 / np.float32(s))).astype(np.float32), 1.0,
                                  kind)  # fmt: skip
        inverse_differs += int(np.count_nonzero(by_inverse != want))
    assert inverse_differs > 0, "no case where value * (1 / scale) rounds differently: the test lost its teeth"


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_is_exact_where_a_float32_quotient_is_not(kind):
    """value and scale (float32) whose quotient lies within half a float32 ulp of an fp8
    midpoint: float32 division would round it onto the midpoint (a tie), the exact
    quotient is on one side of it."""
    mids = _midpoints(kind)
    mids = mids[mids >= 2.0 ** (1 - (7 if kind == "fp8_e4m3" else 15))]  # normal range
    xs, ss = [], []
    for k in (1, 3, 5):
        s = np.float32(1 + k * 2.0**-23)
        for m in mids:
            v0 = np.float32(m * float(s))  # the nearest float32 to m * s (rarely m * s itself) ...
            for d in (-2, -1, 0, 1, 2):  # ... and its neighbours
                v = np.float32(v0 + np.float32(d) * np.spacing(v0))
                xs.append(v)
                ss.append(s)
    x = np.array(xs, np.float32)
    s_all = np.array(ss, np.float32)
    got = np.concatenate([quantize(x[s_all == s], float(s), kind) for s in np.unique(s_all)])
    x_sorted = np.concatenate([x[s_all == s] for s in np.unique(s_all)])
    s_sorted = np.concatenate([s_all[s_all == s] for s in np.unique(s_all)])
    want = np.array([encode_exact(np.array([v]), float(s), kind)[0] for v, s in zip(x_sorted, s_sorted)], np.uint8)
    assert np.array_equal(got, want)
    via_f32 = np.array([encode_exact(np.array([np.float32(v) / np.float32(s)]), 1.0, kind)[0]
                        for v, s in zip(x_sorted, s_sorted)], np.uint8)  # fmt: skip
    assert np.count_nonzero(via_f32 != want) > 0, "no double-rounding case left: the test lost its teeth"


# --------------------------------------------------------------------------------------
# The vectorised encoder against the scalar one; every float16 and bfloat16 value.
# --------------------------------------------------------------------------------------
def _all_inputs() -> dict[str, np.ndarray]:
    every16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    r = {"float16": every16.view(np.float16)}
    if BF16 is not None:
        r["bfloat16"] = every16.view(BF16)
    r["float32"] = np.concatenate([every16.view(np.float16).astype(np.float32),
                                   (every16.astype(np.uint32) << 16).view(np.float32),
                                   (np.arange(40001, dtype=np.uint32) * 107361 + 5).view(np.float32)])  # fmt: skip
    return r


@pytest.mark.parametrize("kind", KINDS)
def test_every_float16_and_bfloat16_value(kind):
    for dtype, x in _all_inputs().items():
        if dtype == "float32":
            continue
        for scale in (1.0, 0.0625, 64.0):  # powers of two: every quotient is a float32 (see above)
            got = quantize(x, scale, kind)
            with np.errstate(invalid="ignore"):  # signalling NaNs stay NaN
                q = np.clip(f64(x) / scale, -MAX[kind], MAX[kind])
            want = q.astype(ML[kind]).view(np.uint8)
            assert np.array_equal(got, want), (dtype, scale, np.flatnonzero(got != want)[:5])
    x = _all_inputs()["float16"]
    got = quantize(x, 3.3, kind)
    want = encode_exact(x, 3.3, kind)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:5]


def test_vector_encoder_equals_scalar_encoder(tmp_path):
    """PAGEDATTN_CPU_ISA=generic runs the scalar loop: every result must match the default
    (AVX2 where the CPU has it), tails included (lengths not a multiple of 8)."""
    script = textwrap.dedent(
        """
        import sys, numpy as np, pagedattn
        sys.path.insert(0, sys.argv[1])
        from test_fp8_convert import _all_inputs
        parts = []
        for kind in ("fp8_e4m3", "fp8_e5m2"):
            for dtype, x in _all_inputs().items():
                for scale in (1.0, 0.37, 1.2e-38, 3.0e38):
                    for n in (x.size, 13, 7):
                        out = np.zeros(n, np.uint8)
                        pagedattn.quantize_fp8(x[:n], out, scale=scale, fp8_dtype=kind)
                        parts.append(out)
        np.save(sys.argv[2], np.concatenate(parts))
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    results = {}
    for isa in ("generic", "default"):
        env = dict(os.environ)
        env.pop("PAGEDATTN_CPU_ISA", None)
        if isa == "generic":
            env["PAGEDATTN_CPU_ISA"] = "generic"
        path = tmp_path / f"{isa}.npy"
        r = subprocess.run([sys.executable, "-c", script, here, str(path)], env=env, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        results[isa] = np.load(path)
    assert results["generic"].size > 500000
    assert np.array_equal(results["generic"], results["default"])


# --------------------------------------------------------------------------------------
# One definition: reshape_and_cache's fp8 writes are quantize_fp8's codes.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", WIDE)
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_reshape_and_cache_writes_quantize_fp8_codes(rng, kind, dtype, layout):
    t, k, d, b = 37, 3, 64, 16
    key = (rng.standard_normal((t, k, d)) * np.exp2(rng.integers(-12, 12, (t, k, d)))).astype(NP[dtype])
    value = (rng.standard_normal((t, k, d)) * 300).astype(NP[dtype])
    k_scale, v_scale = 0.37, 1.75
    kshape, vshape = pagedattn.kv_cache_shape(3, b, k, d, np.uint8, layout)
    kc, vc = np.full(kshape, 0x7F, np.uint8), np.full(vshape, 0x7F, np.uint8)
    slots = np.arange(t, dtype=np.int64)
    pagedattn.reshape_and_cache(key, value, kc, vc, slots, kv_cache_dtype=kind, k_scale=k_scale, v_scale=v_scale)
    want_k, want_v = quantize(key, k_scale, kind), quantize(value, v_scale, kind)
    if layout == "nhd":  # [N, B, K, D]
        got_k, got_v = kc.reshape(-1, k, d)[:t], vc.reshape(-1, k, d)[:t]
    else:  # key [N, K, D/x, B, x], value [N, K, D, B]
        got_k = kc.transpose(0, 3, 1, 2, 4).reshape(-1, k, d)[:t]
        got_v = vc.transpose(0, 3, 1, 2).reshape(-1, k, d)[:t]
    assert np.array_equal(got_k, want_k)
    assert np.array_equal(got_v, want_v)
    assert np.array_equal(want_k, encode_exact(key, k_scale, kind))


# --------------------------------------------------------------------------------------
# Shapes, round trip, errors
# --------------------------------------------------------------------------------------
def test_any_shape_empty_and_round_trip(rng):
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    codes = quantize(x, 0.25, "fp8_e4m3")
    assert codes.shape == x.shape
    back = pagedattn.dequantize_fp8(codes, np.zeros_like(x), scale=0.25)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-4 + 2.0**-11)  # half an e4m3 ulp (+ subnormals)
    pagedattn.quantize_fp8(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.uint8))
    pagedattn.dequantize_fp8(np.zeros(0, np.uint8), np.zeros(0, np.float16))
    s = np.float32(3.0)  # a 0-d array
    out = np.zeros((), np.uint8)
    pagedattn.quantize_fp8(np.array(s), out, fp8_dtype="fp8")  # "fp8" is e4m3
    assert int(out) == 0x44


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float64), np.zeros(4, np.uint8)), TypeError,
         ["src", "float64", "float32, float16 or bfloat16"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.int8)), TypeError,
         ["dst", "uint8"]),
        (lambda: pagedattn.dequantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.float32)), TypeError,
         ["src", "uint8", "float32"]),
        (lambda: pagedattn.dequantize_fp8(np.zeros(4, np.uint8), np.zeros(4, np.int32)), TypeError,
         ["dst", "int32"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(5, np.uint8)), ValueError,
         ["dst", "[5]", "[4]"]),
        (lambda: pagedattn.quantize_fp8(np.zeros((4, 4), np.float32)[:, ::2], np.zeros((4, 2), np.uint8)),
         ValueError, ["src", "C-contiguous"]),
        (lambda: pagedattn.dequantize_fp8(np.zeros((4, 2), np.uint8), np.zeros((4, 4), np.float32)[:, ::2]),
         ValueError, ["dst", "C-contiguous"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.uint8), scale=0.0), ValueError,
         ["scale", "positive", "0"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.uint8), scale=-1.0), ValueError,
         ["scale", "-1"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.uint8), scale=float("nan")),
         ValueError, ["scale", "nan"]),
        (lambda: pagedattn.dequantize_fp8(np.zeros(4, np.uint8), np.zeros(4, np.float32), scale=1e-40), ValueError,
         ["scale", "smallest normal"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.uint8), scale=1e-50), ValueError,
         ["scale", "1e-50", "too small for float32"]),
        (lambda: pagedattn.dequantize_fp8(np.zeros(4, np.uint8), np.zeros(4, np.float32), scale=10**400), ValueError,
         ["scale", "outside the float32 range"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.uint8), scale="2"), TypeError,
         ["scale", "expected a float"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.uint8), fp8_dtype="auto"),
         ValueError, ["fp8_dtype", "auto", "fp8_e4m3"]),
        (lambda: pagedattn.quantize_fp8(np.zeros(4, np.float32), np.zeros(4, np.uint8), fp8_dtype="int8"),
         ValueError, ["fp8_dtype", "int8"]),
        (lambda: pagedattn.quantize_fp8([1.0, 2.0], np.zeros(2, np.uint8)), TypeError, ["src"]),
    ],
)  # fmt: skip
def test_errors_name_the_argument(call, exc, words):
    with pytest.raises(exc) as e:
        call()
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_read_only_and_overlapping_outputs_are_refused():
    dst = np.zeros(4, np.uint8)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="dst.*read-only"):
        pagedattn.quantize_fp8(np.zeros(4, np.float32), dst)
    buf = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="dst"):
        pagedattn.quantize_fp8(buf, buf.view(np.uint8)[:4])
    codes = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="dst"):
        pagedattn.dequantize_fp8(codes[:4], codes.view(np.float32))


def test_exported_from_the_package():
    assert pagedattn.quantize_fp8 is pagedattn._core.quantize_fp8
    assert pagedattn.dequantize_fp8 is pagedattn._core.dequantize_fp8
    assert {"quantize_fp8", "dequantize_fp8"} <= set(pagedattn.__all__)
