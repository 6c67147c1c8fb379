// Device scratch for the partitioned decode when the caller passes no `workspace`: one
// buffer per (device, stream) that only grows, outside graph capture. Inside capture a
// buffer that is too small is an error (allocation would break the capture): pass
// `workspace`, or run the same shapes once eagerly on that stream first.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace pagedattn::cuda_backend {

// At least `bytes` of device memory on `device` (the current device), for work queued
// on `stream` only. Valid until the next call with the same (device, stream).
void* pool_scratch(int device, cudaStream_t stream, std::size_t bytes);

}  // namespace pagedattn::cuda_backend
