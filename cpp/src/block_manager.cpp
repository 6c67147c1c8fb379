// BlockManager: construction, the sequence lifecycle (add, append, fork, free) and the
// queries about sequences and blocks. The other parts are listed in block_manager_impl.hpp.
#include "pagedattn/block_manager.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "block_manager_impl.hpp"
#include "host_outputs.hpp"

namespace pagedattn {

// ---------------------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------------------
namespace {

const BlockManagerOptions& validated(const BlockManagerOptions& opt) {
  constexpr std::int64_t kMaxBlocks = std::numeric_limits<std::int32_t>::max();
  if (opt.num_blocks <= 0 || opt.num_blocks > kMaxBlocks)
    fail<InvalidArgument>("BlockManager: num_blocks must be in [1, ", kMaxBlocks, "], got ", opt.num_blocks);
  if (opt.block_size <= 0 || opt.block_size > (1 << 20))
    fail<InvalidArgument>("BlockManager: block_size must be in [1, 1048576], got ", opt.block_size);
  if (opt.num_cpu_blocks < 0 || opt.num_cpu_blocks > kMaxBlocks)
    fail<InvalidArgument>("BlockManager: num_cpu_blocks must be in [0, ", kMaxBlocks, "], got ",
                          opt.num_cpu_blocks);
  if (!(opt.watermark >= 0.0 && opt.watermark < 1.0))
    fail<InvalidArgument>("BlockManager: watermark must be in [0, 1), got ", opt.watermark);
  if (opt.sliding_window < 0)
    fail<InvalidArgument>("BlockManager: sliding_window must be >= 0 (0 = off), got ", opt.sliding_window);
  if (opt.sliding_window > 0 && opt.enable_prefix_caching)
    fail<InvalidArgument>("BlockManager: sliding_window cannot be combined with enable_prefix_caching");
  // With prefix caching the token ids of every block are kept (4 bytes per slot of the
  // pool, allocated up front); refuse geometries whose table could never be allocated.
  constexpr std::int64_t kMaxCachedSlots = std::int64_t{1} << 32;
  if (opt.enable_prefix_caching && opt.num_blocks > kMaxCachedSlots / opt.block_size)
    fail<InvalidArgument>(
        "BlockManager: with enable_prefix_caching, num_blocks * block_size must be at most 2^32 "
        "slots, got ",
        opt.num_blocks, " * ", opt.block_size);
  return opt;
}

}  // namespace

BlockManager::Impl::Impl(const BlockManagerOptions& options)
    : opt(options),
      bs(options.block_size),
      watermark_blocks(
          static_cast<std::int64_t>(options.watermark * static_cast<double>(options.num_blocks))),
      pool(static_cast<std::int32_t>(options.num_blocks), options.enable_prefix_caching),
      cpu_pool(static_cast<std::int32_t>(options.num_cpu_blocks), false),
      cache(static_cast<std::int32_t>(options.num_blocks), options.block_size,
            options.enable_prefix_caching) {
  if ((bs & (bs - 1)) == 0)
    for (bs_shift = 0; (std::int64_t{1} << bs_shift) < bs; ++bs_shift) {
    }
  const auto marks = static_cast<std::size_t>(std::max(options.num_blocks, options.num_cpu_blocks));
  block_mark.assign(marks, 0);
  block_stamp.assign(marks, 0);
}

BlockManager::BlockManager(const BlockManagerOptions& options)
    : impl_(std::make_unique<Impl>(validated(options))) {}
// A copy does not remember the original's incremental table: the two would both write it.
BlockManager::BlockManager(const BlockManager& other) : impl_(std::make_unique<Impl>(*other.impl_)) {
  impl_->track = Impl::ExportTrack{};
}
BlockManager& BlockManager::operator=(const BlockManager& other) {
  if (this != &other) {
    auto copy = std::make_unique<Impl>(*other.impl_);
    copy->track = Impl::ExportTrack{};
    impl_ = std::move(copy);
  }
  return *this;
}
BlockManager::BlockManager(BlockManager&&) noexcept = default;
BlockManager& BlockManager::operator=(BlockManager&&) noexcept = default;
BlockManager::~BlockManager() = default;

const BlockManagerOptions& BlockManager::options() const { return impl_->opt; }
std::int64_t BlockManager::block_size() const { return impl_->bs; }
std::int64_t BlockManager::num_blocks() const { return impl_->opt.num_blocks; }
std::int64_t BlockManager::num_cpu_blocks() const { return impl_->opt.num_cpu_blocks; }
std::int64_t BlockManager::watermark_blocks() const { return impl_->watermark_blocks; }

// ---------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------
std::int32_t BlockManager::Impl::lookup(std::int64_t seq_id, const char* what) const {
  const std::int32_t idx = find(seq_id);
  if (idx < 0)
    fail<UnknownSequence>(what, ": unknown sequence id ", seq_id, " (never added, or already freed)");
  return idx;
}

const BlockManager::Impl::Seq& BlockManager::Impl::live_gpu_seq(std::int64_t seq_id, const char* what) const {
  const Seq& s = seq_at(lookup(seq_id, what));
  if (s.swapped) fail<InvalidArgument>(what, ": sequence id ", seq_id, " is swapped out; swap_in() it first");
  return s;
}

void BlockManager::Impl::resolve_batch(const std::int64_t* seq_ids, std::int64_t n, const char* what,
                                       bool want_swapped) const {
  resolve_ids(seq_ids, n, what, want_swapped ? 1 : 0);
}

void BlockManager::Impl::resolve_ids(const std::int64_t* seq_ids, std::int64_t n, const char* what,
                                     int want) const {
  if (n < 0) fail<InvalidArgument>(what, ": negative batch size ", n);
  scratch_idx.resize(static_cast<std::size_t>(n));
  if (++stamp == 0) {
    std::fill(seq_stamp.begin(), seq_stamp.end(), 0u);
    stamp = 1;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t idx = lookup(seq_ids[i], what);
    const Seq& s = seq_at(idx);
    if (seq_stamp[static_cast<std::size_t>(idx)] == stamp)
      fail<InvalidArgument>(what, ": sequence id ", seq_ids[i], " appears more than once in the batch");
    seq_stamp[static_cast<std::size_t>(idx)] = stamp;
    if (want >= 0 && s.swapped != (want == 1)) {
      if (want == 1) fail<InvalidArgument>(what, ": sequence id ", seq_ids[i], " is not swapped out");
      fail<InvalidArgument>(what, ": sequence id ", seq_ids[i], " is swapped out; swap_in() it first");
    }
    scratch_idx[static_cast<std::size_t>(i)] = idx;
  }
}

void BlockManager::Impl::reserve_free_slots(std::int64_t n) {
  const std::size_t want = free_seq_slots.size() + static_cast<std::size_t>(n);
  if (want > free_seq_slots.capacity())  // geometric growth: one reservation per free would copy every time
    free_seq_slots.reserve(std::max(want, 2 * free_seq_slots.capacity()));
}

std::int32_t BlockManager::Impl::new_slot_index() {
  if (!free_seq_slots.empty()) {
    const std::int32_t idx = free_seq_slots.back();
    free_seq_slots.pop_back();
    return idx;
  }
  if (seqs.size() >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    fail<InvalidArgument>("BlockManager: too many live sequences");
  seqs.emplace_back();
  seq_stamp.push_back(0);
  return static_cast<std::int32_t>(seqs.size() - 1);
}

std::int32_t BlockManager::Impl::take_block() {
  bool evicted = false;
  const std::int32_t b = pool.take(&evicted);
  if (evicted) {  // the least recently used cached block (callers checked availability)
    cache.erase(b);
    ++stats.evictions;
  }
  return b;
}

std::int64_t BlockManager::Impl::count_prefix_hits(const std::int32_t* tokens, std::int64_t n,
                                                   std::uint64_t extra, std::int64_t* from_lru,
                                                   std::vector<PrefixCache::Link>* chain,
                                                   std::vector<std::int32_t>* blocks) const {
  *from_lru = 0;
  if (!cache.enabled() || tokens == nullptr || n <= 0) return 0;
  const std::int64_t max_hits = (n - 1) / bs;  // leave at least one token to compute
  return cache.match(tokens, max_hits, extra, [&](std::int32_t b, const Hash128& h, PrefixCache::Node node) {
    if (pool.ref(b) == 0) ++*from_lru;
    if (chain) chain->push_back(PrefixCache::Link{h, node});
    if (blocks) blocks->push_back(b);
  });
}

void BlockManager::Impl::register_full_blocks(Seq& s) {
  if (!cache.enabled()) return;
  const std::int64_t full =
      std::min<std::int64_t>(s.num_computed / bs, static_cast<std::int64_t>(s.blocks.size()));
  while (static_cast<std::int64_t>(s.chain.size()) < full) {
    const std::size_t j = s.chain.size();
    const Hash128 prev_hash = j ? s.chain[j - 1].hash : PrefixCache::root().hash;
    const PrefixCache::Node prev = j ? s.chain[j - 1].node : PrefixCache::kRoot;
    const std::int32_t* t = &s.tokens[j * static_cast<std::size_t>(bs)];
    const Hash128 h = cache.hash(prev_hash, s.extra_key, t);
    const std::int32_t b = s.blocks[j];
    PrefixCache::Node node;
    if (cache.is_registered(b)) {  // a shared block, registered after this same prefix
      node = cache.node_of(b);
    } else {
      const std::int32_t displaced = cache.insert(b, h, prev, s.extra_key, t, &node);
      if (displaced >= 0) pool.unregistered(displaced);  // newest wins
    }
    cache.retain(node);
    s.chain.push_back(PrefixCache::Link{h, node});
  }
}

void BlockManager::Impl::release_chain(Seq& s) {
  for (const PrefixCache::Link& link : s.chain) cache.release(link.node);
  s.chain.clear();
}

// ---------------------------------------------------------------------------------------
// Sequence lifecycle
// ---------------------------------------------------------------------------------------
std::int64_t BlockManager::add_sequence(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n,
                                        std::uint64_t extra_key) {
  if (n < 0) fail<InvalidArgument>("add_sequence: negative token count ", n);
  if (n > 0 && tokens == nullptr) fail<InvalidArgument>("add_sequence: null token pointer");
  return impl_->admit(seq_id, tokens, n, extra_key, "add_sequence");
}

void BlockManager::Impl::narrow_tokens(const std::int64_t* tokens, std::int64_t n,
                                       std::vector<std::int32_t>& narrowed, const char* what) {
  if (n < 0) fail<InvalidArgument>(what, ": negative token count ", n);
  if (n > 0 && tokens == nullptr) fail<InvalidArgument>(what, ": null token pointer");
  narrowed.resize(static_cast<std::size_t>(n));
  bool ok = true;  // one branch-free pass; the offending id is searched for only on failure
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t v = tokens[i];
    narrowed[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(v);
    ok &= v >= std::numeric_limits<std::int32_t>::min() && v <= std::numeric_limits<std::int32_t>::max();
  }
  if (ok) return;
  for (std::int64_t i = 0; i < n; ++i)
    if (tokens[i] != static_cast<std::int32_t>(tokens[i]))
      fail<InvalidArgument>(what, ": token_ids[", i, "] = ", tokens[i],
                            " does not fit in 32-bit signed integers");
}

std::int64_t BlockManager::add_sequence_int64(std::int64_t seq_id, const std::int64_t* tokens, std::int64_t n,
                                              std::uint64_t extra_key) {
  std::vector<std::int32_t> narrowed;
  Impl::narrow_tokens(tokens, n, narrowed, "add_sequence");
  return impl_->admit(seq_id, narrowed.data(), n, extra_key, "add_sequence");
}

std::int64_t BlockManager::add_sequence_by_count(std::int64_t seq_id, std::int64_t n) {
  const char* what = "add_sequence_by_count";
  if (n < 0) fail<InvalidArgument>(what, ": negative token count ", n);
  if (impl_->cache.enabled())
    fail<InvalidArgument>(what, ": prefix caching is on, so the token ids are needed; use add_sequence");
  return impl_->admit(seq_id, nullptr, n, 0, what);
}

std::int64_t BlockManager::Impl::admit(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n,
                                       std::uint64_t extra_key, const char* what) {
  Impl& d = *this;
  if (d.find(seq_id) >= 0) fail<InvalidArgument>(what, ": sequence id ", seq_id, " already exists");
  // Without caching there is nothing to look up (and add_sequence_by_count has no ids).
  std::vector<PrefixCache::Link> hit_chain;
  std::vector<std::int32_t> hit_blocks;
  std::int64_t from_lru = 0;
  const std::int64_t hits =
      d.cache.enabled() ? d.count_prefix_hits(tokens, n, extra_key, &from_lru, &hit_chain, &hit_blocks) : 0;
  const std::int64_t need = d.blocks_for(n) - hits;
  const std::int64_t avail = d.pool.num_available() - from_lru;
  if (need > avail - d.watermark_blocks)
    fail<OutOfBlocks>(what, ": sequence id ", seq_id, " (", n, " tokens) needs ", need, " new block(s)",
                      hits ? " after a prefix-cache hit of " : "",
                      hits ? std::to_string(hits) : std::string(), hits ? " block(s)" : "", "; ", avail,
                      " available, ", d.watermark_blocks, " kept free by the watermark");

  // Memory first (may throw bad_alloc), then the pool.
  const std::int32_t idx = d.new_slot_index();
  Impl::Seq& s = d.seq_at(idx);
  try {
    if (tokens)
      s.tokens.assign(tokens, tokens + n);
    else
      s.tokens.assign(static_cast<std::size_t>(n), 0);  // ids unknown; only the length is used
    s.blocks.clear();
    s.blocks.reserve(static_cast<std::size_t>(d.blocks_for(n) + 1));
    s.chain.assign(hit_chain.begin(), hit_chain.end());
    d.seq_map.insert(static_cast<std::uint64_t>(seq_id), idx);
  } catch (...) {
    d.free_seq_slots.push_back(idx);
    throw;
  }
  for (const std::int32_t b : hit_blocks) {
    d.pool.acquire(b);
    s.blocks.push_back(b);
  }
  for (const PrefixCache::Link& link : s.chain) d.cache.retain(link.node);
  if (need <= d.pool.num_free()) {  // no eviction: one pass over the free list
    const std::size_t at = s.blocks.size();
    s.blocks.resize(at + static_cast<std::size_t>(need));  // reserved above: no allocation
    d.pool.take_free(need, s.blocks.data() + at);
  } else {
    for (std::int64_t i = 0; i < need; ++i) s.blocks.push_back(d.take_block());
  }
  s.id = seq_id;
  s.live = true;
  s.swapped = false;
  s.ids_known = tokens != nullptr || n == 0;
  s.uid = d.next_uid++;
  s.export_row = -1;
  s.extra_key = extra_key;
  s.first_live_block = 0;
  s.num_computed = hits * d.bs;
  ++d.num_live;
  if (d.cache.enabled()) {
    d.stats.queried_tokens += n;
    d.stats.hit_tokens += hits * d.bs;
  }
  return hits * d.bs;
}

void BlockManager::Impl::append_into(Seq& s, const std::int32_t* tokens, std::int64_t n,
                                     std::int64_t* slots_out) {
  if (n <= 0) return;
  const auto len = static_cast<std::int64_t>(s.tokens.size());
  if (offset_of(len) != 0) {
    std::int32_t& last = s.blocks.back();
    if (pool.ref(last) > 1) {  // never write a shared block
      const std::int32_t fresh = take_block();
      pool.drop_shared_ref(last);
      copies.emplace_back(last, fresh);
      last = fresh;
      mark_dirty(s, static_cast<std::int64_t>(s.blocks.size()) - 1);
    }
  }
  if (n == 1) {  // a decode token: no range insert
    s.tokens.push_back(*tokens);
    const std::int64_t off = offset_of(len);
    if (off == 0) s.blocks.push_back(take_block());
    if (slots_out) *slots_out = static_cast<std::int64_t>(s.blocks.back()) * bs + off;
    return;
  }
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t pos = len + i;
    const std::int64_t off = pos % bs;
    if (off == 0) s.blocks.push_back(take_block());
    if (slots_out)
      slots_out[i] = static_cast<std::int64_t>(s.blocks[static_cast<std::size_t>(pos / bs)]) * bs + off;
  }
}

void BlockManager::append_tokens(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n,
                                 std::int64_t* slots_out) {
  Impl& d = *impl_;
  if (n < 0) fail<InvalidArgument>("append_tokens: negative token count ", n);
  Impl::Seq& s = d.live_gpu_seq(seq_id, "append_tokens");
  host_out::check_disjoint("append_tokens",
                           {host_out::byte_range(slots_out, n, sizeof(std::int64_t), "slots_out")},
                           {host_out::byte_range(tokens, n, sizeof(std::int32_t), "tokens")});
  const std::int64_t need = d.append_demand(s, n);
  if (need > d.pool.num_available())
    fail<OutOfBlocks>("append_tokens: sequence id ", seq_id, " needs ", need, " new block(s) for ", n,
                      " token(s); ", d.pool.num_available(), " available");
  s.tokens.reserve(s.tokens.size() + static_cast<std::size_t>(n));
  s.blocks.reserve(static_cast<std::size_t>(d.blocks_for(static_cast<std::int64_t>(s.tokens.size()) + n)));
  d.copies.reserve(d.copies.size() + 1);
  d.append_into(s, tokens, n, slots_out);
}

void BlockManager::append_tokens_batch(const std::int64_t* seq_ids, std::int64_t n,
                                       const std::int32_t* tokens, std::int64_t* slots_out) {
  Impl& d = *impl_;
  d.resolve_batch(seq_ids, n, "append_tokens_batch", false);
  host_out::check_disjoint("append_tokens_batch",
                           {host_out::byte_range(slots_out, n, sizeof(std::int64_t), "slots_out")},
                           {host_out::byte_range(seq_ids, n, sizeof(std::int64_t), "seq_ids"),
                            host_out::byte_range(tokens, n, sizeof(std::int32_t), "tokens")});
  const std::int64_t need = d.batch_append_demand();
  if (need > d.pool.num_available())
    fail<OutOfBlocks>("append_tokens_batch: ", n, " sequence(s) need ", need, " new block(s); ",
                      d.pool.num_available(), " available");
  d.copies.reserve(d.copies.size() + static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    d.append_into(d.seq_at(d.scratch_idx[static_cast<std::size_t>(i)]), tokens + i, 1,
                  slots_out ? slots_out + i : nullptr);
}

void BlockManager::Impl::check_forkable(std::int64_t parent_id, std::int64_t child_id,
                                        const char* what) const {
  const Seq& p = seq_at(lookup(parent_id, what));
  if (p.swapped)
    fail<InvalidArgument>(what, ": parent sequence id ", parent_id, " is swapped out; swap_in() it first");
  if (find(child_id) >= 0) fail<InvalidArgument>(what, ": child sequence id ", child_id, " already exists");
  if (p.num_computed != static_cast<std::int64_t>(p.tokens.size()))
    fail<InvalidArgument>(what, ": parent sequence id ", parent_id, " has ",
                          static_cast<std::int64_t>(p.tokens.size()) - p.num_computed,
                          " token(s) not yet computed; fork after the step that computes them");
}

void BlockManager::Impl::fork_at(std::int32_t pidx, std::int64_t child_id) {
  Impl& d = *this;
  const std::int32_t cidx = d.new_slot_index();
  const Seq& p = d.seq_at(pidx);  // re-fetched: new_slot_index may reallocate
  Seq& c = d.seq_at(cidx);
  try {
    c.tokens.assign(p.tokens.begin(), p.tokens.end());
    c.blocks.assign(p.blocks.begin(), p.blocks.end());
    c.chain.assign(p.chain.begin(), p.chain.end());
    d.seq_map.insert(static_cast<std::uint64_t>(child_id), cidx);
  } catch (...) {
    d.free_seq_slots.push_back(cidx);
    throw;
  }
  c.id = child_id;
  c.live = true;
  c.swapped = false;
  c.ids_known = p.ids_known;
  c.uid = d.next_uid++;
  c.export_row = -1;
  c.num_computed = p.num_computed;
  c.extra_key = p.extra_key;
  c.first_live_block = p.first_live_block;
  for (const std::int32_t b : c.blocks)
    if (b >= 0) d.pool.add_ref(b);
  for (const PrefixCache::Link& link : c.chain) d.cache.retain(link.node);
  ++d.num_live;
}

void BlockManager::fork(std::int64_t parent_id, std::int64_t child_id) {
  Impl& d = *impl_;
  d.check_forkable(parent_id, child_id, "fork");
  d.fork_at(d.find(parent_id), child_id);
}

void BlockManager::fork_batch(const std::int64_t* parent_ids, const std::int64_t* child_ids, std::int64_t n) {
  Impl& d = *impl_;
  const char* what = "fork_batch";
  if (n < 0) fail<InvalidArgument>(what, ": negative batch size ", n);
  for (std::int64_t i = 0; i < n; ++i) d.check_forkable(parent_ids[i], child_ids[i], what);
  std::vector<std::int64_t> sorted(child_ids, child_ids + n);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end())
    fail<InvalidArgument>(what, ": child sequence id ", *dup, " appears more than once in the batch");
  std::int64_t done = 0;
  try {
    for (; done < n; ++done) d.fork_at(d.find(parent_ids[done]), child_ids[done]);
  } catch (...) {  // out of memory part way: the children made so far are released again
    for (std::int64_t i = done - 1; i >= 0; --i) d.free_at(d.find(child_ids[i]));
    throw;
  }
}

void BlockManager::Impl::free_at(std::int32_t idx) {
  Impl& d = *this;
  Seq& s = d.seq_at(idx);
  if (s.swapped) {
    for (const std::int32_t c : s.blocks)
      if (c >= 0) d.cpu_pool.release(c, false);
  } else {
    // Last block first: with caching, a prefix stays in the LRU set longer than its tails.
    for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it)
      if (*it >= 0) d.release_block(*it);
  }
  d.seq_map.erase(static_cast<std::uint64_t>(s.id));
  s.live = false;
  s.swapped = false;
  s.tokens.clear();
  s.blocks.clear();
  d.release_chain(s);
  d.free_seq_slots.push_back(idx);
  --d.num_live;
}

void BlockManager::free(std::int64_t seq_id) {
  Impl& d = *impl_;
  const std::int32_t idx = d.lookup(seq_id, "free");
  d.reserve_free_slots(1);  // nothing below can throw
  d.free_at(idx);
}

void BlockManager::free_batch(const std::int64_t* seq_ids, std::int64_t n) {
  Impl& d = *impl_;
  d.resolve_ids(seq_ids, n, "free_batch", -1);
  d.reserve_free_slots(n);  // nothing below can throw
  for (std::int64_t i = 0; i < n; ++i) d.free_at(d.scratch_idx[static_cast<std::size_t>(i)]);
}

// ---------------------------------------------------------------------------------------
// Queries
// ---------------------------------------------------------------------------------------
std::int64_t BlockManager::num_free_blocks() const { return impl_->pool.num_free(); }
std::int64_t BlockManager::num_cached_blocks() const { return impl_->pool.num_evictable(); }
std::int64_t BlockManager::num_used_blocks() const {
  return impl_->pool.size() - impl_->pool.num_available();
}
std::int64_t BlockManager::num_available_blocks() const { return impl_->pool.num_available(); }
std::int64_t BlockManager::num_free_cpu_blocks() const { return impl_->cpu_pool.num_free(); }
std::int64_t BlockManager::num_sequences() const { return impl_->num_live; }
std::int64_t BlockManager::num_pending_copies() const {
  return static_cast<std::int64_t>(impl_->copies.size());
}
bool BlockManager::has_sequence(std::int64_t seq_id) const { return impl_->find(seq_id) >= 0; }
const PrefixCacheStats& BlockManager::prefix_cache_stats() const { return impl_->stats; }
void BlockManager::reset_prefix_cache_stats() { impl_->stats = PrefixCacheStats{}; }

std::vector<std::int64_t> BlockManager::sequence_ids() const {
  std::vector<std::int64_t> ids;
  ids.reserve(static_cast<std::size_t>(impl_->num_live));
  for (const Impl::Seq& s : impl_->seqs)
    if (s.live) ids.push_back(s.id);
  return ids;
}
const std::vector<std::int32_t>& BlockManager::block_table(std::int64_t seq_id) const {
  return impl_->seq_at(impl_->lookup(seq_id, "block_table")).blocks;
}
const std::vector<std::int32_t>& BlockManager::token_ids(std::int64_t seq_id) const {
  const Impl::Seq& s = impl_->seq_at(impl_->lookup(seq_id, "token_ids"));
  if (!s.ids_known)
    fail<InvalidArgument>("token_ids: sequence id ", seq_id,
                          " was admitted by count (add_sequence_by_count, or forked from such a sequence); "
                          "its token ids are not kept");
  return s.tokens;
}
std::int64_t BlockManager::seq_len(std::int64_t seq_id) const {
  return static_cast<std::int64_t>(impl_->seq_at(impl_->lookup(seq_id, "seq_len")).tokens.size());
}
std::int64_t BlockManager::num_computed(std::int64_t seq_id) const {
  return impl_->seq_at(impl_->lookup(seq_id, "num_computed")).num_computed;
}
bool BlockManager::is_swapped(std::int64_t seq_id) const {
  return impl_->seq_at(impl_->lookup(seq_id, "is_swapped")).swapped;
}
std::int32_t BlockManager::ref_count(std::int64_t block) const {
  if (block < 0 || block >= impl_->opt.num_blocks)
    fail<OutOfRange>("ref_count: block ", block, " is outside [0, ", impl_->opt.num_blocks, ")");
  return impl_->pool.ref(static_cast<std::int32_t>(block));
}
std::int32_t BlockManager::cpu_ref_count(std::int64_t block) const {
  if (block < 0 || block >= impl_->opt.num_cpu_blocks)
    fail<OutOfRange>("cpu_ref_count: block ", block, " is outside [0, ", impl_->opt.num_cpu_blocks, ")");
  return impl_->cpu_pool.ref(static_cast<std::int32_t>(block));
}
bool BlockManager::is_cached(std::int64_t block) const {
  if (block < 0 || block >= impl_->opt.num_blocks)
    fail<OutOfRange>("is_cached: block ", block, " is outside [0, ", impl_->opt.num_blocks, ")");
  return impl_->cache.is_registered(static_cast<std::int32_t>(block));
}

}  // namespace pagedattn
