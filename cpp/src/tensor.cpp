#include "pagedattn/tensor.hpp"

#include <sstream>

namespace pagedattn {

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kUInt16: return "uint16";
    case DType::kOther: break;
  }
  return "an unsupported dtype";
}

std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kUInt16: return 2;
    case DType::kUInt8: return 1;
    case DType::kOther: break;
  }
  return 0;
}

const char* device_name(DeviceKind d) noexcept {
  switch (d) {
    case DeviceKind::kCPU: return "cpu";
    case DeviceKind::kCUDA: return "cuda";
    case DeviceKind::kCUDAHost: return "cuda_host";
    case DeviceKind::kOther: break;
  }
  return "an unsupported device";
}

DType parse_dtype(const std::string& name, const char* arg) {
  static const struct {
    const char* name;
    DType dtype;
  } kNames[] = {{"float32", DType::kFloat32},   {"float16", DType::kFloat16},      {"bfloat16", DType::kBFloat16},
                {"float64", DType::kFloat64},   {"int32", DType::kInt32},          {"int64", DType::kInt64},
                {"uint8", DType::kUInt8},       {"uint16", DType::kUInt16},        {"fp8", DType::kUInt8},
                {"fp8_e4m3", DType::kUInt8},    {"fp8_e5m2", DType::kUInt8},       {"float8_e4m3fn", DType::kUInt8},
                {"float8_e5m2", DType::kUInt8}, {"half", DType::kFloat16},         {"float", DType::kFloat32}};
  for (const auto& n : kNames)
    if (name == n.name) return n.dtype;
  fail<InvalidArgument>(arg, ": unknown dtype name \"", name,
                        "\"; expected float32, float16, bfloat16, uint8 or an fp8 name (fp8_e4m3, fp8_e5m2)");
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // empty arrays may report any strides
  std::int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    const auto d = static_cast<std::size_t>(i);
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[static_cast<std::size_t>(i)];
  os << ']';
  return os.str();
}

TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     DeviceKind device, int device_id) {
  TensorView v;
  if (shape.size() > static_cast<std::size_t>(TensorView::kMaxDims))
    fail<InvalidArgument>("make_view: at most ", TensorView::kMaxDims, " dimensions, got ", shape.size());
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.device_id = device_id;
  v.ndim = static_cast<int>(shape.size());
  std::size_t i = 0;
  for (auto s : shape) v.shape[i++] = s;
  std::int64_t expected = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[static_cast<std::size_t>(d)] = expected;
    expected *= v.shape[static_cast<std::size_t>(d)];
  }
  return v;
}

namespace detail {

DType dtype_from_dlpack(std::uint8_t code, std::uint8_t bits, std::uint16_t lanes) {
  if (lanes != 1) return DType::kOther;
  // DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat.
  switch (code) {
    case 0:
      if (bits == 32) return DType::kInt32;
      if (bits == 64) return DType::kInt64;
      break;
    case 1:
      if (bits == 8) return DType::kUInt8;
      if (bits == 16) return DType::kUInt16;
      break;
    case 2:
      if (bits == 16) return DType::kFloat16;
      if (bits == 32) return DType::kFloat32;
      if (bits == 64) return DType::kFloat64;
      break;
    case 4:
      if (bits == 16) return DType::kBFloat16;
      break;
    default: break;
  }
  return DType::kOther;
}

DeviceKind device_from_dlpack(int device_type) {
  // DLPack device types: 1 CPU, 2 CUDA, 3 CUDA pinned host.
  switch (device_type) {
    case 1: return DeviceKind::kCPU;
    case 2: return DeviceKind::kCUDA;
    case 3: return DeviceKind::kCUDAHost;
    default: return DeviceKind::kOther;
  }
}

}  // namespace detail
const char* layout_name(CacheLayout l) noexcept {
  switch (l) {
    case CacheLayout::kVLLM: return "vllm";
    case CacheLayout::kNHD: return "nhd";
    case CacheLayout::kHND: return "hnd";
  }
  return "unknown";
}

const char* kv_cache_dtype_name(KVCacheDType k) noexcept {
  switch (k) {
    case KVCacheDType::kAuto: return "auto";
    case KVCacheDType::kFp8E4M3: return "fp8_e4m3";
    case KVCacheDType::kFp8E5M2: return "fp8_e5m2";
  }
  return "unknown";
}

CacheLayout parse_layout(const std::string& s, const char* arg) {
  if (s == "vllm") return CacheLayout::kVLLM;
  if (s == "nhd") return CacheLayout::kNHD;
  if (s == "hnd") return CacheLayout::kHND;
  fail<InvalidArgument>(arg, ": got \"", s, "\", expected \"vllm\", \"nhd\" or \"hnd\"");
}

KVCacheDType parse_kv_cache_dtype(const std::string& s, const char* arg) {
  if (s == "auto") return KVCacheDType::kAuto;
  if (s == "fp8" || s == "fp8_e4m3") return KVCacheDType::kFp8E4M3;
  if (s == "fp8_e5m2") return KVCacheDType::kFp8E5M2;
  fail<InvalidArgument>(arg, ": got \"", s, "\", expected \"auto\", \"fp8_e4m3\" (or \"fp8\") or \"fp8_e5m2\"");
}

}  // namespace pagedattn
