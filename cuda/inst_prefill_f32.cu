// Varlen kernels for float32 queries (every cache kind; CUDA-core kernel); see prefill_inst.cuh.
#include "cuda/prefill_inst.cuh"

namespace pagedattn::cuda_backend {
template DecodeKernelInfo prefill_kernel<float, KVCacheDType::kAuto>(int, CacheLayout);
template DecodeKernelInfo prefill_kernel<float, KVCacheDType::kFp8E4M3>(int, CacheLayout);
template DecodeKernelInfo prefill_kernel<float, KVCacheDType::kFp8E5M2>(int, CacheLayout);
}  // namespace pagedattn::cuda_backend
