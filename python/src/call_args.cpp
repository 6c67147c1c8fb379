#include "call_args.hpp"

#include <nanobind/stl/string.h>

#include <cstring>
#include <new>
#include <string>

#include "ndarray.hpp"
#include "pagedattn/errors.hpp"

namespace pagedattn::py {
using namespace nb::literals;
namespace {

// numpy.ndarray and numpy.uint16, looked up once (strong references, never released:
// the module lives as long as the interpreter).
struct NumPy {
  PyObject* ndarray = nullptr;
  PyObject* uint16 = nullptr;
  PyObject* empty = nullptr;
  PyObject* dtype = nullptr;
};
const NumPy& numpy() {
  static const NumPy np = [] {
    nb::module_ m = nb::module_::import_("numpy");
    NumPy r;
    r.ndarray = nb::object(m.attr("ndarray")).release().ptr();
    r.uint16 = nb::object(m.attr("uint16")).release().ptr();
    r.empty = nb::object(m.attr("empty")).release().ptr();
    r.dtype = nb::object(m.attr("dtype")).release().ptr();
    return r;
  }();
  return np;
}

bool is_numpy(nb::handle obj) { return PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(numpy().ndarray)); }

// "torch" for torch.Tensor, "numpy", "cupy", "jax" (jaxlib counts as jax), ...
std::string framework(nb::handle obj) {
  nb::object mod = nb::getattr(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()))), "__module__", nb::none());
  if (!nb::isinstance<nb::str>(mod)) return "";
  std::string s = nb::cast<std::string>(mod);
  s = s.substr(0, s.find('.'));
  return s == "jaxlib" ? "jax" : s;
}

// Whether obj's type comes from JAX (jax.Array, its tracers), without importing JAX:
// the type's module is read once per type and cached.
bool is_jax(nb::handle obj) {
  constexpr int kEntries = 8;
  static PyTypeObject* types[kEntries];
  static bool jax[kEntries];
  static int used = 0;
  PyTypeObject* type = Py_TYPE(obj.ptr());
  for (int i = 0; i < used; ++i)
    if (types[i] == type) return jax[i];
  const bool found = framework(obj) == "jax";
  if (used < kEntries) {
    Py_INCREF(type);  // the entry names the type for the process's lifetime
    types[used] = type;
    jax[used++] = found;
  }
  return found;
}

std::string arg_type_name(nb::handle obj) {
  const std::string fw = framework(obj);
  const char* name = Py_TYPE(obj.ptr())->tp_name;
  const char* dot = std::strrchr(name, '.');
  return (fw.empty() || fw == "builtins" ? "" : fw + ".") + (dot ? dot + 1 : name);
}

// The dtype the object reports, for messages ("complex64"), or "" when it has none.
std::string dtype_text(nb::handle obj) {
  nb::object dt = nb::getattr(obj, "dtype", nb::none());
  if (dt.is_none()) return "";
  std::string s = nb::cast<std::string>(nb::str(dt));
  return s.rfind("torch.", 0) == 0 ? s.substr(6) : s;
}

[[noreturn]] void fail_not_array(nb::handle obj, const char* name) {
  const std::string dt = dtype_text(obj);
  fail<TypeMismatch>(name, ": expected an array (NumPy, PyTorch, CuPy, JAX or any object with __dlpack__), got ",
                     arg_type_name(obj), dt.empty() ? "" : detail::concat(" of dtype ", dt),
                     is_jax(obj) ? " (inside jax.jit and other JAX transformations use pagedattn.jax)" : "");
}

// obj.__dlpack__(), called here rather than by nanobind so that a capsule the producer
// handed out before (and that was imported then) is refused instead of being imported a
// second time: two owners of one tensor, a double free. Null when obj has no __dlpack__.
// Sets *read_only from a versioned capsule's flags.
nb::object dlpack_capsule(nb::handle obj, const char* name, bool* read_only) {
  nb::object method = nb::getattr(obj, "__dlpack__", nb::none());
  if (method.is_none()) return nb::object();
  nb::object cap;
  try {
    try {
      cap = method("max_version"_a = nb::make_tuple(1, 0));
    } catch (const nb::python_error& e) {  // producers predating max_version
      if (!e.matches(PyExc_TypeError) && !e.matches(PyExc_BufferError)) throw;
      cap = method();
    }
  } catch (const nb::python_error& e) {
    if (is_jax(obj))  // a tracer: inside jax.jit, lax.scan, vmap, ... there is no array to hand over
      fail<TypeMismatch>(name, ": got a traced JAX value (", arg_type_name(obj), "), which has no memory to hand "
                         "over: inside jax.jit and other JAX transformations use pagedattn.jax");
    fail<TypeMismatch>(name, ": its __dlpack__() raised ", nb::cast<std::string>(nb::str(e.value())));
  }
  if (!PyCapsule_CheckExact(cap.ptr()))
    fail<TypeMismatch>(name, ": __dlpack__() returned ", arg_type_name(cap), ", not a DLPack capsule");
  const char* cname = PyCapsule_GetName(cap.ptr());
  if (cname == nullptr || std::strncmp(cname, "used_", 5) == 0)
    fail<InvalidArgument>(name, ": __dlpack__() returned a capsule that was already consumed (a DLPack capsule is "
                          "imported once; the producer must return a new capsule on every call)");
  if (std::strcmp(cname, "dltensor_versioned") == 0) {
    auto* m = static_cast<exchange::DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap.ptr(), cname));
    if (m == nullptr) PyErr_Clear();
    else *read_only = (m->flags & exchange::kFlagReadOnly) != 0;
  }
  return cap;
}

// Through nanobind's caster (buffer protocol or DLPack capsule); false when it refuses.
bool cast_ndarray(nb::handle obj, AnyArray* out) { return nb::try_cast(obj, *out, /*convert=*/false); }

// Whether a buffer-protocol object refuses writable access (a read-only NumPy array).
bool buffer_read_only(nb::handle obj) {
  if (!PyObject_CheckBuffer(obj.ptr())) return false;
  Py_buffer b;
  if (PyObject_GetBuffer(obj.ptr(), &b, PyBUF_WRITABLE | PyBUF_STRIDES) == 0) {
    PyBuffer_Release(&b);
    return false;
  }
  PyErr_Clear();
  return true;
}

std::uintptr_t stream_int(nb::handle v, const char* what) {
  nb::object idx = nb::steal(PyNumber_Index(v.ptr()));
  if (!idx.is_valid()) {
    PyErr_Clear();
    fail<TypeMismatch>("stream: ", what, " must be an int, got ", arg_type_name(v));
  }
  const long long s = PyLong_AsLongLong(idx.ptr());
  if ((s == -1 && PyErr_Occurred()) || s < 0) {
    PyErr_Clear();
    fail<TypeMismatch>("stream: expected a non-negative stream handle, got ",
                          nb::cast<std::string>(nb::repr(v)));
  }
  return static_cast<std::uintptr_t>(s);
}

}  // namespace

CallArrays::~CallArrays() {
  for (int i = 0; i < n_; ++i) exchange::release(owned_[i]);
}

void refuse_immutable(nb::handle obj, const char* name) {
  if (!is_numpy(obj) && is_jax(obj))
    fail<TypeMismatch>(name, ": got a JAX array, which is immutable: pagedattn never writes into one in place. "
                       "Use pagedattn.jax, whose paged_attention returns a new array and whose reshape_and_cache "
                       "returns the updated caches (under jax.jit too)");
}

int CallArrays::add(nb::handle obj, const char* name, bool written) {
  if (n_ >= kMax) fail<InvalidArgument>("internal: more than ", kMax, " arrays in one call");
  if (written) refuse_immutable(obj, name);
  const int i = n_;
  TensorView v;
  exchange::DLManagedTensorVersioned* owned = nullptr;
  const exchange::Api* api = exchange::api_of(obj.ptr());
  AnyArray& nd = nd_[i];
  if (api == nullptr || !exchange::convert(api, obj.ptr(), &v, &owned)) {
    api = nullptr;
    nb::handle src = obj;
    bool bf16 = false, capsule_read_only = false, from_capsule = false;
    if (!is_numpy(obj)) {
      keep_[i] = dlpack_capsule(obj, name, &capsule_read_only);
      from_capsule = keep_[i].is_valid();
      if (from_capsule) src = keep_[i];
    }
    if (!cast_ndarray(src, &nd)) {
      // NumPy has no bfloat16 of its own: ml_dtypes' bfloat16 arrays reach the core as
      // uint16 views of the same memory, retyped here.
      if (!is_numpy(obj) || dtype_text(obj) != "bfloat16") fail_not_array(obj, name);
      keep_[i] = obj.attr("view")(nb::handle(numpy().uint16));
      src = keep_[i];
      if (!cast_ndarray(src, &nd)) fail_not_array(obj, name);
      bf16 = true;
    }
    v = to_view(nd);
    if (bf16) v.dtype = DType::kBFloat16;
    // Writability: from the capsule when the array came as one, else from the buffer
    // protocol (a type may offer a buffer slot that always refuses, as CuPy's does).
    if (written) v.read_only = from_capsule ? capsule_read_only : buffer_read_only(obj);
  }
  if (v.dtype == DType::kOther) {
    exchange::release(owned);
    const std::string dt = dtype_text(obj);
    fail<TypeMismatch>(name, ": dtype ", dt.empty() ? std::string("(unknown)") : dt,
                       " is not supported (pagedattn takes float32, float16, bfloat16, float64, int32, int64, uint8 "
                       "and uint16 arrays, each where its argument allows)");
  }
  new (&slots_[i].view) TensorView(v);
  objects_[i] = nb::borrow(obj);
  owned_[i] = owned;
  apis_[i] = api;
  n_ = i + 1;
  return i;
}

int CallArrays::add_empty_like(int like, const char* name) {
  const TensorView& q = (*this)[like];
  if (apis_[like] != nullptr && n_ < kMax) {
    TensorView v;
    PyObject* fresh = exchange::allocate_like(apis_[like], q, &v);
    if (fresh != nullptr) {
      const int i = n_;
      new (&slots_[i].view) TensorView(v);
      objects_[i] = nb::steal(fresh);
      owned_[i] = nullptr;
      apis_[i] = apis_[like];
      n_ = i + 1;
      return i;
    }
  }
  nb::handle src = objects_[like];
  nb::list dims;
  for (int d = 0; d < q.ndim; ++d) dims.append(q.shape[static_cast<std::size_t>(d)]);
  nb::tuple shape(dims);
  const std::string fw = framework(src);
  nb::object fresh;
  bool jax = false;
  if (is_numpy(src)) {
    fresh = nb::handle(numpy().empty)(shape, "dtype"_a = src.attr("dtype"));
  } else if (fw == "torch") {
    fresh = nb::module_::import_("torch").attr("empty")(shape, "dtype"_a = src.attr("dtype"),
                                                         "device"_a = src.attr("device"));
  } else if (fw == "cupy") {
    nb::module_ cupy = nb::module_::import_("cupy");
    nb::object device = cupy.attr("cuda").attr("Device")(q.device_id);
    device.attr("__enter__")();
    try {
      fresh = cupy.attr("empty")(shape, "dtype"_a = src.attr("dtype"));
    } catch (...) {
      device.attr("__exit__")(nb::none(), nb::none(), nb::none());
      throw;
    }
    device.attr("__exit__")(nb::none(), nb::none(), nb::none());
  } else if (q.device == DeviceKind::kCPU || q.device == DeviceKind::kCUDAHost) {
    // Any other host array (JAX on the CPU, ...): a NumPy buffer of the same dtype.
    nb::object dt = q.dtype == DType::kBFloat16 ? nb::module_::import_("ml_dtypes").attr("bfloat16")
                                                : nb::object(nb::handle(numpy().dtype)(dtype_name(q.dtype)));
    fresh = nb::handle(numpy().empty)(shape, "dtype"_a = dt);
    jax = fw == "jax";
  } else {
    if (fw == "jax")
      fail<TypeMismatch>(name, ": cannot allocate an output like the query, a ", arg_type_name(src), " on cuda:",
                         q.device_id, " (JAX arrays are immutable): use pagedattn.jax.paged_attention, or pass out= "
                         "(a writable array of another framework, e.g. torch or CuPy)");
    fail<TypeMismatch>(name, ": cannot allocate an output like the query, a ", arg_type_name(src), " on cuda:",
                       q.device_id, "; pass out= (any writable DLPack array)");
  }
  const int i = add(fresh, name, /*written=*/true);
  if (jax) jax_result_ = i;
  return i;
}

void CallArrays::keep_only_numpy_objects() {
  for (int i = 0; i < n_; ++i)
    if (owned_[i] == nullptr && apis_[i] == nullptr && is_numpy(objects_[i])) {
      nd_[i] = AnyArray();
      keep_[i] = nb::object();
    }
}

nb::object CallArrays::result(int i) const {
  if (i == jax_result_) return nb::module_::import_("jax.numpy").attr("asarray")(objects_[i]);
  return objects_[i];
}

void* CallArrays::stream(nb::handle stream, int like) const {
  if (!stream.is_none()) return stream_handle(stream);
  const TensorView& v = (*this)[like];
  if (v.device != DeviceKind::kCUDA) return nullptr;
  void* s = nullptr;
  if (apis_[like] != nullptr && exchange::current_stream(apis_[like], v, &s)) return s;
  const std::string fw = framework(objects_[like]);
  if (fw == "torch") {
    nb::object cur = nb::module_::import_("torch").attr("cuda").attr("current_stream")(v.device_id);
    return reinterpret_cast<void*>(stream_int(cur.attr("cuda_stream"), "torch's current stream"));
  }
  if (fw == "cupy") {
    nb::module_ cupy = nb::module_::import_("cupy");
    nb::object device = cupy.attr("cuda").attr("Device")(v.device_id);
    device.attr("__enter__")();
    nb::object cur;
    try {
      cur = cupy.attr("cuda").attr("get_current_stream")();
    } catch (...) {
      device.attr("__exit__")(nb::none(), nb::none(), nb::none());
      throw;
    }
    device.attr("__exit__")(nb::none(), nb::none(), nb::none());
    return reinterpret_cast<void*>(stream_int(cur.attr("ptr"), "CuPy's current stream"));
  }
  return nullptr;
}

void* stream_handle(nb::handle stream) {
  if (stream.is_none()) return nullptr;
  if (PyLong_Check(stream.ptr()) && !PyBool_Check(stream.ptr()))
    return reinterpret_cast<void*>(stream_int(stream, "the handle"));
  nb::object proto = nb::getattr(stream, "__cuda_stream__", nb::none());
  if (!proto.is_none()) {
    nb::object value = PyCallable_Check(proto.ptr()) ? proto() : proto;
    if (nb::isinstance<nb::tuple>(value) && nb::len(value) == 2) value = value[1];
    return reinterpret_cast<void*>(stream_int(value, "__cuda_stream__"));
  }
  for (const char* attr : {"cuda_stream", "ptr", "handle"}) {
    nb::object h = nb::getattr(stream, attr, nb::none());
    if (PyLong_Check(h.ptr())) return reinterpret_cast<void*>(stream_int(h, attr));
  }
  if (PyIndex_Check(stream.ptr()) && !PyBool_Check(stream.ptr()))  // NumPy integers
    return reinterpret_cast<void*>(stream_int(stream, "the handle"));
  fail<TypeMismatch>("stream: expected an int handle or an object with __cuda_stream__ (a torch or CuPy stream), got ",
                     arg_type_name(stream));
}

}  // namespace pagedattn::py
