// BlockManager: exports of the sequences' block tables, lengths, CSR page tables and slots
// into caller-provided arrays (the step's own metadata is written by block_manager_step.cpp).
#include <algorithm>

#include "block_manager_impl.hpp"
#include "host_outputs.hpp"

namespace pagedattn {

using host_out::at32;
using host_out::byte_range;
using host_out::check_disjoint;
using host_out::check_int32;

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
