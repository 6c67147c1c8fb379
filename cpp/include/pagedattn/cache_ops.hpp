// Whole-block cache operations (copy inside a device, swap between device and host).
//
// Dimension legend: N = num_blocks of a cache, P = number of (src, dst) block pairs.
// A "block" of a cache array is its slice [n] along the first dimension, in every
// layout (vllm key [N, K, D/x, B, x], vllm value [N, K, D, B], nhd [N, B, K, D],
// hnd [N, K, B, D]). Every block (dims 1..) must be C-contiguous; blocks may lie any
// block stride >= one block apart (the key or value half of an [N, 2, ...] allocation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pagedattn/supported.hpp"
#include "pagedattn/tensor.hpp"

namespace pagedattn {

// For every pair p and every array a of `caches`: a[mapping[p, 1]] = a[mapping[p, 0]].
//   caches         arrays [N_a, ...], blocks C-contiguous, all on one device (host or one GPU);
//                  typically every layer's key and value cache: one launch on CUDA
//   block_mapping  int64 or int32 [P, 2] (src, dst), C-contiguous; in host memory, or
//                  on the caches' GPU (then its entries cannot be checked before the
//                  launch: out-of-range pairs are skipped by the kernel)
// The mapping must not share memory with any cache. A host mapping is read once, into
// a private copy, and checked: pairs in range (OutOfRange), no destination twice and no
// destination that is the source of another pair (InvalidArgument naming the pair;
// pairs run in parallel on CUDA). Asynchronous on `stream` for CUDA caches; no host sync.
void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping, void* stream = nullptr);

// For every pair p: dst[mapping[p, 1]] = src[mapping[p, 0]].
//   src, dst       [N_src, ...] and [N_dst, ...]: same dtype and block shape (dims 1..);
//                  blocks C-contiguous; any of: GPU -> pinned host, pinned host -> GPU,
//                  GPU -> same GPU, host -> host. Pageable host memory works too, but
//                  CUDA then copies synchronously.
//   block_mapping  int64 or int32 [P, 2] in host memory (it is read on the host, once,
//                  into a private copy), sharing no memory with src or dst
// src and dst are separate arrays or the very same one. No destination may appear twice;
// when src is dst, no destination may be the source of another pair (InvalidArgument
// naming the pair). With a GPU involved the copies are queued on `stream` (consecutive pairs are merged
// into one copy) and the call returns without waiting.
void swap_blocks(const TensorView& src, const TensorView& dst, const TensorView& block_mapping,
                 void* stream = nullptr);


}  // namespace pagedattn
