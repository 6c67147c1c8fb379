// The Hopper varlen kernels as the launcher sees them. Defined in inst_prefill_sm90.cu,
// which is compiled for sm_90a alone and only when the build targets compute capability
// 9.0 (PAGEDATTN_SM90_PREFILL).
#pragma once

#include "cuda/decode_inst.cuh"
#include "params.hpp"

namespace pagedattn::cuda_backend {

// The kernel for a call of these types and shape on a compute capability 9.0 GPU, or an
// info whose func is null when the Hopper kernels do not cover it (then the sm_80
// tensor-core kernel serves it): 16-bit queries and caches of the same dtype, head size
// 64 or 128, the token-major layouts, or vllm with pages of 8 tokens or more.
DecodeKernelInfo sm90_prefill_kernel_info(DType dtype, KVCacheDType cache, int head_size, CacheLayout layout,
                                     int block_size);

}  // namespace pagedattn::cuda_backend
