// quantize_fp8 / dequantize_fp8 on CUDA: one grid-stride kernel each, eight elements
// per thread and step (16-byte loads and 8-byte stores where the arrays are aligned), a
// scalar tail. The rounding is fp8_codec.hpp's, so results equal the CPU backend's bit
// for bit. The host launcher below is the only place that knows the grid.
#include <algorithm>

#include "cuda/common.cuh"
#include "fp8_convert.hpp"

namespace pagedattn::cuda_backend {
namespace {

struct Fp8KernelParams {
  const void* src;  // [n]: quantize T; dequantize uint8
  void* dst;        // [n]: quantize uint8; dequantize T
  std::int64_t n;
  std::int64_t vec_steps;  // groups of 8 elements done with vector accesses (0: all scalar)
  float scale;
};

constexpr int kThreads = 256;
constexpr int kVec = 8;

// Eight T, loaded or stored as 16-byte words.
template <class T>
struct alignas(16) Vec8 {
  T v[kVec];
};

template <class T, KVCacheDType F>
__global__ void quantize_kernel(const __grid_constant__ Fp8KernelParams p) {
  const auto* src = static_cast<const T*>(p.src);
  auto* dst = static_cast<std::uint8_t*>(p.dst);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t g = first; g < p.vec_steps; g += stride) {
    const Vec8<T> in = reinterpret_cast<const Vec8<T>*>(src)[g];
    std::uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lo |= static_cast<std::uint32_t>(encode_fp8<F>(in.v[j], p.scale)) << (8 * j);
      hi |= static_cast<std::uint32_t>(encode_fp8<F>(in.v[j + 4], p.scale)) << (8 * j);
    }
    reinterpret_cast<uint2*>(dst)[g] = make_uint2(lo, hi);
  }
  for (std::int64_t i = p.vec_steps * kVec + first; i < p.n; i += stride) dst[i] = encode_fp8<F>(src[i], p.scale);
}

// The output of code c: its value times scale, rounded once to T (exact product in double).
template <class T, KVCacheDType F>
__device__ T decode_one(int c, float scale) {
  const double exact = static_cast<double>(fp8::to_float(static_cast<std::uint8_t>(c), fp8::format_of(F))) *
                       static_cast<double>(scale);
  if constexpr (std::is_same_v<T, float>) return static_cast<float>(exact);
  else return from_float<T>(fp8::round_to_odd_float(exact));  // then to nearest even: rounded once
}

// Each block first builds the 256 outputs (one per code) in shared memory.
template <class T, KVCacheDType F>
__global__ void dequantize_kernel(const __grid_constant__ Fp8KernelParams p) {
  __shared__ alignas(16) unsigned char storage[256 * sizeof(T)];
  T* table = reinterpret_cast<T*>(storage);
  for (int c = threadIdx.x; c < 256; c += blockDim.x) table[c] = decode_one<T, F>(c, p.scale);
  __syncthreads();
  const auto* src = static_cast<const std::uint8_t*>(p.src);
  T* dst = static_cast<T*>(p.dst);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::int64_t g = first; g < p.vec_steps; g += stride) {
    const uint2 in = reinterpret_cast<const uint2*>(src)[g];
    Vec8<T> out;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out.v[j] = table[(in.x >> (8 * j)) & 0xffu];
      out.v[j + 4] = table[(in.y >> (8 * j)) & 0xffu];
    }
    reinterpret_cast<Vec8<T>*>(dst)[g] = out;
  }
  for (std::int64_t i = p.vec_steps * kVec + first; i < p.n; i += stride) dst[i] = table[src[i]];
}

template <class T, KVCacheDType F>
const void* kernel_for(bool quantize) {
  return quantize ? reinterpret_cast<const void*>(&quantize_kernel<T, F>)
                  : reinterpret_cast<const void*>(&dequantize_kernel<T, F>);
}

template <class T>
const void* pick_kernel(KVCacheDType format, bool quantize) {
  switch (format) {
    case KVCacheDType::kFp8E4M3: return kernel_for<T, KVCacheDType::kFp8E4M3>(quantize);
    case KVCacheDType::kFp8E5M2: return kernel_for<T, KVCacheDType::kFp8E5M2>(quantize);
    default: break;
  }
  fail<InvalidArgument>("fp8_dtype: expected \"fp8_e4m3\" or \"fp8_e5m2\", got \"", kv_cache_dtype_name(format), "\"");
}

}  // namespace

void convert_fp8(const Fp8ConvertParams& p, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device_id);
  if (p.n == 0) return;
  const void* fn = nullptr;
  switch (p.dtype) {
    case DType::kFloat32: fn = pick_kernel<float>(p.format, p.quantize); break;
    case DType::kFloat16: fn = pick_kernel<__half>(p.format, p.quantize); break;
    case DType::kBFloat16: fn = pick_kernel<__nv_bfloat16>(p.format, p.quantize); break;
    default:
      fail<NotSupported>(p.quantize ? "quantize_fp8" : "dequantize_fp8", " (CUDA): dtype ", dtype_name(p.dtype),
                         " is not supported; supported: float32, float16, bfloat16");
  }
  Fp8KernelParams k{};
  k.src = p.src;
  k.dst = p.dst;
  k.n = p.n;
  k.scale = p.scale;
  // Vector accesses need the wide array 16-byte aligned and the codes 8-byte aligned.
  const auto wide = reinterpret_cast<std::uintptr_t>(p.quantize ? p.src : p.dst);
  const auto codes = reinterpret_cast<std::uintptr_t>(p.quantize ? p.dst : p.src);
  const bool aligned = wide % 16 == 0 && codes % 8 == 0 && (kVec * dtype_size(p.dtype)) % 16 == 0;
  k.vec_steps = aligned ? p.n / kVec : 0;
  const std::int64_t work = std::max<std::int64_t>(k.vec_steps, p.n - k.vec_steps * kVec);
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((work + kThreads - 1) / kThreads, 8192));
  void* args[] = {&k};
  const char* what = p.quantize ? "quantize_fp8: kernel launch" : "dequantize_fp8: kernel launch";
  check_cuda(cudaLaunchKernel(fn, dim3(blocks), dim3(kThreads), args, 0, stream), what);
  check_launch(p.quantize ? "quantize_fp8" : "dequantize_fp8");
}

}  // namespace pagedattn::cuda_backend
