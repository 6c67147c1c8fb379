// BlockPool construction (the per-block operations are inline in block_pool.hpp: they run
// for every block of every step).
#include "block_pool.hpp"

namespace pagedattn {

BlockPool::BlockPool(std::int32_t num_blocks, bool with_lru) {
  const auto nb = static_cast<std::size_t>(num_blocks);
  ref_.assign(nb, 0);
  free_.resize(nb);
  for (std::size_t i = 0; i < nb; ++i) free_[i] = static_cast<std::int32_t>(nb - 1 - i);  // block 0 on top
  if (with_lru) {
    lru_prev_.assign(nb + 1, static_cast<std::int32_t>(nb));
    lru_next_.assign(nb + 1, static_cast<std::int32_t>(nb));
  }
}

}  // namespace pagedattn
