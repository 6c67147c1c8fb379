// Cache-write and block-move kernels: reshape_and_cache (every layout, fp8 with scale),
// copy_blocks (every array, every pair, one launch) and swap_blocks (async copies).
// Each host launcher below is the only place that knows its kernel's grid.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda_backend.hpp"

namespace pagedattn::cuda_backend {
namespace {

// ---------------------------------------------------------------------------------
// reshape_and_cache
// ---------------------------------------------------------------------------------
struct CacheWriteKernelParams {
  const void* key;  // [T, K, D]
  std::int64_t k_stride_tok, k_stride_head;
  const void* value;  // [T, K, D]
  std::int64_t v_stride_tok, v_stride_head;
  void* key_cache;    // vllm [N, K, D/x, B, x] | nhd [N, B, K, D] | hnd [N, K, B, D]
  void* value_cache;  // vllm [N, K, D, B]      | nhd [N, B, K, D] | hnd [N, K, B, D]
  std::int64_t k_block_stride, v_block_stride;  // elements between blocks of each cache
  std::int64_t tok_stride, head_stride;         // nhd / hnd: a row's offset in its block
  const void* slot_mapping;  // [T] int32 / int64
  bool slot_int64;
  int num_kv_heads, head_size, block_size, x;
  std::int64_t num_blocks;
  float k_scale, v_scale;  // fp8: stored = fp8(real / scale)
};

// The stored form of element v: itself, or its fp8 byte of v / scale. The element goes in
// as it is (not through float), so that fp8 keeps the sign of a float16 NaN.
template <class T, class CT, KVCacheDType F>
__device__ __forceinline__ CT encode(T v, float scale) {
  if constexpr (F == KVCacheDType::kAuto) return v;
  else return encode_fp8<F>(v, scale);
}

// One CTA per token; threads walk (head, dim) of key and value.
template <class T, KVCacheDType F, CacheLayout L>
__global__ void reshape_and_cache_kernel(const __grid_constant__ CacheWriteKernelParams p) {
  using CT = std::conditional_t<F == KVCacheDType::kAuto, T, std::uint8_t>;
  const std::int64_t t = blockIdx.x;
  const std::int64_t slot = p.slot_int64 ? static_cast<const std::int64_t*>(p.slot_mapping)[t]
                                         : static_cast<const std::int32_t*>(p.slot_mapping)[t];
  // Negative slots are padding; slots past the cache cannot be checked on the host
  // without a sync and are skipped, so the kernel never writes outside the cache.
  if (slot < 0 || slot >= p.num_blocks * p.block_size) return;
  const std::int64_t blk = slot / p.block_size;
  const int off = static_cast<int>(slot % p.block_size);
  const int K = p.num_kv_heads, D = p.head_size;
  [[maybe_unused]] const int B = p.block_size;
  for (int i = threadIdx.x; i < K * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    const T kv = static_cast<const T*>(p.key)[t * p.k_stride_tok + h * p.k_stride_head + d];
    const T vv = static_cast<const T*>(p.value)[t * p.v_stride_tok + h * p.v_stride_head + d];
    std::int64_t ki, vi;
    if constexpr (L == CacheLayout::kVLLM) {
      ki = blk * p.k_block_stride + ((static_cast<std::int64_t>(h) * (D / p.x) + d / p.x) * B + off) * p.x + d % p.x;
      vi = blk * p.v_block_stride + (static_cast<std::int64_t>(h) * D + d) * B + off;
    } else {  // nhd / hnd
      const std::int64_t row = off * p.tok_stride + h * p.head_stride + d;
      ki = blk * p.k_block_stride + row;
      vi = blk * p.v_block_stride + row;
    }
    static_cast<CT*>(p.key_cache)[ki] = encode<T, CT, F>(kv, p.k_scale);
    static_cast<CT*>(p.value_cache)[vi] = encode<T, CT, F>(vv, p.v_scale);
  }
}

template <class T, KVCacheDType F>
const void* cache_kernel_for_layout(CacheLayout l) {
  if (l == CacheLayout::kVLLM) return reinterpret_cast<const void*>(&reshape_and_cache_kernel<T, F, CacheLayout::kVLLM>);
  // nhd and hnd: one kernel, rows at runtime strides
  return reinterpret_cast<const void*>(&reshape_and_cache_kernel<T, F, CacheLayout::kNHD>);
}

template <class T>
const void* pick_cache_kernel(KVCacheDType kv, CacheLayout l) {
  switch (kv) {
    case KVCacheDType::kAuto: return cache_kernel_for_layout<T, KVCacheDType::kAuto>(l);
    case KVCacheDType::kFp8E4M3: return cache_kernel_for_layout<T, KVCacheDType::kFp8E4M3>(l);
    case KVCacheDType::kFp8E5M2: return cache_kernel_for_layout<T, KVCacheDType::kFp8E5M2>(l);
  }
  fail<InvalidArgument>("kv_cache_dtype: unknown value ", static_cast<int>(kv));
}

// ---------------------------------------------------------------------------------
// copy_blocks
// ---------------------------------------------------------------------------------
// Kept under the classic 4 KB kernel-parameter limit; larger calls are split into a
// few launches (arrays in groups of kMaxCopyArrays, host pairs in groups of
// kMaxInlinePairs).
constexpr int kMaxCopyArrays = 48;
constexpr int kMaxInlinePairs = 256;

struct CopyBlocksKernelParams {
  char* arrays[kMaxCopyArrays];
  std::int64_t block_bytes[kMaxCopyArrays];         // one block, contiguous
  std::int64_t block_stride_bytes[kMaxCopyArrays];  // between block starts (>= block_bytes)
  std::int64_t num_blocks[kMaxCopyArrays];
  std::int32_t inline_pairs[kMaxInlinePairs][2];  // host mapping, copied with the launch
  const void* mapping;                            // device mapping [P, 2] or null
  bool mapping_int64;
  bool vec16;  // every block, block stride and base 16-byte aligned
};
static_assert(sizeof(CopyBlocksKernelParams) <= 4096, "kernel parameters over 4 KB");

// grid (pairs, arrays); threads copy one block of one array.
__global__ void copy_blocks_kernel(const __grid_constant__ CopyBlocksKernelParams p) {
  const std::int64_t pair = blockIdx.x;
  const int a = blockIdx.y;
  std::int64_t src, dst;
  if (p.mapping) {
    if (p.mapping_int64) {
      src = static_cast<const std::int64_t*>(p.mapping)[2 * pair];
      dst = static_cast<const std::int64_t*>(p.mapping)[2 * pair + 1];
    } else {
      src = static_cast<const std::int32_t*>(p.mapping)[2 * pair];
      dst = static_cast<const std::int32_t*>(p.mapping)[2 * pair + 1];
    }
  } else {
    src = p.inline_pairs[pair][0];
    dst = p.inline_pairs[pair][1];
  }
  const std::int64_t n = p.num_blocks[a];
  if (src < 0 || src >= n || dst < 0 || dst >= n) return;  // device mapping: skip bad pairs
  const std::int64_t bytes = p.block_bytes[a], stride = p.block_stride_bytes[a];
  const char* s = p.arrays[a] + src * stride;
  char* d = p.arrays[a] + dst * stride;
  if (p.vec16) {
    const auto* s4 = reinterpret_cast<const uint4*>(s);
    auto* d4 = reinterpret_cast<uint4*>(d);
    for (std::int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (std::int64_t i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace

void reshape_and_cache(const CacheWriteParams& p, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device_id);
  if (p.num_tokens == 0) return;
  if (p.num_tokens > 0x7fffffff) fail<NotSupported>("reshape_and_cache (CUDA): too many tokens: ", p.num_tokens);
  CacheWriteKernelParams k{};
  k.key = p.key;
  k.k_stride_tok = p.k_stride_tok;
  k.k_stride_head = p.k_stride_head;
  k.value = p.value;
  k.v_stride_tok = p.v_stride_tok;
  k.v_stride_head = p.v_stride_head;
  k.key_cache = p.key_cache;
  k.value_cache = p.value_cache;
  k.k_block_stride = p.k_block_stride;
  k.v_block_stride = p.v_block_stride;
  const RowStrides row_st = row_strides(p.layout, p.block_size, p.num_kv_heads, p.head_size);
  k.tok_stride = row_st.token;
  k.head_stride = row_st.head;
  k.slot_mapping = p.slot_mapping;
  k.slot_int64 = p.slot_mapping_int64;
  k.num_kv_heads = p.num_kv_heads;
  k.head_size = p.head_size;
  k.block_size = p.block_size;
  k.x = static_cast<int>(supported::kCacheChunkBytes / cache_elem_size(p.dtype, p.kv_cache_dtype));
  k.num_blocks = p.num_blocks;
  k.k_scale = p.k_scale;
  k.v_scale = p.v_scale;
  const void* fn = nullptr;
  switch (p.dtype) {
    case DType::kFloat32: fn = pick_cache_kernel<float>(p.kv_cache_dtype, p.layout); break;
    case DType::kFloat16: fn = pick_cache_kernel<__half>(p.kv_cache_dtype, p.layout); break;
    case DType::kBFloat16: fn = pick_cache_kernel<__nv_bfloat16>(p.kv_cache_dtype, p.layout); break;
    default:
      fail<NotSupported>("reshape_and_cache (CUDA): dtype ", dtype_name(p.dtype), " is not supported; supported: ",
                         supported::dtypes_str());
  }
  const int threads = std::min(256, std::max(32, (p.num_kv_heads * p.head_size + 31) / 32 * 32));
  void* args[] = {&k};
  check_cuda(cudaLaunchKernel(fn, dim3(static_cast<unsigned>(p.num_tokens)), dim3(threads), args, 0, stream),
             "reshape_and_cache: kernel launch");
  check_launch("reshape_and_cache");
}

void copy_blocks(const CopyBlocksParams& p, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device_id);
  const auto n = static_cast<std::int64_t>(p.arrays.size());
  if (n == 0 || p.num_pairs == 0) return;
  const std::int64_t pair_step = p.mapping_on_host ? kMaxInlinePairs : 0x7fffffff;
  for (std::int64_t a0 = 0; a0 < n; a0 += kMaxCopyArrays) {
    const int na = static_cast<int>(std::min<std::int64_t>(kMaxCopyArrays, n - a0));
    for (std::int64_t p0 = 0; p0 < p.num_pairs; p0 += pair_step) {
      const std::int64_t np = std::min(pair_step, p.num_pairs - p0);
      CopyBlocksKernelParams k{};
      k.vec16 = true;
      for (int i = 0; i < na; ++i) {
        const auto ai = static_cast<std::size_t>(a0 + i);
        k.arrays[i] = static_cast<char*>(p.arrays[ai]);
        k.block_bytes[i] = p.block_bytes[ai];
        k.block_stride_bytes[i] = p.block_stride_bytes[ai];
        k.num_blocks[i] = p.num_blocks[ai];
        if (k.block_bytes[i] % 16 != 0 || k.block_stride_bytes[i] % 16 != 0 ||
            reinterpret_cast<std::uintptr_t>(k.arrays[i]) % 16 != 0)
          k.vec16 = false;
      }
      k.mapping_int64 = p.mapping_int64;
      if (p.mapping_on_host) {
        k.mapping = nullptr;
        for (std::int64_t i = 0; i < np; ++i)
          for (int j = 0; j < 2; ++j) {
            const std::int64_t e = 2 * (p0 + i) + j;
            k.inline_pairs[i][j] = p.mapping_int64
                                       ? static_cast<std::int32_t>(static_cast<const std::int64_t*>(p.mapping)[e])
                                       : static_cast<const std::int32_t*>(p.mapping)[e];
          }
      } else {
        k.mapping = static_cast<const char*>(p.mapping) + 2 * p0 * (p.mapping_int64 ? 8 : 4);
      }
      void* args[] = {&k};
      check_cuda(cudaLaunchKernel(reinterpret_cast<const void*>(&copy_blocks_kernel),
                                  dim3(static_cast<unsigned>(np), static_cast<unsigned>(na)), dim3(256), args, 0,
                                  stream),
                 "copy_blocks: kernel launch");
      check_launch("copy_blocks");
    }
  }
}

void swap_blocks(const SwapBlocksParams& p, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device_id);
  auto at = [&](std::int64_t i, int j) -> std::int64_t {
    return p.mapping_int64 ? static_cast<const std::int64_t*>(p.mapping)[2 * i + j]
                           : static_cast<const std::int32_t*>(p.mapping)[2 * i + j];
  };
  std::int64_t i = 0;
  while (i < p.num_pairs) {
    // Merge a run of consecutive pairs (src, dst), (src+1, dst+1), ... into one copy.
    std::int64_t run = 1;
    while (i + run < p.num_pairs && at(i + run, 0) == at(i, 0) + run && at(i + run, 1) == at(i, 1) + run) ++run;
    const char* s = static_cast<const char*>(p.src) + at(i, 0) * p.src_block_stride_bytes;
    char* d = static_cast<char*>(p.dst) + at(i, 1) * p.dst_block_stride_bytes;
    if (p.src_block_stride_bytes == p.block_bytes && p.dst_block_stride_bytes == p.block_bytes)
      check_cuda(cudaMemcpyAsync(d, s, static_cast<std::size_t>(run * p.block_bytes), cudaMemcpyDefault, stream),
                 "swap_blocks: cudaMemcpyAsync");
    else  // block-strided views: `run` rows of block_bytes, each at its array's block stride
      check_cuda(cudaMemcpy2DAsync(d, static_cast<std::size_t>(p.dst_block_stride_bytes), s,
                                   static_cast<std::size_t>(p.src_block_stride_bytes),
                                   static_cast<std::size_t>(p.block_bytes), static_cast<std::size_t>(run),
                                   cudaMemcpyDefault, stream),
                 "swap_blocks: cudaMemcpy2DAsync");
    i += run;
  }
}

}  // namespace pagedattn::cuda_backend
