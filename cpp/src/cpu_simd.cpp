// Vectorised element conversions of the CPU backend, chosen at run time by CPU features.
#include <cstdint>

#include "cpu_elements.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PAGEDATTN_HAVE_F16C_PATH 1
#endif

namespace pagedattn::cpu {
namespace {

#ifdef PAGEDATTN_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const std::uint16_t* src, float* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = numeric::half_to_float(src[i]);
}

// 8 floats at a time with round to nearest even; a group holding a NaN goes through the
// scalar conversion, whose NaN is canonical (the instruction keeps the payload).
__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, std::uint16_t* dst, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      for (int j = i; j < i + 8; ++j) dst[j] = numeric::float_to_half(src[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = numeric::float_to_half(src[i]);
}

bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

}  // namespace

void half_to_float_row(const std::uint16_t* src, float* dst, int n) {
#ifdef PAGEDATTN_HAVE_F16C_PATH
  if (cpu_has_f16c()) {
    half_to_float_f16c(src, dst, n);
    return;
  }
#endif
  for (int i = 0; i < n; ++i) dst[i] = numeric::half_to_float(src[i]);
}

void float_to_half_row(const float* src, std::uint16_t* dst, int n) {
#ifdef PAGEDATTN_HAVE_F16C_PATH
  if (cpu_has_f16c()) {
    float_to_half_f16c(src, dst, n);
    return;
  }
#endif
  for (int i = 0; i < n; ++i) dst[i] = numeric::float_to_half(src[i]);
}

}  // namespace pagedattn::cpu
