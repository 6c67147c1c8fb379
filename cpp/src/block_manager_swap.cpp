// BlockManager: swap planning. swap_out() maps the sequences' GPU blocks to CPU blocks and
// swap_in() maps them back; the returned pairs are what swap_blocks must copy.
#include "block_manager_impl.hpp"

namespace pagedattn {

namespace {
void check_no_pending(std::int64_t pending, const char* what) {
  if (pending > 0)
    fail<InvalidArgument>(what, ": ", pending,
                          " copy-on-write pair(s) are pending; take_copy_pairs() and run copy_blocks first");
}
}  // namespace

void BlockManager::swap_out(const std::int64_t* seq_ids, std::int64_t n, BlockPairs& pairs) {
  Impl& d = *impl_;
  if (d.opt.num_cpu_blocks == 0)
    fail<InvalidArgument>("swap_out: this manager has no CPU pool (num_cpu_blocks=0)");
  check_no_pending(num_pending_copies(), "swap_out");
  d.resolve_batch(seq_ids, n, "swap_out", false);
  const std::int64_t need = d.distinct_blocks_of_scratch();
  if (need > d.cpu_pool.num_free())
    fail<OutOfBlocks>("swap_out: ", n, " sequence(s) need ", need, " CPU block(s); ", d.cpu_pool.num_free(),
                      " free");
  pairs.reserve(pairs.size() + static_cast<std::size_t>(need));
  // Map every distinct GPU block to a CPU block (first use in table order), then release
  // the GPU blocks, last block first (as free() does).
  d.next_block_stamp();
  for (const std::int32_t idx : d.scratch_idx) {
    Impl::Seq& s = d.seq_at(idx);
    for (std::int32_t& b : s.blocks) {
      if (b < 0) continue;
      const auto bi = static_cast<std::size_t>(b);
      if (d.block_stamp[bi] != d.bstamp) {
        d.block_stamp[bi] = d.bstamp;
        bool unused = false;
        const std::int32_t c = d.cpu_pool.take(&unused);
        d.cpu_pool.set_ref(c, 0);
        d.block_mark[bi] = c;
        pairs.emplace_back(b, c);
      }
      d.cpu_pool.add_ref(d.block_mark[bi]);
    }
    for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) {
      if (*it < 0) continue;
      const std::int32_t b = *it;
      *it = d.block_mark[static_cast<std::size_t>(b)];
      d.release_block(b);
    }
    s.swapped = true;
    Impl::mark_dirty(s, 0);
  }
}

void BlockManager::swap_in(const std::int64_t* seq_ids, std::int64_t n, BlockPairs& pairs) {
  Impl& d = *impl_;
  if (d.opt.num_cpu_blocks == 0)
    fail<InvalidArgument>("swap_in: this manager has no CPU pool (num_cpu_blocks=0)");
  check_no_pending(num_pending_copies(), "swap_in");
  d.resolve_batch(seq_ids, n, "swap_in", true);
  const std::int64_t need = d.distinct_blocks_of_scratch();
  if (need > d.pool.num_available() - d.watermark_blocks)
    fail<OutOfBlocks>("swap_in: ", n, " sequence(s) need ", need, " block(s); ", d.pool.num_available(),
                      " available, ", d.watermark_blocks, " kept free by the watermark");
  pairs.reserve(pairs.size() + static_cast<std::size_t>(need));
  d.next_block_stamp();
  for (const std::int32_t idx : d.scratch_idx) {
    Impl::Seq& s = d.seq_at(idx);
    for (std::int32_t& c : s.blocks) {
      if (c < 0) continue;
      const auto ci = static_cast<std::size_t>(c);
      if (d.block_stamp[ci] != d.bstamp) {
        d.block_stamp[ci] = d.bstamp;
        const std::int32_t g = d.take_block();
        d.pool.set_ref(g, 0);
        d.block_mark[ci] = g;
        pairs.emplace_back(c, g);
      }
      const std::int32_t g = d.block_mark[ci];
      d.pool.add_ref(g);
      d.cpu_pool.release(c, false);
      c = g;
    }
    s.swapped = false;
    Impl::mark_dirty(s, 0);
  }
}

}  // namespace pagedattn
