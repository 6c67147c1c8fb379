// Device helpers shared by every CUDA kernel family of pagedattn: error checking, the
// current-device guard, element types and conversions (f16, bf16, fp8), cp.async and
// warp reductions. Device properties and capture state: cuda/device.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "fp8_codec.hpp"
#include "pagedattn/errors.hpp"
#include "params.hpp"

namespace pagedattn::cuda_backend {

// ---------------------------------------------------------------------------------
// Host: error checks
// ---------------------------------------------------------------------------------
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail<CudaError>(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}
// After every launch: a bad configuration shows here, not at the next unrelated call.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Sets the current device for the lifetime of the object, restoring the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    else prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// ---------------------------------------------------------------------------------
// Device: element types
// ---------------------------------------------------------------------------------
// Cache storage kinds are KVCacheDType (supported.hpp): kAuto, the cache holds the
// query's dtype; kFp8E4M3 / kFp8E5M2, fp8 bytes of one format.

template <class T>
struct Pack2;  // two elements in 32 bits
template <>
struct Pack2<__half> {
  using type = __half2;
};
template <>
struct Pack2<__nv_bfloat16> {
  using type = __nv_bfloat162;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Two floats -> 32 bits of packed f16 / bf16 (element 0 in the low half).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ std::uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&h);
}
template <>
__device__ __forceinline__ std::uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&h);
}

// fp8 -> float (one byte).
template <KVCacheDType F>
__device__ __forceinline__ float fp8_to_float(std::uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v),
                                               F == KVCacheDType::kFp8E4M3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(h));
}

// Two fp8 bytes (low 16 bits of `v`) -> 32 bits of packed T. e4m3 and e5m2 values are
// exact in f16 and in bf16, so this conversion loses nothing.
template <class T, KVCacheDType F>
__device__ __forceinline__ std::uint32_t fp8x2_to(std::uint32_t v) {
  const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu),
                                                    F == KVCacheDType::kFp8E4M3 ? __NV_E4M3 : __NV_E5M2);
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<std::uint32_t>(h2.x) | (static_cast<std::uint32_t>(h2.y) << 16);
  } else {
    const float2 f = __half22float2(__half2(h2));
    return pack2<T>(f.x, f.y);
  }
}

// An element as the float the fp8 encoder takes: exact, and with the sign of a NaN
// kept, since the stored code keeps it (-NaN: 0xff e4m3, 0xfe e5m2). Not to_float:
// __half2float compiles to an f16 add on sm_80+ (HADD2.F32), whose NaN result is the
// canonical, positive NaN. It converts every other value exactly, sign included, so
// OR-ing the f16 sign bit back in changes NaN only. bf16 -> float is the bits shifted.
__device__ __forceinline__ float fp8_source_float(float v) { return v; }
__device__ __forceinline__ float fp8_source_float(__half v) {
  const std::uint32_t sign = static_cast<std::uint32_t>(__half_as_ushort(v) & 0x8000u) << 16;
  return __uint_as_float(__float_as_uint(__half2float(v)) | sign);
}
__device__ __forceinline__ float fp8_source_float(__nv_bfloat16 v) {
  return __uint_as_float(static_cast<std::uint32_t>(__bfloat16_as_ushort(v)) << 16);
}

// The stored fp8 byte of v / scale for an element v (float, f16 or bf16): the exact
// quotient rounded to nearest even, saturating, NaN kept with its sign (fp8_codec.hpp,
// the definition the CPU backend shares). Pass the element itself, not to_float of it.
template <KVCacheDType F, class T>
__device__ __forceinline__ std::uint8_t encode_fp8(T v, float scale) {
  return fp8::encode(fp8_source_float(v), scale, fp8::format_of(F));
}

// ---------------------------------------------------------------------------------
// Device: asynchronous copies global -> shared (sm_80+)
// ---------------------------------------------------------------------------------
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
// Copies `src_bytes` (0..16) bytes and fills the rest of the 16 with zeros. With
// src_bytes == 0 nothing is read from `src`.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// mbarriers in shared memory (a's shared-space address, smem_addr): the Hopper varlen kernel's
// stage ring and the decode kernel of wide value rows (decode_mma.cuh) hand stages between
// threads through them.
__device__ __forceinline__ void mbar_init(std::uint32_t a, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t a) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(a) : "memory");
}
// Arrives once this thread's earlier cp.async copies have landed (the thread goes on).
__device__ __forceinline__ void mbar_arrive_cp_async(std::uint32_t a) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(a) : "memory");
}
// Waits until the phase of the given parity has completed (try_wait suspends the thread in
// hardware on sm_90; sm_80 polls with test_wait).
__device__ __forceinline__ void mbar_wait(std::uint32_t a, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(a),
      "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(a),
      "r"(parity)
      : "memory");
#endif
}

// ---------------------------------------------------------------------------------
// Device: warp helpers
// ---------------------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

constexpr float kLog2e = 1.4426950408889634f;

// The soft cap on a base-2 logit x: cap * tanh(x / cap), with cap = soft_cap * log2(e)
// and inv_cap its reciprocal, as cap - 2 cap / (e^(2x/cap) + 1): one MUFU exponential and
// one MUFU reciprocal (e^(2x/cap) reaching 0 or inf gives -cap or cap), 5 instructions
// where tanhf takes 16. Its error is absolute, within about cap * 2^-21, since the
// difference cancels near x = 0: under 5e-4 for caps up to kSoftCapFastMax, beside the
// float16 output's 2^-11. Larger caps (kFast false) take, below |x / cap| = 1/16,
// y (1 - y^2/3 + 2y^4/15) with y = x / cap (relative error under 2^-27), so even a cap of
// 1e30 leaves the logits as they are: 12 instructions, no branch. The tensor-core decode
// kernels pick the form per call (with_soft_cap_form); the varlen ones take the longer form
// only (two unrolled copies of a tile's loop spilled them); the float32 (CUDA-core) kernels,
// whose outputs are float32, keep tanhf.
constexpr float kSoftCapFastMax = 1024.f;
template <bool kFast>
__device__ __forceinline__ float soft_cap_logit(float x, float cap, float inv_cap) {
  const float y = x * inv_cap;
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(x * (inv_cap * (2.f * kLog2e))));
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(e + 1.f));
  if constexpr (kFast) {
    return fmaf(-2.f * cap, r, cap);
  } else {
    const float y2 = y * y;
    const float small = x * fmaf(y2, fmaf(y2, 2.f / 15.f, -1.f / 3.f), 1.f);
    return fabsf(y) < 0.0625f ? small : fmaf(-2.f * cap, r, cap);
  }
}
// Calls body(std::true_type{}) for caps the short form serves, else body(std::false_type{}):
// one uniform branch around the caller's loop, the form a compile-time choice inside it.
template <class Body>
__device__ __forceinline__ void with_soft_cap_form(float cap, Body&& body) {
  if (cap <= kSoftCapFastMax)
    body(std::true_type{});
  else
    body(std::false_type{});
}

}  // namespace pagedattn::cuda_backend
