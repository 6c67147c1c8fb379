"""Slow, obviously right fp8 references for the conversion tests.

encode_exact: the code of value / scale with exact rational arithmetic (fractions), the
nearest fp8 value with ties to the even code, saturating; NaN -> the NaN code with the
sign. round_exact: a float64 value rounded once, to nearest even, to float16 / bfloat16 /
float32 (frexp / ldexp / rint are exact on float64). Neither uses the library's code.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np

from pagedattn.reference import fp8_decode

# kind -> (max_code, nan_code): the codes of +largest finite and of +NaN the library writes.
FORMATS = {"fp8_e4m3": (0x7E, 0x7F), "fp8_e5m2": (0x7B, 0x7E)}
KINDS = list(FORMATS)

_LADDERS: dict[str, tuple[list[Fraction], list[int]]] = {}


def _ladder(kind: str) -> tuple[list[Fraction], list[int]]:
    """The non-negative finite values of the format, ascending, with their codes."""
    if kind not in _LADDERS:
        max_code = FORMATS[kind][0]
        table = fp8_decode(np.arange(max_code + 1, dtype=np.uint8), kind)
        _LADDERS[kind] = ([Fraction(float(v)) for v in table], list(range(max_code + 1)))
    return _LADDERS[kind]


def encode_one(value: float, scale: float, kind: str) -> int:
    max_code, nan_code = FORMATS[kind]
    sign = 0x80 if math.copysign(1.0, value) < 0 else 0
    if math.isnan(value):
        return sign | nan_code
    if math.isinf(value):
        return sign | max_code
    q = abs(Fraction(value) / Fraction(scale))
    vals, codes = _ladder(kind)
    if q >= vals[-1]:
        return sign | max_code
    i = bisect.bisect_right(vals, q) - 1  # vals[i] <= q < vals[i + 1]
    lo, hi = vals[i], vals[i + 1]
    if q - lo < hi - q or (q - lo == hi - q and codes[i] % 2 == 0):
        return sign | codes[i]
    return sign | codes[i + 1]


def encode_exact(values: np.ndarray, scale: float, kind: str) -> np.ndarray:
    """uint8 codes of values / scale (values: any float array; scale: a float32 value)."""
    flat = np.asarray(values).astype(np.float64).reshape(-1)  # exact for float32 / float16 / bfloat16
    s = float(np.float32(scale))
    return np.array([encode_one(float(v), s, kind) for v in flat], np.uint8).reshape(np.shape(values))


# name -> (significand bits, least normal exponent, largest finite)
_TARGETS = {
    "float32": (24, -126, float(np.finfo(np.float32).max)),
    "float16": (11, -14, 65504.0),
    "bfloat16": (8, -126, float((2 - 2.0**-7) * 2.0**127)),
}


def round_exact(x: np.ndarray, dtype_name: str) -> np.ndarray:
    """float64 x rounded once to nearest even in `dtype_name`, returned as float64 (inf on overflow)."""
    p, emin, top = _TARGETS[dtype_name]
    x = np.asarray(x, np.float64)
    out = np.array(x, copy=True)
    fin = np.isfinite(x) & (x != 0)
    _, e = np.frexp(x[fin])  # |x| = m 2^e, 0.5 <= m < 1: the leading bit is 2^(e - 1)
    quantum = np.maximum(e - 1, emin) - (p - 1)
    r = np.ldexp(np.rint(np.ldexp(x[fin], -quantum)), quantum)
    r = np.where(np.abs(r) > top, np.copysign(np.inf, r), r)
    out[fin] = r
    return out
