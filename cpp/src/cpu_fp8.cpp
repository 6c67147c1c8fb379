// CPU fp8 encode / decode loops (cpu_fp8.hpp). The generic encoder calls fp8_codec.hpp
// per element; the AVX2 one computes the same function four doubles at a time:
//   q = src / scale in double (exact enough: fp8_codec.hpp), then
//   normal fp8 range:    round the double's bits to mant_bits with an integer add,
//   subnormal fp8 range: add 2^(emin - mant_bits + 52), whose double spacing is the fp8
//                        subnormal spacing, so the hardware add rounds to nearest even,
// then clamp to the largest finite code, NaN -> the NaN code, and put the sign back.
#include "cpu_fp8.hpp"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "fp8_codec.hpp"
#include "numeric.hpp"
#include "pagedattn/errors.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PAGEDATTN_FP8_X86 1
#endif

namespace pagedattn::cpu {
namespace {

// Element i of a float32 / float16 / bfloat16 array, as float.
template <DType D>
float load_one(const void* src, std::int64_t i) {
  if constexpr (D == DType::kFloat32) return static_cast<const float*>(src)[i];
  else if constexpr (D == DType::kFloat16) return numeric::half_to_float(static_cast<const std::uint16_t*>(src)[i]);
  else return numeric::bf16_to_float(static_cast<const std::uint16_t*>(src)[i]);
}

template <DType D>
void quantize_range(const void* src, float scale, const fp8::Format& f, std::int64_t i0, std::int64_t n,
                    std::uint8_t* dst) {
  for (std::int64_t i = i0; i < n; ++i) dst[i] = fp8::encode(load_one<D>(src, i), scale, f);
}

// Elements [i0, n) one at a time (fp8_codec.hpp's function itself).
void quantize_generic(const void* src, DType dtype, float scale, const fp8::Format& f, std::int64_t i0,
                      std::int64_t n, std::uint8_t* dst) {
  switch (dtype) {
    case DType::kFloat32: return quantize_range<DType::kFloat32>(src, scale, f, i0, n, dst);
    case DType::kFloat16: return quantize_range<DType::kFloat16>(src, scale, f, i0, n, dst);
    case DType::kBFloat16: return quantize_range<DType::kBFloat16>(src, scale, f, i0, n, dst);
    default: fail<NotSupported>("fp8 encode: unsupported source dtype ", dtype_name(dtype));
  }
}

#ifdef PAGEDATTN_FP8_X86
#define PAGEDATTN_AVX2 __attribute__((target("avx2,fma,f16c")))

// 2^e for a normal double exponent e.
inline double pow2(int e) {
  const std::uint64_t b = static_cast<std::uint64_t>(e + 1023) << 52;
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
}

// Four doubles -> four fp8 codes (one per 64-bit lane), as fp8::from_double.
PAGEDATTN_AVX2 inline __m256i encode4(__m256d q, const fp8::Format& f) {
  const __m256i sign_bit = _mm256_set1_epi64x(static_cast<long long>(0x8000000000000000ull));
  const __m256i u = _mm256_castpd_si256(q);
  const __m256i sign = _mm256_srli_epi64(_mm256_and_si256(u, sign_bit), 56);
  const __m256i a = _mm256_andnot_si256(sign_bit, u);
  const __m256i nan = _mm256_cmpgt_epi64(a, _mm256_set1_epi64x(0x7ff0000000000000ll));
  const int sh = 52 - f.mant_bits, emin = 1 - f.bias;
  // Normal: round the bits to nearest even at bit `sh`, then rebias the exponent.
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi64(a, sh), _mm256_set1_epi64x(1));
  const __m256i r = _mm256_add_epi64(a, _mm256_add_epi64(_mm256_set1_epi64x((1ll << (sh - 1)) - 1), lsb));
  const __m256i normal = _mm256_sub_epi64(_mm256_srli_epi64(r, sh),
                                          _mm256_set1_epi64x(static_cast<long long>(1023 - f.bias) << f.mant_bits));
  // Subnormal: the bits of a + C above C's are the code.
  const __m256d c = _mm256_set1_pd(pow2(emin - f.mant_bits + 52));
  const __m256i sub = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(_mm256_castsi256_pd(a), c)),
                                       _mm256_castpd_si256(c));
  const __m256i is_sub =
      _mm256_cmpgt_epi64(_mm256_set1_epi64x(static_cast<long long>(emin + 1023) << 52), a);
  __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
  const __m256i maxc = _mm256_set1_epi64x(f.max_code);
  code = _mm256_blendv_epi8(code, maxc, _mm256_cmpgt_epi64(code, maxc));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi64x(f.nan_code), nan);
  return _mm256_or_si256(code, sign);
}

// Eight float32 -> eight codes, stored at dst.
PAGEDATTN_AVX2 inline void encode8(__m256 v, __m256d scale, const fp8::Format& f, std::uint8_t* dst) {
  const __m256d lo = _mm256_div_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), scale);
  const __m256d hi = _mm256_div_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), scale);
  const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m128i c0 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(encode4(lo, f), idx));
  const __m128i c1 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(encode4(hi, f), idx));
  const __m128i w = _mm_packus_epi32(c0, c1);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(w, w));
}

PAGEDATTN_AVX2 void quantize_avx2(const void* src, DType dtype, float scale, const fp8::Format& f, std::int64_t n,
                                  std::uint8_t* dst) {
  const __m256d s = _mm256_set1_pd(static_cast<double>(scale));
  std::int64_t i = 0;
  switch (dtype) {
    case DType::kFloat32: {
      const auto* p = static_cast<const float*>(src);
      for (; i + 8 <= n; i += 8) encode8(_mm256_loadu_ps(p + i), s, f, dst + i);
      break;
    }
    case DType::kFloat16: {
      const auto* p = static_cast<const std::uint16_t*>(src);
      for (; i + 8 <= n; i += 8)
        encode8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))), s, f, dst + i);
      break;
    }
    case DType::kBFloat16: {
      const auto* p = static_cast<const std::uint16_t*>(src);
      for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
        encode8(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), s, f, dst + i);
      }
      break;
    }
    default:
      break;  // the generic tail below refuses it
  }
  quantize_generic(src, dtype, scale, f, i, n, dst);
}
#endif

// The best encoder this CPU runs. PAGEDATTN_CPU_ISA caps the choice as for the other
// CPU kernels (avx512bf16, avx512, avx2: AVX2 allowed; generic: the scalar loop).
bool use_avx2() {
#ifdef PAGEDATTN_FP8_X86
  static const bool use = [] {
    const char* env = std::getenv("PAGEDATTN_CPU_ISA");
    if (env && std::strcmp(env, "generic") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  }();
  return use;
#else
  return false;
#endif
}

// Writes `n` outputs of dtype T from a 256-entry table (one per code).
template <class T>
void lookup(const std::uint8_t* src, std::int64_t n, const T* table, void* dst) {
  auto* d = static_cast<T*>(dst);
  for (std::int64_t i = 0; i < n; ++i) d[i] = table[src[i]];
}

}  // namespace

const char* fp8_encoder_isa() { return use_avx2() ? "avx2" : "generic"; }

void quantize_fp8_span(const void* src, DType dtype, float scale, KVCacheDType format, std::int64_t n,
                       std::uint8_t* dst) {
  const fp8::Format f = fp8::format_of(format);
#ifdef PAGEDATTN_FP8_X86
  if (use_avx2()) {
    quantize_avx2(src, dtype, scale, f, n, dst);
    return;
  }
#endif
  quantize_generic(src, dtype, scale, f, 0, n, dst);
}

void dequantize_fp8_span(const std::uint8_t* src, KVCacheDType format, float scale, std::int64_t n, void* dst,
                         DType dtype) {
  // 256 codes: build the rounded output of each once, then look every element up.
  const fp8::Format f = fp8::format_of(format);
  double exact[256];  // code * scale: at most 4 + 24 significant bits, exact in double
  for (int c = 0; c < 256; ++c)
    exact[c] = static_cast<double>(fp8::to_float(static_cast<std::uint8_t>(c), f)) * static_cast<double>(scale);
  switch (dtype) {
    case DType::kFloat32: {
      float t[256];
      for (int c = 0; c < 256; ++c) t[c] = static_cast<float>(exact[c]);
      lookup(src, n, t, dst);
      return;
    }
    case DType::kFloat16: {
      std::uint16_t t[256];
      for (int c = 0; c < 256; ++c) t[c] = numeric::float_to_half(fp8::round_to_odd_float(exact[c]));
      lookup(src, n, t, dst);
      return;
    }
    case DType::kBFloat16: {
      std::uint16_t t[256];
      for (int c = 0; c < 256; ++c) t[c] = numeric::float_to_bf16(fp8::round_to_odd_float(exact[c]));
      lookup(src, n, t, dst);
      return;
    }
    default:
      fail<NotSupported>("fp8 decode: unsupported output dtype ", dtype_name(dtype));
  }
}

}  // namespace pagedattn::cpu
