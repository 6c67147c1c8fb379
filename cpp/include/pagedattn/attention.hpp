// The decode attention and cache-write API of pagedattn.
//
// Every function validates all of its arguments in one pass before any work is
// dispatched to the CPU or CUDA backend, and throws the types in errors.hpp.
// Dimension legend: see params.hpp.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#include "pagedattn/params.hpp"
#include "pagedattn/supported.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn {

struct DecodeOptions {
  std::optional<float> scale;              // default 1 / sqrt(head_size)
  const TensorView* alibi_slopes = nullptr;  // float32 [H], or null
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  int version = 0;         // 0 auto, 1 single pass, 2 partitioned (CUDA only; CPU ignores)
  int partition_size = 0;  // 0 = default (CUDA v2)
  const TensorView* workspace = nullptr;  // CUDA v2 scratch (uint8, on the device), or null
  bool check_block_tables = false;        // CUDA: raise on out-of-range block ids
  void* stream = nullptr;                 // cudaStream_t; null = default stream
};

// out[s, h, :] = softmax(scale * q[s, h] . K[s, kv(h)] + alibi) @ V[s, kv(h)]
//   out          [S, H, D] (written; may be strided in dims 0-1)
//   query        [S, H, D] (may be strided in dims 0-1)
//   key_cache    vllm [N, K, D/x, B, x] | nhd [N, B, K, D]
//   value_cache  vllm [N, K, D, B]      | nhd [N, B, K, D]
//   block_tables int32 [S, M]
//   seq_lens     int32 [S]
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, const DecodeOptions& options = {});

struct CacheWriteOptions {
  KVCacheDType kv_cache_dtype = KVCacheDType::kAuto;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  void* stream = nullptr;
};

// key_cache / value_cache[slot_mapping[t]] = key / value[t] for every t with slot >= 0.
//   key, value   [T, K, D] (may be strided in dims 0-1)
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

// The validation pass alone: checks the arguments of paged_attention and returns the
// parameters a backend would receive. Throws like paged_attention.
DecodeParams make_decode_params(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                                const TensorView& value_cache, const TensorView& block_tables,
                                const TensorView& seq_lens, const DecodeOptions& options = {});
// Checks the index contents of host arrays in p (every seq_len in range, every block id
// a sequence reaches inside the pool). make_decode_params does this already; a caller
// that reuses DecodeParams after changing block_tables / seq_lens in place calls it again.
void check_decode_indices(const DecodeParams& p);

// Runs a decode from parameters made by make_decode_params, without re-checking shapes,
// dtypes or pointers (the arrays must still be alive and unchanged in shape). Host
// parameters get check_decode_indices first, since index contents may have changed.
// This is the prepared-call path: validate once, launch many times.
void run_decode(const DecodeParams& p, DeviceKind device, void* stream = nullptr);

CacheWriteParams make_cache_write_params(const TensorView& key, const TensorView& value,
                                         const TensorView& key_cache, const TensorView& value_cache,
                                         const TensorView& slot_mapping, const CacheWriteOptions& options = {});

// True when this build contains the CUDA backend.
bool built_with_cuda() noexcept;

// Threads the CPU backend uses (PAGEDATTN_NUM_THREADS overrides the hardware count).
int cpu_num_threads();

}  // namespace pagedattn
