// Exception types thrown by the pagedattn library: every one it defines is declared here.
//
// Each derives from a standard exception class, so C++ callers can catch either the
// precise type or the std base. The Python bindings translate them in one place
// (python/src/errors.cpp):
//   InvalidArgument -> ValueError        (bad shape, value, layout, option)
//   TypeMismatch    -> TypeError         (wrong dtype or device kind)
//   OutOfRange      -> IndexError        (a block id, slot or length outside its range)
//   NotSupported    -> ValueError        (a valid request this build cannot serve)
//   CudaError       -> RuntimeError      (a CUDA runtime call failed)
//   OutOfBlocks     -> OutOfBlocksError  (a RuntimeError: the block manager's pool cannot serve a request)
//   UnknownSequence -> KeyError          (a sequence id the block manager does not hold)
// A broken block-manager invariant (BlockManager::check_invariants) is a std::logic_error
// (RuntimeError): it is a bug in the library, not an input error.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace pagedattn {

struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct TypeMismatch : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct OutOfRange : std::out_of_range {
  using std::out_of_range::out_of_range;
};
struct NotSupported : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Not enough blocks (GPU pool, CPU pool, or the watermark) for a block-manager request;
// the manager is unchanged.
struct OutOfBlocks : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A sequence id that the block manager does not hold (never added, or already freed).
struct UnknownSequence : std::out_of_range {
  using std::out_of_range::out_of_range;
};

namespace detail {
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}
}  // namespace detail

// Throws E with the concatenation of the message parts.
template <class E, class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw E(detail::concat(std::forward<Parts>(parts)...));
}

}  // namespace pagedattn
