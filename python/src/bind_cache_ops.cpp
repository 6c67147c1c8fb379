// Bindings of the block operations (copy_blocks, swap_blocks) and of the CUDA decode
// workspace-size query.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings.hpp"
#include "ndarray.hpp"
#include "pagedattn/cache_ops.hpp"
#include "pagedattn/errors.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedattn::py {
namespace {

std::string py_type_name(nb::handle h) { return nb::type_name(h.type()).c_str(); }

// An object the array caster may take: a DLPack producer or a buffer.
bool is_array(nb::handle h) { return nb::hasattr(h, "__dlpack__") || PyObject_CheckBuffer(h.ptr()); }

AnyMutArray cache_array(nb::handle h, const std::string& name) {
  AnyMutArray a;
  if (!is_array(h) || !nb::try_cast(h, a, /*convert=*/false))
    throw nb::type_error(detail::concat(name, ": expected a writable array (any DLPack producer), got ", py_type_name(h))
                             .c_str());
  return a;
}

}  // namespace

void bind_cache_ops(nb::module_& m) {
  m.def(
      "copy_blocks",
      [](nb::handle caches, AnyArray block_mapping, std::uintptr_t stream) {
        // One array is one cache (a single layer), never a sequence of its rows: an
        // array is a Python sequence too, and iterating it would copy inside every row.
        std::vector<AnyMutArray> arrays;
        if (is_array(caches)) {
          arrays.push_back(cache_array(caches, "caches"));
        } else if (PySequence_Check(caches.ptr()) && !nb::isinstance<nb::str>(caches) &&
                   !nb::isinstance<nb::bytes>(caches)) {
          std::size_t i = 0;
          for (nb::handle c : nb::iter(caches)) arrays.push_back(cache_array(c, detail::concat("caches[", i++, "]")));
        } else {
          throw nb::type_error(
              detail::concat("caches: expected a cache array or a sequence of them, got ", py_type_name(caches))
                  .c_str());
        }
        std::vector<TensorView> views;
        views.reserve(arrays.size());
        for (const auto& c : arrays) views.push_back(to_view(c));
        const TensorView mv = to_view(block_mapping);
        nb::gil_scoped_release release;
        copy_blocks(views, mv, to_stream(stream));
      },
      "caches"_a, "block_mapping"_a.noconvert(), "stream"_a = 0,
      "Low-level block copy (validated in C++). Use pagedattn.copy_blocks. `caches` is one cache array\n"
      "or a sequence of them.");

  m.def(
      "swap_blocks",
      [](AnyArray src, AnyMutArray dst, AnyArray block_mapping, std::uintptr_t stream) {
        const TensorView s = to_view(src), d = to_view(dst), mv = to_view(block_mapping);
        nb::gil_scoped_release release;
        swap_blocks(s, d, mv, to_stream(stream));
      },
      "src"_a.noconvert(), "dst"_a.noconvert(), "block_mapping"_a.noconvert(), "stream"_a = 0,
      "Low-level block swap (validated in C++). Use pagedattn.swap_blocks.");

  auto query = [](int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
                  int max_blocks_per_seq, const std::string& dtype, const std::string& kv_cache_dtype,
                  const std::string& layout, int version, int partition_size, int device_id) {
    DecodeWorkspaceQuery q;
    q.num_seqs = num_seqs;
    q.num_heads = num_heads;
    q.num_kv_heads = num_kv_heads;
    q.head_size = head_size;
    q.block_size = block_size;
    q.max_blocks_per_seq = max_blocks_per_seq;
    q.dtype = parse_dtype(dtype);
    q.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
    q.layout = parse_layout(layout);
    q.version = version;
    q.partition_size = partition_size;
    q.device_id = device_id;
    return q;
  };
  m.def(
      "decode_workspace_size",
      [query](int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
              const std::string& dtype, const std::string& kv_cache_dtype, const std::string& layout, int version,
              int partition_size, int device_id) {
        return decode_workspace_size(query(num_seqs, num_heads, num_kv_heads, head_size, block_size,
                                           max_blocks_per_seq, dtype, kv_cache_dtype, layout, version,
                                           partition_size, device_id));
      },
      "num_seqs"_a, "num_heads"_a, "num_kv_heads"_a, "head_size"_a, "block_size"_a, "max_blocks_per_seq"_a,
      "dtype"_a, "kv_cache_dtype"_a = "auto", "layout"_a = "vllm", "version"_a = 0, "partition_size"_a = 0,
      "device_id"_a = 0, "Bytes of CUDA scratch paged_attention needs for these shapes (0: none).");
  m.def(
      "decode_plan",
      [query](int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
              const std::string& dtype, const std::string& kv_cache_dtype, const std::string& layout, int version,
              int partition_size, int device_id) {
        const DecodePlanInfo i = decode_plan(query(num_seqs, num_heads, num_kv_heads, head_size, block_size,
                                                   max_blocks_per_seq, dtype, kv_cache_dtype, layout, version,
                                                   partition_size, device_id));
        nb::dict d;
        d["num_partitions"] = i.num_partitions;
        d["partition_size"] = i.partition_size;
        d["reduce_kernel"] = i.reduce_kernel;
        d["head_tiles"] = i.head_tiles;
        d["ctas"] = i.ctas;
        d["workspace_bytes"] = i.workspace_bytes;
        return d;
      },
      "num_seqs"_a, "num_heads"_a, "num_kv_heads"_a, "head_size"_a, "block_size"_a, "max_blocks_per_seq"_a,
      "dtype"_a, "kv_cache_dtype"_a = "auto", "layout"_a = "vllm", "version"_a = 0, "partition_size"_a = 0,
      "device_id"_a = 0, "The launch plan paged_attention would use on CUDA for these shapes.");
}

}  // namespace pagedattn::py
