// Element load/store helpers of the CPU backend: every storage type is read into and
// written from float32.
#pragma once

#include <cstdint>

#include "cpu_fp8.hpp"
#include "numeric.hpp"
#include "params.hpp"

namespace pagedattn::cpu {

// float16 -> float32 for a row: hardware conversion (F16C) where the CPU has it,
// else a table lookup. Defined in cpu_simd.cpp.
void half_to_float_row(const std::uint16_t* src, float* dst, int n);
// float32 -> float16 for a row, bit for bit numeric::float_to_half (round to nearest even,
// NaN as sign | 0x7e00): F16C where the CPU has it. Defined in cpu_simd.cpp.
void float_to_half_row(const float* src, std::uint16_t* dst, int n);

// Reads n elements of the given storage type starting at src into dst (as float),
// multiplied by `scale` (1 for non-fp8 types).
inline void load_row(const void* src, DType dtype, KVCacheDType kv, float scale, int n, float* dst) {
  if (kv == KVCacheDType::kFp8E4M3 || kv == KVCacheDType::kFp8E5M2) {
    const float* table = kv == KVCacheDType::kFp8E4M3 ? numeric::fp8_e4m3_table() : numeric::fp8_e5m2_table();
    const auto* s = static_cast<const std::uint8_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = table[s[i]] * scale;
    return;
  }
  switch (dtype) {
    case DType::kFloat32: {
      const auto* s = static_cast<const float*>(src);
      for (int i = 0; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DType::kFloat16:
      half_to_float_row(static_cast<const std::uint16_t*>(src), dst, n);
      return;
    case DType::kBFloat16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (int i = 0; i < n; ++i) dst[i] = numeric::bf16_to_float(s[i]);
      return;
    }
    default:
      fail<NotSupported>("CPU backend: unsupported element dtype ", dtype_name(dtype));
  }
}

// Writes n floats from src into dst in the given storage type (fp8: fp8(src / scale),
// fp8_codec.hpp).
inline void store_row(const float* src, DType dtype, KVCacheDType kv, float scale, int n, void* dst) {
  if (kv == KVCacheDType::kFp8E4M3 || kv == KVCacheDType::kFp8E5M2) {
    quantize_fp8_span(src, DType::kFloat32, scale, kv, n, static_cast<std::uint8_t*>(dst));
    return;
  }
  switch (dtype) {
    case DType::kFloat32: {
      auto* d = static_cast<float*>(dst);
      for (int i = 0; i < n; ++i) d[i] = src[i];
      return;
    }
    case DType::kFloat16:
      float_to_half_row(src, static_cast<std::uint16_t*>(dst), n);
      return;
    case DType::kBFloat16: {
      auto* d = static_cast<std::uint16_t*>(dst);
      for (int i = 0; i < n; ++i) d[i] = numeric::float_to_bf16(src[i]);
      return;
    }
    default:
      fail<NotSupported>("CPU backend: unsupported element dtype ", dtype_name(dtype));
  }
}

}  // namespace pagedattn::cpu
