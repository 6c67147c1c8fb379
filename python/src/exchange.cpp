#include "exchange.hpp"

#include <new>

namespace pagedattn::py::exchange {
namespace {

constexpr std::uint32_t kMajor = 1;  // the DLPack major version these layouts follow

struct CacheEntry {
  PyTypeObject* type = nullptr;  // a strong reference: the entry outlives nothing it names
  const Api* api = nullptr;
};

const Api* lookup(PyTypeObject* type) {
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (cap == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const ApiHeader* h = nullptr;
  if (PyCapsule_CheckExact(cap)) h = static_cast<const ApiHeader*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
  if (h == nullptr) PyErr_Clear();
  Py_DECREF(cap);  // the table is static in the producer; the type keeps it alive
  while (h != nullptr && h->version.major > kMajor) h = h->prev_api;
  if (h == nullptr || h->version.major != kMajor) return nullptr;
  const Api* api = reinterpret_cast<const Api*>(h);
  if (api->managed_tensor_from_py_object_no_sync == nullptr || api->current_work_stream == nullptr) return nullptr;
  return api;
}

void set_error(void* ctx, const char* kind, const char* message) {
  (void)ctx;
  (void)kind;
  PyErr_SetString(PyExc_RuntimeError, message ? message : "allocation failed");
}

bool to_dlpack_dtype(DType t, DLDataType* out) {
  switch (t) {
    case DType::kFloat32: *out = {2, 32, 1}; return true;
    case DType::kFloat16: *out = {2, 16, 1}; return true;
    case DType::kBFloat16: *out = {4, 16, 1}; return true;
    case DType::kFloat64: *out = {2, 64, 1}; return true;
    case DType::kInt32: *out = {0, 32, 1}; return true;
    case DType::kInt64: *out = {0, 64, 1}; return true;
    case DType::kUInt8: *out = {1, 8, 1}; return true;
    case DType::kUInt16: *out = {1, 16, 1}; return true;
    default: return false;
  }
}

std::int32_t dlpack_device_type(DeviceKind d) {
  switch (d) {
    case DeviceKind::kCPU: return 1;
    case DeviceKind::kCUDA: return 2;
    case DeviceKind::kCUDAHost: return 3;
    default: return 0;
  }
}

}  // namespace

const Api* api_of(PyObject* obj) {
  // Called with the GIL held; a handful of array types per process.
  constexpr int kEntries = 8;
  static CacheEntry cache[kEntries];
  static int used = 0;
  PyTypeObject* type = Py_TYPE(obj);
  for (int i = 0; i < used; ++i)
    if (cache[i].type == type) return cache[i].api;
  const Api* api = lookup(type);
  if (used < kEntries) {
    Py_INCREF(type);
    cache[used++] = CacheEntry{type, api};
  }
  return api;
}

PyObject* allocate_like(const Api* api, const TensorView& prototype, TensorView* view) {
  if (api->managed_tensor_allocator == nullptr || api->managed_tensor_to_py_object_no_sync == nullptr) return nullptr;
  DLTensor proto{};
  if (!to_dlpack_dtype(prototype.dtype, &proto.dtype)) return nullptr;
  std::int64_t shape[TensorView::kMaxDims];
  for (int i = 0; i < prototype.ndim; ++i) shape[i] = prototype.shape[static_cast<std::size_t>(i)];
  proto.ndim = prototype.ndim;
  proto.shape = shape;
  proto.device = DLDevice{dlpack_device_type(prototype.device), prototype.device_id};
  DLManagedTensorVersioned* m = nullptr;
  if (api->managed_tensor_allocator(&proto, &m, nullptr, &set_error) != 0 || m == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  TensorView v;
  try {
    v = from_dlpack(m->dl_tensor);
  } catch (...) {
    if (m->deleter) m->deleter(m);
    return nullptr;
  }
  void* obj = nullptr;
  if (api->managed_tensor_to_py_object_no_sync(m, &obj) != 0 || obj == nullptr) {  // ownership passed on
    PyErr_Clear();
    return nullptr;
  }
  *view = v;
  return static_cast<PyObject*>(obj);
}

bool current_stream(const Api* api, const TensorView& v, void** stream) {
  *stream = nullptr;
  if (v.device != DeviceKind::kCUDA) return true;
  if (api->current_work_stream(dlpack_device_type(v.device), v.device_id, stream) != 0) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool convert(const Api* api, PyObject* obj, TensorView* view, DLManagedTensorVersioned** owned) {
  *owned = nullptr;
  if (api->dltensor_from_py_object_no_sync != nullptr) {
    DLTensor t{};
    if (api->dltensor_from_py_object_no_sync(obj, &t) != 0) {
      PyErr_Clear();
      return false;
    }
    *view = from_dlpack(t);  // shape and strides copied while guaranteed
    return true;
  }
  DLManagedTensorVersioned* m = nullptr;
  if (api->managed_tensor_from_py_object_no_sync(obj, &m) != 0 || m == nullptr) {
    PyErr_Clear();
    return false;
  }
  try {
    *view = from_dlpack(m->dl_tensor);
  } catch (...) {
    release(m);
    throw;
  }
  view->read_only = (m->flags & kFlagReadOnly) != 0;
  *owned = m;
  return true;
}

}  // namespace pagedattn::py::exchange
