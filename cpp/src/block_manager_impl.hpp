// The block manager's private state (BlockManager::Impl) and the helpers its parts share.
//
// Where each part lives:
//   block_manager.cpp             construction, the sequence lifecycle (add, append, fork, free), queries
//   block_manager_step.cpp        plan_step / step: the scheduler step and its metadata, sliding window
//   block_manager_capacity.cpp    block demand of a request and the can_* queries
//   block_manager_swap.cpp        swap_out / swap_in planning
//   block_manager_export.cpp      block tables (full, incremental), lengths, CSR page tables, slots
//   block_manager_invariants.cpp  check_invariants
//   block_pool.hpp                reference counts, free list, LRU of evictable cached blocks
//   prefix_cache.hpp              block hash, prefix-node tree, registry and exact prefix lookup
//   id_map.hpp                    the int64 -> int32 hash map (sequence ids, block hashes)
//   host_outputs.hpp              checks and writes of caller-provided output arrays
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_pool.hpp"
#include "id_map.hpp"
#include "pagedattn/block_manager.hpp"
#include "prefix_cache.hpp"

namespace pagedattn {

struct BlockManager::Impl {
  // Field order matters: the first cache line holds what every step reads (a decode step
  // over hundreds of sequences is bound by the cache lines it touches per sequence).
  struct alignas(64) Seq {
    std::vector<std::int32_t> blocks;  // GPU ids (CPU ids while swapped); -1 = released
    std::vector<std::int32_t> tokens;
    std::int64_t num_computed = 0;
    bool live = false;
    bool swapped = false;
    bool ids_known = true;              // false: admitted by count (add_sequence_by_count) or forked from one
    std::int64_t export_row = -1;       // row of the remembered table it was last written to
    std::int64_t dirty_from = 0;        // entries [dirty_from, ...) changed since that write
    std::uint64_t uid = 0;              // unique over the manager's life (incremental export)
    std::int64_t first_live_block = 0;  // sliding window: blocks before it are released
    std::int64_t id = 0;
    std::uint64_t extra_key = 0;
    std::vector<PrefixCache::Link> chain;  // prefix nodes of blocks [0, chain.size()) (caching only; held)
  };

  // The table remembered by incremental steps (StepOutputs::incremental).
  struct ExportTrack {
    const void* data = nullptr;  // null: nothing remembered
    std::int64_t rows = 0, cols = 0, s0 = 0, s1 = 0;
    std::int32_t pad = 0;
    std::uintptr_t lo = 0, hi = 0;       // bytes the table spans
    std::vector<std::uint64_t> row_uid;  // sequence whose entries a row holds; 0 = unknown content
    std::vector<std::int64_t> row_len;   // entries of that sequence written; the rest of the row is pad
  };

  explicit Impl(const BlockManagerOptions& options);  // options already validated

  // ---- sequences (block_manager.cpp)
  // Block index and offset of a token position >= 0 (a shift and a mask when the block size
  // is a power of two: the hot paths divide by it once per sequence and step).
  std::int64_t block_of(std::int64_t pos) const { return bs_shift >= 0 ? pos >> bs_shift : pos / bs; }
  std::int64_t offset_of(std::int64_t pos) const { return bs_shift >= 0 ? pos & (bs - 1) : pos % bs; }
  // Overflow-free for every int64 n (n + bs - 1 would wrap near 2^63).
  std::int64_t blocks_for(std::int64_t n) const { return n <= 0 ? 0 : block_of(n) + (offset_of(n) != 0); }
  std::int32_t find(std::int64_t seq_id) const { return seq_map.find(static_cast<std::uint64_t>(seq_id)); }
  std::int32_t lookup(std::int64_t seq_id, const char* what) const;  // throws UnknownSequence
  Seq& seq_at(std::int32_t idx) { return seqs[static_cast<std::size_t>(idx)]; }
  const Seq& seq_at(std::int32_t idx) const { return seqs[static_cast<std::size_t>(idx)]; }
  const Seq& live_gpu_seq(std::int64_t seq_id, const char* what) const;  // throws if unknown or swapped
  Seq& live_gpu_seq(std::int64_t seq_id, const char* what) {
    return const_cast<Seq&>(static_cast<const Impl*>(this)->live_gpu_seq(seq_id, what));
  }
  // Resolves a batch of distinct ids into scratch_idx (all swapped out, or none).
  void resolve_batch(const std::int64_t* seq_ids, std::int64_t n, const char* what, bool want_swapped) const;
  // The same for sequences in any state (want: 0 = on the GPU, 1 = swapped out, -1 = either).
  void resolve_ids(const std::int64_t* seq_ids, std::int64_t n, const char* what, int want) const;
  // Narrows int64 token ids [n] into narrowed (throws InvalidArgument, naming the first id
  // outside int32, before anything changes).
  static void narrow_tokens(const std::int64_t* tokens, std::int64_t n, std::vector<std::int32_t>& narrowed,
                            const char* what);
  // Admission shared by add_sequence and add_sequence_by_count (tokens null: ids not kept).
  std::int64_t admit(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n, std::uint64_t extra_key,
                     const char* what);
  void check_forkable(std::int64_t parent_id, std::int64_t child_id, const char* what) const;
  void fork_at(std::int32_t pidx, std::int64_t child_id);  // checked by check_forkable
  void free_at(std::int32_t idx);
  static void mark_dirty(Seq& s, std::int64_t entry) { s.dirty_from = std::min(s.dirty_from, entry); }
  std::int32_t new_slot_index();
  // Room for n more entries of free_seq_slots, so that a free cannot fail half way.
  void reserve_free_slots(std::int64_t n);
  std::int32_t take_block();
  void release_block(std::int32_t b) { pool.release(b, cache.is_registered(b)); }
  void append_into(Seq& s, const std::int32_t* tokens, std::int64_t n, std::int64_t* slots_out);
  // Blocks of the longest cached prefix of a prompt (at most (n-1)/block_size); *from_lru
  // counts those that are evictable now. chain / blocks (may be null) receive the matches.
  std::int64_t count_prefix_hits(const std::int32_t* tokens, std::int64_t n, std::uint64_t extra,
                                 std::int64_t* from_lru, std::vector<PrefixCache::Link>* chain,
                                 std::vector<std::int32_t>* blocks) const;
  void register_full_blocks(Seq& s);
  void release_chain(Seq& s);  // drops the sequence's references on its prefix nodes

  // ---- steps (block_manager_step.cpp)
  // plan_step; with demand, also counts the blocks appending req.new_tokens takes (as
  // batch_append_demand, in the same pass over the batch).
  StepShape plan(const StepRequest& req, std::int64_t* demand) const;
  void release_window(Seq& s, std::int64_t first_query_pos);

  // ---- incremental export (block_manager_export.cpp)
  // Remembers table t (resetting every row when it is not the table remembered now).
  void track_table(const TensorView& t, std::int32_t pad) const;
  // Forgets the remembered table when t shares memory with it (a full write into it).
  void forget_table_if_overlapping(const TensorView& t) const;
  // Writes row `row` of the remembered table for sequence s: only what differs.
  void write_row_incremental(const TensorView& t, std::int64_t row, Seq& s) const;

  // ---- demand (block_manager_capacity.cpp)
  std::int64_t append_demand(const Seq& s, std::int64_t n) const;
  std::int64_t batch_append_demand() const;  // over scratch_idx, one token each
  // One sequence's share of batch_append_demand (after next_block_stamp()). Copy-on-write
  // is counted exactly: when k sequences of the batch share a partly filled last block, the
  // first k - 1 appenders copy it and the last one writes in place.
  std::int64_t append_one_demand(const Seq& s) const {
    if (offset_of(static_cast<std::int64_t>(s.tokens.size())) == 0) return 1;  // a new block
    if (pool.ref(s.blocks.back()) == 1) return 0;  // held by this sequence alone: written in place
    return shared_append_demand(s);
  }
  std::int64_t shared_append_demand(const Seq& s) const;  // the last block is shared
  std::int64_t distinct_blocks_of_scratch() const;
  // Starts a new marking round over block_stamp (clearing it when the counter wraps).
  void next_block_stamp() const;

  BlockManagerOptions opt;
  std::int64_t bs = 16;
  int bs_shift = -1;  // log2(bs) when bs is a power of two, else -1
  std::int64_t watermark_blocks = 0;

  BlockPool pool;      // GPU
  BlockPool cpu_pool;  // swap space
  PrefixCache cache;
  PrefixCacheStats stats;

  std::vector<Seq> seqs;
  std::vector<std::int32_t> free_seq_slots;
  IdMap seq_map;  // seq id -> index into seqs
  std::int64_t num_live = 0;

  BlockPairs copies;  // pending copy-on-write pairs
  std::uint64_t next_uid = 1;
  mutable ExportTrack track;

  // Scratch (no allocation in steady state).
  mutable std::vector<std::int32_t> scratch_idx;
  mutable std::vector<std::uint32_t> seq_stamp;  // per seq slot, for duplicate detection
  mutable std::uint32_t stamp = 0;
  mutable std::uint32_t bstamp = 0;
  mutable std::vector<std::int32_t> block_mark;  // per GPU/CPU block, for swap dedupe / demand
  mutable std::vector<std::uint32_t> block_stamp;
};

}  // namespace pagedattn
