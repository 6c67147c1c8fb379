// fp8 conversions in the format of pagedattn's fp8 KV caches, so callers can fill and
// inspect such caches (or anything else stored as fp8 bytes) without re-implementing it.
//
// Formats (KVCacheDType): kFp8E4M3 (bias 7, no infinities, NaN 0x7f / 0xff, largest
// finite 448) and kFp8E5M2 (bias 15, IEEE-like, largest finite 57344), one byte per
// element in uint8 arrays, with a per-tensor scale: real value = fp8 value * scale.
//
// Both take arrays of any shape (the same shape for src and dst), C-contiguous, in host
// memory or on one GPU (both on the same device), not sharing memory. On a GPU the work
// is queued on `stream` (a cudaStream_t; null: the default stream) and the call returns
// without waiting. Errors: InvalidArgument (shape, layout, scale, overlap, read-only dst),
// TypeMismatch (dtypes, devices), NotSupported (CUDA arrays in a build without CUDA).
#pragma once

#include "pagedattn/tensor.hpp"

namespace pagedattn {

// dst = fp8(src / scale): the exact quotient rounded once to the nearest fp8 value (ties
// to the even code); finite values beyond the largest finite fp8 value and infinities
// saturate to it, keeping the sign; NaN stays NaN (e4m3 0x7f, e5m2 0x7e, sign kept).
// reshape_and_cache's fp8 writes store exactly these codes.
//   src     float32 / float16 / bfloat16, any shape
//   dst     uint8, src's shape
//   scale   a finite positive normal float32
//   fp8_dtype  kFp8E4M3 or kFp8E5M2 (InvalidArgument for kAuto)
void quantize_fp8(const TensorView& src, const TensorView& dst, float scale = 1.0f,
                  KVCacheDType fp8_dtype = KVCacheDType::kFp8E4M3, void* stream = nullptr);

// dst = fp8 value of src * scale, rounded once (to nearest even) to dst's dtype; NaN
// codes give NaN, e5m2's infinities give infinities.
//   src     uint8 fp8 codes of `fp8_dtype`, any shape
//   dst     float32 / float16 / bfloat16, src's shape
void dequantize_fp8(const TensorView& src, const TensorView& dst, float scale = 1.0f,
                    KVCacheDType fp8_dtype = KVCacheDType::kFp8E4M3, void* stream = nullptr);

}  // namespace pagedattn
