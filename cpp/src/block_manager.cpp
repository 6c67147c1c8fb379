// BlockManager: pool, sequences, appends, fork / copy-on-write, free, step export.
// Swapping, capacity queries, exports and invariant checks: block_manager_swap.cpp.
#include "pagedattn/block_manager.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

namespace pagedattn {

namespace {

constexpr std::uint64_t kK0 = 0xa0761d6478bd642full;
constexpr std::uint64_t kK1 = 0xe7037ed1a0b428dbull;
constexpr std::uint64_t kK2 = 0x8ebc6af09c88c6e3ull;
constexpr std::uint64_t kK3 = 0x589965cc75374cc3ull;
constexpr std::uint64_t kK4 = 0x1d8e4e27c47d124full;
constexpr std::uint64_t kK5 = 0x9e3779b97f4a7c15ull;

// 64 x 64 -> 128-bit multiply, folded by xor (the wyhash "mum" mixer).
inline std::uint64_t mum(std::uint64_t a, std::uint64_t b) {
#if defined(__SIZEOF_INT128__)
  const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
  return static_cast<std::uint64_t>(r) ^ static_cast<std::uint64_t>(r >> 64);
#else
  const std::uint64_t al = a & 0xffffffffull, ah = a >> 32, bl = b & 0xffffffffull, bh = b >> 32;
  const std::uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
  const std::uint64_t mid = (ll >> 32) + (lh & 0xffffffffull) + (hl & 0xffffffffull);
  const std::uint64_t lo = (ll & 0xffffffffull) | (mid << 32);
  const std::uint64_t hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
  return lo ^ hi;
#endif
}

inline std::uint64_t mix64(std::uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

inline std::uint64_t word(const std::int32_t* t) {
  return static_cast<std::uint64_t>(static_cast<std::uint32_t>(t[0])) |
         (static_cast<std::uint64_t>(static_cast<std::uint32_t>(t[1])) << 32);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// IdMap
// ---------------------------------------------------------------------------------------
std::int32_t BlockManager::IdMap::find(std::uint64_t key) const {
  if (size_ == 0) return -1;
  std::uint64_t i = mix64(key) & mask_;
  while (vals_[i] >= 0) {
    if (keys_[i] == key) return vals_[i];
    i = (i + 1) & mask_;
  }
  return -1;
}

void BlockManager::IdMap::grow() {
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

void BlockManager::IdMap::insert(std::uint64_t key, std::int32_t value) {
  if (static_cast<std::size_t>(size_ + 1) * 4 > keys_.size() * 3) grow();
  std::uint64_t i = mix64(key) & mask_;
  while (vals_[i] >= 0) i = (i + 1) & mask_;
  keys_[i] = key;
  vals_[i] = value;
  ++size_;
}

void BlockManager::IdMap::erase(std::uint64_t key) {
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

// ---------------------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------------------
BlockManager::BlockManager(const BlockManagerOptions& options) : opt_(options) {
  constexpr std::int64_t kMaxBlocks = std::numeric_limits<std::int32_t>::max();
  if (opt_.num_blocks <= 0 || opt_.num_blocks > kMaxBlocks)
    fail<InvalidArgument>("BlockManager: num_blocks must be in [1, ", kMaxBlocks, "], got ", opt_.num_blocks);
  if (opt_.block_size <= 0 || opt_.block_size > (1 << 20))
    fail<InvalidArgument>("BlockManager: block_size must be in [1, 1048576], got ", opt_.block_size);
  if (opt_.num_cpu_blocks < 0 || opt_.num_cpu_blocks > kMaxBlocks)
    fail<InvalidArgument>("BlockManager: num_cpu_blocks must be in [0, ", kMaxBlocks, "], got ",
                          opt_.num_cpu_blocks);
  if (!(opt_.watermark >= 0.0 && opt_.watermark < 1.0))
    fail<InvalidArgument>("BlockManager: watermark must be in [0, 1), got ", opt_.watermark);
  if (opt_.sliding_window < 0)
    fail<InvalidArgument>("BlockManager: sliding_window must be >= 0 (0 = off), got ", opt_.sliding_window);
  if (opt_.sliding_window > 0 && opt_.enable_prefix_caching)
    fail<InvalidArgument>("BlockManager: sliding_window cannot be combined with enable_prefix_caching");
  // With prefix caching the token ids of every block are kept (4 bytes per slot of the
  // pool, allocated up front); refuse geometries whose table could never be allocated.
  constexpr std::int64_t kMaxCachedSlots = std::int64_t{1} << 32;
  if (opt_.enable_prefix_caching && opt_.num_blocks > kMaxCachedSlots / opt_.block_size)
    fail<InvalidArgument>("BlockManager: with enable_prefix_caching, num_blocks * block_size must be at most 2^32 "
                          "slots, got ", opt_.num_blocks, " * ", opt_.block_size);
  bs_ = opt_.block_size;
  caching_ = opt_.enable_prefix_caching;
  watermark_blocks_ = static_cast<std::int64_t>(opt_.watermark * static_cast<double>(opt_.num_blocks));

  const auto nb = static_cast<std::size_t>(opt_.num_blocks);
  ref_.assign(nb, 0);
  free_.resize(nb);
  for (std::size_t i = 0; i < nb; ++i) free_[i] = static_cast<std::int32_t>(nb - 1 - i);  // block 0 first
  if (caching_) {
    cached_.assign(nb, 0);
    bhash_.resize(nb);
    bparent_.resize(nb);
    bextra_.assign(nb, 0);
    btokens_.assign(nb * static_cast<std::size_t>(bs_), 0);
    lru_prev_.assign(nb + 1, static_cast<std::int32_t>(nb));
    lru_next_.assign(nb + 1, static_cast<std::int32_t>(nb));
  }
  const auto nc = static_cast<std::size_t>(opt_.num_cpu_blocks);
  cpu_ref_.assign(nc, 0);
  cpu_free_.resize(nc);
  for (std::size_t i = 0; i < nc; ++i) cpu_free_[i] = static_cast<std::int32_t>(nc - 1 - i);
  block_mark_.assign(std::max(nb, nc), 0);
  block_stamp_.assign(std::max(nb, nc), 0);
}

// ---------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------
std::int32_t BlockManager::find(std::int64_t seq_id) const {
  return seq_map_.find(static_cast<std::uint64_t>(seq_id));
}

std::int32_t BlockManager::lookup(std::int64_t seq_id, const char* what) const {
  const std::int32_t idx = find(seq_id);
  if (idx < 0)
    fail<UnknownSequence>(what, ": unknown sequence id ", seq_id, " (never added, or already freed)");
  return idx;
}

BlockManager::Seq& BlockManager::live_gpu_seq(std::int64_t seq_id, const char* what) {
  Seq& s = seqs_[static_cast<std::size_t>(lookup(seq_id, what))];
  if (s.swapped) fail<InvalidArgument>(what, ": sequence id ", seq_id, " is swapped out; swap_in() it first");
  return s;
}

const BlockManager::Seq& BlockManager::live_gpu_seq(std::int64_t seq_id, const char* what) const {
  return const_cast<BlockManager*>(this)->live_gpu_seq(seq_id, what);
}

void BlockManager::resolve_batch(const std::int64_t* seq_ids, std::int64_t n, const char* what,
                                 bool want_swapped) const {
  if (n < 0) fail<InvalidArgument>(what, ": negative batch size ", n);
  scratch_idx_.resize(static_cast<std::size_t>(n));
  if (++stamp_ == 0) {
    std::fill(seq_stamp_.begin(), seq_stamp_.end(), 0u);
    stamp_ = 1;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t idx = lookup(seq_ids[i], what);
    const Seq& s = seqs_[static_cast<std::size_t>(idx)];
    if (seq_stamp_[static_cast<std::size_t>(idx)] == stamp_)
      fail<InvalidArgument>(what, ": sequence id ", seq_ids[i], " appears more than once in the batch");
    seq_stamp_[static_cast<std::size_t>(idx)] = stamp_;
    if (s.swapped != want_swapped) {
      if (want_swapped) fail<InvalidArgument>(what, ": sequence id ", seq_ids[i], " is not swapped out");
      fail<InvalidArgument>(what, ": sequence id ", seq_ids[i], " is swapped out; swap_in() it first");
    }
    scratch_idx_[static_cast<std::size_t>(i)] = idx;
  }
}

std::int32_t BlockManager::new_slot_index() {
  if (!free_seq_slots_.empty()) {
    const std::int32_t idx = free_seq_slots_.back();
    free_seq_slots_.pop_back();
    return idx;
  }
  if (seqs_.size() >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    fail<InvalidArgument>("BlockManager: too many live sequences");
  seqs_.emplace_back();
  seq_stamp_.push_back(0);
  return static_cast<std::int32_t>(seqs_.size() - 1);
}

std::vector<std::int64_t> BlockManager::sequence_ids() const {
  std::vector<std::int64_t> ids;
  ids.reserve(static_cast<std::size_t>(num_live_));
  for (const Seq& s : seqs_)
    if (s.live) ids.push_back(s.id);
  return ids;
}

// ---------------------------------------------------------------------------------------
// Pool: free list, LRU of evictable cached blocks, prefix-cache registry
// ---------------------------------------------------------------------------------------
void BlockManager::lru_push_back(std::int32_t b) {
  const auto sentinel = static_cast<std::int32_t>(opt_.num_blocks);
  const std::int32_t tail = lru_prev_[static_cast<std::size_t>(sentinel)];
  lru_prev_[static_cast<std::size_t>(b)] = tail;
  lru_next_[static_cast<std::size_t>(b)] = sentinel;
  lru_next_[static_cast<std::size_t>(tail)] = b;
  lru_prev_[static_cast<std::size_t>(sentinel)] = b;
  ++lru_size_;
}

void BlockManager::lru_remove(std::int32_t b) {
  const std::int32_t p = lru_prev_[static_cast<std::size_t>(b)];
  const std::int32_t n = lru_next_[static_cast<std::size_t>(b)];
  lru_next_[static_cast<std::size_t>(p)] = n;
  lru_prev_[static_cast<std::size_t>(n)] = p;
  --lru_size_;
}

void BlockManager::uncache(std::int32_t b) {
  const auto bi = static_cast<std::size_t>(b);
  cache_map_.erase(bhash_[bi].lo);
  cached_[bi] = 0;
  if (ref_[bi] == 0) {  // it was evictable: now it is plainly free
    lru_remove(b);
    free_.push_back(b);
  }
}

std::int32_t BlockManager::take_block() {
  std::int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {  // evict the least recently used cached block (callers checked availability)
    b = lru_next_[static_cast<std::size_t>(opt_.num_blocks)];
    lru_remove(b);
    cache_map_.erase(bhash_[static_cast<std::size_t>(b)].lo);
    cached_[static_cast<std::size_t>(b)] = 0;
    ++stats_.evictions;
  }
  ref_[static_cast<std::size_t>(b)] = 1;
  return b;
}

void BlockManager::release_block(std::int32_t b) {
  const auto bi = static_cast<std::size_t>(b);
  if (--ref_[bi] == 0) {
    if (caching_ && cached_[bi])
      lru_push_back(b);
    else
      free_.push_back(b);
  }
}

BlockManager::Hash128 BlockManager::hash_block(const Hash128& prev, std::uint64_t extra,
                                               const std::int32_t* t) const {
  // Two 64-bit lanes with independent seeds; each absorbs two token ids per multiply.
  std::uint64_t a = mum(prev.lo ^ kK0, extra ^ kK1);
  std::uint64_t b = mum(prev.hi ^ kK2, extra ^ kK3);
  std::int64_t i = 0;
  for (; i + 4 <= bs_; i += 4) {
    const std::uint64_t w0 = word(t + i), w1 = word(t + i + 2);
    a = mum(w0 ^ kK1 ^ a, w1 ^ kK2);
    b = mum(w0 ^ kK4 ^ b, w1 ^ kK5);
  }
  for (; i < bs_; ++i) {
    const std::uint64_t w = static_cast<std::uint32_t>(t[i]);
    a = mum(w ^ kK3 ^ a, kK0);
    b = mum(w ^ kK5 ^ b, kK2);
  }
  Hash128 h;
  h.lo = mum(a ^ kK4, b ^ kK0);
  h.hi = mum(b ^ kK1, a ^ kK3);
  return h;
}

std::int32_t BlockManager::find_cached(const Hash128& h) const {
  const std::int32_t b = cache_map_.find(h.lo);
  if (b >= 0 && bhash_[static_cast<std::size_t>(b)] == h) return b;
  return -1;
}

bool BlockManager::verify_cached(std::int32_t b, const Hash128& prev, std::uint64_t extra,
                                 const std::int32_t* tokens) const {
  const auto bi = static_cast<std::size_t>(b);
  return bparent_[bi] == prev && bextra_[bi] == extra &&
         std::memcmp(&btokens_[bi * static_cast<std::size_t>(bs_)], tokens,
                     static_cast<std::size_t>(bs_) * sizeof(std::int32_t)) == 0;
}

namespace {
constexpr std::uint64_t kRootLo = 0x243f6a8885a308d3ull;  // chain start ("previous hash" of block 0)
constexpr std::uint64_t kRootHi = 0x13198a2e03707344ull;
}  // namespace

std::int64_t BlockManager::count_prefix_hits(const std::int32_t* tokens, std::int64_t n, std::uint64_t extra,
                                             std::int64_t* from_lru, std::vector<Hash128>* hashes,
                                             std::vector<std::int32_t>* blocks) const {
  *from_lru = 0;
  if (!caching_ || tokens == nullptr || n <= 0) return 0;
  const std::int64_t max_hits = (n - 1) / bs_;  // leave at least one token to compute
  Hash128 prev{kRootLo, kRootHi};
  std::int64_t k = 0;
  for (; k < max_hits; ++k) {
    const std::int32_t* t = tokens + k * bs_;
    const Hash128 h = hash_block(prev, extra, t);
    const std::int32_t b = find_cached(h);
    if (b < 0 || !verify_cached(b, prev, extra, t)) break;
    if (ref_[static_cast<std::size_t>(b)] == 0) ++*from_lru;
    if (hashes) hashes->push_back(h);
    if (blocks) blocks->push_back(b);
    prev = h;
  }
  return k;
}

void BlockManager::register_full_blocks(Seq& s) {
  if (!caching_) return;
  const std::int64_t full = std::min<std::int64_t>(s.num_computed / bs_, static_cast<std::int64_t>(s.blocks.size()));
  while (static_cast<std::int64_t>(s.hashes.size()) < full) {
    const std::size_t j = s.hashes.size();
    const Hash128 prev = j ? s.hashes[j - 1] : Hash128{kRootLo, kRootHi};
    const std::int32_t* t = &s.tokens[j * static_cast<std::size_t>(bs_)];
    const Hash128 h = hash_block(prev, s.extra_key, t);
    s.hashes.push_back(h);
    const std::int32_t b = s.blocks[j];
    const auto bi = static_cast<std::size_t>(b);
    if (cached_[bi]) continue;
    const std::int32_t old = cache_map_.find(h.lo);
    if (old >= 0) uncache(old);  // newest wins
    cache_map_.insert(h.lo, b);
    cached_[bi] = 1;
    bhash_[bi] = h;
    bparent_[bi] = prev;
    bextra_[bi] = s.extra_key;
    std::memcpy(&btokens_[bi * static_cast<std::size_t>(bs_)], t, static_cast<std::size_t>(bs_) * sizeof(std::int32_t));
  }
}

void BlockManager::release_window(Seq& s, std::int64_t first_query_pos) {
  if (opt_.sliding_window <= 0) return;
  const std::int64_t limit = first_query_pos - opt_.sliding_window + 1;  // oldest key position still needed
  if (limit <= 0) return;
  const std::int64_t end = std::min<std::int64_t>(limit / bs_, static_cast<std::int64_t>(s.blocks.size()));
  for (std::int64_t j = s.first_live_block; j < end; ++j) {
    std::int32_t& b = s.blocks[static_cast<std::size_t>(j)];
    if (b >= 0) release_block(b);
    b = -1;
  }
  s.first_live_block = std::max(s.first_live_block, end);
}

// ---------------------------------------------------------------------------------------
// Sequences
// ---------------------------------------------------------------------------------------
std::int64_t BlockManager::add_sequence(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n,
                                        std::uint64_t extra_key) {
  if (n < 0) fail<InvalidArgument>("add_sequence: negative token count ", n);
  if (n > 0 && tokens == nullptr) fail<InvalidArgument>("add_sequence: null token pointer");
  if (find(seq_id) >= 0) fail<InvalidArgument>("add_sequence: sequence id ", seq_id, " already exists");
  std::vector<Hash128> hit_hashes;
  std::vector<std::int32_t> hit_blocks;
  std::int64_t from_lru = 0;
  const std::int64_t hits = count_prefix_hits(tokens, n, extra_key, &from_lru, &hit_hashes, &hit_blocks);
  const std::int64_t need = blocks_for(n) - hits;
  const std::int64_t avail = num_available_blocks() - from_lru;
  if (need > avail - watermark_blocks_)
    fail<OutOfBlocks>("add_sequence: sequence id ", seq_id, " (", n, " tokens) needs ", need, " new block(s)",
                      hits ? " after a prefix-cache hit of " : "", hits ? std::to_string(hits) : std::string(),
                      hits ? " block(s)" : "", "; ", avail, " available, ", watermark_blocks_,
                      " kept free by the watermark");

  // Memory first (may throw bad_alloc), then the pool.
  const std::int32_t idx = new_slot_index();
  Seq& s = seqs_[static_cast<std::size_t>(idx)];
  try {
    s.tokens.assign(tokens, tokens + n);
    s.blocks.clear();
    s.blocks.reserve(static_cast<std::size_t>(blocks_for(n) + 1));
    s.hashes.assign(hit_hashes.begin(), hit_hashes.end());
    seq_map_.insert(static_cast<std::uint64_t>(seq_id), idx);
  } catch (...) {
    free_seq_slots_.push_back(idx);
    throw;
  }
  for (const std::int32_t b : hit_blocks) {
    if (ref_[static_cast<std::size_t>(b)] == 0) lru_remove(b);
    ++ref_[static_cast<std::size_t>(b)];
    s.blocks.push_back(b);
  }
  for (std::int64_t i = 0; i < need; ++i) s.blocks.push_back(take_block());
  s.id = seq_id;
  s.live = true;
  s.swapped = false;
  s.extra_key = extra_key;
  s.first_live_block = 0;
  s.num_computed = hits * bs_;
  ++num_live_;
  if (caching_) {
    stats_.queried_tokens += n;
    stats_.hit_tokens += hits * bs_;
  }
  return hits * bs_;
}

std::int64_t BlockManager::append_demand(const Seq& s, std::int64_t n) const {
  if (n <= 0) return 0;
  const auto len = static_cast<std::int64_t>(s.tokens.size());
  std::int64_t need = blocks_for(len + n) - static_cast<std::int64_t>(s.blocks.size());
  if (len % bs_ != 0 && ref_[static_cast<std::size_t>(s.blocks.back())] > 1) ++need;  // copy-on-write
  return need;
}

void BlockManager::append_into(Seq& s, const std::int32_t* tokens, std::int64_t n, std::int64_t* slots_out) {
  if (n <= 0) return;
  const auto len = static_cast<std::int64_t>(s.tokens.size());
  if (len % bs_ != 0) {
    std::int32_t& last = s.blocks.back();
    if (ref_[static_cast<std::size_t>(last)] > 1) {  // never write a shared block
      const std::int32_t fresh = take_block();
      --ref_[static_cast<std::size_t>(last)];
      copies_.emplace_back(last, fresh);
      last = fresh;
    }
  }
  s.tokens.insert(s.tokens.end(), tokens, tokens + n);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t pos = len + i;
    const std::int64_t off = pos % bs_;
    if (off == 0) s.blocks.push_back(take_block());
    if (slots_out) slots_out[i] = static_cast<std::int64_t>(s.blocks[static_cast<std::size_t>(pos / bs_)]) * bs_ + off;
  }
}

void BlockManager::append_tokens(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n,
                                 std::int64_t* slots_out) {
  if (n < 0) fail<InvalidArgument>("append_tokens: negative token count ", n);
  Seq& s = live_gpu_seq(seq_id, "append_tokens");
  const std::int64_t need = append_demand(s, n);
  if (need > num_available_blocks())
    fail<OutOfBlocks>("append_tokens: sequence id ", seq_id, " needs ", need, " new block(s) for ", n,
                      " token(s); ", num_available_blocks(), " available");
  s.tokens.reserve(s.tokens.size() + static_cast<std::size_t>(n));
  s.blocks.reserve(static_cast<std::size_t>(blocks_for(static_cast<std::int64_t>(s.tokens.size()) + n)));
  copies_.reserve(copies_.size() + 1);
  append_into(s, tokens, n, slots_out);
}

std::int64_t BlockManager::batch_append_demand() const {
  // One token per sequence in scratch_idx_. Copy-on-write is counted exactly: when k
  // sequences share a partly filled last block, the first k - 1 appenders copy it and the
  // last one writes in place.
  next_block_stamp();
  std::int64_t need = 0;
  for (const std::int32_t idx : scratch_idx_) {
    const Seq& s = seqs_[static_cast<std::size_t>(idx)];
    if (s.tokens.size() % static_cast<std::size_t>(bs_) == 0) {
      ++need;
      continue;
    }
    const auto last = static_cast<std::size_t>(s.blocks.back());
    if (block_stamp_[last] != bstamp_) {
      block_stamp_[last] = bstamp_;
      block_mark_[last] = 0;
    }
    if (ref_[last] - block_mark_[last] > 1) {
      ++need;
      ++block_mark_[last];
    }
  }
  return need;
}

void BlockManager::append_tokens_batch(const std::int64_t* seq_ids, std::int64_t n, const std::int32_t* tokens,
                                       std::int64_t* slots_out) {
  resolve_batch(seq_ids, n, "append_tokens_batch", false);
  const std::int64_t need = batch_append_demand();
  if (need > num_available_blocks())
    fail<OutOfBlocks>("append_tokens_batch: ", n, " sequence(s) need ", need, " new block(s); ",
                      num_available_blocks(), " available");
  copies_.reserve(copies_.size() + static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    append_into(seqs_[static_cast<std::size_t>(scratch_idx_[static_cast<std::size_t>(i)])], tokens + i, 1,
                slots_out ? slots_out + i : nullptr);
}

void BlockManager::fork(std::int64_t parent_id, std::int64_t child_id) {
  const std::int32_t pidx = lookup(parent_id, "fork");
  {
    const Seq& p = seqs_[static_cast<std::size_t>(pidx)];
    if (p.swapped) fail<InvalidArgument>("fork: parent sequence id ", parent_id, " is swapped out; swap_in() it first");
    if (find(child_id) >= 0) fail<InvalidArgument>("fork: child sequence id ", child_id, " already exists");
    if (p.num_computed != static_cast<std::int64_t>(p.tokens.size()))
      fail<InvalidArgument>("fork: parent sequence id ", parent_id, " has ",
                            static_cast<std::int64_t>(p.tokens.size()) - p.num_computed,
                            " token(s) not yet computed; fork after the step that computes them");
  }
  const std::int32_t cidx = new_slot_index();
  const Seq& p = seqs_[static_cast<std::size_t>(pidx)];  // re-fetched: new_slot_index may reallocate
  Seq& c = seqs_[static_cast<std::size_t>(cidx)];
  try {
    c.tokens.assign(p.tokens.begin(), p.tokens.end());
    c.blocks.assign(p.blocks.begin(), p.blocks.end());
    c.hashes.assign(p.hashes.begin(), p.hashes.end());
    seq_map_.insert(static_cast<std::uint64_t>(child_id), cidx);
  } catch (...) {
    free_seq_slots_.push_back(cidx);
    throw;
  }
  c.id = child_id;
  c.live = true;
  c.swapped = false;
  c.num_computed = p.num_computed;
  c.extra_key = p.extra_key;
  c.first_live_block = p.first_live_block;
  for (const std::int32_t b : c.blocks)
    if (b >= 0) ++ref_[static_cast<std::size_t>(b)];
  ++num_live_;
}

void BlockManager::free(std::int64_t seq_id) {
  const std::int32_t idx = lookup(seq_id, "free");
  Seq& s = seqs_[static_cast<std::size_t>(idx)];
  if (s.swapped) {
    for (const std::int32_t c : s.blocks)
      if (c >= 0 && --cpu_ref_[static_cast<std::size_t>(c)] == 0) cpu_free_.push_back(c);
  } else {
    // Last block first: with caching, a prefix stays in the LRU set longer than its tails.
    for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it)
      if (*it >= 0) release_block(*it);
  }
  seq_map_.erase(static_cast<std::uint64_t>(seq_id));
  s.live = false;
  s.swapped = false;
  s.tokens.clear();
  s.blocks.clear();
  s.hashes.clear();
  free_seq_slots_.push_back(idx);
  --num_live_;
}

// ---------------------------------------------------------------------------------------
// Steps
// ---------------------------------------------------------------------------------------
StepShape BlockManager::plan_step(const StepRequest& req) const {
  resolve_batch(req.seq_ids, req.num_seqs, "step", false);
  StepShape shape;
  shape.num_seqs = req.num_seqs;
  const std::int64_t add = req.new_tokens ? 1 : 0;
  for (std::int64_t i = 0; i < req.num_seqs; ++i) {
    const Seq& s = seqs_[static_cast<std::size_t>(scratch_idx_[static_cast<std::size_t>(i)])];
    const std::int64_t len = static_cast<std::int64_t>(s.tokens.size()) + add;
    const std::int64_t pending = len - s.num_computed;
    const std::int64_t q = req.query_lens ? req.query_lens[i] : pending;
    if (q < 0 || q > pending)
      fail<InvalidArgument>("step: query_lens[", i, "] = ", q, " for sequence id ", s.id, " is outside [0, ",
                            pending, "] (tokens not yet computed)");
    shape.num_tokens += q;
    shape.max_blocks = std::max(shape.max_blocks, blocks_for(len));
    shape.max_seq_len = std::max(shape.max_seq_len, s.num_computed + q);
    shape.max_query_len = std::max(shape.max_query_len, q);
  }
  return shape;
}

namespace {

void check_host(const TensorView& t, const char* what, const char* name) {
  if (t.device != DeviceKind::kCPU && t.device != DeviceKind::kCUDAHost)
    fail<TypeMismatch>(what, ": ", name, " must be a host (CPU) array, got device ", device_name(t.device));
}

void check_vec(const TensorView* t, const char* what, const char* name, std::int64_t len, bool allow_int64) {
  if (!t) return;
  check_host(*t, what, name);
  const bool ok = t->dtype == DType::kInt32 || (allow_int64 && t->dtype == DType::kInt64);
  if (!ok)
    fail<TypeMismatch>(what, ": ", name, " must be ", allow_int64 ? "int64 or int32" : "int32", ", got ",
                       dtype_name(t->dtype));
  if (t->ndim != 1 || t->shape[0] != len)
    fail<InvalidArgument>(what, ": ", name, " must have shape [", len, "], got ", t->shape_str());
}

void check_table(const TensorView* t, const char* what, std::int64_t rows, std::int64_t min_cols) {
  if (!t) return;
  check_host(*t, what, "block_tables");
  if (t->dtype != DType::kInt32)
    fail<TypeMismatch>(what, ": block_tables must be int32, got ", dtype_name(t->dtype));
  if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] < min_cols)
    fail<InvalidArgument>(what, ": block_tables must have shape [", rows, ", M] with M >= ", min_cols,
                          ", got ", t->shape_str());
}

inline void put32(const TensorView* t, std::int64_t i, std::int64_t v) {
  t->ptr<std::int32_t>()[i * t->strides[0]] = static_cast<std::int32_t>(v);
}

inline void put_slot(const TensorView* t, std::int64_t i, std::int64_t v) {
  if (t->dtype == DType::kInt64)
    t->ptr<std::int64_t>()[i * t->strides[0]] = v;
  else
    t->ptr<std::int32_t>()[i * t->strides[0]] = static_cast<std::int32_t>(v);
}

void write_row(const TensorView& t, std::int64_t row, const std::vector<std::int32_t>& blocks, std::int32_t pad) {
  std::int32_t* p = t.ptr<std::int32_t>() + row * t.strides[0];
  const std::int64_t cols = t.shape[1], s1 = t.strides[1];
  const auto nb = static_cast<std::int64_t>(blocks.size());
  if (s1 == 1) {
    for (std::int64_t k = 0; k < nb; ++k) p[k] = blocks[static_cast<std::size_t>(k)] < 0 ? pad : blocks[static_cast<std::size_t>(k)];
    std::fill(p + nb, p + cols, pad);
  } else {
    for (std::int64_t k = 0; k < cols; ++k) {
      const std::int32_t b = k < nb ? blocks[static_cast<std::size_t>(k)] : pad;
      p[k * s1] = b < 0 ? pad : b;
    }
  }
}

}  // namespace

StepShape BlockManager::step(const StepRequest& req, const StepOutputs& out) {
  const StepShape shape = plan_step(req);  // resolves scratch_idx_
  const char* what = "step";
  const std::int64_t n = req.num_seqs;
  check_table(out.block_tables, what, n, shape.max_blocks);
  check_vec(out.seq_lens, what, "seq_lens", n, false);
  check_vec(out.context_lens, what, "context_lens", n, false);
  check_vec(out.query_start_loc, what, "query_start_loc", n + 1, false);
  check_vec(out.slot_mapping, what, "slot_mapping", shape.num_tokens, true);
  if (out.slot_mapping && out.slot_mapping->dtype == DType::kInt32 &&
      opt_.num_blocks * bs_ > std::numeric_limits<std::int32_t>::max())
    fail<InvalidArgument>(what, ": slot_mapping must be int64: slots reach ", opt_.num_blocks * bs_);
  if (req.new_tokens) {
    const std::int64_t need = batch_append_demand();
    if (need > num_available_blocks())
      fail<OutOfBlocks>("step: appending one token to each of ", n, " sequence(s) needs ", need,
                        " new block(s); ", num_available_blocks(), " available");
    copies_.reserve(copies_.size() + static_cast<std::size_t>(n));
  }

  // Nothing below can fail.
  std::int64_t t = 0;  // tokens scheduled so far
  if (out.query_start_loc) put32(out.query_start_loc, 0, 0);
  if (req.new_tokens)  // all allocations first, then the schedule (which may register blocks)
    for (std::int64_t i = 0; i < n; ++i)
      append_into(seqs_[static_cast<std::size_t>(scratch_idx_[static_cast<std::size_t>(i)])], req.new_tokens + i, 1,
                  nullptr);
  for (std::int64_t i = 0; i < n; ++i) {
    Seq& s = seqs_[static_cast<std::size_t>(scratch_idx_[static_cast<std::size_t>(i)])];
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    const std::int64_t ctx = s.num_computed;
    const std::int64_t q = req.query_lens ? req.query_lens[i] : len - ctx;
    release_window(s, ctx);
    if (out.slot_mapping) {
      for (std::int64_t pos = ctx; pos < ctx + q; ++pos)
        put_slot(out.slot_mapping, t + pos - ctx,
                 static_cast<std::int64_t>(s.blocks[static_cast<std::size_t>(pos / bs_)]) * bs_ + pos % bs_);
    }
    t += q;
    if (out.query_start_loc) put32(out.query_start_loc, i + 1, t);
    if (out.block_tables) write_row(*out.block_tables, i, s.blocks, out.pad);
    if (out.seq_lens) put32(out.seq_lens, i, ctx + q);
    if (out.context_lens) put32(out.context_lens, i, ctx);
    s.num_computed = ctx + q;
    register_full_blocks(s);
  }
  return shape;
}

void BlockManager::take_copy_pairs(BlockPairs& pairs) {
  pairs.insert(pairs.end(), copies_.begin(), copies_.end());
  copies_.clear();
}

}  // namespace pagedattn
