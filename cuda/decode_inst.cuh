// Maps a runtime (head size, layout) to one instantiated decode kernel of a dtype and
// cache kind. Each inst_decode_*.cu file instantiates one (dtype, cache kind) pair, so
// the kernels compile in parallel; decode_launch.cu only sees the declarations below.
#pragma once

#include "cuda/common.cuh"
#include "pagedattn/supported.hpp"

namespace pagedattn::cuda_backend {

struct DecodeKernelInfo {
  const void* func = nullptr;  // __global__ void (DecodeKernelParams)
  int threads = 0;
  int smem = 0;  // dynamic shared memory bytes
  int rows = 0;  // query heads per CTA
};

// Head sizes with their own kernel; everything else that supported.hpp accepts runs
// the generic one (HEAD = 0: capacity 256, runtime head size).
inline constexpr std::array<int, 7> kSpecialisedHeads = {64, 80, 96, 112, 128, 192, 256};
constexpr bool same_heads() {
  for (std::size_t i = 0; i < kSpecialisedHeads.size(); ++i)
    if (kSpecialisedHeads[i] != supported::kCudaHeadSizes[i]) return false;
  return kSpecialisedHeads.size() == supported::kCudaHeadSizes.size();
}
static_assert(same_heads(), "update the head-size dispatch (decode_inst.cuh) together with supported.hpp");

template <int V>
using IntC = std::integral_constant<int, V>;

// Calls fn(IntC<HEAD>{}) for the specialised head size, IntC<0> for the generic path.
template <class Fn>
DecodeKernelInfo dispatch_head(int head, Fn&& fn) {
  switch (head) {
    case 64: return fn(IntC<64>{});
    case 80: return fn(IntC<80>{});
    case 96: return fn(IntC<96>{});
    case 112: return fn(IntC<112>{});
    case 128: return fn(IntC<128>{});
    case 192: return fn(IntC<192>{});
    case 256: return fn(IntC<256>{});
    default:
      if (supported::is_cuda_head_size(head)) return fn(IntC<0>{});
      fail<NotSupported>("head_size ", head, " is not supported on CUDA; supported: ", supported::cuda_head_sizes_str());
  }
}

template <class Fn>
DecodeKernelInfo dispatch_layout(CacheLayout l, Fn&& fn) {
  switch (l) {
    case CacheLayout::kVLLM: return fn(std::integral_constant<CacheLayout, CacheLayout::kVLLM>{});
    case CacheLayout::kNHD: return fn(std::integral_constant<CacheLayout, CacheLayout::kNHD>{});
  }
  fail<InvalidArgument>("layout: unknown cache layout ", static_cast<int>(l));
}

// Defined in inst_decode_*.cu (T = __half / __nv_bfloat16: tensor-core kernel;
// T = float: CUDA-core kernel).
template <class T, Fp8 F>
DecodeKernelInfo decode_kernel(int head, CacheLayout layout);

}  // namespace pagedattn::cuda_backend
