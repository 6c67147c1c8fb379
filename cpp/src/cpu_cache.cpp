// CPU reshape_and_cache: scatter new keys and values into their cache slots.
#include <cstring>
#include <vector>

#include "cpu_backend.hpp"
#include "cpu_elements.hpp"
#include "cpu_fp8.hpp"
#include "pagedattn/errors.hpp"
#include "thread_pool.hpp"

namespace pagedattn::cpu {

void reshape_and_cache(const CacheWriteParams& p) {
  const int K = p.num_kv_heads, D = p.head_size, B = p.block_size;
  const auto elem = static_cast<std::int64_t>(dtype_size(p.dtype));
  const auto ce = static_cast<std::int64_t>(cache_elem_size(p.dtype, p.kv_cache_dtype));
  const int x = static_cast<int>(supported::kCacheChunkBytes / ce);
  const bool fp8 = p.kv_cache_dtype != KVCacheDType::kAuto;
  const RowStrides rows = row_strides(p.layout, B, K, D);

  parallel_for(p.num_tokens, [&](std::int64_t t) {
    const std::int64_t slot = p.slot_mapping_int64 ? static_cast<const std::int64_t*>(p.slot_mapping)[t]
                                                   : static_cast<const std::int32_t*>(p.slot_mapping)[t];
    if (slot < 0) return;  // padding
    // Read once (above) and checked here again: slot_mapping may change while the call
    // runs (another thread), and a changed slot must never address outside the caches.
    if (slot / B >= p.num_blocks)
      fail<OutOfRange>("slot_mapping[", t, "] = ", slot, " is outside [-1, num_blocks * block_size = ",
                       p.num_blocks * B, ") (it changed while the call ran)");
    const std::int64_t block = slot / B;
    const int off = static_cast<int>(slot % B);
    thread_local std::vector<unsigned char> packed;
    packed.resize(static_cast<std::size_t>(D) * static_cast<std::size_t>(ce));
    for (int h = 0; h < K; ++h) {
      for (int which = 0; which < 2; ++which) {
        const bool is_value = which == 1;
        const char* src = static_cast<const char*>(is_value ? p.value : p.key) +
                          (t * (is_value ? p.v_stride_tok : p.k_stride_tok) +
                           h * (is_value ? p.v_stride_head : p.k_stride_head)) *
                              elem;
        char* cache = static_cast<char*>(is_value ? p.value_cache : p.key_cache);
        // Convert the row once into the cache's element type (a no-op copy when equal).
        const void* packed_row = src;
        if (fp8) {
          quantize_fp8_span(src, p.dtype, is_value ? p.v_scale : p.k_scale, p.kv_cache_dtype, D, packed.data());
          packed_row = packed.data();
        }
        const auto* pr = static_cast<const char*>(packed_row);
        cache += block * (is_value ? p.v_block_stride : p.k_block_stride) * ce;  // the block's start
        if (p.layout != CacheLayout::kVLLM) {  // nhd [B, K, D] / hnd [K, B, D] blocks: one row
          std::memcpy(cache + (off * rows.token + h * rows.head) * ce, pr, static_cast<std::size_t>(D * ce));
        } else if (!is_value) {  // [N, K, D/x, B, x]
          char* base = cache + (h * static_cast<std::int64_t>(D) * B) * ce;
          for (int c = 0; c < D / x; ++c)
            std::memcpy(base + ((static_cast<std::int64_t>(c) * B + off) * x) * ce, pr + c * x * ce,
                        static_cast<std::size_t>(x * ce));
        } else {  // [N, K, D, B]
          char* base = cache + (h * static_cast<std::int64_t>(D) * B) * ce;
          for (int d = 0; d < D; ++d)
            std::memcpy(base + (static_cast<std::int64_t>(d) * B + off) * ce, pr + d * ce, static_cast<std::size_t>(ce));
        }
      }
    }
  });
}

}  // namespace pagedattn::cpu
