// quantize_fp8 / dequantize_fp8 (pagedattn/fp8.hpp): one validation pass, the host
// implementation (cpu_fp8.cpp's loops over chunks, in parallel), and the routing to CUDA.
#include "fp8_convert.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "cpu_fp8.hpp"
#include "device_checks.hpp"
#include "pagedattn/errors.hpp"
#include "pagedattn/fp8.hpp"
#include "thread_pool.hpp"

namespace pagedattn {
namespace {

bool is_float_dtype(DType t) { return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16; }

// Checks both arrays; returns the parameters of the conversion. `op` names the function
// for the few messages that need it.
Fp8ConvertParams check(const TensorView& src, const TensorView& dst, float scale, KVCacheDType fp8_dtype,
                       bool quantize) {
  for (const auto* t : {&src, &dst})
    if (t->device == DeviceKind::kOther)
      fail<TypeMismatch>(t == &src ? "src" : "dst",
                         ": arrays on this device type are not supported (expected cpu or cuda)");
  if (dst.read_only) fail<InvalidArgument>("dst: the array is read-only; pagedattn writes into it");
  if (fp8_dtype != KVCacheDType::kFp8E4M3 && fp8_dtype != KVCacheDType::kFp8E5M2)
    fail<InvalidArgument>("fp8_dtype: expected \"fp8_e4m3\" or \"fp8_e5m2\", got \"", kv_cache_dtype_name(fp8_dtype),
                          "\"");
  if (!std::isfinite(scale) || scale <= 0.0f)
    fail<InvalidArgument>("scale: must be a finite positive number, got ", scale);
  if (!std::isnormal(scale))
    fail<InvalidArgument>("scale: must be at least ", std::numeric_limits<float>::min(),
                          " (the smallest normal float32), got ", scale);
  const TensorView& wide = quantize ? src : dst;
  const TensorView& codes = quantize ? dst : src;
  const char* wide_name = quantize ? "src" : "dst";
  const char* codes_name = quantize ? "dst" : "src";
  if (!is_float_dtype(wide.dtype))
    fail<TypeMismatch>(wide_name, ": expected dtype float32, float16 or bfloat16, got ", dtype_name(wide.dtype));
  if (codes.dtype != DType::kUInt8)
    fail<TypeMismatch>(codes_name, ": expected dtype uint8 (fp8 codes), got ", dtype_name(codes.dtype));
  bool same_shape = src.ndim == dst.ndim;
  for (int d = 0; same_shape && d < src.ndim; ++d) same_shape = src.size(d) == dst.size(d);
  if (!same_shape) fail<InvalidArgument>("dst: shape ", dst.shape_str(), " must equal src's shape ", src.shape_str());
  if (!src.is_contiguous()) fail<InvalidArgument>("src: must be C-contiguous (shape ", src.shape_str(), ")");
  if (!dst.is_contiguous()) fail<InvalidArgument>("dst: must be C-contiguous (shape ", dst.shape_str(), ")");
  if (!detail::same_device(src, dst))
    fail<InvalidArgument>("dst is on ", detail::where(dst), " but src is on ", detail::where(src),
                          "; both must be in host memory or on the same GPU");
  detail::check_disjoint(dst, "dst", src, "src");
  Fp8ConvertParams p;
  p.src = src.data;
  p.dst = dst.data;
  p.n = src.numel();
  p.dtype = wide.dtype;
  p.format = fp8_dtype;
  p.scale = scale;
  p.quantize = quantize;
  p.device_id = src.device == DeviceKind::kCUDA ? src.device_id : 0;
  return p;
}

// Host arrays: chunks of kChunk elements spread over the thread pool.
void convert_on_host(const Fp8ConvertParams& p) {
  constexpr std::int64_t kChunk = 1 << 16;
  const std::int64_t chunks = (p.n + kChunk - 1) / kChunk;
  const std::size_t wide = dtype_size(p.dtype);
  cpu::parallel_for(chunks, [&](std::int64_t c) {
    const std::int64_t i0 = c * kChunk, n = std::min(kChunk, p.n - i0);
    if (p.quantize)
      cpu::quantize_fp8_span(static_cast<const char*>(p.src) + i0 * static_cast<std::int64_t>(wide), p.dtype, p.scale,
                             p.format, n, static_cast<std::uint8_t*>(p.dst) + i0);
    else
      cpu::dequantize_fp8_span(static_cast<const std::uint8_t*>(p.src) + i0, p.format, p.scale, n,
                               static_cast<char*>(p.dst) + i0 * static_cast<std::int64_t>(wide), p.dtype);
  });
}

void run(const Fp8ConvertParams& p, bool cuda, void* stream) {
  if (p.n == 0) return;
  if (cuda) cuda_backend::convert_fp8(p, stream);
  else convert_on_host(p);
}

}  // namespace

void quantize_fp8(const TensorView& src, const TensorView& dst, float scale, KVCacheDType fp8_dtype, void* stream) {
  run(check(src, dst, scale, fp8_dtype, /*quantize=*/true), src.device == DeviceKind::kCUDA, stream);
}

void dequantize_fp8(const TensorView& src, const TensorView& dst, float scale, KVCacheDType fp8_dtype, void* stream) {
  run(check(src, dst, scale, fp8_dtype, /*quantize=*/false), src.device == DeviceKind::kCUDA, stream);
}

#ifndef PAGEDATTN_WITH_CUDA
// Without the CUDA backend (the validation above refuses nothing device-specific, so this
// is where CUDA arrays stop).
void cuda_backend::convert_fp8(const Fp8ConvertParams& p, void*) {
  fail<NotSupported>(p.quantize ? "quantize_fp8" : "dequantize_fp8",
                     ": this build of pagedattn has no CUDA backend (built without nvcc)");
}
#endif

}  // namespace pagedattn
