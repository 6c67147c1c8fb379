// BlockManager: swapping, capacity queries, exports, introspection and invariant checks.
#include <algorithm>
#include <limits>
#include <stdexcept>

#include "pagedattn/block_manager.hpp"

namespace pagedattn {

// ---------------------------------------------------------------------------------------
// Swapping
// ---------------------------------------------------------------------------------------
void BlockManager::next_block_stamp() const {
  if (++bstamp_ == 0) {
    std::fill(block_stamp_.begin(), block_stamp_.end(), 0u);
    bstamp_ = 1;
  }
}

std::int64_t BlockManager::distinct_blocks_of_scratch(bool cpu) const {
  (void)cpu;  // the same stamp arrays serve both pools (sized for the larger one)
  next_block_stamp();
  std::int64_t distinct = 0;
  for (const std::int32_t idx : scratch_idx_) {
    for (const std::int32_t b : seqs_[static_cast<std::size_t>(idx)].blocks) {
      if (b < 0 || block_stamp_[static_cast<std::size_t>(b)] == bstamp_) continue;
      block_stamp_[static_cast<std::size_t>(b)] = bstamp_;
      ++distinct;
    }
  }
  return distinct;
}

namespace {
void check_no_pending(std::int64_t pending, const char* what) {
  if (pending > 0)
    fail<InvalidArgument>(what, ": ", pending,
                          " copy-on-write pair(s) are pending; take_copy_pairs() and run copy_blocks first");
}
}  // namespace

void BlockManager::swap_out(const std::int64_t* seq_ids, std::int64_t n, BlockPairs& pairs) {
  if (opt_.num_cpu_blocks == 0) fail<InvalidArgument>("swap_out: this manager has no CPU pool (num_cpu_blocks=0)");
  check_no_pending(num_pending_copies(), "swap_out");
  resolve_batch(seq_ids, n, "swap_out", false);
  const std::int64_t need = distinct_blocks_of_scratch(false);
  if (need > num_free_cpu_blocks())
    fail<OutOfBlocks>("swap_out: ", n, " sequence(s) need ", need, " CPU block(s); ", num_free_cpu_blocks(),
                      " free");
  pairs.reserve(pairs.size() + static_cast<std::size_t>(need));
  // Map every distinct GPU block to a CPU block (first use in table order), then release
  // the GPU blocks, last block first (as free() does).
  next_block_stamp();
  for (const std::int32_t idx : scratch_idx_) {
    Seq& s = seqs_[static_cast<std::size_t>(idx)];
    for (std::int32_t& b : s.blocks) {
      if (b < 0) continue;
      const auto bi = static_cast<std::size_t>(b);
      if (block_stamp_[bi] != bstamp_) {
        block_stamp_[bi] = bstamp_;
        const std::int32_t c = cpu_free_.back();
        cpu_free_.pop_back();
        cpu_ref_[static_cast<std::size_t>(c)] = 0;
        block_mark_[bi] = c;
        pairs.emplace_back(b, c);
      }
      ++cpu_ref_[static_cast<std::size_t>(block_mark_[bi])];
    }
    for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) {
      if (*it < 0) continue;
      const std::int32_t b = *it;
      *it = block_mark_[static_cast<std::size_t>(b)];
      release_block(b);
    }
    s.swapped = true;
  }
}

void BlockManager::swap_in(const std::int64_t* seq_ids, std::int64_t n, BlockPairs& pairs) {
  if (opt_.num_cpu_blocks == 0) fail<InvalidArgument>("swap_in: this manager has no CPU pool (num_cpu_blocks=0)");
  check_no_pending(num_pending_copies(), "swap_in");
  resolve_batch(seq_ids, n, "swap_in", true);
  const std::int64_t need = distinct_blocks_of_scratch(true);
  if (need > num_available_blocks() - watermark_blocks_)
    fail<OutOfBlocks>("swap_in: ", n, " sequence(s) need ", need, " block(s); ", num_available_blocks(),
                      " available, ", watermark_blocks_, " kept free by the watermark");
  pairs.reserve(pairs.size() + static_cast<std::size_t>(need));
  next_block_stamp();
  for (const std::int32_t idx : scratch_idx_) {
    Seq& s = seqs_[static_cast<std::size_t>(idx)];
    for (std::int32_t& c : s.blocks) {
      if (c < 0) continue;
      const auto ci = static_cast<std::size_t>(c);
      if (block_stamp_[ci] != bstamp_) {
        block_stamp_[ci] = bstamp_;
        const std::int32_t g = take_block();
        ref_[static_cast<std::size_t>(g)] = 0;
        block_mark_[ci] = g;
        pairs.emplace_back(c, g);
      }
      const std::int32_t g = block_mark_[ci];
      ++ref_[static_cast<std::size_t>(g)];
      if (--cpu_ref_[ci] == 0) cpu_free_.push_back(c);
      c = g;
    }
    s.swapped = false;
  }
}

// ---------------------------------------------------------------------------------------
// Capacity
// ---------------------------------------------------------------------------------------
bool BlockManager::can_allocate(const std::int32_t* tokens, std::int64_t n, std::uint64_t extra_key) const {
  if (n < 0) return false;
  std::int64_t from_lru = 0;
  const std::int64_t hits = count_prefix_hits(tokens, n, extra_key, &from_lru, nullptr, nullptr);
  return blocks_for(n) - hits <= num_available_blocks() - from_lru - watermark_blocks_;
}

bool BlockManager::can_append(std::int64_t seq_id, std::int64_t num_tokens) const {
  const Seq& s = seqs_[static_cast<std::size_t>(lookup(seq_id, "can_append"))];
  if (s.swapped || num_tokens < 0) return false;
  return append_demand(s, num_tokens) <= num_available_blocks();
}

bool BlockManager::can_append_batch(const std::int64_t* seq_ids, std::int64_t n) const {
  resolve_batch(seq_ids, n, "can_append_batch", false);
  return batch_append_demand() <= num_available_blocks();
}

bool BlockManager::can_swap_out(const std::int64_t* seq_ids, std::int64_t n) const {
  resolve_batch(seq_ids, n, "can_swap_out", false);
  if (opt_.num_cpu_blocks == 0 || !copies_.empty()) return false;
  return distinct_blocks_of_scratch(false) <= num_free_cpu_blocks();
}

bool BlockManager::can_swap_in(const std::int64_t* seq_ids, std::int64_t n) const {
  resolve_batch(seq_ids, n, "can_swap_in", true);
  if (!copies_.empty()) return false;
  return distinct_blocks_of_scratch(true) <= num_available_blocks() - watermark_blocks_;
}

// ---------------------------------------------------------------------------------------
// Export
// ---------------------------------------------------------------------------------------
namespace {

void check_int32_out(const TensorView& t, const char* what, const char* name, int ndim) {
  if (t.device != DeviceKind::kCPU && t.device != DeviceKind::kCUDAHost)
    fail<TypeMismatch>(what, ": ", name, " must be a host (CPU) array, got device ", device_name(t.device));
  if (t.dtype != DType::kInt32) fail<TypeMismatch>(what, ": ", name, " must be int32, got ", dtype_name(t.dtype));
  if (t.ndim != ndim) fail<InvalidArgument>(what, ": ", name, " must have ", ndim, " dimension(s), got ", t.shape_str());
}

inline std::int32_t& at(const TensorView& t, std::int64_t i) { return t.ptr<std::int32_t>()[i * t.strides[0]]; }

}  // namespace

void BlockManager::export_block_tables(const std::int64_t* seq_ids, std::int64_t n, const TensorView& out,
                                       std::int32_t pad) const {
  const char* what = "export_block_tables";
  resolve_batch(seq_ids, n, what, false);
  std::int64_t width = 0;
  for (const std::int32_t idx : scratch_idx_)
    width = std::max<std::int64_t>(width, static_cast<std::int64_t>(seqs_[static_cast<std::size_t>(idx)].blocks.size()));
  check_int32_out(out, what, "block_tables", 2);
  if (out.shape[0] != n || out.shape[1] < width)
    fail<InvalidArgument>(what, ": block_tables must have shape [", n, ", M] with M >= ", width, ", got ",
                          out.shape_str());
  const std::int64_t cols = out.shape[1];
  for (std::int64_t i = 0; i < n; ++i) {
    const auto& blocks = seqs_[static_cast<std::size_t>(scratch_idx_[static_cast<std::size_t>(i)])].blocks;
    std::int32_t* row = out.ptr<std::int32_t>() + i * out.strides[0];
    const auto nb = static_cast<std::int64_t>(blocks.size());
    for (std::int64_t k = 0; k < cols; ++k) {
      const std::int32_t b = k < nb ? blocks[static_cast<std::size_t>(k)] : pad;
      row[k * out.strides[1]] = b < 0 ? pad : b;
    }
  }
}

void BlockManager::export_seq_lens(const std::int64_t* seq_ids, std::int64_t n, const TensorView& out) const {
  const char* what = "export_seq_lens";
  resolve_batch(seq_ids, n, what, false);
  check_int32_out(out, what, "seq_lens", 1);
  if (out.shape[0] != n) fail<InvalidArgument>(what, ": seq_lens must have shape [", n, "], got ", out.shape_str());
  for (std::int64_t i = 0; i < n; ++i)
    at(out, i) = static_cast<std::int32_t>(seqs_[static_cast<std::size_t>(scratch_idx_[static_cast<std::size_t>(i)])].tokens.size());
}

std::int64_t BlockManager::count_blocks(const std::int64_t* seq_ids, std::int64_t n) const {
  resolve_batch(seq_ids, n, "count_blocks", false);
  std::int64_t total = 0;
  for (const std::int32_t idx : scratch_idx_) total += static_cast<std::int64_t>(seqs_[static_cast<std::size_t>(idx)].blocks.size());
  return total;
}

void BlockManager::export_csr(const std::int64_t* seq_ids, std::int64_t n, const TensorView& indptr,
                              const TensorView& indices, const TensorView& last_page_len, std::int32_t pad) const {
  const char* what = "export_csr";
  const std::int64_t nnz = count_blocks(seq_ids, n);  // resolves scratch_idx_
  check_int32_out(indptr, what, "indptr", 1);
  check_int32_out(indices, what, "indices", 1);
  check_int32_out(last_page_len, what, "last_page_len", 1);
  if (indptr.shape[0] != n + 1) fail<InvalidArgument>(what, ": indptr must have shape [", n + 1, "], got ", indptr.shape_str());
  if (indices.shape[0] != nnz) fail<InvalidArgument>(what, ": indices must have shape [", nnz, "], got ", indices.shape_str());
  if (last_page_len.shape[0] != n)
    fail<InvalidArgument>(what, ": last_page_len must have shape [", n, "], got ", last_page_len.shape_str());
  std::int64_t k = 0;
  at(indptr, 0) = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const Seq& s = seqs_[static_cast<std::size_t>(scratch_idx_[static_cast<std::size_t>(i)])];
    for (const std::int32_t b : s.blocks) at(indices, k++) = b < 0 ? pad : b;
    at(indptr, i + 1) = static_cast<std::int32_t>(k);
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    at(last_page_len, i) = static_cast<std::int32_t>(len == 0 ? 0 : (len - 1) % bs_ + 1);
  }
}

void BlockManager::slots(std::int64_t seq_id, std::int64_t start, std::int64_t stop, std::int64_t* out) const {
  const Seq& s = live_gpu_seq(seq_id, "slots");
  const auto len = static_cast<std::int64_t>(s.tokens.size());
  if (start < 0 || stop < start || stop > len)
    fail<OutOfRange>("slots: token range [", start, ", ", stop, ") is outside sequence id ", seq_id, " of length ", len);
  for (std::int64_t pos = start; pos < stop; ++pos) {
    const std::int32_t b = s.blocks[static_cast<std::size_t>(pos / bs_)];
    out[pos - start] = b < 0 ? -1 : static_cast<std::int64_t>(b) * bs_ + pos % bs_;
  }
}

// ---------------------------------------------------------------------------------------
// Introspection
// ---------------------------------------------------------------------------------------
const std::vector<std::int32_t>& BlockManager::block_table(std::int64_t seq_id) const {
  return seqs_[static_cast<std::size_t>(lookup(seq_id, "block_table"))].blocks;
}
const std::vector<std::int32_t>& BlockManager::token_ids(std::int64_t seq_id) const {
  return seqs_[static_cast<std::size_t>(lookup(seq_id, "token_ids"))].tokens;
}
std::int64_t BlockManager::seq_len(std::int64_t seq_id) const {
  return static_cast<std::int64_t>(seqs_[static_cast<std::size_t>(lookup(seq_id, "seq_len"))].tokens.size());
}
std::int64_t BlockManager::num_computed(std::int64_t seq_id) const {
  return seqs_[static_cast<std::size_t>(lookup(seq_id, "num_computed"))].num_computed;
}
bool BlockManager::is_swapped(std::int64_t seq_id) const {
  return seqs_[static_cast<std::size_t>(lookup(seq_id, "is_swapped"))].swapped;
}
std::int32_t BlockManager::ref_count(std::int64_t block) const {
  if (block < 0 || block >= opt_.num_blocks)
    fail<OutOfRange>("ref_count: block ", block, " is outside [0, ", opt_.num_blocks, ")");
  return ref_[static_cast<std::size_t>(block)];
}
std::int32_t BlockManager::cpu_ref_count(std::int64_t block) const {
  if (block < 0 || block >= opt_.num_cpu_blocks)
    fail<OutOfRange>("cpu_ref_count: block ", block, " is outside [0, ", opt_.num_cpu_blocks, ")");
  return cpu_ref_[static_cast<std::size_t>(block)];
}
bool BlockManager::is_cached(std::int64_t block) const {
  if (block < 0 || block >= opt_.num_blocks)
    fail<OutOfRange>("is_cached: block ", block, " is outside [0, ", opt_.num_blocks, ")");
  return caching_ && cached_[static_cast<std::size_t>(block)] != 0;
}

void BlockManager::check_invariants() const {
  auto bad = [](auto&&... parts) { throw std::logic_error(detail::concat("BlockManager invariant: ", parts...)); };
  const auto nb = static_cast<std::size_t>(opt_.num_blocks);
  const auto nc = static_cast<std::size_t>(opt_.num_cpu_blocks);
  std::vector<std::int32_t> holders(nb, 0), cpu_holders(nc, 0);
  std::int64_t live = 0;
  for (const Seq& s : seqs_) {
    if (!s.live) continue;
    ++live;
    if (find(s.id) < 0 || &seqs_[static_cast<std::size_t>(find(s.id))] != &s) bad("sequence ", s.id, " not in the id map");
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    if (static_cast<std::int64_t>(s.blocks.size()) != blocks_for(len))
      bad("sequence ", s.id, " has ", s.blocks.size(), " blocks for ", len, " tokens");
    if (s.num_computed < 0 || s.num_computed > len) bad("sequence ", s.id, " num_computed out of range");
    if (caching_ && static_cast<std::int64_t>(s.hashes.size()) > s.num_computed / bs_)
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
        const std::int32_t b = s.blocks[static_cast<std::size_t>(pos / bs_)];
        if (ref_[static_cast<std::size_t>(b)] != 1)
          bad("sequence ", s.id, " token ", pos, " would be written into block ", b, " with ", ref_[static_cast<std::size_t>(b)], " holders");
      }
  }
  if (live != num_live_ || seq_map_.size() != num_live_) bad("live sequence count mismatch");
  for (std::size_t b = 0; b < nb; ++b)
    if (holders[b] != ref_[b]) bad("block ", b, " ref count ", ref_[b], " but held by ", holders[b], " table entries");
  for (std::size_t c = 0; c < nc; ++c)
    if (cpu_holders[c] != cpu_ref_[c]) bad("CPU block ", c, " ref count ", cpu_ref_[c], " but held ", cpu_holders[c], " times");

  std::vector<std::uint8_t> seen(nb, 0);
  for (const std::int32_t b : free_) {
    const auto bi = static_cast<std::size_t>(b);
    if (seen[bi]++) bad("block ", b, " twice in the free list");
    if (ref_[bi] != 0) bad("free block ", b, " has ref count ", ref_[bi]);
    if (caching_ && cached_[bi]) bad("free block ", b, " is registered in the cache");
  }
  std::int64_t lru = 0, registered = 0;
  if (caching_) {
    for (std::int32_t b = lru_next_[nb]; b != static_cast<std::int32_t>(nb); b = lru_next_[static_cast<std::size_t>(b)]) {
      const auto bi = static_cast<std::size_t>(b);
      if (seen[bi]++) bad("block ", b, " in the LRU set twice or also free");
      if (ref_[bi] != 0 || !cached_[bi]) bad("LRU block ", b, " is in use or not registered");
      ++lru;
    }
    for (std::size_t b = 0; b < nb; ++b) {
      if (!cached_[b]) continue;
      ++registered;
      if (cache_map_.find(bhash_[b].lo) != static_cast<std::int32_t>(b)) bad("registered block ", b, " not in the map");
    }
    if (registered != cache_map_.size()) bad("cache map size ", cache_map_.size(), " vs ", registered, " registered");
  }
  if (lru != lru_size_) bad("LRU size ", lru_size_, " but ", lru, " linked");
  std::int64_t used = 0;
  for (std::size_t b = 0; b < nb; ++b) used += ref_[b] > 0;
  if (num_free_blocks() + lru + used != opt_.num_blocks)
    bad("free ", num_free_blocks(), " + cached ", lru, " + used ", used, " != ", opt_.num_blocks);
  std::vector<std::uint8_t> cseen(nc, 0);
  std::int64_t cpu_used = 0;
  for (const std::int32_t c : cpu_free_) {
    if (cseen[static_cast<std::size_t>(c)]++) bad("CPU block ", c, " twice in the free list");
    if (cpu_ref_[static_cast<std::size_t>(c)] != 0) bad("free CPU block ", c, " in use");
  }
  for (std::size_t c = 0; c < nc; ++c) cpu_used += cpu_ref_[c] > 0;
  if (cpu_used + num_free_cpu_blocks() != opt_.num_cpu_blocks) bad("CPU pool does not add up");
  for (const auto& pr : copies_)
    if (pr.first < 0 || pr.second < 0 || pr.first >= opt_.num_blocks || pr.second >= opt_.num_blocks || pr.first == pr.second)
      bad("bad pending copy pair");
}

}  // namespace pagedattn
