// Scratch of the partitioned decode and the varlen kernel's work counters (cuda/scratch_pool.cuh).
#include "cuda/scratch_pool.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/device.cuh"

namespace pagedattn::cuda_backend {
namespace {

// A stream's entry in the pools: the device, the stream, and for the per-thread default
// stream (one handle naming a different stream in each host thread, whose kernels may run
// at the same time) the thread as well.
using StreamKey = std::tuple<int, cudaStream_t, std::thread::id>;
StreamKey stream_key(int device, cudaStream_t stream) {
  return {device, stream, stream == cudaStreamPerThread ? std::this_thread::get_id() : std::thread::id{}};
}

// The stream's pool buffer with at least `bytes`; null while the stream is being
// captured. A captured graph never points into the pool: a later eager call that grows
// the pool frees the old buffer, and a graph replayed after that would use freed memory.
// Captures take stream-ordered scratch instead, which the graph owns.
void* pool_buffer(int device, cudaStream_t stream, std::size_t bytes) {
  if (stream_is_capturing(stream)) return nullptr;
  struct Buffer {
    void* ptr = nullptr;
    std::size_t bytes = 0;
  };
  static std::mutex mu;
  static std::map<StreamKey, Buffer> pools;
  std::lock_guard<std::mutex> lock(mu);
  Buffer& b = pools[stream_key(device, stream)];
  if (b.bytes >= bytes) return b.ptr;
  if (b.ptr) check_cuda(cudaFree(b.ptr), "cudaFree");  // synchronises: in-flight users finish first
  b.ptr = nullptr;
  b.bytes = 0;
  const std::size_t want = std::max<std::size_t>(bytes + bytes / 4, std::size_t{4} << 20);
  check_cuda(cudaMalloc(&b.ptr, want), "cudaMalloc (paged_attention scratch)");
  b.bytes = want;
  return b.ptr;
}

// The stream's pair of counters, zeroed (on the stream) when made; null while the stream is
// being captured.
int* pool_counters(int device, cudaStream_t stream) {
  if (stream_is_capturing(stream)) return nullptr;
  static std::mutex mu;
  static std::map<StreamKey, int*> pools;
  std::lock_guard<std::mutex> lock(mu);
  int*& c = pools[stream_key(device, stream)];
  if (c == nullptr) {
    int* fresh = nullptr;
    check_cuda(cudaMalloc(&fresh, 2 * sizeof(int)), "cudaMalloc (paged_attention work counters)");
    // zeroed on the stream itself: ordered before the kernel whatever the stream's flags
    const cudaError_t e = cudaMemsetAsync(fresh, 0, 2 * sizeof(int), stream);
    if (e != cudaSuccess) {
      cudaFree(fresh);
      check_cuda(e, "cudaMemset (paged_attention work counters)");
    }
    c = fresh;
  }
  return c;
}

}  // namespace

CallCounters::CallCounters(int device, cudaStream_t stream) : stream_(stream) {
  ptr_ = pool_counters(device, stream);
  if (ptr_ != nullptr || !device_info(device).memory_pools) return;
  void* p = nullptr;
  check_cuda(cudaMallocAsync(&p, 2 * sizeof(int), stream), "cudaMallocAsync (paged_attention work counters)");
  ptr_ = static_cast<int*>(p);
  stream_ordered_ = true;
  check_cuda(cudaMemsetAsync(ptr_, 0, 2 * sizeof(int), stream), "cudaMemsetAsync (paged_attention work counters)");
}

CallCounters::~CallCounters() {
  if (stream_ordered_) cudaFreeAsync(ptr_, stream_);  // error path: best effort
}

void CallCounters::release() {
  if (!stream_ordered_) return;
  stream_ordered_ = false;
  check_cuda(cudaFreeAsync(ptr_, stream_), "cudaFreeAsync (paged_attention work counters)");
}

CallScratch::CallScratch(int device, cudaStream_t stream, std::size_t bytes) : stream_(stream) {
  ptr_ = pool_buffer(device, stream, bytes);
  if (ptr_ != nullptr) return;
  if (!device_info(device).memory_pools)
    fail<InvalidArgument>("paged_attention: the partitioned kernel needs ", bytes,
                          " bytes of scratch, and this device cannot allocate during CUDA graph capture (no "
                          "stream-ordered allocator); pass workspace= (a uint8 device array of "
                          "decode_workspace_size(...) bytes)");
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
