// Varlen kernels for one (query dtype, cache kind) pair; see prefill_inst.cuh.
#include "cuda/prefill_inst.cuh"

namespace pagedattn::cuda_backend {
template DecodeKernelInfo prefill_kernel<__nv_bfloat16, KVCacheDType::kAuto>(int, CacheLayout);
}  // namespace pagedattn::cuda_backend
