// The attention and cache-write API of pagedattn.
//
// Every function validates all of its arguments in one pass (validate.cpp) before any
// work is dispatched to the CPU or CUDA backend, and throws the types in errors.hpp.
//
// Dimension legend of the shape comments:
//   S = num_seqs, H = num_heads, K = num_kv_heads, D = head_size, B = block_size,
//   N = num_blocks, M = max_blocks_per_seq, T = num_tokens, x = 16 / element size of the cache.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>

#include "pagedattn/supported.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn {

// Which CUDA decode kernel runs (the CPU backend has one form and ignores it).
enum class DecodeKernel : std::uint8_t {
  kAuto,         // the planner chooses
  kSinglePass,   // one CTA streams a whole sequence
  kPartitioned,  // the context is split into partitions, merged by a reduce kernel
};
const char* decode_kernel_name(DecodeKernel k) noexcept;
// Parses "auto" / "single_pass" / "partitioned"; throws InvalidArgument naming `arg` otherwise.
DecodeKernel parse_decode_kernel(const char* s, const char* arg = "kernel");

// Every option of an attention call, in one struct: the C++ entry points, the prepared
// call, the workspace / plan queries and the Python bindings all take this object.
// An option added here is bound in python/src/call_options.cpp, checked in validate.cpp
// and read by the kernels; nothing else changes.
struct AttentionOptions {
  std::optional<float> scale;               // softmax scale; default 1 / sqrt(head_size)
  std::optional<TensorView> alibi_slopes;   // float32 [H]: adds slope[h] * (t - seq_len + 1)
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  float k_scale = 1.0f;                     // fp8 caches: real key = stored * k_scale
  float v_scale = 1.0f;
  DecodeKernel kernel = DecodeKernel::kAuto;  // CUDA only
  int partition_size = 0;                   // tokens per partition (CUDA, partitioned); 0 = planner
  std::optional<TensorView> workspace;      // CUDA scratch (any dtype, on the device), or none
  bool check_block_tables = false;          // CUDA: raise on out-of-range block ids (synchronises)
  void* stream = nullptr;                   // cudaStream_t; null = the default stream
  // Varlen queries (chunked prefill, mixed prefill + decode batches): int32 [S + 1]; see
  // paged_attention. Absent: one query token per sequence (decode).
  std::optional<TensorView> query_start_loc;
  // Host-side upper bound on every query_start_loc[i + 1] - query_start_loc[i]. The CUDA
  // path never reads device memory to size its grid: it launches max_query_len rows per
  // sequence; without it, the tensor-core kernel a flat grid of ceil(T * G / 128) + S tiles
  // and the CUDA-core kernel (float32, other head sizes) and checked calls T rows per
  // sequence (correct, more idle CTAs). max_query_len = 1 with T = S runs the decode kernels. A sequence with
  // more rows is an error (raised on the host and by checked calls; NaN rows otherwise).
  std::optional<int> max_query_len;
  // Attention variants; each costs nothing when off.
  // Sliding window of W tokens (0 = off): the query at position p attends to key
  // positions max(0, p - W + 1) .. p only; blocks wholly outside every query's window
  // are never read (their block-table entries may be anything, e.g. released: -1).
  int sliding_window = 0;
  // Logit soft-capping (0 = off): logit = soft_cap * tanh(scale * q.k / soft_cap), then
  // ALiBi's bias is added. Finite and >= 0.
  float soft_cap = 0.0f;
  // Attention sinks: float32 [H], on the query's device. exp(sinks[h]) joins the softmax
  // denominator of head h (in the units of the logits; a sink carries no value):
  //   out = sum_t exp(l_t) v_t / (sum_t exp(l_t) + exp(sinks[h])).
  // -inf is no sink, +inf gives zeros, NaN gives NaN rows (the contents are not checked).
  // A row without a finite logit (non-finite inputs) is NaN with or without a sink.
  std::optional<TensorView> sinks;
  // The caches' layout. Absent: "vllm" for a rank-5 key_cache, "nhd" for a rank-4 one;
  // an "hnd" cache must be named (see paged_attention).
  std::optional<CacheLayout> layout;
};

// out[s, h, :] = softmax(scale * q[s, h] . K[s, kv(h)] + alibi) @ V[s, kv(h)]
//   out          [S, H, D] (written; may be strided in dims 0-1; not read_only)
//   query        [S, H, D] (may be strided in dims 0-1)
//   key_cache    vllm [N, K, D/x, B, x] | nhd [N, B, K, D] | hnd [N, K, B, D]
//   value_cache  vllm [N, K, D, B]      | nhd [N, B, K, D] | hnd [N, K, B, D]
//   block_tables int32 [S, M]
//   seq_lens     int32 [S]
// Query head h reads KV head h / (H / K). A sequence of length 0 yields zeros.
//
// Caches: each block (dims 1..) C-contiguous; the block stride (dim 0) may be anything
// >= one block's elements, so the key and value halves of a per-layer [N, 2, ...] or
// [2, N, ...] allocation are taken as they are (on CUDA the block stride must be a
// multiple of 16 bytes). Layout: options.layout, or from the rank when absent: rank 5 is
// "vllm", rank 4 is "nhd" (its meaning before "hnd" existed). An "hnd" cache must be
// passed with layout = kHND; a rank-4 cache without a layout whose "nhd" reading does not
// fit num_heads (dim 2 does not divide H) while its "hnd" reading does is refused.
//
// Varlen form (options.query_start_loc given): query and out are [T, H, D] and sequence
// i owns rows qsl[i] .. qsl[i + 1] (qsl[0] = 0, non-decreasing, qsl[S] = T). Those
// q_i = qsl[i + 1] - qsl[i] rows are the sequence's LAST q_i tokens: row j sits at
// position p = seq_lens[i] - q_i + j and attends to key positions 0 .. p (causal,
// aligned bottom-right), all read from the paged cache (write the new tokens' keys and
// values with reshape_and_cache first). q_i may be 0; q_i > seq_lens[i] is an error.
// ALiBi adds slope[h] * (t - p). With every q_i = 1 the numbers equal the decode form's.
//
// Variants (AttentionOptions): sliding_window, soft_cap and sinks apply to both forms.
// With sliding_window = W the decode query sits at p = seq_len - 1; the blocks before the
// block of key position max(0, p_first - W + 1) (p_first: a sequence's first query row)
// are not read, so their block_tables entries are not checked either. A sequence of
// length 0 still yields zeros (the sink has nothing to weigh against).
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, const AttentionOptions& options = {});

// A paged_attention call validated once and run many times: the lowest host cost per
// step, and the form to capture in a CUDA graph. The constructor runs the whole
// validation pass; run() launches with no further shape, dtype or pointer checks. The
// arrays are not owned: they must outlive the object and keep their shapes; their
// contents may change between runs. On the host, run() checks the index contents
// (seq_lens, block_tables) again, since they may have changed.
class PreparedDecode {
 public:
  PreparedDecode(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                 const TensorView& value_cache, const TensorView& block_tables, const TensorView& seq_lens,
                 const AttentionOptions& options = {});
  ~PreparedDecode();
  PreparedDecode(PreparedDecode&&) noexcept;
  PreparedDecode& operator=(PreparedDecode&&) noexcept;
  PreparedDecode(const PreparedDecode&) = delete;
  PreparedDecode& operator=(const PreparedDecode&) = delete;

  void run() const;                 // on the stream given in the options
  void run(void* stream) const;     // on `stream` (a cudaStream_t; ignored on the host)
  DeviceKind device() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

struct CacheWriteOptions {
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  // As AttentionOptions::layout; without it a rank-4 cache whose dim 2 is not the new
  // keys' num_kv_heads while its dim 1 is is refused (an "hnd" cache must be named).
  std::optional<CacheLayout> layout;
  float k_scale = 1.0f;  // fp8 caches: stored = value / k_scale, saturated
  float v_scale = 1.0f;
  void* stream = nullptr;
};

// key_cache / value_cache[slot_mapping[t]] = key / value[t] for every t with slot >= 0.
//   key, value   [T, K, D] (may be strided in dims 0-1)
//   key_cache, value_cache  as in paged_attention (block-strided views accepted); key_cache
//                and value_cache may be views of one allocation as long as no block of
//                one overlaps a block of the other
//   slot_mapping int32 or int64 [T]; slot = block * B + offset; negative = skip
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const CacheWriteOptions& options = {});

using Shape = std::array<std::int64_t, TensorView::kMaxDims>;
struct CacheShapes {
  int key_ndim = 0;
  int value_ndim = 0;
  Shape key{};    // first key_ndim entries used
  Shape value{};  // first value_ndim entries used
};
// Shapes of the key and value caches for the given geometry, element size and layout.
CacheShapes kv_cache_shape(std::int64_t num_blocks, std::int64_t block_size, std::int64_t num_kv_heads,
                           std::int64_t head_size, std::size_t elem_size, CacheLayout layout);

// The sizes of a decode call, without its arrays: what the workspace and plan queries
// need to answer for a call before its arrays exist.
struct DecodeShape {
  int num_seqs = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  DType dtype = DType::kFloat16;  // query dtype
  CacheLayout layout = CacheLayout::kVLLM;
  int device_id = 0;              // the CUDA device
};

// Device scratch bytes paged_attention needs on CUDA for these sizes and options (0 when
// the single-pass kernel runs). Depends only on host-known sizes, never on seq_lens, so a
// workspace sized once fits every later call of the same sizes. Same checks and errors as
// paged_attention for everything the sizes and options determine.
std::size_t decode_workspace_size(const DecodeShape& shape, const AttentionOptions& options = {});

// How paged_attention will run on CUDA for these sizes and options (same inputs and
// errors as decode_workspace_size): for people tuning or studying the kernels.
struct DecodePlanInfo {
  int num_partitions = 1;      // CTAs along the context per (sequence, KV head, head tile)
  int partition_size = 0;      // tokens per partition
  bool reduce_kernel = false;  // partials written to scratch and merged by a second kernel
  int head_tiles = 1;          // CTAs per KV head along its query heads
  std::int64_t ctas = 0;       // CTAs of the decode grid
  int threads_per_cta = 0;     // threads of each (fp8 caches: the width is chosen per call)
  std::size_t workspace_bytes = 0;
  // The kernel family of a call with query_start_loc (chunked prefill, mixed batches) on
  // this device: "sm90_wgmma" (Hopper), "sm80_mma" (tensor cores, sm_80 and up) or
  // "cuda_core" (float32 queries, head sizes the tensor-core kernels do not take).
  const char* varlen_kernel = "";
};
DecodePlanInfo decode_plan(const DecodeShape& shape, const AttentionOptions& options = {});

// True when this build contains the CUDA backend.
bool built_with_cuda() noexcept;

// Threads the CPU backend uses (PAGEDATTN_NUM_THREADS overrides the hardware count).
int cpu_num_threads();

}  // namespace pagedattn
