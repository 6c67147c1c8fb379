// Bindings of the attention and cache-write API: pagedattn.paged_attention,
// prepare_decode / PreparedDecode, reshape_and_cache, the workspace and plan queries,
// kv_cache_shape and supported(). Each is one crossing from Python: the arrays, the output,
// the stream and the options are all converted here (call_args.hpp, call_options.hpp).
#include <nanobind/stl/string.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "bindings.hpp"
#include "call_args.hpp"
#include "call_options.hpp"
#include "pagedattn/attention.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedattn::py {
namespace {

// Indices of a decode call's arrays in its CallArrays.
enum { kQuery, kKeyCache, kValueCache, kBlockTables, kSeqLens };

// Converts a decode call's arrays into `a` and completes `kw.options` with them and the
// stream; returns the index of the output (allocated like the query when the call passes
// none, after the shapes that size it are known to agree).
int convert_decode(CallArrays& a, nb::handle query, nb::handle key_cache, nb::handle value_cache,
                   nb::handle block_tables, nb::handle seq_lens, CallKeywords& kw) {
  a.add(query, "query");
  a.add(key_cache, "key_cache");
  a.add(value_cache, "value_cache");
  a.add(block_tables, "block_tables");
  a.add(seq_lens, "seq_lens");
  const int alibi = a.add_optional(kw.alibi_slopes, "alibi_slopes");
  const int ws = a.add_optional(kw.workspace, "workspace", /*written=*/true);
  const int qsl = a.add_optional(kw.query_start_loc, "query_start_loc");
  const int sinks = a.add_optional(kw.sinks, "sinks");
  if (alibi >= 0) kw.options.alibi_slopes = a[alibi];
  if (sinks >= 0) kw.options.sinks = a[sinks];
  if (ws >= 0) kw.options.workspace = a[ws];
  if (qsl >= 0) kw.options.query_start_loc = a[qsl];
  kw.options.stream = a.stream(kw.stream, kQuery);
  if (!kw.out.is_none()) return a.add(kw.out, "out", /*written=*/true);
  const TensorView& q = a[kQuery];
  const TensorView &bt = a[kBlockTables], &sl = a[kSeqLens];
  // The number of sequences: the query's rows (decode) or len(query_start_loc) - 1.
  const std::int64_t seqs = qsl >= 0 ? (a[qsl].ndim == 1 ? a[qsl].shape[0] - 1 : -1) : q.ndim > 0 ? q.shape[0] : -1;
  if (q.ndim != 3 || bt.ndim < 1 || sl.ndim < 1 || seqs < 0 || bt.shape[0] != seqs || sl.shape[0] != seqs) {
    // The validation pass names what is wrong (the query's own shape, or an index array
    // that disagrees with it) before anything is allocated.
    PreparedDecode check(q, q, a[kKeyCache], a[kValueCache], bt, sl, kw.options);
  }
  return a.add_empty_like(kQuery, "out");
}

// A prepared decode from Python: the validated call and every array it reads, held for
// the object's lifetime (so a run can never outlive its arrays).
struct PreparedCall {
  std::unique_ptr<CallArrays> arrays;
  std::optional<PreparedDecode> call;
  int out = -1;

  nb::object run(nb::handle stream) const {
    if (!call) fail<InvalidArgument>("PreparedDecode: this prepared call was cleared by the garbage collector");
    if (stream.is_none()) {
      nb::gil_scoped_release release;
      call->run();
    } else {
      void* handle = stream_handle(stream);
      nb::gil_scoped_release release;
      call->run(handle);
    }
    return arrays->result(out);
  }
};

// A prepared call holds Python objects (its arrays), so it takes part in garbage
// collection: a cycle through it (an array whose attributes refer back to the call) is
// collected instead of leaking.
int prepared_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  const PreparedCall* p = nb::inst_ptr<PreparedCall>(self);
  return p->arrays ? p->arrays->traverse(visit, arg) : 0;
}

int prepared_clear(PyObject* self) {
  PreparedCall* p = nb::inst_ptr<PreparedCall>(self);
  p->call.reset();
  p->arrays.reset();
  return 0;
}

PyType_Slot prepared_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(&prepared_traverse)},
                                {Py_tp_clear, reinterpret_cast<void*>(&prepared_clear)},
                                {0, nullptr}};

DType dtype_arg(nb::handle dtype, const char* name) {
  std::string text;
  if (PyUnicode_Check(dtype.ptr())) {
    text = nb::cast<std::string>(dtype);
  } else {
    text = nb::cast<std::string>(nb::str(dtype));
    if (text.rfind("torch.", 0) == 0) {
      text = text.substr(6);
    } else {
      try {  // NumPy dtypes and scalar types (numpy.float16, ml_dtypes.bfloat16, ...)
        text = nb::cast<std::string>(nb::module_::import_("numpy").attr("dtype")(dtype).attr("name"));
      } catch (const nb::python_error&) {
        fail<TypeMismatch>(name, ": expected a dtype (a name, a NumPy or torch dtype), got ", text);
      }
    }
  }
  return parse_dtype(text, name);
}

nb::tuple shape_tuple(const Shape& s, int n) {
  nb::list l;
  for (int i = 0; i < n; ++i) l.append(s[static_cast<std::size_t>(i)]);
  return nb::tuple(l);
}

DecodeShape decode_shape(nb::handle num_seqs, nb::handle num_heads, nb::handle num_kv_heads, nb::handle head_size,
                         nb::handle block_size, nb::handle max_blocks_per_seq, nb::handle dtype,
                         nb::handle layout, nb::handle device) {
  DecodeShape s;
  s.num_seqs = int_arg(num_seqs, "num_seqs");
  s.num_heads = int_arg(num_heads, "num_heads");
  s.num_kv_heads = int_arg(num_kv_heads, "num_kv_heads");
  s.head_size = int_arg(head_size, "head_size");
  s.block_size = int_arg(block_size, "block_size");
  s.max_blocks_per_seq = int_arg(max_blocks_per_seq, "max_blocks_per_seq");
  s.dtype = dtype_arg(dtype, "dtype");
  s.layout = parse_layout(str_arg(layout, "layout"));
  s.device_id = int_arg(device, "device");
  return s;
}

// decode_workspace_size and decode_plan: the same arguments, read the same way;
// `answer(shape, options)` gives the result.
template <class Answer>
void def_decode_query(nb::module_& m, const char* name, Answer answer, const std::string& sig,
                      const std::string& doc) {
  m.def(
      name,
      [name, answer](nb::handle num_seqs, nb::handle num_heads, nb::handle num_kv_heads, nb::handle head_size,
                     nb::handle block_size, nb::handle max_blocks_per_seq, nb::handle dtype, nb::handle layout,
                     nb::handle device, nb::kwargs kwargs) -> nb::object {
        CallKeywords kw;
        parse_keywords(name, kDecodeQuery, kwargs, &kw);
        return answer(decode_shape(num_seqs, num_heads, num_kv_heads, head_size, block_size, max_blocks_per_seq,
                                   dtype, layout, device),
                      kw.options);
      },
      "num_seqs"_a, "num_heads"_a, "num_kv_heads"_a, "head_size"_a, "block_size"_a, "max_blocks_per_seq"_a,
      "dtype"_a, "layout"_a = "vllm", "device"_a = 0, "kwargs"_a, nb::sig(sig.c_str()), doc.c_str());
}

std::string doc(const char* head, unsigned set, const char* tail = "") {
  return detail::concat(head, "\n\nKeyword options:\n", keyword_docs(set), tail);
}

constexpr const char* kDecodeDoc =
    "Paged attention over a paged KV cache: one new query token per sequence (decode), or\n"
    "with query_start_loc any number of each sequence's last tokens (chunked prefill and\n"
    "mixed prefill + decode batches; query and out are then [T, H, D], causal).\n\n"
    "Shapes (S sequences, H query heads, K KV heads, D head size, B block size, N blocks,\n"
    "M max blocks per sequence, x = 16 / element size of the cache):\n"
    "    query        [S, H, D]; may be strided in its first two dimensions\n"
    "    key_cache    layout 'vllm' [N, K, D/x, B, x], 'nhd' [N, B, K, D] or 'hnd' [N, K, B, D]\n"
    "    value_cache  layout 'vllm' [N, K, D, B], 'nhd' [N, B, K, D] or 'hnd' [N, K, B, D]\n"
    "                 (each block C-contiguous; any block stride >= one block, e.g. the key\n"
    "                 and value halves of an [N, 2, ...] allocation)\n"
    "    block_tables int32 [S, M]; seq_lens int32 [S]\n"
    "layout=None reads a rank-5 cache as 'vllm' and a rank-4 one as 'nhd'; 'hnd' caches\n"
    "need layout='hnd'.\n"
    "Query head h reads KV head h // (H // K). A sequence of length 0 yields zeros. Returns\n"
    "`out` when given, else a new array of the query's kind, dtype and device. Any DLPack\n"
    "array works (NumPy, PyTorch, CuPy, JAX), on the CPU or one CUDA device.";

// The eager decode call from Python (see bind_attention for why it is a plain function).
PyObject* paged_attention_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static const char* const kNames[] = {"query", "key_cache", "value_cache", "block_tables", "seq_lens"};
  try {
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs > 5)
      fail<TypeMismatch>("paged_attention() takes 5 positional arguments (query, key_cache, value_cache, "
                         "block_tables, seq_lens) but ", nargs, " were given");
    nb::handle arrays[5];
    for (Py_ssize_t i = 0; i < nargs; ++i) arrays[i] = args[i];
    CallKeywords kw;
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t j = 0; j < nkw; ++j) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, j);
      int slot = -1;
      for (int i = 0; i < 5 && slot < 0; ++i)
        if (PyUnicode_CompareWithASCIIString(key, kNames[i]) == 0) slot = i;
      if (slot < 0) {
        set_keyword("paged_attention", kDecodeCall, key, args[nargs + j], &kw);
      } else {
        if (arrays[slot].is_valid())
          fail<TypeMismatch>("paged_attention() got multiple values for argument '", kNames[slot], "'");
        arrays[slot] = args[nargs + j];
      }
    }
    for (int i = 0; i < 5; ++i)
      if (!arrays[i].is_valid())
        fail<TypeMismatch>("paged_attention() missing required argument '", kNames[i], "'");
    CallArrays a;
    const int out = convert_decode(a, arrays[0], arrays[1], arrays[2], arrays[3], arrays[4], kw);
    {
      nb::gil_scoped_release release;
      paged_attention(a[out], a[kQuery], a[kKeyCache], a[kValueCache], a[kBlockTables], a[kSeqLens], kw.options);
    }
    return a.result(out).release().ptr();
  } catch (...) {
    set_python_error(std::current_exception(), /*all=*/true);
    return nullptr;
  }
}

}  // namespace

void bind_attention(nb::module_& m) {
  // paged_attention is a plain METH_FASTCALL | METH_KEYWORDS function: arguments come
  // straight from the vectorcall, with no argument tuple or keyword dict built for them
  // (the per-call host cost of an eager decode).
  static const std::string decode_doc = detail::concat(
      "paged_attention($module, query, key_cache, value_cache, block_tables, seq_lens, ",
      keyword_text_signature(kDecodeCall), ")\n--\n\n", doc(kDecodeDoc, kDecodeCall));
  static PyMethodDef decode_def = {"paged_attention", reinterpret_cast<PyCFunction>(
                                                          reinterpret_cast<void (*)()>(&paged_attention_fastcall)),
                                   METH_FASTCALL | METH_KEYWORDS, decode_doc.c_str()};
  nb::object module_name = m.attr("__name__");
  PyObject* decode_fn = PyCFunction_NewEx(&decode_def, m.ptr(), module_name.ptr());
  if (decode_fn == nullptr) throw nb::python_error();
  m.attr("paged_attention") = nb::steal(decode_fn);

  static const std::string prepared_sig = detail::concat(
      "def __init__(self, query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, ",
      keyword_signature(kDecodeCall), ") -> None");
  nb::class_<PreparedCall>(m, "PreparedDecode", nb::type_slots(prepared_slots),
                           "A paged_attention call validated once and launched many times with run().\n\n"
                           "It holds every array of the call (not copies): change the contents of query,\n"
                           "block_tables, seq_lens and the caches in place between runs, never their shapes.\n"
                           "On the GPU a run launches with no conversion (the lowest host cost per step, and\n"
                           "the form to capture in a CUDA graph); on the CPU the index contents are checked\n"
                           "again on every run.")
      .def(
          "__init__",
          [](PreparedCall* self, nb::handle query, nb::handle key_cache, nb::handle value_cache,
             nb::handle block_tables, nb::handle seq_lens, nb::kwargs kwargs) {
            CallKeywords kw;
            parse_keywords("prepare_decode", kDecodeCall, kwargs, &kw);
            auto arrays = std::make_unique<CallArrays>();
            CallArrays& a = *arrays;
            const int out = convert_decode(a, query, key_cache, value_cache, block_tables, seq_lens, kw);
            a.keep_only_numpy_objects();
            PreparedCall* p = new (self) PreparedCall{std::move(arrays), std::nullopt, out};
            try {
              p->call.emplace(a[out], a[kQuery], a[kKeyCache], a[kValueCache], a[kBlockTables], a[kSeqLens],
                              kw.options);
            } catch (...) {
              p->~PreparedCall();
              throw;
            }
          },
          "query"_a, "key_cache"_a, "value_cache"_a, "block_tables"_a, "seq_lens"_a, "kwargs"_a,
          nb::sig(prepared_sig.c_str()))
      .def("run", &PreparedCall::run, "stream"_a = nb::none(),
           "Launches the prepared decode (on `stream`, else the one resolved when prepared); returns out.")
      .def("__call__", &PreparedCall::run, "stream"_a = nb::none(), "Same as run().")
      .def_prop_ro(
          "out",
          [](const PreparedCall& self) {
            if (!self.arrays) fail<InvalidArgument>("PreparedDecode: this prepared call was cleared");
            return self.arrays->result(self.out);
          },
          "The output array the runs write.");

  static const std::string write_sig = detail::concat(
      "def reshape_and_cache(key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any, ",
      keyword_signature(kCacheWrite), ") -> None");
  static const std::string write_doc =
      doc("Writes key / value [T, K, D] into their cache slots, in place.\n\n"
          "slot_mapping int32 or int64 [T]: slot = block * B + offset; negative slots mark padding and are\n"
          "skipped. Works with every cache layout (layout= as in paged_attention); with an fp8 kv_cache_dtype the values are stored as\n"
          "value / scale, saturated.",
          kCacheWrite);
  m.def(
      "reshape_and_cache",
      [](nb::handle key, nb::handle value, nb::handle key_cache, nb::handle value_cache, nb::handle slot_mapping,
         nb::kwargs kwargs) {
        CallKeywords kw;
        parse_keywords("reshape_and_cache", kCacheWrite, kwargs, &kw);
        CallArrays a;
        a.add(key, "key");
        a.add(value, "value");
        a.add(key_cache, "key_cache", /*written=*/true);
        a.add(value_cache, "value_cache", /*written=*/true);
        a.add(slot_mapping, "slot_mapping");
        CacheWriteOptions opt;
        opt.kv_cache_dtype = kw.options.kv_cache_dtype;
        opt.layout = kw.options.layout;
        opt.k_scale = kw.options.k_scale;
        opt.v_scale = kw.options.v_scale;
        opt.stream = a.stream(kw.stream, 0);
        nb::gil_scoped_release release;
        reshape_and_cache(a[0], a[1], a[2], a[3], a[4], opt);
      },
      "key"_a, "value"_a, "key_cache"_a, "value_cache"_a, "slot_mapping"_a, "kwargs"_a, nb::sig(write_sig.c_str()),
      write_doc.c_str());

  static const std::string query_args =
      "num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int, max_blocks_per_seq: int, "
      "dtype: Any, layout: str = 'vllm', device: int = 0, ";
  static const std::string ws_sig = detail::concat("def decode_workspace_size(", query_args,
                                                   keyword_signature(kDecodeQuery), ") -> int");
  static const std::string ws_doc =
      doc("Bytes of CUDA scratch paged_attention needs for these sizes and options (0: the single-pass\n"
          "kernel runs and no workspace is used).\n\n"
          "The size depends only on these host-known sizes (never on seq_lens), so one buffer of this size\n"
          "serves every later call with the same sizes, including graph replays. The checks and errors are\n"
          "paged_attention's for everything the sizes and options decide.",
          kDecodeQuery);
  static const std::string plan_sig =
      detail::concat("def decode_plan(", query_args, keyword_signature(kDecodeQuery), ") -> dict");
  static const std::string plan_doc =
      doc("How paged_attention runs on CUDA for these sizes and options (same arguments and errors as\n"
          "decode_workspace_size). Returns a dict: num_partitions and partition_size (tokens) along the\n"
          "context, reduce_kernel (True: partial results go to scratch and a second kernel merges them),\n"
          "head_tiles (CTAs per KV head along its query heads), ctas (the decode grid), threads_per_cta\n"
          "(fp8 caches run CTAs of 256 or 128 threads, as the grid suits), workspace_bytes,\n"
          "varlen_kernel (the kernel family of a call with query_start_loc on this device: 'sm90_wgmma',\n"
          "'sm80_mma' or 'cuda_core').",
          kDecodeQuery);
  def_decode_query(
      m, "decode_workspace_size",
      [](const DecodeShape& shape, const AttentionOptions& opt) { return nb::int_(decode_workspace_size(shape, opt)); },
      ws_sig, ws_doc);
  def_decode_query(
      m, "decode_plan",
      [](const DecodeShape& shape, const AttentionOptions& opt) {
        const DecodePlanInfo i = decode_plan(shape, opt);
        nb::dict d;
        d["num_partitions"] = i.num_partitions;
        d["partition_size"] = i.partition_size;
        d["reduce_kernel"] = i.reduce_kernel;
        d["head_tiles"] = i.head_tiles;
        d["ctas"] = i.ctas;
        d["threads_per_cta"] = i.threads_per_cta;
        d["workspace_bytes"] = i.workspace_bytes;
        d["varlen_kernel"] = i.varlen_kernel;
        return nb::object(d);
      },
      plan_sig, plan_doc);

  m.def(
      "kv_cache_shape",
      [](nb::handle num_blocks, nb::handle block_size, nb::handle num_kv_heads, nb::handle head_size,
         nb::handle dtype, nb::handle layout) {
        const std::int64_t nb_ = int64_arg(num_blocks, "num_blocks"), bs = int64_arg(block_size, "block_size"),
                           kh = int64_arg(num_kv_heads, "num_kv_heads"), hs = int64_arg(head_size, "head_size");
        const DType t = dtype_arg(dtype, "dtype");
        if (t != DType::kFloat32 && t != DType::kFloat16 && t != DType::kBFloat16 && t != DType::kUInt8)
          fail<TypeMismatch>("dtype: ", dtype_name(t), " is not a cache dtype; expected ", supported::dtypes_str(),
                             " or an fp8 / uint8 name");
        const CacheShapes s = kv_cache_shape(nb_, bs, kh, hs, dtype_size(t), parse_layout(str_arg(layout, "layout")));
        return nb::make_tuple(shape_tuple(s.key, s.key_ndim), shape_tuple(s.value, s.value_ndim));
      },
      "num_blocks"_a, "block_size"_a, "num_kv_heads"_a, "head_size"_a, "dtype"_a, "layout"_a = "vllm",
      nb::sig("def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: Any, "
              "layout: str = 'vllm') -> tuple[tuple[int, ...], tuple[int, ...]]"),
      "(key_shape, value_shape) of a paged KV cache.\n\n"
      "dtype is the cache element type: a NumPy dtype or scalar type, a torch dtype, or a name\n"
      "('float32', 'float16', 'bfloat16', 'uint8', 'fp8_e4m3', 'fp8_e5m2'). layout is 'vllm', 'nhd' or 'hnd'.");

  m.def("exchange_api_available", [](nb::handle obj) { return exchange::api_of(obj.ptr()) != nullptr; }, "obj"_a,
        "Whether the type of `obj` offers the DLPack C exchange API (`__dlpack_c_exchange_api__`).");
  m.def("num_threads", &cpu_num_threads, "Threads used by the CPU backend (PAGEDATTN_NUM_THREADS overrides).");
  m.def("supported", []() {
    nb::dict d;
    nb::list dts, kvs, hs, bs, kernels;
    for (DType t : supported::kDTypes) dts.append(dtype_name(t));
    for (KVCacheDType k : supported::kKVCacheDTypes) kvs.append(kv_cache_dtype_name(k));
    for (int h : supported::kCudaHeadSizes) hs.append(h);
    for (int b : supported::kCudaBlockSizes) bs.append(b);
    for (DecodeKernel k : {DecodeKernel::kAuto, DecodeKernel::kSinglePass, DecodeKernel::kPartitioned})
      kernels.append(decode_kernel_name(k));
    d["dtypes"] = dts;
    d["kv_cache_dtypes"] = nb::tuple(kvs);
    nb::list layouts;
    for (CacheLayout l : supported::kLayouts) layouts.append(layout_name(l));
    d["layouts"] = nb::tuple(layouts);
    d["kernels"] = nb::tuple(kernels);
    d["cuda_head_sizes"] = hs;
    d["cuda_head_size_align"] = supported::kCudaHeadSizeAlign;
    d["cuda_max_head_size"] = supported::kCudaMaxHeadSize;
    d["cuda_block_sizes"] = bs;
    d["cpu_max_head_size"] = supported::kCpuMaxHeadSize;
    d["cpu_max_block_size"] = supported::kCpuMaxBlockSize;
    d["max_context_tokens"] = supported::kMaxContextTokens;
    nb::list variants;
    for (const char* v : supported::kVariants) variants.append(v);
    d["variants"] = nb::tuple(variants);
    return d;
  }, "The supported dtypes, kv-cache dtypes, layouts, kernels, attention variants, head sizes, block sizes and "
     "tokens per sequence (read from the one list in supported.hpp).");
}

}  // namespace pagedattn::py
