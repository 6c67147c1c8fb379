// The CUDA device as the launchers see it: its properties (read once per device) and
// whether a stream is being captured into a graph.
#pragma once

#include <cuda_runtime.h>

namespace pagedattn::cuda_backend {

struct DeviceInfo {
  int num_sms = 0;
  int max_smem_per_block = 0;  // opt-in limit
  int max_smem_per_sm = 0;
  int cc_major = 0;   // compute capability (9 and up: programmatic dependent launch)
  int cc_minor = 0;
  double mem_bw = 0;  // bytes per microsecond the decode can expect: 0.9 x the peak DRAM rate
  bool memory_pools = false;  // stream-ordered allocation (cudaMallocAsync), also during capture
};
// Read once per device (no synchronisation).
const DeviceInfo& device_info(int device);

// Whether work queued on `stream` is being captured into a CUDA graph.
bool stream_is_capturing(cudaStream_t stream);

}  // namespace pagedattn::cuda_backend
