// Checks and writes of the caller-provided host arrays the block manager fills (step
// metadata and exports). Arrays may have any strides.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>

#include "checked_math.hpp"
#include <vector>

#include "pagedattn/errors.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn::host_out {

inline void check_host(const TensorView& t, const char* what, const char* name) {
  if (t.device != DeviceKind::kCPU && t.device != DeviceKind::kCUDAHost)
    fail<TypeMismatch>(what, ": ", name, " must be a host (CPU) array, got device ", device_name(t.device));
}

// An int32 array with ndim dimensions (shapes are checked by the caller).
inline void check_int32(const TensorView& t, const char* what, const char* name, int ndim) {
  check_host(t, what, name);
  if (t.dtype != DType::kInt32)
    fail<TypeMismatch>(what, ": ", name, " must be int32, got ", dtype_name(t.dtype));
  if (t.ndim != ndim)
    fail<InvalidArgument>(what, ": ", name, " must have ", ndim, " dimension(s), got ", t.shape_str());
}

// An int32 (or, with allow_int64, int64) vector [len] (with at_least: [L], L >= len); null =
// not requested.
inline void check_vec(const TensorView* t, const char* what, const char* name, std::int64_t len,
                      bool allow_int64, bool at_least = false) {
  if (!t) return;
  check_host(*t, what, name);
  const bool ok = t->dtype == DType::kInt32 || (allow_int64 && t->dtype == DType::kInt64);
  if (!ok)
    fail<TypeMismatch>(what, ": ", name, " must be ", allow_int64 ? "int64 or int32" : "int32", ", got ",
                       dtype_name(t->dtype));
  if (t->ndim != 1 || (at_least ? t->shape[0] < len : t->shape[0] != len))
    fail<InvalidArgument>(what, ": ", name, " must have shape [", at_least ? "L" : "",
                          at_least ? "] with L >= " : "", len, at_least ? "" : "]", ", got ", t->shape_str());
}

// An int32 block table [rows, M] with M >= min_cols (with at_least: [R, M], R >= rows); null =
// not requested.
inline void check_table(const TensorView* t, const char* what, std::int64_t rows, std::int64_t min_cols,
                        bool at_least = false) {
  if (!t) return;
  check_host(*t, what, "block_tables");
  if (t->dtype != DType::kInt32)
    fail<TypeMismatch>(what, ": block_tables must be int32, got ", dtype_name(t->dtype));
  if (t->ndim != 2 || (at_least ? t->shape[0] < rows : t->shape[0] != rows) || t->shape[1] < min_cols) {
    if (at_least)
      fail<InvalidArgument>(what, ": block_tables must have shape [R, M] with R >= ", rows,
                            " and M >= ", min_cols, ", got ", t->shape_str());
    fail<InvalidArgument>(what, ": block_tables must have shape [", rows, ", M] with M >= ", min_cols,
                          ", got ", t->shape_str());
  }
}

// ---- memory overlap -------------------------------------------------------------------
// The arrays a call writes must not share memory with the arrays it reads (an input would
// change while it is used: wrong sizes, writes past an array) nor with each other.

// Bytes [lo, hi) an array's elements span; lo == hi when it has none.
struct ByteRange {
  std::uintptr_t lo = 0, hi = 0;
  const char* name = "";
};

using detail::add_ok;
using detail::mul_ok;

inline ByteRange byte_range(const void* data, std::int64_t n, std::size_t elem, const char* name) {
  if (data == nullptr || n <= 0) return ByteRange{0, 0, name};
  const auto lo = reinterpret_cast<std::uintptr_t>(data);
  return ByteRange{lo, lo + static_cast<std::uintptr_t>(n) * elem, name};  // n elements exist: no overflow
}

inline ByteRange byte_range(const TensorView* t, const char* what, const char* name) {
  if (t == nullptr || t->data == nullptr) return ByteRange{0, 0, name};
  for (int d = 0; d < t->ndim; ++d)
    if (t->shape[static_cast<std::size_t>(d)] <= 0) return ByteRange{0, 0, name};
  const auto es = static_cast<std::int64_t>(std::max<std::size_t>(dtype_size(t->dtype), 1));
  std::int64_t lo = 0, hi = 0;  // element offsets of the lowest and highest element reached
  bool ok = true;
  for (int d = 0; d < t->ndim && ok; ++d) {
    const auto i = static_cast<std::size_t>(d);
    std::int64_t span = 0;
    ok = mul_ok(t->shape[i] - 1, t->strides[i], &span) &&
         add_ok(span < 0 ? lo : hi, span, span < 0 ? &lo : &hi);
  }
  ok = ok && mul_ok(lo, es, &lo) && mul_ok(hi, es, &hi) && add_ok(hi, es, &hi);
  if (!ok)
    fail<InvalidArgument>(what, ": ", name, " with shape ", t->shape_str(), " spans more than 2^63 bytes");
  const auto base = reinterpret_cast<std::uintptr_t>(t->data);
  return ByteRange{base + static_cast<std::uintptr_t>(lo), base + static_cast<std::uintptr_t>(hi), name};
}

inline bool overlap(const ByteRange& a, const ByteRange& b) {
  return a.lo != a.hi && b.lo != b.hi && a.lo < b.hi && b.lo < a.hi;
}

// Throws InvalidArgument naming both arrays when an output shares memory with an input or
// with another output.
inline void check_disjoint(const char* what, std::initializer_list<ByteRange> outputs,
                           std::initializer_list<ByteRange> inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (const ByteRange& in : inputs)
      if (overlap(*o, in))
        fail<InvalidArgument>(what, ": output ", o->name, " overlaps input ", in.name,
                              " in memory; outputs must not share memory with the inputs or with each other");
    for (auto p = std::next(o); p != outputs.end(); ++p)
      if (overlap(*o, *p))
        fail<InvalidArgument>(what, ": output ", o->name, " overlaps output ", p->name,
                              " in memory; outputs must not share memory with the inputs or with each other");
  }
}

inline std::int32_t& at32(const TensorView& t, std::int64_t i) {
  return t.ptr<std::int32_t>()[i * t.strides[0]];
}

// Writes a slot into an int64 or int32 vector.
inline void put_slot(const TensorView& t, std::int64_t i, std::int64_t v) {
  if (t.dtype == DType::kInt64)
    t.ptr<std::int64_t>()[i * t.strides[0]] = v;
  else
    t.ptr<std::int32_t>()[i * t.strides[0]] = static_cast<std::int32_t>(v);
}

// Writes one block-table row: the blocks (released ones as pad), then pad up to the width.
inline void write_row(const TensorView& t, std::int64_t row, const std::vector<std::int32_t>& blocks,
                      std::int32_t pad) {
  std::int32_t* p = t.ptr<std::int32_t>() + row * t.strides[0];
  const std::int64_t cols = t.shape[1], s1 = t.strides[1];
  const auto nb = static_cast<std::int64_t>(blocks.size());
  if (s1 == 1) {
    for (std::int64_t k = 0; k < nb; ++k) {
      const std::int32_t b = blocks[static_cast<std::size_t>(k)];
      p[k] = b < 0 ? pad : b;
    }
    std::fill(p + nb, p + cols, pad);
  } else {
    for (std::int64_t k = 0; k < cols; ++k) {
      const std::int32_t b = k < nb ? blocks[static_cast<std::size_t>(k)] : pad;
      p[k * s1] = b < 0 ? pad : b;
    }
  }
}

}  // namespace pagedattn::host_out
