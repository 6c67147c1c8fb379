// The one parameter struct of the decode kernel family (tensor-core kernel, CUDA-core
// kernel and the partition reduce), passed by value to every kernel of the family.
// Only the host launcher (decode_launch.cu) fills it and chooses grid shapes.
//
// Dimension legend: S seqs, H query heads, K KV heads, G = H / K heads per KV head,
// D head size, B block size, N blocks, M max blocks per seq, NP partitions.
#pragma once

#include <cstdint>

#include "cuda/error_record.cuh"

namespace pagedattn::cuda_backend {

struct DecodeKernelParams {
  void* out;  // [S, H, D], query dtype
  std::int64_t o_stride_seq, o_stride_head;
  const void* query;  // [S, H, D]
  std::int64_t q_stride_seq, q_stride_head;
  const void* key_cache;    // vllm [N, K, D/x, B, x] | nhd [N, B, K, D] | hnd [N, K, B, D]
  const void* value_cache;  // vllm [N, K, D, B]      | nhd [N, B, K, D] | hnd [N, K, B, D]
  // Elements between the starts of consecutive blocks of each cache (>= one block), and,
  // for the token-major layouts (nhd and hnd share the kNHD kernels), the elements from a
  // block's start to token t, head h's row: t * tok_stride + h * head_stride.
  std::int64_t k_block_stride, v_block_stride;
  std::int64_t tok_stride, head_stride;
  const std::int32_t* block_tables;  // [S, M]
  const std::int32_t* seq_lens;      // [S]
  const float* alibi_slopes;         // [H] or null
  // A mixed varlen batch (the varlen kernel serves the sequences with more than one row):
  // [S + 1] row offsets, or null when row s of query / out is sequence s.
  const std::int32_t* query_start_loc;
  int num_tokens;     // T (mixed batches)
  int max_query_len;  // the caller's bound, or -1 (mixed batches)

  int num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq;
  std::int64_t num_blocks;
  int group;           // G
  int rows_per_cta;    // query heads of one group handled by one CTA (a head tile)
  int num_head_tiles;  // ceil(G / rows_per_cta)

  float qk_scale_log2;  // scale * k_scale * log2(e): logits are kept in base 2
  float v_scale;

  // Variants (0 / null = off). A window of W tokens: the query at len - 1 sees keys
  // len - W .. len - 1 and the partitions are laid from window_base() (decode_common.cuh).
  int sliding_window;
  float soft_cap_log2;      // soft_cap * log2(e): logit2 = soft_cap_log2 * tanh(logit2 / soft_cap_log2)
  float inv_soft_cap_log2;  // 1 / soft_cap_log2
  const float* sinks;       // [H] (natural units): exp(sinks[h]) joins head h's denominator

  int partition_size;  // tokens per partition (a multiple of 16)
  int num_partitions;  // NP; 1 = single pass, writes `out` directly
  float* part_out;     // [S, H, NP, D] unnormalised partial outputs (NP > 1)
  float* part_max;     // [S, H, NP] partial max logit (base 2)
  float* part_sum;     // [S, H, NP] partial exp-sum

  DeviceErrorRecord* error;  // the checked call's record, or null (unchecked)
};

}  // namespace pagedattn::cuda_backend
