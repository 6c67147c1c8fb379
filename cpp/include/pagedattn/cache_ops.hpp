// Whole-block cache operations (copy inside a device, swap between device and host)
// and the size of the CUDA decode scratch.
//
// Dimension legend: N = num_blocks of a cache, P = number of (src, dst) block pairs.
// A "block" of a cache array is its slice [n] along the first dimension, in every
// layout (vllm key [N, K, D/x, B, x], vllm value [N, K, D, B], nhd [N, B, K, D]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pagedattn/params.hpp"
#include "pagedattn/supported.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn {

// For every pair p and every array a of `caches`: a[mapping[p, 1]] = a[mapping[p, 0]].
//   caches         arrays [N_a, ...], C-contiguous, all on one device (host or one GPU);
//                  typically every layer's key and value cache: one launch on CUDA
//   block_mapping  int64 or int32 [P, 2] (src, dst), C-contiguous; in host memory, or
//                  on the caches' GPU (then its entries cannot be checked before the
//                  launch: out-of-range pairs are skipped by the kernel)
// The mapping must not share memory with any cache. A host mapping is read once, into
// a private copy, and checked: pairs in range (OutOfRange), no destination twice and no
// destination that is the source of another pair (InvalidArgument naming the pair;
// pairs run in parallel on CUDA). Asynchronous on `stream` for CUDA caches; no host sync.
void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping, void* stream = nullptr);

// For every pair p: dst[mapping[p, 1]] = src[mapping[p, 0]].
//   src, dst       [N_src, ...] and [N_dst, ...]: same dtype and block shape (dims 1..);
//                  C-contiguous; any of: GPU -> pinned host, pinned host -> GPU,
//                  GPU -> same GPU, host -> host. Pageable host memory works too, but
//                  CUDA then copies synchronously.
//   block_mapping  int64 or int32 [P, 2] in host memory (it is read on the host, once,
//                  into a private copy), sharing no memory with src or dst
// src and dst are separate arrays or the very same one. No destination may appear twice;
// when src is dst, no destination may be the source of another pair (InvalidArgument
// naming the pair). With a GPU involved the copies are queued on `stream` (consecutive pairs are merged
// into one copy) and the call returns without waiting.
void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 void* stream = nullptr);

// Device scratch bytes paged_attention needs on CUDA for these shapes and options
// (0 when the single-pass kernel is chosen). Depends only on host-known sizes, never
// on seq_lens, so a workspace sized once fits every later call of the same shapes.
struct DecodeWorkspaceQuery {
  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  DType dtype = DType::kFloat16;
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  CacheLayout layout = CacheLayout::kVLLM;
  int version = 0;
  int partition_size = 0;
  int device_id = 0;
};
std::size_t decode_workspace_size(const DecodeWorkspaceQuery& q);

// How paged_attention will run on CUDA for these shapes and options (same inputs and
// errors as decode_workspace_size): for people tuning or studying the kernels.
struct DecodePlanInfo {
  int num_partitions = 1;   // CTAs along the context per (sequence, KV head, head tile)
  int partition_size = 0;   // tokens per partition
  bool reduce_kernel = false;  // partials written to scratch and merged by a second kernel
  int head_tiles = 1;       // CTAs per KV head along its query heads
  std::int64_t ctas = 0;    // CTAs of the decode grid
  std::size_t workspace_bytes = 0;
};
DecodePlanInfo decode_plan(const DecodeWorkspaceQuery& q);

// Parameters handed to the CUDA backend (validated).
struct CopyBlocksParams {
  std::vector<void*> arrays;              // base pointers
  std::vector<std::int64_t> block_bytes;  // bytes of one block of each array
  std::vector<std::int64_t> num_blocks;   // N of each array
  const void* mapping = nullptr;          // [P, 2]
  bool mapping_int64 = true;
  bool mapping_on_host = true;
  std::int64_t num_pairs = 0;
  int device_id = 0;
};

struct SwapBlocksParams {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t block_bytes = 0;
  std::int64_t src_blocks = 0;
  std::int64_t dst_blocks = 0;
  const void* mapping = nullptr;  // host [P, 2]
  bool mapping_int64 = true;
  std::int64_t num_pairs = 0;
  int device_id = 0;  // the GPU involved
};

}  // namespace pagedattn
