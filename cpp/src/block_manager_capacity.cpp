// BlockManager: how many blocks a request needs, and the can_* queries that compare it
// with what the pools can serve. The mutating calls use the same demand functions, so a
// query and the call it predicts always agree.
#include <algorithm>
#include <limits>

#include "block_manager_impl.hpp"

namespace pagedattn {

void BlockManager::Impl::next_block_stamp() const {
  if (++bstamp == 0) {
    std::fill(block_stamp.begin(), block_stamp.end(), 0u);
    bstamp = 1;
  }
}

std::int64_t BlockManager::Impl::append_demand(const Seq& s, std::int64_t n) const {
  if (n <= 0) return 0;
  const auto len = static_cast<std::int64_t>(s.tokens.size());
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  if (n > kMax - len) return kMax;  // more tokens than int64 can count: no pool serves it
  std::int64_t need = blocks_for(len + n) - static_cast<std::int64_t>(s.blocks.size());
  if (offset_of(len) != 0 && pool.ref(s.blocks.back()) > 1) ++need;  // copy-on-write
  return need;
}

std::int64_t BlockManager::Impl::batch_append_demand() const {
  next_block_stamp();
  std::int64_t need = 0;
  for (const std::int32_t idx : scratch_idx) need += append_one_demand(seq_at(idx));
  return need;
}

std::int64_t BlockManager::Impl::shared_append_demand(const Seq& s) const {
  const auto last = static_cast<std::size_t>(s.blocks.back());
  if (block_stamp[last] != bstamp) {
    block_stamp[last] = bstamp;
    block_mark[last] = 0;
  }
  if (pool.ref(s.blocks.back()) - block_mark[last] > 1) {
    ++block_mark[last];
    return 1;
  }
  return 0;
}

std::int64_t BlockManager::Impl::distinct_blocks_of_scratch() const {
  // The same stamp arrays serve both pools (sized for the larger one).
  next_block_stamp();
  std::int64_t distinct = 0;
  for (const std::int32_t idx : scratch_idx) {
    for (const std::int32_t b : seq_at(idx).blocks) {
      if (b < 0 || block_stamp[static_cast<std::size_t>(b)] == bstamp) continue;
      block_stamp[static_cast<std::size_t>(b)] = bstamp;
      ++distinct;
    }
  }
  return distinct;
}

std::int64_t BlockManager::blocks_for(std::int64_t n) const { return impl_->blocks_for(n); }

bool BlockManager::can_allocate(const std::int32_t* tokens, std::int64_t n, std::uint64_t extra_key) const {
  const Impl& d = *impl_;
  if (n < 0) fail<InvalidArgument>("can_allocate: num_tokens = ", n, " must be >= 0");
  std::int64_t from_lru = 0;
  const std::int64_t hits = d.count_prefix_hits(tokens, n, extra_key, &from_lru, nullptr, nullptr);
  return d.blocks_for(n) - hits <= d.pool.num_available() - from_lru - d.watermark_blocks;
}

PrefixPeek BlockManager::peek_prefix(const std::int32_t* tokens, std::int64_t n,
                                     std::uint64_t extra_key) const {
  const Impl& d = *impl_;
  if (n < 0) fail<InvalidArgument>("peek_prefix: num_tokens = ", n, " must be >= 0");
  std::int64_t from_lru = 0;
  const std::int64_t hits = d.count_prefix_hits(tokens, n, extra_key, &from_lru, nullptr, nullptr);
  PrefixPeek p;
  p.cached_tokens = hits * d.bs;
  p.new_blocks = d.blocks_for(n) - hits;
  p.reused_cached_blocks = from_lru;
  p.fits = p.new_blocks <= d.pool.num_available() - from_lru - d.watermark_blocks;  // as add_sequence decides
  return p;
}

PrefixPeek BlockManager::peek_prefix_int64(const std::int64_t* tokens, std::int64_t n,
                                           std::uint64_t extra_key) const {
  if (tokens == nullptr) return peek_prefix(nullptr, n);
  std::vector<std::int32_t> narrowed;
  Impl::narrow_tokens(tokens, n, narrowed, "peek_prefix");
  return peek_prefix(narrowed.data(), n, extra_key);
}

bool BlockManager::can_append(std::int64_t seq_id, std::int64_t num_tokens) const {
  const Impl& d = *impl_;
  if (num_tokens < 0) fail<InvalidArgument>("can_append: num_tokens = ", num_tokens, " must be >= 0");
  const Impl::Seq& s = d.seq_at(d.lookup(seq_id, "can_append"));
  if (s.swapped) return false;
  return d.append_demand(s, num_tokens) <= d.pool.num_available();
}

bool BlockManager::can_append_batch(const std::int64_t* seq_ids, std::int64_t n) const {
  const Impl& d = *impl_;
  d.resolve_batch(seq_ids, n, "can_append_batch", false);
  return d.batch_append_demand() <= d.pool.num_available();
}

bool BlockManager::can_swap_out(const std::int64_t* seq_ids, std::int64_t n) const {
  const Impl& d = *impl_;
  d.resolve_batch(seq_ids, n, "can_swap_out", false);
  if (d.opt.num_cpu_blocks == 0 || !d.copies.empty()) return false;
  return d.distinct_blocks_of_scratch() <= d.cpu_pool.num_free();
}

bool BlockManager::can_swap_in(const std::int64_t* seq_ids, std::int64_t n) const {
  const Impl& d = *impl_;
  d.resolve_batch(seq_ids, n, "can_swap_in", true);
  if (!d.copies.empty()) return false;
  return d.distinct_blocks_of_scratch() <= d.pool.num_available() - d.watermark_blocks;
}

}  // namespace pagedattn
