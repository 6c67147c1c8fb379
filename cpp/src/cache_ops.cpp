// copy_blocks / swap_blocks: one validation pass, the host implementation, and the
// routing to the CUDA backend.
#include "pagedattn/cache_ops.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cuda_backend.hpp"
#include "pagedattn/attention.hpp"
#include "device_checks.hpp"
#include "pagedattn/errors.hpp"

namespace pagedattn {
namespace {

using detail::on_host;
using detail::same_device;
using detail::where;

void check_writable(const TensorView& t, const std::string& name) {
  if (t.read_only) fail<InvalidArgument>(name, ": the array is read-only; pagedattn writes into it");
}

void check_known_device(const TensorView& t, const std::string& name) {
  if (t.device == DeviceKind::kOther)
    fail<TypeMismatch>(name, ": arrays on this device type are not supported (expected cpu or cuda)");
}

// Bytes of one block of a cache array and from one block's start to the next's: its
// blocks (dims 1..) must be C-contiguous, the block stride anything that keeps blocks
// apart (detail::check_block_strided says what is allowed, naming the strides).
struct BlockBytes {
  std::int64_t block = 0;
  std::int64_t stride = 0;
};
BlockBytes block_bytes_of(const TensorView& t, const std::string& name) {
  if (t.ndim < 1) fail<InvalidArgument>(name, ": expected an array of blocks [num_blocks, ...], got a scalar");
  const std::size_t es = dtype_size(t.dtype);
  if (es == 0) fail<TypeMismatch>(name, ": dtype ", dtype_name(t.dtype), " is not supported");
  const detail::BlockStrided b = detail::check_block_strided(t, name.c_str());
  const auto e = static_cast<std::int64_t>(es);
  return {b.block_elems * e, b.block_stride * e};
}

struct Mapping {
  const void* data = nullptr;
  bool int64 = true;
  std::int64_t pairs = 0;
};

Mapping check_mapping(const TensorView& m) {
  if (m.ndim != 2 || m.size(1) != 2)
    fail<InvalidArgument>("block_mapping: expected shape [num_pairs, 2] (src, dst), got ", m.shape_str());
  if (m.dtype != DType::kInt64 && m.dtype != DType::kInt32)
    fail<TypeMismatch>("block_mapping: expected dtype int64 or int32, got ", dtype_name(m.dtype));
  if (!m.is_contiguous()) fail<InvalidArgument>("block_mapping: must be C-contiguous");
  return Mapping{m.data, m.dtype == DType::kInt64, m.size(0)};
}

// The pairs of a host mapping, read exactly once into a private int64 copy [P, 2]:
// every check and every copy uses the copy, so a mapping that changes during the call
// (another thread writing it) can at worst give a wrong answer, never an access out of
// bounds.
std::vector<std::int64_t> read_pairs(const Mapping& m) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(2 * m.pairs));
  if (m.int64) {
    if (!v.empty()) std::memcpy(v.data(), m.data, v.size() * sizeof(std::int64_t));
  } else {
    const auto* s = static_cast<const std::int32_t*>(m.data);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = s[i];
  }
  return v;
}

void check_pairs_range(const std::vector<std::int64_t>& pairs, std::int64_t src_n, std::int64_t dst_n) {
  for (std::size_t i = 0; i < pairs.size() / 2; ++i) {
    const std::int64_t s = pairs[2 * i], d = pairs[2 * i + 1];
    if (s < 0 || s >= src_n) fail<OutOfRange>("block_mapping[", i, ", 0] = ", s, " is outside [0, ", src_n, ")");
    if (d < 0 || d >= dst_n) fail<OutOfRange>("block_mapping[", i, ", 1] = ", d, " is outside [0, ", dst_n, ")");
  }
}

// Each block is written at most once per call, and (with `chains`, when sources and
// destinations are blocks of the same arrays) no block is written by one pair and read
// by another: the result would depend on the order of the pairs on the CPU and race on
// CUDA, where pairs run in parallel. A pair (b, b) is a no-op and reads nothing
// another pair writes, but its destination still counts once.
void check_destinations(const std::vector<std::int64_t>& pairs, bool chains) {
  const std::size_t n = pairs.size() / 2;
  std::vector<std::pair<std::int64_t, std::size_t>> dst(n);  // (block, pair), sorted
  for (std::size_t i = 0; i < n; ++i) dst[i] = {pairs[2 * i + 1], i};
  std::sort(dst.begin(), dst.end());
  for (std::size_t k = 1; k < n; ++k)
    if (dst[k].first == dst[k - 1].first)
      fail<InvalidArgument>("block_mapping[", dst[k].second, "]: destination block ", dst[k].first,
                            " is also the destination of pair ", dst[k - 1].second,
                            "; a block may be written only once per call");
  if (!chains) return;
  for (std::size_t j = 0; j < n; ++j) {
    const std::int64_t s = pairs[2 * j];
    const auto it = std::lower_bound(dst.begin(), dst.end(), std::make_pair(s, std::size_t{0}));
    if (it == dst.end() || it->first != s) continue;
    const std::size_t i = it->second;
    if (i == j || pairs[2 * i] == pairs[2 * i + 1]) continue;
    fail<InvalidArgument>("block_mapping[", i, "]: destination block ", s, " is also the source of pair ", j,
                          " (a chained copy, whose result would depend on the order of the pairs); "
                          "split it into two calls");
  }
}

// No two caches of a copy_blocks call may share a block: a copy into one would change
// another's source, and the result would depend on the order of the caches. (The key and
// value halves of one [N, 2, ...] allocation interleave without sharing one.) The caches
// are sorted by their first byte, so only those whose byte ranges meet are compared block
// by block: O(L log L) for L caches that do not overlap.
void check_caches_share_no_block(const std::vector<TensorView>& caches, const CopyBlocksParams& p) {
  const std::size_t n = caches.size();
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> range(n);  // [first byte, past the last)
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto lo = reinterpret_cast<std::uintptr_t>(caches[i].data);
    const std::int64_t nb = p.num_blocks[i];
    const std::int64_t bytes =
        nb > 0 && p.block_bytes[i] > 0 ? (nb - 1) * p.block_stride_bytes[i] + p.block_bytes[i] : 0;
    range[i] = {lo, lo + static_cast<std::uintptr_t>(bytes)};
    order[i] = i;
  }
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return range[a].first < range[b].first; });
  std::vector<std::uintptr_t> reach(n);  // the furthest end among order[0 .. k]
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = order[k];
    reach[k] = std::max(k ? reach[k - 1] : 0, range[i].second);
    if (range[i].first == range[i].second) continue;
    for (std::size_t j = k; j-- > 0 && reach[j] > range[i].first;) {
      const std::size_t o = order[j];
      if (range[o].second <= range[i].first || range[o].first == range[o].second) continue;
      const std::size_t first = std::min(i, o), second = std::max(i, o);
      const std::string a = detail::concat("caches[", first, "]"), b = detail::concat("caches[", second, "]");
      detail::check_blocks_disjoint(caches[first], a.c_str(), caches[second], b.c_str());
    }
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
    check_writable(t, name);
    const bool same = same_device(ref, t);
    if (!same)
      fail<InvalidArgument>(name, " is on ", where(t), " but caches[0] is on ", where(ref),
                            "; all caches of one call must be on the same device");
    p.arrays.push_back(t.data);
    const BlockBytes bb = block_bytes_of(t, name);
    p.block_bytes.push_back(bb.block);
    p.block_stride_bytes.push_back(bb.stride);
    p.num_blocks.push_back(t.size(0));
    detail::check_disjoint(t, name.c_str(), block_mapping, "block_mapping");
  }
  check_caches_share_no_block(caches, p);
  const bool cuda = ref.device == DeviceKind::kCUDA;
  const bool map_host = on_host(block_mapping);
  if (!map_host && !(cuda && block_mapping.device_id == ref.device_id))
    fail<InvalidArgument>("block_mapping is on ", where(block_mapping), " but the caches are on ", where(ref),
                          "; pass it in host memory or on the caches' device");
  std::vector<std::int64_t> pairs;
  if (map_host) {
    pairs = read_pairs(m);
    std::int64_t nmin = p.num_blocks.front();
    for (auto n : p.num_blocks) nmin = std::min(nmin, n);
    check_pairs_range(pairs, nmin, nmin);
    check_destinations(pairs, /*chains=*/true);
  }
  if (!cuda) {
    for (std::size_t i = 0; i < pairs.size() / 2; ++i) {
      const auto s = static_cast<std::size_t>(pairs[2 * i]), d = static_cast<std::size_t>(pairs[2 * i + 1]);
      if (s == d) continue;
      for (std::size_t a = 0; a < p.arrays.size(); ++a) {
        char* base = static_cast<char*>(p.arrays[a]);
        const auto bb = static_cast<std::size_t>(p.block_bytes[a]);
        const auto bs = static_cast<std::size_t>(p.block_stride_bytes[a]);
        std::memcpy(base + d * bs, base + s * bs, bb);
      }
    }
    return;
  }
  p.mapping = map_host ? static_cast<const void*>(pairs.data()) : m.data;  // host: the checked copy
  p.mapping_int64 = map_host || m.int64;
  p.mapping_on_host = map_host;
  p.num_pairs = m.pairs;
  p.device_id = ref.device_id;
  cuda_backend::copy_blocks(p, stream);
}

void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping, void* stream) {
  check_known_device(src, "src");
  check_known_device(dst, "dst");
  check_writable(dst, "dst");
  check_known_device(block_mapping, "block_mapping");
  const Mapping m = check_mapping(block_mapping);
  if (!on_host(block_mapping))
    fail<InvalidArgument>("block_mapping: must be in host memory (it is read on the host), got an array on ",
                          where(block_mapping));
  if (src.dtype != dst.dtype)
    fail<TypeMismatch>("dst: dtype ", dtype_name(dst.dtype), " must equal src's dtype ", dtype_name(src.dtype));
  const BlockBytes sbb = block_bytes_of(src, "src"), dbb = block_bytes_of(dst, "dst");
  const std::int64_t sb = sbb.block, db = dbb.block;
  bool same_block = src.ndim == dst.ndim;
  for (int d = 1; same_block && d < src.ndim; ++d) same_block = src.size(d) == dst.size(d);
  if (!same_block || sb != db)
    fail<InvalidArgument>("dst: block shape of ", dst.shape_str(), " must equal src's ", src.shape_str(),
                          " in every dimension but the first");
  if (src.device == DeviceKind::kCUDA && dst.device == DeviceKind::kCUDA && src.device_id != dst.device_id)
    fail<InvalidArgument>("src is on ", where(src), " and dst on ", where(dst),
                          "; swap_blocks copies between one GPU and host memory (or within one GPU)");
  detail::check_disjoint(dst, "dst", block_mapping, "block_mapping");
  detail::check_disjoint(src, "src", block_mapping, "block_mapping");
  if (dst.data != src.data) detail::check_blocks_disjoint(dst, "dst", src, "src");
  else detail::check_disjoint(dst, "dst", src, "src", /*allow_identical=*/true);
  const std::vector<std::int64_t> pairs = read_pairs(m);
  check_pairs_range(pairs, src.size(0), dst.size(0));
  check_destinations(pairs, /*chains=*/src.data == dst.data);  // blocks of one array: no chains either
  if (on_host(src) && on_host(dst)) {
    const auto bb = static_cast<std::size_t>(sb);
    const auto ss = static_cast<std::size_t>(sbb.stride), ds = static_cast<std::size_t>(dbb.stride);
    for (std::size_t i = 0; i < pairs.size() / 2; ++i)
      std::memmove(static_cast<char*>(dst.data) + static_cast<std::size_t>(pairs[2 * i + 1]) * ds,
                   static_cast<const char*>(src.data) + static_cast<std::size_t>(pairs[2 * i]) * ss, bb);
    return;
  }
  SwapBlocksParams p;
  p.src = src.data;
  p.dst = dst.data;
  p.block_bytes = sb;
  p.src_block_stride_bytes = sbb.stride;
  p.dst_block_stride_bytes = dbb.stride;
  p.src_blocks = src.size(0);
  p.dst_blocks = dst.size(0);
  p.mapping = pairs.data();  // the checked copy
  p.mapping_int64 = true;
  p.num_pairs = m.pairs;
  p.device_id = src.device == DeviceKind::kCUDA ? src.device_id : dst.device_id;
  cuda_backend::swap_blocks(p, stream);
}

}  // namespace pagedattn
