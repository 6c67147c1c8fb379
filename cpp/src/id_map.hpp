// IdMap: an open-addressing hash map from 64-bit keys to non-negative int32 values (linear
// probing, backward-shift deletion, no tombstones). The block manager maps sequence ids to
// sequence slots with it, and the prefix cache maps block hashes to prefix nodes.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedattn {

class IdMap {
 public:
  std::int32_t find(std::uint64_t key) const;          // -1 when absent
  void insert(std::uint64_t key, std::int32_t value);  // key must be absent, value >= 0
  void erase(std::uint64_t key);                       // key must be present
  std::int64_t size() const { return size_; }

 private:
  void grow();
  std::vector<std::uint64_t> keys_;
  std::vector<std::int32_t> vals_;  // -1 = empty
  std::int64_t size_ = 0;
  std::uint64_t mask_ = 0;
};

}  // namespace pagedattn
