// The body of decode_kernel<T, F>(): included by the inst_decode_*.cu files only.
#pragma once

#include "cuda/decode_inst.cuh"
#include "cuda/decode_mma.cuh"
#include "cuda/decode_simt.cuh"

namespace pagedattn::cuda_backend {

template <class T, KVCacheDType F>
DecodeKernelInfo decode_kernel(int head, CacheLayout layout) {
  return dispatch_layout(layout, [&](auto lc) {
    constexpr CacheLayout L = decltype(lc)::value;
    return dispatch_head(head, [&](auto hc) {
      constexpr int HEAD = decltype(hc)::value;
      DecodeKernelInfo info;
      if constexpr (std::is_same_v<T, float>) {
        using Cfg = SimtDecodeConfig<F, HEAD, L>;
        info.func = reinterpret_cast<const void*>(&decode_simt_kernel<F, HEAD, L>);
        info.threads = Cfg::kThreads;
        info.smem = Cfg::kSmemBytes;
        info.rows = Cfg::kRows;
      } else {
        using Cfg = MmaDecodeConfig<T, F, HEAD, L>;
        info.func = reinterpret_cast<const void*>(&decode_mma_kernel<T, F, HEAD, L>);
        info.threads = Cfg::kThreads;
        info.smem = Cfg::kDynBytes;
        info.rows = Cfg::kRows;
        info.cta_bw = Cfg::kCtaBw;
      }
      return info;
    });
  });
}

}  // namespace pagedattn::cuda_backend
