#include "ndarray.hpp"

namespace pagedattn::py {
namespace {

template <class Array>
TensorView convert(const Array& a) {
  TensorView v;
  if (a.ndim() > static_cast<size_t>(TensorView::kMaxDims))
    fail<InvalidArgument>("arrays of at most ", TensorView::kMaxDims, " dimensions are supported, got ", a.ndim());
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  const nb::dlpack::dtype dt = a.dtype();
  v.dtype = detail::dtype_from_dlpack(dt.code, dt.bits, dt.lanes);
  v.device = detail::device_from_dlpack(a.device_type());
  v.device_id = a.device_id();
  v.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[static_cast<size_t>(i)] = static_cast<std::int64_t>(a.shape(static_cast<size_t>(i)));
    v.strides[static_cast<size_t>(i)] = static_cast<std::int64_t>(a.stride(static_cast<size_t>(i)));
  }
  return v;
}

}  // namespace

TensorView to_view(const AnyArray& a) { return convert(a); }
TensorView to_view(const AnyMutArray& a) { return convert(a); }

}  // namespace pagedattn::py
