// Filled in by the cache-operations work (copy_blocks, swap_blocks).
#include "bindings.hpp"

namespace pagedattn::py {
void bind_cache_ops(nanobind::module_&) {}
}  // namespace pagedattn::py
