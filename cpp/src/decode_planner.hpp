// The decode planner: how a CUDA decode call is cut into CTAs (single pass or partitioned
// with a reduce, the partition size, the head tiles) and how much scratch that needs.
// Pure host arithmetic on plain numbers: no CUDA types, compiled in every build, so its
// decisions are unit-tested on any machine (tests/cpp/test_decode_planner.cpp). The CUDA
// backend (cuda/decode_plan.cu) fills the inputs from the device and the chosen kernel.
//
// Dimension legend: see params.hpp (S seqs, H query heads, K KV heads, G = H / K,
// D head size, B block size, M max blocks per seq, NP partitions).
#pragma once

#include <cstddef>
#include <cstdint>

#include "pagedattn/attention.hpp"

namespace pagedattn::planner {

// Partition sizes are multiples of one warp chunk of tokens.
inline constexpr int kPartitionAlign = 16;
// Each piece of the partitioned scratch starts on this many bytes.
inline constexpr std::size_t kWorkspaceAlign = 256;

// The host-known sizes of one decode call (never the contents of seq_lens or tables).
struct DecodeShape {
  int num_seqs = 0;            // S
  int num_heads = 0;           // H
  int num_kv_heads = 0;        // K
  int head_size = 0;           // D
  int block_size = 0;          // B
  int max_blocks_per_seq = 0;  // M: the context planned for is M * B tokens
  std::size_t cache_elem_bytes = 0;  // bytes of one cached key or value element
  DecodeKernel kernel = DecodeKernel::kAuto;
  int partition_size = 0;  // tokens per partition when forced; 0 = choose. A multiple of
                           // kPartitionAlign (the validator refuses others)
  int sliding_window = 0;  // W > 0: a CTA streams at most W + kPartitionAlign - 1 tokens (the
                           // window from its chunk-aligned base), so the plan is for that context
};

// The decode kernel that will run.
struct KernelShape {
  int threads = 0;       // per CTA (a multiple of 32)
  int rows = 0;          // query heads of one KV head's group per CTA (a head tile)
  int slots_per_sm = 1;  // CTAs of this kernel resident on one multiprocessor at once
  double cta_bw = 26.0e3;  // bytes per us one CTA pulls alone (its copies in flight over the
                           // memory latency; fitted per kernel family, see PlanModel)
};

// The device.
struct DeviceShape {
  int num_sms = 0;    // multiprocessors
  double mem_bw = 0;  // bytes per microsecond a decode can expect from DRAM
};

struct DecodePlan {
  int tiles = 1;           // head tiles per KV head: ceil(G / rows)
  int num_partitions = 1;  // NP, for the longest context M * B
  int partition_size = 0;  // tokens per partition
  bool partials = false;   // partitioned form: partial results in scratch + reduce kernel
  std::size_t out_bytes = 0, stat_bytes = 0;  // [S, H, NP, D] and [S, H, NP] floats
  // Scratch bytes: partial outputs, then max logits, then exp-sums, each aligned.
  std::size_t workspace_bytes() const;
  // Byte offsets of the max logits and the exp-sums inside the scratch.
  std::size_t max_offset() const;
  std::size_t sum_offset() const;
  // CTAs of the decode grid: (partition, KV head x head tile, sequence)
  std::int64_t ctas(int num_seqs, int num_kv_heads) const {
    return static_cast<std::int64_t>(num_seqs) * num_kv_heads * tiles * num_partitions;
  }
};

// Modelled time (us) of one decode whose grid is `ctas` CTAs, each streaming
// `cta_bytes`. Memory is shared evenly by the active multiprocessors; the busiest one
// runs c = ceil(ctas / sms) CTAs, at most `slots` at a time, and one CTA pulls at most
// ~26 bytes/ns (its warps' copies in flight over the memory latency), so a grid with
// fewer CTAs than multiprocessors does not get the whole bandwidth (KernelShape::cta_bw, per
// kernel: ~13 bytes/ns for the nhd kernel, whose copies are token rows rather than whole
// slabs; 13 for vllm fp8 and 8.5 for nhd fp8, whose stages hold half the bytes). When the CTAs run in
// several rounds (c > slots), the busiest multiprocessor's extra work over the average
// (c - ctas / sms) costs only slots / c of its streaming time: multiprocessors that run
// out of CTAs early leave their share of the bandwidth to the others. Fixed costs: ~1.5 us
// per CTA of the busiest multiprocessor (its start and final merge are not fully hidden)
// and ~1 us per round of resident CTAs; when CTAs run in several rounds they end at
// staggered times and the last ones drain alone (~0.2 CTA lifetimes at the per-CTA
// rate); the partitioned form pays ~3 us for the reduce plus the partials written and
// read back. The constants were fitted to partition sweeps of every benchmark shape on
// an H100 and an H200 (.ci/plan_sweep.py): the plan is within 2% of the best measured.
struct PlanModel {
  int sms, slots;
  double bw;          // bytes per us for the whole device
  double cta_bw;      // bytes per us one CTA can pull
  double part_bytes;  // partial-result bytes one CTA writes (and the reduce reads)
  double us(std::int64_t ctas, double cta_bytes, bool partials) const;
};

// The plan of one call. Deterministic in its inputs.
DecodePlan make_plan(const DecodeShape& shape, const KernelShape& kernel, const DeviceShape& device);

// Kernels that run at two widths (the transposed fp8 decode kernels: CTAs of 8 warps, or of
// 4 with twice the CTAs per multiprocessor): whether a call keeps the full width, given the
// full width's kernel shape and its plan. It does where the grid fills every
// multiprocessor's CTA slots in one round (more than slots - 1 CTAs per multiprocessor on
// average, at most slots) and each warp has 8 chunks or more; other calls run narrow
// (measured on an H200: PERF_NOTES.md, "fp8 CTAs of 8 warps").
bool keep_full_width(const DecodeShape& shape, const DecodePlan& plan, const KernelShape& kernel, int num_sms);

}  // namespace pagedattn::planner
