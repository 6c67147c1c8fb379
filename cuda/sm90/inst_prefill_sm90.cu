// The Hopper varlen kernels (prefill_sm90.cuh): f16 / bf16, head sizes 64 and 128, the
// token-major (nhd / hnd) and vllm layouts. This file is compiled for sm_90a only.
#include "cuda/sm90/prefill_sm90.cuh"
#include "cuda/sm90/prefill_sm90.h"

namespace pagedattn::cuda_backend {
namespace {

template <class T, int D, CacheLayout L>
DecodeKernelInfo info_of() {
  using C = sm90::PrefillSm90Config<T, D, L>;
  DecodeKernelInfo info;
  info.func = reinterpret_cast<const void*>(&sm90::prefill_sm90_kernel<T, D, L>);
  info.threads = C::kThreads;
  info.smem = C::kSmemBytes;
  info.rows = C::kBM;
  info.name = "sm90_wgmma";
  return info;
}

template <class T>
DecodeKernelInfo for_type(int head_size, CacheLayout layout) {
  const bool vllm = layout == CacheLayout::kVLLM;
  if (head_size == 64) return vllm ? info_of<T, 64, CacheLayout::kVLLM>() : info_of<T, 64, CacheLayout::kNHD>();
  if (head_size == 128) return vllm ? info_of<T, 128, CacheLayout::kVLLM>() : info_of<T, 128, CacheLayout::kNHD>();
  return {};
}

}  // namespace

DecodeKernelInfo sm90_prefill_kernel_info(DType dtype, KVCacheDType cache, int head_size, CacheLayout layout,
                                     int block_size) {
  if (cache != KVCacheDType::kAuto) return {};
  if (layout == CacheLayout::kVLLM && block_size < 2) return {};  // page 1 runs as nhd (the same bytes)
  if (dtype == DType::kFloat16) return for_type<__half>(head_size, layout);
  if (dtype == DType::kBFloat16) return for_type<__nv_bfloat16>(head_size, layout);
  return {};
}

}  // namespace pagedattn::cuda_backend
