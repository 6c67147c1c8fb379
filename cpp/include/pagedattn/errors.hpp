// Exception types thrown by the pagedattn core.
//
// Every error the library raises derives from one of the standard exception
// classes, so C++ callers can catch either the precise type or the std base.
// The Python bindings map them to Python exceptions:
//   InvalidArgument -> ValueError      (bad shape, value, layout, option)
//   TypeMismatch    -> TypeError       (wrong dtype or device kind)
//   OutOfRange      -> IndexError      (a block id, slot or length outside its range)
//   NotSupported    -> ValueError      (a valid request this build cannot serve)
//   CudaError       -> RuntimeError    (a CUDA runtime call failed)
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
