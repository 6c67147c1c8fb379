// One function per binding source file; module.cpp calls them all.
#pragma once

#include <nanobind/nanobind.h>

#include <exception>

namespace pagedattn::py {

void bind_errors(nanobind::module_& m);
// Sets the Python error for the library exception in `p` (errors.hpp's types); with `all`,
// for any exception (Python errors restored, bad_alloc as MemoryError, others as
// RuntimeError), else rethrows the others. For functions called without nanobind's dispatch.
bool set_python_error(const std::exception_ptr& p, bool all);         // errors.cpp: the one C++ -> Python exception translation

void bind_attention(nanobind::module_& m);      // bind_attention.cpp
void bind_block_manager(nanobind::module_& m);  // bind_block_manager.cpp
void bind_cache_ops(nanobind::module_& m);      // bind_cache_ops.cpp (copy_blocks, swap_blocks)
void bind_jax_ffi(nanobind::module_& m);        // jax_ffi.cpp (XLA FFI handlers for pagedattn.jax)
void bind_fp8(nanobind::module_& m);            // bind_fp8.cpp (quantize_fp8, dequantize_fp8)

}  // namespace pagedattn::py
