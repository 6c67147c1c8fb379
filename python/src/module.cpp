// pagedattn._core: the private compiled module behind the pure-Python package.
#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "pagedattn/pagedattn.hpp"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  m.doc() = "pagedattn compiled core (use the pagedattn package, not this module)";
  m.attr("__version__") = pagedattn::kVersion;
  m.attr("with_cuda") = pagedattn::built_with_cuda();

  pagedattn::py::bind_errors(m);  // C++ exception types -> Python exception types (errors.cpp)
  pagedattn::py::bind_attention(m);
  pagedattn::py::bind_block_manager(m);
  pagedattn::py::bind_cache_ops(m);
  pagedattn::py::bind_jax_ffi(m);
  pagedattn::py::bind_fp8(m);
}
