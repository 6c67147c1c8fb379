// CPU paged-attention decode.
//
// One task per (sequence, KV head). A task reads each cached key and value of its KV
// head exactly once and serves all query heads of the group from that read. Each
// block is converted to float32 in the cache's own element order (float32 caches are
// read in place), then:
//   - keys: every token's q.k is a sum of 8-wide multiply-adds over the token's
//     8-element chunks, which both layouts store contiguously (vllm: x >= 8, or a
//     re-chunked copy for float32's x = 4; nhd: the row itself);
//   - values: 8-wide multiply-adds along the block's tokens (vllm, [D][B]) or along
//     the head dimension (nhd, [B][D]) into a float32 accumulator that is folded into
//     a float64 running total every kMergeTokens tokens: float32 sums stay short, so
//     the output's error does not grow with the context length.
// Head sizes that are not a multiple of 8 (and vllm blocks not a multiple of 8 for the
// values) take a plain scalar path. Softmax is numerically stable (max subtracted) in
// float32, over chunks of at most kChunkTokens tokens with a running max and sum (the
// online form), so a task's scratch does not grow with the context length.
// Variants: a sliding window starts the block loop at the window's first block and skips
// the tokens before the window in it (never read into a sum); the soft cap maps the
// chunk's logits through tanh before ALiBi; a sink joins the denominator once, at the end.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_backend.hpp"
#include "cpu_elements.hpp"
#include "cpu_simd.hpp"
#include "pagedattn/errors.hpp"
#include "thread_pool.hpp"

namespace pagedattn::cpu {
namespace {

constexpr int W = 8;  // floats per vector chunk
// Tokens whose logits a task holds at once (rounded down to whole blocks, at least one).
constexpr int kChunkTokens = 4096;
// Tokens whose weighted values are summed in float32 before they are folded into the
// float64 total (rounded down to whole blocks, at least one): short enough that the
// float32 sums add little error, long enough that folding costs a few percent at most.
constexpr int kMergeTokens = 256;
typedef float f8 __attribute__((vector_size(W * sizeof(float))));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(f8 v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

struct Scratch {
  std::vector<float> q;       // [G, D], pre-scaled
  std::vector<float> logits;  // [G, chunk tokens]
  std::vector<float> raw;     // one block of one head as float32, in cache order (D * B)
  std::vector<float> chunked;  // float32 vllm keys re-chunked to [D/8][B][8]
  std::vector<float> acc;     // [G, D] (nhd, scalar) or [G, D, 8] lanes (vllm vector path):
                              // the float32 sum of at most kMergeTokens tokens
  std::vector<std::int32_t> blocks;  // this sequence's block ids, read once and checked
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Where the 8-element chunk c of token t of a converted key block starts, and how
// chunks/tokens are strided: ptr = base + (c / per_group) * group_stride
//                                   + t * tok_stride + (c % per_group) * 8.
struct ChunkMap {
  const float* base;
  int per_group;
  std::int64_t group_stride;
  std::int64_t tok_stride;
  const float* at(int c, int t) const {
    return base + (c / per_group) * group_stride + t * tok_stride + (c % per_group) * W;
  }
};

class DecodeTask {
 public:
  DecodeTask(const DecodeParams& p, int seq, int kv_head)
      : p_(p),
        G_(p.num_heads / p.num_kv_heads),
        D_(p.head_size),
        B_(p.block_size),
        L_(read_seq_len(p, seq)),
        seq_(seq),
        kv_head_(kv_head),
        h0_(kv_head * G_),
        ce_(static_cast<std::int64_t>(cache_elem_size(p.dtype, p.kv_cache_dtype))),
        x_(static_cast<int>(supported::kCacheChunkBytes / ce_)),
        head_elems_(static_cast<std::int64_t>(D_) * B_),
        rows_(p.layout != CacheLayout::kVLLM),
        direct_(p.dtype == DType::kFloat32 && p.kv_cache_dtype == KVCacheDType::kAuto &&
                p.layout != CacheLayout::kNHD),
        vec_k_(D_ % W == 0),
        vec_v_(D_ % W == 0 && (rows_ || B_ % W == 0)),
        rs_(row_strides(p.layout, p.block_size, p.num_kv_heads, p.head_size)),
        s_(scratch()) {}

  void run() {
    const bool lanes = vec_v_ && !rows_;
    s_.acc.assign(static_cast<std::size_t>(G_) * D_ * (lanes ? W : 1), 0.0f);
    total_.assign(static_cast<std::size_t>(G_) * D_, 0.0);
    if (L_ > 0) {
      const int num_blocks = L_ / B_ + (L_ % B_ != 0);  // L_ + B_ - 1 overflows int near 2^31
      ws_ = static_cast<int>(window_start(p_.sliding_window, L_ - 1));
      const int first_block = ws_ / B_;
      read_block_ids(first_block, num_blocks);
      load_query();
      const int chunk = std::max(1, kChunkTokens / B_);
      lstride_ = std::min(num_blocks - first_block, chunk) * B_;
      s_.logits.resize(static_cast<std::size_t>(G_) * static_cast<std::size_t>(lstride_));
      max_.assign(static_cast<std::size_t>(G_), -INFINITY);
      sum_.assign(static_cast<std::size_t>(G_), 0.0);
      for (int b0 = first_block; b0 < num_blocks; b0 += chunk) {
        const int b1 = std::min(num_blocks, b0 + chunk);
        logits_pass(b0, b1);
        softmax(b0, b1);
        value_pass(b0, b1, lanes);
      }
      inv_sum_.resize(static_cast<std::size_t>(G_));
      for (int g = 0; g < G_; ++g) {
        const auto gi = static_cast<std::size_t>(g);
        const double sink = p_.sinks ? sink_weight(p_.sinks[h0_ + g], max_[gi]) : 0.0;
        inv_sum_[gi] = 1.0 / (sum_[gi] + sink);
      }
    }
    write_out();
  }

 private:
  // The index arrays were validated before dispatch, but the caller's memory may change
  // while the call runs (another thread): each index is read exactly once, here, and
  // checked again where it is used, so a racing change gives a wrong answer or an
  // error, never an access out of bounds.
  static int read_seq_len(const DecodeParams& p, int seq) {
    const std::int32_t len = p.seq_lens[seq];
    const std::int64_t max_len = static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size;
    if (len < 0 || len > max_len)
      fail<OutOfRange>("seq_lens[", seq, "] = ", len, " is outside [0, ", max_len,
                       "] (it changed while the call ran)");
    return len;
  }

  // Blocks [first, num_blocks) (the entries before a window's first block are not read).
  void read_block_ids(int first, int num_blocks) {
    const std::int32_t* row = p_.block_tables + static_cast<std::int64_t>(seq_) * p_.max_blocks_per_seq;
    s_.blocks.resize(static_cast<std::size_t>(num_blocks));
    for (int b = first; b < num_blocks; ++b) {
      const std::int32_t id = row[b];
      if (id < 0 || id >= p_.num_blocks)
        fail<OutOfRange>("block_tables[", seq_, ", ", b, "] = ", id, " is outside [0, num_blocks = ", p_.num_blocks,
                         ") (it changed while the call ran)");
      s_.blocks[static_cast<std::size_t>(b)] = id;
    }
  }

  std::size_t gd(int g) const { return static_cast<std::size_t>(g) * D_; }
  int tokens_in(int b) const { return std::min(B_, L_ - b * B_); }
  // The first token of block b inside the window (0 but in the window's first block).
  int first_in(int b) const { return std::max(0, ws_ - b * B_); }

  void load_query() {
    const auto elem = static_cast<std::int64_t>(dtype_size(p_.dtype));
    s_.q.resize(static_cast<std::size_t>(G_) * D_);
    for (int g = 0; g < G_; ++g) {
      const char* src = static_cast<const char*>(p_.query) +
                        (seq_ * p_.q_stride_seq + static_cast<std::int64_t>(h0_ + g) * p_.q_stride_head) * elem;
      float* q = s_.q.data() + gd(g);
      load_row(src, p_.dtype, KVCacheDType::kAuto, 1.0f, D_, q);
      for (int d = 0; d < D_; ++d) q[d] *= p_.scale;
    }
  }

  // One block of this KV head as float32 in cache order: vllm keys [D/x][B][x], vllm
  // values [D][B], nhd and hnd [B][D] (nhd: rows gathered; vllm and hnd: the head's
  // part of the block is contiguous).
  const float* load_block(std::int64_t block, bool values) {
    const char* base = static_cast<const char*>(values ? p_.value_cache : p_.key_cache) +
                       block * (values ? p_.v_block_stride : p_.k_block_stride) * ce_;
    const float sc = values ? p_.v_scale : p_.k_scale;
    s_.raw.resize(static_cast<std::size_t>(head_elems_));
    if (p_.layout != CacheLayout::kNHD) {
      const char* src = base + kv_head_ * head_elems_ * ce_;
      if (direct_) return reinterpret_cast<const float*>(src);
      load_row(src, p_.dtype, p_.kv_cache_dtype, sc, static_cast<int>(head_elems_), s_.raw.data());
      return s_.raw.data();
    }
    for (int t = 0; t < B_; ++t) {
      const char* src = base + (t * rs_.token + kv_head_ * rs_.head) * ce_;
      load_row(src, p_.dtype, p_.kv_cache_dtype, sc, D_, s_.raw.data() + static_cast<std::size_t>(t) * D_);
    }
    return s_.raw.data();
  }

  // Element (t, d) of a converted key block.
  float key_at(const float* kb, int t, int d) const {
    if (rows_) return kb[static_cast<std::size_t>(t) * D_ + d];
    return kb[(static_cast<std::size_t>(d / x_) * B_ + t) * x_ + d % x_];
  }

  ChunkMap key_chunks(const float* kb) {
    if (rows_) return {kb, D_ / W, 0, D_};
    if (x_ >= W) return {kb, x_ / W, static_cast<std::int64_t>(B_) * x_, x_};
    // x = 4 (float32): re-chunk [D/4][B][4] into [D/8][B][8].
    s_.chunked.resize(static_cast<std::size_t>(head_elems_));
    for (int c = 0; c < D_ / W; ++c)
      for (int t = 0; t < B_; ++t)
        for (int half = 0; half < 2; ++half)
          std::memcpy(s_.chunked.data() + (static_cast<std::size_t>(c) * B_ + t) * W + half * 4,
                      kb + (static_cast<std::size_t>(2 * c + half) * B_ + t) * 4, 4 * sizeof(float));
    return {s_.chunked.data(), 1, static_cast<std::int64_t>(B_) * W, W};
  }

  // logits[g][t - b0 * B] = (scale * q[g]) . k[t] for every token of blocks [b0, b1).
  PAGEDATTN_HOT void logits_pass(int b0, int b1) {
    for (int b = b0; b < b1; ++b) {
      const int n = tokens_in(b);
      const int t0 = first_in(b);  // tokens before it are outside the window: never read
      const float* kb = load_block(s_.blocks[static_cast<std::size_t>(b)], false);
      float* lg0 = s_.logits.data() + static_cast<std::size_t>(b - b0) * B_;
      if (vec_k_) {
        const ChunkMap km = key_chunks(kb);
        for (int g = 0; g < G_; ++g) {
          const float* q = s_.q.data() + gd(g);
          float* lg = lg0 + static_cast<std::size_t>(g) * lstride_;
          for (int t = t0; t < n; ++t) {
            f8 acc = {};
            for (int c = 0; c < D_ / W; ++c) acc += load8(q + c * W) * load8(km.at(c, t));
            lg[t] = hsum(acc);
          }
        }
      } else {
        for (int g = 0; g < G_; ++g) {
          const float* q = s_.q.data() + gd(g);
          float* lg = lg0 + static_cast<std::size_t>(g) * lstride_;
          for (int t = t0; t < n; ++t) {
            float acc = 0.0f;
            for (int d = 0; d < D_; ++d) acc += q[d] * key_at(kb, t, d);
            lg[t] = acc;
          }
        }
      }
    }
  }

  // Softmax of one chunk per query head (soft cap, then ALiBi bias first), online: the
  // running max rises to cover the chunk, the sum and the output total are rescaled to it.
  // Probabilities stay unnormalised; the 1 / sum is applied to the output. With a single
  // chunk this is exactly the two-pass softmax over the whole context. Tokens before the
  // window (j < j0, first chunk only) weigh 0.
  void softmax(int b0, int b1) {
    const int t0 = b0 * B_;
    const int n = std::min(L_, b1 * B_) - t0;
    const int j0 = std::min(n, std::max(0, ws_ - t0));
    for (int g = 0; g < G_; ++g) {
      const auto gi = static_cast<std::size_t>(g);
      float* full = s_.logits.data() + gi * static_cast<std::size_t>(lstride_);
      std::fill(full, full + j0, 0.0f);
      float* lg = full + j0;
      const int m = n - j0;
      if (p_.soft_cap > 0.0f) {
        const float cap = p_.soft_cap, inv = 1.0f / p_.soft_cap;
        for (int j = 0; j < m; ++j) lg[j] = cap * std::tanh(lg[j] * inv);
      }
      if (p_.alibi_slopes) {
        const float slope = p_.alibi_slopes[h0_ + g];
        for (int j = 0; j < m; ++j) lg[j] += slope * static_cast<float>(t0 + j0 + j - L_ + 1);
      }
      float mx = max_[gi];
      for (int j = 0; j < m; ++j) mx = std::max(mx, lg[j]);
      if (mx == -INFINITY) {  // nothing but -inf so far: these tokens weigh 0
        std::fill(lg, lg + m, 0.0f);
        continue;
      }
      const float corr = std::exp(max_[gi] - mx);  // 0 on the first finite chunk
      if (corr != 1.0f) {
        double* total = total_.data() + gd(g);
        for (int d = 0; d < D_; ++d) total[d] *= corr;
      }
      double sum = sum_[gi] * corr;
      for (int j = 0; j < m; ++j) {
        lg[j] = std::exp(lg[j] - mx);
        sum += lg[j];
      }
      sum_[gi] = sum;
      max_[gi] = mx;
    }
  }

  // Adds the float32 accumulator into the float64 total and clears it.
  void fold(bool lanes) {
    for (int g = 0; g < G_; ++g) {
      double* total = total_.data() + gd(g);
      if (lanes) {
        const float* acc = s_.acc.data() + gd(g) * W;
        for (int d = 0; d < D_; ++d) total[d] += hsum(load8(acc + static_cast<std::size_t>(d) * W));
      } else {
        const float* acc = s_.acc.data() + gd(g);
        for (int d = 0; d < D_; ++d) total[d] += acc[d];
      }
    }
    std::fill(s_.acc.begin(), s_.acc.end(), 0.0f);
  }

  // total[g] += sum_t p[g][t] * v[t] over the tokens of blocks [b0, b1), through the
  // float32 accumulator folded every kMergeTokens tokens.
  void value_pass(int b0, int b1, bool lanes) {
    const int per_fold = std::max(1, kMergeTokens / B_);
    for (int f0 = b0; f0 < b1; f0 += per_fold) {
      value_blocks(b0, f0, std::min(b1, f0 + per_fold));
      fold(lanes);
    }
  }

  // acc[g] += sum_t p[g][t] * v[t] over the tokens of blocks [f0, f1) of the chunk that
  // starts at block b0.
  PAGEDATTN_HOT void value_blocks(int b0, int f0, int f1) {
    for (int b = f0; b < f1; ++b) {
      const int n = tokens_in(b);
      const int t0 = first_in(b);  // tokens before it are outside the window: never read
      const float* vb = load_block(s_.blocks[static_cast<std::size_t>(b)], true);
      const float* pr0 = s_.logits.data() + static_cast<std::size_t>(b - b0) * B_;
      for (int g = 0; g < G_; ++g) {
        const float* pr = pr0 + static_cast<std::size_t>(g) * lstride_;
        if (rows_) {  // vb [B][D]
          float* acc = s_.acc.data() + gd(g);
          for (int t = t0; t < n; ++t) {
            const float w = pr[t];
            const float* v = vb + static_cast<std::size_t>(t) * D_;
            if (vec_v_) {
              const f8 wv = f8{} + w;
              for (int c = 0; c < D_ / W; ++c) store8(acc + c * W, load8(acc + c * W) + wv * load8(v + c * W));
            } else {
              for (int d = 0; d < D_; ++d) acc[d] += w * v[d];
            }
          }
        } else if (vec_v_ && n == B_ && t0 == 0) {  // vb [D][B], full block: 8 tokens per vector
          float* acc = s_.acc.data() + gd(g) * W;
          for (int d = 0; d < D_; ++d) {
            f8 a = load8(acc + static_cast<std::size_t>(d) * W);
            const float* vr = vb + static_cast<std::size_t>(d) * B_;
            for (int tc = 0; tc < B_ / W; ++tc) a += load8(pr + tc * W) * load8(vr + tc * W);
            store8(acc + static_cast<std::size_t>(d) * W, a);
          }
        } else {  // vb [D][B], partial block or scalar path: only tokens t0 .. n are read
          const int stride = vec_v_ ? W : 1;
          float* acc = s_.acc.data() + gd(g) * static_cast<std::size_t>(stride);
          for (int d = 0; d < D_; ++d) {
            const float* vr = vb + static_cast<std::size_t>(d) * B_;
            float a = 0.0f;
            for (int t = t0; t < n; ++t) a += pr[t] * vr[t];
            acc[static_cast<std::size_t>(d) * stride] += a;
          }
        }
      }
    }
  }

  void write_out() {
    const auto elem = static_cast<std::int64_t>(dtype_size(p_.dtype));
    std::vector<float>& row = s_.raw;
    row.resize(static_cast<std::size_t>(std::max<std::int64_t>(D_, head_elems_)));
    for (int g = 0; g < G_; ++g) {
      const double inv = L_ > 0 ? inv_sum_[static_cast<std::size_t>(g)] : 0.0;
      for (int d = 0; d < D_; ++d) row[static_cast<std::size_t>(d)] = static_cast<float>(total_[gd(g) + d] * inv);
      char* dst = static_cast<char*>(p_.out) +
                  (seq_ * p_.o_stride_seq + static_cast<std::int64_t>(h0_ + g) * p_.o_stride_head) * elem;
      store_row(row.data(), p_.dtype, KVCacheDType::kAuto, 1.0f, D_, dst);
    }
  }

  const DecodeParams& p_;
  const int G_, D_, B_, L_, seq_, kv_head_, h0_;
  const std::int64_t ce_;
  const int x_;
  const std::int64_t head_elems_;
  const bool rows_;  // token-major blocks, [B][D] per head (nhd, hnd)
  const bool direct_, vec_k_, vec_v_;
  const RowStrides rs_;
  Scratch& s_;
  int ws_ = 0;                 // the window's first token (0 without a window)
  int lstride_ = 0;            // logits row length: tokens of one chunk
  std::vector<float> max_;     // [G] running max of the logits
  std::vector<double> sum_;    // [G] running sum of exp(logit - max)
  std::vector<double> inv_sum_;
  std::vector<double> total_;  // [G, D] running sum of exp(logit - max) * v
};

}  // namespace

void paged_attention(const DecodeParams& p) {
  const std::int64_t tasks = static_cast<std::int64_t>(p.num_seqs) * p.num_kv_heads;
  parallel_for(tasks, [&](std::int64_t i) {
    DecodeTask(p, static_cast<int>(i / p.num_kv_heads), static_cast<int>(i % p.num_kv_heads)).run();
  });
}

}  // namespace pagedattn::cpu
