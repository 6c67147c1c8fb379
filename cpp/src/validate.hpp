// The validation pass (validate.cpp), as the entry points and the prepared call use it.
// Everything it returns has been checked; backends trust it.
#pragma once

#include "pagedattn/attention.hpp"
#include "params.hpp"

namespace pagedattn {

// Checks every argument of paged_attention and returns what a backend receives.
DecodeParams make_decode_params(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                                const TensorView& value_cache, const TensorView& block_tables,
                                const TensorView& seq_lens, const AttentionOptions& options);

// The part of the pass that sizes and options alone decide (shared with the workspace and
// plan queries, so those answer exactly for the calls paged_attention accepts). `device`
// is where the call runs.
void check_decode_shape(const DecodeShape& shape, DeviceKind device, const AttentionOptions& options);

// Parameters of a decode with these sizes and options but no arrays (the queries' input
// to the planner), after check_decode_shape.
DecodeParams decode_params_of(const DecodeShape& shape, const AttentionOptions& options);

// Checks the index contents of host arrays in p (every seq_len in range, every block id a
// sequence reaches inside the pool): part of make_decode_params, and repeated by a
// prepared call's run() on the host, since the contents may have changed.
void check_decode_indices(const DecodeParams& p);
// The varlen part of it: query_start_loc starts at 0, never decreases, ends at num_tokens;
// no sequence has more query rows than tokens, nor more than max_query_len when given.
void check_query_start_loc(const DecodeParams& p);

CacheWriteParams make_cache_write_params(const TensorView& key, const TensorView& value,
                                         const TensorView& key_cache, const TensorView& value_cache,
                                         const TensorView& slot_mapping, const CacheWriteOptions& options);

}  // namespace pagedattn
