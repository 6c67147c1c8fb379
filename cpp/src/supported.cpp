#include "pagedattn/supported.hpp"

#include <algorithm>
#include <sstream>

namespace pagedattn {

namespace supported {
namespace {
template <class Container, class F>
std::string join(const Container& c, F&& f) {
  std::ostringstream os;
  bool first = true;
  for (const auto& v : c) {
    os << (first ? "" : ", ") << f(v);
    first = false;
  }
  return os.str();
}
}  // namespace

bool is_dtype(DType t) noexcept { return std::find(kDTypes.begin(), kDTypes.end(), t) != kDTypes.end(); }

bool is_cuda_head_size(int head_size) noexcept {
  return head_size > 0 && head_size <= kCudaMaxHeadSize && head_size % kCudaHeadSizeAlign == 0;
}

bool is_cuda_block_size(int block_size) noexcept {
  return std::find(kCudaBlockSizes.begin(), kCudaBlockSizes.end(), block_size) != kCudaBlockSizes.end();
}

std::string dtypes_str() {
  return join(kDTypes, [](DType t) { return dtype_name(t); });
}
std::string cuda_head_sizes_str() {
  return join(kCudaHeadSizes, [](int v) { return v; }) + " (specialised) and other multiples of " +
         std::to_string(kCudaHeadSizeAlign) + " up to " + std::to_string(kCudaMaxHeadSize);
}
std::string cuda_block_sizes_str() {
  return join(kCudaBlockSizes, [](int v) { return v; });
}
std::string layouts_str() {
  return join(kLayouts, [](CacheLayout l) { return std::string("\"") + layout_name(l) + "\""; });
}

}  // namespace supported
}  // namespace pagedattn
