// The CPU backend: same semantics as the CUDA kernels, used for host arrays and as the
// reference the CUDA backend is tested against.
#pragma once

#include "params.hpp"

namespace pagedattn::cpu {

void paged_attention(const DecodeParams& p);
// The varlen form (p.query_start_loc set): chunked prefill and mixed batches (cpu_prefill.cpp).
void paged_attention_varlen(const DecodeParams& p);
void reshape_and_cache(const CacheWriteParams& p);

}  // namespace pagedattn::cpu
