// BlockManager: exports of the sequences' block tables, lengths, CSR page tables and slots
// into caller-provided arrays (the step's own metadata is written by block_manager_step.cpp),
// and the remembered table of incremental steps.
#include <algorithm>
#include <cstdlib>
#include <limits>

#include "block_manager_impl.hpp"
#include "host_outputs.hpp"

namespace pagedattn {

using host_out::at32;
using host_out::byte_range;
using host_out::check_disjoint;
using host_out::check_int32;

// ---------------------------------------------------------------------------------------
// Incremental export
// ---------------------------------------------------------------------------------------
void BlockManager::Impl::track_table(const TensorView& t, std::int32_t pad) const {
  ExportTrack& k = track;
  const std::int64_t rows = t.shape[0], cols = t.shape[1], s0 = t.strides[0], s1 = t.strides[1];
  if (k.data == t.data && k.rows == rows && k.cols == cols && k.s0 == s0 && k.s1 == s1 && k.pad == pad)
    return;
  // A row's entries must be its own: the row state would be wrong if two rows shared memory.
  const std::int64_t a = std::llabs(s0), b = std::llabs(s1);
  const bool row_major = (cols <= 1 || b >= 1) && (rows <= 1 || a >= (cols - 1) * b + 1);
  const bool col_major = (rows <= 1 || a >= 1) && (cols <= 1 || b >= (rows - 1) * a + 1);
  if (!row_major && !col_major)
    fail<InvalidArgument>("step: an incremental block_tables must not have overlapping rows, got shape ",
                          t.shape_str(), " with strides (", s0, ", ", s1, ")");
  std::vector<std::uint64_t> uid(static_cast<std::size_t>(rows), 0);  // may throw: nothing changed yet
  std::vector<std::int64_t> len(static_cast<std::size_t>(rows), 0);
  const host_out::ByteRange r = byte_range(&t, "step", "block_tables");
  k.row_uid.swap(uid);
  k.row_len.swap(len);
  k.data = t.data;
  k.rows = rows;
  k.cols = cols;
  k.s0 = s0;
  k.s1 = s1;
  k.pad = pad;
  k.lo = r.lo;
  k.hi = r.hi;
}

void BlockManager::Impl::forget_table_if_overlapping(const TensorView& t) const {
  if (track.data == nullptr) return;
  const host_out::ByteRange r = byte_range(&t, "export", "output");
  if (host_out::overlap(r, host_out::ByteRange{track.lo, track.hi, ""})) track = ExportTrack{};
}

void BlockManager::Impl::write_row_incremental(const TensorView& t, std::int64_t row, Seq& s) const {
  std::int32_t* p = t.ptr<std::int32_t>() + row * t.strides[0];
  const std::int64_t s1 = t.strides[1];
  const std::int32_t pad = track.pad;
  std::uint64_t& owner = track.row_uid[static_cast<std::size_t>(row)];
  std::int64_t& written = track.row_len[static_cast<std::size_t>(row)];
  const auto nb = static_cast<std::int64_t>(s.blocks.size());
  std::int64_t from = 0, pad_to = track.cols;  // unknown content: the whole row
  if (owner != 0) {
    pad_to = written;  // the rest of the row already holds pad
    if (owner == s.uid && s.export_row == row) from = std::min(written, s.dirty_from);
  }
  for (std::int64_t k = from; k < nb; ++k) {
    const std::int32_t b = s.blocks[static_cast<std::size_t>(k)];
    p[k * s1] = b < 0 ? pad : b;
  }
  for (std::int64_t k = nb; k < pad_to; ++k) p[k * s1] = pad;
  owner = s.uid;
  written = nb;
  s.export_row = row;
  s.dirty_from = std::numeric_limits<std::int64_t>::max();
}

// ---------------------------------------------------------------------------------------
// Full exports
// ---------------------------------------------------------------------------------------
void BlockManager::export_block_tables(const std::int64_t* seq_ids, std::int64_t n, const TensorView& out,
                                       std::int32_t pad) const {
  const Impl& d = *impl_;
  const char* what = "export_block_tables";
  d.resolve_batch(seq_ids, n, what, false);
  std::int64_t width = 0;
  for (const std::int32_t idx : d.scratch_idx)
    width = std::max<std::int64_t>(width, static_cast<std::int64_t>(d.seq_at(idx).blocks.size()));
  check_int32(out, what, "block_tables", 2);
  if (out.shape[0] != n || out.shape[1] < width)
    fail<InvalidArgument>(what, ": block_tables must have shape [", n, ", M] with M >= ", width, ", got ",
                          out.shape_str());
  check_disjoint(what, {byte_range(&out, what, "block_tables")},
                 {byte_range(seq_ids, n, sizeof(std::int64_t), "seq_ids")});
  d.forget_table_if_overlapping(out);
  for (std::int64_t i = 0; i < n; ++i)
    host_out::write_row(out, i, d.seq_at(d.scratch_idx[static_cast<std::size_t>(i)]).blocks, pad);
}

void BlockManager::export_seq_lens(const std::int64_t* seq_ids, std::int64_t n, const TensorView& out) const {
  const Impl& d = *impl_;
  const char* what = "export_seq_lens";
  d.resolve_batch(seq_ids, n, what, false);
  check_int32(out, what, "seq_lens", 1);
  if (out.shape[0] != n)
    fail<InvalidArgument>(what, ": seq_lens must have shape [", n, "], got ", out.shape_str());
  check_disjoint(what, {byte_range(&out, what, "seq_lens")},
                 {byte_range(seq_ids, n, sizeof(std::int64_t), "seq_ids")});
  d.forget_table_if_overlapping(out);
  for (std::int64_t i = 0; i < n; ++i)
    at32(out, i) =
        static_cast<std::int32_t>(d.seq_at(d.scratch_idx[static_cast<std::size_t>(i)]).tokens.size());
}

std::int64_t BlockManager::count_blocks(const std::int64_t* seq_ids, std::int64_t n) const {
  const Impl& d = *impl_;
  d.resolve_batch(seq_ids, n, "count_blocks", false);
  std::int64_t total = 0;
  for (const std::int32_t idx : d.scratch_idx)
    total += static_cast<std::int64_t>(d.seq_at(idx).blocks.size());
  return total;
}

void BlockManager::export_csr(const std::int64_t* seq_ids, std::int64_t n, const TensorView& indptr,
                              const TensorView& indices, const TensorView& last_page_len,
                              std::int32_t pad) const {
  const Impl& d = *impl_;
  const char* what = "export_csr";
  const std::int64_t nnz = count_blocks(seq_ids, n);  // resolves d.scratch_idx
  check_int32(indptr, what, "indptr", 1);
  check_int32(indices, what, "indices", 1);
  check_int32(last_page_len, what, "last_page_len", 1);
  if (indptr.shape[0] != n + 1)
    fail<InvalidArgument>(what, ": indptr must have shape [", n + 1, "], got ", indptr.shape_str());
  if (indices.shape[0] != nnz)
    fail<InvalidArgument>(what, ": indices must have shape [", nnz, "], got ", indices.shape_str());
  if (last_page_len.shape[0] != n)
    fail<InvalidArgument>(what, ": last_page_len must have shape [", n, "], got ", last_page_len.shape_str());
  check_disjoint(what,
                 {byte_range(&indptr, what, "indptr"), byte_range(&indices, what, "indices"),
                  byte_range(&last_page_len, what, "last_page_len")},
                 {byte_range(seq_ids, n, sizeof(std::int64_t), "seq_ids")});
  for (const TensorView* t : {&indptr, &indices, &last_page_len}) d.forget_table_if_overlapping(*t);
  std::int64_t k = 0;
  at32(indptr, 0) = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const Impl::Seq& s = d.seq_at(d.scratch_idx[static_cast<std::size_t>(i)]);
    for (const std::int32_t b : s.blocks) at32(indices, k++) = b < 0 ? pad : b;
    at32(indptr, i + 1) = static_cast<std::int32_t>(k);
    const auto len = static_cast<std::int64_t>(s.tokens.size());
    at32(last_page_len, i) = static_cast<std::int32_t>(len == 0 ? 0 : (len - 1) % d.bs + 1);
  }
}

void BlockManager::slots(std::int64_t seq_id, std::int64_t start, std::int64_t stop,
                         std::int64_t* out) const {
  const Impl& d = *impl_;
  const Impl::Seq& s = d.live_gpu_seq(seq_id, "slots");
  const auto len = static_cast<std::int64_t>(s.tokens.size());
  if (start < 0 || stop < start || stop > len)
    fail<OutOfRange>("slots: token range [", start, ", ", stop, ") is outside sequence id ", seq_id,
                     " of length ", len);
  for (std::int64_t pos = start; pos < stop; ++pos) {
    const std::int32_t b = s.blocks[static_cast<std::size_t>(pos / d.bs)];
    out[pos - start] = b < 0 ? -1 : static_cast<std::int64_t>(b) * d.bs + pos % d.bs;
  }
}

}  // namespace pagedattn
