// Bindings of the block operations (copy_blocks, swap_blocks).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings.hpp"
#include "ndarray.hpp"
#include "pagedattn/cache_ops.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedattn::py {

void bind_cache_ops(nb::module_& m) {
  m.def(
      "copy_blocks",
      [](const std::vector<AnyMutArray>& caches, AnyArray block_mapping, std::uintptr_t stream) {
        std::vector<TensorView> views;
        views.reserve(caches.size());
        for (const auto& c : caches) views.push_back(to_view(c));
        const TensorView mv = to_view(block_mapping);
        nb::gil_scoped_release release;
        copy_blocks(views, mv, to_stream(stream));
      },
      "caches"_a, "block_mapping"_a.noconvert(), "stream"_a = 0,
      "Low-level block copy (validated in C++). Use pagedattn.copy_blocks.");

  m.def(
      "swap_blocks",
      [](AnyArray src, AnyMutArray dst, AnyArray block_mapping, std::uintptr_t stream) {
        const TensorView s = to_view(src), d = to_view(dst), mv = to_view(block_mapping);
        nb::gil_scoped_release release;
        swap_blocks(s, d, mv, to_stream(stream));
      },
      "src"_a.noconvert(), "dst"_a.noconvert(), "block_mapping"_a.noconvert(), "stream"_a = 0,
      "Low-level block swap (validated in C++). Use pagedattn.swap_blocks.");
}

}  // namespace pagedattn::py
