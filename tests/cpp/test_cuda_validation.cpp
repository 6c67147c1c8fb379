// The CUDA decode kernels' host-knowable limits (cache and workspace alignment, the
// sequence count, the partition size) are part of the one validation pass: these tests
// call make_decode_params with views on a CUDA device, on any machine. Validation never
// dereferences device memory, so the views carry made-up, well separated addresses.
#include <cstdint>
#include <string>

#include <pagedattn/pagedattn.hpp>

#include "check.hpp"

using namespace pagedattn;

namespace {

// Address of made-up device array i: 4 GiB apart, so no two overlap.
char* fake(int i) { return reinterpret_cast<char*>(static_cast<std::uintptr_t>(i + 1) << 32); }

struct CudaCall {
  std::int64_t S = 2, H = 8, K = 2, D = 128, B = 16, M = 4, N = 16;
  std::int64_t key_offset = 0, value_offset = 0, workspace_offset = 0;  // bytes
  TensorView out() const { return make_view(fake(0), DType::kBFloat16, {S, H, D}, DeviceKind::kCUDA); }
  TensorView query() const { return make_view(fake(1), DType::kBFloat16, {S, H, D}, DeviceKind::kCUDA); }
  TensorView key() const {
    return make_view(fake(2) + key_offset, DType::kBFloat16, {N, B, K, D}, DeviceKind::kCUDA);  // nhd
  }
  TensorView value() const {
    return make_view(fake(3) + value_offset, DType::kBFloat16, {N, B, K, D}, DeviceKind::kCUDA);
  }
  TensorView tables() const { return make_view(fake(4), DType::kInt32, {S, M}, DeviceKind::kCUDA); }
  TensorView lens() const { return make_view(fake(5), DType::kInt32, {S}, DeviceKind::kCUDA); }
  TensorView workspace() const {
    return make_view(fake(6) + workspace_offset, DType::kUInt8, {1 << 20}, DeviceKind::kCUDA);
  }
  // The validation pass alone: a prepared call validates in its constructor and launches
  // nothing until run().
  void validate(const AttentionOptions& opt) const {
    const PreparedDecode prepared(out(), query(), key(), value(), tables(), lens(), opt);
  }
};

// Runs f, which must throw E with every fragment in its message.
template <class E, class F>
void expect_error(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const char* frag : fragments)
      if (msg.find(frag) == std::string::npos) PA_FAIL_AT("message \"" << msg << "\" lacks \"" << frag << "\"");
    return;
  } catch (const std::exception& e) {
    PA_FAIL_AT("threw another error type: " << e.what());
  }
  PA_FAIL_AT("did not throw");
}

// A call within the limits: valid in a CUDA build, refused for lacking CUDA otherwise.
void expect_within_limits(const CudaCall& c, const AttentionOptions& opt) {
  if (built_with_cuda()) {
    c.validate(opt);
  } else {
    expect_error<NotSupported>([&] { c.validate(opt); }, {"built without CUDA"});
  }
}

}  // namespace

int main() { return pagedattn_test::run_all(); }

PA_TEST(caches_must_be_16_byte_aligned) {
  CudaCall c;
  c.key_offset = 8;
  expect_error<InvalidArgument>([&] { c.validate({}); }, {"key_cache", "16-byte boundary"});
  c.key_offset = 0;
  c.value_offset = 4;
  expect_error<InvalidArgument>([&] { c.validate({}); }, {"value_cache", "16-byte boundary"});
  c.value_offset = 32;  // any multiple of 16 is fine
  expect_within_limits(c, {});
}

PA_TEST(at_most_65535_sequences) {
  CudaCall c;
  c.S = 65536;
  expect_error<NotSupported>([&] { c.validate({}); }, {"num_seqs", "65536", "at most 65535"});
  c.S = 65535;
  expect_within_limits(c, {});
}

PA_TEST(partition_size_is_a_multiple_of_16) {
  CudaCall c;
  AttentionOptions opt;
  opt.kernel = DecodeKernel::kPartitioned;
  opt.partition_size = 40;
  expect_error<InvalidArgument>([&] { c.validate(opt); }, {"partition_size", "multiple of 16", "got 40"});
  opt.partition_size = 48;
  expect_within_limits(c, opt);
}

PA_TEST(workspace_must_be_16_byte_aligned) {
  CudaCall c;
  c.workspace_offset = 1;
  const TensorView ws = c.workspace();
  AttentionOptions opt;
  opt.kernel = DecodeKernel::kPartitioned;
  opt.partition_size = 64;
  opt.workspace = ws;
  expect_error<InvalidArgument>([&] { c.validate(opt); }, {"workspace", "16-byte boundary"});
}

PA_TEST(host_calls_ignore_the_cuda_limits) {
  // The CPU backend takes any partition size (it ignores it) and caches at any address.
  float q[2 * 8] = {}, out[2 * 8] = {}, kc[4 * 4 * 1 * 8 + 1] = {}, vc[4 * 4 * 1 * 8] = {};
  std::int32_t bt[2] = {0, 1}, lens[2] = {0, 0};
  AttentionOptions opt;
  opt.kernel = DecodeKernel::kPartitioned;
  opt.partition_size = 40;
  out[0] = out[15] = 1.0f;
  const PreparedDecode prepared(
      make_view(out, DType::kFloat32, {2, 1, 8}), make_view(q, DType::kFloat32, {2, 1, 8}),
      make_view(kc + 1, DType::kFloat32, {4, 4, 1, 8}), make_view(vc, DType::kFloat32, {4, 4, 1, 8}),
      make_view(bt, DType::kInt32, {2, 1}), make_view(lens, DType::kInt32, {2}), opt);
  prepared.run();  // sequences of length 0 give zeros
  PA_CHECK_EQ(out[0], 0.0f);
  PA_CHECK_EQ(out[15], 0.0f);
}

PA_TEST(plan_queries_refuse_what_a_call_would) {
  DecodeShape q;
  AttentionOptions opt;
  q.num_seqs = 2;
  q.num_heads = 8;
  q.num_kv_heads = 2;
  q.head_size = 128;
  q.block_size = 16;
  q.max_blocks_per_seq = 4;
  q.dtype = DType::kBFloat16;
  opt.kernel = DecodeKernel::kPartitioned;
  opt.partition_size = 64;
  if (!built_with_cuda()) {  // refused for lacking CUDA first
    expect_error<NotSupported>([&] { decode_plan(q, opt); }, {"no CUDA backend"});
    return;
  }
  try {
    decode_plan(q, opt);
  } catch (const NotSupported&) {  // built with CUDA, but no usable device here: the
    return;                        // queries look for the device before these limits
  }
  opt.partition_size = 40;
  expect_error<InvalidArgument>([&] { decode_plan(q, opt); }, {"partition_size", "multiple of 16"});
  opt.partition_size = 64;
  q.num_seqs = 70000;
  expect_error<NotSupported>([&] { decode_workspace_size(q, opt); }, {"num_seqs", "at most 65535"});
}
