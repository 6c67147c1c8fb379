"""The KV block manager (implemented in C++; see ``cpp/include/pagedattn/block_manager.hpp``).

``BlockManager`` hands out cache slots to growing sequences, shares blocks between forks with
copy-on-write, optionally reuses cached prompt prefixes, swaps sequences to a CPU pool, and
exports block tables / slot mappings for a batch in one call. ``StepMetadata`` is what
``BlockManager.step`` returns. ``OutOfBlocksError`` (a ``RuntimeError``) is raised when the pool
cannot serve a request; the manager is then unchanged.

Thread safety: none. Calls hold the GIL, so Python threads are serialized on standard CPython;
use one manager per thread (or an external lock) anywhere else.
"""

from __future__ import annotations

from ._core import BlockManager, OutOfBlocksError, StepMetadata

__all__ = ["BlockManager", "StepMetadata", "OutOfBlocksError"]
