// Public entry points: validate once, then route to the CPU or the CUDA backend.
#include "pagedattn/attention.hpp"

#include "cpu_backend.hpp"
#include "cuda_backend.hpp"
#include "thread_pool.hpp"

namespace pagedattn {

bool built_with_cuda() noexcept {
#ifdef PAGEDATTN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cpu_num_threads() { return cpu::num_threads(); }

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables, const TensorView& seq_lens,
                     const DecodeOptions& options) {
  const DecodeParams p = make_decode_params(out, query, key_cache, value_cache, block_tables, seq_lens, options);
  if (p.num_seqs == 0) return;
  if (query.device == DeviceKind::kCUDA)
    cuda_backend::paged_attention(p, options.stream);
  else
    cpu::paged_attention(p);
}

void run_decode(const DecodeParams& p, DeviceKind device, void* stream) {
  if (p.num_seqs == 0) return;
  if (device == DeviceKind::kCUDA) {
    cuda_backend::paged_attention(p, stream);
  } else {
    check_decode_indices(p);
    cpu::paged_attention(p);
  }
}

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const CacheWriteOptions& options) {
  const CacheWriteParams p = make_cache_write_params(key, value, key_cache, value_cache, slot_mapping, options);
  if (p.num_tokens == 0) return;
  if (key.device == DeviceKind::kCUDA)
    cuda_backend::reshape_and_cache(p, options.stream);
  else
    cpu::reshape_and_cache(p);
}

}  // namespace pagedattn
