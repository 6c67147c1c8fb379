// CPU paged attention, varlen form (chunked prefill and mixed batches).
//
// Work is cut into tiles: up to kTileRows rows of one sequence and one KV head, where a
// row is one (query token, query head of the KV head's group) pair, token-major. A tile
// walks its keys in chunks of whole blocks (about kChunkKeys keys). Each chunk is read
// from the paged cache and converted (to float32, or repacked as bfloat16 pairs), keys
// transposed to [D, chunk] and values to [chunk, D]: once for all the tiles of a
// (sequence, KV head) when it has several (SharedChunks), else by the tile itself. Then
//   S = (scale * Q) . K^T        one blocked matrix product over the tile's rows,
//   causal mask (diagonal chunks only; chunks wholly above the diagonal are never read),
//   online softmax in float32 (running max and sum per row),
//   O += P . V                   a second blocked matrix product.
// O is summed in float32 over at most kMergeKeys keys and then folded into a float64
// total (as the decode path does), so the error does not grow with the context length.
// The matrix products and the exponentials are compiled for AVX-512, AVX2 + FMA and the
// baseline, picked once at run time (see pick_kernels); on CPUs with AVX512-BF16,
// bfloat16 inputs take bfloat16 pair products (see bf16dot).
//
// Variants: with a sliding window a tile's key loop starts at the block of its first
// row's window start, and the keys of that chunk before it are cleared after loading (so
// slots outside every window never reach a sum); each row masks the keys before its own
// window. The soft cap maps the logits through tanh before ALiBi; a sink joins each row's
// denominator once, when the output is written.
//
// A batch whose every sequence has one query row is the decode problem itself and goes
// to the decode path, so it returns the decode call's numbers exactly.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_backend.hpp"
#include "cpu_elements.hpp"
#include "pagedattn/errors.hpp"
#include "thread_pool.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(PAGEDATTN_NO_MULTIVERSION)
#define PAGEDATTN_PREFILL_X86 1
#include <immintrin.h>
#endif

namespace pagedattn::cpu {
namespace {

constexpr int kTileRows = 256;   // rows (tokens x group heads) per tile, at least one token
constexpr int kChunkKeys = 64;   // keys per chunk, rounded down to whole blocks (at least one)
constexpr int kMergeKeys = 256;  // keys summed in float32 before folding into float64
constexpr int kColPad = 32;      // key-chunk and head-size columns are padded to this
constexpr int kRowPad = 8;       // tile rows are padded to this
constexpr int kSumLanes = 16;    // floats per row for the softmax's partial sums (the widest vector)
// The most a call converts ahead for its groups of tiles at once (see SharedChunks); the
// process keeps a buffer of this size at most for later calls (SharedStore). The variable
// PAGEDATTN_CPU_SHARED_BYTES, read once, sets another size (0: no group is shared), for
// tests and comparisons.
constexpr std::size_t kSharedBytes = std::size_t{64} << 20;

std::size_t shared_bytes() {
  static const std::size_t bytes = [] {
    const char* env = std::getenv("PAGEDATTN_CPU_SHARED_BYTES");
    if (!env || !*env) return kSharedBytes;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    return *end == '\0' && v <= (std::size_t{1} << 40) ? static_cast<std::size_t>(v) : kSharedBytes;
  }();
  return bytes;
}

constexpr std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

// ---------------------------------------------------------------------------------------
// Inner loops, one copy per instruction set (see cpu_prefill_kernels.inc).
// ---------------------------------------------------------------------------------------
namespace generic {
constexpr int VW = 8, MR = 4;
#include "cpu_prefill_kernels.inc"
}  // namespace generic

#ifdef PAGEDATTN_PREFILL_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr int VW = 8, MR = 4;
#include "cpu_prefill_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
constexpr int VW = 16, MR = 8;
#include "cpu_prefill_kernels.inc"
}  // namespace avx512
#pragma GCC pop_options

// bfloat16 inputs on CPUs with AVX512-BF16: the products run as bf16 pair dot products
// (vdpbf16ps: 32 multiply-adds per instruction, twice the float32 rate), summed in
// float32. q.k is exact per product (the inputs are bfloat16 already); the softmax
// weights are rounded to bfloat16 for P . V, as GPU flash-attention kernels do.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
namespace bf16dot {
constexpr int MR = 8, NV = 2;  // 8 x 2 x 16 float32 accumulators
static_assert(kColPad % (NV * 16) == 0 && kRowPad % MR == 0, "padding must fit the register blocks");

// C[M, N] = alpha * A . B, or C += A . B when accumulating. A is [M, Kp] and B [Kp, N]
// in 32-bit words, each word a pair of bfloat16 along the product's inner dimension
// (A: [M, 2 Kp] bf16 row-major; B: [Kp, N, 2] bf16). M a multiple of MR, N of 32.
void gemm(const std::uint32_t* A, std::int64_t lda, const std::uint32_t* B, std::int64_t ldb, float* C,
          std::int64_t ldc, int M, int N, int Kp, bool accumulate, float alpha) {
  for (int m0 = 0; m0 < M; m0 += MR) {
    for (int n0 = 0; n0 < N; n0 += NV * 16) {
      __m512 c[MR][NV];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j)
          c[i][j] = accumulate ? _mm512_loadu_ps(C + (m0 + i) * ldc + n0 + j * 16) : _mm512_setzero_ps();
      const std::uint32_t* a = A + m0 * lda;
      const std::uint32_t* b = B + n0;
      for (int k = 0; k < Kp; ++k, b += ldb) {
        __m512bh bv[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) bv[j] = (__m512bh)_mm512_loadu_si512(b + j * 16);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + k]));
#pragma GCC unroll 4
          for (int j = 0; j < NV; ++j) c[i][j] = _mm512_dpbf16_ps(c[i][j], av, bv[j]);
        }
      }
      const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j)
          _mm512_storeu_ps(C + (m0 + i) * ldc + n0 + j * 16,
                           accumulate ? c[i][j] : _mm512_mul_ps(c[i][j], al));
    }
  }
}

// Word i of dst = the pair (bfloat16(src[2i]), bfloat16(src[2i + 1])), rounded to
// nearest even; n (floats) a multiple of 32.
void to_bf16(const float* src, std::uint32_t* dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i / 2, (__m512i)v);
  }
}
}  // namespace bf16dot
#pragma GCC pop_options
#endif

struct Kernels {
  void (*gemm)(const float*, std::int64_t, const float*, std::int64_t, float*, std::int64_t, int, int, int,
               bool);
  void (*softmax_chunk)(float*, std::int64_t, int, int, float*, float*, float*);
  void (*rescale_rows)(float*, std::int64_t, int, int, const float*);
  void (*fold_rows)(double*, float*, std::int64_t, int, int, const float*, float*, double*, float*);
  // bfloat16 pair products; null where the CPU has no AVX512-BF16
  void (*gemm_bf16)(const std::uint32_t*, std::int64_t, const std::uint32_t*, std::int64_t, float*,
                    std::int64_t, int, int, int, bool, float) = nullptr;
  void (*to_bf16)(const float*, std::uint32_t*, std::int64_t) = nullptr;
};

// The best variant this CPU runs. PAGEDATTN_CPU_ISA (avx512bf16, avx512, avx2, generic)
// caps the choice at that level, for tests and comparisons; another value is ignored.
Kernels pick_kernels() {
  const char* levels[] = {"avx512bf16", "avx512", "avx2", "generic"};
  const char* env = std::getenv("PAGEDATTN_CPU_ISA");
  int cap = 0;  // index into levels: the best level allowed
  for (int i = 0; env && i < 4; ++i)
    if (std::strcmp(env, levels[i]) == 0) cap = i;
  const auto allowed = [&](int level) { return level >= cap; };
#ifdef PAGEDATTN_PREFILL_X86
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  if (allowed(0) && avx512 && __builtin_cpu_supports("avx512bf16"))
    return {avx512::gemm,      avx512::softmax_chunk, avx512::rescale_rows,
            avx512::fold_rows, bf16dot::gemm,         bf16dot::to_bf16};
  if (allowed(1) && avx512)
    return {avx512::gemm, avx512::softmax_chunk, avx512::rescale_rows, avx512::fold_rows};
  if (allowed(2) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {avx2::gemm, avx2::softmax_chunk, avx2::rescale_rows, avx2::fold_rows};
#endif
  (void)allowed;
  return {generic::gemm, generic::softmax_chunk, generic::rescale_rows, generic::fold_rows};
}

const Kernels& kernels() {
  static const Kernels k = pick_kernels();
  return k;
}

// ---------------------------------------------------------------------------------------
// The work list.
// ---------------------------------------------------------------------------------------
struct Tile {
  int seq;
  int kv_head;
  int j0, j1;          // the tile's query rows of the sequence: [j0, j1) of its q rows
  std::int64_t row0;   // query_start_loc[seq]
  int q_len, seq_len;  // as read once for the whole call
  std::int64_t cost;   // the sequence's seq_len x q_len: costly sequences go first
};

// Reads query_start_loc and seq_lens once and checks them again (validation passed, but
// the caller's memory may change while the call runs: a change must give an error, never
// an access out of bounds), then cuts every sequence into tiles. Tiles of one sequence
// and KV head stay together (they read the same keys and values, which then stay in
// cache); the most costly sequences go first so the pool's threads finish together.
std::vector<Tile> make_tiles(const DecodeParams& p, int tokens_per_tile) {
  const std::int64_t max_len = static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size;
  std::vector<Tile> tiles;
  std::int32_t start = p.query_start_loc[0];
  if (start != 0)
    fail<OutOfRange>("query_start_loc[0] = ", start, " is not 0 (it changed while the call ran)");
  for (int s = 0; s < p.num_seqs; ++s) {
    const std::int32_t next = p.query_start_loc[s + 1];
    const std::int32_t len = p.seq_lens[s];
    if (len < 0 || len > max_len)
      fail<OutOfRange>("seq_lens[", s, "] = ", len, " is outside [0, ", max_len,
                       "] (it changed while the call ran)");
    if (next < start || next > p.num_tokens || next - start > len)
      fail<OutOfRange>("query_start_loc[", s + 1, "] = ", next, " does not give sequence ", s,
                       " between 0 and seq_lens = ", len, " rows within num_tokens = ", p.num_tokens,
                       " (it changed while the call ran)");
    const int q = next - start;
    // The keys the rows read: all of them, or (a window) at most the window plus the rows.
    const std::int64_t keys = len - window_start(p.sliding_window, len - q);
    // Later rows see more keys: a group's tiles run last row first.
    for (int kh = 0; kh < p.num_kv_heads; ++kh) {
      for (int j1 = q; j1 > 0; j1 -= tokens_per_tile) {
        const int j0 = std::max(0, j1 - tokens_per_tile);
        tiles.push_back({s, kh, j0, j1, start, q, len, keys * q});
      }
    }
    start = next;
  }
  if (start != p.num_tokens)
    fail<OutOfRange>("query_start_loc[", p.num_seqs, "] = ", start, " is not num_tokens = ", p.num_tokens,
                     " (it changed while the call ran)");
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}

// ---------------------------------------------------------------------------------------
// One tile.
// ---------------------------------------------------------------------------------------
struct Scratch {
  std::vector<float> q;     // [Mp, D], pre-scaled; padding rows 0
  std::vector<float> kt;    // [D, NC]: the chunk's keys, transposed
  std::vector<float> v;     // [NC, Dp]: the chunk's values
  std::vector<float> s;     // [Mp, NC]: logits, then probabilities
  std::vector<float> o32;   // [Mp, Dp]: float32 sum of at most kMergeKeys keys
  std::vector<double> o64;  // [Mp, Dp]: float64 total, relative to fold_max
  std::vector<float> row_max, corr;
  std::vector<float> fold_max;  // [Mp]: the row max o64 was last scaled to
  std::vector<double> row_sum;  // [Mp]: the softmax denominators, relative to fold_max
  std::vector<float> sums;      // [Mp, kSumLanes]: their float32 parts since the last fold
  std::vector<float> raw;       // one block of one head as float32, in cache order
  // The bfloat16 pair-product path: 32-bit words, each two bfloat16 along the product's
  // inner dimension.
  std::vector<std::uint32_t> qw;     // [Mp, D/2]: query pairs along D (unscaled)
  std::vector<std::uint32_t> ktw;    // [D/2, NC]: key pairs along D, per key
  std::vector<std::uint32_t> vw;     // [NC/2, Dp]: value pairs along the keys, per dim
  std::vector<std::uint32_t> pw;     // [Mp, NC/2]: softmax weights, pairs along the keys
  std::vector<std::uint16_t> raw16;  // one block of one head (or one row), as stored
  std::vector<std::int32_t> blocks;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// One (sequence, KV head)'s keys and values, converted once for all of its tiles (a
// tile of its own re-reads its whole context, and the context is read by every tile of
// the group). Chunk i holds keys [first_key + i * chunk keys, ...) in the layout a tile
// otherwise builds for itself in its scratch: kt [D, NC] then v [NC, Dp] floats, or, for
// bfloat16 pair products, ktw [D/2, NC] then vw [NC/2, Dp] words.
struct SharedChunks {
  int first_key = 0;  // the group's first key read: its earliest row's window start, in whole blocks
  int keys = 0;       // keys converted: [first_key, keys)
  float* f = nullptr;
  std::uint32_t* w = nullptr;
};

// The buffers of the conversions: the process keeps one pair for later calls (at most
// shared_bytes() is ever asked of them), taken without waiting; a call that finds them in
// use by another thread's call takes buffers of its own for the call. No lock is held, so a
// child forked while a call ran only ever takes buffers of its own.
class SharedStore {
 public:
  SharedStore() : kept_(!busy().exchange(true, std::memory_order_acquire)) {}
  ~SharedStore() {
    if (kept_) busy().store(false, std::memory_order_release);
  }
  SharedStore(const SharedStore&) = delete;
  SharedStore& operator=(const SharedStore&) = delete;
  std::vector<float>& f() { return kept_ ? kept().f : own_.f; }
  std::vector<std::uint32_t>& w() { return kept_ ? kept().w : own_.w; }

 private:
  struct Buffers {
    std::vector<float> f;
    std::vector<std::uint32_t> w;
  };
  static std::atomic<bool>& busy() {
    static std::atomic<bool> b{false};
    return b;
  }
  static Buffers& kept() {
    static Buffers b;
    return b;
  }
  const bool kept_;
  Buffers own_;
};

class TileTask {
 public:
  TileTask(const DecodeParams& p, const Tile& t, const Kernels& k, const SharedChunks* sh = nullptr)
      : p_(p),
        t_(t),
        k_(k),
        G_(p.num_heads / p.num_kv_heads),
        D_(p.head_size),
        Dp_(static_cast<int>(round_up(p.head_size, kColPad))),
        B_(p.block_size),
        R_(t.j1 - t.j0),
        M_(R_ * G_),
        Mp_(static_cast<int>(round_up(M_, kRowPad))),
        chunk_blocks_(std::max(1, kChunkKeys / p.block_size)),
        NC_(static_cast<int>(round_up(static_cast<std::int64_t>(chunk_blocks_) * p.block_size, kColPad))),
        pos0_(t.seq_len - t.q_len + t.j0),
        keys_(pos0_ + R_),
        ws_(static_cast<int>(window_start(p.sliding_window, pos0_))),
        ce_(static_cast<std::int64_t>(cache_elem_size(p.dtype, p.kv_cache_dtype))),
        x_(static_cast<int>(supported::kCacheChunkBytes / ce_)),
        bf_(k.gemm_bf16 && p.dtype == DType::kBFloat16 && p.kv_cache_dtype == KVCacheDType::kAuto &&
            p.head_size % 2 == 0),
        rs_(row_strides(p.layout, p.block_size, p.num_kv_heads, p.head_size)),
        sh_(sh),
        s_(scratch()) {}

  int chunk_keys() const { return chunk_blocks_ * B_; }
  // The 4-byte words of one chunk's keys and values in the product layouts.
  std::size_t key_words() const { return static_cast<std::size_t>(bf_ ? D_ / 2 : D_) * NC_; }
  std::size_t value_words() const { return static_cast<std::size_t>(bf_ ? NC_ / 2 : NC_) * Dp_; }
  std::size_t chunk_words() const { return key_words() + value_words(); }
  bool pair_products() const { return bf_; }
  // The first key this tile's rows read, in whole blocks (its earliest row's window start).
  int first_key() const { return ws_ / B_ * B_; }

  // Converts chunk i of sh (keys from sh.first_key up to sh.keys) for the whole group.
  // Built on the group's tile of earliest rows, whose window start is the group's, so the
  // keys before it are cleared as a tile of its own would clear them.
  void convert(const SharedChunks& sh, int i) {
    const int k0 = sh.first_key + i * chunk_keys();
    const int n = std::min(chunk_keys(), sh.keys - k0);
    read_block_ids(k0 / B_, (k0 + n - 1) / B_ + 1);
    const std::size_t at = static_cast<std::size_t>(i) * chunk_words();
    if (bf_) {
      std::uint32_t* kt = sh.w + at;
      std::fill(kt, kt + chunk_words(), 0u);
      load_chunk_bf16(k0, n, kt, kt + key_words());
      if (k0 < ws_) clear_keys_bf16(ws_ - k0, kt, kt + key_words());
    } else {
      float* kt = sh.f + at;
      std::fill(kt, kt + chunk_words(), 0.0f);
      load_chunk(k0, n, kt, kt + key_words());
      if (k0 < ws_) clear_keys(ws_ - k0, kt, kt + key_words());
    }
  }

  void run() {
    const int chunk_keys = this->chunk_keys();
    int first_key = this->first_key();  // chunks start at the window's first block
    if (sh_)                            // or on the group's grid of shared chunks
      first_key = sh_->first_key + (first_key - sh_->first_key) / chunk_keys * chunk_keys;
    else
      read_block_ids(first_key / B_, keys_ / B_ + (keys_ % B_ != 0));
    const auto mp = static_cast<std::size_t>(Mp_);
    // The chunk buffers start cleared (a tile reading its own chunks relies on their
    // padding being 0); with shared chunks only a copy of the values may be made here.
    if (bf_) {
      load_query_bf16();
      if (sh_) {
        s_.vw.resize(value_words());
      } else {
        s_.ktw.assign(key_words(), 0u);
        s_.vw.assign(value_words(), 0u);
      }
      s_.pw.resize(mp * (NC_ / 2));
    } else {
      load_query();
      if (sh_) {
        s_.v.resize(value_words());
      } else {
        s_.kt.assign(key_words(), 0.0f);
        s_.v.assign(value_words(), 0.0f);
      }
    }
    s_.s.resize(mp * NC_);
    s_.o32.resize(mp * Dp_);  // written by the first product after each fold
    s_.o64.assign(mp * Dp_, 0.0);
    s_.row_max.assign(mp, -INFINITY);
    s_.fold_max.assign(mp, -INFINITY);
    s_.row_sum.assign(mp, 0.0);
    s_.sums.assign(mp * kSumLanes, 0.0f);
    s_.corr.resize(mp);
    const int per_fold = std::max(1, kMergeKeys / chunk_keys);
    int since_fold = 0;
    for (int k0 = first_key; k0 < keys_; k0 += chunk_keys) {
      const int n = std::min(chunk_keys, keys_ - k0);
      const std::size_t words =
          sh_ ? static_cast<std::size_t>((k0 - sh_->first_key) / chunk_keys) * chunk_words() : 0;
      if (!sh_) {
        // The next chunk's keys and values start coming in while this one is computed:
        // the rows of a block table are scattered, so the hardware prefetchers miss them.
        if (k0 + chunk_keys < keys_)
          prefetch_chunk(k0 + chunk_keys, std::min(chunk_keys, keys_ - k0 - chunk_keys));
      }
      // With shared chunks, the keys outside this tile's reach (before its window, after
      // its last row) belong to the group's other rows: their logits are masked below,
      // and the values are cleared in a copy of the chunk, so that not even a NaN among
      // them reaches this tile's sums.
      const int lo = std::max(0, ws_ - k0);
      const bool own_values = sh_ && (lo > 0 || n < std::min(chunk_keys, sh_->keys - k0));
      const void* values;
      if (bf_) {
        const std::uint32_t* kt = s_.ktw.data();
        values = s_.vw.data();
        if (sh_) {
          kt = sh_->w + words;
          values = own_values ? clear_values_bf16(sh_->w + words + key_words(), lo, n) : kt + key_words();
        } else {
          load_chunk_bf16(k0, n, s_.ktw.data(), s_.vw.data());
          if (k0 < ws_) clear_keys_bf16(ws_ - k0, s_.ktw.data(), s_.vw.data());
        }
        k_.gemm_bf16(s_.qw.data(), D_ / 2, kt, NC_, s_.s.data(), NC_, Mp_, NC_, D_ / 2, false, p_.scale);
      } else {
        const float* kt = s_.kt.data();
        values = s_.v.data();
        if (sh_) {
          kt = sh_->f + words;
          values = own_values ? clear_values(sh_->f + words + key_words(), lo, n) : kt + key_words();
        } else {
          load_chunk(k0, n, s_.kt.data(), s_.v.data());
          if (k0 < ws_) clear_keys(ws_ - k0, s_.kt.data(), s_.v.data());
        }
        k_.gemm(s_.q.data(), D_, kt, NC_, s_.s.data(), NC_, Mp_, NC_, D_, false);
      }
      bias_and_mask(k0, n);
      k_.softmax_chunk(s_.s.data(), NC_, Mp_, NC_, s_.row_max.data(), s_.sums.data(), s_.corr.data());
      // The float32 sums hold nothing since the last fold (or the start): the product
      // overwrites them, and there is nothing to rescale.
      const bool fresh = since_fold == 0;
      if (!fresh) rescale();
      if (bf_) {
        k_.to_bf16(s_.s.data(), s_.pw.data(), static_cast<std::int64_t>(Mp_) * NC_);
        k_.gemm_bf16(s_.pw.data(), NC_ / 2, static_cast<const std::uint32_t*>(values), Dp_, s_.o32.data(),
                     Dp_, Mp_, Dp_, NC_ / 2, !fresh, 1.0f);
      } else {
        k_.gemm(s_.s.data(), NC_, static_cast<const float*>(values), Dp_, s_.o32.data(), Dp_, Mp_, Dp_, NC_,
                !fresh);
      }
      if (++since_fold == per_fold) {
        fold();
        since_fold = 0;
      }
    }
    if (since_fold > 0) fold();
    write_out();
  }

 private:
  std::size_t row(int m) const { return static_cast<std::size_t>(m); }
  // Position of tile row m (token-major: m = r * G + g); padding rows take the last one.
  int pos(int m) const { return pos0_ + std::min(m / G_, R_ - 1); }

  // Blocks [first, last) of the sequence's table (entries before a window's first block
  // are not read).
  void read_block_ids(int first, int last) {
    const std::int32_t* row = p_.block_tables + static_cast<std::int64_t>(t_.seq) * p_.max_blocks_per_seq;
    s_.blocks.resize(static_cast<std::size_t>(last));
    for (int b = first; b < last; ++b) {
      const std::int32_t id = row[b];
      if (id < 0 || id >= p_.num_blocks)
        fail<OutOfRange>("block_tables[", t_.seq, ", ", b, "] = ", id,
                         " is outside [0, num_blocks = ", p_.num_blocks, ") (it changed while the call ran)");
      s_.blocks[static_cast<std::size_t>(b)] = id;
    }
  }

  void load_query() {
    const auto elem = static_cast<std::int64_t>(dtype_size(p_.dtype));
    s_.q.assign(static_cast<std::size_t>(Mp_) * D_, 0.0f);
    for (int r = 0; r < R_; ++r) {
      const std::int64_t tok = t_.row0 + t_.j0 + r;
      for (int g = 0; g < G_; ++g) {
        const std::int64_t h = static_cast<std::int64_t>(t_.kv_head) * G_ + g;
        float* q = s_.q.data() + row(r * G_ + g) * D_;
        load_row(static_cast<const char*>(p_.query) + (tok * p_.q_stride_seq + h * p_.q_stride_head) * elem,
                 p_.dtype, KVCacheDType::kAuto, 1.0f, D_, q);
        for (int d = 0; d < D_; ++d) q[d] *= p_.scale;
      }
    }
  }

  void prefetch_chunk(int k0, int n) const {
    const std::int64_t head_bytes = static_cast<std::int64_t>(D_) * B_ * ce_;
    const std::int64_t row_bytes = static_cast<std::int64_t>(D_) * ce_;
    for (int c0 = 0; c0 < n; c0 += B_) {
      const std::int64_t blk = s_.blocks[static_cast<std::size_t>((k0 + c0) / B_)];
      const char* kc = key_block(blk);
      const char* vc = value_block(blk);
      if (p_.layout != CacheLayout::kNHD) {  // the head's part of the block is contiguous
        const std::int64_t off = t_.kv_head * head_bytes;
        for (std::int64_t b = 0; b < head_bytes; b += 64) {
          __builtin_prefetch(kc + off + b);
          __builtin_prefetch(vc + off + b);
        }
      } else {
        const int nt = std::min(B_, n - c0);
        for (int t = 0; t < nt; ++t) {
          const std::int64_t off = row_in_block(t);
          for (std::int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(kc + off + b);
            __builtin_prefetch(vc + off + b);
          }
        }
      }
    }
  }

  static std::uint32_t pair(std::uint16_t lo, std::uint16_t hi) {
    return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
  }
  // Sets the bfloat16 of key n (its half of the pair word) in a value word.
  static void set_half(std::uint32_t& w, int n, std::uint16_t x) {
    w = (n & 1) ? (w & 0xFFFFu) | (static_cast<std::uint32_t>(x) << 16) : (w & 0xFFFF0000u) | x;
  }

  void load_query_bf16() {
    const int Dh = D_ / 2;
    s_.qw.assign(static_cast<std::size_t>(Mp_) * Dh, 0u);
    s_.raw16.resize(static_cast<std::size_t>(D_));
    std::uint16_t* tmp = s_.raw16.data();
    for (int r = 0; r < R_; ++r) {
      const std::int64_t tok = t_.row0 + t_.j0 + r;
      for (int g = 0; g < G_; ++g) {
        const std::int64_t h = static_cast<std::int64_t>(t_.kv_head) * G_ + g;
        std::memcpy(tmp,
                    static_cast<const char*>(p_.query) + (tok * p_.q_stride_seq + h * p_.q_stride_head) * 2,
                    sizeof(std::uint16_t) * static_cast<std::size_t>(D_));
        std::uint32_t* q = s_.qw.data() + row(r * G_ + g) * Dh;
        for (int i = 0; i < Dh; ++i) q[i] = pair(tmp[2 * i], tmp[2 * i + 1]);
      }
    }
  }

  // As load_chunk, for the bfloat16 pair-product path: keys into kt [D/2, NC] (pairs
  // along D), values into v [NC/2, Dp] (pairs along the keys); bytes copied, not converted.
  void load_chunk_bf16(int k0, int n, std::uint32_t* kt, std::uint32_t* v) {
    if (n < NC_) {  // the last chunk: clear what an earlier, fuller chunk left
      std::fill(kt, kt + key_words(), 0u);
      std::fill(v, v + value_words(), 0u);
    }
    const std::int64_t head_elems = static_cast<std::int64_t>(D_) * B_;
    s_.raw16.resize(static_cast<std::size_t>(std::max<std::int64_t>(head_elems, 2 * D_)));
    std::uint16_t* raw = s_.raw16.data();
    const std::size_t row_bytes = sizeof(std::uint16_t) * static_cast<std::size_t>(D_);
    for (int c0 = 0; c0 < n; c0 += B_) {
      const std::int64_t blk = s_.blocks[static_cast<std::size_t>((k0 + c0) / B_)];
      const char* kc = key_block(blk);
      const char* vc = value_block(blk);
      const int nt = std::min(B_, n - c0);
      if (p_.layout == CacheLayout::kVLLM) {
        const std::int64_t head = t_.kv_head;
        std::memcpy(raw, kc + head * head_elems * 2,
                    static_cast<std::size_t>(head_elems) * 2);  // [D/x][B][x]
        for (int c = 0; c < D_ / x_; ++c)
          for (int t = 0; t < nt; ++t) {
            const std::uint16_t* e = raw + (static_cast<std::size_t>(c) * B_ + t) * x_;
            for (int w = 0; w < x_ / 2; ++w)
              kt[static_cast<std::size_t>(c * x_ / 2 + w) * NC_ + c0 + t] = pair(e[2 * w], e[2 * w + 1]);
          }
        std::memcpy(raw, vc + head * head_elems * 2, static_cast<std::size_t>(head_elems) * 2);  // [D][B]
        for (int t = 0; t < nt; ++t) {
          const int key = c0 + t;
          std::uint32_t* vr = v + static_cast<std::size_t>(key / 2) * Dp_;
          for (int d = 0; d < D_; ++d) set_half(vr[d], key, raw[static_cast<std::size_t>(d) * B_ + t]);
        }
      } else {  // nhd / hnd rows: keys here, values below in pairs of tokens
        for (int t = 0; t < nt; ++t) {
          const int key = c0 + t;
          std::memcpy(raw, kc + row_in_block(t), row_bytes);
          for (int i = 0; i < D_ / 2; ++i)
            kt[static_cast<std::size_t>(i) * NC_ + key] = pair(raw[2 * i], raw[2 * i + 1]);
        }
      }
    }
    if (p_.layout != CacheLayout::kVLLM) {
      std::uint16_t* r0 = raw;
      std::uint16_t* r1 = raw + D_;
      for (int key = 0; key < n; key += 2) {
        std::memcpy(r0, value_row(k0 + key), row_bytes);
        if (key + 1 < n)
          std::memcpy(r1, value_row(k0 + key + 1), row_bytes);
        else
          std::memset(r1, 0, row_bytes);
        std::uint32_t* vr = v + static_cast<std::size_t>(key / 2) * Dp_;
        for (int d = 0; d < D_; ++d) vr[d] = pair(r0[d], r1[d]);
      }
    }
  }

  // The value row of key `key` (of this sequence) in a token-major (nhd, hnd) cache.
  const char* value_row(int key) const {
    return value_block(s_.blocks[static_cast<std::size_t>(key / B_)]) + row_in_block(key % B_);
  }

  // Where block `blk` of each cache starts (blocks are k/v_block_stride elements apart),
  // and the byte offset of token t's row of this KV head inside a token-major block.
  const char* key_block(std::int64_t blk) const {
    return static_cast<const char*>(p_.key_cache) + blk * p_.k_block_stride * ce_;
  }
  const char* value_block(std::int64_t blk) const {
    return static_cast<const char*>(p_.value_cache) + blk * p_.v_block_stride * ce_;
  }
  std::int64_t row_in_block(int t) const { return (t * rs_.token + t_.kv_head * rs_.head) * ce_; }

  // Keys [k0, k0 + n) (whole blocks but maybe the last) into kt [D, NC] and v [NC, Dp];
  // columns / rows n .. NC stay 0 so padding never meets the cache's unwritten slots.
  void load_chunk(int k0, int n, float* kt, float* v) {
    const std::int64_t head_elems = static_cast<std::int64_t>(D_) * B_;
    s_.raw.resize(static_cast<std::size_t>(std::max<std::int64_t>(head_elems, D_)));
    float* raw = s_.raw.data();
    for (int c0 = 0; c0 < n; c0 += B_) {
      const std::int64_t blk = s_.blocks[static_cast<std::size_t>((k0 + c0) / B_)];
      const char* kc = key_block(blk);
      const char* vc = value_block(blk);
      const int nt = std::min(B_, n - c0);
      if (p_.layout == CacheLayout::kVLLM) {
        const std::int64_t head = t_.kv_head;
        // keys [D/x][B][x]: converted whole (slots past nt are converted, never used)
        load_row(kc + head * head_elems * ce_, p_.dtype, p_.kv_cache_dtype, p_.k_scale,
                 static_cast<int>(head_elems), raw);
        for (int c = 0; c < D_ / x_; ++c)
          for (int t = 0; t < nt; ++t)
            for (int i = 0; i < x_; ++i)
              kt[static_cast<std::size_t>(c * x_ + i) * NC_ + c0 + t] =
                  raw[(static_cast<std::size_t>(c) * B_ + t) * x_ + i];
        // values [D][B]
        load_row(vc + head * head_elems * ce_, p_.dtype, p_.kv_cache_dtype, p_.v_scale,
                 static_cast<int>(head_elems), raw);
        for (int t = 0; t < nt; ++t) {
          float* vr = v + static_cast<std::size_t>(c0 + t) * Dp_;
          for (int d = 0; d < D_; ++d) vr[d] = raw[static_cast<std::size_t>(d) * B_ + t];
        }
      } else {  // nhd / hnd: one row per token
        for (int t = 0; t < nt; ++t) {
          const std::int64_t off = row_in_block(t);
          load_row(kc + off, p_.dtype, p_.kv_cache_dtype, p_.k_scale, D_, raw);
          for (int d = 0; d < D_; ++d) kt[static_cast<std::size_t>(d) * NC_ + c0 + t] = raw[d];
          load_row(vc + off, p_.dtype, p_.kv_cache_dtype, p_.v_scale, D_,
                   v + static_cast<std::size_t>(c0 + t) * Dp_);
        }
      }
    }
    if (n < NC_) {  // the last chunk: clear what an earlier, fuller chunk left
      for (int d = 0; d < D_; ++d)
        std::fill(kt + static_cast<std::size_t>(d) * NC_ + n, kt + (d + 1) * NC_, 0.0f);
      std::fill(v + static_cast<std::size_t>(n) * Dp_, v + static_cast<std::size_t>(NC_) * Dp_, 0.0f);
    }
  }

  // The keys [0, n) of the chunk (n from the chunk's start) lie before the tile's window:
  // they are zeroed, so whatever their slots hold (released blocks, NaN) never meets a
  // product (their logits are masked too).
  void clear_keys(int n, float* kt, float* v) {
    n = std::min(n, NC_);
    for (int d = 0; d < D_; ++d) {
      float* col = kt + static_cast<std::size_t>(d) * NC_;
      std::fill(col, col + n, 0.0f);
    }
    std::fill(v, v + static_cast<std::size_t>(n) * Dp_, 0.0f);
  }
  void clear_keys_bf16(int n, std::uint32_t* kt, std::uint32_t* v) {
    n = std::min(n, NC_);
    for (int d = 0; d < D_ / 2; ++d) {
      std::uint32_t* col = kt + static_cast<std::size_t>(d) * NC_;
      std::fill(col, col + n, 0u);
    }
    for (int key = 0; key < n; ++key) {
      std::uint32_t* vr = v + static_cast<std::size_t>(key / 2) * Dp_;
      for (int d = 0; d < D_; ++d) set_half(vr[d], key, 0);
    }
  }

  // A copy of a shared chunk's values in this thread's scratch with the keys outside
  // [lo, hi) cleared (see run).
  const float* clear_values(const float* shared, int lo, int hi) {
    float* v = s_.v.data();
    std::copy(shared, shared + value_words(), v);
    std::fill(v, v + static_cast<std::size_t>(lo) * Dp_, 0.0f);
    std::fill(v + static_cast<std::size_t>(hi) * Dp_, v + value_words(), 0.0f);
    return v;
  }
  const std::uint32_t* clear_values_bf16(const std::uint32_t* shared, int lo, int hi) {
    std::uint32_t* v = s_.vw.data();
    std::copy(shared, shared + value_words(), v);
    for (int key = 0; key < NC_; ++key) {
      if (key >= lo && key < hi) continue;
      std::uint32_t* vr = v + static_cast<std::size_t>(key / 2) * Dp_;
      for (int d = 0; d < D_; ++d) set_half(vr[d], key, 0);
    }
    return v;
  }

  // Soft cap, ALiBi (slope[h] * (t - p)) and the mask: key k0 + c is visible to row m
  // when c < n (a real key of the chunk, not padding), k0 + c <= pos(m) (causal) and,
  // with a window W, k0 + c >= pos(m) - W + 1.
  void bias_and_mask(int k0, int n) {
    // Most chunks: every row sees every column (no padding, no key past the first row's
    // position, none before the last row's window) and there is no cap or bias to add.
    if (n == NC_ && k0 + n - 1 <= pos0_ && window_start(p_.sliding_window, pos(Mp_ - 1)) <= k0 &&
        !(p_.soft_cap > 0.0f) && !p_.alibi_slopes)
      return;
    for (int m = 0; m < Mp_; ++m) {
      float* s = s_.s.data() + row(m) * NC_;
      const int p = pos(m);
      const int visible = std::max(0, std::min(n, p - k0 + 1));
      const std::int64_t first = window_start(p_.sliding_window, p) - k0;  // the first column in the window
      const int hidden = static_cast<int>(std::clamp<std::int64_t>(first, 0, visible));
      if (p_.soft_cap > 0.0f) {
        const float cap = p_.soft_cap, inv = 1.0f / p_.soft_cap;
        for (int c = hidden; c < visible; ++c) s[c] = cap * std::tanh(s[c] * inv);
      }
      if (p_.alibi_slopes && m < M_) {
        const float slope = p_.alibi_slopes[t_.kv_head * G_ + m % G_];
        for (int c = hidden; c < visible; ++c) s[c] += slope * static_cast<float>(k0 + c - p);
      }
      std::fill(s, s + hidden, -INFINITY);
      std::fill(s + visible, s + NC_, -INFINITY);
    }
  }

  // Rows whose max rose: their float32 sum follows the new scale (the float64 total
  // catches up when it is folded). corr = 0: the first finite chunk of the row (or a jump
  // beyond float range): the sum restarts from 0.
  void rescale() { k_.rescale_rows(s_.o32.data(), Dp_, Mp_, D_, s_.corr.data()); }

  // total = total * exp(fold max - row max) + the float32 sum, which then counts as 0.
  void fold() {
    k_.fold_rows(s_.o64.data(), s_.o32.data(), Dp_, Mp_, D_, s_.row_max.data(), s_.fold_max.data(),
                 s_.row_sum.data(), s_.sums.data());
  }

  void write_out() {
    const auto elem = static_cast<std::int64_t>(dtype_size(p_.dtype));
    s_.raw.resize(std::max(s_.raw.size(), static_cast<std::size_t>(D_)));
    float* out_row = s_.raw.data();
    for (int m = 0; m < M_; ++m) {
      const double sink =
          p_.sinks ? sink_weight(p_.sinks[t_.kv_head * G_ + m % G_], s_.row_max[row(m)]) : 0.0;
      const double inv = 1.0 / (s_.row_sum[row(m)] + sink);
      const double* t = s_.o64.data() + row(m) * Dp_;
      for (int d = 0; d < D_; ++d) out_row[d] = static_cast<float>(t[d] * inv);
      const std::int64_t tok = t_.row0 + t_.j0 + m / G_;
      const std::int64_t h = static_cast<std::int64_t>(t_.kv_head) * G_ + m % G_;
      store_row(out_row, p_.dtype, KVCacheDType::kAuto, 1.0f, D_,
                static_cast<char*>(p_.out) + (tok * p_.o_stride_seq + h * p_.o_stride_head) * elem);
    }
  }

  const DecodeParams& p_;
  const Tile& t_;
  const Kernels& k_;
  const int G_, D_, Dp_, B_, R_, M_, Mp_, chunk_blocks_, NC_, pos0_, keys_;
  const int ws_;  // the first key any row of the tile sees (0 without a window)
  const std::int64_t ce_;
  const int x_;
  const bool bf_;           // bfloat16 pair products (see bf16dot)
  const RowStrides rs_;     // token-major (nhd, hnd) rows inside a block
  const SharedChunks* sh_;  // the group's converted chunks, or null: the tile reads its own
  Scratch& s_;
};

// Every sequence has exactly one query row (checked on the values read once): the call
// is the decode problem, rows = sequences.
bool all_single_rows(const DecodeParams& p) {
  if (p.num_tokens != p.num_seqs) return false;
  for (int s = 0; s <= p.num_seqs; ++s)
    if (p.query_start_loc[s] != s) return false;
  return true;
}

}  // namespace

void paged_attention_varlen(const DecodeParams& p) {
  if (all_single_rows(p)) {
    DecodeParams d = p;
    d.query_start_loc = nullptr;
    paged_attention(d);
    return;
  }
  const int G = p.num_heads / p.num_kv_heads;
  const std::vector<Tile> tiles = make_tiles(p, std::max(1, kTileRows / G));
  if (tiles.empty()) return;  // every sequence has 0 rows
  const Kernels& k = kernels();

  // Groups: the tiles of one (sequence, KV head), stored together, earliest rows last. A
  // group of several tiles has its context converted once (SharedChunks), in waves of
  // groups whose conversions fit shared_bytes(); a group larger than that on its own, or
  // of one tile, has each tile read its own chunks.
  const std::size_t budget = shared_bytes();
  struct Group {
    std::size_t begin, end;  // its tiles
    SharedChunks sh;
    std::size_t words = 0;  // converted size (0: not shared)
    int chunks = 0;
  };
  std::vector<Group> groups;
  for (std::size_t i = 0; i < tiles.size();) {
    std::size_t j = i + 1;
    while (j < tiles.size() && tiles[j].seq == tiles[i].seq && tiles[j].kv_head == tiles[i].kv_head) ++j;
    Group g{i, j, {}, 0, 0};
    if (j - i >= 2) {
      const TileTask first(p, tiles[j - 1], k);
      g.sh.first_key = first.first_key();
      g.sh.keys = tiles[i].seq_len;
      g.chunks = (g.sh.keys - g.sh.first_key + first.chunk_keys() - 1) / first.chunk_keys();
      const std::size_t words = static_cast<std::size_t>(g.chunks) * first.chunk_words();
      if (words * sizeof(float) <= budget) g.words = words;
    }
    groups.push_back(g);
    i = j;
  }
  const bool pairs = TileTask(p, tiles.front(), k).pair_products();
  SharedStore store;
  std::vector<float>& shared_f = store.f();
  std::vector<std::uint32_t>& shared_w = store.w();
  for (std::size_t g0 = 0; g0 < groups.size();) {
    std::size_t g1 = g0, words = 0;
    while (g1 < groups.size() && (words + groups[g1].words) * sizeof(float) <= budget)
      words += groups[g1++].words;
    if (pairs) {
      if (shared_w.size() < words) shared_w.resize(words);
    } else if (shared_f.size() < words) {
      shared_f.resize(words);
    }
    struct Job {
      std::size_t group;
      int chunk;
    };
    std::vector<Job> jobs;
    std::vector<const SharedChunks*> of_tile;  // per tile of the wave
    std::size_t at = 0;
    for (std::size_t g = g0; g < g1; ++g) {
      Group& gr = groups[g];
      if (gr.words) {
        gr.sh.f = pairs ? nullptr : shared_f.data() + at;
        gr.sh.w = pairs ? shared_w.data() + at : nullptr;
        at += gr.words;
        for (int c = 0; c < gr.chunks; ++c) jobs.push_back({g, c});
      }
      for (std::size_t t = gr.begin; t < gr.end; ++t) of_tile.push_back(gr.words ? &gr.sh : nullptr);
    }
    if (!jobs.empty())
      parallel_for(static_cast<std::int64_t>(jobs.size()), [&](std::int64_t i) {
        const Job& job = jobs[static_cast<std::size_t>(i)];
        const Group& gr = groups[job.group];
        TileTask(p, tiles[gr.end - 1], k).convert(gr.sh, job.chunk);
      });
    const std::size_t first_tile = groups[g0].begin;
    parallel_for(static_cast<std::int64_t>(of_tile.size()), [&](std::int64_t i) {
      const auto t = static_cast<std::size_t>(i);
      TileTask(p, tiles[first_tile + t], k, of_tile[t]).run();
    });
    g0 = g1;
  }
}

}  // namespace pagedattn::cpu
