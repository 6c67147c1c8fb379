// The varlen (prefill) kernels of one (dtype, cache kind) pair, instantiated in
// inst_prefill_*.cu so they compile in parallel: the tensor-core kernel for 16-bit
// queries and the head sizes of supported::kCudaHeadSizes, the CUDA-core kernel for
// float32 queries and every other supported head size.
#pragma once

#include "cuda/decode_inst.cuh"
#include "cuda/prefill_mma.cuh"
#include "cuda/prefill_simt.cuh"

namespace pagedattn::cuda_backend {

template <class T, KVCacheDType F>
DecodeKernelInfo prefill_kernel(int head, CacheLayout layout) {
  return dispatch_layout(layout, [&](auto lc) {
    constexpr CacheLayout L = decltype(lc)::value;
    return dispatch_head(head, [&](auto hc) {
      constexpr int HEAD = decltype(hc)::value;
      DecodeKernelInfo info;
      if constexpr (std::is_same_v<T, float> || HEAD == 0) {
        info.func = reinterpret_cast<const void*>(&prefill_simt_kernel<T, F, L>);
        info.threads = kPrefillSimtWarps * 32;
        info.smem = 0;
        info.rows = kPrefillSimtWarps;
        info.name = "cuda_core";
      } else {
        using Cfg = PrefillMmaConfig<T, F, HEAD, L>;
        info.func = reinterpret_cast<const void*>(&prefill_mma_kernel<T, F, HEAD, L>);
        info.threads = Cfg::kThreads;
        info.smem = Cfg::kSmemBytes;
        info.rows = Cfg::kBM;
        info.name = "sm80_mma";
      }
      return info;
    });
  });
}

}  // namespace pagedattn::cuda_backend
