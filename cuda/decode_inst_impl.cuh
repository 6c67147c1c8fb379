// The body of decode_kernel<T, F>(): included by the inst_decode_*.cu files only.
#pragma once

#include "cuda/decode_inst.cuh"
#include "cuda/decode_mma.cuh"
#include "cuda/decode_simt.cuh"

namespace pagedattn::cuda_backend {

template <class T, KVCacheDType F, int HEAD, CacheLayout L, bool S, bool N8 = false, bool W = false>
DecodeKernelInfo mma_kernel_info() {
  using Cfg = MmaDecodeConfig<T, F, HEAD, L, S, N8, W>;
  DecodeKernelInfo info;
  if constexpr (N8)
    info.func = reinterpret_cast<const void*>(&decode_mma_kernel_n8<T, F, HEAD, L, S>);
  else
    info.func = reinterpret_cast<const void*>(&decode_mma_kernel<T, F, HEAD, L, S, false, W>);
  info.threads = Cfg::kThreads;
  info.smem = Cfg::kDynBytes;
  info.rows = Cfg::kRows;
  info.cta_bw = Cfg::kCtaBw;
  if constexpr (N8) {
    info.narrow_threads = Cfg::kNarrowWarps * 32;
    info.narrow_smem = Cfg::dyn_bytes(Cfg::kNarrowWarps);
  }
  return info;
}

template <class T, KVCacheDType F>
DecodeKernelInfo decode_kernel(int head, CacheLayout layout, int block_size, int group) {
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
      } else if constexpr (L == CacheLayout::kVLLM) {
        // vllm pages of 2 and 4, and 8 for 16-bit caches: the small-page kernel (slabs of
        // whole blocks). fp8 pages of 8 keep the [D][16] stage: 8-byte runs, measured 7%
        // faster there than slabs on an H200 (111.7 against 120 us, b8 x16384). The other
        // kernel copies values in pieces of 8 or 16 tokens, so it takes pages of 8 and more
        // only (pages of 1 run the nhd kernels: decode_launch.cu's vllm_as_nhd).
        const bool small = block_size == 2 || block_size == 4 || (block_size == 8 && F == KVCacheDType::kAuto);
        // fp8 pages of 2 and 4 keep the untransposed small-page kernel for every group: its
        // transposed twins would cost 1 MB of the library for pages few engines use.
        if constexpr (has_transposed_decode<F, HEAD, L>()) {
          if (group <= 8 && !small) return mma_kernel_info<T, F, HEAD, L, false, true>();
        }
        // 16-bit caches in pages of 64 and more: the wide-row kernel (a group of the four warps'
        // chunks shares a V stage filled with whole 128-byte rows), for the head sizes of the
        // GQA models in use; the others keep the per-warp stages. Pages of 32 keep them too:
        // there a group's row is two 64-byte runs of two blocks, and the wide-row kernel
        // measured no faster than the per-warp one on an H200 (1.01-1.09x page 16 against
        // 1.03-1.06x in the same run).
        if constexpr (F == KVCacheDType::kAuto && (HEAD == 64 || HEAD == 128)) {
          if (block_size >= 64) return mma_kernel_info<T, F, HEAD, L, false, false, true>();
        }
        info = small ? mma_kernel_info<T, F, HEAD, L, true>() : mma_kernel_info<T, F, HEAD, L, false>();
      } else {
        if constexpr (has_transposed_decode<F, HEAD, L>()) {
          if (group <= 8) return mma_kernel_info<T, F, HEAD, L, false, true>();
        }
        info = mma_kernel_info<T, F, HEAD, L, false>();
      }
      return info;
    });
  });
}

}  // namespace pagedattn::cuda_backend
