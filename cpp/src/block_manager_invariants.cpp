// BlockManager::check_invariants: recomputes every count the manager keeps incrementally
// and compares (reference counts against block tables, free / LRU / registry consistency,
// exclusive ownership of every block that still receives slots).
#include <algorithm>
#include <stdexcept>
#include <vector>

#include "block_manager_impl.hpp"

namespace pagedattn {

void BlockManager::check_invariants() const {
  const Impl& d = *impl_;
  auto bad = [](auto&&... parts) {
    throw std::logic_error(detail::concat("BlockManager invariant: ", parts...));
  };
  const auto nb = static_cast<std::size_t>(d.opt.num_blocks);
  const auto nc = static_cast<std::size_t>(d.opt.num_cpu_blocks);
  const bool caching = d.cache.enabled();
  std::vector<std::int32_t> holders(nb, 0), cpu_holders(nc, 0);
  std::int64_t live = 0;
  std::vector<std::uint64_t> uids;
  for (const Impl::Seq& s : d.seqs) {
    if (!s.live) continue;
    ++live;
    // Incremental export: a row is trusted only for the sequence whose uid it records.
    if (s.uid == 0 || s.uid >= d.next_uid)
      bad("sequence ", s.id, " has uid ", s.uid, " outside [1, ", d.next_uid, ")");
    uids.push_back(s.uid);
    if (!s.ids_known && caching) bad("sequence ", s.id, " has no token ids with prefix caching on");
    if (d.find(s.id) < 0 || &d.seq_at(d.find(s.id)) != &s) bad("sequence ", s.id, " not in the id map");
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    if (static_cast<std::int64_t>(s.blocks.size()) != d.blocks_for(len))
      bad("sequence ", s.id, " has ", s.blocks.size(), " blocks for ", len, " tokens");
    if (s.num_computed < 0 || s.num_computed > len) bad("sequence ", s.id, " num_computed out of range");
    if (caching && static_cast<std::int64_t>(s.chain.size()) > s.num_computed / d.bs)
      bad("sequence ", s.id, " hashed an uncomputed block");
    for (std::size_t j = 0; j < s.blocks.size(); ++j) {
      const std::int32_t b = s.blocks[j];
      if (b < 0) {
        if (static_cast<std::int64_t>(j) >= s.first_live_block) bad("sequence ", s.id, " has a hole at ", j);
        continue;
      }
      if (s.swapped) {
        if (static_cast<std::size_t>(b) >= nc) bad("sequence ", s.id, " CPU block out of range");
        ++cpu_holders[static_cast<std::size_t>(b)];
      } else {
        if (static_cast<std::size_t>(b) >= nb) bad("sequence ", s.id, " block out of range");
        ++holders[static_cast<std::size_t>(b)];
      }
    }
    // Every uncomputed token (a slot still to be written) lies in an exclusively owned block.
    if (!s.swapped)
      for (std::int64_t pos = s.num_computed; pos < len; ++pos) {
        const std::int32_t b = s.blocks[static_cast<std::size_t>(pos / d.bs)];
        if (d.pool.ref(b) != 1)
          bad("sequence ", s.id, " token ", pos, " would be written into block ", b, " with ", d.pool.ref(b),
              " holders");
      }
  }
  if (live != d.num_live || d.seq_map.size() != d.num_live) bad("live sequence count mismatch");
  for (std::size_t b = 0; b < nb; ++b) {
    const std::int32_t r = d.pool.ref(static_cast<std::int32_t>(b));
    if (holders[b] != r) bad("block ", b, " ref count ", r, " but held by ", holders[b], " table entries");
  }
  for (std::size_t c = 0; c < nc; ++c) {
    const std::int32_t r = d.cpu_pool.ref(static_cast<std::int32_t>(c));
    if (cpu_holders[c] != r) bad("CPU block ", c, " ref count ", r, " but held ", cpu_holders[c], " times");
  }

  std::vector<std::uint8_t> seen(nb, 0);
  for (const std::int32_t b : d.pool.free_list()) {
    const auto bi = static_cast<std::size_t>(b);
    if (seen[bi]++) bad("block ", b, " twice in the free list");
    if (d.pool.ref(b) != 0) bad("free block ", b, " has ref count ", d.pool.ref(b));
    if (d.cache.is_registered(b)) bad("free block ", b, " is registered in the cache");
  }
  std::int64_t lru = 0, registered = 0;
  if (caching) {
    if (!d.pool.has_lru()) bad("prefix caching is on but the pool keeps no LRU list");
    for (std::int32_t b = d.pool.lru_first(); b != d.pool.lru_end(); b = d.pool.lru_after(b)) {
      const auto bi = static_cast<std::size_t>(b);
      if (seen[bi]++) bad("block ", b, " in the LRU set twice or also free");
      if (d.pool.ref(b) != 0 || !d.cache.is_registered(b))
        bad("LRU block ", b, " is in use or not registered");
      ++lru;
    }
    // Prefix nodes: each registered block is attached to an indexed live node that names it,
    // and every node's reference count is what refers to it (its block, child nodes, links).
    const auto nn = static_cast<std::size_t>(d.cache.num_nodes());
    std::vector<std::int32_t> refs(nn, 0);
    for (std::size_t b = 0; b < nb; ++b) {
      const auto bb = static_cast<std::int32_t>(b);
      if (!d.cache.is_registered(bb)) continue;
      ++registered;
      const PrefixCache::Node n = d.cache.node_of(bb);
      if (n < 0 || static_cast<std::size_t>(n) >= nn) bad("registered block ", b, " has no prefix node");
      const PrefixCache::NodeView v = d.cache.node(n);
      if (!v.live || !v.indexed || v.block != bb)
        bad("registered block ", b, " and its prefix node ", n, " disagree");
    }
    if (registered != d.cache.num_registered())
      bad("prefix cache counts ", d.cache.num_registered(), " registered blocks, ", registered, " found");
    for (std::size_t n = 0; n < nn; ++n) {
      const PrefixCache::NodeView v = d.cache.node(static_cast<PrefixCache::Node>(n));
      if (!v.live) continue;
      if (v.block >= 0) ++refs[n];
      if (v.parent != PrefixCache::kRoot) {
        if (!d.cache.node(v.parent).live) bad("prefix node ", n, " has a freed parent ", v.parent);
        ++refs[static_cast<std::size_t>(v.parent)];
      }
    }
    for (const Impl::Seq& s : d.seqs) {
      if (!s.live) continue;
      for (const PrefixCache::Link& link : s.chain) {
        if (link.node < 0 || static_cast<std::size_t>(link.node) >= nn || !d.cache.node(link.node).live)
          bad("sequence ", s.id, " links a freed prefix node");
        ++refs[static_cast<std::size_t>(link.node)];
      }
    }
    for (std::size_t n = 0; n < nn; ++n) {
      const PrefixCache::NodeView v = d.cache.node(static_cast<PrefixCache::Node>(n));
      if (v.live && v.refs != refs[n])
        bad("prefix node ", n, " has ref count ", v.refs, " but ", refs[n], " referrers");
      if (v.live && v.refs == 0) bad("prefix node ", n, " is live with no referrer");
    }
  }
  if (lru != d.pool.num_evictable()) bad("LRU size ", d.pool.num_evictable(), " but ", lru, " linked");
  std::int64_t used = 0;
  for (std::size_t b = 0; b < nb; ++b) used += d.pool.ref(static_cast<std::int32_t>(b)) > 0;
  if (d.pool.num_free() + lru + used != d.opt.num_blocks)
    bad("free ", d.pool.num_free(), " + cached ", lru, " + used ", used, " != ", d.opt.num_blocks);
  std::vector<std::uint8_t> cseen(nc, 0);
  std::int64_t cpu_used = 0;
  for (const std::int32_t c : d.cpu_pool.free_list()) {
    if (cseen[static_cast<std::size_t>(c)]++) bad("CPU block ", c, " twice in the free list");
    if (d.cpu_pool.ref(c) != 0) bad("free CPU block ", c, " in use");
  }
  for (std::size_t c = 0; c < nc; ++c) cpu_used += d.cpu_pool.ref(static_cast<std::int32_t>(c)) > 0;
  if (cpu_used + d.cpu_pool.num_free() != d.opt.num_cpu_blocks) bad("CPU pool does not add up");
  for (const auto& pr : d.copies)
    if (pr.first < 0 || pr.second < 0 || pr.first >= d.opt.num_blocks || pr.second >= d.opt.num_blocks ||
        pr.first == pr.second)
      bad("bad pending copy pair");
  std::sort(uids.begin(), uids.end());
  if (std::adjacent_find(uids.begin(), uids.end()) != uids.end()) bad("two live sequences share a uid");
  const Impl::ExportTrack& k = d.track;
  if (k.data != nullptr) {
    if (static_cast<std::int64_t>(k.row_uid.size()) != k.rows ||
        static_cast<std::int64_t>(k.row_len.size()) != k.rows)
      bad("the remembered table has ", k.rows, " rows but row state for ", k.row_uid.size());
    for (std::size_t r = 0; r < k.row_len.size(); ++r)
      if (k.row_len[r] < 0 || k.row_len[r] > k.cols || (k.row_uid[r] == 0 && k.row_len[r] != 0))
        bad("row ", r, " of the remembered table records ", k.row_len[r], " entries of ", k.cols);
  }
}

}  // namespace pagedattn
