// BlockPool: the physical blocks of one pool (GPU or CPU) with their reference counts, the
// free list and, for a GPU pool with prefix caching, the LRU set of evictable blocks.
//
// A block is in exactly one of three states: held (ref > 0), free (ref == 0, on the free
// list), or evictable (ref == 0, registered in the prefix cache, on the LRU list). The pool
// does not know the prefix cache: callers say whether a released block is registered, and
// take() reports when it evicted one so the caller can unregister it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pagedattn {

class BlockPool {
 public:
  BlockPool() = default;
  // Blocks 0 .. num_blocks-1, all free; block 0 is taken first. with_lru: keep an LRU list.
  BlockPool(std::int32_t num_blocks, bool with_lru);

  std::int64_t size() const { return static_cast<std::int64_t>(ref_.size()); }
  std::int64_t num_free() const { return static_cast<std::int64_t>(free_.size()); }
  std::int64_t num_evictable() const { return lru_size_; }
  std::int64_t num_available() const { return num_free() + lru_size_; }  // what take() can serve
  std::int32_t ref(std::int32_t b) const { return ref_[idx(b)]; }

  // Takes a block (free list first, then the least recently used evictable block) with
  // ref count 1. Sets *evicted when the block came from the LRU list. Requires num_available() > 0.
  std::int32_t take(bool* evicted) {
    std::int32_t b;
    *evicted = free_.empty();
    if (!*evicted) {
      b = free_.back();
      free_.pop_back();
    } else {
      b = lru_next_[sentinel()];
      lru_remove(b);
    }
    ref_[idx(b)] = 1;
    return b;
  }
  // Takes n <= num_free() blocks from the free list, in the order n take() calls would, into
  // out [n], each with ref count 1.
  void take_free(std::int64_t n, std::int32_t* out) {
    const std::size_t top = free_.size();
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int32_t b = free_[top - 1 - static_cast<std::size_t>(i)];
      out[i] = b;
      ref_[idx(b)] = 1;
    }
    free_.resize(top - static_cast<std::size_t>(n));
  }
  // Drops one reference; at zero the block becomes evictable (registered) or free.
  void release(std::int32_t b, bool registered) {
    if (--ref_[idx(b)] == 0) {
      if (registered)
        lru_push_back(b);
      else
        free_.push_back(b);
    }
  }
  // Adds a reference; an evictable block leaves the LRU list (a prefix-cache hit).
  void acquire(std::int32_t b) {
    if (ref_[idx(b)] == 0) lru_remove(b);
    ++ref_[idx(b)];
  }
  void add_ref(std::int32_t b) { ++ref_[idx(b)]; }                    // b is held
  void drop_shared_ref(std::int32_t b) { --ref_[idx(b)]; }            // b has ref > 1
  void set_ref(std::int32_t b, std::int32_t r) { ref_[idx(b)] = r; }  // b was just taken
  // A block lost its prefix-cache registration: if it was evictable it is now free.
  void unregistered(std::int32_t b) {
    if (ref_[idx(b)] == 0) {
      lru_remove(b);
      free_.push_back(b);
    }
  }

  // For the invariant checker.
  const std::vector<std::int32_t>& free_list() const { return free_; }
  bool has_lru() const { return !lru_next_.empty(); }
  std::int32_t lru_first() const { return lru_next_[sentinel()]; }
  std::int32_t lru_after(std::int32_t b) const { return lru_next_[idx(b)]; }
  std::int32_t lru_end() const { return static_cast<std::int32_t>(ref_.size()); }

 private:
  static std::size_t idx(std::int32_t b) { return static_cast<std::size_t>(b); }
  std::size_t sentinel() const { return ref_.size(); }
  void lru_push_back(std::int32_t b) {
    const auto s = static_cast<std::int32_t>(sentinel());
    const std::int32_t tail = lru_prev_[sentinel()];
    lru_prev_[idx(b)] = tail;
    lru_next_[idx(b)] = s;
    lru_next_[idx(tail)] = b;
    lru_prev_[sentinel()] = b;
    ++lru_size_;
  }
  void lru_remove(std::int32_t b) {
    const std::int32_t p = lru_prev_[idx(b)];
    const std::int32_t n = lru_next_[idx(b)];
    lru_next_[idx(p)] = n;
    lru_prev_[idx(n)] = p;
    --lru_size_;
  }

  std::vector<std::int32_t> ref_;
  std::vector<std::int32_t> free_;                 // stack; back() is taken next
  std::vector<std::int32_t> lru_prev_, lru_next_;  // intrusive list; index size() = sentinel
  std::int64_t lru_size_ = 0;
};

}  // namespace pagedattn
