// CPU paged attention, varlen form (chunked prefill and mixed batches).
//
// One task per (sequence, KV head): the sequence's keys and values of that head are read
// from the paged cache once into float32 rows, then every query row of every query head
// of the group is served from them with a numerically stable softmax in float32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_backend.hpp"
#include "cpu_elements.hpp"
#include "thread_pool.hpp"

namespace pagedattn::cpu {
namespace {

// Reads tokens [0, len) of KV head kh of sequence s into k / v ([len, D] float32).
void gather_kv(const DecodeParams& p, std::int64_t s, int kh, int len, float* k, float* v) {
  const int D = p.head_size, B = p.block_size, K = p.num_kv_heads;
  const std::size_t es = cache_elem_size(p.dtype, p.kv_cache_dtype);
  const int x = static_cast<int>(16 / es);
  const auto* kc = static_cast<const char*>(p.key_cache);
  const auto* vc = static_cast<const char*>(p.value_cache);
  const std::int32_t* row = p.block_tables + s * p.max_blocks_per_seq;
  for (int t = 0; t < len; ++t) {
    const std::int64_t blk = row[t / B];
    const int off = t % B;
    float* kt = k + static_cast<std::size_t>(t) * D;
    float* vt = v + static_cast<std::size_t>(t) * D;
    if (p.layout == CacheLayout::kNHD) {
      const std::int64_t base = ((blk * B + off) * K + kh) * D;
      load_row(kc + base * es, p.dtype, p.kv_cache_dtype, p.k_scale, D, kt);
      load_row(vc + base * es, p.dtype, p.kv_cache_dtype, p.v_scale, D, vt);
    } else {
      const std::int64_t head = blk * K + kh;
      for (int c = 0; c < D / x; ++c)
        load_row(kc + ((head * (D / x) + c) * B + off) * x * es, p.dtype, p.kv_cache_dtype, p.k_scale, x,
                 kt + c * x);
      for (int d = 0; d < D; ++d)
        load_row(vc + ((head * D + d) * B + off) * es, p.dtype, p.kv_cache_dtype, p.v_scale, 1, vt + d);
    }
  }
}

}  // namespace

void paged_attention_varlen(const DecodeParams& p) {
  const int D = p.head_size, K = p.num_kv_heads, G = p.num_heads / p.num_kv_heads;
  const std::size_t es = dtype_size(p.dtype);
  const KVCacheDType kAuto = KVCacheDType::kAuto;
  parallel_for(static_cast<std::int64_t>(p.num_seqs) * K, [&](std::int64_t task) {
    const std::int64_t s = task / K;
    const int kh = static_cast<int>(task % K);
    const std::int64_t row0 = p.query_start_loc[s];
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int len = p.seq_lens[s];
    if (q_len == 0) return;
    std::vector<float> k(static_cast<std::size_t>(len) * D), v(k.size()), q(D), acc(D), logits(len);
    gather_kv(p, s, kh, len, k.data(), v.data());
    for (int g = 0; g < G; ++g) {
      const int h = kh * G + g;
      const float slope = p.alibi_slopes ? p.alibi_slopes[h] : 0.0f;
      for (int j = 0; j < q_len; ++j) {
        const std::int64_t r = row0 + j;
        const int pos = len - q_len + j;  // the row's position; it attends to 0 .. pos
        load_row(static_cast<const char*>(p.query) + (r * p.q_stride_seq + h * p.q_stride_head) * es, p.dtype,
                 kAuto, 1.0f, D, q.data());
        float mx = -INFINITY;
        for (int t = 0; t <= pos; ++t) {
          const float* kt = k.data() + static_cast<std::size_t>(t) * D;
          float dot = 0.0f;
          for (int d = 0; d < D; ++d) dot += q[static_cast<std::size_t>(d)] * kt[d];
          logits[static_cast<std::size_t>(t)] = dot * p.scale + slope * static_cast<float>(t - pos);
          mx = std::max(mx, logits[static_cast<std::size_t>(t)]);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        float sum = 0.0f;
        for (int t = 0; t <= pos; ++t) {
          const float w = std::exp(logits[static_cast<std::size_t>(t)] - mx);
          sum += w;
          const float* vt = v.data() + static_cast<std::size_t>(t) * D;
          for (int d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += w * vt[d];
        }
        for (float& a : acc) a /= sum;
        store_row(acc.data(), p.dtype, kAuto, 1.0f, D,
                  static_cast<char*>(p.out) + (r * p.o_stride_seq + h * p.o_stride_head) * es);
      }
    }
  });
}

}  // namespace pagedattn::cpu
