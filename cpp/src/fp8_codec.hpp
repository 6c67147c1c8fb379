// The one definition of pagedattn's fp8 formats, shared by the CPU backend and the CUDA
// kernels (every function here is callable from host and device code).
//
// Encoding a real value v with a per-tensor scale s stores fp8(v / s): the exact quotient
// rounded once to the nearest fp8 value, ties to the even code; finite values beyond the
// largest finite fp8 value, and infinities, saturate to it (keeping the sign); NaN stays
// NaN (sign kept: e4m3 0x7f, e5m2 0x7e, the quiet NaN). Decoding gives code * s, rounded
// once to the output type.
//
// Why the quotient is computed in double: write v = V 2^a and s = S 2^b (float32: V, S
// below 2^24) and an fp8 midpoint m = M 2^c (M below 2^5). When v / s != m, v - m s is
// a nonzero multiple of 2^min(a, b + c), which puts v / s at least m / (S M) (or, with
// v / s near m, m / (2 V)) away from m: more than m 2^-29. A float32 quotient (rounding
// error up to m 2^-24) can land on m and turn a value just beside a midpoint into a tie
// (1.1875 + 2^-23 over 1 + 2^-23 does, for e4m3); a double quotient (m 2^-53) cannot. It
// is on the same side of every midpoint as the exact quotient and equals a midpoint only
// when that does, so rounding it once more, to fp8, gives the exact quotient's rounding.
#pragma once

#include <cstdint>
#include <cstring>

#include "pagedattn/tensor.hpp"

#if defined(__CUDACC__)
#define PAGEDATTN_HD __host__ __device__ inline
#else
#define PAGEDATTN_HD inline
#endif

namespace pagedattn::fp8 {

// e4m3 ("fn" variant): bias 7, no infinities, 0x7f / 0xff NaN, largest finite 448.
// e5m2: bias 15, IEEE-like (0x7c infinity, 0x7d..0x7f NaN), largest finite 57344.
struct Format {
  int mant_bits;
  int bias;
  std::uint8_t max_code;  // the code of +largest finite
  std::uint8_t nan_code;  // the code of +NaN this library writes
};
// Functions rather than constants, so device code can use them too.
PAGEDATTN_HD constexpr Format e4m3() { return Format{3, 7, 0x7e, 0x7f}; }
PAGEDATTN_HD constexpr Format e5m2() { return Format{2, 15, 0x7b, 0x7e}; }
PAGEDATTN_HD constexpr Format format_of(KVCacheDType k) { return k == KVCacheDType::kFp8E4M3 ? e4m3() : e5m2(); }

PAGEDATTN_HD std::uint64_t double_bits(double d) {
  std::uint64_t u;
  memcpy(&u, &d, sizeof u);
  return u;
}

// x rounded to the nearest fp8 value of format (mant_bits, bias), ties to even,
// saturating; NaN -> NaN. Integer arithmetic only, so host and device agree bit for bit.
PAGEDATTN_HD std::uint8_t from_double(double x, int mant_bits, int bias, std::uint8_t max_code,
                                      std::uint8_t nan_code) {
  const std::uint64_t u = double_bits(x);
  const auto sign = static_cast<std::uint8_t>((u >> 56) & 0x80u);
  const std::uint64_t a = u & 0x7fffffffffffffffull;
  if (a > 0x7ff0000000000000ull) return static_cast<std::uint8_t>(sign | nan_code);
  const int biased = static_cast<int>(a >> 52);
  if (biased == 0) return sign;  // zero or a double subnormal: far below half the least fp8 value
  const std::uint64_t sig = (a & 0xfffffffffffffull) | (1ull << 52);  // x = sig * 2^(e - 52)
  const int e = biased - 1023;
  const int emin = 1 - bias;  // exponent of the least normal fp8 value
  // Round sig to a multiple of 2^shift, the fp8 spacing at x (the subnormal spacing below emin).
  const int shift = 52 - mant_bits + (e < emin ? emin - e : 0);
  if (shift > 53) return sign;  // below a quarter of the least subnormal: rounds to zero
  std::uint64_t q = sig >> shift;
  const std::uint64_t rem = sig & ((1ull << shift) - 1), half = 1ull << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // Normal: exponent field (e - emin + 1), mantissa q - 2^mant_bits (a carry out of the
  // mantissa moves to the next binade by itself). Subnormal: q is the code.
  const std::int64_t code =
      e < emin ? static_cast<std::int64_t>(q)
               : (static_cast<std::int64_t>(e - emin + 1) << mant_bits) + static_cast<std::int64_t>(q) -
                     (std::int64_t{1} << mant_bits);
  return static_cast<std::uint8_t>(sign | (code > max_code ? max_code : code));
}

PAGEDATTN_HD std::uint8_t from_double(double x, const Format& f) {
  return from_double(x, f.mant_bits, f.bias, f.max_code, f.nan_code);
}

// The stored code of value / scale (float32 operands; see the top of this file).
PAGEDATTN_HD std::uint8_t encode(float value, float scale, const Format& f) {
  return from_double(static_cast<double>(value) / static_cast<double>(scale), f);
}

// The real value of a code, as float (exact: every fp8 value is a float32 value).
PAGEDATTN_HD float to_float(std::uint8_t v, const Format& f) {
  const bool neg = (v & 0x80u) != 0;
  const int exp_bits = 7 - f.mant_bits;
  const int e = (v >> f.mant_bits) & ((1 << exp_bits) - 1);
  const int m = v & ((1 << f.mant_bits) - 1);
  std::uint32_t bits;
  if ((f.bias == 7 && (v & 0x7fu) == 0x7fu) || (f.bias == 15 && e == 31 && m != 0)) {
    bits = 0x7fc00000u;  // NaN
  } else if (f.bias == 15 && e == 31) {
    bits = 0x7f800000u;  // infinity
  } else if (e == 0) {  // subnormal: m * 2^(1 - bias - mant_bits), a normal float32
    if (m == 0) {
      bits = 0;
    } else {
      int shift = 0;  // normalise m to 1.xxx
      while (((m << shift) & (1 << f.mant_bits)) == 0) ++shift;
      const int mm = (m << shift) & ((1 << f.mant_bits) - 1);
      bits = static_cast<std::uint32_t>(1 - f.bias - shift + 127) << 23 |
             static_cast<std::uint32_t>(mm) << (23 - f.mant_bits);
    }
  } else {
    bits = static_cast<std::uint32_t>(e - f.bias + 127) << 23 | static_cast<std::uint32_t>(m) << (23 - f.mant_bits);
  }
  bits |= neg ? 0x80000000u : 0u;
  float r;
  memcpy(&r, &bits, sizeof r);
  return r;
}

// x rounded to float32 "to odd": x itself when exact, else the one of its two float32
// neighbours whose last significand bit is 1. Rounding that once more, to nearest even,
// to a format at least two bits narrower (float16, bfloat16) gives x correctly rounded
// to that format: how decoding rounds code * scale exactly once.
PAGEDATTN_HD float round_to_odd_float(double x) {
  const auto f = static_cast<float>(x);
  if (x != x || static_cast<double>(f) == x) return f;  // NaN or exact
  std::uint32_t b;
  memcpy(&b, &f, sizeof b);
  const double af = f < 0 ? -static_cast<double>(f) : static_cast<double>(f);
  if (af > (x < 0 ? -x : x)) --b;  // rounded away from zero: step back (infinity -> largest finite)
  b |= 1u;
  float r;
  memcpy(&r, &b, sizeof r);
  return r;
}

}  // namespace pagedattn::fp8
