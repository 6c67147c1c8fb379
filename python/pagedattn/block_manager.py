"""The KV block manager (implemented in C++; see ``cpp/include/pagedattn/block_manager.hpp``).

``BlockManager`` hands out cache slots to growing sequences, shares blocks between forks with
copy-on-write, optionally reuses cached prompt prefixes, swaps sequences to a CPU pool, and
exports block tables / slot mappings for a batch in one call. ``StepMetadata`` is what
``BlockManager.step`` returns. ``OutOfBlocksError`` (a ``RuntimeError``) is raised when the pool
cannot serve a request, ``KeyError`` for an unknown sequence id, ``ValueError`` for bad values
(including output arrays that share memory with an input or with each other); a call that raises
leaves the manager unchanged. Prefix-cache hits are exact: a cached block is reused only after
exactly the same prefix of token ids (any int32 values), so no hash collision can give a false hit.

Thread safety: none. Calls hold the GIL, so Python threads are serialized on standard CPython;
use one manager per thread (or an external lock) anywhere else.
"""

from __future__ import annotations

from ._core import BlockManager, OutOfBlocksError, PrefixPeek, StepMetadata

__all__ = ["BlockManager", "StepMetadata", "PrefixPeek", "OutOfBlocksError"]
