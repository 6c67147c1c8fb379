#include "decode_planner.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pagedattn::planner {
namespace {

std::size_t align_up(std::size_t v) { return (v + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

std::int64_t round_to_chunks(std::int64_t v) { return (v + kPartitionAlign - 1) / kPartitionAlign * kPartitionAlign; }

}  // namespace

std::size_t DecodePlan::workspace_bytes() const {
  return partials ? align_up(out_bytes) + 2 * align_up(stat_bytes) : 0;
}
std::size_t DecodePlan::max_offset() const { return align_up(out_bytes); }
std::size_t DecodePlan::sum_offset() const { return align_up(out_bytes) + align_up(stat_bytes); }

double PlanModel::us(std::int64_t ctas, double cta_bytes, bool partials) const {
  constexpr double kCtaUs = 1.5, kRoundUs = 1.0, kTail = 0.2, kReduceUs = 3.0;
  const std::int64_t c = (ctas + sms - 1) / sms;
  const double active = static_cast<double>(std::min<std::int64_t>(ctas, sms));
  const double rate = std::min(static_cast<double>(std::min<std::int64_t>(c, slots)) * cta_bw, bw / active);
  double streamed = static_cast<double>(c);  // CTAs' worth of bytes the busiest multiprocessor waits for
  if (c > slots) {
    const double mean = static_cast<double>(ctas) / sms;
    streamed = mean + (static_cast<double>(c) - mean) * slots / static_cast<double>(c);
  }
  double t = streamed * cta_bytes / rate + static_cast<double>(c) * kCtaUs +
             kRoundUs * static_cast<double>((c + slots - 1) / slots);
  if (c > slots) t += kTail * cta_bytes / cta_bw;
  // A grid of one to three rounds whose last round is short: the CTAs of the full rounds
  // end together, and the r left (at most one per multiprocessor) then stream alone, at
  // min(cta_bw, bw / r) each, instead of sharing the memory with the others. What that costs
  // beyond the bandwidth-bound time of their bytes is added, on top of the drain term above
  // that every grid of several rounds pays (H200, bf16, both layouts: b56 /
  // b64 / b112 x4096 single pass 290 / 295 / 469 us, partitioned 231 / 255 / 437;
  // PERF_NOTES.md, "Decode: grids of a round and a bit"). From three rounds on, the rounds
  // have drifted apart and the tail is spread (b160 x2048 single pass is as fast as any split).
  const std::int64_t wave = static_cast<std::int64_t>(sms) * slots;
  const std::int64_t r = ctas % wave;
  if (ctas > wave && ctas < 3 * wave && r != 0 && r <= sms) {
    const double lone = std::min(cta_bw, bw / static_cast<double>(r));
    t += std::max(0.0, cta_bytes / lone - static_cast<double>(r) * cta_bytes / bw);
  }
  if (partials) t += kReduceUs + 2.0 * static_cast<double>(ctas) * part_bytes / bw;
  return t;
}

DecodePlan make_plan(const DecodeShape& p, const KernelShape& kernel, const DeviceShape& device) {
  DecodePlan plan;
  const int G = p.num_heads / p.num_kv_heads;
  plan.tiles = (G + kernel.rows - 1) / kernel.rows;
  const std::int64_t base = static_cast<std::int64_t>(p.num_seqs) * p.num_kv_heads * plan.tiles;
  std::int64_t ctx = std::max<std::int64_t>(static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size, 1);
  if (p.sliding_window > 0)  // the kernels lay the partitions from the window's chunk-aligned start
    ctx = std::min<std::int64_t>(ctx, static_cast<std::int64_t>(p.sliding_window) + kPartitionAlign);

  std::int64_t psize = 0;
  if (p.kernel == DecodeKernel::kSinglePass) {
    psize = round_to_chunks(ctx);
  } else if (p.partition_size != 0) {
    psize = p.partition_size;
    plan.partials = p.kernel == DecodeKernel::kPartitioned || psize < ctx;
  } else {
    const double bytes_per_token = 2.0 * p.head_size * static_cast<double>(p.cache_elem_bytes);
    const PlanModel model{device.num_sms, kernel.slots_per_sm, device.mem_bw, kernel.cta_bw,
                          4.0 * std::min(G, kernel.rows) * (p.head_size + 2)};
    const int min_np = p.kernel == DecodeKernel::kPartitioned && ctx > kPartitionAlign ? 2 : 1;
    const int max_np = static_cast<int>(std::max<std::int64_t>(min_np, std::min<std::int64_t>(ctx / 64, 512)));
    double best = INFINITY;
    psize = round_to_chunks(ctx);
    // every warp of a CTA gets at least one chunk of its partition
    const std::int64_t min_ps = static_cast<std::int64_t>(kPartitionAlign) * (kernel.threads / 32);
    // Short contexts (at most 4 chunks per warp) run single pass: writing and merging
    // partials costs more than the parallelism gains (OPT-125m 5 x 196 and OPT-30B 1 x 204
    // on an H100: 10.4 vs 11.3 us and 11.6 vs 13.4 us).
    const int np_limit = ctx <= 4 * min_ps ? min_np : max_np;
    for (int np = min_np; np <= np_limit; ++np) {
      const std::int64_t ps = std::max(min_ps, round_to_chunks((ctx + np - 1) / np));
      const std::int64_t np_eff = (ctx + ps - 1) / ps;
      if (np_eff < min_np) continue;
      const double t = model.us(base * np_eff, static_cast<double>(std::min(ps, ctx)) * bytes_per_token, np_eff > 1);
      if (t < best * 0.995) {  // prefer fewer partitions on near ties
        best = t;
        psize = ps;
      }
    }
    plan.partials = p.kernel == DecodeKernel::kPartitioned || psize < ctx;
  }
  if (psize > std::numeric_limits<int>::max() / 2) psize = std::numeric_limits<int>::max() / 2;
  plan.partition_size = static_cast<int>(psize);
  plan.num_partitions = static_cast<int>((ctx + psize - 1) / psize);
  if (plan.partials) {
    const auto rows = static_cast<std::size_t>(p.num_seqs) * static_cast<std::size_t>(p.num_heads) *
                      static_cast<std::size_t>(plan.num_partitions);
    plan.out_bytes = rows * static_cast<std::size_t>(p.head_size) * sizeof(float);
    plan.stat_bytes = rows * sizeof(float);
  }
  return plan;
}

bool keep_full_width(const DecodeShape& p, const DecodePlan& plan, const KernelShape& kernel, int num_sms) {
  const std::int64_t ctas = plan.ctas(p.num_seqs, p.num_kv_heads);
  const std::int64_t full = static_cast<std::int64_t>(kernel.slots_per_sm) * num_sms;
  const std::int64_t cta_tokens = std::min<std::int64_t>(
      plan.partition_size, static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size);
  return ctas > full - num_sms && ctas <= full && cta_tokens >= 8 * kPartitionAlign * (kernel.threads / 32);
}

}  // namespace pagedattn::planner
