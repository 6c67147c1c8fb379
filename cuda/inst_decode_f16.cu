// Decode kernels for one (query dtype, cache kind) pair; see decode_inst.cuh.
#include "cuda/decode_inst_impl.cuh"

namespace pagedattn::cuda_backend {
template DecodeKernelInfo decode_kernel<__half, KVCacheDType::kAuto>(int, CacheLayout, int, int);
}  // namespace pagedattn::cuda_backend
