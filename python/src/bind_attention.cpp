// Bindings of the decode attention and cache-write API.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <utility>

#include "bindings.hpp"
#include "exchange.hpp"
#include "ndarray.hpp"
#include "pagedattn/attention.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedattn::py {
namespace {

// NumPy has no bfloat16; the Python layer passes ml_dtypes.bfloat16 arrays as uint16
// views and sets the argument's bit in `bf16_mask` so the core sees bfloat16.
template <class Array>
TensorView view_arg(const Array& a, unsigned mask, int bit) {
  TensorView v = to_view(a);
  if ((mask >> bit) & 1u) {
    if (v.dtype != DType::kUInt16) fail<TypeMismatch>("internal: bfloat16 view expected as uint16");
    v.dtype = DType::kBFloat16;
  }
  return v;
}

nb::tuple shape_tuple(const Shape& s, int n) {
  nb::list l;
  for (int i = 0; i < n; ++i) l.append(s[static_cast<std::size_t>(i)]);
  return nb::tuple(l);
}

// The scalar options of a decode call (the array options are set by the caller).
DecodeOptions decode_options(std::optional<float> scale, const std::string& kv_cache_dtype, float k_scale,
                             float v_scale, int version, int partition_size, bool check_block_tables, void* stream) {
  DecodeOptions opt;
  opt.scale = scale;
  opt.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  opt.k_scale = k_scale;
  opt.v_scale = v_scale;
  opt.version = version;
  opt.partition_size = partition_size;
  opt.check_block_tables = check_block_tables;
  opt.stream = stream;
  return opt;
}

// The stream of an exchange-path call: an int handle as given, else (None) the current
// stream the producer reports for `like`'s device. False: the general path must run.
bool exchange_stream(nb::handle stream, const exchange::Api* api, const TensorView& like, void** out) {
  if (stream.is_none()) return exchange::current_stream(api, like, out);
  if (!PyLong_CheckExact(stream.ptr())) return false;
  *out = to_stream(nb::cast<std::uintptr_t>(stream));
  return true;
}

// The arguments of one decode call, converted to views once.
struct DecodeCall {
  TensorView out, query, key_cache, value_cache, block_tables, seq_lens, alibi, ws;
  DecodeOptions opt;
  DecodeCall(const AnyMutArray& out_, const AnyArray& query_, const AnyArray& key_cache_, const AnyArray& value_cache_,
             const AnyArray& block_tables_, const AnyArray& seq_lens_, std::optional<float> scale,
             const std::optional<AnyArray>& alibi_slopes, const std::string& kv_cache_dtype, float k_scale,
             float v_scale, int version, int partition_size, const std::optional<AnyArray>& workspace,
             bool check_block_tables, std::uintptr_t stream, unsigned bf16_mask)
      : out(view_arg(out_, bf16_mask, 0)),
        query(view_arg(query_, bf16_mask, 1)),
        key_cache(view_arg(key_cache_, bf16_mask, 2)),
        value_cache(view_arg(value_cache_, bf16_mask, 3)),
        block_tables(to_view(block_tables_)),
        seq_lens(to_view(seq_lens_)),
        opt(decode_options(scale, kv_cache_dtype, k_scale, v_scale, version, partition_size, check_block_tables,
                           to_stream(stream))) {
    if (alibi_slopes) {
      alibi = to_view(*alibi_slopes);
      opt.alibi_slopes = &alibi;
    }
    if (workspace) {
      ws = to_view(*workspace);
      opt.workspace = &ws;
    }
  }
  DecodeCall(const DecodeCall&) = delete;
};

// The arrays' Python objects are kept alive by the Python wrapper (pagedattn.PreparedDecode),
// which also hands over the object `run` returns and its stream resolver (attach).
struct PreparedDecode {
  DecodeParams params;
  DeviceKind device;
  void* stream;
  nb::object result;   // the caller's output array
  nb::object resolve;  // resolve_stream(stream, like) -> int, for a stream that is not an int
};

#define DECODE_ARGS                                                                                              \
  "out"_a.noconvert(), "query"_a.noconvert(), "key_cache"_a.noconvert(), "value_cache"_a.noconvert(),            \
      "block_tables"_a.noconvert(), "seq_lens"_a.noconvert(), "scale"_a.none(), "alibi_slopes"_a.none(),          \
      "kv_cache_dtype"_a = "auto", "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "version"_a = 0, "partition_size"_a = 0, \
      "workspace"_a.none() = nb::none(), "check_block_tables"_a = false, "stream"_a = 0, "bf16_mask"_a = 0u

// Eager decode with every array converted through its type's DLPack exchange table
// (no Python-level call per array, the stream from the producer): the fast path of
// pagedattn.paged_attention. Returns None, having done nothing, when an array's type
// offers no table or the producer refuses it; the caller then takes the general path
// (which also gives the error messages for the cases skipped here).
nb::object decode_exchange(nb::handle out, nb::handle query, nb::handle key_cache, nb::handle value_cache,
                           nb::handle block_tables, nb::handle seq_lens, std::optional<float> scale,
                           nb::handle alibi_slopes, const std::string& kv_cache_dtype, float k_scale, float v_scale,
                           int version, int partition_size, nb::handle workspace, bool check_block_tables,
                           nb::handle stream) {
  enum { kQ, kK, kV, kBT, kSL, kOpt };
  exchange::Arrays a;
  for (nb::handle h : {query, key_cache, value_cache, block_tables, seq_lens})
    if (!a.add(h.ptr())) return nb::none();
  int i_out = -1, i_alibi = -1, i_ws = -1, n = kOpt;
  for (auto [h, idx] : {std::pair<nb::handle, int*>{out, &i_out}, {alibi_slopes, &i_alibi}, {workspace, &i_ws}}) {
    if (h.is_none()) continue;
    if (!a.add(h.ptr())) return nb::none();
    *idx = n++;
  }
  const TensorView& q = a[kQ];
  void* handle = nullptr;
  if (!exchange_stream(stream, a.api(kQ), q, &handle)) return nb::none();

  nb::object result;
  TensorView o;
  if (i_out >= 0) {
    if (a.read_only(i_out)) return nb::none();
    result = nb::borrow(out);
    o = a[i_out];
  } else {
    // Allocate only for a query whose sequence count the index arrays agree with (the
    // general path reports the mismatch before it allocates anything).
    if (q.ndim != 3 || a[kBT].ndim < 1 || a[kSL].ndim < 1 || a[kBT].shape[0] != q.shape[0] ||
        a[kSL].shape[0] != q.shape[0])
      return nb::none();
    PyObject* fresh = exchange::allocate_like(a.api(kQ), q, &o);
    if (fresh == nullptr) return nb::none();
    result = nb::steal(fresh);
  }
  DecodeOptions opt =
      decode_options(scale, kv_cache_dtype, k_scale, v_scale, version, partition_size, check_block_tables, handle);
  if (i_alibi >= 0) opt.alibi_slopes = &a[i_alibi];
  if (i_ws >= 0) opt.workspace = &a[i_ws];
  {
    nb::gil_scoped_release release;
    paged_attention(o, q, a[kK], a[kV], a[kBT], a[kSL], opt);
  }
  return result;
}

// reshape_and_cache through the exchange tables; False when the general path must run.
bool cache_write_exchange(nb::handle key, nb::handle value, nb::handle key_cache, nb::handle value_cache,
                          nb::handle slot_mapping, const std::string& kv_cache_dtype, float k_scale, float v_scale,
                          nb::handle stream) {
  exchange::Arrays a;
  for (nb::handle h : {key, value, key_cache, value_cache, slot_mapping})
    if (!a.add(h.ptr())) return false;
  void* handle = nullptr;
  if (a.read_only(2) || a.read_only(3) || !exchange_stream(stream, a.api(0), a[0], &handle)) return false;
  CacheWriteOptions opt;
  opt.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  opt.k_scale = k_scale;
  opt.v_scale = v_scale;
  opt.stream = handle;
  nb::gil_scoped_release release;
  reshape_and_cache(a[0], a[1], a[2], a[3], a[4], opt);
  return true;
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("paged_attention_exchange", &decode_exchange, "out"_a.none(), "query"_a, "key_cache"_a, "value_cache"_a,
        "block_tables"_a, "seq_lens"_a, "scale"_a.none(), "alibi_slopes"_a.none(), "kv_cache_dtype"_a, "k_scale"_a,
        "v_scale"_a, "version"_a, "partition_size"_a, "workspace"_a.none(), "check_block_tables"_a, "stream"_a.none(),
        "Decode through the DLPack C exchange API; None when an argument's type does not offer it.");
  m.def("reshape_and_cache_exchange", &cache_write_exchange, "key"_a, "value"_a, "key_cache"_a, "value_cache"_a,
        "slot_mapping"_a, "kv_cache_dtype"_a, "k_scale"_a, "v_scale"_a, "stream"_a.none(),
        "Cache write through the DLPack C exchange API; False when an argument's type does not offer it.");
  m.def("exchange_api_available", [](nb::handle obj) { return exchange::api_of(obj.ptr()) != nullptr; }, "obj"_a,
        "Whether the type of `obj` offers the DLPack C exchange API (`__dlpack_c_exchange_api__`).");

  m.def(
      "paged_attention",
      [](AnyMutArray out, AnyArray query, AnyArray key_cache, AnyArray value_cache, AnyArray block_tables,
         AnyArray seq_lens, std::optional<float> scale, std::optional<AnyArray> alibi_slopes,
         const std::string& kv_cache_dtype, float k_scale, float v_scale, int version, int partition_size,
         std::optional<AnyArray> workspace, bool check_block_tables, std::uintptr_t stream, unsigned bf16_mask) {
        DecodeCall c(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes, kv_cache_dtype,
                     k_scale, v_scale, version, partition_size, workspace, check_block_tables, stream, bf16_mask);
        nb::gil_scoped_release release;
        paged_attention(c.out, c.query, c.key_cache, c.value_cache, c.block_tables, c.seq_lens, c.opt);
      },
      DECODE_ARGS, "Low-level decode entry point (validated in C++). Use pagedattn.paged_attention.");

  nb::class_<PreparedDecode>(m, "PreparedDecode",
                             "A decode validated once and launched many times (use pagedattn.prepare_decode).")
      .def(
          "__init__",
          [](PreparedDecode* self, AnyMutArray out, AnyArray query, AnyArray key_cache, AnyArray value_cache,
             AnyArray block_tables, AnyArray seq_lens, std::optional<float> scale, std::optional<AnyArray> alibi_slopes,
             const std::string& kv_cache_dtype, float k_scale, float v_scale, int version, int partition_size,
             std::optional<AnyArray> workspace, bool check_block_tables, std::uintptr_t stream, unsigned bf16_mask) {
            DecodeCall c(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
                         kv_cache_dtype, k_scale, v_scale, version, partition_size, workspace, check_block_tables,
                         stream, bf16_mask);
            new (self) PreparedDecode{make_decode_params(c.out, c.query, c.key_cache, c.value_cache, c.block_tables,
                                                         c.seq_lens, c.opt),
                                      c.query.device, c.opt.stream};
          },
          DECODE_ARGS)
      .def(
          "attach",
          [](PreparedDecode& self, nb::object result, nb::object resolve) {
            self.result = std::move(result);
            self.resolve = std::move(resolve);
          },
          "result"_a, "resolve"_a, "Sets the object `run` returns and the resolver of non-int stream arguments.")
      .def(
          "run",
          [](const PreparedDecode& self, nb::handle stream) -> nb::object {
            // The whole per-step path from Python: no Python frame, no conversion.
            void* handle = self.stream;
            if (!stream.is_none()) {
              nb::object h = PyLong_CheckExact(stream.ptr()) || !self.resolve.is_valid()
                                 ? nb::borrow(stream)
                                 : self.resolve(stream, self.result);
              std::uintptr_t v = 0;
              if (!nb::try_cast(h, v))
                throw nb::type_error("stream: expected a non-negative int handle or an object with __cuda_stream__");
              handle = to_stream(v);
            }
            {
              nb::gil_scoped_release release;
              run_decode(self.params, self.device, handle);
            }
            return self.result.is_valid() ? self.result : nb::none();
          },
          "stream"_a = nb::none(),
          "Launches the prepared decode (on `stream`, else the one given when prepared); returns the output.");

  m.def(
      "reshape_and_cache",
      [](AnyArray key, AnyArray value, AnyMutArray key_cache, AnyMutArray value_cache, AnyArray slot_mapping,
         const std::string& kv_cache_dtype, float k_scale, float v_scale, std::uintptr_t stream, unsigned bf16_mask) {
        const TensorView k = view_arg(key, bf16_mask, 0), v = view_arg(value, bf16_mask, 1),
                         kc = view_arg(key_cache, bf16_mask, 2), vc = view_arg(value_cache, bf16_mask, 3);
        const TensorView sm = to_view(slot_mapping);
        CacheWriteOptions opt;
        opt.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
        opt.k_scale = k_scale;
        opt.v_scale = v_scale;
        opt.stream = to_stream(stream);
        nb::gil_scoped_release release;
        reshape_and_cache(k, v, kc, vc, sm, opt);
      },
      "key"_a.noconvert(), "value"_a.noconvert(), "key_cache"_a.noconvert(), "value_cache"_a.noconvert(),
      "slot_mapping"_a.noconvert(), "kv_cache_dtype"_a = "auto", "k_scale"_a = 1.0f, "v_scale"_a = 1.0f,
      "stream"_a = 0, "bf16_mask"_a = 0u,
      "Low-level cache-write entry point (validated in C++). Use pagedattn.reshape_and_cache.");

  m.def(
      "kv_cache_shape",
      [](std::int64_t num_blocks, std::int64_t block_size, std::int64_t num_kv_heads, std::int64_t head_size,
         const std::string& dtype, const std::string& layout) {
        const DType t = parse_dtype(dtype);
        if (t != DType::kFloat32 && t != DType::kFloat16 && t != DType::kBFloat16 && t != DType::kUInt8)
          fail<TypeMismatch>("dtype: ", dtype_name(t), " is not a cache dtype; expected ", supported::dtypes_str(),
                             " or an fp8 / uint8 name");
        const CacheShapes s =
            kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype_size(t), parse_layout(layout));
        return nb::make_tuple(shape_tuple(s.key, s.key_ndim), shape_tuple(s.value, s.value_ndim));
      },
      "num_blocks"_a, "block_size"_a, "num_kv_heads"_a, "head_size"_a, "dtype"_a, "layout"_a = "vllm");

  m.def("num_threads", &cpu_num_threads, "Threads used by the CPU backend (PAGEDATTN_NUM_THREADS overrides).");
  m.def("supported", []() {
    nb::dict d;
    nb::list dts, hs, bs;
    for (DType t : supported::kDTypes) dts.append(dtype_name(t));
    for (int h : supported::kCudaHeadSizes) hs.append(h);
    for (int b : supported::kCudaBlockSizes) bs.append(b);
    d["dtypes"] = dts;
    d["kv_cache_dtypes"] = nb::make_tuple("auto", "fp8_e4m3", "fp8_e5m2");
    d["layouts"] = nb::make_tuple("vllm", "nhd");
    d["cuda_head_sizes"] = hs;
    d["cuda_head_size_align"] = supported::kCudaHeadSizeAlign;
    d["cuda_max_head_size"] = supported::kCudaMaxHeadSize;
    d["cuda_block_sizes"] = bs;
    d["cpu_max_head_size"] = supported::kCpuMaxHeadSize;
    d["cpu_max_block_size"] = supported::kCpuMaxBlockSize;
    return d;
  }, "The supported dtypes, layouts, head sizes and block sizes (one list the whole library reads).");
}

}  // namespace pagedattn::py
