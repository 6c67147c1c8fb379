// Built only without the CUDA backend: the CUDA entry points refuse clearly. (The
// validation pass already refuses CUDA arrays in such a build; these are a second
// line of defence for direct callers.)
#include "cuda/launch.hpp"
#include "pagedattn/attention.hpp"

namespace pagedattn {
namespace cuda_backend {

void paged_attention(const DecodeParams&, void*) {
  fail<NotSupported>("paged_attention: this build of pagedattn has no CUDA backend (built without nvcc)");
}
void reshape_and_cache(const CacheWriteParams&, void*) {
  fail<NotSupported>("reshape_and_cache: this build of pagedattn has no CUDA backend (built without nvcc)");
}

}  // namespace cuda_backend
}  // namespace pagedattn
