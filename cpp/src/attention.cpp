// Public entry points: validate once (validate.cpp), then route to the CPU or the CUDA
// backend.
#include "pagedattn/attention.hpp"

#include <cstring>
#include <string>

#include "cpu_backend.hpp"
#include "cuda_backend.hpp"
#include "device_checks.hpp"
#include "thread_pool.hpp"
#include "validate.hpp"

namespace pagedattn {

bool built_with_cuda() noexcept {
#ifdef PAGEDATTN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cpu_num_threads() { return cpu::num_threads(); }

const char* decode_kernel_name(DecodeKernel k) noexcept {
  switch (k) {
    case DecodeKernel::kAuto: return "auto";
    case DecodeKernel::kSinglePass: return "single_pass";
    case DecodeKernel::kPartitioned: return "partitioned";
  }
  return "unknown";
}

DecodeKernel parse_decode_kernel(const char* s, const char* arg) {
  for (DecodeKernel k : {DecodeKernel::kAuto, DecodeKernel::kSinglePass, DecodeKernel::kPartitioned})
    if (std::strcmp(s, decode_kernel_name(k)) == 0) return k;
  fail<InvalidArgument>(arg, ": got \"", s, "\", expected \"auto\", \"single_pass\" or \"partitioned\"");
}

namespace {

void launch(const DecodeParams& p, DeviceKind device, void* stream) {
  if (p.num_seqs == 0) return;
  if (device == DeviceKind::kCUDA)
    cuda_backend::paged_attention(p, stream);
  else if (p.query_start_loc && !(p.max_query_len == 1 && p.num_tokens == p.num_seqs))
    cpu::paged_attention_varlen(p);  // (validated: max_query_len = 1 and T = S is one row per sequence)
  else
    cpu::paged_attention(p);
}

// Rethrows the error of `f` with the query's name in front (same type).
template <class F>
auto named(const char* what, F f) {
  try {
    return f();
  } catch (const NotSupported& e) {
    throw NotSupported(detail::concat(what, ": ", e.what()));
  } catch (const TypeMismatch& e) {
    throw TypeMismatch(detail::concat(what, ": ", e.what()));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(detail::concat(what, ": ", e.what()));
  }
}

// The sizes of a query are checked as paged_attention checks them, then against the
// devices this process can use. Errors name the query.
DecodeParams query_params(const char* what, const DecodeShape& shape, const AttentionOptions& options) {
  return named(what, [&] {
    check_decode_shape(shape, DeviceKind::kCUDA, options);
    const DecodeParams p = decode_params_of(shape, options);
    detail::check_cuda_decode_limits(p, nullptr);
    if (!built_with_cuda())
      fail<NotSupported>("this build of pagedattn has no CUDA backend (built without nvcc)");
    const int devices = cuda_backend::device_count();
    if (shape.device_id < 0 || shape.device_id >= devices)
      fail<NotSupported>("device: ", shape.device_id, " is not a usable CUDA device (",
                         devices == 0 ? std::string("no CUDA device or driver is available")
                                      : detail::concat(devices, " device(s) visible"),
                         ")");
    return p;
  });
}

}  // namespace

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables, const TensorView& seq_lens,
                     const AttentionOptions& options) {
  launch(make_decode_params(out, query, key_cache, value_cache, block_tables, seq_lens, options), query.device,
         options.stream);
}

struct PreparedDecode::State {
  DecodeParams params;
  DeviceKind device;
  void* stream;
};

PreparedDecode::PreparedDecode(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                               const TensorView& value_cache, const TensorView& block_tables,
                               const TensorView& seq_lens, const AttentionOptions& options)
    : state_(new State{make_decode_params(out, query, key_cache, value_cache, block_tables, seq_lens, options),
                       query.device, options.stream}) {}
PreparedDecode::~PreparedDecode() = default;
PreparedDecode::PreparedDecode(PreparedDecode&&) noexcept = default;
PreparedDecode& PreparedDecode::operator=(PreparedDecode&&) noexcept = default;

void PreparedDecode::run() const { run(state_->stream); }

void PreparedDecode::run(void* stream) const {
  const State& s = *state_;
  if (s.device != DeviceKind::kCUDA) check_decode_indices(s.params);
  launch(s.params, s.device, stream);
}

DeviceKind PreparedDecode::device() const noexcept { return state_->device; }

std::size_t decode_workspace_size(const DecodeShape& shape, const AttentionOptions& options) {
  return cuda_backend::decode_workspace_bytes(query_params("decode_workspace_size", shape, options));
}

DecodePlanInfo decode_plan(const DecodeShape& shape, const AttentionOptions& options) {
  return cuda_backend::decode_plan_info(query_params("decode_plan", shape, options));
}

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       const CacheWriteOptions& options) {
  const CacheWriteParams p = make_cache_write_params(key, value, key_cache, value_cache, slot_mapping, options);
  if (p.num_tokens == 0) return;
  if (key.device == DeviceKind::kCUDA)
    cuda_backend::reshape_and_cache(p, options.stream);
  else
    cpu::reshape_and_cache(p);
}

}  // namespace pagedattn
