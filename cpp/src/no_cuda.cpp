// Built only without the CUDA backend: the CUDA entry points refuse clearly. (The
// validation pass already refuses CUDA arrays in such a build; these are a second
// line of defence for direct callers.)
#include "cuda_backend.hpp"
#include "pagedattn/attention.hpp"

namespace pagedattn {
namespace cuda_backend {

int device_count() noexcept { return 0; }

void paged_attention(const DecodeParams&, void*) {
  fail<NotSupported>("paged_attention: this build of pagedattn has no CUDA backend (built without nvcc)");
}
void reshape_and_cache(const CacheWriteParams&, void*) {
  fail<NotSupported>("reshape_and_cache: this build of pagedattn has no CUDA backend (built without nvcc)");
}
std::size_t decode_workspace_bytes(const DecodeParams&) {
  fail<NotSupported>("decode_workspace_size: this build of pagedattn has no CUDA backend (built without nvcc)");
}
DecodePlanInfo decode_plan_info(const DecodeParams&) {
  fail<NotSupported>("decode_plan: this build of pagedattn has no CUDA backend (built without nvcc)");
}
void copy_blocks(const CopyBlocksParams&, void*) {
  fail<NotSupported>("copy_blocks: this build of pagedattn has no CUDA backend (built without nvcc)");
}
void swap_blocks(const SwapBlocksParams&, void*) {
  fail<NotSupported>("swap_blocks: this build of pagedattn has no CUDA backend (built without nvcc)");
}

}  // namespace cuda_backend
}  // namespace pagedattn
