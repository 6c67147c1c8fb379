// Bindings of the fp8 conversions: pagedattn.quantize_fp8 and pagedattn.dequantize_fp8
// (pagedattn/fp8.hpp), one crossing each.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"
#include "call_args.hpp"
#include "call_options.hpp"
#include "pagedattn/fp8.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedattn::py {
namespace {

// One conversion: src and dst converted once, the GIL released while it runs; returns dst.
template <class Fn>
nb::object convert(nb::handle src, nb::handle dst, float scale, const std::string& fp8_dtype, nb::handle stream,
                   Fn fn) {
  const KVCacheDType kind = parse_kv_cache_dtype(fp8_dtype, "fp8_dtype");
  CallArrays a;
  a.add(src, "src");
  a.add(dst, "dst", /*written=*/true);
  void* handle = a.stream(stream, 0);
  {
    nb::gil_scoped_release release;
    fn(a[0], a[1], scale, kind, handle);
  }
  return nb::borrow(dst);
}

}  // namespace

void bind_fp8(nb::module_& m) {
  m.def(
      "quantize_fp8",
      [](nb::handle src, nb::handle dst, nb::handle scale, const std::string& fp8_dtype, nb::handle stream) {
        return convert(src, dst, float_arg(scale, "scale"), fp8_dtype, stream,
                       [](auto&&... args) { quantize_fp8(args...); });
      },
      "src"_a, "dst"_a, nb::kw_only(), "scale"_a = 1.0, "fp8_dtype"_a = "fp8_e4m3", "stream"_a = nb::none(),
      nb::sig("def quantize_fp8(src: Any, dst: Any, *, scale: float = 1.0, fp8_dtype: str = 'fp8_e4m3', "
              "stream: Any = None) -> Any"),
      "dst = fp8(src / scale), the codes reshape_and_cache writes into an fp8 cache; returns dst.\n\n"
      "src: float32 / float16 / bfloat16 array of any shape; dst: uint8 array of the same shape (written).\n"
      "Both C-contiguous, on the host or on the same GPU, not sharing memory. The exact quotient\n"
      "src / scale (scale: a positive normal float32) is rounded once to the nearest fp8 value, ties to\n"
      "even; finite values beyond the largest finite fp8 value (e4m3 448, e5m2 57344) and infinities\n"
      "saturate to it, keeping the sign; NaN stays NaN (e4m3 0x7f, e5m2 0x7e, with the sign bit).\n"
      "fp8_dtype: \"fp8_e4m3\" (alias \"fp8\") or \"fp8_e5m2\". On a GPU the work is queued on `stream`\n"
      "(default: the arrays' framework's current stream, see paged_attention).");

  m.def(
      "dequantize_fp8",
      [](nb::handle src, nb::handle dst, nb::handle scale, const std::string& fp8_dtype, nb::handle stream) {
        return convert(src, dst, float_arg(scale, "scale"), fp8_dtype, stream,
                       [](auto&&... args) { dequantize_fp8(args...); });
      },
      "src"_a, "dst"_a, nb::kw_only(), "scale"_a = 1.0, "fp8_dtype"_a = "fp8_e4m3", "stream"_a = nb::none(),
      nb::sig("def dequantize_fp8(src: Any, dst: Any, *, scale: float = 1.0, fp8_dtype: str = 'fp8_e4m3', "
              "stream: Any = None) -> Any"),
      "dst = (fp8 value of src) * scale, rounded once to dst's dtype; returns dst.\n\n"
      "src: uint8 fp8 codes of any shape; dst: float32 / float16 / bfloat16 array of the same shape\n"
      "(written). Both C-contiguous, on the host or on the same GPU, not sharing memory. NaN codes give\n"
      "NaN; e5m2's infinity codes give infinity. fp8_dtype and stream as for quantize_fp8.");
}

}  // namespace pagedattn::py
