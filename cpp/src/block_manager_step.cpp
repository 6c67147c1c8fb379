// BlockManager: the scheduler step (plan_step / step) that appends decode tokens, schedules
// query ranges, writes the step's metadata and releases blocks that left the sliding window.
#include <algorithm>
#include <limits>

#include "block_manager_impl.hpp"
#include "host_outputs.hpp"

namespace pagedattn {

void BlockManager::Impl::release_window(Seq& s, std::int64_t first_query_pos) {
  if (opt.sliding_window <= 0) return;
  const std::int64_t limit = first_query_pos - opt.sliding_window + 1;  // oldest key position still needed
  if (limit <= 0) return;
  const std::int64_t end = std::min<std::int64_t>(limit / bs, static_cast<std::int64_t>(s.blocks.size()));
  if (end > s.first_live_block) mark_dirty(s, s.first_live_block);
  for (std::int64_t j = s.first_live_block; j < end; ++j) {
    std::int32_t& b = s.blocks[static_cast<std::size_t>(j)];
    if (b >= 0) release_block(b);
    b = -1;
  }
  s.first_live_block = std::max(s.first_live_block, end);
}

StepShape BlockManager::plan_step(const StepRequest& req) const { return impl_->plan(req, nullptr); }

StepShape BlockManager::Impl::plan(const StepRequest& req, std::int64_t* demand) const {
  // One pass: resolve the ids (as resolve_batch), count the append demand, size the step.
  // The errors are those of resolve_batch followed by a pass over the query lengths: an
  // id error anywhere wins over a query-length error, so the latter waits for the end.
  const Impl& d = *this;
  const std::int64_t n = req.num_seqs;
  if (n < 0) fail<InvalidArgument>("step: negative batch size ", n);
  scratch_idx.resize(static_cast<std::size_t>(n));
  if (++stamp == 0) {
    std::fill(seq_stamp.begin(), seq_stamp.end(), 0u);
    stamp = 1;
  }
  StepShape shape;
  shape.num_seqs = n;
  const std::int64_t add = req.new_tokens ? 1 : 0;
  const bool count = demand != nullptr && add;
  if (count) {
    *demand = 0;
    d.next_block_stamp();
  }
  std::int64_t bad_query = -1;  // the first sequence whose query length is out of range
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t idx = lookup(req.seq_ids[i], "step");
    const Seq& s = seq_at(idx);
    if (seq_stamp[static_cast<std::size_t>(idx)] == stamp)
      fail<InvalidArgument>("step: sequence id ", req.seq_ids[i], " appears more than once in the batch");
    seq_stamp[static_cast<std::size_t>(idx)] = stamp;
    if (s.swapped)
      fail<InvalidArgument>("step: sequence id ", req.seq_ids[i], " is swapped out; swap_in() it first");
    scratch_idx[static_cast<std::size_t>(i)] = idx;
    if (count) *demand += d.append_one_demand(s);  // batch_append_demand, in the same pass
    const std::int64_t len = static_cast<std::int64_t>(s.tokens.size()) + add;
    const std::int64_t pending = len - s.num_computed;
    const std::int64_t q = req.query_lens ? req.query_lens[i] : pending;
    if (q < 0 || q > pending) {
      if (bad_query < 0) bad_query = i;
      continue;
    }
    shape.num_tokens += q;
    shape.max_blocks = std::max(shape.max_blocks, d.blocks_for(len));
    shape.max_seq_len = std::max(shape.max_seq_len, s.num_computed + q);
    shape.max_query_len = std::max(shape.max_query_len, q);
  }
  if (bad_query >= 0) {
    const Seq& s = seq_at(scratch_idx[static_cast<std::size_t>(bad_query)]);
    const std::int64_t pending = static_cast<std::int64_t>(s.tokens.size()) + add - s.num_computed;
    fail<InvalidArgument>("step: query_lens[", bad_query, "] = ", req.query_lens[bad_query],
                          " for sequence id ", s.id, " is outside [0, ", pending,
                          "] (tokens not yet computed)");
  }
  return shape;
}

StepShape BlockManager::step(const StepRequest& req, const StepOutputs& out) {
  using namespace host_out;
  Impl& d = *impl_;
  std::int64_t need = 0;                       // blocks the appends take (req.new_tokens)
  const StepShape shape = d.plan(req, &need);  // resolves d.scratch_idx
  const char* what = "step";
  const std::int64_t n = req.num_seqs;
  const std::int64_t bs = d.bs;
  const bool at_least = out.persistent;
  check_table(out.block_tables, what, n, shape.max_blocks, at_least);
  check_vec(out.seq_lens, what, "seq_lens", n, false, at_least);
  check_vec(out.context_lens, what, "context_lens", n, false, at_least);
  check_vec(out.query_start_loc, what, "query_start_loc", n + 1, false, at_least);
  check_vec(out.slot_mapping, what, "slot_mapping", shape.num_tokens, true, at_least);
  check_disjoint(
      what,
      {byte_range(out.block_tables, what, "block_tables"), byte_range(out.seq_lens, what, "seq_lens"),
       byte_range(out.context_lens, what, "context_lens"),
       byte_range(out.query_start_loc, what, "query_start_loc"),
       byte_range(out.slot_mapping, what, "slot_mapping")},
      {byte_range(req.seq_ids, n, sizeof(std::int64_t), "seq_ids"),
       byte_range(req.new_tokens, n, sizeof(std::int32_t), "token_ids"),
       byte_range(req.query_lens, n, sizeof(std::int64_t), "query_lens")});
  if (out.slot_mapping && out.slot_mapping->dtype == DType::kInt32 &&
      d.opt.num_blocks * bs > std::numeric_limits<std::int32_t>::max())
    fail<InvalidArgument>(what, ": slot_mapping must be int64: slots reach ", d.opt.num_blocks * bs);
  if (req.new_tokens) {
    if (need > d.pool.num_available())
      fail<OutOfBlocks>("step: appending one token to each of ", n, " sequence(s) needs ", need,
                        " new block(s); ", d.pool.num_available(), " available");
    d.copies.reserve(d.copies.size() + static_cast<std::size_t>(n));
  }
  const bool incremental = out.block_tables && out.incremental;
  if (incremental)
    d.track_table(*out.block_tables, out.pad);  // may allocate its row state: before any change
  for (const TensorView* t : {incremental ? nullptr : out.block_tables, out.seq_lens, out.context_lens,
                              out.query_start_loc, out.slot_mapping})
    if (t) d.forget_table_if_overlapping(*t);  // a full write into the remembered table

  // Nothing below can fail. The outputs' pointers and strides are read once: stores through
  // an int32 pointer could alias a TensorView's fields, so the compiler would reload them.
  struct Out32 {
    std::int32_t* p = nullptr;
    std::int64_t st = 0;
    explicit Out32(const TensorView* v)
        : p(v ? v->ptr<std::int32_t>() : nullptr), st(v ? v->strides[0] : 0) {}
    void put(std::int64_t i, std::int64_t value) const {
      if (p) p[i * st] = static_cast<std::int32_t>(value);
    }
  };
  const Out32 seq_lens(out.seq_lens), context_lens(out.context_lens), qsl(out.query_start_loc);
  std::int64_t* slots64 = nullptr;
  std::int64_t slots_st = 0;
  if (out.slot_mapping && out.slot_mapping->dtype == DType::kInt64) {
    slots64 = out.slot_mapping->ptr<std::int64_t>();
    slots_st = out.slot_mapping->strides[0];
  }
  const bool caching = d.cache.enabled();
  const bool window = d.opt.sliding_window > 0;
  std::int64_t t = 0;  // tokens scheduled so far
  qsl.put(0, 0);
  if (req.new_tokens)  // all allocations first, then the schedule (which may register blocks)
    for (std::int64_t i = 0; i < n; ++i)
      d.append_into(d.seq_at(d.scratch_idx[static_cast<std::size_t>(i)]), req.new_tokens + i, 1, nullptr);
  for (std::int64_t i = 0; i < n; ++i) {
    Impl::Seq& s = d.seq_at(d.scratch_idx[static_cast<std::size_t>(i)]);
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    const std::int64_t ctx = s.num_computed;
    const std::int64_t q = req.query_lens ? req.query_lens[i] : len - ctx;
    if (window) d.release_window(s, ctx);
    if (slots64 && q == 1) {  // a decode token
      slots64[t * slots_st] =
          static_cast<std::int64_t>(s.blocks[static_cast<std::size_t>(d.block_of(ctx))]) * bs +
          d.offset_of(ctx);
    } else if (out.slot_mapping) {
      for (std::int64_t pos = ctx; pos < ctx + q; ++pos)
        put_slot(*out.slot_mapping, t + pos - ctx,
                 static_cast<std::int64_t>(s.blocks[static_cast<std::size_t>(pos / bs)]) * bs + pos % bs);
    }
    t += q;
    qsl.put(i + 1, t);
    if (incremental) {
      // Most decode steps change nothing in a row (a new block every block_size tokens).
      const auto r = static_cast<std::size_t>(i);
      const auto nb = static_cast<std::int64_t>(s.blocks.size());
      if (!(d.track.row_uid[r] == s.uid && s.export_row == i && d.track.row_len[r] == nb &&
            s.dirty_from >= nb))
        d.write_row_incremental(*out.block_tables, i, s);
    } else if (out.block_tables) {
      write_row(*out.block_tables, i, s.blocks, out.pad);
    }
    seq_lens.put(i, ctx + q);
    context_lens.put(i, ctx);
    s.num_computed = ctx + q;
    if (caching) d.register_full_blocks(s);
  }
  return shape;
}

void BlockManager::reset_incremental_export() { impl_->track = Impl::ExportTrack{}; }

void BlockManager::take_copy_pairs(BlockPairs& pairs) {
  pairs.insert(pairs.end(), impl_->copies.begin(), impl_->copies.end());
  impl_->copies.clear();
}

}  // namespace pagedattn
