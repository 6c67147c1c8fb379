// The CUDA backend's interface to the C++ core, beside cpu_backend.hpp. Plain C++: no CUDA types
// leak out of cuda/. Built with nvcc these are defined in cuda/*.cu; without CUDA,
// cpp/src/no_cuda.cpp defines them to throw NotSupported.
#pragma once

#include <cstddef>

#include "pagedattn/attention.hpp"
#include "pagedattn/cache_ops.hpp"
#include "params.hpp"

namespace pagedattn::cuda_backend {

// All arguments validated; pointers are device pointers; stream is a cudaStream_t.
void paged_attention(const DecodeParams& p, void* stream);
void reshape_and_cache(const CacheWriteParams& p, void* stream);

// Number of usable CUDA devices: 0 when there is none or no (recent enough) driver.
// Never throws; leaves no pending CUDA error behind.
int device_count() noexcept;

// Device scratch bytes paged_attention(p) needs (0 when it runs single-pass). Reads
// only host-known sizes of p (never seq_lens or the arrays' contents).
std::size_t decode_workspace_bytes(const DecodeParams& p);
// The plan paged_attention(p) would launch.
DecodePlanInfo decode_plan_info(const DecodeParams& p);
// One launch over every array and pair (cuda/cache_kernels.cu).
void copy_blocks(const CopyBlocksParams& p, void* stream);
// cudaMemcpyAsync per run of consecutive pairs; mapping in host memory.
void swap_blocks(const SwapBlocksParams& p, void* stream);

}  // namespace pagedattn::cuda_backend
