// Entry points of the decode kernel family (cuda_backend.hpp): the one place that fills
// the kernels' parameters and launches them, from the launch plan of the call.
//
// Partitioned (v2) scratch, per call: [S, H, NP, D] float partial outputs plus
// [S, H, NP] max logits and exp-sums (decode_workspace_bytes). It comes from the
// caller's `workspace` when given (checked against the plan by the validator), else from
// the stream's scratch pool or, during graph capture, a stream-ordered allocation
// (cuda/scratch_pool.cuh). A reduce kernel merges the partials
// (cuda/decode_reduce.cu). No call synchronises the host, except with check_block_tables,
// which reads the call's error record back (cuda/error_record.cuh).
//
// Everything the host can check from the arguments (alignment, grid limits, partition
// size, workspace size) is checked by the validator (cpp/src/validate.cpp) before this
// runs: DecodeParams arrive trusted.
#include <optional>

#include "cuda/decode_common.cuh"
#include "cuda/decode_launch_plan.cuh"
#include "cuda/decode_reduce.cuh"
#include "cuda/device.cuh"
#include "cuda/error_record.cuh"
#include "cuda/prefill_launch.cuh"
#include "cuda/scratch_pool.cuh"
#include "cuda_backend.hpp"

namespace pagedattn::cuda_backend {
namespace {

// A vllm cache of one-token blocks is, byte for byte, an nhd one: [N, K, D/x, 1, x] and
// [N, K, D, 1] hold a block's heads as D contiguous elements each, as [N, 1, K, D] does
// (the block stride is the cache's own in both). Such calls run the nhd kernels, which copy
// whole token rows, instead of the vllm kernels' element-by-element value loads (6-10x the
// page-16 time). Every entry point maps the call the same way, so the workspace size and
// the plan a caller queries are those of the kernels that run.
bool vllm_as_nhd(const DecodeParams& p) { return p.layout == CacheLayout::kVLLM && p.block_size == 1; }

DecodeParams as_nhd(const DecodeParams& p) {
  DecodeParams q = p;
  q.layout = CacheLayout::kNHD;
  return q;
}

}  // namespace

std::size_t decode_workspace_bytes(const DecodeParams& p) {
  if (vllm_as_nhd(p)) return decode_workspace_bytes(as_nhd(p));
  DeviceGuard guard(p.device_id);
  return cached_launch_plan(p).plan.workspace_bytes();
}

DecodePlanInfo decode_plan_info(const DecodeParams& p) {
  if (vllm_as_nhd(p)) return decode_plan_info(as_nhd(p));
  DeviceGuard guard(p.device_id);
  const LaunchPlan& lp = cached_launch_plan(p);
  const planner::DecodePlan& plan = lp.plan;
  DecodePlanInfo info;
  info.threads_per_cta = lp.kernel.threads;
  info.num_partitions = plan.num_partitions;
  info.partition_size = plan.partition_size;
  info.reduce_kernel = plan.partials;
  info.head_tiles = plan.tiles;
  info.ctas = plan.ctas(p.num_seqs, p.num_kv_heads);
  info.workspace_bytes = plan.workspace_bytes();
  info.varlen_kernel = varlen_kernel_name(p);
  return info;
}

void paged_attention(const DecodeParams& p, void* stream_handle) {
  if (vllm_as_nhd(p)) return paged_attention(as_nhd(p), stream_handle);
  auto stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device_id);
  if (p.num_seqs == 0) return;
  // Varlen calls: a plain decode batch runs the decode kernels as they are; a checked
  // call or one sequence runs the varlen kernel alone; otherwise the varlen kernel serves
  // the sequences with more (or fewer) than one row and the decode kernels, queued behind
  // it, the single-row ones: a mixed step's decodes cost what a decode batch costs.
  bool mixed = false;
  if (p.query_start_loc && !varlen_is_decode(p)) {
    if (p.check_block_tables || p.num_seqs == 1) return paged_attention_varlen(p, stream, /*skip_single=*/false);
    paged_attention_varlen(p, stream, /*skip_single=*/true);
    mixed = true;
  }
  // Only the checking mode (and a scratch pool that must grow, see CallScratch) cares about
  // capture; the capture query is skipped otherwise, to keep the host cost of a call low.
  if (p.check_block_tables && stream_is_capturing(stream))
    fail<InvalidArgument>("check_block_tables=True needs a host synchronisation and cannot run during CUDA graph "
                          "capture");

  const LaunchPlan lp = cached_launch_plan(p);
  const planner::DecodePlan& plan = lp.plan;
  DecodeKernelParams k{};
  k.out = p.out;
  k.o_stride_seq = p.o_stride_seq;
  k.o_stride_head = p.o_stride_head;
  k.query = p.query;
  k.q_stride_seq = p.q_stride_seq;
  k.q_stride_head = p.q_stride_head;
  k.key_cache = p.key_cache;
  k.value_cache = p.value_cache;
  k.k_block_stride = p.k_block_stride;
  k.v_block_stride = p.v_block_stride;
  const RowStrides row_st = row_strides(p.layout, p.block_size, p.num_kv_heads, p.head_size);
  k.tok_stride = row_st.token;
  k.head_stride = row_st.head;
  k.block_tables = p.block_tables;
  k.seq_lens = p.seq_lens;
  k.alibi_slopes = p.alibi_slopes;
  k.query_start_loc = mixed ? p.query_start_loc : nullptr;
  k.num_tokens = static_cast<int>(p.num_tokens);
  k.max_query_len = p.max_query_len;
  k.num_seqs = p.num_seqs;
  k.num_heads = p.num_heads;
  k.num_kv_heads = p.num_kv_heads;
  k.head_size = p.head_size;
  k.block_size = p.block_size;
  k.max_blocks_per_seq = p.max_blocks_per_seq;
  k.num_blocks = p.num_blocks;
  k.group = p.num_heads / p.num_kv_heads;
  k.rows_per_cta = lp.kernel.rows;
  k.num_head_tiles = plan.tiles;
  const float k_scale = p.kv_cache_dtype == KVCacheDType::kAuto ? 1.0f : p.k_scale;
  k.qk_scale_log2 = p.scale * k_scale * kLog2e;
  k.v_scale = p.kv_cache_dtype == KVCacheDType::kAuto ? 1.0f : p.v_scale;
  k.partition_size = plan.partition_size;
  k.num_partitions = plan.num_partitions;
  static_assert(kWindowAlign == planner::kPartitionAlign, "windows are laid out in whole partition chunks");
  k.sliding_window = p.sliding_window;
  k.soft_cap_log2 = p.soft_cap * kLog2e;
  k.inv_soft_cap_log2 = p.soft_cap > 0.0f ? 1.0f / (p.soft_cap * kLog2e) : 0.0f;
  k.sinks = p.sinks;

  std::optional<CallScratch> scratch;  // partitioned calls without a caller workspace
  if (plan.partials) {
    char* ws = static_cast<char*>(p.workspace);
    if (ws == nullptr) {
      scratch.emplace(p.device_id, stream, plan.workspace_bytes());
      ws = static_cast<char*>(scratch->get());
    }
    k.part_out = reinterpret_cast<float*>(ws);
    k.part_max = reinterpret_cast<float*>(ws + plan.max_offset());
    k.part_sum = reinterpret_cast<float*>(ws + plan.sum_offset());
  }

  std::optional<ErrorRecordLease> record;  // checked calls only: the call's own record
  if (p.check_block_tables) {
    record.emplace(p.device_id);
    record->zero(stream);
    k.error = record->get();
  }

  void* args[] = {&k};
  const dim3 grid(static_cast<unsigned>(plan.num_partitions), static_cast<unsigned>(p.num_kv_heads * plan.tiles),
                  static_cast<unsigned>(p.num_seqs));
  check_cuda(cudaLaunchKernel(lp.kernel.func, grid, dim3(lp.kernel.threads), args,
                              static_cast<std::size_t>(lp.kernel.smem), stream),
             "paged_attention: decode kernel launch");
  check_launch("paged_attention: decode kernel");
  if (plan.partials) {
    // Programmatic dependent launch where the device has it: the reduce kernel is set up
    // while the decode grid runs and waits for it on the device (no launch gap).
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.num_seqs));
    cfg.blockDim = dim3(kDecodeReduceThreads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = lp.dependent_launch ? 1 : 0;
    check_cuda(cudaLaunchKernelExC(&cfg, decode_reduce_kernel_for(p.dtype), args),
               "paged_attention: reduce kernel launch");
    check_launch("paged_attention: reduce kernel");
  }

  if (scratch) scratch->release();
  if (record) raise_recorded_error(record->take(stream), p);
}

}  // namespace pagedattn::cuda_backend
