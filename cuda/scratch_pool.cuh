// Device scratch for the partitioned decode when the caller passes no `workspace`, and
// the work counters of the persistent varlen kernel (CallCounters, below).
//
// Outside graph capture it is a buffer per (device, stream; and host thread for the
// per-thread default stream) that only grows. While the stream is being captured, the
// call allocates its scratch stream-ordered (cudaMallocAsync) and frees it behind its
// kernels (cudaFreeAsync), which a capture records as graph memory nodes: the graph owns
// that memory (never the pool's, which a later call may free to grow it), so capturing
// needs neither `workspace` nor a warm-up on the capture stream (PyTorch's recipe warms
// up on a side stream, then captures on another).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace pagedattn::cuda_backend {

// The scratch of one call on `device` (the current device) for work queued on `stream`.
class CallScratch {
 public:
  CallScratch(int device, cudaStream_t stream, std::size_t bytes);
  ~CallScratch();  // frees a stream-ordered allocation if release() did not (a failed call)
  CallScratch(const CallScratch&) = delete;
  CallScratch& operator=(const CallScratch&) = delete;

  void* get() const { return ptr_; }
  // After the call's kernels are queued: frees a stream-ordered allocation behind them.
  void release();

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
  bool stream_ordered_ = false;
};

// The zeroed work counters of one persistent varlen call (PrefillKernelParams::sched: two
// ints), which the kernel leaves zeroed again when it ends. Outside graph capture they
// are a pair per (device, stream) as above, kept for the life of the process: calls on
// one stream run one after another, so no two kernels share them. While the stream is being
// captured they are a stream-ordered allocation zeroed on the stream and freed behind
// the kernel: the graph owns them, so a graph replayed on another stream never shares
// the eager calls' pair (and one graph's replays run one at a time). get() is null when
// neither can be had (capture on a device without stream-ordered allocation): the
// caller then launches the one-block-per-item grid, which needs no counter.
class CallCounters {
 public:
  CallCounters(int device, cudaStream_t stream);
  ~CallCounters();  // frees a stream-ordered allocation if release() did not (a failed call)
  CallCounters(const CallCounters&) = delete;
  CallCounters& operator=(const CallCounters&) = delete;

  int* get() const { return ptr_; }
  // After the kernel is queued: frees a stream-ordered allocation behind it.
  void release();

 private:
  int* ptr_ = nullptr;
  cudaStream_t stream_;
  bool stream_ordered_ = false;
};

}  // namespace pagedattn::cuda_backend
