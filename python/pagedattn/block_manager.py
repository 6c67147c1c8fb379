"""The KV block manager (implemented in C++; see ``cpp/include/pagedattn/block_manager.hpp``).

``BlockManager`` hands out cache slots to growing sequences, shares blocks between forks with
copy-on-write, optionally reuses cached prompt prefixes, swaps sequences to a CPU pool, and
exports block tables / slot mappings for a batch in one call. ``StepMetadata`` is what
``BlockManager.step`` and ``BlockManager.step_into`` return; ``PrefixPeek`` is what
``BlockManager.peek_prefix`` returns.

For a scheduler: ``step_into`` fills persistent buffers (sized once for the largest batch) up to
what a step needs and, by default, writes only the block-table entries that changed since its
previous call; ``add_sequence`` reads int32 / int64 arrays and any buffer-protocol integer array
without per-element conversion, and ``add_sequence_by_count`` admits a prompt by its length when
prefix caching is off; ``peek_prefix`` tells how many prompt tokens are cached and how many
blocks admission would take, changing nothing; ``free_batch`` and ``fork_batch`` finish or fork
many sequences in one all-or-nothing call. ``OutOfBlocksError`` (a ``RuntimeError``) is raised
when the pool cannot serve a request, ``KeyError`` for an unknown sequence id, ``ValueError``
for bad values (including output arrays that share memory with an input or with each other); a
call that raises leaves the manager unchanged. Prefix-cache hits are exact: a cached block is
reused only after exactly the same prefix of token ids (any int32 values), so no hash collision
can give a false hit.

Thread safety: none. Calls hold the GIL, so Python threads are serialized on standard CPython;
use one manager per thread (or an external lock) anywhere else.
"""

from __future__ import annotations

from ._core import BlockManager, OutOfBlocksError, PrefixPeek, StepMetadata

__all__ = ["BlockManager", "StepMetadata", "PrefixPeek", "OutOfBlocksError"]
