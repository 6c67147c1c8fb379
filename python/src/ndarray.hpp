// Turns nanobind ndarrays (any framework, any device; used by call_args.cpp for arrays
// whose type offers no DLPack exchange table)
// into the core's non-owning TensorView.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "pagedattn/tensor.hpp"

namespace pagedattn::py {

namespace nb = nanobind;

// Any array: no dtype, shape, device or order constraint (the core validates).
using AnyArray = nb::ndarray<nb::ro>;
using AnyMutArray = nb::ndarray<>;

TensorView to_view(const AnyArray& a);
TensorView to_view(const AnyMutArray& a);

// Stream argument as passed from Python: an integer handle (0 = default stream).
inline void* to_stream(std::uintptr_t handle) { return reinterpret_cast<void*>(handle); }

}  // namespace pagedattn::py
