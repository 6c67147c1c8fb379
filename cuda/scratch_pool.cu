// The per-(device, stream) scratch pool of the partitioned decode (cuda/scratch_pool.cuh).
#include "cuda/scratch_pool.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/device.cuh"

namespace pagedattn::cuda_backend {

void* pool_scratch(int device, cudaStream_t stream, std::size_t bytes) {
  struct Buffer {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Buffer> pools;
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = pools[std::make_pair(device, stream)];
  if (b.bytes >= bytes) return b.ptr;
  if (stream_is_capturing(stream))
    fail<InvalidArgument>("paged_attention: the partitioned kernel needs ", bytes,
                          " bytes of scratch, more than this stream's pool holds (", b.bytes,
                          "), and memory cannot be allocated during CUDA graph capture; pass workspace= (a uint8 "
                          "device array of decode_workspace_size(...) bytes) or run the same shapes once before "
                          "capturing");
  if (b.ptr) check_cuda(cudaFree(b.ptr), "cudaFree");  // synchronises: in-flight users finish first
  b.ptr = nullptr;
  b.bytes = 0;
  const std::size_t want = std::max<std::size_t>(bytes + bytes / 4, std::size_t{4} << 20);
  check_cuda(cudaMalloc(&b.ptr, want), "cudaMalloc (paged_attention scratch)");
  b.bytes = want;
  return b.ptr;
}

}  // namespace pagedattn::cuda_backend
