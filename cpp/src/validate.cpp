// The one validation pass: every argument of the public entry points is checked here
// before anything is dispatched. Messages name the argument, what it got and what is
// allowed.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "validate.hpp"
#include "checked_math.hpp"
#include "cuda_backend.hpp"
#include "decode_planner.hpp"
#include "device_checks.hpp"
#include "pagedattn/errors.hpp"

namespace pagedattn {
namespace {

using detail::on_host;
using detail::same_device;
using detail::where;

// All arrays must live on one device: host memory (CPU or pinned) or one CUDA device.
void check_same_device(const TensorView& ref, const char* ref_name, const TensorView& t, const char* name) {
  if (t.device == DeviceKind::kOther)
    fail<TypeMismatch>(name, ": arrays on this device type are not supported (expected cpu or cuda)");
  const bool same = same_device(ref, t);
  if (!same)
    fail<InvalidArgument>(name, " is on ", where(t), " but ", ref_name, " is on ", where(ref),
                          "; all arrays of one call must be on the same device");
}

void check_ndim(const TensorView& t, const char* name, int ndim, const char* dims) {
  if (t.ndim != ndim)
    fail<InvalidArgument>(name, ": expected ", ndim, " dimensions ", dims, ", got ", t.ndim, " (shape ", t.shape_str(),
                          ")");
}

void check_dtype(const TensorView& t, const char* name, DType want) {
  if (t.dtype != want)
    fail<TypeMismatch>(name, ": expected dtype ", dtype_name(want), ", got ", dtype_name(t.dtype));
}

void check_float_dtype(const TensorView& t, const char* name) {
  if (!supported::is_dtype(t.dtype))
    fail<TypeMismatch>(name, ": dtype ", dtype_name(t.dtype), " is not supported; expected one of ",
                       supported::dtypes_str());
}

void check_contiguous(const TensorView& t, const char* name) {
  if (!t.is_contiguous())
    fail<InvalidArgument>(name, ": must be C-contiguous (shape ", t.shape_str(), ")");
}

void check_writable(const TensorView& t, const char* name) {
  if (t.read_only) fail<InvalidArgument>(name, ": the array is read-only; pagedattn writes into it");
}

void check_last_dim_contiguous(const TensorView& t, const char* name) {
  if (t.numel() > 0 && t.size(-1) > 1 && t.stride(-1) != 1)
    fail<InvalidArgument>(name, ": the last dimension must be contiguous (stride 1), got stride ", t.stride(-1));
}

void check_dim(const TensorView& t, const char* name, int d, std::int64_t want, const char* what) {
  if (t.size(d) != want)
    fail<InvalidArgument>(name, ": dimension ", d, " (", what, ") must be ", want, ", got ", t.size(d), " (shape ",
                          t.shape_str(), ")");
}

void check_positive_scale(float v, const char* name) {
  if (!std::isfinite(v) || v <= 0.0f) fail<InvalidArgument>(name, ": must be a finite positive number, got ", v);
  // fp8 writes store value / scale: a subnormal float32 scale makes 1 / scale infinite
  // (and 0 / scale NaN), so the smallest accepted scale is the smallest normal float32.
  if (!std::isnormal(v))
    fail<InvalidArgument>(name, ": must be at least ", std::numeric_limits<float>::min(),
                          " (the smallest normal float32), got ", v);
}

// ---- memory overlap -------------------------------------------------------------------
// Arrays a call writes must not share memory with anything else of the call (a wrong
// answer or a race otherwise), and an output must not overlap itself.

std::string strides_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.strides[static_cast<std::size_t>(i)]);
  return s + "]";
}

[[noreturn]] void fail_span(const TensorView& t, const char* name) {
  fail<InvalidArgument>(name, ": shape ", t.shape_str(), " with strides ", strides_str(t),
                        " spans more than 2^63 bytes");
}

using detail::add_ok;
using detail::mul_ok;

std::int64_t checked_mul(std::int64_t a, std::int64_t b, const TensorView& t, const char* name) {
  std::int64_t r = 0;
  if (!mul_ok(a, b, &r)) fail_span(t, name);
  return r;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b, const TensorView& t, const char* name) {
  std::int64_t r = 0;
  if (!add_ok(a, b, &r)) fail_span(t, name);
  return r;
}

// Byte range [lo, hi) spanned by a view's elements; lo == hi when it has none.
struct Extent {
  std::uintptr_t lo = 0, hi = 0;
};

Extent extent(const TensorView& t, const char* name) {
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[static_cast<std::size_t>(d)] <= 0) return {};
  const auto es = static_cast<std::int64_t>(std::max<std::size_t>(dtype_size(t.dtype), 1));
  std::int64_t lo = 0, hi = 0;  // element offsets of the first and last element reached
  for (int d = 0; d < t.ndim; ++d) {
    const auto i = static_cast<std::size_t>(d);
    const std::int64_t span = checked_mul(t.shape[i] - 1, t.strides[i], t, name);
    if (span < 0)
      lo = checked_add(lo, span, t, name);
    else
      hi = checked_add(hi, span, t, name);
  }
  const std::int64_t lo_b = checked_mul(lo, es, t, name);
  const std::int64_t hi_b = checked_add(checked_mul(hi, es, t, name), es, t, name);
  const auto base = reinterpret_cast<std::uintptr_t>(t.data);
  return {base + static_cast<std::uintptr_t>(lo_b), base + static_cast<std::uintptr_t>(hi_b)};
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.ndim != b.ndim || dtype_size(a.dtype) != dtype_size(b.dtype)) return false;
  for (int d = 0; d < a.ndim; ++d) {
    const auto i = static_cast<std::size_t>(d);
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
  }
  return true;
}

// An array a call writes, with its byte range computed once: every other array of the
// call must not share memory with it; with allow_identical, the very same view (an
// in-place call such as out=query) is accepted.
class Written {
 public:
  Written(const TensorView& t, const char* name) : t_(t), name_(name), range_(extent(t, name)) {}
  void disjoint_from(const TensorView& other, const char* oname, bool allow_identical = false) const {
    if (range_.lo == range_.hi || (allow_identical && same_view(t_, other))) return;
    const Extent b = extent(other, oname);
    if (b.lo == b.hi) return;
    if (range_.lo < b.hi && b.lo < range_.hi)
      fail<InvalidArgument>(
          name_, " overlaps ", oname, " in memory; ", name_, " must be a separate array",
          allow_identical ? detail::concat(" (or ", oname, " itself, for an in-place call)") : "");
  }

 private:
  const TensorView& t_;
  const char* name_;
  Extent range_;
};

// Every element of an array that is written must have its own memory: with the
// dimensions sorted by stride, each stride must step past everything the smaller ones
// reach (true of every contiguous array and of slices and permutations of one).
void check_no_self_overlap(const TensorView& t, const char* name) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (|stride|, size) of dims with size > 1
  for (int d = 0; d < t.ndim; ++d) {
    const auto i = static_cast<std::size_t>(d);
    if (t.shape[i] == 0) return;
    if (t.shape[i] > 1) dims.emplace_back(t.strides[i] < 0 ? -t.strides[i] : t.strides[i], t.shape[i]);
  }
  std::sort(dims.begin(), dims.end());
  std::int64_t reach = 0;  // largest element offset the smaller dimensions reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach)
      fail<InvalidArgument>(name, ": its elements overlap in memory (shape ", t.shape_str(), ", strides ",
                            strides_str(t), "); every element written needs its own memory");
    reach = checked_add(reach, checked_mul(size - 1, stride, t, name), t, name);
  }
}

int to_int(std::int64_t v, const char* what) {
  if (v > std::numeric_limits<int>::max())
    fail<InvalidArgument>(what, " = ", v, " is too large (at most ", std::numeric_limits<int>::max(), ")");
  return static_cast<int>(v);
}

// Geometry of a paged KV cache pair, read off the arrays.
struct CacheGeometry {
  CacheLayout layout;
  std::int64_t num_blocks;
  std::int64_t num_kv_heads;
  std::int64_t head_size;
  std::int64_t block_size;
  std::int64_t k_block_stride;  // elements between blocks of each cache
  std::int64_t v_block_stride;
};

// What the other arguments of a call say about num_kv_heads: exactly `exact` (cache
// writes: the new keys' dimension 1), or a divisor of `divides` (attention: num_heads).
struct KvHeadsHint {
  std::int64_t exact = 0;
  std::int64_t divides = 0;
  bool fits(std::int64_t k) const {
    if (k <= 0) return false;
    if (exact > 0) return k == exact;
    return divides <= 0 || divides % k == 0;
  }
};

// The layout of a call: the one it names, or (none named) "vllm" for a rank-5 key cache
// and "nhd" for a rank-4 one, as before "hnd" existed. A rank-4 cache is "nhd"
// [N, B, K, D] or "hnd" [N, K, B, D] and only the call can say which; without layout=
// the "nhd" reading is taken, and refused when the other arguments rule it out while
// the "hnd" reading fits them (a cache pair made for "hnd" passed without its layout:
// value_cache of key_cache's shape; other value shapes get their own error).
CacheLayout resolve_layout(const TensorView& key_cache, const TensorView& value_cache,
                           std::optional<CacheLayout> named, const KvHeadsHint& hint) {
  if (named) {
    const CacheLayout l = *named;
    if (std::find(supported::kLayouts.begin(), supported::kLayouts.end(), l) == supported::kLayouts.end())
      fail<InvalidArgument>("layout: got the value ", static_cast<int>(l), ", expected one of ",
                            supported::layouts_str());
    const int want = l == CacheLayout::kVLLM ? 5 : 4;
    if (key_cache.ndim != want)
      fail<InvalidArgument>("key_cache: layout \"", layout_name(l), "\" expects ", want, " dimensions ",
                            l == CacheLayout::kVLLM   ? "[num_blocks, num_kv_heads, head_size/x, block_size, x]"
                            : l == CacheLayout::kNHD ? "[num_blocks, block_size, num_kv_heads, head_size]"
                                                     : "[num_blocks, num_kv_heads, block_size, head_size]",
                            ", got ", key_cache.ndim, " (shape ", key_cache.shape_str(), ")");
    return l;
  }
  if (key_cache.ndim == 5) return CacheLayout::kVLLM;
  if (key_cache.ndim != 4)
    fail<InvalidArgument>("key_cache: expected 5 dimensions (layout \"vllm\": [num_blocks, num_kv_heads, "
                          "head_size/x, block_size, x]) or 4 (layout \"nhd\": [num_blocks, block_size, num_kv_heads, "
                          "head_size], or \"hnd\": [num_blocks, num_kv_heads, block_size, head_size] with "
                          "layout=\"hnd\"), got ",
                          key_cache.ndim, " (shape ", key_cache.shape_str(), ")");
  const std::int64_t s1 = key_cache.size(1), s2 = key_cache.size(2);
  bool pair = value_cache.ndim == 4;
  for (int d = 0; pair && d < 4; ++d) pair = value_cache.size(d) == key_cache.size(d);
  if (pair && !hint.fits(s2) && hint.fits(s1))
    fail<InvalidArgument>(
        "key_cache: shape ", key_cache.shape_str(), " was given without layout=, so it is read as layout \"nhd\" "
        "[num_blocks, block_size, num_kv_heads, head_size], num_kv_heads = ", s2, ", which ",
        hint.exact > 0 ? detail::concat("does not match the new keys' num_kv_heads ", hint.exact)
                       : detail::concat("does not divide num_heads ", hint.divides),
        "; as layout \"hnd\" [num_blocks, num_kv_heads, block_size, head_size] it would fit: pass layout=\"hnd\" "
        "(or layout=\"nhd\" to keep this reading)");
  return CacheLayout::kNHD;
}

CacheGeometry check_caches(const TensorView& key_cache, const TensorView& value_cache, DType dtype,
                           KVCacheDType kv_dtype, std::optional<CacheLayout> named, const KvHeadsHint& hint) {
  const DType cache_dtype = kv_dtype == KVCacheDType::kAuto ? dtype : DType::kUInt8;
  if (key_cache.dtype != cache_dtype || value_cache.dtype != cache_dtype) {
    const TensorView& bad = key_cache.dtype != cache_dtype ? key_cache : value_cache;
    const char* name = key_cache.dtype != cache_dtype ? "key_cache" : "value_cache";
    if (kv_dtype == KVCacheDType::kAuto)
      fail<TypeMismatch>(name, ": dtype ", dtype_name(bad.dtype), " does not match the query/key dtype ",
                         dtype_name(dtype), " (with kv_cache_dtype=\"auto\" the caches share that dtype)");
    fail<TypeMismatch>(name, ": with kv_cache_dtype=\"", kv_cache_dtype_name(kv_dtype),
                       "\" the cache must be a uint8 array, got ", dtype_name(bad.dtype));
  }
  const std::int64_t x = supported::kCacheChunkBytes / static_cast<std::int64_t>(cache_elem_size(dtype, kv_dtype));
  CacheGeometry g{};
  g.layout = resolve_layout(key_cache, value_cache, named, hint);
  if (g.layout == CacheLayout::kVLLM) {
    check_ndim(value_cache, "value_cache", 4, "[num_blocks, num_kv_heads, head_size, block_size] (layout \"vllm\")");
    if (key_cache.size(4) != x)
      fail<InvalidArgument>("key_cache: the last dimension of the \"vllm\" layout must be x = 16 / element size = ", x,
                            ", got ", key_cache.size(4), " (shape ", key_cache.shape_str(), ")");
    g.num_blocks = key_cache.size(0);
    g.num_kv_heads = key_cache.size(1);
    g.head_size = key_cache.size(2) * x;
    g.block_size = key_cache.size(3);
    check_dim(value_cache, "value_cache", 0, g.num_blocks, "num_blocks, as in key_cache");
    check_dim(value_cache, "value_cache", 1, g.num_kv_heads, "num_kv_heads, as in key_cache");
    check_dim(value_cache, "value_cache", 2, g.head_size, "head_size, as in key_cache");
    check_dim(value_cache, "value_cache", 3, g.block_size, "block_size, as in key_cache");
  } else {
    const bool nhd = g.layout == CacheLayout::kNHD;
    check_ndim(value_cache, "value_cache", 4,
               nhd ? "[num_blocks, block_size, num_kv_heads, head_size] (layout \"nhd\")"
                   : "[num_blocks, num_kv_heads, block_size, head_size] (layout \"hnd\")");
    g.num_blocks = key_cache.size(0);
    g.block_size = key_cache.size(nhd ? 1 : 2);
    g.num_kv_heads = key_cache.size(nhd ? 2 : 1);
    g.head_size = key_cache.size(3);
    for (int d = 0; d < 4; ++d)
      if (value_cache.size(d) != key_cache.size(d))
        fail<InvalidArgument>("value_cache: shape ", value_cache.shape_str(), " must equal key_cache's shape ",
                              key_cache.shape_str(), " in the \"", layout_name(g.layout), "\" layout");
  }
  g.k_block_stride = detail::check_block_strided(key_cache, "key_cache").block_stride;
  g.v_block_stride = detail::check_block_strided(value_cache, "value_cache").block_stride;
  if (g.num_kv_heads <= 0) fail<InvalidArgument>("key_cache: num_kv_heads must be positive, got ", g.num_kv_heads);
  if (g.block_size <= 0) fail<InvalidArgument>("key_cache: block_size must be positive, got ", g.block_size);
  if (g.head_size <= 0) fail<InvalidArgument>("key_cache: head_size must be positive, got ", g.head_size);
  return g;
}

void check_cuda_build() {
  if (!built_with_cuda())
    fail<NotSupported>("CUDA arrays are not supported by this build of pagedattn (built without CUDA); "
                       "reinstall on a machine with nvcc, or pass host arrays");
}

void check_cuda_geometry(std::int64_t head_size, std::int64_t block_size) {
  check_cuda_build();
  detail::check_cuda_sizes(head_size, block_size);
}

// ---- CUDA decode launch limits, part 2 (part 1: detail::check_cuda_decode_limits) --------
// A caller's workspace against the bytes the call's plan needs (a device query: CUDA
// builds only, after the workspace's own checks).
void check_cuda_workspace_size(const DecodeParams& p) {
  const std::size_t need = cuda_backend::decode_workspace_bytes(p);
  if (p.workspace_bytes < need)
    fail<InvalidArgument>("workspace: the partitioned kernel needs ", need, " bytes for these shapes, got ",
                          p.workspace_bytes, " (see decode_workspace_size)");
}
// ---- end of part 2 -------------------------------------------------------------------------

void check_host_limits(std::int64_t head_size, std::int64_t block_size) {
  if (head_size > supported::kCpuMaxHeadSize)
    fail<NotSupported>("head_size ", head_size, " is larger than the CPU backend's limit ", supported::kCpuMaxHeadSize);
  if (block_size > supported::kCpuMaxBlockSize)
    fail<NotSupported>("block_size ", block_size, " is larger than the CPU backend's limit ",
                       supported::kCpuMaxBlockSize);
}

}  // namespace

namespace detail {

void check_cuda_sizes(std::int64_t head_size, std::int64_t block_size) {
  if (!supported::is_cuda_head_size(static_cast<int>(head_size)))
    fail<NotSupported>("head_size ", head_size, " is not supported on CUDA; supported: ",
                       supported::cuda_head_sizes_str());
  if (!supported::is_cuda_block_size(static_cast<int>(block_size)))
    fail<NotSupported>("block_size ", block_size, " is not supported on CUDA; supported: ",
                       supported::cuda_block_sizes_str());
}

// ---- CUDA decode launch limits, part 1 (declared in device_checks.hpp) ------------------
// Alignment, grid and partition limits of the CUDA decode kernels that the host can tell
// from the arguments alone; no device query, so checked in every build, before the
// build's own CUDA support. Null cache pointers (a plan query) pass.
void check_cuda_decode_limits(const DecodeParams& p, const TensorView* workspace) {
  constexpr std::uintptr_t kAlign = supported::kCacheChunkBytes;  // the kernels' 16-byte loads
  if (reinterpret_cast<std::uintptr_t>(p.key_cache) % kAlign != 0)
    fail<InvalidArgument>("key_cache: the CUDA kernels need its data to start on a ", kAlign,
                          "-byte boundary, got address ", p.key_cache);
  if (reinterpret_cast<std::uintptr_t>(p.value_cache) % kAlign != 0)
    fail<InvalidArgument>("value_cache: the CUDA kernels need its data to start on a ", kAlign,
                          "-byte boundary, got address ", p.value_cache);
  // Blocks start where the kernels' vector loads may: on 16 bytes, or on 8 for token rows
  // that are themselves only 8-byte multiples (fp8 nhd / hnd rows), as in a contiguous cache.
  const auto ce = static_cast<std::int64_t>(cache_elem_size(p.dtype, p.kv_cache_dtype));
  const std::int64_t block_align =
      p.layout != CacheLayout::kVLLM && p.head_size * ce % static_cast<std::int64_t>(kAlign) != 0
          ? 8
          : static_cast<std::int64_t>(kAlign);
  const std::pair<const char*, std::int64_t> block_strides[] = {{"key_cache", p.k_block_stride},
                                                                {"value_cache", p.v_block_stride}};
  for (const auto& [name, stride] : block_strides)
    if (stride * ce % block_align != 0)
      fail<InvalidArgument>(name, ": the CUDA kernels need a block stride (dimension 0) that is a multiple of ",
                            block_align, " bytes, got ", stride, " elements of ", ce, " bytes");
  constexpr int kMaxSeqs = 65535;  // the grid's z dimension
  if (p.num_seqs > kMaxSeqs)
    fail<NotSupported>("num_seqs: got ", p.num_seqs, ", the CUDA kernels take at most ", kMaxSeqs,
                       " sequences per call (split the batch)");
  if (p.partition_size % planner::kPartitionAlign != 0)
    fail<InvalidArgument>("partition_size: the CUDA kernels need a multiple of ", planner::kPartitionAlign, ", got ",
                          p.partition_size);
  if (workspace && reinterpret_cast<std::uintptr_t>(workspace->data) % kAlign != 0)
    fail<InvalidArgument>("workspace: must start on a ", kAlign, "-byte boundary, got address ", workspace->data);
}
// ---- end of part 1 -------------------------------------------------------------------------

void check_decode_choice(DecodeKernel kernel, int partition_size) {
  if (static_cast<int>(kernel) > static_cast<int>(DecodeKernel::kPartitioned))
    fail<InvalidArgument>("kernel: got the value ", static_cast<int>(kernel),
                          ", expected \"auto\", \"single_pass\" or \"partitioned\"");
  if (partition_size < 0) fail<InvalidArgument>("partition_size: must be >= 0, got ", partition_size);
}

void check_disjoint(const TensorView& written, const char* written_name, const TensorView& other,
                    const char* other_name, bool allow_identical) {
  Written(written, written_name).disjoint_from(other, other_name, allow_identical);
}

BlockStrided check_block_strided(const TensorView& t, const char* name) {
  if (t.ndim < 1) fail<InvalidArgument>(name, ": expected an array of blocks [num_blocks, ...], got a scalar");
  std::int64_t elems = 1;
  bool blocks_contiguous = true;
  std::string want = "]";  // the strides of dims 1.. that a block needs, innermost first
  for (int d = t.ndim - 1; d >= 1; --d) {
    const auto i = static_cast<std::size_t>(d);
    if (t.shape[i] != 1 && t.strides[i] != elems) blocks_contiguous = false;
    want = ", " + std::to_string(elems) + want;
    elems = checked_mul(elems, std::max<std::int64_t>(t.shape[i], 0), t, name);
  }
  const std::int64_t n = t.shape[0];
  BlockStrided b{elems, elems};
  if (n <= 0 || elems == 0) return b;  // no element is ever addressed
  if (n > 1) b.block_stride = t.strides[0];
  if (!blocks_contiguous || b.block_stride < elems)
    fail<InvalidArgument>(name, ": shape ", t.shape_str(), " with strides ", strides_str(t),
                          " (in elements) is not supported; each block (dimensions 1..) must be C-contiguous and "
                          "blocks must not overlap: strides [s", want, " with a block stride s >= ", elems,
                          " (one block's elements), e.g. a C-contiguous array or the key or value half of a "
                          "[num_blocks, 2, ...] allocation");
  const auto es = static_cast<std::int64_t>(std::max<std::size_t>(dtype_size(t.dtype), 1));
  checked_mul(checked_add(checked_mul(n - 1, b.block_stride, t, name), elems, t, name), es, t, name);
  return b;
}

void check_blocks_disjoint(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  const BlockStrided ba = check_block_strided(a, a_name), bb = check_block_strided(b, b_name);
  const auto ea = static_cast<std::int64_t>(std::max<std::size_t>(dtype_size(a.dtype), 1));
  const auto eb = static_cast<std::int64_t>(std::max<std::size_t>(dtype_size(b.dtype), 1));
  const std::int64_t na = a.shape[0], nb = b.shape[0];
  if (na <= 0 || nb <= 0 || ba.block_elems == 0 || bb.block_elems == 0) return;
  const std::int64_t sa = ba.block_stride * ea, sb = bb.block_stride * eb;
  if (na < 2 || nb < 2 || sa != sb) {  // not interleavable: whole ranges
    Written(a, a_name).disjoint_from(b, b_name);
    return;
  }
  // Block i of a covers [i s, i s + La) and block j of b [d + j s, d + j s + Lb), offsets
  // from a's start: they meet when k = i - j has k s in (d - La, d + Lb).
  const std::int64_t la = ba.block_elems * ea, lb = bb.block_elems * eb;
  const auto d = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(b.data) -
                                           reinterpret_cast<std::uintptr_t>(a.data));
  const std::int64_t lo = d - la;  // |d| < 2^62 on every real address space
  const std::int64_t k_lo = (lo >= 0 ? lo / sa : -((-lo + sa - 1) / sa)) + 1;  // floor(lo / s) + 1
  const std::int64_t k = std::max(k_lo, -(nb - 1));
  if (k <= na - 1 && k * sa < d + lb)
    fail<InvalidArgument>(a_name, " overlaps ", b_name, " in memory: a block of one shares bytes with a block of the "
                          "other (block stride ", sa, " bytes, blocks of ", la, " and ", lb, " bytes, ", b_name,
                          " starts ", d, " bytes after ", a_name, "); their blocks must be separate memory, as the "
                          "key and value halves of one [num_blocks, 2, ...] allocation are");
}

}  // namespace detail

void check_decode_shape(const DecodeShape& sh, DeviceKind device, const AttentionOptions& opt) {
  if (sh.num_seqs < 0) fail<InvalidArgument>("num_seqs: must be >= 0, got ", sh.num_seqs);
  if (sh.num_heads <= 0) fail<InvalidArgument>("query: num_heads must be positive, got ", sh.num_heads);
  if (sh.head_size <= 0) fail<InvalidArgument>("query: head_size must be positive, got ", sh.head_size);
  if (sh.num_kv_heads <= 0) fail<InvalidArgument>("key_cache: num_kv_heads must be positive, got ", sh.num_kv_heads);
  if (sh.block_size <= 0) fail<InvalidArgument>("key_cache: block_size must be positive, got ", sh.block_size);
  if (sh.max_blocks_per_seq < 0)
    fail<InvalidArgument>("block_tables: max_blocks_per_seq must be >= 0, got ", sh.max_blocks_per_seq);
  if (static_cast<std::int64_t>(sh.max_blocks_per_seq) * sh.block_size > supported::kMaxContextTokens)
    fail<NotSupported>("block_tables: max_blocks_per_seq ", sh.max_blocks_per_seq, " x block_size ", sh.block_size,
                       " = ", static_cast<std::int64_t>(sh.max_blocks_per_seq) * sh.block_size,
                       " tokens per sequence is more than pagedattn supports (at most max_context_tokens = ",
                       supported::kMaxContextTokens, " = 2^30); pass a block table with fewer columns");
  if (!supported::is_dtype(sh.dtype))
    fail<TypeMismatch>("query: dtype ", dtype_name(sh.dtype), " is not supported; expected one of ",
                       supported::dtypes_str());
  if (sh.num_heads % sh.num_kv_heads != 0)
    fail<InvalidArgument>("num_heads ", sh.num_heads, " (query) must be a multiple of num_kv_heads ", sh.num_kv_heads,
                          " (the caches')");
  if (sh.layout == CacheLayout::kVLLM) {
    const int x = supported::kCacheChunkBytes / static_cast<int>(cache_elem_size(sh.dtype, opt.kv_cache_dtype));
    if (sh.head_size % x != 0)
      fail<InvalidArgument>("head_size ", sh.head_size, " does not fit the \"vllm\" layout, which needs a multiple of "
                            "x = 16 / element size = ", x, " (the \"nhd\" and \"hnd\" layouts take any head size)");
  }
  if (opt.layout && *opt.layout != sh.layout)
    fail<InvalidArgument>("layout: the options name layout \"", layout_name(*opt.layout), "\" but the shape's is \"",
                          layout_name(sh.layout), "\"");
  if (opt.scale && !std::isfinite(*opt.scale)) fail<InvalidArgument>("scale: must be finite, got ", *opt.scale);
  if (opt.sliding_window < 0)
    fail<InvalidArgument>("sliding_window: must be >= 0 (tokens; 0 = off), got ", opt.sliding_window);
  if (!std::isfinite(opt.soft_cap) || opt.soft_cap < 0.0f)
    fail<InvalidArgument>("soft_cap: must be a finite number >= 0 (0 = off), got ", opt.soft_cap);
  // The kernels divide by the cap: a subnormal one has no finite float32 inverse.
  if (opt.soft_cap > 0.0f && opt.soft_cap < std::numeric_limits<float>::min())
    fail<InvalidArgument>("soft_cap: must be 0 (off) or at least ", std::numeric_limits<float>::min(),
                          " (the smallest normal float32), got ", opt.soft_cap);
  if (opt.kv_cache_dtype != KVCacheDType::kAuto) {
    check_positive_scale(opt.k_scale, "k_scale");
    check_positive_scale(opt.v_scale, "v_scale");
  }
  detail::check_decode_choice(opt.kernel, opt.partition_size);
  if (device == DeviceKind::kCUDA)
    detail::check_cuda_sizes(sh.head_size, sh.block_size);
  else
    check_host_limits(sh.head_size, sh.block_size);
}

DecodeParams decode_params_of(const DecodeShape& sh, const AttentionOptions& opt) {
  DecodeParams p;
  p.num_seqs = sh.num_seqs;
  p.num_heads = sh.num_heads;
  p.num_kv_heads = sh.num_kv_heads;
  p.head_size = sh.head_size;
  p.block_size = sh.block_size;
  p.max_blocks_per_seq = sh.max_blocks_per_seq;
  p.scale = opt.scale ? *opt.scale : 1.0f / std::sqrt(static_cast<float>(sh.head_size));
  p.k_scale = opt.k_scale;
  p.v_scale = opt.v_scale;
  p.dtype = sh.dtype;
  p.kv_cache_dtype = opt.kv_cache_dtype;
  p.layout = sh.layout;
  p.kernel = opt.kernel;
  p.partition_size = opt.partition_size;
  p.check_block_tables = opt.check_block_tables;
  p.device_id = sh.device_id;
  p.sliding_window = opt.sliding_window;
  p.soft_cap = opt.soft_cap;
  return p;
}

DecodeParams make_decode_params(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                                const TensorView& value_cache, const TensorView& block_tables,
                                const TensorView& seq_lens, const AttentionOptions& opt) {
  if (query.device == DeviceKind::kOther)
    fail<TypeMismatch>("query: arrays on this device type are not supported (expected cpu or cuda)");
  check_same_device(query, "query", out, "out");
  check_same_device(query, "query", key_cache, "key_cache");
  check_same_device(query, "query", value_cache, "value_cache");
  check_same_device(query, "query", block_tables, "block_tables");
  check_same_device(query, "query", seq_lens, "seq_lens");
  if (opt.alibi_slopes) check_same_device(query, "query", *opt.alibi_slopes, "alibi_slopes");
  if (opt.sinks) check_same_device(query, "query", *opt.sinks, "sinks");
  const TensorView* qsl = opt.query_start_loc ? &*opt.query_start_loc : nullptr;
  if (qsl) check_same_device(query, "query", *qsl, "query_start_loc");

  check_ndim(query, "query", 3, qsl ? "[num_tokens, num_heads, head_size] (with query_start_loc)"
                                    : "[num_seqs, num_heads, head_size]");
  check_float_dtype(query, "query");
  check_last_dim_contiguous(query, "query");
  const std::int64_t H = query.size(1), D = query.size(2);
  std::int64_t S = query.size(0);
  const char* seqs_from = "num_seqs, as in query";
  if (qsl) {
    check_ndim(*qsl, "query_start_loc", 1, "[num_seqs + 1]");
    check_dtype(*qsl, "query_start_loc", DType::kInt32);
    check_contiguous(*qsl, "query_start_loc");
    if (qsl->size(0) < 1)
      fail<InvalidArgument>("query_start_loc: needs num_seqs + 1 >= 1 entries (it starts with 0), got shape ",
                            qsl->shape_str());
    S = qsl->size(0) - 1;
    seqs_from = "num_seqs = len(query_start_loc) - 1";
  }
  if (opt.max_query_len && *opt.max_query_len < 0)
    fail<InvalidArgument>("max_query_len: must be >= 0, got ", *opt.max_query_len);
  if (H <= 0) fail<InvalidArgument>("query: num_heads must be positive, got ", H);
  if (D <= 0) fail<InvalidArgument>("query: head_size must be positive, got ", D);

  const CacheGeometry g =
      check_caches(key_cache, value_cache, query.dtype, opt.kv_cache_dtype, opt.layout, KvHeadsHint{0, H});
  if (g.head_size != D)
    fail<InvalidArgument>("key_cache: head_size ", g.head_size, " does not match the query's head_size ", D);

  check_ndim(block_tables, "block_tables", 2, "[num_seqs, max_blocks_per_seq]");
  check_dtype(block_tables, "block_tables", DType::kInt32);
  check_dim(block_tables, "block_tables", 0, S, seqs_from);
  check_contiguous(block_tables, "block_tables");
  check_ndim(seq_lens, "seq_lens", 1, "[num_seqs]");
  check_dtype(seq_lens, "seq_lens", DType::kInt32);
  check_dim(seq_lens, "seq_lens", 0, S, seqs_from);
  check_contiguous(seq_lens, "seq_lens");

  check_ndim(out, "out", 3, qsl ? "[num_tokens, num_heads, head_size]" : "[num_seqs, num_heads, head_size]");
  if (out.dtype != query.dtype)
    fail<TypeMismatch>("out: dtype ", dtype_name(out.dtype), " must equal the query's dtype ", dtype_name(query.dtype));
  for (int d = 0; d < 3; ++d)
    if (out.size(d) != query.size(d))
      fail<InvalidArgument>("out: shape ", out.shape_str(), " must equal the query's shape ", query.shape_str());
  check_last_dim_contiguous(out, "out");
  check_writable(out, "out");

  if (opt.alibi_slopes) {
    const TensorView& a = *opt.alibi_slopes;
    check_ndim(a, "alibi_slopes", 1, "[num_heads]");
    check_dtype(a, "alibi_slopes", DType::kFloat32);
    check_dim(a, "alibi_slopes", 0, H, "num_heads");
    check_contiguous(a, "alibi_slopes");
  }
  if (opt.sinks) {
    const TensorView& a = *opt.sinks;
    check_ndim(a, "sinks", 1, "[num_heads]");
    check_dtype(a, "sinks", DType::kFloat32);
    check_dim(a, "sinks", 0, H, "num_heads");
    check_contiguous(a, "sinks");
  }
  check_no_self_overlap(out, "out");
  const Written out_w(out, "out");
  out_w.disjoint_from(query, "query", /*allow_identical=*/true);
  out_w.disjoint_from(key_cache, "key_cache");
  out_w.disjoint_from(value_cache, "value_cache");
  out_w.disjoint_from(block_tables, "block_tables");
  out_w.disjoint_from(seq_lens, "seq_lens");
  if (opt.alibi_slopes) out_w.disjoint_from(*opt.alibi_slopes, "alibi_slopes");
  if (opt.sinks) out_w.disjoint_from(*opt.sinks, "sinks");
  if (qsl) out_w.disjoint_from(*qsl, "query_start_loc");

  DecodeShape sh;
  sh.num_seqs = to_int(S, "num_seqs");
  sh.num_heads = to_int(H, "num_heads");
  sh.num_kv_heads = to_int(g.num_kv_heads, "num_kv_heads");
  sh.head_size = to_int(D, "head_size");
  sh.block_size = to_int(g.block_size, "block_size");
  sh.max_blocks_per_seq = to_int(block_tables.size(1), "max_blocks_per_seq");
  sh.dtype = query.dtype;
  sh.layout = g.layout;
  sh.device_id = query.device_id;
  check_decode_shape(sh, query.device, opt);

  DecodeParams p = decode_params_of(sh, opt);
  p.out = out.data;
  p.o_stride_seq = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.query = query.data;
  p.q_stride_seq = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.key_cache = key_cache.data;
  p.value_cache = value_cache.data;
  p.k_block_stride = g.k_block_stride;
  p.v_block_stride = g.v_block_stride;
  p.block_tables = block_tables.ptr<const std::int32_t>();
  p.seq_lens = seq_lens.ptr<const std::int32_t>();
  p.alibi_slopes = opt.alibi_slopes ? opt.alibi_slopes->ptr<const float>() : nullptr;
  p.sinks = opt.sinks ? opt.sinks->ptr<const float>() : nullptr;
  p.num_blocks = g.num_blocks;
  if (qsl) {
    p.query_start_loc = qsl->ptr<const std::int32_t>();
    p.num_tokens = to_int(query.size(0), "num_tokens");
    p.max_query_len = opt.max_query_len ? *opt.max_query_len : -1;
  }

  if (query.device == DeviceKind::kCUDA) {
    detail::check_cuda_decode_limits(p, opt.workspace ? &*opt.workspace : nullptr);
    check_cuda_build();
    if (opt.workspace) {
      const TensorView& ws = *opt.workspace;
      check_same_device(query, "query", ws, "workspace");
      check_contiguous(ws, "workspace");
      check_writable(ws, "workspace");
      const TensorView* inputs[] = {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens};
      const char* names[] = {"out", "query", "key_cache", "value_cache", "block_tables", "seq_lens"};
      const Written ws_w(ws, "workspace");
      for (int i = 0; i < 6; ++i) ws_w.disjoint_from(*inputs[i], names[i]);
      if (opt.alibi_slopes) ws_w.disjoint_from(*opt.alibi_slopes, "alibi_slopes");
      if (opt.sinks) ws_w.disjoint_from(*opt.sinks, "sinks");
      if (qsl) ws_w.disjoint_from(*qsl, "query_start_loc");
      p.workspace = ws.data;
      p.workspace_bytes = static_cast<std::size_t>(ws.numel()) * dtype_size(ws.dtype);
      check_cuda_workspace_size(p);
    }
  } else {
    check_decode_indices(p);
  }
  return p;
}

void check_decode_indices(const DecodeParams& p) {
  // On the host the index arrays can be read: every length and every block id a
  // sequence reaches is checked, so the kernel never reads outside the cache.
  const std::int64_t max_len = static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size;
  for (std::int64_t s = 0; s < p.num_seqs; ++s) {
    const std::int64_t len = p.seq_lens[s];
    if (len < 0 || len > max_len)
      fail<OutOfRange>("seq_lens[", s, "] = ", len, " is outside [0, max_blocks_per_seq * block_size = ", max_len, "]");
    const std::int64_t nb = (len + p.block_size - 1) / p.block_size;
    const std::int32_t* row = p.block_tables + s * p.max_blocks_per_seq;
    // A sliding window leaves the blocks before its first key unread (released ones hold -1).
    std::int64_t first_pos = len - 1;  // the decode query; varlen: the first query row
    if (p.query_start_loc) first_pos = len - (static_cast<std::int64_t>(p.query_start_loc[s + 1]) - p.query_start_loc[s]);
    for (std::int64_t b = window_start(p.sliding_window, first_pos) / p.block_size; b < nb; ++b)
      if (row[b] < 0 || row[b] >= p.num_blocks)
        fail<OutOfRange>("block_tables[", s, ", ", b, "] = ", row[b], " is outside [0, num_blocks = ", p.num_blocks,
                         ") (sequence ", s, " has length ", len, ")");
  }
  if (p.query_start_loc) check_query_start_loc(p);
}

void check_query_start_loc(const DecodeParams& p) {
  const std::int32_t* qsl = p.query_start_loc;
  if (qsl[0] != 0) fail<InvalidArgument>("query_start_loc[0]: must be 0, got ", qsl[0]);
  for (std::int64_t s = 0; s < p.num_seqs; ++s) {
    const std::int64_t q = static_cast<std::int64_t>(qsl[s + 1]) - qsl[s];
    if (q < 0)
      fail<InvalidArgument>("query_start_loc: must be non-decreasing, got query_start_loc[", s, "] = ", qsl[s],
                            " > query_start_loc[", s + 1, "] = ", qsl[s + 1]);
    if (q > p.seq_lens[s])
      fail<InvalidArgument>("query_start_loc: sequence ", s, " has ", q, " query rows (query_start_loc[", s + 1,
                            "] - query_start_loc[", s, "]) but seq_lens[", s, "] = ", p.seq_lens[s],
                            "; a sequence's query rows are its last tokens, at most seq_len of them");
    if (p.max_query_len >= 0 && q > p.max_query_len)
      fail<InvalidArgument>("max_query_len: ", p.max_query_len, " is smaller than sequence ", s, "'s ", q,
                            " query rows (query_start_loc[", s + 1, "] - query_start_loc[", s, "])");
  }
  if (qsl[p.num_seqs] != p.num_tokens)
    fail<InvalidArgument>("query_start_loc[", p.num_seqs, "]: must equal the query's num_tokens ", p.num_tokens,
                          ", got ", qsl[p.num_seqs]);
}

CacheWriteParams make_cache_write_params(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                                         const TensorView& value_cache, const TensorView& slot_mapping,
                                         const CacheWriteOptions& opt) {
  if (key.device == DeviceKind::kOther)
    fail<TypeMismatch>("key: arrays on this device type are not supported (expected cpu or cuda)");
  check_same_device(key, "key", value, "value");
  check_same_device(key, "key", key_cache, "key_cache");
  check_same_device(key, "key", value_cache, "value_cache");
  check_same_device(key, "key", slot_mapping, "slot_mapping");

  check_ndim(key, "key", 3, "[num_tokens, num_kv_heads, head_size]");
  check_ndim(value, "value", 3, "[num_tokens, num_kv_heads, head_size]");
  check_float_dtype(key, "key");
  if (value.dtype != key.dtype)
    fail<TypeMismatch>("value: dtype ", dtype_name(value.dtype), " must equal key's dtype ", dtype_name(key.dtype));
  for (int d = 0; d < 3; ++d)
    if (value.size(d) != key.size(d))
      fail<InvalidArgument>("value: shape ", value.shape_str(), " must equal key's shape ", key.shape_str());
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");
  const std::int64_t T = key.size(0);

  const CacheGeometry g =
      check_caches(key_cache, value_cache, key.dtype, opt.kv_cache_dtype, opt.layout, KvHeadsHint{key.size(1), 0});
  if (key.size(1) != g.num_kv_heads)
    fail<InvalidArgument>("key: num_kv_heads ", key.size(1), " does not match the caches' num_kv_heads ",
                          g.num_kv_heads);
  if (key.size(2) != g.head_size)
    fail<InvalidArgument>("key: head_size ", key.size(2), " does not match the caches' head_size ", g.head_size);

  check_ndim(slot_mapping, "slot_mapping", 1, "[num_tokens]");
  if (slot_mapping.dtype != DType::kInt32 && slot_mapping.dtype != DType::kInt64)
    fail<TypeMismatch>("slot_mapping: expected dtype int32 or int64, got ", dtype_name(slot_mapping.dtype));
  check_dim(slot_mapping, "slot_mapping", 0, T, "num_tokens, as in key");
  check_contiguous(slot_mapping, "slot_mapping");
  if (opt.kv_cache_dtype != KVCacheDType::kAuto) {
    check_positive_scale(opt.k_scale, "k_scale");
    check_positive_scale(opt.v_scale, "v_scale");
  }
  check_writable(key_cache, "key_cache");
  check_writable(value_cache, "value_cache");
  const Written kc_w(key_cache, "key_cache"), vc_w(value_cache, "value_cache");
  detail::check_blocks_disjoint(value_cache, "value_cache", key_cache, "key_cache");
  for (const Written* cache : {&kc_w, &vc_w}) {
    cache->disjoint_from(key, "key");
    cache->disjoint_from(value, "value");
    cache->disjoint_from(slot_mapping, "slot_mapping");
  }

  CacheWriteParams p;
  p.key = key.data;
  p.k_stride_tok = key.stride(0);
  p.k_stride_head = key.stride(1);
  p.value = value.data;
  p.v_stride_tok = value.stride(0);
  p.v_stride_head = value.stride(1);
  p.key_cache = key_cache.data;
  p.value_cache = value_cache.data;
  p.k_block_stride = g.k_block_stride;
  p.v_block_stride = g.v_block_stride;
  p.slot_mapping = slot_mapping.data;
  p.slot_mapping_int64 = slot_mapping.dtype == DType::kInt64;
  p.num_tokens = T;
  p.num_kv_heads = to_int(g.num_kv_heads, "num_kv_heads");
  p.head_size = to_int(g.head_size, "head_size");
  p.block_size = to_int(g.block_size, "block_size");
  p.num_blocks = g.num_blocks;
  p.k_scale = opt.k_scale;
  p.v_scale = opt.v_scale;
  p.dtype = key.dtype;
  p.kv_cache_dtype = opt.kv_cache_dtype;
  p.layout = g.layout;
  p.device_id = key.device_id;

  if (key.device == DeviceKind::kCUDA) {
    check_cuda_geometry(g.head_size, g.block_size);
  } else {
    check_host_limits(g.head_size, g.block_size);
    const std::int64_t num_slots = g.num_blocks * g.block_size;
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t s = p.slot_mapping_int64 ? static_cast<const std::int64_t*>(p.slot_mapping)[t]
                                                  : static_cast<const std::int32_t*>(p.slot_mapping)[t];
      if (s >= num_slots)
        fail<OutOfRange>("slot_mapping[", t, "] = ", s, " is outside [0, num_blocks * block_size = ", num_slots,
                         ") (negative slots mark padding and are skipped)");
    }
  }
  return p;
}

CacheShapes kv_cache_shape(std::int64_t num_blocks, std::int64_t block_size, std::int64_t num_kv_heads,
                           std::int64_t head_size, std::size_t elem_size, CacheLayout layout) {
  if (num_blocks < 0) fail<InvalidArgument>("num_blocks: must be >= 0, got ", num_blocks);
  if (block_size <= 0) fail<InvalidArgument>("block_size: must be positive, got ", block_size);
  if (num_kv_heads <= 0) fail<InvalidArgument>("num_kv_heads: must be positive, got ", num_kv_heads);
  if (head_size <= 0) fail<InvalidArgument>("head_size: must be positive, got ", head_size);
  if (elem_size != 1 && elem_size != 2 && elem_size != 4)
    fail<InvalidArgument>("dtype: element size ", elem_size, " bytes is not supported (1, 2 or 4)");
  // Refuse a geometry no array can have (more than 2^63 bytes) instead of returning it.
  std::int64_t bytes = static_cast<std::int64_t>(elem_size);
  for (const std::int64_t n : {num_blocks, block_size, num_kv_heads, head_size}) {
    if (n != 0 && bytes > std::numeric_limits<std::int64_t>::max() / n)
      fail<InvalidArgument>("kv_cache_shape: num_blocks ", num_blocks, " x block_size ", block_size,
                            " x num_kv_heads ", num_kv_heads, " x head_size ", head_size, " x ", elem_size,
                            " bytes exceeds 2^63 bytes");
    bytes *= n;
  }
  CacheShapes s;
  if (layout == CacheLayout::kVLLM) {
    const auto x = static_cast<std::int64_t>(supported::kCacheChunkBytes / elem_size);
    if (head_size % x != 0)
      fail<InvalidArgument>("head_size: the \"vllm\" layout needs a multiple of x = 16 / element size = ", x, ", got ",
                            head_size, " (the \"nhd\" and \"hnd\" layouts take any head size)");
    s.key_ndim = 5;
    s.value_ndim = 4;
    s.key = {num_blocks, num_kv_heads, head_size / x, block_size, x};
    s.value = {num_blocks, num_kv_heads, head_size, block_size, 0};
  } else if (layout == CacheLayout::kNHD) {
    s.key_ndim = 4;
    s.value_ndim = 4;
    s.key = {num_blocks, block_size, num_kv_heads, head_size};
    s.value = s.key;
  } else if (layout == CacheLayout::kHND) {
    s.key_ndim = 4;
    s.value_ndim = 4;
    s.key = {num_blocks, num_kv_heads, block_size, head_size};
    s.value = s.key;
  } else {
    fail<InvalidArgument>("layout: got the value ", static_cast<int>(layout), ", expected one of ",
                          supported::layouts_str());
  }
  return s;
}

}  // namespace pagedattn
