// The public fp8 conversions (pagedattn/fp8.hpp) through the C++ API: known codes, the
// round trip, ties of value / scale, and the typed errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "pagedattn/pagedattn.hpp"

using namespace pagedattn;

PA_TEST(quantize_known_codes) {
  // 1.0625 is the tie between 1 (0x38) and 1.125 (0x39): the even code; 1.1875 between
  // 1.125 and 1.25 (0x3a): the even code again; 1000 and infinity saturate to 448 (0x7e).
  std::vector<float> src = {1.0f, 1.0625f, 1.1875f, 1000.0f, -INFINITY, NAN, -0.0f, 0.3f};
  std::vector<std::uint8_t> dst(src.size(), 0x55);
  quantize_fp8(make_view(src.data(), DType::kFloat32, {8}), make_view(dst.data(), DType::kUInt8, {8}));
  const std::uint8_t want[8] = {0x38, 0x38, 0x3a, 0x7e, 0xfe, 0x7f, 0x80, 0x2a};
  for (int i = 0; i < 8; ++i) PA_CHECK_EQ(static_cast<int>(dst[i]), static_cast<int>(want[i]));
  // value / scale with scale 2: 2.125 / 2 = 1.0625, a tie again
  float v = 2.125f;
  std::uint8_t c = 0;
  quantize_fp8(make_view(&v, DType::kFloat32, {1}), make_view(&c, DType::kUInt8, {1}), 2.0f,
               KVCacheDType::kFp8E5M2);
  PA_CHECK_EQ(static_cast<int>(c), 0x3c);  // e5m2: 1.0625 ties between 1 (0x3c) and 1.25 (0x3d)
}

PA_TEST(dequantize_every_code_times_scale) {
  std::vector<std::uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
  std::vector<float> out(256);
  dequantize_fp8(make_view(codes.data(), DType::kUInt8, {16, 16}), make_view(out.data(), DType::kFloat32, {16, 16}),
                 0.5f, KVCacheDType::kFp8E4M3);
  PA_CHECK_EQ(out[0x38], 0.5f);
  PA_CHECK_EQ(out[0x7e], 224.0f);
  PA_CHECK_EQ(out[0x01], std::ldexp(1.0f, -10));
  PA_CHECK(std::isnan(out[0x7f]) && std::isnan(out[0xff]));
  std::vector<std::uint8_t> back(256);
  quantize_fp8(make_view(out.data(), DType::kFloat32, {256}), make_view(back.data(), DType::kUInt8, {256}), 0.5f);
  for (int i = 0; i < 256; ++i)
    if ((i & 0x7f) != 0x7f) PA_CHECK_EQ(static_cast<int>(back[static_cast<std::size_t>(i)]), i);
}

PA_TEST(typed_errors) {
  float f[4] = {};
  double d[4] = {};
  std::uint8_t u[4] = {};
  const TensorView src = make_view(f, DType::kFloat32, {4});
  const TensorView dst = make_view(u, DType::kUInt8, {4});
  PA_CHECK_THROWS(quantize_fp8(make_view(d, DType::kFloat64, {4}), dst), TypeMismatch);
  PA_CHECK_THROWS(quantize_fp8(src, make_view(f, DType::kFloat32, {4})), TypeMismatch);
  PA_CHECK_THROWS(dequantize_fp8(src, dst), TypeMismatch);
  PA_CHECK_THROWS(quantize_fp8(src, make_view(u, DType::kUInt8, {2, 2})), InvalidArgument);
  PA_CHECK_THROWS(quantize_fp8(src, dst, 0.0f), InvalidArgument);
  PA_CHECK_THROWS(quantize_fp8(src, dst, NAN), InvalidArgument);
  PA_CHECK_THROWS(quantize_fp8(src, dst, 1.0f, KVCacheDType::kAuto), InvalidArgument);
  try {
    quantize_fp8(src, dst, -2.0f);
    PA_CHECK(false);
  } catch (const InvalidArgument& e) {
    PA_CHECK(std::string(e.what()).find("scale") != std::string::npos);
  }
}

int main() { return pagedattn_test::run_all(); }
