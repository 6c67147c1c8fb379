// The host-side KV block manager: which physical cache block holds which token.
//
// A pool of `num_blocks` physical blocks of `block_size` tokens each (plus an optional
// CPU pool for swapped-out sequences). Sequences grow token by token; each token gets a
// slot `block * block_size + offset` in the paged KV cache. The manager produces what the
// kernels read: block tables, sequence lengths, slot mappings, and for chunked prefill
// query_start_loc / context_lens (the names used by vLLM's attention metadata).
//
// Sequence model
//   Every sequence has `num_tokens` tokens, each with a slot, and a cursor `num_computed`:
//   tokens [0, num_computed) have their K/V written in the cache, tokens
//   [num_computed, num_tokens) are waiting for a step. add_sequence() sets the cursor to
//   the number of tokens found in the prefix cache, append_tokens() adds tokens after it,
//   and step() schedules a query range per sequence (advancing the cursor) and writes the
//   step's metadata. A decode step is step() with one new token per sequence.
//
// Copy-on-write
//   fork() makes the child share all of the parent's blocks (reference counts). The first
//   append into a shared, partly filled last block moves the appender onto a fresh block
//   and queues a (src, dst) copy; take_copy_pairs() (or step()) hands the queue out for
//   copy_blocks, which must run before the next forward pass. A block with reference
//   count > 1 never receives a slot: every slot handed out lies in a block owned by
//   exactly one sequence.
//
// Prefix caching (optional)
//   Once all tokens of a full block are computed, the block is registered in the prefix
//   cache. add_sequence() reuses the longest registered prefix (at most (n-1)/block_size
//   blocks, so at least one prompt token is always left to compute). A hit is exact: the
//   cache keeps a tree of prefixes (each node: its parent prefix, the extra key, the
//   block's exact token ids), a registered block is attached to the prefix it was computed
//   after, and block i is reused only when its node's parent is the node reused at i - 1
//   and its tokens and extra key equal the prompt's. A chained 128-bit hash only finds
//   candidates, so a hash collision (constructed or accidental) can cost a hit but never
//   give a false one. Token ids are any int32 values (negative ones included).
//   When a block is registered for a prefix that already has a block, the newer block wins
//   and the older one is unregistered. Blocks of freed sequences that are registered stay
//   reusable in an LRU set and are evicted only when a block is needed and the free list
//   is empty; a sequence's blocks enter the LRU set last block first, so a prefix
//   outlives its tails.
//
// Caller arrays
//   Every call that writes into caller memory (step, the exports, append_tokens*) refuses,
//   with InvalidArgument naming both arrays, an output that shares memory with one of the
//   call's inputs or with another output.
//
// Capacity and failures
//   Allocation takes from the free list, then evicts the least recently used cached block.
//   add_sequence() and swap_in() keep `watermark * num_blocks` blocks available; appends
//   may use them. Every mutating call validates and counts what it needs before changing
//   anything: when it throws, the manager is exactly as before the call.
//
// Swapping
//   swap_out() moves sequences to the CPU pool and returns the (gpu_block, cpu_block)
//   pairs for swap_blocks; swap_in() moves them back and returns (cpu_block, gpu_block)
//   pairs. Blocks shared among the sequences of one call are moved once. Execute each
//   returned mapping before the next forward pass and in the order the calls were made;
//   swap_out()/swap_in() refuse while copy-on-write pairs are pending. Preemption by
//   recomputation is free() followed by add_sequence() with the tokens so far.
//
// Sliding window (optional, not with prefix caching)
//   With `sliding_window = W`, step() releases blocks whose tokens are all older than
//   every position a query of this or any later step can attend to (key positions
//   p - W + 1 .. p). Released positions read back as -1 from block_table() and as the pad
//   value in exported tables.
//
// Thread safety: none. A BlockManager must not be used from two threads at once (not even
// const queries, which use internal scratch buffers); use one manager per thread or an
// external lock. From Python every call holds the GIL, which serializes calls on standard
// (GIL) CPython builds.
//
// Dimension legend: S = number of sequences in a batch, M = block-table width,
// T = number of tokens scheduled in a step, P = number of block pairs.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "pagedattn/errors.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn {

struct BlockManagerOptions {
  std::int64_t num_blocks = 0;        // GPU pool size, in blocks (at most 2^31 - 1)
  std::int64_t block_size = 16;       // tokens per block
  bool enable_prefix_caching = false;
  std::int64_t num_cpu_blocks = 0;    // CPU pool for swap_out / swap_in; 0 = no swapping
  double watermark = 0.0;             // share of num_blocks kept available at admission, in [0, 1)
  std::int64_t sliding_window = 0;    // tokens; 0 = off
};

struct PrefixCacheStats {
  std::int64_t queried_tokens = 0;  // prompt tokens looked up by add_sequence()
  std::int64_t hit_tokens = 0;      // of those, found in the cache
  std::int64_t evictions = 0;       // cached blocks evicted to serve an allocation
  double hit_rate() const { return queried_tokens ? double(hit_tokens) / double(queried_tokens) : 0.0; }
};

// What step() schedules. Pointers are not owned; ids must be distinct.
struct StepRequest {
  const std::int64_t* seq_ids = nullptr;     // [S]
  std::int64_t num_seqs = 0;
  const std::int32_t* new_tokens = nullptr;  // [S] one token appended to each sequence first, or null
  const std::int64_t* query_lens = nullptr;  // [S] tokens to schedule per sequence; null = all not yet computed
};

// Sizes of a step's outputs (returned by plan_step() before anything changes).
struct StepShape {
  std::int64_t num_seqs = 0;
  std::int64_t num_tokens = 0;     // T = sum of query lengths
  std::int64_t max_blocks = 0;     // widest block table in the batch
  std::int64_t max_seq_len = 0;
  std::int64_t max_query_len = 0;
};

// Where step() writes. Any output may be null (not written; all null = a step that only
// advances the manager). Host memory, any strides. No output may share memory with the
// request's arrays or with another output (InvalidArgument).
//
// Persistent buffers (persistent = true): every output may be larger than the step needs
// (block_tables [R, M] with R >= S, the vectors at least as long as below); the step writes
// the leading rows / entries and leaves the rest as they are, so one set of buffers sized
// for the largest batch serves every step without re-slicing.
//
// Incremental block tables (incremental = true): the manager remembers the last table it
// wrote incrementally (address, shape, strides and pad) and, per row, which sequence it
// holds and how many of its entries are written; a step then writes only what differs: the
// new entries of a sequence that keeps its row, and the whole row (padded to the width) of
// a sequence that is new to its row or whose entries changed since (copy-on-write, swap_in,
// sliding-window release). Rows [0, S) always end exactly as a full rewrite would leave
// them. A different table or pad starts over with full rows. Only this manager may write
// the table between incremental steps: after writing it yourself, call
// reset_incremental_export() (or step once with incremental = false). A full write
// (incremental = false, or export_block_tables) into the remembered table forgets it.
struct StepOutputs {
  const TensorView* block_tables = nullptr;     // int32 [S, M], M >= StepShape::max_blocks; padded with pad
  const TensorView* seq_lens = nullptr;         // int32 [S]   context + query length
  const TensorView* context_lens = nullptr;     // int32 [S]   tokens computed before this step
  const TensorView* query_start_loc = nullptr;  // int32 [S+1] exclusive prefix sum of query lengths
  const TensorView* slot_mapping = nullptr;     // int64 or int32 [T] slot of every scheduled token
  std::int32_t pad = 0;                         // fills unused and released block-table entries
  bool persistent = false;                      // outputs may be larger than the step (see above)
  bool incremental = false;                     // write only the changed block-table entries
};

// What add_sequence() would find in the prefix cache for a prompt (peek_prefix()).
struct PrefixPeek {
  std::int64_t cached_tokens = 0;         // leading tokens already computed (add_sequence's return value)
  std::int64_t new_blocks = 0;            // blocks add_sequence would take from the pool
  std::int64_t reused_cached_blocks = 0;  // hit blocks now evictable (leave the available set too)
  bool fits = false;                      // whether add_sequence would succeed now (can_allocate)
};

class BlockManager {
 public:
  using BlockPairs = std::vector<std::pair<std::int32_t, std::int32_t>>;

  // Throws InvalidArgument for options outside their documented ranges.
  explicit BlockManager(const BlockManagerOptions& options);
  BlockManager(const BlockManager& other);  // an independent copy of the whole state
  BlockManager& operator=(const BlockManager& other);
  BlockManager(BlockManager&&) noexcept;
  BlockManager& operator=(BlockManager&&) noexcept;
  ~BlockManager();  // a moved-from manager may only be destroyed or assigned to

  const BlockManagerOptions& options() const;
  std::int64_t block_size() const;
  std::int64_t num_blocks() const;
  std::int64_t num_cpu_blocks() const;
  std::int64_t watermark_blocks() const;

  // ---- sequences ---------------------------------------------------------------------
  // Adds a sequence with its prompt tokens [n] and allocates all of its blocks. Returns the
  // number of leading tokens found in the prefix cache (already computed; 0 without caching).
  // Throws InvalidArgument (duplicate id), OutOfBlocks.
  std::int64_t add_sequence(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n,
                            std::uint64_t extra_key = 0);
  // The same with int64 token ids [n] (each must fit in int32; InvalidArgument names the first
  // that does not), read in one pass without a conversion by the caller.
  std::int64_t add_sequence_int64(std::int64_t seq_id, const std::int64_t* tokens, std::int64_t n,
                                  std::uint64_t extra_key = 0);
  // Adds a sequence of n tokens whose ids are not given (prefix caching must be off: the
  // ids are never needed then). The same admission as add_sequence() without the copy of
  // the ids; token_ids() of the sequence (and of its forks) throws InvalidArgument.
  // Returns 0 (no cache hits). Throws InvalidArgument (caching on, duplicate id), OutOfBlocks.
  std::int64_t add_sequence_by_count(std::int64_t seq_id, std::int64_t n);
  // Appends tokens [n] to a sequence; writes their slots to slots_out [n] (may be null).
  // Throws UnknownSequence, InvalidArgument (swapped out), OutOfBlocks.
  void append_tokens(std::int64_t seq_id, const std::int32_t* tokens, std::int64_t n,
                     std::int64_t* slots_out);
  // Appends tokens[i] to seq_ids[i] for i < n (ids distinct), all or nothing; slots_out [n] may be null.
  void append_tokens_batch(const std::int64_t* seq_ids, std::int64_t n, const std::int32_t* tokens,
                           std::int64_t* slots_out);
  // The child shares all of the parent's blocks. The parent must have no uncomputed tokens.
  void fork(std::int64_t parent_id, std::int64_t child_id);
  // Forks child_ids[i] from parent_ids[i] for i < n (a parent may repeat; children distinct
  // and new), all or nothing, as n fork() calls would.
  void fork_batch(const std::int64_t* parent_ids, const std::int64_t* child_ids, std::int64_t n);
  // Releases a sequence (GPU or swapped out). Throws UnknownSequence (also on a double free).
  void free(std::int64_t seq_id);
  // Releases the (distinct) sequences, all or nothing, as n free() calls in this order would.
  void free_batch(const std::int64_t* seq_ids, std::int64_t n);

  // ---- steps -------------------------------------------------------------------------
  // Validates a step request and returns its output sizes without changing anything.
  StepShape plan_step(const StepRequest& req) const;
  // Appends req.new_tokens (if any), schedules the query ranges (advancing num_computed,
  // registering completed blocks in the prefix cache, releasing blocks that left the
  // sliding window) and writes the outputs. All or nothing. Returns the step's shape.
  StepShape step(const StepRequest& req, const StepOutputs& out);
  // Moves the pending copy-on-write (src, dst) pairs into `pairs` (appended) and clears them.
  void take_copy_pairs(BlockPairs& pairs);
  std::int64_t num_pending_copies() const;
  // Forgets the table remembered by incremental steps: the next incremental step writes its
  // rows in full. Call it after writing that table yourself.
  void reset_incremental_export();

  // ---- preemption --------------------------------------------------------------------
  // Moves the sequences to the CPU pool; appends (gpu_block, cpu_block) pairs to `pairs`.
  void swap_out(const std::int64_t* seq_ids, std::int64_t n, BlockPairs& pairs);
  // Moves swapped-out sequences back; appends (cpu_block, gpu_block) pairs to `pairs`.
  void swap_in(const std::int64_t* seq_ids, std::int64_t n, BlockPairs& pairs);

  // ---- capacity ----------------------------------------------------------------------
  // Exact for every count up to 2^63 - 1 (no overflow); a negative count throws InvalidArgument.
  // Whether add_sequence() would succeed for n tokens (tokens may be null: no cache hits counted).
  bool can_allocate(const std::int32_t* tokens, std::int64_t n, std::uint64_t extra_key = 0) const;
  // What add_sequence(tokens, n, extra_key) would find in the prefix cache and take from the
  // pool, without changing anything (no statistics, no LRU order). tokens may be null (no hits).
  PrefixPeek peek_prefix(const std::int32_t* tokens, std::int64_t n, std::uint64_t extra_key = 0) const;
  PrefixPeek peek_prefix_int64(const std::int64_t* tokens, std::int64_t n, std::uint64_t extra_key = 0) const;
  // Whether appending num_tokens tokens to the sequence would succeed (false while swapped out).
  bool can_append(std::int64_t seq_id, std::int64_t num_tokens = 1) const;
  // Whether a step appending one token to each of the (distinct) sequences would succeed.
  bool can_append_batch(const std::int64_t* seq_ids, std::int64_t n) const;
  bool can_swap_out(const std::int64_t* seq_ids, std::int64_t n) const;
  bool can_swap_in(const std::int64_t* seq_ids, std::int64_t n) const;
  // Blocks a sequence of n >= 0 tokens occupies (0 for n <= 0).
  std::int64_t blocks_for(std::int64_t n) const;

  // ---- export ------------------------------------------------------------------------
  // Writes the block tables of the sequences into int32 [S, M] (M >= their widest table),
  // padding with pad. Swapped-out sequences are rejected.
  void export_block_tables(const std::int64_t* seq_ids, std::int64_t n, const TensorView& out,
                           std::int32_t pad = 0) const;
  // Writes num_tokens of each sequence into int32 [S].
  void export_seq_lens(const std::int64_t* seq_ids, std::int64_t n, const TensorView& out) const;
  // Total block-table entries of the sequences (the CSR `indices` length).
  std::int64_t count_blocks(const std::int64_t* seq_ids, std::int64_t n) const;
  // CSR page table: indptr int32 [S+1], indices int32 [count_blocks], last_page_len int32 [S]
  // (tokens in each sequence's last block, 0 for an empty sequence).
  void export_csr(const std::int64_t* seq_ids, std::int64_t n, const TensorView& indptr,
                  const TensorView& indices, const TensorView& last_page_len, std::int32_t pad = 0) const;
  // Slots of tokens [start, stop) of a sequence, written to out [stop - start].
  void slots(std::int64_t seq_id, std::int64_t start, std::int64_t stop, std::int64_t* out) const;

  // ---- introspection -----------------------------------------------------------------
  std::int64_t num_free_blocks() const;
  std::int64_t num_cached_blocks() const;  // evictable: registered, held by none
  std::int64_t num_used_blocks() const;
  std::int64_t num_available_blocks() const;  // free + evictable
  std::int64_t num_free_cpu_blocks() const;
  std::int64_t num_sequences() const;
  bool has_sequence(std::int64_t seq_id) const;
  std::vector<std::int64_t> sequence_ids() const;  // in insertion-slot order
  const std::vector<std::int32_t>& block_table(std::int64_t seq_id) const;  // -1 = released
  const std::vector<std::int32_t>& token_ids(std::int64_t seq_id) const;
  std::int64_t seq_len(std::int64_t seq_id) const;
  std::int64_t num_computed(std::int64_t seq_id) const;
  bool is_swapped(std::int64_t seq_id) const;
  std::int32_t ref_count(std::int64_t block) const;      // GPU block
  std::int32_t cpu_ref_count(std::int64_t block) const;  // CPU block
  bool is_cached(std::int64_t block) const;  // registered in the prefix cache (in use or evictable)
  const PrefixCacheStats& prefix_cache_stats() const;
  void reset_prefix_cache_stats();
  // Checks every internal invariant (reference counts against tables, free/LRU/map
  // consistency, prefix-node reference counts, exclusive ownership of every block still
  // receiving slots); throws std::logic_error on the first violation. O(pool + tokens).
  void check_invariants() const;

 private:
  struct Impl;  // cpp/src/block_manager_impl.hpp
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedattn
