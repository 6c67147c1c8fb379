"""Whole-block cache operations, the compiled functions themselves (one crossing each).

- :func:`copy_blocks`: copy blocks inside every cache of a list (every layer's key and
  value caches at once: one launch on CUDA).
- :func:`swap_blocks`: move blocks between a GPU cache and a (pinned) host cache,
  asynchronously on the stream.

The same calls work on NumPy (host) arrays.
"""

from __future__ import annotations

from ._core import copy_blocks, swap_blocks

__all__ = ["copy_blocks", "swap_blocks"]
