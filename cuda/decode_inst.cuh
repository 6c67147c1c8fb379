// Maps a runtime (head size, layout) to one instantiated decode kernel of a dtype and
// cache kind. Each inst_decode_*.cu file instantiates one (dtype, cache kind) pair, so
// the kernels compile in parallel; the launcher only sees the declarations below.
// The head sizes with a kernel of their own are supported::kCudaHeadSizes itself: the
// dispatch below is generated from that list, so the two cannot drift apart.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "cuda/common.cuh"
#include "pagedattn/supported.hpp"

namespace pagedattn::cuda_backend {

struct DecodeKernelInfo {
  const void* func = nullptr;  // __global__ void (DecodeKernelParams)
  int threads = 0;
  int smem = 0;  // dynamic shared memory bytes
  int rows = 0;  // query heads per CTA
  double cta_bw = 26.0e3;  // bytes per us one CTA pulls alone (the planner's model)
  // Kernels that also run narrower CTAs (the transposed fp8 ones: half the warps), chosen
  // per call by the launch plan; 0: one width only.
  int narrow_threads = 0;
  int narrow_smem = 0;
  const char* name = "";  // varlen kernels: the family, as decode_plan reports it
};

// The specialised list must be usable as kernel template arguments: ascending (so no
// duplicates), each a multiple of the head-size alignment and within the generic path's
// capacity (every specialised size is also a size the generic path could serve).
constexpr bool valid_specialised_heads() {
  const auto& h = supported::kCudaHeadSizes;
  for (std::size_t i = 0; i < h.size(); ++i) {
    if (h[i] <= 0 || h[i] > supported::kCudaMaxHeadSize || h[i] % supported::kCudaHeadSizeAlign != 0) return false;
    if (i > 0 && h[i] <= h[i - 1]) return false;
  }
  return true;
}
static_assert(valid_specialised_heads(),
              "supported::kCudaHeadSizes must be ascending multiples of kCudaHeadSizeAlign up to kCudaMaxHeadSize");

template <int V>
using IntC = std::integral_constant<int, V>;

template <class Fn, std::size_t... I>
DecodeKernelInfo dispatch_head_impl(int head, Fn& fn, std::index_sequence<I...>) {
  DecodeKernelInfo info;
  const bool specialised =
      ((head == supported::kCudaHeadSizes[I] && (info = fn(IntC<supported::kCudaHeadSizes[I]>{}), true)) || ...);
  if (specialised) return info;
  if (supported::is_cuda_head_size(head)) return fn(IntC<0>{});
  fail<NotSupported>("head_size ", head, " is not supported on CUDA; supported: ", supported::cuda_head_sizes_str());
}

// Calls fn(IntC<HEAD>{}) for a head size of supported::kCudaHeadSizes, IntC<0>{} for
// the generic path (capacity supported::kCudaMaxHeadSize, runtime head size).
template <class Fn>
DecodeKernelInfo dispatch_head(int head, Fn&& fn) {
  return dispatch_head_impl(head, fn, std::make_index_sequence<supported::kCudaHeadSizes.size()>{});
}

template <class Fn>
DecodeKernelInfo dispatch_layout(CacheLayout l, Fn&& fn) {
  switch (l) {
    case CacheLayout::kVLLM: return fn(std::integral_constant<CacheLayout, CacheLayout::kVLLM>{});
    // hnd is nhd with other row strides (DecodeKernelParams::tok_stride / head_stride):
    // the token-major kernels serve both, no instantiation of its own.
    case CacheLayout::kNHD:
    case CacheLayout::kHND: return fn(std::integral_constant<CacheLayout, CacheLayout::kNHD>{});
  }
  fail<InvalidArgument>("layout: unknown cache layout ", static_cast<int>(l));
}

// Defined in inst_decode_*.cu (T = __half / __nv_bfloat16: tensor-core kernel;
// T = float: CUDA-core kernel). The page size picks the vllm kernel (pages of 2, 4, 8), the
// group size (query heads per KV head) the transposed fp8 kernels (groups of up to 8).
template <class T, KVCacheDType F>
DecodeKernelInfo decode_kernel(int head, CacheLayout layout, int block_size, int group);

// Defined in cuda/prefill_inst.cuh, instantiated in inst_prefill_*.cu: the varlen kernel of
// a (query dtype, cache kind) pair for a head size and layout. Declared here so that the
// launcher does not instantiate (and embed a second copy of) every varlen kernel.
template <class T, KVCacheDType F>
DecodeKernelInfo prefill_kernel(int head, CacheLayout layout);

}  // namespace pagedattn::cuda_backend
