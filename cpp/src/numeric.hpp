// Scalar conversions between float32 and the storage types the CPU backend reads and
// writes: float16, bfloat16 and the two fp8 formats (fp8_codec.hpp). All rounding is to
// nearest even; fp8 conversions saturate finite overflow (and infinity) to the largest
// finite value.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp8_codec.hpp"

namespace pagedattn::numeric {

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// --- bfloat16 -------------------------------------------------------------------------
inline float bf16_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }
inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

// --- float16 --------------------------------------------------------------------------
inline float half_to_float_slow(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp == 0) {                                                          // zero / subnormal
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}
// Table-driven conversion (256 KiB table built once).
float half_to_float(std::uint16_t h);

inline std::uint16_t float_to_half(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a < 0x38800000u) {  // below the smallest normal half: a multiple of 2^-24
    const auto m = static_cast<std::uint32_t>(std::nearbyint(bits_float(a) * 16777216.0f));
    return static_cast<std::uint16_t>(sign | m);
  }
  std::uint32_t h = ((((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13));
  const std::uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

// --- fp8 ------------------------------------------------------------------------------
// The formats and their rounding are defined once, in fp8_codec.hpp (shared with the
// CUDA kernels); the decode tables below are built from it.

// 256-entry decode tables (built once).
const float* fp8_e4m3_table();
const float* fp8_e5m2_table();

}  // namespace pagedattn::numeric
