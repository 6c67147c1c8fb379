// The arguments of one call from Python, converted once in C++: every array (through its
// type's DLPack C exchange table when it offers one, else nanobind's buffer-protocol /
// __dlpack__ caster; NumPy bfloat16 through a uint16 view), the output array when the
// caller passes none, and the CUDA stream. The Python layer only forwards its arguments.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <optional>
#include <vector>

#include "exchange.hpp"
#include "ndarray.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn::py {

namespace nb = nanobind;

// The arrays of a call. Each is converted once and what its producer handed out is held
// until the object dies: for an eager call, the call; for a prepared call, its lifetime
// (with a strong reference to every Python object, so the arrays outlive every run).
class CallArrays {
 public:
  static constexpr int kMax = 12;  // a decode call: 5 arrays, 5 optional ones, its output
  CallArrays() = default;
  CallArrays(const CallArrays&) = delete;
  CallArrays& operator=(const CallArrays&) = delete;
  ~CallArrays();

  // Converts `obj`, the argument `name`; returns its index. `written`: the call writes
  // into it, so a read-only array is flagged (TensorView::read_only) for the validator.
  // Throws TypeMismatch naming the argument when `obj` is not an array.
  int add(nb::handle obj, const char* name, bool written = false);
  // add() for an optional argument: -1 for None.
  int add_optional(nb::handle obj, const char* name, bool written = false) {
    return obj.is_none() ? -1 : add(obj, name, written);
  }
  const TensorView& operator[](int i) const { return slots_[i].view; }
  nb::handle object(int i) const { return objects_[i]; }

  // A new array like array `like` (kind, dtype, shape, device), made by the framework
  // that made `like`, added as the argument `name`; returns its index. Throws TypeMismatch
  // when that framework cannot be asked for one (pass out=).
  int add_empty_like(int like, const char* name);
  // The object to return for array i: the array itself, or for an output allocated for an
  // immutable framework's host array (JAX), that framework's array of the result.
  nb::object result(int i) const;

  // Drops what conversion holds besides the caller's objects where those alone keep the
  // memory alive (NumPy arrays, whose export never copies): then every reference this
  // object holds is one traverse() visits, so a cycle through it can be collected.
  void keep_only_numpy_objects();

  // Visits the Python objects held (for the garbage collector of an object that owns
  // this: a prepared call).
  int traverse(visitproc visit, void* arg) const {
    for (int i = 0; i < n_; ++i) {
      Py_VISIT(objects_[i].ptr());
      Py_VISIT(keep_[i].ptr());
    }
    return 0;
  }

  // The CUDA stream of the call: `stream` as given (an int handle, or an object with
  // __cuda_stream__ or a cuda_stream / ptr / handle attribute), else, for arrays on a GPU,
  // the current stream that array `like`'s framework reports for its device (null: the
  // default stream).
  void* stream(nb::handle stream, int like) const;

 private:
  union Slot {
    Slot() {}  // constructed by add() only: an eager call converts 5-8 arrays
    TensorView view;
  };
  Slot slots_[kMax];
  nb::object objects_[kMax];                          // the caller's objects (strong references)
  nb::object keep_[kMax];                             // the uint16 view of a NumPy bfloat16 array
  AnyArray nd_[kMax];                                 // what nanobind's caster holds
  exchange::DLManagedTensorVersioned* owned_[kMax];   // released in the destructor
  const exchange::Api* apis_[kMax];                   // null: converted by nanobind
  int n_ = 0;
  int jax_result_ = -1;  // index of an output allocated in NumPy for a JAX host array
};

// Any number of arrays (copy_blocks takes every layer's caches): CallArrays of kMax
// arrays each, filled in turn.
class ArrayList {
 public:
  int add(nb::handle obj, const char* name, bool written = false) {
    if (chunks_.empty() || used_ == CallArrays::kMax) {
      chunks_.push_back(std::make_unique<CallArrays>());
      used_ = 0;
    }
    chunks_.back()->add(obj, name, written);
    ++used_;
    return static_cast<int>(size()) - 1;
  }
  std::size_t size() const { return chunks_.empty() ? 0 : (chunks_.size() - 1) * CallArrays::kMax + used_; }
  const TensorView& operator[](std::size_t i) const {
    return (*chunks_[i / CallArrays::kMax])[static_cast<int>(i % CallArrays::kMax)];
  }
  // The stream of the call, as CallArrays::stream for array `like`.
  void* stream(nb::handle stream, std::size_t like) const {
    return chunks_[like / CallArrays::kMax]->stream(stream, static_cast<int>(like % CallArrays::kMax));
  }

 private:
  std::vector<std::unique_ptr<CallArrays>> chunks_;
  int used_ = 0;
};

// A stream argument alone (for run() of a prepared call): null for None.
void* stream_handle(nb::handle stream);

// Throws TypeMismatch naming `name` when obj is a JAX array: an argument pagedattn writes
// into must never be one (they are immutable; pagedattn.jax is the functional form).
// Never imports JAX. CallArrays::add() calls it for every written argument.
void refuse_immutable(nb::handle obj, const char* name);

}  // namespace pagedattn::py
