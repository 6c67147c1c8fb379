// Scratch of the partitioned decode (cuda/scratch_pool.cuh).
#include "cuda/scratch_pool.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/device.cuh"

namespace pagedattn::cuda_backend {
namespace {

// The stream's pool buffer with at least `bytes`, or null when it is smaller and the
// stream is being captured (no allocation may happen then outside the stream's order).
void* pool_buffer(int device, cudaStream_t stream, std::size_t bytes) {
  struct Buffer {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Buffer> pools;
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = pools[std::make_pair(device, stream)];
  if (b.bytes >= bytes) return b.ptr;
  if (stream_is_capturing(stream)) return nullptr;
  if (b.ptr) check_cuda(cudaFree(b.ptr), "cudaFree");  // synchronises: in-flight users finish first
  b.ptr = nullptr;
  b.bytes = 0;
  const std::size_t want = std::max<std::size_t>(bytes + bytes / 4, std::size_t{4} << 20);
  check_cuda(cudaMalloc(&b.ptr, want), "cudaMalloc (paged_attention scratch)");
  b.bytes = want;
  return b.ptr;
}

}  // namespace

CallScratch::CallScratch(int device, cudaStream_t stream, std::size_t bytes) : stream_(stream) {
  ptr_ = pool_buffer(device, stream, bytes);
  if (ptr_ != nullptr) return;
  if (!device_info(device).memory_pools)
    fail<InvalidArgument>("paged_attention: the partitioned kernel needs ", bytes,
                          " bytes of scratch, more than this stream's pool holds, and this device cannot allocate "
                          "during CUDA graph capture (no stream-ordered allocator); pass workspace= (a uint8 "
                          "device array of decode_workspace_size(...) bytes) or run the same shapes once on the "
                          "capture stream before capturing");
  check_cuda(cudaMallocAsync(&ptr_, bytes, stream), "cudaMallocAsync (paged_attention scratch, graph capture)");
  stream_ordered_ = true;
}

CallScratch::~CallScratch() {
  if (stream_ordered_) cudaFreeAsync(ptr_, stream_);  // error path: best effort
}

void CallScratch::release() {
  if (!stream_ordered_) return;
  stream_ordered_ = false;
  check_cuda(cudaFreeAsync(ptr_, stream_), "cudaFreeAsync (paged_attention scratch)");
}

}  // namespace pagedattn::cuda_backend
