// Python bindings of the KV block manager (pagedattn.BlockManager).
//
// Integer arguments (token ids, sequence ids, query lengths) accept a Python sequence of
// ints or a 1-D integer array of any DLPack/buffer-protocol host framework; contiguous
// int32 token ids and int64 sequence ids are read in place. Outputs are new NumPy arrays
// or caller-provided host arrays (any DLPack array) that the core validates and fills.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "bindings.hpp"
#include "call_args.hpp"
#include "call_options.hpp"
#include "ndarray.hpp"
#include "pagedattn/block_manager.hpp"

namespace pagedattn::py {
namespace {

using namespace nb::literals;

// ---------------------------------------------------------------------------------------
// Integer array arguments
// ---------------------------------------------------------------------------------------
template <class T>
struct IntArg {
  const T* ptr = nullptr;
  std::int64_t size = 0;
  std::vector<T> store;  // used when the input cannot be read in place
  nb::ndarray<nb::ro> keep;
};

// The width of a new block table: the widest table in the batch, or max_blocks, which may
// pad up to the pool size (or the widest table, when that is wider: released sliding-window
// entries count). Checked before anything is allocated, so an extreme max_blocks is a
// ValueError, never an allocation of gigabytes.
std::int64_t table_width(const BlockManager& m, std::int64_t widest, std::optional<std::int64_t> max_blocks,
                         const char* what) {
  if (!max_blocks) return widest;
  if (*max_blocks < widest)
    fail<InvalidArgument>(what, ": max_blocks = ", *max_blocks, " is smaller than the widest block table (",
                          widest, ")");
  const std::int64_t limit = std::max(widest, m.num_blocks());
  if (*max_blocks > limit)
    fail<InvalidArgument>(what, ": max_blocks = ", *max_blocks, " is larger than ", limit,
                          " (the pool's num_blocks, or the widest block table when wider)");
  return *max_blocks;
}

template <class T>
bool fits(long long v) {
  return v >= static_cast<long long>(std::numeric_limits<T>::min()) &&
         v <= static_cast<long long>(std::numeric_limits<T>::max());
}

template <class T, class S>
void copy_strided(IntArg<T>& a, const S* src, std::int64_t n, std::int64_t stride, const char* what,
                  const char* name) {
  a.store.resize(static_cast<std::size_t>(n));
  if constexpr (std::is_signed_v<S> && sizeof(S) > sizeof(T)) {
    if (stride == 1) {  // e.g. int64 token ids: one branch-free pass, the checks below only on failure
      bool ok = true;
      T* dst = a.store.data();
      for (std::int64_t i = 0; i < n; ++i) {
        const S v = src[i];
        dst[i] = static_cast<T>(v);
        ok &= static_cast<S>(static_cast<T>(v)) == v;
      }
      if (ok) {
        a.ptr = a.store.data();
        a.size = n;
        return;
      }
    }
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const S v = src[i * stride];
    if constexpr (std::is_unsigned_v<S>) {
      if (static_cast<unsigned long long>(v) > static_cast<unsigned long long>(std::numeric_limits<T>::max()))
        fail<InvalidArgument>(what, ": ", name, "[", i, "] = ", static_cast<unsigned long long>(v),
                              " does not fit in ", sizeof(T) * 8, "-bit signed integers");
    } else if constexpr (sizeof(S) > sizeof(T)) {
      if (!fits<T>(static_cast<long long>(v)))
        fail<InvalidArgument>(what, ": ", name, "[", i, "] = ", static_cast<long long>(v), " does not fit in ",
                              sizeof(T) * 8, "-bit signed integers");
    }
    a.store[static_cast<std::size_t>(i)] = static_cast<T>(v);
  }
  a.ptr = a.store.data();
  a.size = n;
}

// The value of an exact int that CPython stores in one digit (|v| < 2^30: every token id in
// practice), read without a call; false for anything else (the caller takes the general path).
inline bool compact_int(PyObject* o, long long* v) {
#if defined(Py_LIMITED_API)
  (void)o;
  (void)v;
  return false;
#elif PY_VERSION_HEX >= 0x030C0000
  if (!PyLong_CheckExact(o) || !PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(o))) return false;
  *v = static_cast<long long>(PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(o)));
  return true;
#else
  if (!PyLong_CheckExact(o)) return false;
  const Py_ssize_t size = Py_SIZE(o);
  if (size < -1 || size > 1) return false;
  *v = static_cast<long long>(size) * static_cast<long long>(reinterpret_cast<PyLongObject*>(o)->ob_digit[0]);
  return true;
#endif
}

// Reads a 1-D integer argument into T (int32 for token ids, int64 for ids and lengths).
template <class T>
IntArg<T> int_arg_from_array(const nb::ndarray<nb::ro>& arr, const char* what, const char* name);
template <class T>
IntArg<T> int_arg_from_sequence(nb::handle h, const char* what, const char* name);

template <class T>
IntArg<T> int_arg(nb::handle h, const char* what, const char* name) {
  IntArg<T> a;
  nb::ndarray<nb::ro> arr;
  if (!PyList_Check(h.ptr()) && !PyTuple_Check(h.ptr()) && nb::try_cast(h, arr, false))
    return int_arg_from_array<T>(arr, what, name);
  return int_arg_from_sequence<T>(h, what, name);
}

// A 1-D host integer array (any width, any stride): read in place when it already holds T
// contiguously, else converted with range checks.
template <class T>
IntArg<T> int_arg_from_array(const nb::ndarray<nb::ro>& arr, const char* what, const char* name) {
  IntArg<T> a;
  {
    if (arr.device_type() != nb::device::cpu::value)
      fail<TypeMismatch>(what, ": ", name, " must be a host (CPU) array");
    if (arr.ndim() != 1) fail<InvalidArgument>(what, ": ", name, " must be 1-D, got ", arr.ndim(), " dimensions");
    const nb::dlpack::dtype dt = arr.dtype();
    const auto n = static_cast<std::int64_t>(arr.shape(0));
    const std::int64_t st = arr.stride(0);
    const void* p = arr.data();
    const bool is_int = dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int);
    const bool is_uint = dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::UInt);
    if (dt.lanes != 1 || !(is_int || is_uint))
      fail<TypeMismatch>(what, ": ", name, " must hold integers (int32 or int64), got an array of ",
                         dtype_name(detail::dtype_from_dlpack(dt.code, dt.bits, dt.lanes)) ,
                         " (code ", int(dt.code), ", ", int(dt.bits), " bits)");
    if (is_int && dt.bits == sizeof(T) * 8 && (st == 1 || n <= 1)) {
      a.ptr = static_cast<const T*>(p);
      a.size = n;
      a.keep = arr;
      return a;
    }
    switch ((is_int ? 0 : 100) + dt.bits) {
      case 8: copy_strided(a, static_cast<const std::int8_t*>(p), n, st, what, name); break;
      case 16: copy_strided(a, static_cast<const std::int16_t*>(p), n, st, what, name); break;
      case 32: copy_strided(a, static_cast<const std::int32_t*>(p), n, st, what, name); break;
      case 64: copy_strided(a, static_cast<const std::int64_t*>(p), n, st, what, name); break;
      case 108: copy_strided(a, static_cast<const std::uint8_t*>(p), n, st, what, name); break;
      case 116: copy_strided(a, static_cast<const std::uint16_t*>(p), n, st, what, name); break;
      case 132: copy_strided(a, static_cast<const std::uint32_t*>(p), n, st, what, name); break;
      case 164: copy_strided(a, static_cast<const std::uint64_t*>(p), n, st, what, name); break;
      default: fail<TypeMismatch>(what, ": ", name, " has an unsupported integer width of ", int(dt.bits), " bits");
    }
    return a;
  }
}

// A Python sequence of ints (lists, tuples, ranges, NumPy integer scalars).
template <class T>
IntArg<T> int_arg_from_sequence(nb::handle h, const char* what, const char* name) {
  IntArg<T> a;
  if (PyLong_Check(h.ptr()) || PyUnicode_Check(h.ptr()) || PyBytes_Check(h.ptr()))
    fail<TypeMismatch>(what, ": ", name, " must be a sequence of ints or a 1-D integer array, got ",
                       nb::inst_name(h).c_str());
  PyObject* seq = PySequence_Fast(h.ptr(), "");
  if (!seq) {
    PyErr_Clear();
    fail<TypeMismatch>(what, ": ", name, " must be a sequence of ints or a 1-D integer array, got ",
                       nb::inst_name(h).c_str());
  }
  nb::object guard = nb::steal(seq);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  a.store.resize(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    long long v;
    if (compact_int(item, &v)) {
      a.store[static_cast<std::size_t>(i)] = static_cast<T>(v);  // |v| < 2^30 fits in T
      continue;
    }
    if (PyLong_Check(item)) {
      v = PyLong_AsLongLong(item);
    } else if (!PyFloat_Check(item) && PyIndex_Check(item)) {  // NumPy integer scalars
      nb::object idx = nb::steal(PyNumber_Index(item));
      if (!idx.is_valid()) throw nb::python_error();
      v = PyLong_AsLongLong(idx.ptr());
    } else {
      fail<TypeMismatch>(what, ": ", name, "[", static_cast<long long>(i), "] must be an int, got ",
                         nb::inst_name(item).c_str());
    }
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      fail<InvalidArgument>(what, ": ", name, "[", static_cast<long long>(i), "] does not fit in 64 bits");
    }
    if (!fits<T>(v))
      fail<InvalidArgument>(what, ": ", name, "[", static_cast<long long>(i), "] = ", v, " does not fit in ",
                            sizeof(T) * 8, "-bit signed integers");
    a.store[static_cast<std::size_t>(i)] = static_cast<T>(v);
  }
  a.ptr = a.store.data();
  a.size = static_cast<std::int64_t>(n);
  return a;
}

// Token ids for admission: a contiguous host int64 array is handed to the core as it is (the
// core narrows it in one pass); everything else goes through int_arg as int32.
struct TokenArg {
  const std::int64_t* p64 = nullptr;
  IntArg<std::int32_t> i32;
  nb::ndarray<nb::ro> keep;
  std::int64_t size = 0;
};

TokenArg token_arg(nb::handle h, const char* what) {
  TokenArg t;
  if (!PyList_Check(h.ptr()) && !PyTuple_Check(h.ptr()) && nb::try_cast(h, t.keep, false)) {
    const nb::dlpack::dtype dt = t.keep.dtype();
    if (t.keep.device_type() == nb::device::cpu::value && t.keep.ndim() == 1 && dt.lanes == 1 &&
        dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Int) && dt.bits == 64 &&
        (t.keep.stride(0) == 1 || t.keep.shape(0) <= 1)) {
      t.p64 = static_cast<const std::int64_t*>(t.keep.data());
      t.size = static_cast<std::int64_t>(t.keep.shape(0));
      return t;
    }
    t.i32 = int_arg_from_array<std::int32_t>(t.keep, what, "token_ids");  // cast once
    t.size = t.i32.size;
    return t;
  }
  t.i32 = int_arg_from_sequence<std::int32_t>(h, what, "token_ids");
  t.size = t.i32.size;
  return t;
}

// ---------------------------------------------------------------------------------------
// New NumPy arrays
// ---------------------------------------------------------------------------------------
template <class T>
nb::object new_array(std::initializer_list<std::size_t> shape, T** data) {
  std::size_t n = 1;
  for (std::size_t s : shape) n *= s;
  T* p = new T[n ? n : 1];
  nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<T*>(q); });
  *data = p;
  return nb::ndarray<nb::numpy, T>(p, shape, owner).cast();
}

nb::object pairs_array(const BlockManager::BlockPairs& pairs) {
  std::int64_t* p = nullptr;
  nb::object a = new_array<std::int64_t>({pairs.size(), 2}, &p);
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    p[2 * i] = pairs[i].first;
    p[2 * i + 1] = pairs[i].second;
  }
  return a;
}

// An output argument: the caller's array (validated by the core) or a new int32/int64 array.
struct Out {
  nb::object obj;
  TensorView view;
  bool given = false;
};

template <class T>
Out out_arg(const nb::object& given, std::initializer_list<std::size_t> shape, DType dt, const char* name = "out") {
  Out o;
  if (!given.is_none()) {
    refuse_immutable(given, name);
    AnyMutArray arr;
    if (!nb::try_cast(given, arr, false))
      fail<TypeMismatch>("output arrays must be writable DLPack / buffer-protocol arrays, got ",
                         nb::inst_name(given).c_str());
    o.view = to_view(arr);
    o.obj = given;
    o.given = true;
    return o;
  }
  T* p = nullptr;
  o.obj = new_array<T>(shape, &p);
  std::vector<std::int64_t> dims(shape.begin(), shape.end());
  o.view.data = p;
  o.view.dtype = dt;
  o.view.device = DeviceKind::kCPU;
  o.view.ndim = static_cast<int>(dims.size());
  std::int64_t stride = 1;
  for (int i = o.view.ndim - 1; i >= 0; --i) {
    o.view.shape[static_cast<std::size_t>(i)] = dims[static_cast<std::size_t>(i)];
    o.view.strides[static_cast<std::size_t>(i)] = stride;
    stride *= dims[static_cast<std::size_t>(i)];
  }
  return o;
}

// ---------------------------------------------------------------------------------------
// StepMetadata
// ---------------------------------------------------------------------------------------
struct StepMetadata {
  nb::object block_tables, seq_lens, context_lens, query_start_loc, slot_mapping, copy_pairs;
  std::int64_t num_seqs = 0, num_tokens = 0, max_seq_len = 0, max_query_len = 0;
};

nb::object empty_pairs() {
  static nb::object* cached = nullptr;  // one shared read-only (0, 2) array
  if (!cached) {
    std::int64_t* p = nullptr;
    nb::object a = new_array<std::int64_t>({0, 2}, &p);
    a.attr("flags").attr("writeable") = false;
    cached = new nb::object(a);
  }
  return *cached;
}

// The request of a step() / step_into() call of `fn`, with the converted id, token and
// query-length arrays it points into (so it is neither copied nor moved).
struct StepArgs {
  IntArg<std::int64_t> ids;
  IntArg<std::int32_t> toks;
  IntArg<std::int64_t> qlens;
  StepRequest req;

  StepArgs(const char* fn, nb::handle seq_ids, nb::handle token_ids, nb::handle query_lens)
      : ids(int_arg<std::int64_t>(seq_ids, fn, "seq_ids")) {
    req.seq_ids = ids.ptr;
    req.num_seqs = ids.size;
    if (!token_ids.is_none()) {
      toks = int_arg<std::int32_t>(token_ids, fn, "token_ids");
      if (toks.size != ids.size)
        fail<InvalidArgument>(fn, ": token_ids has ", toks.size, " entries for ", ids.size,
                              " sequences (one new token per sequence)");
      req.new_tokens = toks.ptr;
    }
    if (!query_lens.is_none()) {
      qlens = int_arg<std::int64_t>(query_lens, fn, "query_lens");
      if (qlens.size != ids.size)
        fail<InvalidArgument>(fn, ": query_lens has ", qlens.size, " entries for ", ids.size, " sequences");
      req.query_lens = qlens.ptr;
    }
  }
  StepArgs(const StepArgs&) = delete;
  StepArgs& operator=(const StepArgs&) = delete;
};

// The StepMetadata of a finished step: its output objects (block_tables, seq_lens,
// context_lens, query_start_loc, slot_mapping), the pending copy pairs and the sizes.
StepMetadata step_metadata(BlockManager& m, const StepShape& shape, std::array<nb::object, 5> outputs) {
  StepMetadata md;
  md.block_tables = std::move(outputs[0]);
  md.seq_lens = std::move(outputs[1]);
  md.context_lens = std::move(outputs[2]);
  md.query_start_loc = std::move(outputs[3]);
  md.slot_mapping = std::move(outputs[4]);
  if (m.num_pending_copies() == 0) {
    md.copy_pairs = empty_pairs();
  } else {
    BlockManager::BlockPairs pairs;
    m.take_copy_pairs(pairs);
    md.copy_pairs = pairs_array(pairs);
  }
  md.num_seqs = shape.num_seqs;
  md.num_tokens = shape.num_tokens;
  md.max_seq_len = shape.max_seq_len;
  md.max_query_len = shape.max_query_len;
  return md;
}

StepMetadata run_step(BlockManager& m, nb::handle seq_ids, nb::handle token_ids, nb::handle query_lens,
                      const nb::object& block_tables, const nb::object& seq_lens, const nb::object& context_lens,
                      const nb::object& query_start_loc, const nb::object& slot_mapping,
                      std::optional<std::int64_t> max_blocks, std::int32_t pad) {
  const StepArgs args("step", seq_ids, token_ids, query_lens);
  const StepRequest& req = args.req;
  const StepShape shape = m.plan_step(req);
  const std::int64_t width = table_width(m, shape.max_blocks, max_blocks, "step");
  const auto n = static_cast<std::size_t>(shape.num_seqs);
  Out bt = out_arg<std::int32_t>(block_tables, {n, static_cast<std::size_t>(width)}, DType::kInt32, "block_tables");
  Out sl = out_arg<std::int32_t>(seq_lens, {n}, DType::kInt32, "seq_lens");
  Out cl = out_arg<std::int32_t>(context_lens, {n}, DType::kInt32, "context_lens");
  Out qs = out_arg<std::int32_t>(query_start_loc, {n + 1}, DType::kInt32, "query_start_loc");
  Out sm = out_arg<std::int64_t>(slot_mapping, {static_cast<std::size_t>(shape.num_tokens)}, DType::kInt64,
                                 "slot_mapping");
  StepOutputs out;
  out.block_tables = &bt.view;
  out.seq_lens = &sl.view;
  out.context_lens = &cl.view;
  out.query_start_loc = &qs.view;
  out.slot_mapping = &sm.view;
  out.pad = pad;
  m.step(req, out);

  return step_metadata(m, shape, {bt.obj, sl.obj, cl.obj, qs.obj, sm.obj});
}

// step_into: the caller's persistent buffers, filled up to their capacity; no new arrays
// apart from copy_pairs when copies are pending. Outputs not given are not written.
StepMetadata run_step_into(BlockManager& m, nb::handle seq_ids, nb::handle token_ids, nb::handle query_lens,
                           const nb::object& block_tables, const nb::object& seq_lens,
                           const nb::object& context_lens, const nb::object& query_start_loc,
                           const nb::object& slot_mapping, std::int32_t pad, bool incremental) {
  const StepArgs args("step_into", seq_ids, token_ids, query_lens);
  const StepRequest& req = args.req;
  TensorView views[5];
  const nb::object* given[5] = {&block_tables, &seq_lens, &context_lens, &query_start_loc, &slot_mapping};
  static const char* const names[5] = {"block_tables", "seq_lens", "context_lens", "query_start_loc",
                                       "slot_mapping"};
  const TensorView* ptrs[5] = {};
  for (int k = 0; k < 5; ++k) {
    if (given[k]->is_none()) continue;
    refuse_immutable(*given[k], names[k]);
    AnyMutArray arr;
    if (!nb::try_cast(*given[k], arr, false))
      fail<TypeMismatch>("step_into: ", names[k], " must be a writable DLPack / buffer-protocol array, got ",
                         nb::inst_name(*given[k]).c_str());
    views[k] = to_view(arr);
    ptrs[k] = &views[k];
  }
  StepOutputs out;
  out.block_tables = ptrs[0];
  out.seq_lens = ptrs[1];
  out.context_lens = ptrs[2];
  out.query_start_loc = ptrs[3];
  out.slot_mapping = ptrs[4];
  out.pad = pad;
  out.persistent = true;
  out.incremental = incremental;
  const StepShape shape = m.step(req, out);

  return step_metadata(m, shape, {block_tables, seq_lens, context_lens, query_start_loc, slot_mapping});
}

std::vector<std::int32_t> table_list(const BlockManager& m, std::int64_t seq_id) { return m.block_table(seq_id); }

}  // namespace

void bind_block_manager(nb::module_& m) {
  nb::class_<StepMetadata>(m, "StepMetadata",
                           "Everything a forward pass needs for one step (see BlockManager.step; step_into\n"
                           "returns the caller's buffers here, None where none was given).\n\n"
                           "Arrays: block_tables int32 [S, M] (padded), seq_lens int32 [S] (context + query),\n"
                           "context_lens int32 [S] (tokens computed before the step), query_start_loc int32 [S+1],\n"
                           "slot_mapping int64 [T] (slot of every scheduled token, sequence by sequence),\n"
                           "copy_pairs int64 [P, 2] (copy-on-write (src, dst) blocks; run copy_blocks before the\n"
                           "forward pass). Ints: num_seqs, num_tokens (T), max_seq_len, max_query_len.")
      .def_ro("block_tables", &StepMetadata::block_tables)
      .def_ro("seq_lens", &StepMetadata::seq_lens)
      .def_ro("context_lens", &StepMetadata::context_lens)
      .def_ro("query_start_loc", &StepMetadata::query_start_loc)
      .def_ro("slot_mapping", &StepMetadata::slot_mapping)
      .def_ro("copy_pairs", &StepMetadata::copy_pairs)
      .def_ro("num_seqs", &StepMetadata::num_seqs)
      .def_ro("num_tokens", &StepMetadata::num_tokens)
      .def_ro("max_seq_len", &StepMetadata::max_seq_len)
      .def_ro("max_query_len", &StepMetadata::max_query_len)
      .def("__repr__", [](const StepMetadata& s) {
        return nb::str("StepMetadata(num_seqs={}, num_tokens={}, max_seq_len={}, max_query_len={}, copies={})")
            .format(s.num_seqs, s.num_tokens, s.max_seq_len, s.max_query_len, nb::len(s.copy_pairs));
      });

  nb::class_<PrefixPeek>(m, "PrefixPeek",
                         "What add_sequence would find in the prefix cache for a prompt (BlockManager.peek_prefix):\n"
                         "cached_tokens (its return value), new_blocks (blocks it would take from the pool),\n"
                         "reused_cached_blocks (hit blocks now evictable), fits (whether it would succeed now).")
      .def_ro("cached_tokens", &PrefixPeek::cached_tokens)
      .def_ro("new_blocks", &PrefixPeek::new_blocks)
      .def_ro("reused_cached_blocks", &PrefixPeek::reused_cached_blocks)
      .def_ro("fits", &PrefixPeek::fits)
      .def("__repr__", [](const PrefixPeek& p) {
        return nb::str("PrefixPeek(cached_tokens={}, new_blocks={}, reused_cached_blocks={}, fits={})")
            .format(p.cached_tokens, p.new_blocks, p.reused_cached_blocks, p.fits);
      });

  nb::class_<BlockManager>(
      m, "BlockManager",
      "Host-side KV block manager: block pool with reference counts, fork with copy-on-write,\n"
      "optional automatic prefix caching with LRU eviction, swapping to a CPU pool, sliding-window\n"
      "release, and fast export of block tables / slot mappings for a batch of sequences.\n\n"
      "Errors: unknown sequence id (also a double free) -> KeyError; duplicate id, a sequence in the\n"
      "wrong state, bad lengths, an output array sharing memory with an input or another output ->\n"
      "ValueError; non-integer token ids -> TypeError; not enough blocks -> OutOfBlocksError. A call\n"
      "that raises leaves the manager unchanged. Prefix-cache hits are exact (token ids, any int32,\n"
      "are compared along the whole prefix; a hash collision can never give a hit). Not thread-safe: calls hold\n"
      "the GIL, so Python threads are serialized; do not share one manager across free-threaded code.")
      .def(
          "__init__",
          [](BlockManager* self, std::int64_t num_blocks, std::int64_t block_size, bool enable_prefix_caching,
             std::int64_t num_cpu_blocks, double watermark, std::int64_t sliding_window) {
            BlockManagerOptions o;
            o.num_blocks = num_blocks;
            o.block_size = block_size;
            o.enable_prefix_caching = enable_prefix_caching;
            o.num_cpu_blocks = num_cpu_blocks;
            o.watermark = watermark;
            o.sliding_window = sliding_window;
            new (self) BlockManager(o);
          },
          "num_blocks"_a, "block_size"_a, nb::kw_only(), "enable_prefix_caching"_a = false, "num_cpu_blocks"_a = 0,
          "watermark"_a = 0.0, "sliding_window"_a = 0,
          "A pool of num_blocks blocks of block_size tokens. watermark: share of num_blocks kept\n"
          "available when admitting (add_sequence, swap_in). sliding_window: tokens (0 = off).")
      // ---- configuration
      .def_prop_ro("block_size", &BlockManager::block_size)
      .def_prop_ro("num_blocks", &BlockManager::num_blocks)
      .def_prop_ro("num_cpu_blocks", &BlockManager::num_cpu_blocks)
      .def_prop_ro("watermark_blocks", &BlockManager::watermark_blocks, "Blocks kept available at admission.")
      .def_prop_ro("enable_prefix_caching", [](const BlockManager& b) { return b.options().enable_prefix_caching; })
      .def_prop_ro("sliding_window", [](const BlockManager& b) { return b.options().sliding_window; })
      // ---- counts
      .def_prop_ro("num_free_blocks", &BlockManager::num_free_blocks,
                   "Blocks on the free list (held by no sequence and caching nothing).")
      .def_prop_ro("num_cached_blocks", &BlockManager::num_cached_blocks,
                   "Evictable blocks: held by no sequence, kept for prefix-cache reuse.")
      .def_prop_ro("num_used_blocks", &BlockManager::num_used_blocks, "Blocks held by at least one sequence.")
      .def_prop_ro("num_available_blocks", &BlockManager::num_available_blocks,
                   "Blocks an allocation can take: free + cached.")
      .def_prop_ro("num_free_cpu_blocks", &BlockManager::num_free_cpu_blocks)
      .def_prop_ro("num_sequences", &BlockManager::num_sequences)
      .def_prop_ro("num_pending_copies", &BlockManager::num_pending_copies)
      .def("__len__", &BlockManager::num_sequences)
      .def("__contains__", &BlockManager::has_sequence, "seq_id"_a)
      .def_prop_ro(
          "prefix_cache_stats",
          [](const BlockManager& b) {
            const PrefixCacheStats& s = b.prefix_cache_stats();
            nb::dict d;
            d["queried_tokens"] = s.queried_tokens;
            d["hit_tokens"] = s.hit_tokens;
            d["hit_rate"] = s.hit_rate();
            d["evictions"] = s.evictions;
            return d;
          },
          "dict: queried_tokens, hit_tokens, hit_rate (hit/queried), evictions.")
      .def("reset_prefix_cache_stats", &BlockManager::reset_prefix_cache_stats)
      // ---- sequences
      .def(
          "add_sequence",
          [](BlockManager& b, std::int64_t seq_id, nb::handle token_ids, std::uint64_t extra_key) {
            const TokenArg t = token_arg(token_ids, "add_sequence");
            if (t.p64) return b.add_sequence_int64(seq_id, t.p64, t.size, extra_key);
            return b.add_sequence(seq_id, t.i32.ptr, t.size, extra_key);
          },
          "seq_id"_a, "token_ids"_a, nb::kw_only(), "extra_key"_a = 0,
          "Adds a sequence with its prompt and allocates its blocks. Returns the number of leading\n"
          "tokens found in the prefix cache (already computed). extra_key (e.g. an adapter id) is part\n"
          "of every block hash of the sequence.")
      .def("add_sequence_by_count", &BlockManager::add_sequence_by_count, "seq_id"_a, "num_tokens"_a,
           "Adds a sequence of num_tokens tokens without their ids (prefix caching must be off: the ids\n"
           "are never needed then) and allocates its blocks, as add_sequence would. Returns 0.\n"
           "token_ids() of the sequence (and of its forks) raises ValueError.")
      .def(
          "append_tokens",
          [](BlockManager& b, std::int64_t seq_id, nb::handle token_ids) {
            const auto t = int_arg<std::int32_t>(token_ids, "append_tokens", "token_ids");
            std::int64_t* p = nullptr;
            BlockManager::BlockPairs none;
            nb::object slots = new_array<std::int64_t>({static_cast<std::size_t>(t.size)}, &p);
            b.append_tokens(seq_id, t.ptr, t.size, p);
            return slots;
          },
          "seq_id"_a, "token_ids"_a,
          "Appends tokens (a decode token or a prefill chunk); returns their slots, int64 [n].")
      .def(
          "append_tokens_batch",
          [](BlockManager& b, nb::handle seq_ids, nb::handle token_ids) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "append_tokens_batch", "seq_ids");
            const auto t = int_arg<std::int32_t>(token_ids, "append_tokens_batch", "token_ids");
            if (t.size != ids.size)
              fail<InvalidArgument>("append_tokens_batch: token_ids has ", t.size, " entries for ", ids.size,
                                    " sequences (one token per sequence)");
            std::int64_t* p = nullptr;
            nb::object slots = new_array<std::int64_t>({static_cast<std::size_t>(ids.size)}, &p);
            b.append_tokens_batch(ids.ptr, ids.size, t.ptr, p);
            return slots;
          },
          "seq_ids"_a, "token_ids"_a, "Appends token_ids[i] to seq_ids[i], all or nothing; returns slots int64 [S].")
      .def("fork", &BlockManager::fork, "parent_id"_a, "child_id"_a,
           "The child shares all of the parent's blocks (copy-on-write). The parent must have no\n"
           "tokens waiting for a step.")
      .def(
          "fork_batch",
          [](BlockManager& b, nb::handle parent_ids, nb::handle child_ids) {
            const auto children = int_arg<std::int64_t>(child_ids, "fork_batch", "child_ids");
            IntArg<std::int64_t> parents;
            if (PyLong_Check(parent_ids.ptr())) {  // one parent for every child
              parents.store.assign(static_cast<std::size_t>(children.size), int64_arg(parent_ids, "parent_ids"));
              parents.ptr = parents.store.data();
              parents.size = children.size;
            } else {
              parents = int_arg<std::int64_t>(parent_ids, "fork_batch", "parent_ids");
            }
            if (parents.size != children.size)
              fail<InvalidArgument>("fork_batch: parent_ids has ", parents.size, " entries for ", children.size,
                                    " child_ids");
            b.fork_batch(parents.ptr, children.ptr, children.size);
          },
          "parent_ids"_a, "child_ids"_a,
          "Forks child_ids[i] from parent_ids[i] (an int: one parent for all), all or nothing, as\n"
          "fork() one by one would. Children must be distinct new ids.")
      .def("free", &BlockManager::free, "seq_id"_a,
           "Releases a sequence (running or swapped out). KeyError for an unknown id or a double free.")
      .def(
          "free_batch",
          [](BlockManager& b, nb::handle seq_ids) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "free_batch", "seq_ids");
            b.free_batch(ids.ptr, ids.size);
          },
          "seq_ids"_a,
          "Releases the distinct sequences (running or swapped out), all or nothing, as free() in\n"
          "this order would. KeyError for an unknown id, ValueError for a repeated one.")
      // ---- steps
      .def("step", &run_step, "seq_ids"_a, "token_ids"_a = nb::none(), nb::kw_only(), "query_lens"_a = nb::none(),
           "block_tables"_a = nb::none(), "seq_lens"_a = nb::none(), "context_lens"_a = nb::none(),
           "query_start_loc"_a = nb::none(), "slot_mapping"_a = nb::none(), "max_blocks"_a = nb::none(),
           "pad"_a = 0,
           "One scheduler step for a batch. token_ids (one per sequence) are appended first (a decode\n"
           "step); then query_lens[i] tokens of each sequence (default: all not yet computed) are\n"
           "scheduled and marked computed. Returns a StepMetadata. Output arrays may be passed in\n"
           "(any writable host DLPack array of the right dtype/shape; block_tables may be wider; none\n"
           "may share memory with an input or another output); the rest are new NumPy arrays.\n"
           "max_blocks pads the new block table up to the pool size (or the widest table). Pending\n"
           "copy-on-write pairs are drained into copy_pairs.")
      .def("step_into", &run_step_into, "seq_ids"_a, "token_ids"_a = nb::none(), nb::kw_only(),
           "query_lens"_a = nb::none(), "block_tables"_a = nb::none(), "seq_lens"_a = nb::none(),
           "context_lens"_a = nb::none(), "query_start_loc"_a = nb::none(), "slot_mapping"_a = nb::none(),
           "pad"_a = 0, "incremental"_a = true,
           "The same step as step(), written into persistent buffers: each given output may be\n"
           "larger than the step (block_tables [R, M] with R >= S and M >= the widest table, the vectors\n"
           "at least S, S + 1 or T long); the leading rows / entries are written, the rest left as they\n"
           "are. Outputs not given are not written (none given: the step only advances the manager).\n"
           "incremental=True writes only the block-table entries that changed since this manager last\n"
           "wrote that table (new blocks; whole rows for a sequence new to its row or changed by\n"
           "copy-on-write, swap_in or the sliding window); rows [0, S) end as a full rewrite leaves\n"
           "them. Write the table yourself only after reset_incremental_export(), or pass\n"
           "incremental=False (a full rewrite). Returns a StepMetadata holding the given arrays\n"
           "(None where not given) and the drained copy-on-write pairs.")
      .def("reset_incremental_export", &BlockManager::reset_incremental_export,
           "Forgets the block table remembered by step_into(incremental=True): its next call writes\n"
           "every row in full. Call it after writing that table yourself.")
      .def(
          "take_copy_pairs",
          [](BlockManager& b) {
            BlockManager::BlockPairs pairs;
            b.take_copy_pairs(pairs);
            return pairs_array(pairs);
          },
          "Returns and clears the pending copy-on-write pairs, int64 [P, 2] of (src, dst) blocks.")
      // ---- preemption
      .def(
          "swap_out",
          [](BlockManager& b, nb::handle seq_ids) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "swap_out", "seq_ids");
            BlockManager::BlockPairs pairs;
            b.swap_out(ids.ptr, ids.size, pairs);
            return pairs_array(pairs);
          },
          "seq_ids"_a,
          "Moves the sequences to the CPU pool. Returns int64 [P, 2] (gpu_block, cpu_block) pairs\n"
          "for swap_blocks; run them before any later mapping or forward pass.")
      .def(
          "swap_in",
          [](BlockManager& b, nb::handle seq_ids) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "swap_in", "seq_ids");
            BlockManager::BlockPairs pairs;
            b.swap_in(ids.ptr, ids.size, pairs);
            return pairs_array(pairs);
          },
          "seq_ids"_a, "Moves swapped-out sequences back. Returns int64 [P, 2] (cpu_block, gpu_block) pairs.")
      // ---- capacity
      .def(
          "can_allocate",
          [](const BlockManager& b, nb::handle tokens_or_count, std::uint64_t extra_key) {
            if (PyLong_Check(tokens_or_count.ptr())) {
              int overflow = 0;
              const long long n = PyLong_AsLongLongAndOverflow(tokens_or_count.ptr(), &overflow);
              if (overflow != 0 || (n == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                fail<InvalidArgument>("can_allocate: num_tokens = ", nb::str(tokens_or_count).c_str(),
                                      " is outside the int64 range");
              }
              return b.can_allocate(nullptr, n, extra_key);
            }
            const auto t = int_arg<std::int32_t>(tokens_or_count, "can_allocate", "token_ids");
            return b.can_allocate(t.ptr, t.size, extra_key);
          },
          "token_ids"_a, nb::kw_only(), "extra_key"_a = 0,
          "Whether add_sequence would succeed now (token ids: prefix hits counted; an int: a token count,\n"
          "exact up to 2**63 - 1; negative -> ValueError).")
      .def(
          "peek_prefix",
          [](const BlockManager& b, nb::handle token_ids, std::uint64_t extra_key) {
            const TokenArg t = token_arg(token_ids, "peek_prefix");
            if (t.p64) return b.peek_prefix_int64(t.p64, t.size, extra_key);
            return b.peek_prefix(t.i32.ptr, t.size, extra_key);
          },
          "token_ids"_a, nb::kw_only(), "extra_key"_a = 0,
          "What add_sequence(token_ids) would find in the prefix cache now, changing nothing (no\n"
          "statistics, no LRU order): a PrefixPeek (cached_tokens, new_blocks, reused_cached_blocks, fits).")
      .def("can_append", &BlockManager::can_append, "seq_id"_a, "num_tokens"_a = 1,
           "Whether appending num_tokens tokens would succeed now (exact up to 2**63 - 1; negative ->\n"
           "ValueError; False while swapped out).")
      .def(
          "can_append_batch",
          [](const BlockManager& b, nb::handle seq_ids) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "can_append_batch", "seq_ids");
            return b.can_append_batch(ids.ptr, ids.size);
          },
          "seq_ids"_a, "Whether appending one token to each sequence (a decode step) would succeed.")
      .def(
          "can_swap_out",
          [](const BlockManager& b, nb::handle seq_ids) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "can_swap_out", "seq_ids");
            return b.can_swap_out(ids.ptr, ids.size);
          },
          "seq_ids"_a)
      .def(
          "can_swap_in",
          [](const BlockManager& b, nb::handle seq_ids) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "can_swap_in", "seq_ids");
            return b.can_swap_in(ids.ptr, ids.size);
          },
          "seq_ids"_a)
      // ---- export
      .def(
          "block_tables",
          [](const BlockManager& b, nb::handle seq_ids, const nb::object& out, std::optional<std::int64_t> max_blocks,
             std::int32_t pad) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "block_tables", "seq_ids");
            std::int64_t width = 0;
            if (out.is_none()) {
              for (std::int64_t i = 0; i < ids.size; ++i)
                width = std::max<std::int64_t>(width, b.blocks_for(b.seq_len(ids.ptr[i])));
              width = table_width(b, width, max_blocks, "block_tables");
            }
            Out o = out_arg<std::int32_t>(out, {static_cast<std::size_t>(ids.size), static_cast<std::size_t>(width)},
                                          DType::kInt32);
            b.export_block_tables(ids.ptr, ids.size, o.view, pad);
            return o.obj;
          },
          "seq_ids"_a, nb::kw_only(), "out"_a = nb::none(), "max_blocks"_a = nb::none(), "pad"_a = 0,
          "Block tables int32 [S, M], padded with pad (M = widest table, or max_blocks up to the pool\n"
          "size, or out's width; out may not share memory with seq_ids).")
      .def(
          "seq_lens",
          [](const BlockManager& b, nb::handle seq_ids, const nb::object& out) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "seq_lens", "seq_ids");
            Out o = out_arg<std::int32_t>(out, {static_cast<std::size_t>(ids.size)}, DType::kInt32);
            b.export_seq_lens(ids.ptr, ids.size, o.view);
            return o.obj;
          },
          "seq_ids"_a, nb::kw_only(), "out"_a = nb::none(), "Lengths (tokens with slots) int32 [S].")
      .def(
          "csr",
          [](const BlockManager& b, nb::handle seq_ids, std::int32_t pad) {
            const auto ids = int_arg<std::int64_t>(seq_ids, "csr", "seq_ids");
            const std::int64_t nnz = b.count_blocks(ids.ptr, ids.size);
            const auto n = static_cast<std::size_t>(ids.size);
            Out ip = out_arg<std::int32_t>(nb::none(), {n + 1}, DType::kInt32);
            Out ix = out_arg<std::int32_t>(nb::none(), {static_cast<std::size_t>(nnz)}, DType::kInt32);
            Out lp = out_arg<std::int32_t>(nb::none(), {n}, DType::kInt32);
            b.export_csr(ids.ptr, ids.size, ip.view, ix.view, lp.view, pad);
            return nb::make_tuple(ip.obj, ix.obj, lp.obj);
          },
          "seq_ids"_a, nb::kw_only(), "pad"_a = 0,
          "CSR page table (indptr int32 [S+1], indices int32 [nnz], last_page_len int32 [S]).")
      .def(
          "slots",
          [](const BlockManager& b, std::int64_t seq_id, std::int64_t start, std::optional<std::int64_t> stop) {
            const std::int64_t len = b.seq_len(seq_id);
            const std::int64_t end = stop ? *stop : len;
            if (start < 0 || end < start || end > len)  // checked before the output is allocated
              fail<OutOfRange>("slots: [start, stop) = [", start, ", ", end, ") is not a range inside [0, seq_len = ",
                               len, "]");
            std::int64_t* p = nullptr;
            nb::object a = new_array<std::int64_t>({static_cast<std::size_t>(end - start)}, &p);
            b.slots(seq_id, start, end, p);
            return a;
          },
          "seq_id"_a, "start"_a = 0, "stop"_a = nb::none(),
          "Slots of tokens [start, stop) of a sequence, int64 (-1 where the window released the block).")
      // ---- introspection
      .def("block_table", &table_list, "seq_id"_a,
           "The sequence's block ids (CPU block ids while swapped out; -1 = released by the window).")
      .def(
          "token_ids",
          [](const BlockManager& b, std::int64_t seq_id) {
            const auto& t = b.token_ids(seq_id);
            std::int32_t* p = nullptr;
            nb::object a = new_array<std::int32_t>({t.size()}, &p);
            if (!t.empty()) std::memcpy(p, t.data(), t.size() * sizeof(std::int32_t));
            return a;
          },
          "seq_id"_a, "The sequence's token ids, int32.")
      .def("seq_len", &BlockManager::seq_len, "seq_id"_a, "Tokens of the sequence (all have slots).")
      .def("num_computed", &BlockManager::num_computed, "seq_id"_a, "Tokens already computed (cache written).")
      .def("is_swapped", &BlockManager::is_swapped, "seq_id"_a)
      .def("sequence_ids", &BlockManager::sequence_ids)
      .def("ref_count", &BlockManager::ref_count, "block"_a)
      .def("cpu_ref_count", &BlockManager::cpu_ref_count, "block"_a)
      .def("is_cached", &BlockManager::is_cached, "block"_a, "Whether a block is registered in the prefix cache.")
      .def("check_invariants", &BlockManager::check_invariants,
           "Checks all internal invariants (slow; for tests). Raises RuntimeError on a violation.")
      .def("__repr__", [](const BlockManager& b) {
        return nb::str("BlockManager(num_blocks={}, block_size={}, sequences={}, free={}, cached={}, used={})")
            .format(b.num_blocks(), b.block_size(), b.num_sequences(), b.num_free_blocks(), b.num_cached_blocks(),
                    b.num_used_blocks());
      });
}

}  // namespace pagedattn::py
