// The CPU backend: same semantics as the CUDA kernels, used for host arrays and as the
// reference the CUDA backend is tested against.
#pragma once

#include <cmath>

#include "params.hpp"

namespace pagedattn::cpu {

// exp(sink - row_max): an attention sink's share of a softmax denominator whose terms are
// exp(logit - row_max). -inf is no sink. A row without a finite logit (row_max = -inf:
// non-finite inputs) stays NaN, as it is without a sink.
inline double sink_weight(float sink, float row_max) {
  if (sink == -INFINITY) return 0.0;
  if (row_max == -INFINITY) return NAN;
  return std::exp(static_cast<double>(sink) - static_cast<double>(row_max));
}

void paged_attention(const DecodeParams& p);
// The varlen form (p.query_start_loc set): chunked prefill and mixed batches (cpu_prefill.cpp).
void paged_attention_varlen(const DecodeParams& p);
void reshape_and_cache(const CacheWriteParams& p);

}  // namespace pagedattn::cpu
