// CPU fp8 conversion loops: the encode of reshape_and_cache's fp8 writes and of
// quantize_fp8, the decode of dequantize_fp8. Bit for bit the rounding of fp8_codec.hpp.
#pragma once

#include <cstdint>

#include "pagedattn/tensor.hpp"

namespace pagedattn::cpu {

// dst[i] = fp8(src[i] / scale), i < n.
//   src  [n] float32 / float16 / bfloat16 (`dtype`), contiguous
//   dst  [n] fp8 codes of `format` (kFp8E4M3 or kFp8E5M2)
// Vectorised (AVX2) where the CPU has it and PAGEDATTN_CPU_ISA allows it.
void quantize_fp8_span(const void* src, DType dtype, float scale, KVCacheDType format, std::int64_t n,
                       std::uint8_t* dst);

// dst[i] = code src[i] * scale, rounded once to `dtype`, i < n.
//   src  [n] fp8 codes of `format`
//   dst  [n] float32 / float16 / bfloat16 (`dtype`), contiguous
void dequantize_fp8_span(const std::uint8_t* src, KVCacheDType format, float scale, std::int64_t n, void* dst,
                         DType dtype);

// The encoder quantize_fp8_span runs: "avx2" or "generic".
const char* fp8_encoder_isa();

}  // namespace pagedattn::cpu
