"""The paged KV cache of the demo model: one key and one value cache per layer on the
device, a host pool for swapped-out blocks, and the pagedattn calls that move data.

Every byte the model reads or writes goes through the public API: ``reshape_and_cache``
(the keys and values of a step's new tokens), ``paged_attention`` with
``query_start_loc`` (all attention: decode rows and prompt-chunk rows in one call per
layer), ``copy_blocks`` (copy-on-write after a fork) and ``swap_blocks`` (preemption
by swapping). The device caches start filled
with NaN, so reading a slot that was never written shows up in the checks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import pagedattn

from .backend import Backend

__all__ = ["PagedKVCache"]


class PagedKVCache:
    def __init__(
        self,
        backend: Backend,
        *,
        num_layers: int,
        num_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: str,
    ) -> None:
        self.be = backend
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        kshape, vshape = pagedattn.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype)
        self.key = [backend.full(kshape, np.nan, dtype) for _ in range(num_layers)]
        self.value = [backend.full(vshape, np.nan, dtype) for _ in range(num_layers)]
        cpu = max(num_cpu_blocks, 1)  # a 1-block pool when swapping is off keeps the code uniform
        self.cpu_key = [backend.host_pool((cpu,) + tuple(kshape[1:]), dtype) for _ in range(num_layers)]
        self.cpu_value = [backend.host_pool((cpu,) + tuple(vshape[1:]), dtype) for _ in range(num_layers)]
        self.blocks_copied = 0
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0

    def write(self, layer: int, k: Any, v: Any, slots: Any) -> None:
        """k / v [T, K, D] into their slots [T]."""
        pagedattn.reshape_and_cache(k, v, self.key[layer], self.value[layer], slots)

    def attend(
        self, layer: int, q: Any, block_tables: Any, seq_lens: Any, query_start_loc: Any, max_query_len: int,
        scale: float,
    ) -> Any:  # fmt: skip
        """Varlen attention of q [T, H, D]: sequence i's rows query_start_loc[i] .. [i+1] are
        its last tokens, attending causally to its seq_lens[i] cached tokens. Returns [T, H, D]."""
        return pagedattn.paged_attention(
            q, self.key[layer], self.value[layer], block_tables, seq_lens, scale=scale,
            query_start_loc=query_start_loc, max_query_len=max_query_len,
        )  # fmt: skip

    def copy(self, pairs: np.ndarray) -> None:
        """Copy-on-write: every (src, dst) block pair, in every layer's caches, in one call."""
        if len(pairs):
            pagedattn.copy_blocks(self.key, self.value, pairs)
            self.blocks_copied += len(pairs)

    def swap_out(self, pairs: np.ndarray) -> None:
        """(device block, host block) pairs: device -> host."""
        for layer in range(len(self.key)):
            pagedattn.swap_blocks(self.key[layer], self.cpu_key[layer], pairs)
            pagedattn.swap_blocks(self.value[layer], self.cpu_value[layer], pairs)
        self.blocks_swapped_out += len(pairs)

    def swap_in(self, pairs: np.ndarray) -> None:
        """(host block, device block) pairs: host -> device."""
        for layer in range(len(self.key)):
            pagedattn.swap_blocks(self.cpu_key[layer], self.key[layer], pairs)
            pagedattn.swap_blocks(self.cpu_value[layer], self.value[layer], pairs)
        self.blocks_swapped_in += len(pairs)
