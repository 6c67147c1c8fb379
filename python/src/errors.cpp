// The one translation of library exceptions (pagedattn/errors.hpp) into Python exceptions.
#include "pagedattn/errors.hpp"

#include <nanobind/nanobind.h>

#include "bindings.hpp"

namespace pagedattn::py {

namespace nb = nanobind;

namespace {
// Created once per process (the module is initialised once) and owned by the module from
// then on; the translation reads it through this pointer.
PyObject* out_of_blocks = nullptr;
}  // namespace

bool set_python_error(const std::exception_ptr& p, bool all) {
  try {
    std::rethrow_exception(p);
  } catch (const TypeMismatch& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const OutOfRange& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const NotSupported& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const CudaError& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const OutOfBlocks& e) {
    PyErr_SetString(out_of_blocks, e.what());
  } catch (const UnknownSequence& e) {
    PyErr_SetString(PyExc_KeyError, e.what());
  } catch (nb::python_error& e) {
    if (!all) throw;
    e.restore();
  } catch (const std::bad_alloc&) {
    if (!all) throw;
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    if (!all) throw;
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    if (!all) throw;
    PyErr_SetString(PyExc_RuntimeError, "pagedattn: unknown C++ exception");
  }
  return true;
}

void bind_errors(nb::module_& m) {
  out_of_blocks = PyErr_NewExceptionWithDoc(
      "pagedattn._core.OutOfBlocksError",
      "Raised when the block pool (or the CPU pool, or the watermark) cannot serve a request.\n"
      "The manager is left exactly as it was before the call.",
      PyExc_RuntimeError, nullptr);
  if (!out_of_blocks) throw nb::python_error();
  m.attr("OutOfBlocksError") = nb::handle(out_of_blocks);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) { set_python_error(p, false); });
}

}  // namespace pagedattn::py
