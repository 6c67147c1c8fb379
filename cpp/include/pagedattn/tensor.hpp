// A small non-owning view of a strided array, the only array type the core sees.
//
// The core never allocates or frees the arrays it is handed and never includes a
// framework header. Python arrays reach it through DLPack (see the bindings);
// C++ callers build a TensorView directly or convert a DLPack DLTensor with
// from_dlpack().
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "pagedattn/errors.hpp"

namespace pagedattn {

enum class DType : std::uint8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat64,
  kInt32,
  kInt64,
  kUInt8,  // storage of fp8 KV caches
  kUInt16,
  kOther,
};

enum class DeviceKind : std::uint8_t { kCPU, kCUDA, kCUDAHost, kOther };

const char* dtype_name(DType t) noexcept;
std::size_t dtype_size(DType t) noexcept;
const char* device_name(DeviceKind d) noexcept;
// Parses a dtype name: "float32", "float16", "bfloat16", "float64", "int32", "int64",
// "uint8", "uint16"; fp8 storage names ("fp8", "fp8_e4m3", "fp8_e5m2", "float8_e4m3fn",
// "float8_e5m2") map to uint8. Throws InvalidArgument naming `arg` otherwise.
DType parse_dtype(const std::string& name, const char* arg = "dtype");

// How the paged KV cache is laid out in memory. The rank of key_cache tells "vllm" (5)
// from the rank-4 layouts; "nhd" and "hnd" share a rank, so a call names "hnd" with its
// layout option (a rank-4 cache without one is read as "nhd": see paged_attention).
// Every layout may have a block stride of its own (dimension 0 of a cache array): a
// cache may be a view of a larger allocation, e.g. the key half of [N, 2, ...].
enum class CacheLayout : std::uint8_t {
  kVLLM,  // key [num_blocks, num_kv_heads, head_size/x, block_size, x],
          //   x = supported::kCacheChunkBytes / elem size
          // value [num_blocks, num_kv_heads, head_size, block_size]
  kNHD,   // key and value [num_blocks, block_size, num_kv_heads, head_size]
  kHND,   // key and value [num_blocks, num_kv_heads, block_size, head_size]
};

// Element type stored in the KV cache. kAuto: the same dtype as the query / new keys.
// The fp8 kinds store one byte per element (uint8 arrays) with a per-tensor scale:
// real value = fp8 value * scale.
enum class KVCacheDType : std::uint8_t { kAuto, kFp8E4M3, kFp8E5M2 };

const char* layout_name(CacheLayout l) noexcept;
const char* kv_cache_dtype_name(KVCacheDType k) noexcept;
// Parses "vllm" / "nhd" / "hnd"; throws InvalidArgument naming `arg` otherwise.
CacheLayout parse_layout(const std::string& s, const char* arg = "layout");
// Parses "auto" / "fp8_e4m3" (alias "fp8") / "fp8_e5m2"; throws InvalidArgument otherwise.
KVCacheDType parse_kv_cache_dtype(const std::string& s, const char* arg = "kv_cache_dtype");

struct TensorView {
  static constexpr int kMaxDims = 8;

  void* data = nullptr;
  DType dtype = DType::kOther;
  DeviceKind device = DeviceKind::kCPU;
  int device_id = 0;
  int ndim = 0;
  bool read_only = false;  // the owner forbids writes: refused wherever pagedattn writes
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> strides{};  // in elements, not bytes

  std::int64_t size(int d) const { return shape[static_cast<std::size_t>(d < 0 ? d + ndim : d)]; }
  std::int64_t stride(int d) const { return strides[static_cast<std::size_t>(d < 0 ? d + ndim : d)]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[static_cast<std::size_t>(i)];
    return n;
  }
  bool is_contiguous() const;  // C order; size-1 dimensions may carry any stride
  std::string shape_str() const;  // "[2, 3, 4]"
  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Builds a view over contiguous memory (C order).
TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     DeviceKind device = DeviceKind::kCPU, int device_id = 0);

namespace detail {
DType dtype_from_dlpack(std::uint8_t code, std::uint8_t bits, std::uint16_t lanes);
DeviceKind device_from_dlpack(int device_type);
}  // namespace detail

// Converts any struct laid out like DLPack's DLTensor (data, device, ndim, dtype,
// shape, strides, byte_offset). A template so the core needs no DLPack header:
// pass a `DLTensor` from <dlpack/dlpack.h> and it just works.
template <class DLTensorLike>
TensorView from_dlpack(const DLTensorLike& t) {
  TensorView v;
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims)
    fail<InvalidArgument>("from_dlpack: ndim ", t.ndim, " is outside [0, ", TensorView::kMaxDims, "]");
  v.ndim = t.ndim;
  v.dtype = detail::dtype_from_dlpack(static_cast<std::uint8_t>(t.dtype.code),
                                      static_cast<std::uint8_t>(t.dtype.bits),
                                      static_cast<std::uint16_t>(t.dtype.lanes));
  v.device = detail::device_from_dlpack(static_cast<int>(t.device.device_type));
  v.device_id = static_cast<int>(t.device.device_id);
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  std::int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    v.shape[static_cast<std::size_t>(i)] = t.shape[i];
    v.strides[static_cast<std::size_t>(i)] = t.strides ? t.strides[i] : expected;
    expected *= t.shape[i];
  }
  return v;
}

}  // namespace pagedattn
