// The varlen launcher (cuda/prefill_launch.cu), called by paged_attention for a call
// with query_start_loc.
#pragma once

#include <cuda_runtime.h>

#include "params.hpp"

namespace pagedattn::cuda_backend {

// True when a varlen call is a plain decode batch the decode kernels serve as is: the
// caller's max_query_len = 1 and T = S (so every sequence has exactly one row, row i).
inline bool varlen_is_decode(const DecodeParams& p) {
  return p.max_query_len == 1 && p.num_tokens == p.num_seqs && !p.check_block_tables;
}

// p.query_start_loc set; everything validated. With skip_single the kernel leaves the
// sequences of exactly one valid row to the decode kernels (decode_row()).
void paged_attention_varlen(const DecodeParams& p, cudaStream_t stream, bool skip_single);

// The kernel family a varlen call with these parameters runs on its device:
// "sm90_wgmma", "sm80_mma" or "cuda_core".
const char* varlen_kernel_name(const DecodeParams& p);

}  // namespace pagedattn::cuda_backend
