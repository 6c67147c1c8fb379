// The varlen (chunked prefill / mixed batch) launcher: one kernel over (query tile, KV
// head[, sequence]). The grid is sized from host-known numbers only, never from device
// memory (so a call can be captured in a CUDA graph with a fixed token budget):
// ceil(bound * G / rows per CTA) tiles per sequence with bound = max_query_len when the
// caller gives it; without it, the tensor-core kernel takes a flat grid of
// ceil(T * G / rows per CTA) + S tiles, the CUDA-core kernel and checked calls bound = T. Nothing is allocated
// (but a stream's first persistent call makes its pair of work counters, and a captured
// one takes graph-owned counters: cuda/scratch_pool.cuh) and the host never waits, except
// with check_block_tables, which reads the call's error record back (cuda/error_record.cuh).
#include <cstdlib>
#include <optional>
#include <string_view>

#include "cuda/decode_dispatch.cuh"
#include "cuda/decode_inst.cuh"
#include "cuda/device.cuh"
#include "cuda/error_record.cuh"
#include "cuda/prefill_launch.cuh"
#include "cuda/prefill_params.cuh"
#include "cuda/scratch_pool.cuh"
#if PAGEDATTN_SM90_PREFILL
#include "cuda/sm90/prefill_sm90.h"
#endif

// A tuning knob: -DPAGEDATTN_PREFILL_FLAT=0 gives the tensor-core kernel the per-sequence
// grid as well (for A/B timing of the flat grid).
#ifndef PAGEDATTN_PREFILL_FLAT
#define PAGEDATTN_PREFILL_FLAT 1
#endif

namespace pagedattn::cuda_backend {
namespace {

// PAGEDATTN_PREFILL_KERNEL=mma keeps the sm_80 tensor-core kernel on Hopper too (for A/B
// timing, and to test that kernel on a Hopper GPU). Read once.
bool sm90_prefill_off() {
  static const bool off = [] {
    const char* e = std::getenv("PAGEDATTN_PREFILL_KERNEL");
    return e != nullptr && std::string_view(e) == "mma";
  }();
  return off;
}

// PAGEDATTN_SM90_PERSISTENT=0 gives the Hopper kernel one CTA per work item instead of
// its persistent grid (for A/B timing). Read once.
bool sm90_persistent_off() {
  static const bool off = [] {
    const char* e = std::getenv("PAGEDATTN_SM90_PERSISTENT");
    return e != nullptr && std::string_view(e) == "0";
  }();
  return off;
}

// PAGEDATTN_SM90_SURE=1: the persistent grid only when the items that cannot be empty
// fill two rounds (the earlier rule; for A/B timing). Read once.
bool sm90_sure_rule() {
  static const bool on = [] {
    const char* e = std::getenv("PAGEDATTN_SM90_SURE");
    return e != nullptr && std::string_view(e) == "1";
  }();
  return on;
}

DecodeKernelInfo select_prefill_kernel(const DecodeParams& p) {
#if PAGEDATTN_SM90_PREFILL
  const DeviceInfo& dev = device_info(p.device_id);
  if (dev.cc_major == 9 && dev.cc_minor == 0 && !sm90_prefill_off()) {
    const DecodeKernelInfo k =
        sm90_prefill_kernel_info(p.dtype, p.kv_cache_dtype, p.head_size, p.layout, p.block_size);
    if (k.func != nullptr) return k;
  }
#endif
  return select_by_types(p, [&](auto t, auto kc) {
    return prefill_kernel<typename decltype(t)::type, decltype(kc)::value>(p.head_size, p.layout);
  });
}

}  // namespace

const char* varlen_kernel_name(const DecodeParams& p) { return select_prefill_kernel(p).name; }

void paged_attention_varlen(const DecodeParams& p, cudaStream_t stream, bool skip_single) {
  if (p.check_block_tables && stream_is_capturing(stream))
    fail<InvalidArgument>("check_block_tables=True needs a host synchronisation and cannot run during CUDA graph "
                          "capture");
  const DecodeKernelInfo kernel = select_prefill_kernel(p);
  kernel_slots_per_sm(kernel, p.device_id);  // sets the kernel's shared-memory limit once per device

  const int group = p.num_heads / p.num_kv_heads;
  if (p.num_tokens == 0) return;  // no query rows at all
  // At least one tile per sequence, so that a max_query_len of 0 that some sequence
  // exceeds is still seen (and reported) by a CTA.
  const std::int64_t bound = std::max<std::int64_t>(
      1, p.max_query_len >= 0 ? std::min<std::int64_t>(p.max_query_len, p.num_tokens) : p.num_tokens);
  // The tensor-core kernel enumerates the tiles of all sequences in one flat grid
  // (prefill_item_warp): ceil(T * G / rows) + S CTAs, however the rows are split. The
  // CUDA-core kernel and checked calls (which must visit every sequence to report it)
  // take a tile bound per sequence: max_query_len when given, else T.
  // The sm_80 kernel, measured on an H100 (PERF_NOTES.md): with max_query_len given, the per-sequence grid
  // is as fast on a mixed step and 20% faster on a lone chunk, so the flat grid serves the
  // calls without it, where the per-sequence bound T would launch S * T * G / 128 CTAs.
  // The Hopper kernel (one 225 KB thread block per multiprocessor) takes the flat grid
  // always: measured on an H100, the per-sequence grid's empty blocks cost a mixed step
  // (a 512-row chunk and 127 decode rows) 7% (501 against 467 us), other shapes within noise.
  const bool sm90 = std::string_view(kernel.name) == "sm90_wgmma";
  const bool flat = PAGEDATTN_PREFILL_FLAT && kernel.smem > 0 && !p.check_block_tables &&
                    (p.max_query_len < 0 || sm90);
  const std::int64_t tiles = flat ? (p.num_tokens * group + kernel.rows - 1) / kernel.rows + p.num_seqs
                                  : (bound * group + kernel.rows - 1) / kernel.rows;
  if (tiles > 0x7fffffff)
    fail<NotSupported>("query: ", bound, " rows per sequence x ", group,
                       " heads per KV head is more than the CUDA grid can index; pass a smaller max_query_len "
                       "or split the call");

  PrefillKernelParams k{};
  k.out = p.out;
  k.o_stride_tok = p.o_stride_seq;
  k.o_stride_head = p.o_stride_head;
  k.query = p.query;
  k.q_stride_tok = p.q_stride_seq;
  k.q_stride_head = p.q_stride_head;
  k.key_cache = p.key_cache;
  k.value_cache = p.value_cache;
  k.k_block_stride = p.k_block_stride;
  k.v_block_stride = p.v_block_stride;
  const RowStrides row_st = row_strides(p.layout, p.block_size, p.num_kv_heads, p.head_size);
  k.tok_stride = row_st.token;
  k.head_stride = row_st.head;
  {
    // a block's elements bound every row offset inside it (t * tok_stride + h * head_stride + d)
    constexpr std::int64_t kMax32 = 0x7fffffff;
    const std::int64_t block_elems = static_cast<std::int64_t>(p.block_size) * p.num_kv_heads * p.head_size;
    k.strides32 = p.k_block_stride <= kMax32 && p.v_block_stride <= kMax32 && block_elems <= kMax32;
  }
  k.block_tables = p.block_tables;
  k.seq_lens = p.seq_lens;
  k.query_start_loc = p.query_start_loc;
  k.alibi_slopes = p.alibi_slopes;
  k.num_seqs = p.num_seqs;
  k.num_heads = p.num_heads;
  k.num_kv_heads = p.num_kv_heads;
  k.head_size = p.head_size;
  k.block_size = p.block_size;
  k.max_blocks_per_seq = p.max_blocks_per_seq;
  k.num_blocks = p.num_blocks;
  k.num_tokens = static_cast<int>(p.num_tokens);
  k.max_query_len = p.max_query_len;
  k.group = group;
  k.skip_single = skip_single;
  k.flat_tiles = flat;
  // The Hopper kernel on the flat grid is persistent when the grid is long: one CTA per
  // multiprocessor (its shared memory allows no more), each walking items of the tiles x
  // KV heads grid, so that the start and the stores of one item overlap the loads of the
  // next (PERF_NOTES.md). Each CTA takes its next item from a counter (the greedy deal
  // the hardware gives blocks). Items with nothing to do (a gap tile of the flat grid, a
  // one-row sequence left to the decode kernels: a mixed step's grid is mostly such items)
  // cost a fresh block its start and a lookup, a persistent CTA only the lookup. So the
  // grid is persistent whenever it has two rounds of items; PAGEDATTN_SM90_SURE=1 keeps
  // the earlier rule (only when the items that cannot be empty fill two rounds), for A/B
  // timing. (Moving the counter past a run of empty items, as the kernel once did, measured
  // no faster on an H200: PERF_NOTES.md.) The item indices must fit the counter's int.
  const std::int64_t items = tiles * p.num_kv_heads;
  const std::int64_t sure_items = items - 2 * static_cast<std::int64_t>(p.num_seqs) * p.num_kv_heads;
  const int num_sms = device_info(p.device_id).num_sms;
  std::optional<CallCounters> counters;
  if (sm90 && flat && !sm90_persistent_off() && (sm90_sure_rule() ? sure_items : items) >= 2 * num_sms &&
      items + num_sms <= 0x7fffffff) {
    counters.emplace(p.device_id, stream);
    k.sched = counters->get();  // null: capture without stream-ordered allocation
  }
  k.persistent = k.sched != nullptr;
  k.tiles = static_cast<int>(tiles);
  const bool fp8 = p.kv_cache_dtype != KVCacheDType::kAuto;
  k.qk_scale_log2 = p.scale * (fp8 ? p.k_scale : 1.0f) * kLog2e;
  k.v_scale = fp8 ? p.v_scale : 1.0f;
  k.sliding_window = p.sliding_window;
  k.soft_cap_log2 = p.soft_cap * kLog2e;
  k.inv_soft_cap_log2 = p.soft_cap > 0.0f ? 1.0f / (p.soft_cap * kLog2e) : 0.0f;
  k.sinks = p.sinks;

  std::optional<ErrorRecordLease> record;  // checked calls only: the call's own record
  if (p.check_block_tables) {
    record.emplace(p.device_id);
    record->zero(stream);
    k.error = record->get();
  }
  void* args[] = {&k};
  const dim3 grid = k.persistent
                        ? dim3(static_cast<unsigned>(num_sms))  // items >= 2 x num_sms
                        : dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.num_kv_heads),
                               flat ? 1u : static_cast<unsigned>(p.num_seqs));
  check_cuda(cudaLaunchKernel(kernel.func, grid, dim3(kernel.threads), args, static_cast<std::size_t>(kernel.smem),
                              stream),
             "paged_attention: varlen kernel launch");
  check_launch("paged_attention: varlen kernel");
  if (counters) counters->release();
  if (record) raise_recorded_error(record->take(stream), p);
}

}  // namespace pagedattn::cuda_backend
