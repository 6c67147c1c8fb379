// Device properties, capture state and the device count (cuda/device.cuh).
#include "cuda/device.cuh"

#include <map>
#include <mutex>

#include "cuda/common.cuh"
#include "cuda_backend.hpp"

namespace pagedattn::cuda_backend {

const DeviceInfo& device_info(int device) {
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  DeviceInfo info;
  check_cuda(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.max_smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.max_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute");
  check_cuda(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device),
             "cudaDeviceGetAttribute");
  // Peak DRAM rate = 2 transfers per memory clock (kHz) x bus width; copies measure about
  // 90% of it (H100 SXM: 3.35 TB/s peak, 3.03 measured; H200: 4.8, 4.28).
  int mem_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
    cudaGetLastError();
    mem_khz = bus_bits = 0;
  }
  int pools = 0;
  if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess) {
    cudaGetLastError();
    pools = 0;
  }
  info.memory_pools = pools != 0;
  const double peak = 2.0 * mem_khz * 1e3 * (bus_bits / 8.0) / 1e6;  // bytes per us
  info.mem_bw = peak > 1e5 ? 0.9 * peak : 3.0e6;                       // unknown: ~3 TB/s
  return cache.emplace(device, info).first->second;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &st), "cudaStreamIsCapturing");
  return st != cudaStreamCaptureStatusNone;
}

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

}  // namespace pagedattn::cuda_backend
