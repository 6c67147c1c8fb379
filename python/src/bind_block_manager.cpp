// Placeholder-free stub: replaced by the block manager bindings.
#include "bindings.hpp"

namespace pagedattn::py {
void bind_block_manager(nanobind::module_&) {}
}  // namespace pagedattn::py
