// Decode kernels for one (query dtype, cache kind) pair; see decode_inst.cuh.
#include "cuda/decode_inst_impl.cuh"

namespace pagedattn::cuda_backend {
template DecodeKernelInfo decode_kernel<__nv_bfloat16, KVCacheDType::kFp8E4M3>(int, CacheLayout, int, int);
}  // namespace pagedattn::cuda_backend
