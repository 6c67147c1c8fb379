// One function per binding source file; module.cpp calls them all.
#pragma once

#include <nanobind/nanobind.h>

namespace pagedattn::py {

void bind_errors(nanobind::module_& m);         // errors.cpp: the one C++ -> Python exception translation

void bind_attention(nanobind::module_& m);      // bind_attention.cpp
void bind_block_manager(nanobind::module_& m);  // bind_block_manager.cpp
void bind_cache_ops(nanobind::module_& m);      // bind_cache_ops.cpp (copy_blocks, swap_blocks)

}  // namespace pagedattn::py
