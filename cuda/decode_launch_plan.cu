// Launch plans of decode calls (cuda/decode_launch_plan.cuh): the device and kernel
// inputs of the host planner, and the per-thread plan cache.
#include "cuda/decode_launch_plan.cuh"

#include <cstdlib>

#include "cuda/decode_dispatch.cuh"
#include "cuda/device.cuh"

namespace pagedattn::cuda_backend {
namespace {

// The inputs of make_launch_plan: everything host-known that the plan depends on.
struct PlanKey {
  int device, head_size, num_seqs, num_heads, num_kv_heads, max_blocks_per_seq, block_size, partition_size,
      sliding_window;
  DecodeKernel kernel;
  DType dtype;
  KVCacheDType kv_cache_dtype;
  CacheLayout layout;
  bool operator==(const PlanKey& o) const {
    return device == o.device && head_size == o.head_size && num_seqs == o.num_seqs && num_heads == o.num_heads &&
           num_kv_heads == o.num_kv_heads && max_blocks_per_seq == o.max_blocks_per_seq &&
           block_size == o.block_size && kernel == o.kernel && partition_size == o.partition_size &&
           dtype == o.dtype && kv_cache_dtype == o.kv_cache_dtype && layout == o.layout &&
           sliding_window == o.sliding_window;
  }
};

}  // namespace

LaunchPlan make_launch_plan(const DecodeParams& p) {
  LaunchPlan lp;
  lp.kernel = select_kernel(p);
  // PAGEDATTN_NO_PDL=1 turns programmatic dependent launch off (for A/B measurements).
  static const bool pdl_off = [] {
    const char* e = std::getenv("PAGEDATTN_NO_PDL");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }();
  const DeviceInfo& dev = device_info(p.device_id);
  lp.dependent_launch = !pdl_off && dev.cc_major >= 9;

  planner::DecodeShape shape;
  shape.num_seqs = p.num_seqs;
  shape.num_heads = p.num_heads;
  shape.num_kv_heads = p.num_kv_heads;
  shape.head_size = p.head_size;
  shape.block_size = p.block_size;
  shape.max_blocks_per_seq = p.max_blocks_per_seq;
  shape.cache_elem_bytes = cache_elem_size(p.dtype, p.kv_cache_dtype);
  shape.kernel = p.kernel;
  shape.partition_size = p.partition_size;
  shape.sliding_window = p.sliding_window;
  // The narrow form of a kernel with two widths, in place (its lone-CTA rate scaled down)
  auto to_narrow = [](DecodeKernelInfo& k) {
    k.cta_bw *= static_cast<double>(k.narrow_threads) / k.threads;
    k.threads = k.narrow_threads;
    k.smem = k.narrow_smem;
    k.narrow_threads = k.narrow_smem = 0;
  };
  // A full width whose shared memory the device cannot give one block (the fp8 kernels of
  // head sizes 192 and 256 at 8 warps, 96-128 KB, on GPUs of about 100 KB per block) leaves
  // the narrow width alone.
  if (lp.kernel.narrow_threads > 0 && lp.kernel.smem > dev.max_smem_per_block) to_narrow(lp.kernel);
  planner::KernelShape kernel;
  kernel.threads = lp.kernel.threads;
  kernel.rows = lp.kernel.rows;
  kernel.slots_per_sm = kernel_slots_per_sm(lp.kernel, p.device_id);
  kernel.cta_bw = lp.kernel.cta_bw;
  planner::DeviceShape device;
  device.num_sms = dev.num_sms;
  device.mem_bw = dev.mem_bw;
  lp.plan = planner::make_plan(shape, kernel, device);
  // Kernels with narrow CTAs (the transposed fp8 ones): the full width where its grid fills
  // every multiprocessor's slots in one round with 8 chunks or more per warp (b32 x4096,
  // b8-b32 x16384, MHA b8 x2048 on an H200: 5-11% faster than CTAs of half the width); other
  // grids narrow (b128 x512 17-20% and b64 / b128 x4096 1-1.5% faster so; grids of 1-4 chunks
  // per warp, b1 x4096, b8 x1024 and b4 x4096 nhd, 6-15%).
  if (lp.kernel.narrow_threads > 0 && !planner::keep_full_width(shape, lp.plan, kernel, dev.num_sms)) {
    kernel.slots_per_sm = kernel_slots_per_sm(lp.kernel, p.device_id, true);  // lp.kernel still full width
    to_narrow(lp.kernel);
    kernel.threads = lp.kernel.threads;
    kernel.cta_bw = lp.kernel.cta_bw;
    lp.plan = planner::make_plan(shape, kernel, device);
  }
  return lp;
}

const LaunchPlan& cached_launch_plan(const DecodeParams& p) {
  constexpr int kSlots = 8;
  struct Entry {
    PlanKey key;
    LaunchPlan plan;
    bool used = false;
  };
  thread_local Entry entries[kSlots];
  thread_local int next = 0;
  const PlanKey key{p.device_id,  p.head_size, p.num_seqs,       p.num_heads, p.num_kv_heads,   p.max_blocks_per_seq,
                    p.block_size, p.partition_size, p.sliding_window, p.kernel, p.dtype, p.kv_cache_dtype,
                    p.layout};
  for (Entry& e : entries)
    if (e.used && e.key == key) return e.plan;
  Entry& e = entries[next];
  e.plan = make_launch_plan(p);  // may throw: the slot stays as it was
  e.key = key;
  e.used = true;
  next = (next + 1) % kSlots;
  return e.plan;
}

}  // namespace pagedattn::cuda_backend
