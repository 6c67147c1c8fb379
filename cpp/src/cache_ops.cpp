// copy_blocks / swap_blocks: one validation pass, the host implementation, and the
// routing to the CUDA backend.
#include "pagedattn/cache_ops.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "cuda_backend.hpp"
#include "pagedattn/attention.hpp"
#include "device_checks.hpp"
#include "pagedattn/errors.hpp"

namespace pagedattn {
namespace {

using detail::on_host;
using detail::same_device;
using detail::where;

void check_known_device(const TensorView& t, const std::string& name) {
  if (t.device == DeviceKind::kOther)
    fail<TypeMismatch>(name, ": arrays on this device type are not supported (expected cpu or cuda)");
}

std::int64_t block_bytes_of(const TensorView& t, const std::string& name) {
  if (t.ndim < 1) fail<InvalidArgument>(name, ": expected an array of blocks [num_blocks, ...], got a scalar");
  if (!t.is_contiguous()) fail<InvalidArgument>(name, ": must be C-contiguous (shape ", t.shape_str(), ")");
  const std::size_t es = dtype_size(t.dtype);
  if (es == 0) fail<TypeMismatch>(name, ": dtype ", dtype_name(t.dtype), " is not supported");
  std::int64_t n = 1;
  for (int d = 1; d < t.ndim; ++d) n *= t.size(d);
  return n * static_cast<std::int64_t>(es);
}

struct Mapping {
  const void* data = nullptr;
  bool int64 = true;
  std::int64_t pairs = 0;
  std::int64_t at(std::int64_t i, int j) const {
    return int64 ? static_cast<const std::int64_t*>(data)[2 * i + j] : static_cast<const std::int32_t*>(data)[2 * i + j];
  }
};

Mapping check_mapping(const TensorView& m) {
  if (m.ndim != 2 || m.size(1) != 2)
    fail<InvalidArgument>("block_mapping: expected shape [num_pairs, 2] (src, dst), got ", m.shape_str());
  if (m.dtype != DType::kInt64 && m.dtype != DType::kInt32)
    fail<TypeMismatch>("block_mapping: expected dtype int64 or int32, got ", dtype_name(m.dtype));
  if (!m.is_contiguous()) fail<InvalidArgument>("block_mapping: must be C-contiguous");
  return Mapping{m.data, m.dtype == DType::kInt64, m.size(0)};
}

void check_pairs_range(const Mapping& m, std::int64_t src_n, std::int64_t dst_n) {
  for (std::int64_t i = 0; i < m.pairs; ++i) {
    if (m.at(i, 0) < 0 || m.at(i, 0) >= src_n)
      fail<OutOfRange>("block_mapping[", i, ", 0] = ", m.at(i, 0), " is outside [0, ", src_n, ")");
    if (m.at(i, 1) < 0 || m.at(i, 1) >= dst_n)
      fail<OutOfRange>("block_mapping[", i, ", 1] = ", m.at(i, 1), " is outside [0, ", dst_n, ")");
  }
}

}  // namespace

void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping, void* stream) {
  const Mapping m = check_mapping(block_mapping);
  check_known_device(block_mapping, "block_mapping");
  if (caches.empty()) return;
  CopyBlocksParams p;
  const TensorView& ref = caches.front();
  for (std::size_t i = 0; i < caches.size(); ++i) {
    const TensorView& t = caches[i];
    const std::string name = detail::concat("caches[", i, "]");
    check_known_device(t, name);
    const bool same = same_device(ref, t);
    if (!same)
      fail<InvalidArgument>(name, " is on ", where(t), " but caches[0] is on ", where(ref),
                            "; all caches of one call must be on the same device");
    p.arrays.push_back(t.data);
    p.block_bytes.push_back(block_bytes_of(t, name));
    p.num_blocks.push_back(t.size(0));
  }
  const bool cuda = ref.device == DeviceKind::kCUDA;
  const bool map_host = on_host(block_mapping);
  if (!map_host && !(cuda && block_mapping.device_id == ref.device_id))
    fail<InvalidArgument>("block_mapping is on ", where(block_mapping), " but the caches are on ", where(ref),
                          "; pass it in host memory or on the caches' device");
  if (map_host) {
    std::int64_t nmin = p.num_blocks.front();
    for (auto n : p.num_blocks) nmin = std::min(nmin, n);
    check_pairs_range(m, nmin, nmin);
  }
  if (!cuda) {
    for (std::int64_t i = 0; i < m.pairs; ++i)
      for (std::size_t a = 0; a < p.arrays.size(); ++a) {
        char* base = static_cast<char*>(p.arrays[a]);
        const auto bb = static_cast<std::size_t>(p.block_bytes[a]);
        if (m.at(i, 0) != m.at(i, 1))
          std::memcpy(base + static_cast<std::size_t>(m.at(i, 1)) * bb, base + static_cast<std::size_t>(m.at(i, 0)) * bb,
                      bb);
      }
    return;
  }
  p.mapping = m.data;
  p.mapping_int64 = m.int64;
  p.mapping_on_host = map_host;
  p.num_pairs = m.pairs;
  p.device_id = ref.device_id;
  cuda_backend::copy_blocks(p, stream);
}

void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping, void* stream) {
  check_known_device(src, "src");
  check_known_device(dst, "dst");
  check_known_device(block_mapping, "block_mapping");
  const Mapping m = check_mapping(block_mapping);
  if (!on_host(block_mapping))
    fail<InvalidArgument>("block_mapping: must be in host memory (it is read on the host), got an array on ",
                          where(block_mapping));
  if (src.dtype != dst.dtype)
    fail<TypeMismatch>("dst: dtype ", dtype_name(dst.dtype), " must equal src's dtype ", dtype_name(src.dtype));
  const std::int64_t sb = block_bytes_of(src, "src"), db = block_bytes_of(dst, "dst");
  bool same_block = src.ndim == dst.ndim;
  for (int d = 1; same_block && d < src.ndim; ++d) same_block = src.size(d) == dst.size(d);
  if (!same_block || sb != db)
    fail<InvalidArgument>("dst: block shape of ", dst.shape_str(), " must equal src's ", src.shape_str(),
                          " in every dimension but the first");
  if (src.device == DeviceKind::kCUDA && dst.device == DeviceKind::kCUDA && src.device_id != dst.device_id)
    fail<InvalidArgument>("src is on ", where(src), " and dst on ", where(dst),
                          "; swap_blocks copies between one GPU and host memory (or within one GPU)");
  check_pairs_range(m, src.size(0), dst.size(0));
  if (on_host(src) && on_host(dst)) {
    const auto bb = static_cast<std::size_t>(sb);
    for (std::int64_t i = 0; i < m.pairs; ++i)
      std::memmove(static_cast<char*>(dst.data) + static_cast<std::size_t>(m.at(i, 1)) * bb,
                   static_cast<const char*>(src.data) + static_cast<std::size_t>(m.at(i, 0)) * bb, bb);
    return;
  }
  SwapBlocksParams p;
  p.src = src.data;
  p.dst = dst.data;
  p.block_bytes = sb;
  p.src_blocks = src.size(0);
  p.dst_blocks = dst.size(0);
  p.mapping = m.data;
  p.mapping_int64 = m.int64;
  p.num_pairs = m.pairs;
  p.device_id = src.device == DeviceKind::kCUDA ? src.device_id : dst.device_id;
  cuda_backend::swap_blocks(p, stream);
}

}  // namespace pagedattn
