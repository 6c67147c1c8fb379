// The reduce kernel of the partitioned decode: merges the NP partial results of each
// (sequence, query head) into the output. Launched behind the decode grid (with
// programmatic dependent launch on sm_90 and later, so its launch overlaps that grid).
#pragma once

#include "pagedattn/tensor.hpp"

namespace pagedattn::cuda_backend {

// The reduce kernel for outputs of dtype t: __global__ void (DecodeKernelParams), grid
// (H, S), kDecodeReduceThreads threads, no dynamic shared memory.
const void* decode_reduce_kernel_for(DType t);
inline constexpr int kDecodeReduceThreads = 128;

}  // namespace pagedattn::cuda_backend
