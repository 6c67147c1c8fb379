// IdMap: open addressing with linear probing and backward-shift deletion.
#include "id_map.hpp"

namespace pagedattn {

namespace {
inline std::uint64_t mix64(std::uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}
}  // namespace

std::int32_t IdMap::find(std::uint64_t key) const {
  if (size_ == 0) return -1;
  std::uint64_t i = mix64(key) & mask_;
  while (vals_[i] >= 0) {
    if (keys_[i] == key) return vals_[i];
    i = (i + 1) & mask_;
  }
  return -1;
}

void IdMap::grow() {
  const std::size_t cap = keys_.empty() ? 16 : keys_.size() * 2;
  std::vector<std::uint64_t> old_keys(cap);
  std::vector<std::int32_t> old_vals(cap, -1);
  old_keys.swap(keys_);
  old_vals.swap(vals_);
  mask_ = cap - 1;
  for (std::size_t j = 0; j < old_keys.size(); ++j) {
    if (old_vals[j] < 0) continue;
    std::uint64_t i = mix64(old_keys[j]) & mask_;
    while (vals_[i] >= 0) i = (i + 1) & mask_;
    keys_[i] = old_keys[j];
    vals_[i] = old_vals[j];
  }
}

void IdMap::insert(std::uint64_t key, std::int32_t value) {
  if (static_cast<std::size_t>(size_ + 1) * 4 > keys_.size() * 3) grow();
  std::uint64_t i = mix64(key) & mask_;
  while (vals_[i] >= 0) i = (i + 1) & mask_;
  keys_[i] = key;
  vals_[i] = value;
  ++size_;
}

void IdMap::erase(std::uint64_t key) {
  std::uint64_t i = mix64(key) & mask_;
  while (keys_[i] != key || vals_[i] < 0) i = (i + 1) & mask_;
  // Backward-shift deletion keeps every probe chain unbroken without tombstones.
  std::uint64_t j = i;
  for (;;) {
    j = (j + 1) & mask_;
    if (vals_[j] < 0) break;
    const std::uint64_t home = mix64(keys_[j]) & mask_;
    if (((j - home) & mask_) >= ((j - i) & mask_)) {
      keys_[i] = keys_[j];
      vals_[i] = vals_[j];
      i = j;
    }
  }
  vals_[i] = -1;
  --size_;
}

}  // namespace pagedattn
