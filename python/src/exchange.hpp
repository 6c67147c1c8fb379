// The DLPack C exchange protocol (`__dlpack_c_exchange_api__`, DLPack 1.3): a producer
// type (torch.Tensor since torch 2.11, ...) offers a table of C functions that convert
// its arrays to DLTensors and report the current stream of a device, with no
// Python-level call. The call arguments (call_args.hpp) use it for every array whose
// type offers it (the lowest host cost per call), and nanobind's ndarray caster otherwise.
//
// The structs below restate the layouts fixed by the DLPack specification; only the
// fields this file reads are named meaningfully.
#pragma once

#include <Python.h>

#include <cstdint>

#include "pagedattn/tensor.hpp"

namespace pagedattn::py::exchange {

struct DLDevice {
  std::int32_t device_type;  // DLDeviceType: 1 CPU, 2 CUDA, 3 CUDA host
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLPackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  std::uint64_t flags;
  DLTensor dl_tensor;
};
struct ApiHeader {
  DLPackVersion version;
  ApiHeader* prev_api;
};
struct Api {
  ApiHeader header;
  int (*managed_tensor_allocator)(DLTensor* prototype, DLManagedTensorVersioned** out, void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind, const char* message));
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, DLManagedTensorVersioned** out);
  int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned* tensor, void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);  // may be null
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out_stream);
};

constexpr std::uint64_t kFlagReadOnly = 1;  // DLPACK_FLAG_BITMASK_READ_ONLY

// The exchange table of `obj`'s type, or null when the type offers none (or one of an
// unsupported major version). Looked up once per type and cached.
const Api* api_of(PyObject* obj);

// A new contiguous array like `prototype` (dtype, shape, device) made by the producer
// of `api`; returns a new reference to the Python object and its view, or null with
// the Python error cleared when the producer cannot allocate.
PyObject* allocate_like(const Api* api, const TensorView& prototype, TensorView* view);

// The producer's current stream for the view's device into `*stream` (null for host
// arrays); false (Python error cleared) when the producer cannot say.
bool current_stream(const Api* api, const TensorView& v, void** stream);

// Converts `obj` through `api` into `*view` (shape and strides copied). Sets `*owned` to
// the tensor the producer handed out (null when it lent a view): the caller releases it
// with release() once the call is over. False (Python error cleared) when the producer
// refuses the object.
bool convert(const Api* api, PyObject* obj, TensorView* view, DLManagedTensorVersioned** owned);
inline void release(DLManagedTensorVersioned* owned) {
  if (owned != nullptr && owned->deleter != nullptr) owned->deleter(owned);
}

}  // namespace pagedattn::py::exchange
