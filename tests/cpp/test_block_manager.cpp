// Unit tests of the KV block manager: pool accounting, copy-on-write, prefix caching,
// eviction, swapping, sliding window, step export (full, persistent and incremental), the
// scheduler calls (peek_prefix, admission by count, batch fork / free) and the strong
// exception guarantee.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "check.hpp"
#include "pagedattn/block_manager.hpp"

using pagedattn::BlockManager;
using pagedattn::BlockManagerOptions;
using pagedattn::DType;
using pagedattn::InvalidArgument;
using pagedattn::OutOfBlocks;
using pagedattn::PrefixPeek;
using pagedattn::StepOutputs;
using pagedattn::StepRequest;
using pagedattn::UnknownSequence;

namespace {

BlockManager make(std::int64_t blocks, std::int64_t bs, bool caching = false, std::int64_t cpu = 0,
                  double watermark = 0.0, std::int64_t window = 0) {
  BlockManagerOptions o;
  o.num_blocks = blocks;
  o.block_size = bs;
  o.enable_prefix_caching = caching;
  o.num_cpu_blocks = cpu;
  o.watermark = watermark;
  o.sliding_window = window;
  return BlockManager(o);
}

std::vector<std::int32_t> iota_tokens(std::int64_t n, std::int32_t start = 0) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), start);
  return t;
}

std::int64_t add(BlockManager& m, std::int64_t id, const std::vector<std::int32_t>& t) {
  return m.add_sequence(id, t.data(), static_cast<std::int64_t>(t.size()));
}

// Schedules every pending token of the sequences (no outputs).
void compute_all(BlockManager& m, const std::vector<std::int64_t>& ids) {
  StepRequest r;
  r.seq_ids = ids.data();
  r.num_seqs = static_cast<std::int64_t>(ids.size());
  m.step(r, StepOutputs{});
}

// A snapshot of everything observable, to check the strong exception guarantee.
struct Snapshot {
  std::int64_t free, cached, used, cpu_free, seqs, copies;
  std::vector<std::vector<std::int32_t>> tables;
  std::vector<std::int32_t> refs;
  bool operator==(const Snapshot& o) const {
    return free == o.free && cached == o.cached && used == o.used && cpu_free == o.cpu_free && seqs == o.seqs &&
           copies == o.copies && tables == o.tables && refs == o.refs;
  }
};
Snapshot snap(const BlockManager& m) {
  Snapshot s{m.num_free_blocks(), m.num_cached_blocks(), m.num_used_blocks(), m.num_free_cpu_blocks(),
             m.num_sequences(), m.num_pending_copies(), {}, {}};
  for (std::int64_t id : m.sequence_ids()) s.tables.push_back(m.block_table(id));
  for (std::int64_t b = 0; b < m.num_blocks(); ++b) s.refs.push_back(m.ref_count(b));
  return s;
}

}  // namespace

PA_TEST(add_append_slots_and_free) {
  BlockManager m = make(8, 4);
  PA_CHECK_EQ(add(m, 1, iota_tokens(5)), 0);
  const auto& t = m.block_table(1);
  PA_CHECK_EQ(t.size(), 2u);
  PA_CHECK_EQ(m.num_free_blocks(), 6);
  std::vector<std::int64_t> slots(4);
  const auto more = iota_tokens(4, 100);
  m.append_tokens(1, more.data(), 4, slots.data());
  const auto& t2 = m.block_table(1);
  PA_CHECK_EQ(t2.size(), 3u);  // 9 tokens
  for (int i = 0; i < 4; ++i) {
    const std::int64_t pos = 5 + i;
    PA_CHECK_EQ(slots[static_cast<std::size_t>(i)], std::int64_t(t2[static_cast<std::size_t>(pos / 4)]) * 4 + pos % 4);
  }
  PA_CHECK_EQ(m.seq_len(1), 9);
  m.check_invariants();
  m.free(1);
  PA_CHECK_EQ(m.num_free_blocks(), 8);
  PA_CHECK_THROWS(m.free(1), UnknownSequence);  // double free
  m.check_invariants();
}

PA_TEST(errors_leave_state_unchanged) {
  BlockManager m = make(4, 4, false, 1);
  add(m, 1, iota_tokens(6));
  const Snapshot before = snap(m);
  PA_CHECK_THROWS(add(m, 1, iota_tokens(2)), InvalidArgument);      // duplicate
  PA_CHECK_THROWS(add(m, 2, iota_tokens(13)), OutOfBlocks);         // 4 blocks > 2 free
  const auto big = iota_tokens(11);
  PA_CHECK_THROWS(m.append_tokens(1, big.data(), 11, nullptr), OutOfBlocks);  // needs 3 more
  PA_CHECK_THROWS(m.append_tokens(7, big.data(), 1, nullptr), UnknownSequence);
  PA_CHECK_THROWS(m.fork(7, 8), UnknownSequence);
  PA_CHECK_THROWS(m.fork(1, 1), InvalidArgument);
  const std::int64_t ids[] = {1};
  std::vector<std::pair<std::int32_t, std::int32_t>> pairs;
  PA_CHECK_THROWS(m.swap_out(ids, 1, pairs), OutOfBlocks);  // 2 blocks, 1 CPU block
  PA_CHECK(pairs.empty());
  PA_CHECK(snap(m) == before);
  m.check_invariants();
}

PA_TEST(watermark_applies_to_admission_only) {
  BlockManager m = make(10, 4, false, 0, 0.2);  // keeps 2 blocks
  PA_CHECK_EQ(m.watermark_blocks(), 2);
  PA_CHECK(m.can_allocate(nullptr, 32));
  PA_CHECK(!m.can_allocate(nullptr, 33));
  PA_CHECK_THROWS(add(m, 1, iota_tokens(33)), OutOfBlocks);
  add(m, 1, iota_tokens(32));  // 8 blocks, 2 left
  const auto more = iota_tokens(8);
  PA_CHECK(m.can_append(1, 8));
  m.append_tokens(1, more.data(), 8, nullptr);  // appends may dip into the watermark
  PA_CHECK_EQ(m.num_free_blocks(), 0);
  m.check_invariants();
}

PA_TEST(capacity_queries_do_not_overflow) {
  BlockManager m = make(16, 16);
  add(m, 1, iota_tokens(3));
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  for (const std::int64_t n : {std::int64_t{2147483647}, kMax / 2, kMax - 1, kMax}) {
    PA_CHECK(!m.can_allocate(nullptr, n));
    PA_CHECK(!m.can_append(1, n));
  }
  PA_CHECK_EQ(m.blocks_for(kMax), kMax / 16 + 1);
  PA_CHECK_EQ(m.blocks_for(0), 0);
  PA_CHECK(m.can_append(1, 16 * 16 - 3) && !m.can_append(1, 16 * 16 - 2));
  PA_CHECK_THROWS(m.can_allocate(nullptr, -1), InvalidArgument);
  PA_CHECK_THROWS(m.can_append(1, std::numeric_limits<std::int64_t>::min()), InvalidArgument);
  m.check_invariants();
}

PA_TEST(outputs_sharing_memory_with_inputs_are_refused) {
  BlockManager m = make(64, 4);
  add(m, 0, iota_tokens(10));
  add(m, 1, iota_tokens(10));
  const Snapshot before = snap(m);
  std::vector<std::int64_t> buf(16, 0);
  buf[0] = 1;
  buf[1] = 2;
  const std::int64_t ids[] = {0, 1};
  StepRequest r;
  r.seq_ids = ids;
  r.num_seqs = 2;
  r.query_lens = buf.data();  // [2], and slot_mapping [3] starts at the same address
  auto v_sm = pagedattn::make_view(buf.data(), DType::kInt64, {3});
  StepOutputs out;
  out.slot_mapping = &v_sm;
  PA_CHECK_THROWS(m.step(r, out), InvalidArgument);
  std::vector<std::int32_t> lens(8, 0);
  auto v_a = pagedattn::make_view(lens.data(), DType::kInt32, {2});
  auto v_b = pagedattn::make_view(lens.data() + 1, DType::kInt32, {2});
  StepOutputs both;
  both.seq_lens = &v_a;
  both.context_lens = &v_b;
  r.query_lens = nullptr;
  PA_CHECK_THROWS(m.step(r, both), InvalidArgument);
  std::vector<std::int64_t> tok_and_slots(4, 0);  // tokens read as int32 from the slots' memory
  PA_CHECK_THROWS(m.append_tokens(0, reinterpret_cast<const std::int32_t*>(tok_and_slots.data()), 2,
                                  tok_and_slots.data()),
                  InvalidArgument);
  PA_CHECK(snap(m) == before);
  m.check_invariants();
}

PA_TEST(copies_are_independent) {
  BlockManager a = make(8, 4, true);
  add(a, 1, iota_tokens(9));
  compute_all(a, {1});
  BlockManager b = a;  // a deep copy: changing one leaves the other as it was
  b.free(1);
  PA_CHECK(a.has_sequence(1) && !b.has_sequence(1));
  PA_CHECK_EQ(add(b, 2, iota_tokens(9)), 8);  // b's prefix cache kept the registered blocks
  PA_CHECK_EQ(a.num_sequences(), 1);
  BlockManager c = std::move(b);
  PA_CHECK(c.has_sequence(2));
  a.check_invariants();
  c.check_invariants();
}

PA_TEST(fork_copy_on_write) {
  BlockManager m = make(16, 4);
  add(m, 1, iota_tokens(6));  // blocks: full + 2/4
  const std::vector<std::int64_t> one = {1};
  const auto tok = iota_tokens(1, 50);
  PA_CHECK_THROWS(m.fork(1, 2), InvalidArgument);  // tokens not computed yet
  compute_all(m, one);
  m.fork(1, 2);
  m.fork(1, 3);
  const auto parent = m.block_table(1);
  PA_CHECK(m.block_table(2) == parent);
  PA_CHECK_EQ(m.ref_count(parent[1]), 3);
  std::int64_t slot = -1;
  m.append_tokens(2, tok.data(), 1, &slot);  // copy-on-write
  PA_CHECK(m.block_table(2)[1] != parent[1]);
  PA_CHECK_EQ(m.block_table(2)[0], parent[0]);
  PA_CHECK_EQ(slot, std::int64_t(m.block_table(2)[1]) * 4 + 2);
  PA_CHECK_EQ(m.ref_count(parent[1]), 2);
  const std::int64_t batch[] = {1, 3};
  const std::int32_t toks[] = {7, 8};
  std::int64_t slots[2];
  PA_CHECK(m.can_append_batch(batch, 2));
  m.append_tokens_batch(batch, 2, toks, slots);  // seq 1 copies, seq 3 then writes in place
  PA_CHECK(m.block_table(1)[1] != parent[1]);
  PA_CHECK_EQ(m.block_table(3)[1], parent[1]);
  PA_CHECK_EQ(m.ref_count(parent[1]), 1);
  std::vector<std::pair<std::int32_t, std::int32_t>> pairs;
  m.take_copy_pairs(pairs);
  PA_CHECK_EQ(pairs.size(), 2u);
  PA_CHECK_EQ(pairs[0].first, parent[1]);
  PA_CHECK_EQ(pairs[0].second, m.block_table(2)[1]);
  PA_CHECK_EQ(pairs[1].second, m.block_table(1)[1]);
  PA_CHECK_EQ(m.num_pending_copies(), 0);
  m.check_invariants();
  for (std::int64_t id : {1, 2, 3}) m.free(id);
  PA_CHECK_EQ(m.num_free_blocks(), 16);
}

PA_TEST(batch_copy_on_write_demand_is_exact) {
  // Three forks share a partly filled block; a 1-token step for all of them needs exactly 2 blocks.
  BlockManager m = make(4, 4);
  add(m, 1, iota_tokens(6));
  compute_all(m, {1});
  m.fork(1, 2);
  m.fork(1, 3);
  PA_CHECK_EQ(m.num_free_blocks(), 2);
  const std::int64_t ids[] = {1, 2, 3};
  const std::int32_t toks[] = {1, 2, 3};
  PA_CHECK(m.can_append_batch(ids, 3));
  m.append_tokens_batch(ids, 3, toks, nullptr);
  PA_CHECK_EQ(m.num_free_blocks(), 0);
  m.check_invariants();
  // Each sequence owns its last block now (7 tokens): the 8th token fits, the 9th does not.
  const std::int32_t toks2[] = {4, 5, 6};
  PA_CHECK(m.can_append_batch(ids, 3));
  m.append_tokens_batch(ids, 3, toks2, nullptr);
  PA_CHECK_EQ(m.seq_len(3), 8);
  PA_CHECK(!m.can_append_batch(ids, 3));
  const Snapshot after = snap(m);
  PA_CHECK_THROWS(m.append_tokens_batch(ids, 3, toks2, nullptr), OutOfBlocks);
  PA_CHECK(snap(m) == after);
  PA_CHECK_EQ(m.seq_len(1), 8);
  const std::int64_t dup[] = {1, 1};
  PA_CHECK_THROWS(m.append_tokens_batch(dup, 2, toks2, nullptr), InvalidArgument);
}

PA_TEST(prefix_cache_hits_lru_and_eviction) {
  BlockManager m = make(8, 4, true);
  const auto prompt = iota_tokens(10);  // 2 full blocks + 2
  PA_CHECK_EQ(add(m, 1, prompt), 0);
  compute_all(m, {1});
  PA_CHECK(m.is_cached(m.block_table(1)[0]));
  PA_CHECK(m.is_cached(m.block_table(1)[1]));
  PA_CHECK(!m.is_cached(m.block_table(1)[2]));
  PA_CHECK_EQ(add(m, 2, prompt), 8);  // identical prefix -> identical blocks
  PA_CHECK_EQ(m.block_table(2)[0], m.block_table(1)[0]);
  PA_CHECK_EQ(m.block_table(2)[1], m.block_table(1)[1]);
  PA_CHECK(m.block_table(2)[2] != m.block_table(1)[2]);
  PA_CHECK_EQ(m.num_computed(2), 8);
  // A different extra key (adapter) misses.
  PA_CHECK_EQ(m.add_sequence(3, prompt.data(), 10, 42), 0);
  m.free(3);
  // Full-prompt hit leaves the last block to compute.
  const auto exact = iota_tokens(8);
  PA_CHECK_EQ(add(m, 4, exact), 4);
  m.free(4);
  const auto first = m.block_table(1);
  m.free(1);
  m.free(2);
  PA_CHECK_EQ(m.num_cached_blocks(), 2);
  PA_CHECK_EQ(m.num_used_blocks(), 0);
  m.check_invariants();
  // Reuse after free.
  PA_CHECK_EQ(add(m, 5, prompt), 8);
  PA_CHECK_EQ(m.block_table(5)[0], first[0]);
  m.free(5);
  // Fill the pool: eviction only when the free list is empty, tail block first.
  PA_CHECK_EQ(add(m, 6, iota_tokens(6 * 4, 1000)), 0);
  PA_CHECK_EQ(m.num_cached_blocks(), 2);
  const auto t7 = iota_tokens(4, 5000);
  PA_CHECK_EQ(add(m, 7, t7), 0);
  PA_CHECK_EQ(m.num_cached_blocks(), 1);
  PA_CHECK(m.is_cached(first[0]));  // the prefix's first block outlives its tail
  PA_CHECK(!m.is_cached(first[1]));
  PA_CHECK_EQ(m.prefix_cache_stats().evictions, 1);
  PA_CHECK(m.prefix_cache_stats().hit_tokens > 0);
  m.check_invariants();
}

PA_TEST(prefix_cache_out_of_blocks_is_atomic_and_counts_lru_hits) {
  BlockManager m = make(4, 4, true);
  add(m, 1, iota_tokens(9));
  compute_all(m, {1});
  m.free(1);  // blocks 0,1 cached, others free
  PA_CHECK_EQ(m.num_cached_blocks(), 2);
  // 17 tokens: 2 hits from the LRU + 3 new blocks > 2 left.
  PA_CHECK(!m.can_allocate(iota_tokens(17).data(), 17));
  const Snapshot before = snap(m);
  const auto stats = m.prefix_cache_stats();
  PA_CHECK_THROWS(add(m, 2, iota_tokens(17)), OutOfBlocks);
  PA_CHECK(snap(m) == before);
  PA_CHECK_EQ(m.prefix_cache_stats().queried_tokens, stats.queried_tokens);
  PA_CHECK(m.can_allocate(iota_tokens(16).data(), 16));
  PA_CHECK_EQ(add(m, 2, iota_tokens(16)), 8);
  PA_CHECK_EQ(m.num_available_blocks(), 0);
  m.check_invariants();
}

PA_TEST(step_outputs_and_chunked_prefill) {
  BlockManager m = make(32, 4);
  add(m, 10, iota_tokens(10));
  add(m, 11, iota_tokens(3));
  const std::int64_t ids[] = {10, 11};
  const std::int64_t q[] = {6, 3};
  StepRequest r;
  r.seq_ids = ids;
  r.num_seqs = 2;
  r.query_lens = q;
  const auto shape = m.plan_step(r);
  PA_CHECK_EQ(shape.num_tokens, 9);
  PA_CHECK_EQ(shape.max_blocks, 3);
  std::vector<std::int32_t> bt(2 * 5), sl(2), cl(2), qs(3);
  std::vector<std::int64_t> sm(9);
  auto v_bt = pagedattn::make_view(bt.data(), DType::kInt32, {2, 5});
  auto v_sl = pagedattn::make_view(sl.data(), DType::kInt32, {2});
  auto v_cl = pagedattn::make_view(cl.data(), DType::kInt32, {2});
  auto v_qs = pagedattn::make_view(qs.data(), DType::kInt32, {3});
  auto v_sm = pagedattn::make_view(sm.data(), DType::kInt64, {9});
  StepOutputs out;
  out.block_tables = &v_bt;
  out.seq_lens = &v_sl;
  out.context_lens = &v_cl;
  out.query_start_loc = &v_qs;
  out.slot_mapping = &v_sm;
  out.pad = -7;
  m.step(r, out);
  PA_CHECK_EQ(sl[0], 6);
  PA_CHECK_EQ(sl[1], 3);
  PA_CHECK_EQ(cl[0], 0);
  PA_CHECK_EQ(qs[1], 6);
  PA_CHECK_EQ(qs[2], 9);
  PA_CHECK_EQ(bt[3], -7);
  PA_CHECK_EQ(bt[5 + 1], -7);
  const auto& t10 = m.block_table(10);
  PA_CHECK_EQ(bt[2], t10[2]);
  PA_CHECK_EQ(sm[5], std::int64_t(t10[1]) * 4 + 1);
  PA_CHECK_EQ(m.num_computed(10), 6);
  // Second chunk + a decode token for seq 11.
  const std::int32_t tok[] = {0, 99};
  (void)tok;
  const std::int64_t q2[] = {4};
  r.seq_ids = ids;
  r.num_seqs = 1;
  r.query_lens = q2;
  std::vector<std::int64_t> sm2(4);
  auto v_sm2 = pagedattn::make_view(sm2.data(), DType::kInt64, {4});
  StepOutputs out2;
  out2.slot_mapping = &v_sm2;
  m.step(r, out2);
  PA_CHECK_EQ(sm2[0], std::int64_t(t10[1]) * 4 + 2);
  PA_CHECK_EQ(m.num_computed(10), 10);
  // Errors: too many query tokens, short output, wrong dtype; nothing changes.
  const std::int64_t q3[] = {1};
  r.query_lens = q3;
  PA_CHECK_THROWS(m.step(r, StepOutputs{}), InvalidArgument);
  const std::int32_t newtok[] = {5};
  r.new_tokens = newtok;
  r.query_lens = nullptr;
  auto v_bad = pagedattn::make_view(sm2.data(), DType::kInt64, {2});
  StepOutputs bad;
  bad.slot_mapping = &v_bad;
  const Snapshot before = snap(m);
  PA_CHECK_THROWS(m.step(r, bad), InvalidArgument);
  auto v_f = pagedattn::make_view(sm2.data(), DType::kFloat32, {1});
  bad.slot_mapping = &v_f;
  PA_CHECK_THROWS(m.step(r, bad), pagedattn::TypeMismatch);
  PA_CHECK(snap(m) == before);
  PA_CHECK_EQ(m.seq_len(10), 10);
  m.check_invariants();
}

PA_TEST(swap_out_and_in_share_blocks_once) {
  BlockManager m = make(16, 4, false, 8, 0.0);
  add(m, 1, iota_tokens(9));
  compute_all(m, {1});
  m.fork(1, 2);
  add(m, 3, iota_tokens(4));
  const auto table = m.block_table(1);
  std::vector<std::pair<std::int32_t, std::int32_t>> out_pairs, in_pairs;
  const std::int64_t both[] = {1, 2};
  PA_CHECK(m.can_swap_out(both, 2));
  m.swap_out(both, 2, out_pairs);
  PA_CHECK_EQ(out_pairs.size(), 3u);  // shared blocks moved once
  PA_CHECK(m.is_swapped(1));
  PA_CHECK_EQ(m.num_free_cpu_blocks(), 5);
  PA_CHECK_EQ(m.cpu_ref_count(out_pairs[0].second), 2);
  PA_CHECK_EQ(out_pairs[0].first, table[0]);
  PA_CHECK_EQ(m.num_used_blocks(), 1);
  m.check_invariants();
  const auto tok = iota_tokens(1);
  PA_CHECK_THROWS(m.append_tokens(1, tok.data(), 1, nullptr), InvalidArgument);
  // Swap only one of the two back: its blocks are copied, the other stays on the CPU.
  const std::int64_t one[] = {2};
  m.swap_in(one, 1, in_pairs);
  PA_CHECK_EQ(in_pairs.size(), 3u);
  PA_CHECK_EQ(m.num_free_cpu_blocks(), 5);
  PA_CHECK_EQ(m.cpu_ref_count(out_pairs[0].second), 1);
  m.check_invariants();
  m.free(1);  // free a swapped-out sequence
  PA_CHECK_EQ(m.num_free_cpu_blocks(), 8);
  PA_CHECK_THROWS(m.swap_in(one, 1, in_pairs), InvalidArgument);  // not swapped
  m.free(2);
  m.free(3);
  PA_CHECK_EQ(m.num_free_blocks(), 16);
  m.check_invariants();
}

PA_TEST(swap_refuses_with_pending_copies_and_without_pool) {
  BlockManager none = make(4, 4);
  add(none, 1, iota_tokens(2));
  const std::int64_t id[] = {1};
  std::vector<std::pair<std::int32_t, std::int32_t>> pairs;
  PA_CHECK_THROWS(none.swap_out(id, 1, pairs), InvalidArgument);
  BlockManager m = make(8, 4, false, 8);
  add(m, 1, iota_tokens(2));
  compute_all(m, {1});
  m.fork(1, 2);
  const auto tok = iota_tokens(1);
  m.append_tokens(2, tok.data(), 1, nullptr);
  PA_CHECK_THROWS(m.swap_out(id, 1, pairs), InvalidArgument);
  m.take_copy_pairs(pairs);
  m.swap_out(id, 1, pairs);
  PA_CHECK(m.is_swapped(1));
}

PA_TEST(sliding_window_releases_old_blocks) {
  BlockManager m = make(16, 4, false, 0, 0.0, 6);
  add(m, 1, iota_tokens(12));
  compute_all(m, {1});
  PA_CHECK_EQ(m.num_used_blocks(), 3);
  // Next query position is 12; it attends to keys 7..12, so block 0 (0..3) can go.
  std::vector<std::int32_t> bt(4);
  auto v_bt = pagedattn::make_view(bt.data(), DType::kInt32, {1, 4});
  StepOutputs out;
  out.block_tables = &v_bt;
  out.pad = -1;
  const std::int64_t id[] = {1};
  const std::int32_t tok[] = {5};
  StepRequest r;
  r.seq_ids = id;
  r.num_seqs = 1;
  r.new_tokens = tok;
  m.step(r, out);
  PA_CHECK_EQ(m.block_table(1)[0], -1);
  PA_CHECK(m.block_table(1)[1] >= 0);
  PA_CHECK_EQ(bt[0], -1);
  PA_CHECK_EQ(m.num_used_blocks(), 3);  // released 1, took 1 for token 12
  m.check_invariants();
  m.free(1);
  PA_CHECK_EQ(m.num_free_blocks(), 16);
}

PA_TEST(random_operations_keep_invariants) {
  for (bool caching : {false, true}) {
    BlockManager m = make(64, 4, caching, 32, 0.05);
    std::mt19937_64 rng(caching ? 7 : 11);
    std::vector<std::int64_t> live;
    std::int64_t next = 0;
    std::vector<std::pair<std::int32_t, std::int32_t>> pairs;
    for (int it = 0; it < 3000; ++it) {
      const int op = static_cast<int>(rng() % 7);
      try {
        if (op == 0 || live.empty()) {
          const auto n = static_cast<std::int64_t>(rng() % 20);
          std::vector<std::int32_t> t(static_cast<std::size_t>(n));
          for (auto& x : t) x = static_cast<std::int32_t>(rng() % 3);  // tiny vocab: many prefix hits
          m.add_sequence(next, t.data(), n);
          live.push_back(next++);
        } else {
          const std::int64_t id = live[rng() % live.size()];
          if (op == 1) {
            const std::int32_t tok = static_cast<std::int32_t>(rng() % 3);
            m.append_tokens(id, &tok, 1, nullptr);
          } else if (op == 2) {
            const std::int64_t ids[] = {id};
            StepRequest r;
            r.seq_ids = ids;
            r.num_seqs = 1;
            m.step(r, StepOutputs{});
          } else if (op == 3) {
            m.fork(id, next);
            live.push_back(next++);
          } else if (op == 4) {
            m.free(id);
            live.erase(std::find(live.begin(), live.end(), id));
          } else if (op == 5) {
            m.take_copy_pairs(pairs);
            const std::int64_t ids[] = {id};
            if (m.is_swapped(id))
              m.swap_in(ids, 1, pairs);
            else
              m.swap_out(ids, 1, pairs);
          } else {
            m.take_copy_pairs(pairs);
          }
        }
      } catch (const OutOfBlocks&) {
      } catch (const InvalidArgument&) {
      }
      m.check_invariants();
    }
    for (std::int64_t id : live) m.free(id);
    PA_CHECK_EQ(m.num_free_blocks() + m.num_cached_blocks(), 64);
    PA_CHECK_EQ(m.num_free_cpu_blocks(), 32);
    PA_CHECK_EQ(m.num_used_blocks(), 0);
    m.check_invariants();
  }
}

// ---- scheduler calls -------------------------------------------------------------------
namespace {

// A decode step of the sequences written into a persistent table [rows, cols], incrementally
// or in full; returns the rows the batch occupies.
std::vector<std::int32_t> step_rows(BlockManager& m, const std::vector<std::int64_t>& ids,
                                    std::vector<std::int32_t>& table, std::int64_t rows, std::int64_t cols,
                                    bool incremental, bool decode = true) {
  const std::vector<std::int32_t> toks(ids.size(), 7);
  StepRequest r;
  r.seq_ids = ids.data();
  r.num_seqs = static_cast<std::int64_t>(ids.size());
  r.new_tokens = decode ? toks.data() : nullptr;
  auto v = pagedattn::make_view(table.data(), DType::kInt32, {rows, cols});
  StepOutputs out;
  out.block_tables = &v;
  out.pad = -1;
  out.persistent = true;
  out.incremental = incremental;
  m.step(r, out);
  return std::vector<std::int32_t>(table.begin(),
                                   table.begin() + static_cast<std::ptrdiff_t>(ids.size() * cols));
}

// What a full rewrite of the batch's rows holds.
std::vector<std::int32_t> full_rows(const BlockManager& m, const std::vector<std::int64_t>& ids,
                                    std::int64_t cols) {
  std::vector<std::int32_t> rows;
  for (const std::int64_t id : ids) {
    const auto& t = m.block_table(id);
    for (std::int64_t k = 0; k < cols; ++k)
      rows.push_back(k < static_cast<std::int64_t>(t.size()) && t[static_cast<std::size_t>(k)] >= 0
                         ? t[static_cast<std::size_t>(k)]
                         : -1);
  }
  return rows;
}

// Steps the batch into the table, then compares its rows with a full rewrite.
bool step_matches(BlockManager& m, const std::vector<std::int64_t>& ids, std::vector<std::int32_t>& table,
                  std::int64_t rows, std::int64_t cols, bool incremental, bool decode = true) {
  const std::vector<std::int32_t> got = step_rows(m, ids, table, rows, cols, incremental, decode);
  return got == full_rows(m, ids, cols);
}

}  // namespace

PA_TEST(incremental_table_matches_full_rewrite_through_cow_swap_and_row_reuse) {
  BlockManager m = make(64, 4, false, 32);
  for (std::int64_t id = 1; id <= 3; ++id) add(m, id, iota_tokens(6));
  compute_all(m, {1, 2, 3});
  const std::int64_t rows = 5, cols = 8;
  std::vector<std::int32_t> table(rows * cols, 99);
  PA_CHECK(step_matches(m, {1, 2, 3}, table, rows, cols, true));
  PA_CHECK_EQ(table[static_cast<std::size_t>(3 * cols)], 99);  // rows past the batch untouched
  // Behind the manager's back: an entry that does not change is not written again.
  table[0] = 555;
  step_rows(m, {1, 2, 3}, table, rows, cols, true);
  PA_CHECK_EQ(table[0], 555);
  m.reset_incremental_export();  // after writing the table yourself
  PA_CHECK(step_matches(m, {1, 2, 3}, table, rows, cols, true));
  // Copy-on-write replaces the last (already written) entry of the forked sequence's row.
  m.fork(1, 4);
  BlockManager::BlockPairs pairs;
  PA_CHECK(step_matches(m, {1, 2, 3}, table, rows, cols, true));
  m.take_copy_pairs(pairs);
  PA_CHECK_EQ(pairs.size(), 1u);
  // Rows move, a new sequence takes a row, a freed sequence's row is reused.
  m.free(2);
  PA_CHECK(step_matches(m, {4, 3, 1}, table, rows, cols, true));
  // Swap out and back in: every entry changes.
  m.take_copy_pairs(pairs);
  const std::int64_t three[] = {3};
  m.swap_out(three, 1, pairs);
  m.swap_in(three, 1, pairs);
  PA_CHECK(step_matches(m, {4, 3, 1}, table, rows, cols, true));
  // A full write forgets the table; the next incremental step rewrites every row.
  step_rows(m, {4, 3, 1}, table, rows, cols, false);
  table[0] = 555;
  PA_CHECK(step_matches(m, {4, 3, 1}, table, rows, cols, true));
  m.check_invariants();
}

PA_TEST(incremental_table_with_sliding_window_pads_released_entries) {
  BlockManager m = make(64, 2, false, 0, 0.0, 3);
  add(m, 1, iota_tokens(3));
  const std::int64_t rows = 1, cols = 12;
  std::vector<std::int32_t> table(rows * cols, 99);
  for (int i = 0; i < 12; ++i) {
    PA_CHECK(step_matches(m, {1}, table, rows, cols, true, i > 0));
  }
  PA_CHECK_EQ(table[0], -1);  // released by the window
  m.check_invariants();
}

PA_TEST(persistent_outputs_accept_larger_buffers_and_check_their_size) {
  BlockManager m = make(16, 4);
  add(m, 1, iota_tokens(9));
  const std::int64_t ids[] = {1};
  StepRequest r;
  r.seq_ids = ids;
  r.num_seqs = 1;
  std::vector<std::int64_t> sm(16, -5);
  std::vector<std::int32_t> bt(2 * 2, -5);  // 3 blocks needed: too narrow
  auto v_sm = pagedattn::make_view(sm.data(), DType::kInt64, {16});
  auto v_bt = pagedattn::make_view(bt.data(), DType::kInt32, {2, 2});
  StepOutputs out;
  out.slot_mapping = &v_sm;
  PA_CHECK_THROWS(m.step(r, out), InvalidArgument);  // exact shapes without persistent
  out.block_tables = &v_bt;
  out.persistent = true;
  const Snapshot before = snap(m);
  PA_CHECK_THROWS(m.step(r, out), InvalidArgument);  // narrower than the widest table
  PA_CHECK(snap(m) == before);
  out.block_tables = nullptr;
  m.step(r, out);
  PA_CHECK_EQ(sm[8], std::int64_t(m.block_table(1)[2]) * 4);
  PA_CHECK_EQ(sm[9], -5);  // past the step's tokens: untouched
  PA_CHECK_EQ(m.num_computed(1), 9);
}

PA_TEST(peek_prefix_predicts_add_sequence_and_changes_nothing) {
  BlockManager m = make(16, 4, true, 0, 0.25);
  const auto prompt = iota_tokens(10);
  add(m, 1, prompt);
  compute_all(m, {1});
  m.free(1);  // two registered blocks, now evictable
  const auto stats = m.prefix_cache_stats();
  const PrefixPeek p = m.peek_prefix(prompt.data(), 10);
  PA_CHECK_EQ(p.cached_tokens, 8);
  PA_CHECK_EQ(p.new_blocks, 1);
  PA_CHECK_EQ(p.reused_cached_blocks, 2);
  PA_CHECK(p.fits && p.fits == m.can_allocate(prompt.data(), 10));
  PA_CHECK_EQ(m.prefix_cache_stats().queried_tokens, stats.queried_tokens);
  const std::int64_t avail = m.num_available_blocks();
  PA_CHECK_EQ(add(m, 2, prompt), p.cached_tokens);
  PA_CHECK_EQ(avail - m.num_available_blocks(), p.new_blocks + p.reused_cached_blocks);
  const PrefixPeek none = m.peek_prefix(nullptr, 50);
  PA_CHECK(none.cached_tokens == 0 && none.new_blocks == 13 && !none.fits);
  PA_CHECK_THROWS(m.peek_prefix(nullptr, -1), InvalidArgument);
  m.check_invariants();
}

PA_TEST(add_sequence_by_count_matches_add_sequence_without_ids) {
  BlockManager a = make(16, 4), b = make(16, 4);
  PA_CHECK_EQ(a.add_sequence_by_count(1, 9), 0);
  add(b, 1, iota_tokens(9));
  PA_CHECK(a.block_table(1) == b.block_table(1));
  PA_CHECK_EQ(a.seq_len(1), 9);
  PA_CHECK_THROWS(a.token_ids(1), InvalidArgument);
  compute_all(a, {1});
  a.fork(1, 2);
  PA_CHECK_THROWS(a.token_ids(2), InvalidArgument);
  PA_CHECK_THROWS(a.add_sequence_by_count(3, -1), InvalidArgument);
  PA_CHECK_THROWS(a.add_sequence_by_count(1, 1), InvalidArgument);  // duplicate
  PA_CHECK_THROWS(a.add_sequence_by_count(3, 100), OutOfBlocks);
  BlockManager c = make(16, 4, true);
  PA_CHECK_THROWS(c.add_sequence_by_count(1, 4), InvalidArgument);  // caching needs the ids
  a.check_invariants();
}

PA_TEST(batch_fork_and_free_are_all_or_nothing) {
  BlockManager m = make(32, 4);
  add(m, 1, iota_tokens(6));
  add(m, 2, iota_tokens(3));
  compute_all(m, {1, 2});
  const Snapshot before = snap(m);
  const std::int64_t parents[] = {1, 1, 2}, dup_children[] = {10, 11, 10}, bad_parent[] = {1, 9, 2};
  const std::int64_t children[] = {10, 11, 12};
  PA_CHECK_THROWS(m.fork_batch(parents, dup_children, 3), InvalidArgument);
  PA_CHECK_THROWS(m.fork_batch(bad_parent, children, 3), UnknownSequence);
  const std::int64_t existing[] = {10, 2, 12};
  PA_CHECK_THROWS(m.fork_batch(parents, existing, 3), InvalidArgument);
  PA_CHECK(snap(m) == before);
  m.fork_batch(parents, children, 3);
  PA_CHECK(m.block_table(10) == m.block_table(1) && m.block_table(12) == m.block_table(2));
  PA_CHECK_EQ(m.ref_count(m.block_table(1)[0]), 3);
  const Snapshot forked = snap(m);
  const std::int64_t unknown[] = {10, 99}, repeated[] = {10, 11, 10}, all[] = {10, 11, 12, 1};
  PA_CHECK_THROWS(m.free_batch(unknown, 2), UnknownSequence);
  PA_CHECK_THROWS(m.free_batch(repeated, 3), InvalidArgument);
  PA_CHECK(snap(m) == forked);
  m.free_batch(all, 4);
  PA_CHECK_EQ(m.num_sequences(), 1);
  PA_CHECK(snap(m) == [&] {
    BlockManager one = make(32, 4);
    add(one, 1, iota_tokens(6));
    add(one, 2, iota_tokens(3));
    compute_all(one, {1, 2});
    one.free(1);
    return snap(one);
  }());
  m.check_invariants();
}

PA_TEST(int64_token_ids_are_narrowed_or_refused_before_any_change) {
  BlockManager a = make(16, 4, true), b = make(16, 4, true);
  const std::vector<std::int64_t> wide = {5, -3, 2147483647, -2147483648LL, 9, 9, 9, 9, 1};
  std::vector<std::int32_t> narrow(wide.begin(), wide.end());
  PA_CHECK_EQ(a.add_sequence_int64(1, wide.data(), 9), add(b, 1, narrow));
  PA_CHECK(a.token_ids(1) == narrow && a.block_table(1) == b.block_table(1));
  compute_all(a, {1});
  compute_all(b, {1});
  PA_CHECK_EQ(a.peek_prefix_int64(wide.data(), 9).cached_tokens, 8);
  PA_CHECK_EQ(a.add_sequence_int64(2, wide.data(), 9), 8);
  const Snapshot before = snap(a);
  const std::vector<std::int64_t> bad = {1, 2, 2147483648LL};
  PA_CHECK_THROWS(a.add_sequence_int64(3, bad.data(), 3), InvalidArgument);
  PA_CHECK_THROWS(a.peek_prefix_int64(bad.data(), 3), InvalidArgument);
  PA_CHECK_THROWS(a.add_sequence_int64(3, nullptr, 2), InvalidArgument);
  PA_CHECK(snap(a) == before);
  a.check_invariants();
}

int main() { return pagedattn_test::run_all(); }
