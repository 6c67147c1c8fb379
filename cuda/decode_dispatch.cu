// Decode kernel selection and per-device kernel set-up (cuda/decode_dispatch.cuh).
#include "cuda/decode_dispatch.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/device.cuh"

namespace pagedattn::cuda_backend {

DecodeKernelInfo select_kernel(const DecodeParams& p) {
  return select_by_types(p, [&](auto t, auto kc) {
    return decode_kernel<typename decltype(t)::type, decltype(kc)::value>(p.head_size, p.layout, p.block_size,
                                                                          p.num_heads / p.num_kv_heads);
  });
}

int kernel_slots_per_sm(const DecodeKernelInfo& k, int device, bool narrow) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, bool, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  narrow = narrow && k.narrow_threads > 0;
  const auto key = std::make_tuple(k.func, narrow, device);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (k.smem > device_info(device).max_smem_per_block)
    fail<NotSupported>("paged_attention: this kernel needs ", k.smem, " bytes of shared memory, the device allows ",
                       device_info(device).max_smem_per_block);
  // the full width's (the larger) shared memory: both widths launch under this attribute
  check_cuda(cudaFuncSetAttribute(k.func, cudaFuncAttributeMaxDynamicSharedMemorySize, k.smem),
             "cudaFuncSetAttribute");
  int occ = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                 &occ, k.func, narrow ? k.narrow_threads : k.threads, narrow ? k.narrow_smem : k.smem),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return cache.emplace(key, std::max(occ, 1)).first->second;
}

}  // namespace pagedattn::cuda_backend
