// XLA FFI handlers: paged_attention and reshape_and_cache as XLA custom calls, so that
// JAX runs them under jax.jit (python/pagedattn/jax.py registers and calls them).
//
// Each handler turns XLA's buffers into the core's TensorViews, its attributes into the
// core's options, and calls the same C++ API as the eager bindings: one validation pass,
// the same kernels. On CUDA the work is queued on the stream XLA hands the handler. A
// library exception becomes an ffi::Error carrying its message (XLA raises it in Python);
// nothing here aborts.
//
// Built only when jaxlib's XLA FFI headers were found at build time (PAGEDATTN_JAX_FFI in
// python/CMakeLists.txt); otherwise _jax_ffi_targets() returns an empty dict.
#include <nanobind/nanobind.h>

#include "bindings.hpp"

#if PAGEDATTN_WITH_JAX_FFI
#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>

#include "pagedattn/attention.hpp"
#include "pagedattn/errors.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pagedattn::py {
namespace {

const char* xla_dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    default: return "an XLA type pagedattn does not know";
  }
}

// The core's dtype of an XLA element type. fp8 cache arrays (float8_e4m3fn, float8_e5m2)
// are the bytes of an fp8 cache: uint8 storage, read with kv_cache_dtype (checked below).
DType to_dtype(ffi::DataType t, const char* name) {
  switch (t) {
    case ffi::DataType::F32: return DType::kFloat32;
    case ffi::DataType::F16: return DType::kFloat16;
    case ffi::DataType::BF16: return DType::kBFloat16;
    case ffi::DataType::F64: return DType::kFloat64;
    case ffi::DataType::S32: return DType::kInt32;
    case ffi::DataType::S64: return DType::kInt64;
    case ffi::DataType::U8:
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E5M2: return DType::kUInt8;
    case ffi::DataType::U16: return DType::kUInt16;
    default:
      fail<TypeMismatch>(name, ": dtype ", xla_dtype_name(t),
                         " is not supported (pagedattn takes float32, float16, bfloat16, float64, int32, int64, "
                         "uint8, uint16, float8_e4m3fn and float8_e5m2 arrays, each where its argument allows)");
  }
}

// Where the handler runs: XLA's CPU client, or a CUDA device with XLA's stream.
struct Place {
  DeviceKind device = DeviceKind::kCPU;
  int device_id = 0;
  void* stream = nullptr;
};

// A dense row-major XLA buffer (the layout jax.ffi.ffi_call asks for) as a TensorView.
TensorView view(const ffi::AnyBuffer& b, const char* name, const Place& at) {
  const auto dims = b.dimensions();
  if (dims.size() > static_cast<std::size_t>(TensorView::kMaxDims))
    fail<InvalidArgument>(name, ": arrays of at most ", TensorView::kMaxDims, " dimensions are supported, got ",
                          dims.size());
  TensorView v;
  v.data = b.untyped_data();
  v.dtype = to_dtype(b.element_type(), name);
  v.device = at.device;
  v.device_id = at.device_id;
  v.ndim = static_cast<int>(dims.size());
  std::int64_t stride = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[static_cast<std::size_t>(i)] = dims[static_cast<std::size_t>(i)];
    v.strides[static_cast<std::size_t>(i)] = stride;
    stride *= dims[static_cast<std::size_t>(i)];
  }
  return v;
}

// An fp8-typed cache array must be read in its own format.
void check_fp8_cache(const ffi::AnyBuffer& cache, const char* name, KVCacheDType kv) {
  const ffi::DataType t = cache.element_type();
  if (t == ffi::DataType::F8E4M3FN && kv != KVCacheDType::kFp8E4M3)
    fail<InvalidArgument>(name, ": a float8_e4m3fn cache needs kv_cache_dtype='fp8_e4m3', got '",
                          kv_cache_dtype_name(kv), "'");
  if (t == ffi::DataType::F8E5M2 && kv != KVCacheDType::kFp8E5M2)
    fail<InvalidArgument>(name, ": a float8_e5m2 cache needs kv_cache_dtype='fp8_e5m2', got '",
                          kv_cache_dtype_name(kv), "'");
}

// The call's attributes, read by name. Every option is one entry of read_option(); an
// attribute no entry knows is an error (a misspelt option never passes silently).
class Attrs {
 public:
  explicit Attrs(const ffi::Dictionary& d) : d_(d) {}

  template <class T>
  T get(std::string_view name) const {
    ffi::ErrorOr<T> v = d_.get<T>(name);
    if (!v.has_value())
      fail<TypeMismatch>("attribute '", name, "' has the wrong type (", v.error().message(), ")");
    return *v;
  }
  std::string str(std::string_view name) const { return std::string(get<std::string_view>(name)); }
  template <class F>
  void each(F&& read) const {
    for (auto it = d_.begin(); it != d_.end(); ++it)
      if (!read(*it)) fail<InvalidArgument>("unknown attribute '", *it, "'");
  }

 private:
  const ffi::Dictionary& d_;
};

int int_attr(const Attrs& a, std::string_view name) {
  const std::int64_t v = a.get<std::int64_t>(name);
  if (v < INT32_MIN || v > INT32_MAX) fail<InvalidArgument>(name, ": ", v, " does not fit in 32 bits");
  return static_cast<int>(v);
}

// One attention option from the attribute `name`; false when no option has that name.
// The optional arrays (alibi_slopes, query_start_loc, sinks) are operands, named by the
// attribute "operands" (see paged_attention_impl).
bool read_option(const Attrs& a, std::string_view name, AttentionOptions& o) {
  if (name == "scale") o.scale = a.get<float>(name);
  else if (name == "kv_cache_dtype") o.kv_cache_dtype = parse_kv_cache_dtype(a.str(name));
  else if (name == "k_scale") o.k_scale = a.get<float>(name);
  else if (name == "v_scale") o.v_scale = a.get<float>(name);
  else if (name == "kernel") o.kernel = parse_decode_kernel(a.str(name).c_str());
  else if (name == "partition_size") o.partition_size = int_attr(a, name);
  else if (name == "max_query_len") o.max_query_len = int_attr(a, name);
  else if (name == "check_block_tables") o.check_block_tables = a.get<bool>(name);
  else if (name == "sliding_window") o.sliding_window = int_attr(a, name);
  else if (name == "soft_cap") o.soft_cap = a.get<float>(name);
  else if (name == "layout") o.layout = parse_layout(a.str(name), "layout");
  else if (name == "operands") {}  // read by the caller
  else return false;
  return true;
}

// A library exception (or any other) as the ffi::Error XLA raises in Python, its message
// starting with the Python exception type the eager call would raise.
ffi::Error to_ffi_error(const char* call) {
  try {
    throw;
  } catch (const TypeMismatch& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, detail::concat("TypeError: ", call, ": ", e.what()));
  } catch (const NotSupported& e) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, detail::concat("ValueError: ", call, ": ", e.what()));
  } catch (const InvalidArgument& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, detail::concat("ValueError: ", call, ": ", e.what()));
  } catch (const OutOfRange& e) {
    return ffi::Error(ffi::ErrorCode::kOutOfRange, detail::concat("IndexError: ", call, ": ", e.what()));
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, detail::concat("MemoryError: ", call, ": out of memory"));
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, detail::concat("RuntimeError: ", call, ": ", e.what()));
  } catch (...) {
    return ffi::Error(ffi::ErrorCode::kInternal, detail::concat("RuntimeError: ", call, ": unknown C++ exception"));
  }
}

// paged_attention: operands query, key_cache, value_cache, block_tables, seq_lens, then
// the optional arrays listed in the attribute "operands" ("alibi_slopes",
// "query_start_loc", "sinks", comma-separated, in operand order); result out (like the query).
ffi::Error paged_attention_impl(const Place& at, ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                                ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables, ffi::AnyBuffer seq_lens,
                                ffi::RemainingArgs optional, ffi::Result<ffi::AnyBuffer> out,
                                const ffi::Dictionary& attrs) {
  constexpr const char* kCall = "paged_attention";
  try {
    const Attrs a(attrs);
    AttentionOptions o;
    a.each([&](std::string_view name) { return read_option(a, name, o); });
    o.stream = at.stream;
    check_fp8_cache(key_cache, "key_cache", o.kv_cache_dtype);
    check_fp8_cache(value_cache, "value_cache", o.kv_cache_dtype);
    std::string names = attrs.contains("operands") ? a.str("operands") : std::string();
    std::size_t index = 0;
    for (std::size_t start = 0; start < names.size();) {
      std::size_t end = names.find(',', start);
      if (end == std::string::npos) end = names.size();
      const std::string name = names.substr(start, end - start);
      start = end + 1;
      ffi::ErrorOr<ffi::AnyBuffer> buf = optional.get<ffi::AnyBuffer>(index++);
      if (!buf.has_value())
        fail<InvalidArgument>("the attribute operands names '", name, "' but the call has only ",
                              optional.size(), " optional operand(s)");
      if (name == "alibi_slopes") o.alibi_slopes = view(*buf, "alibi_slopes", at);
      else if (name == "query_start_loc") o.query_start_loc = view(*buf, "query_start_loc", at);
      else if (name == "sinks") o.sinks = view(*buf, "sinks", at);
      else fail<InvalidArgument>("unknown optional operand '", name, "'");
    }
    if (index != optional.size())
      fail<InvalidArgument>(optional.size(), " optional operand(s) given, ", index,
                            " named by the attribute operands");
    paged_attention(view(*out, "out", at), view(query, "query", at), view(key_cache, "key_cache", at),
                    view(value_cache, "value_cache", at), view(block_tables, "block_tables", at),
                    view(seq_lens, "seq_lens", at), o);
    return ffi::Error::Success();
  } catch (...) {
    return to_ffi_error(kCall);
  }
}

// reshape_and_cache: operands key, value, key_cache, value_cache, slot_mapping; results
// the updated key_cache and value_cache, aliased to their operands (the call's
// input_output_aliases), so the write lands in place.
ffi::Error reshape_and_cache_impl(const Place& at, ffi::AnyBuffer key, ffi::AnyBuffer value,
                                  ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                                  ffi::AnyBuffer slot_mapping, ffi::Result<ffi::AnyBuffer> key_cache_out,
                                  ffi::Result<ffi::AnyBuffer> value_cache_out, const ffi::Dictionary& attrs) {
  constexpr const char* kCall = "reshape_and_cache";
  try {
    if (key_cache_out->untyped_data() != key_cache.untyped_data() ||
        value_cache_out->untyped_data() != value_cache.untyped_data())
      fail<InvalidArgument>("the updated caches must alias the key_cache and value_cache operands "
                            "(input_output_aliases={2: 0, 3: 1})");
    const Attrs a(attrs);
    CacheWriteOptions o;
    a.each([&](std::string_view name) {
      if (name == "kv_cache_dtype") o.kv_cache_dtype = parse_kv_cache_dtype(a.str(name));
      else if (name == "k_scale") o.k_scale = a.get<float>(name);
      else if (name == "v_scale") o.v_scale = a.get<float>(name);
      else if (name == "layout") o.layout = parse_layout(a.str(name), "layout");
      else return false;
      return true;
    });
    o.stream = at.stream;
    check_fp8_cache(key_cache, "key_cache", o.kv_cache_dtype);
    check_fp8_cache(value_cache, "value_cache", o.kv_cache_dtype);
    reshape_and_cache(view(key, "key", at), view(value, "value", at), view(*key_cache_out, "key_cache", at),
                      view(*value_cache_out, "value_cache", at), view(slot_mapping, "slot_mapping", at), o);
    return ffi::Error::Success();
  } catch (...) {
    return to_ffi_error(kCall);
  }
}

constexpr Place kHost{};
Place cuda_place(void* stream, std::int32_t device) { return Place{DeviceKind::kCUDA, device, stream}; }

// The handlers, one per (operation, platform): static function pointers, not exported
// symbols; _jax_ffi_targets() hands them to Python as capsules.
XLA_FFI_DEFINE_HANDLER(
    pagedattn_paged_attention_cpu,
    [](ffi::AnyBuffer q, ffi::AnyBuffer kc, ffi::AnyBuffer vc, ffi::AnyBuffer bt, ffi::AnyBuffer sl,
       ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
      return paged_attention_impl(kHost, q, kc, vc, bt, sl, rest, out, attrs);
    },
    ffi::Ffi::Bind()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .RemainingArgs()
        .Ret<ffi::AnyBuffer>()
        .Attrs<ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER(
    pagedattn_paged_attention_cuda,
    [](void* stream, std::int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer kc, ffi::AnyBuffer vc, ffi::AnyBuffer bt,
       ffi::AnyBuffer sl, ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out, ffi::Dictionary attrs) {
      return paged_attention_impl(cuda_place(stream, device), q, kc, vc, bt, sl, rest, out, attrs);
    },
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<void*>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .RemainingArgs()
        .Ret<ffi::AnyBuffer>()
        .Attrs<ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER(
    pagedattn_reshape_and_cache_cpu,
    [](ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer kc, ffi::AnyBuffer vc, ffi::AnyBuffer slots,
       ffi::Result<ffi::AnyBuffer> kc_out, ffi::Result<ffi::AnyBuffer> vc_out, ffi::Dictionary attrs) {
      return reshape_and_cache_impl(kHost, k, v, kc, vc, slots, kc_out, vc_out, attrs);
    },
    ffi::Ffi::Bind()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Attrs<ffi::Dictionary>());

XLA_FFI_DEFINE_HANDLER(
    pagedattn_reshape_and_cache_cuda,
    [](void* stream, std::int32_t device, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
       ffi::AnyBuffer slots, ffi::Result<ffi::AnyBuffer> kc_out, ffi::Result<ffi::AnyBuffer> vc_out,
       ffi::Dictionary attrs) {
      return reshape_and_cache_impl(cuda_place(stream, device), k, v, kc, vc, slots, kc_out, vc_out, attrs);
    },
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<void*>>()
        .Ctx<ffi::DeviceOrdinal>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Attrs<ffi::Dictionary>());

}  // namespace
}  // namespace pagedattn::py
#endif  // PAGEDATTN_WITH_JAX_FFI

namespace nb = nanobind;

namespace pagedattn::py {

void bind_jax_ffi(nb::module_& m) {
  m.def(
      "_jax_ffi_targets",
      []() {
        nb::dict targets;
#if PAGEDATTN_WITH_JAX_FFI
        const auto capsule = [](XLA_FFI_Handler* h) {
          return nb::steal(PyCapsule_New(reinterpret_cast<void*>(h), nullptr, nullptr));
        };
        nb::dict cpu, cuda;
        cpu["pagedattn_paged_attention"] = capsule(pagedattn_paged_attention_cpu);
        cpu["pagedattn_reshape_and_cache"] = capsule(pagedattn_reshape_and_cache_cpu);
        cuda["pagedattn_paged_attention"] = capsule(pagedattn_paged_attention_cuda);
        cuda["pagedattn_reshape_and_cache"] = capsule(pagedattn_reshape_and_cache_cuda);
        targets["cpu"] = cpu;
        targets["CUDA"] = cuda;
#endif
        return targets;
      },
      "The XLA FFI handlers built into this module, as {platform: {target name: capsule}}\n"
      "(empty when it was built without jaxlib's XLA FFI headers). pagedattn.jax registers them.");
}

}  // namespace pagedattn::py
