// What pagedattn supports: the one list that dispatch, validation, errors, docs and
// tests all read. Change a list here and everything else follows.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "pagedattn/tensor.hpp"

namespace pagedattn {

namespace supported {

// Floating dtypes of query, key, value and (with kv_cache_dtype "auto") the caches.
inline constexpr std::array<DType, 3> kDTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
inline constexpr std::array<KVCacheDType, 3> kKVCacheDTypes = {KVCacheDType::kAuto, KVCacheDType::kFp8E4M3,
                                                               KVCacheDType::kFp8E5M2};

// Cache layouts (see CacheLayout), in every op and on every backend.
inline constexpr std::array<CacheLayout, 3> kLayouts = {CacheLayout::kVLLM, CacheLayout::kNHD, CacheLayout::kHND};

// CPU: any head size and block size the layout allows, up to these bounds.
inline constexpr int kCpuMaxHeadSize = 1024;
inline constexpr int kCpuMaxBlockSize = 1024;

// The "vllm" key layout groups each token's key into chunks of this many bytes: its last
// dimension holds x = kCacheChunkBytes / element size elements (16-byte vector loads).
inline constexpr int kCacheChunkBytes = 16;

// CUDA: head sizes with a specialised kernel (ascending; the kernel dispatch is generated
// from this list); other multiples of kCudaHeadSizeAlign up to kCudaMaxHeadSize run
// through the generic path, whose kernels hold kCudaMaxHeadSize dims per head.
inline constexpr std::array<int, 7> kCudaHeadSizes = {64, 80, 96, 112, 128, 192, 256};
inline constexpr int kCudaHeadSizeAlign = 8;
inline constexpr int kCudaMaxHeadSize = 256;
// CUDA: block (page) sizes, every power of two from 1 to 256; others are refused with a
// clear error. The kernels take the size at run time (no instantiation per size): token
// t's block is block_tables[t / B], its slot t % B.
inline constexpr std::array<int, 9> kCudaBlockSizes = {1, 2, 4, 8, 16, 32, 64, 128, 256};

// Tokens per sequence, on every backend: a block table's max_blocks_per_seq x block_size
// may not exceed this (2^30), so every token position and every sum of a position and a
// partition or tile size the kernels form stays inside a 32-bit int.
inline constexpr std::int64_t kMaxContextTokens = std::int64_t{1} << 30;

// Attention variants: options of AttentionOptions (and keywords of the Python calls),
// on every backend, in the decode and varlen forms, alone or combined.
inline constexpr std::array<const char*, 3> kVariants = {"sliding_window", "soft_cap", "sinks"};

bool is_dtype(DType t) noexcept;
bool is_cuda_head_size(int head_size) noexcept;   // specialised or generic
bool is_cuda_block_size(int block_size) noexcept;
// "float32, float16, bfloat16" etc., for error messages and docs.
std::string dtypes_str();
std::string cuda_head_sizes_str();
std::string cuda_block_sizes_str();
std::string layouts_str();  // "\"vllm\", \"nhd\", \"hnd\""

}  // namespace supported
}  // namespace pagedattn
