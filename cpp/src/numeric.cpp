#include "numeric.hpp"

#include <vector>

namespace pagedattn::numeric {

float half_to_float(std::uint16_t h) {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (std::uint32_t i = 0; i < 65536; ++i) t[i] = half_to_float_slow(static_cast<std::uint16_t>(i));
    return t;
  }();
  return table[h];
}

namespace {
std::vector<float> build_fp8_table(const fp8::Format& f) {
  std::vector<float> t(256);
  for (int i = 0; i < 256; ++i) t[static_cast<std::size_t>(i)] = fp8::to_float(static_cast<std::uint8_t>(i), f);
  return t;
}
}  // namespace

const float* fp8_e4m3_table() {
  static const std::vector<float> t = build_fp8_table(fp8::e4m3());
  return t.data();
}
const float* fp8_e5m2_table() {
  static const std::vector<float> t = build_fp8_table(fp8::e5m2());
  return t.data();
}

}  // namespace pagedattn::numeric
