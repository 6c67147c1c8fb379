// The interface between the C++ core and the CUDA backend. Plain C++: no CUDA types
// leak out of cuda/. Built with nvcc these are defined in cuda/*.cu; without CUDA,
// cpp/src/no_cuda.cpp defines them to throw NotSupported.
#pragma once

#include "pagedattn/params.hpp"

namespace pagedattn::cuda_backend {

// All arguments validated; pointers are device pointers; stream is a cudaStream_t.
void paged_attention(const DecodeParams& p, void* stream);
void reshape_and_cache(const CacheWriteParams& p, void* stream);

}  // namespace pagedattn::cuda_backend
