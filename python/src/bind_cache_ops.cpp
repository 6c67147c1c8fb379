// Bindings of the block operations: pagedattn.copy_blocks and pagedattn.swap_blocks, each
// one crossing from Python (arrays, the pair list, NumPy bfloat16 and the stream are all
// converted here, call_args.hpp).
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "bindings.hpp"
#include "call_args.hpp"
#include "pagedattn/cache_ops.hpp"
#include "pagedattn/errors.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedattn::py {
namespace {

std::string py_type_name(nb::handle h) { return nb::type_name(h.type()).c_str(); }

// An object the array conversion may take: a DLPack producer or a buffer.
bool is_array(nb::handle h) { return nb::hasattr(h, "__dlpack__") || PyObject_CheckBuffer(h.ptr()); }

// Adds the per-layer caches of `caches` (`name`): one cache array is one layer, never a
// sequence of its rows (an array is a Python sequence too).
void add_layers(ArrayList& out, nb::handle caches, const char* name) {
  if (is_array(caches)) {
    out.add(caches, name, /*written=*/true);
    return;
  }
  if (!PySequence_Check(caches.ptr()) || nb::isinstance<nb::str>(caches) || nb::isinstance<nb::bytes>(caches))
    fail<TypeMismatch>(name, ": expected a cache array or a sequence of them, got ", py_type_name(caches));
  std::size_t i = 0;
  for (nb::handle c : nb::iter(caches)) {
    const std::string item = detail::concat(name, "[", i++, "]");
    if (!is_array(c)) fail<TypeMismatch>(item, ": expected a writable array (any DLPack producer), got ", py_type_name(c));
    out.add(c, item.c_str(), /*written=*/true);
  }
}

// The pair list as an array: an array as given, else (a list of pairs) an int64 NumPy
// array in host memory.
nb::object mapping_object(nb::handle block_mapping) {
  if (is_array(block_mapping)) return nb::borrow(block_mapping);
  if (!PySequence_Check(block_mapping.ptr()) || nb::isinstance<nb::str>(block_mapping))
    fail<TypeMismatch>("block_mapping: expected [P, 2] (src, dst) pairs as an int array or a list of pairs, got ",
                       py_type_name(block_mapping));
  nb::module_ np = nb::module_::import_("numpy");
  nb::object arr;
  try {
    arr = np.attr("asarray")(block_mapping, "dtype"_a = np.attr("int64"));
  } catch (const nb::python_error& e) {
    fail<TypeMismatch>("block_mapping: the pairs are not integers (", nb::cast<std::string>(nb::str(e.value())), ")");
  }
  if (nb::cast<std::size_t>(arr.attr("size")) == 0) arr = arr.attr("reshape")(0, 2);
  return np.attr("ascontiguousarray")(arr);
}

}  // namespace

void bind_cache_ops(nb::module_& m) {
  m.def(
      "copy_blocks",
      [](nb::handle key_caches, nb::handle value_caches, nb::handle block_mapping, nb::handle stream) {
        ArrayList caches;
        add_layers(caches, key_caches, "key_caches");
        add_layers(caches, value_caches, "value_caches");
        const nb::object mapping = mapping_object(block_mapping);
        CallArrays map_array;
        map_array.add(mapping, "block_mapping");
        if (caches.size() == 0) {  // nothing to copy; the mapping is still checked
          copy_blocks({}, map_array[0], nullptr);
          return;
        }
        std::vector<TensorView> views;
        views.reserve(caches.size());
        for (std::size_t i = 0; i < caches.size(); ++i) views.push_back(caches[i]);
        void* handle = caches.stream(stream, 0);
        nb::gil_scoped_release release;
        copy_blocks(views, map_array[0], handle);
      },
      "key_caches"_a, "value_caches"_a, "block_mapping"_a, nb::kw_only(), "stream"_a = nb::none(),
      nb::sig("def copy_blocks(key_caches: Any, value_caches: Any, block_mapping: Any, *, stream: Any = None) -> None"),
      "For every (src, dst) pair and every cache: cache[dst] = cache[src], in place.\n\n"
      "key_caches / value_caches: lists of cache arrays [num_blocks, ...] on one device (any layout; a block\n"
      "is the slice along the first dimension, C-contiguous, at any block stride >= one block, such as the\n"
      "key and value halves of an [N, 2, ...] allocation), one per layer; a single array (not in a list) is\n"
      "one layer's cache, never a list of rows; no two caches may share a block. block_mapping: pairs [P, 2]\n"
      "(src, dst) as a list of pairs, or an int64 / int32 array in host memory or on the caches' GPU, never\n"
      "inside a cache. A destination must not appear twice nor be the source of another pair (a host mapping\n"
      "breaking this raises ValueError naming the pair). On CUDA all arrays and pairs are done in one kernel\n"
      "launch on `stream` (default: the arrays' framework's current stream, see paged_attention).");

  m.def(
      "swap_blocks",
      [](nb::handle src, nb::handle dst, nb::handle block_mapping, nb::handle stream) {
        for (auto [h, name] : {std::pair<nb::handle, const char*>{src, "src"}, {dst, "dst"}})
          if (!is_array(h))
            fail<TypeMismatch>(name, ": expected one cache array (any DLPack producer), got ", py_type_name(h),
                               "; swap_blocks moves the blocks of one cache: call it once per layer and per key / "
                               "value cache");
        const nb::object mapping = mapping_object(block_mapping);
        CallArrays a;
        a.add(src, "src");
        a.add(dst, "dst", /*written=*/true);
        a.add(mapping, "block_mapping");
        void* handle = a.stream(stream, a[0].device == DeviceKind::kCUDA ? 0 : 1);
        nb::gil_scoped_release release;
        swap_blocks(a[0], a[1], a[2], handle);
      },
      "src"_a, "dst"_a, "block_mapping"_a, nb::kw_only(), "stream"_a = nb::none(),
      nb::sig("def swap_blocks(src: Any, dst: Any, block_mapping: Any, *, stream: Any = None) -> None"),
      "For every (s, d) pair: dst[d] = src[s]: GPU <-> pinned host, or host <-> host.\n\n"
      "src and dst share dtype and block shape (all dimensions but the first). block_mapping: pairs [P, 2]\n"
      "in host memory (list of pairs or array), never inside src or dst; a destination must not appear\n"
      "twice (nor, when src and dst share memory, be the source of another pair). With a GPU involved the\n"
      "copies are queued on `stream` (default: the GPU array's framework's current stream) and the call\n"
      "returns at once; use pinned host memory (e.g. torch.empty(..., pin_memory=True)) for truly\n"
      "asynchronous copies.");
}

}  // namespace pagedattn::py
