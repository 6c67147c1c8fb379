// quantize_fp8 / dequantize_fp8 between the validating front end (fp8_convert.cpp) and
// the CUDA backend (cuda/fp8_convert.cu).
#pragma once

#include <cstdint>

#include "pagedattn/tensor.hpp"

namespace pagedattn {

// Legend: n = number of elements of src (and dst).
struct Fp8ConvertParams {
  const void* src = nullptr;  // [n]: quantize: `dtype`; dequantize: uint8 codes
  void* dst = nullptr;        // [n]: quantize: uint8 codes; dequantize: `dtype`
  std::int64_t n = 0;
  DType dtype = DType::kFloat32;  // the wide side: float32, float16 or bfloat16
  KVCacheDType format = KVCacheDType::kFp8E4M3;
  float scale = 1.0f;
  bool quantize = true;  // true: dtype -> fp8; false: fp8 -> dtype
  int device_id = 0;
};

namespace cuda_backend {
// All arguments validated; device pointers; stream is a cudaStream_t. Without CUDA it
// throws NotSupported (fp8_convert.cpp).
void convert_fp8(const Fp8ConvertParams& p, void* stream);
}  // namespace cuda_backend

}  // namespace pagedattn
