// Plain parameter structs handed from the validated front end to a backend (CPU or
// CUDA). Everything in them has been checked; backends trust them.
//
// Dimension legend used in the shape comments:
//   S = num_seqs, H = num_heads, K = num_kv_heads, D = head_size, B = block_size,
//   N = num_blocks, M = max_blocks_per_seq, T = num_tokens, x = 16 / sizeof(cache element).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pagedattn/attention.hpp"
#include "pagedattn/supported.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn {

struct DecodeParams {
  void* out = nullptr;              // [S, H, D], dtype; last dim contiguous
  std::int64_t o_stride_seq = 0;    // elements
  std::int64_t o_stride_head = 0;
  const void* query = nullptr;      // [S, H, D], dtype; last dim contiguous
  std::int64_t q_stride_seq = 0;
  std::int64_t q_stride_head = 0;
  // vllm [N, K, D/x, B, x] | nhd [N, B, K, D] | hnd [N, K, B, D]; each block (dims 1..)
  // contiguous, blocks k_block_stride elements apart
  const void* key_cache = nullptr;
  // vllm [N, K, D, B]      | nhd [N, B, K, D] | hnd [N, K, B, D]; as key_cache
  const void* value_cache = nullptr;
  std::int64_t k_block_stride = 0;  // elements of the cache type between blocks (>= B * K * D)
  std::int64_t v_block_stride = 0;
  const std::int32_t* block_tables = nullptr;  // [S, M], contiguous
  const std::int32_t* seq_lens = nullptr;      // [S]
  const float* alibi_slopes = nullptr;         // [H] or null
  // Varlen queries: [S + 1] row offsets (see paged_attention), or null for decode. With
  // them query / out hold num_tokens rows instead of num_seqs.
  const std::int32_t* query_start_loc = nullptr;
  std::int64_t num_tokens = 0;  // T: rows of query / out in the varlen form
  int max_query_len = -1;       // host-known bound on every q_i; -1 = unknown (at most T)

  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  std::int64_t num_blocks = 0;

  float scale = 1.0f;    // softmax scale applied to q.k
  float k_scale = 1.0f;  // fp8 caches: real key = stored * k_scale
  float v_scale = 1.0f;

  // Variants (see AttentionOptions); 0 / null = off.
  int sliding_window = 0;         // tokens
  float soft_cap = 0.0f;          // logit = soft_cap * tanh(logit / soft_cap)
  const float* sinks = nullptr;   // [H]: exp(sinks[h]) joins head h's softmax denominator

  DType dtype = DType::kFloat32;  // query, output, and (kAuto) cache element type
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  CacheLayout layout = CacheLayout::kVLLM;

  // Backend hints (CUDA): 0 = choose, 1 = single pass, 2 = partitioned + reduce.
  DecodeKernel kernel = DecodeKernel::kAuto;
  int partition_size = 0;       // tokens per partition for v2; 0 = default
  void* workspace = nullptr;    // caller-provided device scratch for v2, or null
  std::size_t workspace_bytes = 0;
  bool check_block_tables = false;  // CUDA: report out-of-range block ids as an error
  int device_id = 0;
};

struct CacheWriteParams {
  const void* key = nullptr;    // [T, K, D], dtype; last dim contiguous
  std::int64_t k_stride_tok = 0;
  std::int64_t k_stride_head = 0;
  const void* value = nullptr;  // [T, K, D], dtype; last dim contiguous
  std::int64_t v_stride_tok = 0;
  std::int64_t v_stride_head = 0;
  void* key_cache = nullptr;    // as in DecodeParams
  void* value_cache = nullptr;
  std::int64_t k_block_stride = 0;  // elements of the cache type, as in DecodeParams
  std::int64_t v_block_stride = 0;
  const void* slot_mapping = nullptr;  // [T], int32 or int64; negative = padding, skipped
  bool slot_mapping_int64 = false;

  std::int64_t num_tokens = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  int block_size = 0;
  std::int64_t num_blocks = 0;

  float k_scale = 1.0f;  // fp8 caches: stored = real / k_scale
  float v_scale = 1.0f;
  DType dtype = DType::kFloat32;  // key / value element type
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  CacheLayout layout = CacheLayout::kVLLM;
  int device_id = 0;
};

// First key position a sliding window lets any query row at or after `first_pos` see
// (0 without a window): keys and blocks before it are never read.
inline std::int64_t window_start(int sliding_window, std::int64_t first_pos) noexcept {
  const std::int64_t s = first_pos - sliding_window + 1;
  return sliding_window > 0 && s > 0 ? s : 0;
}

// Where a token's row of D elements starts inside a block of a token-major layout (nhd,
// hnd): at token * token + head * head elements from the block's start.
struct RowStrides {
  std::int64_t token = 0;
  std::int64_t head = 0;
};
inline RowStrides row_strides(CacheLayout layout, int block_size, int num_kv_heads, int head_size) noexcept {
  const auto D = static_cast<std::int64_t>(head_size);
  if (layout == CacheLayout::kHND) return {D, static_cast<std::int64_t>(block_size) * D};
  return {static_cast<std::int64_t>(num_kv_heads) * D, D};
}

// Element size in bytes of the cache given the input dtype and the cache dtype.
inline std::size_t cache_elem_size(DType dtype, KVCacheDType kv) noexcept {
  return kv == KVCacheDType::kAuto ? dtype_size(dtype) : 1;
}

// copy_blocks / swap_blocks parameters handed to the CUDA backend (validated).
struct CopyBlocksParams {
  std::vector<void*> arrays;              // base pointers
  std::vector<std::int64_t> block_bytes;  // bytes of one block of each array (contiguous)
  std::vector<std::int64_t> block_stride_bytes;  // bytes from one block's start to the next's
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
  std::int64_t block_bytes = 0;             // bytes of one block (contiguous in both arrays)
  std::int64_t src_block_stride_bytes = 0;  // bytes from one block's start to the next's
  std::int64_t dst_block_stride_bytes = 0;
  std::int64_t src_blocks = 0;
  std::int64_t dst_blocks = 0;
  const void* mapping = nullptr;  // host [P, 2]
  bool mapping_int64 = true;
  std::int64_t num_pairs = 0;
  int device_id = 0;  // the GPU involved
};

}  // namespace pagedattn
