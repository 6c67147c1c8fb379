// Smoke program for find_package(pagedattn): one decode step through the C++ API.
#include <cmath>
#include <cstdio>
#include <vector>

#include <pagedattn/pagedattn.hpp>

int main() {
  using namespace pagedattn;
  const int heads = 2, head_size = 8, block_size = 4, num_blocks = 2, len = 3;
  const CacheShapes shapes = kv_cache_shape(num_blocks, block_size, heads, head_size, sizeof(float), CacheLayout::kNHD);
  std::vector<float> kc(static_cast<size_t>(num_blocks * block_size * heads * head_size), 0.5f);
  std::vector<float> vc(kc.size());
  for (size_t i = 0; i < vc.size(); ++i) vc[i] = static_cast<float>(i % 7);
  std::vector<float> q(static_cast<size_t>(heads * head_size), 1.0f), out(q.size(), -1.0f);
  std::vector<int> table = {1}, lens = {len};
  // Equal keys: the output is the mean of the first `len` value rows of block 1.
  paged_attention(make_view(out.data(), DType::kFloat32, {1, heads, head_size}),
                  make_view(q.data(), DType::kFloat32, {1, heads, head_size}),
                  make_view(kc.data(), DType::kFloat32, {shapes.key[0], shapes.key[1], shapes.key[2], shapes.key[3]}),
                  make_view(vc.data(), DType::kFloat32, {shapes.value[0], shapes.value[1], shapes.value[2], shapes.value[3]}),
                  make_view(table.data(), DType::kInt32, {1, 1}), make_view(lens.data(), DType::kInt32, {1}));
  for (int h = 0; h < heads; ++h)
    for (int d = 0; d < head_size; ++d) {
      double want = 0;
      for (int t = 0; t < len; ++t) want += vc[static_cast<size_t>(((1 * block_size + t) * heads + h) * head_size + d)];
      want /= len;
      if (std::fabs(out[static_cast<size_t>(h * head_size + d)] - want) > 1e-5) {
        std::printf("mismatch at h=%d d=%d: %f vs %f\n", h, d, out[static_cast<size_t>(h * head_size + d)], want);
        return 1;
      }
    }
  // The same call with options, prepared once and run twice (as a decode loop would).
  AttentionOptions options;
  options.scale = 0.5f;
  options.kernel = DecodeKernel::kAuto;
  std::vector<float> out2(q.size(), -1.0f);
  const PreparedDecode prepared(make_view(out2.data(), DType::kFloat32, {1, heads, head_size}),
                                make_view(q.data(), DType::kFloat32, {1, heads, head_size}),
                                make_view(kc.data(), DType::kFloat32, {shapes.key[0], shapes.key[1], shapes.key[2], shapes.key[3]}),
                                make_view(vc.data(), DType::kFloat32, {shapes.value[0], shapes.value[1], shapes.value[2], shapes.value[3]}),
                                make_view(table.data(), DType::kInt32, {1, 1}), make_view(lens.data(), DType::kInt32, {1}),
                                options);
  for (int run = 0; run < 2; ++run) {
    prepared.run();
    for (size_t i = 0; i < out.size(); ++i)
      if (std::fabs(out2[i] - out[i]) > 1e-5) {  // equal keys: the scale does not change the mean
        std::printf("prepared run %d differs at %zu\n", run, i);
        return 1;
      }
  }
  try {
    paged_attention(make_view(out.data(), DType::kFloat32, {1, heads, head_size}),
                    make_view(q.data(), DType::kFloat32, {1, heads, head_size}),
                    make_view(kc.data(), DType::kFloat32, {2, 4, 2, 8}), make_view(vc.data(), DType::kFloat32, {2, 4, 2, 8}),
                    make_view(table.data(), DType::kInt32, {1, 1}), make_view(lens.data(), DType::kInt32, {1}));
  } catch (...) {
    std::printf("unexpected error\n");
    return 1;
  }
  std::printf("pagedattn %s consumer ok (cuda backend: %s)\n", kVersion, built_with_cuda() ? "yes" : "no");
  return 0;
}
