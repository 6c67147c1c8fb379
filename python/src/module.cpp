// pagedattn._core: the private compiled module behind the pure-Python package.
#include <nanobind/nanobind.h>

#include "bindings.hpp"
#include "pagedattn/pagedattn.hpp"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  m.doc() = "pagedattn compiled core (use the pagedattn package, not this module)";
  m.attr("__version__") = pagedattn::kVersion;
  m.attr("with_cuda") = pagedattn::built_with_cuda();

  // C++ exception types -> Python exception types (see errors.hpp).
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const pagedattn::TypeMismatch& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const pagedattn::OutOfRange& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const pagedattn::NotSupported& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const pagedattn::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const pagedattn::CudaError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  pagedattn::py::bind_attention(m);
  pagedattn::py::bind_block_manager(m);
  pagedattn::py::bind_cache_ops(m);
}
