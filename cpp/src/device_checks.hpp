// Checks shared by the validation passes (validate.cpp, cache_ops.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "pagedattn/attention.hpp"
#include "pagedattn/errors.hpp"
#include "params.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn::detail {

// Host memory: plain CPU memory or CUDA pinned host memory.
inline bool on_host(const TensorView& t) {
  return t.device == DeviceKind::kCPU || t.device == DeviceKind::kCUDAHost;
}

// "cpu", "cuda_host" or "cuda:N", for messages.
inline std::string where(const TensorView& t) {
  if (t.device == DeviceKind::kCUDA) return concat("cuda:", t.device_id);
  return device_name(t.device);
}

// Both in host memory, or both on the same CUDA device.
inline bool same_device(const TensorView& a, const TensorView& b) {
  return (on_host(a) && on_host(b)) ||
         (a.device == DeviceKind::kCUDA && b.device == DeviceKind::kCUDA && a.device_id == b.device_id);
}

// Head size and block size against the CUDA backend's supported lists (NotSupported).
// Defined in validate.cpp.
void check_cuda_sizes(std::int64_t head_size, std::int64_t block_size);

// `written` (an array a call writes) must not share memory with `other`; with
// allow_identical the very same view is accepted (InvalidArgument naming both).
// Defined in validate.cpp: the overlap check of the decode and cache-write passes.
void check_disjoint(const TensorView& written, const char* written_name, const TensorView& other,
                    const char* other_name, bool allow_identical = false);

// A cache-like array [N, ...] whose blocks (dims 1..) are C-contiguous and whose blocks
// lie block_stride elements apart, block_stride >= block_elems (blocks never overlap):
// what every cache op accepts, e.g. the key half of a per-layer [N, 2, ...] allocation.
struct BlockStrided {
  std::int64_t block_elems = 0;   // elements of one block (the product of dims 1..)
  std::int64_t block_stride = 0;  // elements between block starts (block_elems when N <= 1)
};
// Checks `t` (InvalidArgument naming it, its shape, its strides and what is allowed)
// and that its span (N - 1) * block_stride + block_elems fits in int64 bytes. Defined
// in validate.cpp.
BlockStrided check_block_strided(const TensorView& t, const char* name);

// `written` and `other` are block-strided arrays (check_block_strided): refuses them
// when a block of one shares memory with a block of the other. Exact for equal block
// strides (the key and value halves of one allocation, interleaved per block, pass);
// otherwise their whole byte ranges must be disjoint. Defined in validate.cpp.
void check_blocks_disjoint(const TensorView& written, const char* written_name, const TensorView& other,
                           const char* other_name);

// The decode kernel choice: a known DecodeKernel, partition_size >= 0 (InvalidArgument).
// Defined in validate.cpp.
void check_decode_choice(DecodeKernel kernel, int partition_size);

// The CUDA decode kernels' limits that need no device: 16-byte aligned caches and
// workspace, at most 65535 sequences, partition_size a multiple of 16. Defined in
// validate.cpp.
void check_cuda_decode_limits(const DecodeParams& p, const TensorView* workspace);

}  // namespace pagedattn::detail
