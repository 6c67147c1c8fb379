// Kernel selection for a decode call: the (dtype, kv-cache dtype, head size, layout)
// dispatch to one instantiated kernel, generated from the lists in supported.hpp, and
// the per-device set-up of that kernel (its shared-memory limit, its CTAs per
// multiprocessor).
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/decode_inst.cuh"
#include "params.hpp"
#include "pagedattn/supported.hpp"

namespace pagedattn::cuda_backend {

// The device element type of each supported dtype. A dtype added to supported::kDTypes
// without an entry here does not compile.
template <DType D>
struct CudaElement;
template <>
struct CudaElement<DType::kFloat32> {
  using type = float;
};
template <>
struct CudaElement<DType::kFloat16> {
  using type = __half;
};
template <>
struct CudaElement<DType::kBFloat16> {
  using type = __nv_bfloat16;
};

template <class Fn, std::size_t... I>
bool visit_dtype_impl(DType t, Fn& fn, std::index_sequence<I...>) {
  return ((t == supported::kDTypes[I] && (fn(std::integral_constant<DType, supported::kDTypes[I]>{}), true)) || ...);
}
// Calls fn(std::integral_constant<DType, t>{}) when t is in supported::kDTypes; returns
// whether it did.
template <class Fn>
bool visit_dtype(DType t, Fn&& fn) {
  return visit_dtype_impl(t, fn, std::make_index_sequence<supported::kDTypes.size()>{});
}

template <class Fn, std::size_t... I>
bool visit_kv_cache_dtype_impl(KVCacheDType k, Fn& fn, std::index_sequence<I...>) {
  return ((k == supported::kKVCacheDTypes[I] &&
           (fn(std::integral_constant<KVCacheDType, supported::kKVCacheDTypes[I]>{}), true)) ||
          ...);
}
// Calls fn(std::integral_constant<KVCacheDType, k>{}) when k is in
// supported::kKVCacheDTypes; returns whether it did.
template <class Fn>
bool visit_kv_cache_dtype(KVCacheDType k, Fn&& fn) {
  return visit_kv_cache_dtype_impl(k, fn, std::make_index_sequence<supported::kKVCacheDTypes.size()>{});
}

template <class T>
struct TypeTag {
  using type = T;
};

// pick(TypeTag<element type>{}, std::integral_constant<KVCacheDType, ...>{}) for p's query
// dtype and cache kind: the one dtype / cache-kind dispatch of every kernel family.
// Throws NotSupported for a combination without kernels.
template <class Pick>
DecodeKernelInfo select_by_types(const DecodeParams& p, Pick&& pick) {
  DecodeKernelInfo info;
  const bool found = visit_dtype(p.dtype, [&](auto dc) {
    using T = typename CudaElement<decltype(dc)::value>::type;
    if (!visit_kv_cache_dtype(p.kv_cache_dtype, [&](auto kc) { info = pick(TypeTag<T>{}, kc); }))
      fail<NotSupported>("kv_cache_dtype: \"", kv_cache_dtype_name(p.kv_cache_dtype),
                         "\" is not supported on CUDA");
  });
  if (!found)
    fail<NotSupported>("paged_attention (CUDA): dtype ", dtype_name(p.dtype), " is not supported; dtypes: ",
                       supported::dtypes_str());
  return info;
}

// The decode kernel that serves p (throws NotSupported for a combination without one).
DecodeKernelInfo select_kernel(const DecodeParams& p);

// Sets k up on `device` once (its dynamic shared-memory limit) and returns how many of
// its CTAs fit on one multiprocessor (the occupancy API; at least 1); `narrow`: of its
// narrow CTAs (narrow_threads, narrow_smem), where it has them.
int kernel_slots_per_sm(const DecodeKernelInfo& k, int device, bool narrow = false);

}  // namespace pagedattn::cuda_backend
