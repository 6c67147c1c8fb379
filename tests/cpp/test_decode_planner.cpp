// The CUDA decode planner (cpp/src/decode_planner.hpp) is pure host arithmetic: these
// tests pin its plans for the benchmark shapes (BENCHMARKS.md) on H100 and H200 inputs,
// and check the forced choices and the scratch size, on any machine.
//
// Inputs of the two GPUs:
//   - 132 multiprocessors (both; BENCHMARKS.md).
//   - DRAM rate: the backend uses 0.9 x the peak computed from the memory clock and bus
//     width (cuda/device.cu). H100 SXM: 2 x 2619 MHz x 5120 bits = 3.35 TB/s, the peak
//     quoted there; H200: its quoted peak, 4.8 TB/s. The plans are also checked to hold
//     for rates 3% below and above (the H200's clock x bus estimate may differ from the
//     quoted peak by about that much).
//   - CTAs per multiprocessor of the tensor-core kernel at head size 128 with 2-byte
//     caches: 3, as PERF_NOTES.md records ("3 CTAs per SM still fit" at 166-168
//     registers). It agrees with the kernel's sizes: 66,048 bytes of dynamic shared
//     memory (4 warps x 2 stages x 8 KB + 512) plus the 1 KB the hardware reserves per
//     CTA, three times, is 201,216 of the 233,472 bytes of a multiprocessor; 168
//     registers x 128 threads x 3 CTAs = 64,512 of 65,536 registers.
//   - The tensor-core kernel: 128 threads, 16 query heads per CTA; the CUDA-core
//     (float32) kernel: 128 threads, 8 heads.
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "check.hpp"
#include "decode_planner.hpp"

using namespace pagedattn::planner;

namespace {

constexpr int kSms = 132;
constexpr double kH100Bw = 0.9 * 2.0 * 2619.0 * (5120 / 8);  // bytes per us
constexpr double kH200Bw = 0.9 * 4.8e6;
constexpr KernelShape kTensorCore{128, 16, 3};

DecodeShape shape(int S, int H, int K, int D, int ctx, std::size_t elem = 2) {
  DecodeShape s;
  s.num_seqs = S;
  s.num_heads = H;
  s.num_kv_heads = K;
  s.head_size = D;
  s.block_size = 16;
  s.max_blocks_per_seq = (ctx + 15) / 16;
  s.cache_elem_bytes = elem;
  return s;
}

struct Expected {
  const char* name;
  DecodeShape shape;
  int h100_partitions, h100_partition_size;
  int h200_partitions, h200_partition_size;
};

// The benchmark suite: gqa32/8 at batch 1-128 x context 1k-16k (bf16, head 128), the
// OPT-125m and OPT-30B seed shapes and mha32x128 (fp16), all with 16-token blocks.
const Expected kSuite[] = {
    {"gqa32/8 b1 x1024", shape(1, 32, 8, 128, 1024), 16, 64, 16, 64},
    {"gqa32/8 b1 x4096", shape(1, 32, 8, 128, 4096), 16, 256, 16, 256},
    {"gqa32/8 b1 x16384", shape(1, 32, 8, 128, 16384), 16, 1024, 32, 512},
    {"gqa32/8 b8 x1024", shape(8, 32, 8, 128, 1024), 2, 512, 4, 256},
    {"gqa32/8 b8 x4096", shape(8, 32, 8, 128, 4096), 2, 2048, 4, 1024},
    {"gqa32/8 b8 x16384", shape(8, 32, 8, 128, 16384), 2, 8192, 4, 4096},
    {"gqa32/8 b32 x1024", shape(32, 32, 8, 128, 1024), 1, 1024, 1, 1024},
    {"gqa32/8 b32 x4096", shape(32, 32, 8, 128, 4096), 1, 4096, 1, 4096},
    {"gqa32/8 b32 x16384", shape(32, 32, 8, 128, 16384), 1, 16384, 1, 16384},
    {"gqa32/8 b128 x1024", shape(128, 32, 8, 128, 1024), 1, 1024, 1, 1024},
    {"gqa32/8 b128 x4096", shape(128, 32, 8, 128, 4096), 1, 4096, 1, 4096},
    {"gqa32/8 b128 x16384", shape(128, 32, 8, 128, 16384), 2, 8192, 2, 8192},
    {"opt-125m 5x196", shape(5, 12, 12, 64, 196), 1, 208, 1, 208},
    {"opt-30b 1x204", shape(1, 56, 56, 128, 204), 1, 208, 1, 208},
    {"mha32x128 b64 x2048", shape(64, 32, 32, 128, 2048), 1, 2048, 1, 2048},
};

void check_plan(const Expected& e, double bw, int partitions, int partition_size) {
  const DecodePlan p = make_plan(e.shape, kTensorCore, DeviceShape{kSms, bw});
  if (p.num_partitions != partitions || p.partition_size != partition_size)
    PA_FAIL_AT(e.name << " at " << bw << " bytes/us: planned " << p.num_partitions << " x " << p.partition_size
                      << ", expected " << partitions << " x " << partition_size);
  PA_CHECK_EQ(p.partials, partitions > 1);
  PA_CHECK_EQ(p.tiles, 1);  // every suite shape has a group of at most 16 heads
  PA_CHECK(static_cast<std::int64_t>(p.num_partitions) * p.partition_size >=
           static_cast<std::int64_t>(e.shape.max_blocks_per_seq) * e.shape.block_size);
  PA_CHECK_EQ(p.partition_size % kPartitionAlign, 0);
}

}  // namespace

int main() { return pagedattn_test::run_all(); }

PA_TEST(benchmark_plans_on_h100) {
  for (const Expected& e : kSuite) check_plan(e, kH100Bw, e.h100_partitions, e.h100_partition_size);
}

PA_TEST(benchmark_plans_on_h200) {
  for (const Expected& e : kSuite) check_plan(e, kH200Bw, e.h200_partitions, e.h200_partition_size);
}

PA_TEST(benchmark_plans_hold_within_3_percent_of_the_memory_rate) {
  for (const double f : {0.97, 1.03})
    for (const Expected& e : kSuite) {
      check_plan(e, kH100Bw * f, e.h100_partitions, e.h100_partition_size);
      check_plan(e, kH200Bw * f, e.h200_partitions, e.h200_partition_size);
    }
}

PA_TEST(recorded_planner_decisions) {
  // Since the cost-model change of commit f2396f1: b128 x 16384 splits in 2 partitions on
  // both GPUs (the measured best), b1 x 16384 takes 1024 tokens per partition on the H100.
  const DecodeShape big = shape(128, 32, 8, 128, 16384);
  PA_CHECK_EQ(make_plan(big, kTensorCore, {kSms, kH100Bw}).num_partitions, 2);
  PA_CHECK_EQ(make_plan(big, kTensorCore, {kSms, kH200Bw}).num_partitions, 2);
  PA_CHECK_EQ(make_plan(shape(1, 32, 8, 128, 16384), kTensorCore, {kSms, kH100Bw}).partition_size, 1024);
}

PA_TEST(a_slower_cta_gets_more_partitions) {
  // The nhd kernel's CTA streams ~13-17 bytes/ns (token rows), the vllm one's ~26 (whole
  // slabs): where a grid has about one CTA per multiprocessor the nhd plan splits further.
  // H100 sweeps (PERF_NOTES.md): nhd b8 x 16384 in 2 x 8192 took 243-250 us, in 4 x 4096
  // 192-193; vllm about 190-199 either way. On the H200, whose multiprocessors each get a
  // larger share of the bandwidth, two nhd CTAs per multiprocessor do not use it: b32 x 16384
  // single pass 597 us, in 4 x 4096 541. Grids that fill the GPU plan alike.
  const KernelShape nhd{128, 16, 3, 13.0e3};
  const DeviceShape h100{kSms, kH100Bw}, h200{kSms, kH200Bw};
  const DecodePlan b8 = make_plan(shape(8, 32, 8, 128, 16384), nhd, h100);
  PA_CHECK_EQ(b8.num_partitions, 4);
  PA_CHECK_EQ(b8.partition_size, 4096);
  PA_CHECK_EQ(make_plan(shape(8, 32, 8, 128, 16384), kTensorCore, h100).num_partitions, 2);
  PA_CHECK_EQ(make_plan(shape(1, 32, 8, 128, 16384), nhd, h100).partition_size, 512);
  // the suite's GQA shapes of 32 sequences and more (grids of two CTAs or more per
  // multiprocessor) plan on the H100 as with the vllm kernel's rate
  for (const Expected& e : kSuite) {
    if (e.shape.num_seqs < 32 || e.shape.num_heads != 32 || e.shape.num_kv_heads != 8) continue;
    PA_CHECK_EQ(make_plan(e.shape, nhd, h100).num_partitions, make_plan(e.shape, kTensorCore, h100).num_partitions);
  }
  PA_CHECK_EQ(make_plan(shape(32, 32, 8, 128, 16384), kTensorCore, h200).num_partitions, 1);
  PA_CHECK(make_plan(shape(32, 32, 8, 128, 16384), nhd, h200).num_partitions >= 4);
  PA_CHECK_EQ(make_plan(shape(128, 32, 8, 128, 4096), nhd, h200).num_partitions, 1);
  // The nhd kernels of d128 / d256 rows copy from one base and a fixed stride, at 16
  // bytes/ns (PAGEDATTN_NHD_ROW_CTA_BW; H200, both rates' plans timed on one machine):
  // b32 x 4096 and x 16384 single pass as the vllm kernel (132 / 495 us against 135 / 541
  // in 3 / 5 partitions), b8 x 16384 still in 6 (134.5 us, 136.3 in 4); the H100 plans as at 13.
  const KernelShape nhd_rows{128, 16, 3, 16.0e3};
  PA_CHECK_EQ(make_plan(shape(32, 32, 8, 128, 4096), nhd, h200).num_partitions, 3);
  PA_CHECK_EQ(make_plan(shape(32, 32, 8, 128, 4096), nhd_rows, h200).num_partitions, 1);
  PA_CHECK_EQ(make_plan(shape(32, 32, 8, 128, 16384), nhd_rows, h200).num_partitions, 1);
  PA_CHECK_EQ(make_plan(shape(8, 32, 8, 128, 16384), nhd_rows, h200).num_partitions, 6);
  for (const Expected& e : kSuite)
    PA_CHECK_EQ(make_plan(e.shape, nhd_rows, h100).num_partitions, make_plan(e.shape, nhd, h100).num_partitions);
  // an fp8 stage holds half the bytes: half the lone-CTA rate, half the bytes per CTA
  const KernelShape vllm_fp8{128, 16, 3, 13.0e3};
  PA_CHECK_EQ(make_plan(shape(8, 32, 8, 128, 16384, 1), vllm_fp8, h100).num_partitions, 4);
}

PA_TEST(short_contexts_run_single_pass_whatever_the_occupancy) {
  // At most 4 chunks per warp: single pass on any device (the seed shapes' head size 64
  // kernel has its own, unrecorded occupancy, which therefore does not matter).
  for (int slots = 1; slots <= 16; ++slots)
    for (const double bw : {kH100Bw, kH200Bw})
      for (const DecodeShape& s : {shape(5, 12, 12, 64, 196), shape(1, 56, 56, 128, 204), shape(64, 8, 1, 64, 256)}) {
        const DecodePlan p = make_plan(s, KernelShape{128, 16, slots}, DeviceShape{kSms, bw});
        PA_CHECK_EQ(p.num_partitions, 1);
        PA_CHECK(!p.partials);
        PA_CHECK_EQ(p.workspace_bytes(), std::size_t{0});
      }
}

PA_TEST(forced_versions_and_partition_sizes) {
  const DeviceShape h100{kSms, kH100Bw};
  DecodeShape s = shape(1, 32, 8, 128, 4096);
  s.kernel = pagedattn::DecodeKernel::kSinglePass;  // single pass: one partition covering the whole context
  DecodePlan p = make_plan(s, kTensorCore, h100);
  PA_CHECK_EQ(p.num_partitions, 1);
  PA_CHECK_EQ(p.partition_size, 4096);
  PA_CHECK(!p.partials);
  s.kernel = pagedattn::DecodeKernel::kPartitioned;
  s.partition_size = 512;
  p = make_plan(s, kTensorCore, h100);
  PA_CHECK_EQ(p.num_partitions, 8);
  PA_CHECK_EQ(p.partition_size, 512);
  PA_CHECK(p.partials);
  s.partition_size = 8192;  // forced partitioned form even with one partition
  p = make_plan(s, kTensorCore, h100);
  PA_CHECK_EQ(p.num_partitions, 1);
  PA_CHECK(p.partials);
  s.kernel = pagedattn::DecodeKernel::kAuto;  // a partition size alone: partitioned only when it splits the context
  PA_CHECK(!make_plan(s, kTensorCore, h100).partials);
  s.partition_size = 1024;
  PA_CHECK(make_plan(s, kTensorCore, h100).partials);
  s.kernel = pagedattn::DecodeKernel::kPartitioned;  // partitioned, size chosen: at least two partitions
  s.partition_size = 0;
  for (const int S : {1, 32, 128}) {
    s.num_seqs = S;
    const DecodePlan q = make_plan(s, kTensorCore, h100);
    PA_CHECK(q.partials);
    PA_CHECK(q.num_partitions >= 2);
  }
}

PA_TEST(single_pass_partition_rounds_the_context_to_chunks) {
  DecodeShape s = shape(3, 8, 2, 64, 0);
  s.block_size = 8;
  s.max_blocks_per_seq = 5;  // 40 tokens -> one partition of 48
  s.kernel = pagedattn::DecodeKernel::kSinglePass;
  PA_CHECK_EQ(make_plan(s, kTensorCore, {kSms, kH100Bw}).partition_size, 48);
  s.max_blocks_per_seq = 0;  // empty tables: one partition of a chunk per warp
  s.kernel = pagedattn::DecodeKernel::kAuto;
  const DecodePlan p = make_plan(s, kTensorCore, {kSms, kH100Bw});
  PA_CHECK_EQ(p.num_partitions, 1);
  PA_CHECK_EQ(p.partition_size, kPartitionAlign * kTensorCore.threads / 32);
  PA_CHECK(!p.partials);
}

PA_TEST(head_tiles_follow_the_kernel_rows) {
  const DeviceShape h100{kSms, kH100Bw};
  PA_CHECK_EQ(make_plan(shape(1, 64, 2, 128, 1024), kTensorCore, h100).tiles, 2);        // G = 32, 16 rows
  PA_CHECK_EQ(make_plan(shape(1, 64, 2, 128, 1024), KernelShape{128, 8, 4}, h100).tiles, 4);  // 8 rows
  PA_CHECK_EQ(make_plan(shape(1, 40, 2, 128, 1024), KernelShape{128, 8, 4}, h100).tiles, 3);  // G = 20
  PA_CHECK_EQ(make_plan(shape(1, 8, 8, 128, 1024), kTensorCore, h100).tiles, 1);         // MHA
}

PA_TEST(workspace_holds_the_partials_and_their_statistics) {
  DecodeShape s = shape(3, 8, 2, 80, 1000);
  s.kernel = pagedattn::DecodeKernel::kPartitioned;
  s.partition_size = 64;
  const DecodePlan p = make_plan(s, kTensorCore, {kSms, kH200Bw});
  PA_CHECK_EQ(p.num_partitions, 16);  // 63 blocks of 16 = 1008 tokens
  const std::size_t rows = 3 * 8 * 16;
  PA_CHECK_EQ(p.out_bytes, rows * 80 * sizeof(float));
  PA_CHECK_EQ(p.stat_bytes, rows * sizeof(float));
  auto align = [](std::size_t v) { return (v + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; };
  PA_CHECK_EQ(p.max_offset(), align(p.out_bytes));
  PA_CHECK_EQ(p.sum_offset(), align(p.out_bytes) + align(p.stat_bytes));
  PA_CHECK_EQ(p.workspace_bytes(), align(p.out_bytes) + 2 * align(p.stat_bytes));
  PA_CHECK_EQ(p.max_offset() % kWorkspaceAlign, std::size_t{0});
  PA_CHECK_EQ(p.sum_offset() % kWorkspaceAlign, std::size_t{0});
}

PA_TEST(plan_model_charges_rounds_and_the_reduce) {
  const PlanModel m{kSms, 3, kH100Bw, 4.0 * 16 * 130};
  // one round of one CTA per multiprocessor against two rounds
  PA_CHECK(m.us(2 * 4 * kSms, 65536.0, false) > m.us(kSms, 65536.0, false));
  // the partitioned form pays for the reduce and its traffic
  PA_CHECK(m.us(kSms, 65536.0, true) > m.us(kSms, 65536.0, false) + 2.9);
  // a lone CTA is limited to its own pull rate, not the device's bandwidth
  PA_CHECK(m.us(1, 26.0e3 * 10.0, false) > 10.0);
}

PA_TEST(a_short_last_round_is_split) {
  // Grids of one to three rounds of CTAs whose last round has at most one CTA per
  // multiprocessor: those stream alone at the lone-CTA rate. H200, vllm bf16 (3 slots, 396
  // CTAs a round), us single pass / split (PERF_NOTES.md, "Decode: grids of a round and a
  // bit"): b56 x4096 290 / 237 (3), b64 x4096 295 / 264 (2), b112 x4096 469 / 449 (2),
  // b64 x2048 155 / 140 (2). Single pass stays where it measured best: last rounds of more
  // than a CTA per multiprocessor (b80 x4096, b128 x2048) and grids of three rounds or more
  // (b160 x2048).
  const DeviceShape h200{kSms, kH200Bw}, h100{kSms, kH100Bw};
  PA_CHECK_EQ(make_plan(shape(56, 32, 8, 128, 4096), kTensorCore, h200).num_partitions, 3);
  PA_CHECK_EQ(make_plan(shape(64, 32, 8, 128, 4096), kTensorCore, h200).num_partitions, 2);
  PA_CHECK_EQ(make_plan(shape(112, 32, 8, 128, 4096), kTensorCore, h200).num_partitions, 2);
  PA_CHECK_EQ(make_plan(shape(64, 32, 8, 128, 2048), kTensorCore, h200).num_partitions, 2);
  for (const int S : {48, 80, 96})
    PA_CHECK_EQ(make_plan(shape(S, 32, 8, 128, 4096), kTensorCore, h200).num_partitions, 1);
  for (const int S : {96, 128, 160})
    PA_CHECK_EQ(make_plan(shape(S, 32, 8, 128, 2048), kTensorCore, h200).num_partitions, 1);
  // On the H100 a multiprocessor's share of the bandwidth (23 bytes/ns) is below a vllm
  // CTA's lone rate, so a lone CTA loses little: single pass as before.
  PA_CHECK_EQ(make_plan(shape(64, 32, 8, 128, 4096), kTensorCore, h100).num_partitions, 1);
  // The model: the same bytes in a grid of a round and a few CTAs cost more than the
  // bandwidth-bound time of those few CTAs' bytes; a full last round adds nothing.
  const PlanModel m{kSms, 3, kH200Bw, 26.0e3, 0.0};
  const double b = 2.0e6;
  PA_CHECK(m.us(3 * kSms + 10, b, false) - m.us(3 * kSms, b, false) > 0.9 * (b / 26.0e3 - 10 * b / kH200Bw));
  PA_CHECK(m.us(6 * kSms, b, false) - m.us(3 * kSms, b, false) < 1.1 * (3 * kSms * b / kH200Bw) + 20.0);
}

PA_TEST(sliding_window_plans_for_the_window_not_the_context) {
  // A 4096-token window over 32k contexts: the CTAs stream at most W + 15 tokens from the
  // window's chunk-aligned start, so the plan is that of a W + 16 token context.
  for (int S : {1, 8, 64}) {
    DecodeShape windowed = shape(S, 32, 8, 128, 32768);
    windowed.sliding_window = 4096;
    const DecodeShape ctx = shape(S, 32, 8, 128, 4096 + 16);
    const DecodePlan a = make_plan(windowed, kTensorCore, {kSms, kH100Bw});
    const DecodePlan b = make_plan(ctx, kTensorCore, {kSms, kH100Bw});
    PA_CHECK_EQ(a.num_partitions, b.num_partitions);
    PA_CHECK_EQ(a.partition_size, b.partition_size);
    PA_CHECK_EQ(a.workspace_bytes(), b.workspace_bytes());
    PA_CHECK(static_cast<std::int64_t>(a.num_partitions) * a.partition_size >= 4096 + 15);
  }
  // a window wider than the context changes nothing; forced single pass covers the window
  DecodeShape wide = shape(4, 32, 8, 128, 2048);
  const DecodePlan plain = make_plan(wide, kTensorCore, {kSms, kH100Bw});
  wide.sliding_window = 2147483647;
  PA_CHECK_EQ(make_plan(wide, kTensorCore, {kSms, kH100Bw}).partition_size, plain.partition_size);
  DecodeShape single = shape(4, 32, 8, 128, 32768);
  single.sliding_window = 1000;
  single.kernel = pagedattn::DecodeKernel::kSinglePass;
  const DecodePlan sp = make_plan(single, kTensorCore, {kSms, kH100Bw});
  PA_CHECK_EQ(sp.num_partitions, 1);
  PA_CHECK_EQ(sp.partition_size, 1024);  // 1000 + 16 rounded up to chunks
}

PA_TEST(fp8_full_width_where_the_grid_fills_the_slots_once) {
  // The transposed fp8 kernels at their full width: 256 threads, 8 heads per CTA, 2 CTAs per
  // multiprocessor, twice the lone-CTA rate of 4 warps (vllm: 26 bytes/ns). H200 inputs.
  constexpr KernelShape kFp8Full{256, 8, 2, 26.0e3};
  struct Case {
    const char* name;
    DecodeShape shape;
    bool full;
  };
  const Case cases[] = {
      // one round of 2 CTAs on (nearly) every multiprocessor, 2048-16384 tokens per CTA
      {"gqa32/8 b32 x4096", shape(32, 32, 8, 128, 4096, 1), true},
      {"gqa32/8 b8 x16384", shape(8, 32, 8, 128, 16384, 1), true},
      {"gqa32/8 b16 x16384", shape(16, 32, 8, 128, 16384, 1), true},
      {"gqa32/8 b32 x16384", shape(32, 32, 8, 128, 16384, 1), true},
      {"mha32 b8 x2048", shape(8, 32, 32, 128, 2048, 1), true},
      // several rounds
      {"gqa32/8 b64 x4096", shape(64, 32, 8, 128, 4096, 1), false},
      {"gqa32/8 b128 x512", shape(128, 32, 8, 128, 512, 1), false},
      // at most one CTA per multiprocessor
      {"gqa32/8 b1 x4096", shape(1, 32, 8, 128, 4096, 1), false},
      // the slots filled, but 512 tokens per CTA: 4 chunks per warp
      {"gqa32/8 b1 x16384", shape(1, 32, 8, 128, 16384, 1), false},
  };
  for (const Case& c : cases) {
    for (double bw : {kH200Bw, 0.97 * kH200Bw, 1.03 * kH200Bw}) {
      const DecodePlan plan = make_plan(c.shape, kFp8Full, {kSms, bw});
      if (keep_full_width(c.shape, plan, kFp8Full, kSms) != c.full)
        PA_FAIL_AT(c.name << " at " << bw << " bytes/us: expected the " << (c.full ? "full" : "narrow") << " width");
    }
  }
  // the bounds of the rule: grids of exactly slots x SMs and (slots - 1) x SMs + 1 CTAs keep
  // it; (slots - 1) x SMs and one more than slots x SMs do not; 1023 tokens per CTA do not
  DecodePlan one;
  one.num_partitions = 1;
  one.partition_size = 1024;
  const std::pair<int, bool> bounds[] = {{33, true}, {17, true}, {16, false}, {34, false}};
  for (const auto& [S, full] : bounds) {
    const DecodeShape s = shape(S, 32, 8, 128, 1024, 1);  // S x 8 CTAs: 264, 136, 128, 272
    PA_CHECK_EQ(keep_full_width(s, one, kFp8Full, kSms), full);
  }
  DecodeShape s = shape(33, 32, 8, 128, 1008, 1);
  one.partition_size = 1008;
  PA_CHECK(!keep_full_width(s, one, kFp8Full, kSms));
}
