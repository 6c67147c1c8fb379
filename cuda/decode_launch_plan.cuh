// A decode call's launch plan: the kernel chosen for it, the planner's decisions
// (cpp/src/decode_planner.hpp) for that kernel on this device, and whether the reduce
// uses programmatic dependent launch.
#pragma once

#include "cuda/decode_inst.cuh"
#include "decode_planner.hpp"
#include "params.hpp"

namespace pagedattn::cuda_backend {

struct LaunchPlan {
  DecodeKernelInfo kernel;
  planner::DecodePlan plan;
  bool dependent_launch = false;  // launch the reduce with programmatic stream serialisation
};

// The plan of p on p.device_id (the current device).
LaunchPlan make_launch_plan(const DecodeParams& p);

// make_launch_plan through a small per-thread cache keyed by every host-known input of
// the plan (a serving loop repeats the same few shapes; the search costs a few us).
const LaunchPlan& cached_launch_plan(const DecodeParams& p);

}  // namespace pagedattn::cuda_backend
