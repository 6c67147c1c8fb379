// PrefixCache: the registry of full, computed blocks that later sequences may reuse.
//
// A registered block records the chained 128-bit hash it is found under, the chain hash of
// its predecessor, the sequence's extra key and its exact token ids. match() walks a prompt
// block by block and accepts a block only when all of these agree with the prompt. The
// cache holds no references: which registered blocks are in use or evictable is the pool's
// business (BlockPool), and an evicted block is erased here by the manager.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "id_map.hpp"

namespace pagedattn {

struct Hash128 {
  std::uint64_t lo = 0, hi = 0;
  bool operator==(const Hash128& o) const { return lo == o.lo && hi == o.hi; }
};

class PrefixCache {
 public:
  PrefixCache() = default;
  // An empty registry for num_blocks blocks of block_size tokens; disabled = no storage.
  PrefixCache(std::int32_t num_blocks, std::int64_t block_size, bool enabled);

  bool enabled() const { return enabled_; }
  // The chain value that precedes a sequence's first block.
  static Hash128 root() { return Hash128{0x243f6a8885a308d3ull, 0x13198a2e03707344ull}; }
  // Chain hash of one block of block_size tokens after the block hashed `prev`.
  Hash128 hash(const Hash128& prev, std::uint64_t extra, const std::int32_t* tokens) const;

  bool is_registered(std::int32_t b) const { return enabled_ && registered_[static_cast<std::size_t>(b)] != 0; }
  const Hash128& hash_of(std::int32_t b) const { return hash_[static_cast<std::size_t>(b)]; }
  std::int64_t size() const { return map_.size(); }
  // Whether the map finds registered block b under its hash (for the invariant checker).
  bool is_indexed(std::int32_t b) const { return map_.find(hash_[static_cast<std::size_t>(b)].lo) == b; }
  // The block registered under h (checked on all 128 bits), or -1.
  std::int32_t find(const Hash128& h) const {
    const std::int32_t b = map_.find(h.lo);
    return b >= 0 && hash_[static_cast<std::size_t>(b)] == h ? b : -1;
  }

  // Walks the first max_blocks blocks of `tokens` and calls on_hit(block, hash) for each
  // cached block of the longest matching prefix. Returns the number of blocks matched.
  template <class OnHit>
  std::int64_t match(const std::int32_t* tokens, std::int64_t max_blocks, std::uint64_t extra, OnHit&& on_hit) const {
    Hash128 prev = root();
    std::int64_t k = 0;
    for (; k < max_blocks; ++k) {
      const std::int32_t* t = tokens + k * bs_;
      const Hash128 h = hash(prev, extra, t);
      const std::int32_t b = find(h);
      if (b < 0 || !holds(b, prev, extra, t)) break;
      on_hit(b, h);
      prev = h;
    }
    return k;
  }

  // Registers block b (not registered) under h. Another block registered under the same
  // map key is unregistered first (the newest registration wins) and returned, else -1.
  std::int32_t insert(std::int32_t b, const Hash128& h, const Hash128& prev, std::uint64_t extra,
                      const std::int32_t* tokens);
  // Unregisters block b (registered).
  void erase(std::int32_t b);

 private:
  bool holds(std::int32_t b, const Hash128& prev, std::uint64_t extra, const std::int32_t* tokens) const {
    const auto bi = static_cast<std::size_t>(b);
    return parent_[bi] == prev && extra_[bi] == extra &&
           std::memcmp(&tokens_[bi * static_cast<std::size_t>(bs_)], tokens,
                       static_cast<std::size_t>(bs_) * sizeof(std::int32_t)) == 0;
  }

  bool enabled_ = false;
  std::int64_t bs_ = 0;
  std::vector<std::uint8_t> registered_;
  std::vector<Hash128> hash_;
  std::vector<Hash128> parent_;  // chain hash of the previous block when registered
  std::vector<std::uint64_t> extra_;
  std::vector<std::int32_t> tokens_;  // [num_blocks * block_size]
  IdMap map_;                         // hash.lo -> block
};

}  // namespace pagedattn
