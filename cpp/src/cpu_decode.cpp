// CPU paged-attention decode.
//
// One task per (sequence, KV head). A task reads each cached key and value of its KV
// head exactly once and serves all query heads of the group from that read: a block
// of keys is converted to float32 and transposed to [D][B] (so the q.k products are
// axpy loops over the block that the compiler vectorises), a block of values to
// [B][D]. Softmax is the numerically stable two-pass form over the whole context in
// float32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_backend.hpp"
#include "cpu_elements.hpp"
#include "cpu_simd.hpp"
#include "thread_pool.hpp"

namespace pagedattn::cpu {
namespace {

struct Scratch {
  std::vector<float> q;       // [G, D]
  std::vector<float> logits;  // [G, L]
  std::vector<float> raw;     // one block of one head, as stored: D * B floats
  std::vector<float> kt;      // [D, B]
  std::vector<float> acc;     // [G, D]
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

PAGEDATTN_HOT void decode_task(const DecodeParams& p, int seq, int kv_head) {
  const int G = p.num_heads / p.num_kv_heads;
  const int D = p.head_size;
  const int B = p.block_size;
  const int L = p.seq_lens[seq];
  const std::size_t elem = dtype_size(p.dtype);
  const std::size_t cache_elem = cache_elem_size(p.dtype, p.kv_cache_dtype);
  const int h0 = kv_head * G;

  Scratch& s = scratch();
  s.acc.assign(static_cast<std::size_t>(G) * D, 0.0f);

  auto write_out = [&]() {
    for (int g = 0; g < G; ++g) {
      char* dst = static_cast<char*>(p.out) + (seq * p.o_stride_seq + static_cast<std::int64_t>(h0 + g) * p.o_stride_head) *
                                                  static_cast<std::int64_t>(elem);
      store_row(s.acc.data() + static_cast<std::size_t>(g) * D, p.dtype, KVCacheDType::kAuto, 1.0f, D, dst);
    }
  };
  if (L == 0) {
    write_out();
    return;
  }

  s.q.resize(static_cast<std::size_t>(G) * D);
  for (int g = 0; g < G; ++g) {
    const char* src = static_cast<const char*>(p.query) +
                      (seq * p.q_stride_seq + static_cast<std::int64_t>(h0 + g) * p.q_stride_head) *
                          static_cast<std::int64_t>(elem);
    float* q = s.q.data() + static_cast<std::size_t>(g) * D;
    load_row(src, p.dtype, KVCacheDType::kAuto, 1.0f, D, q);
    for (int d = 0; d < D; ++d) q[d] *= p.scale;
  }
  s.logits.assign(static_cast<std::size_t>(G) * L, 0.0f);
  s.raw.resize(static_cast<std::size_t>(D) * B);
  s.kt.resize(static_cast<std::size_t>(D) * B);

  const int num_blocks = (L + B - 1) / B;
  const std::int32_t* table = p.block_tables + static_cast<std::int64_t>(seq) * p.max_blocks_per_seq;
  const auto head_elems = static_cast<std::int64_t>(D) * B;  // one block of one KV head
  const auto* kbase = static_cast<const char*>(p.key_cache);
  const auto* vbase = static_cast<const char*>(p.value_cache);
  const auto ce = static_cast<std::int64_t>(cache_elem);
  const int x = static_cast<int>(16 / cache_elem);

  // Loads one block of keys (kind 0) or values (kind 1) of this KV head as float32:
  // keys into s.kt as [D][B], values into s.raw as [B][D].
  auto load_block = [&](std::int64_t block, bool values) {
    const char* base = values ? vbase : kbase;
    const float sc = values ? p.v_scale : p.k_scale;
    if (p.layout == CacheLayout::kVLLM) {
      const char* src = base + ((block * p.num_kv_heads + kv_head) * head_elems) * ce;
      load_row(src, p.dtype, p.kv_cache_dtype, sc, D * B, s.raw.data());
      if (!values) {  // raw [D/x][B][x] -> kt [D][B]
        for (int c = 0; c < D / x; ++c)
          for (int t = 0; t < B; ++t)
            for (int j = 0; j < x; ++j)
              s.kt[static_cast<std::size_t>(c * x + j) * B + t] = s.raw[(static_cast<std::size_t>(c) * B + t) * x + j];
      } else {  // raw [D][B] -> kt used as [B][D]
        for (int d = 0; d < D; ++d)
          for (int t = 0; t < B; ++t) s.kt[static_cast<std::size_t>(t) * D + d] = s.raw[static_cast<std::size_t>(d) * B + t];
      }
    } else {  // nhd: token t of the block at [block, t, kv_head, :]
      for (int t = 0; t < B; ++t) {
        const char* src = base + ((block * B + t) * p.num_kv_heads + kv_head) * static_cast<std::int64_t>(D) * ce;
        load_row(src, p.dtype, p.kv_cache_dtype, sc, D, s.raw.data() + static_cast<std::size_t>(t) * D);
      }
      if (!values) {
        for (int t = 0; t < B; ++t)
          for (int d = 0; d < D; ++d) s.kt[static_cast<std::size_t>(d) * B + t] = s.raw[static_cast<std::size_t>(t) * D + d];
      } else {
        std::copy(s.raw.begin(), s.raw.end(), s.kt.begin());
      }
    }
  };

  // Pass 1: logits = (scale * q) . k for every token of the context.
  for (int b = 0; b < num_blocks; ++b) {
    const int n = std::min(B, L - b * B);
    load_block(table[b], false);
    for (int g = 0; g < G; ++g) {
      float* lg = s.logits.data() + static_cast<std::size_t>(g) * L + static_cast<std::size_t>(b) * B;
      const float* q = s.q.data() + static_cast<std::size_t>(g) * D;
      for (int d = 0; d < D; ++d) {
        const float qd = q[d];
        const float* kd = s.kt.data() + static_cast<std::size_t>(d) * B;
        for (int t = 0; t < n; ++t) lg[t] += qd * kd[t];
      }
    }
  }

  // Softmax per query head (ALiBi bias first).
  std::vector<float> inv_sum(static_cast<std::size_t>(G));
  for (int g = 0; g < G; ++g) {
    float* lg = s.logits.data() + static_cast<std::size_t>(g) * L;
    if (p.alibi_slopes) {
      const float slope = p.alibi_slopes[h0 + g];
      for (int t = 0; t < L; ++t) lg[t] += slope * static_cast<float>(t - L + 1);
    }
    float mx = -INFINITY;
    for (int t = 0; t < L; ++t) mx = std::max(mx, lg[t]);
    double sum = 0.0;
    for (int t = 0; t < L; ++t) {
      lg[t] = std::exp(lg[t] - mx);
      sum += lg[t];
    }
    inv_sum[static_cast<std::size_t>(g)] = static_cast<float>(1.0 / sum);
  }

  // Pass 2: acc = sum_t p_t * v_t.
  for (int b = 0; b < num_blocks; ++b) {
    const int n = std::min(B, L - b * B);
    load_block(table[b], true);
    for (int g = 0; g < G; ++g) {
      const float* pr = s.logits.data() + static_cast<std::size_t>(g) * L + static_cast<std::size_t>(b) * B;
      float* acc = s.acc.data() + static_cast<std::size_t>(g) * D;
      for (int t = 0; t < n; ++t) {
        const float w = pr[t];
        const float* v = s.kt.data() + static_cast<std::size_t>(t) * D;
        for (int d = 0; d < D; ++d) acc[d] += w * v[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    float* acc = s.acc.data() + static_cast<std::size_t>(g) * D;
    const float inv = inv_sum[static_cast<std::size_t>(g)];
    for (int d = 0; d < D; ++d) acc[d] *= inv;
  }
  write_out();
}

}  // namespace

void paged_attention(const DecodeParams& p) {
  const std::int64_t tasks = static_cast<std::int64_t>(p.num_seqs) * p.num_kv_heads;
  parallel_for(tasks, [&](std::int64_t i) {
    decode_task(p, static_cast<int>(i / p.num_kv_heads), static_cast<int>(i % p.num_kv_heads));
  });
}

}  // namespace pagedattn::cpu
