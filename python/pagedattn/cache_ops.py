"""Whole-block cache operations, the compiled functions themselves (one crossing each).

- :func:`copy_blocks`: copy blocks inside every cache of a list (every layer's key and
  value caches at once: one launch on CUDA).
- :func:`swap_blocks`: move blocks between a GPU cache and a (pinned) host cache,
  asynchronously on the stream.
- :func:`quantize_fp8` / :func:`dequantize_fp8`: convert to and from the codes of an fp8
  cache (``value / scale`` rounded to nearest even, saturating), to fill or inspect one.

The same calls work on NumPy (host) arrays.
"""

from __future__ import annotations

from ._core import copy_blocks, dequantize_fp8, quantize_fp8, swap_blocks

__all__ = ["copy_blocks", "swap_blocks", "quantize_fp8", "dequantize_fp8"]
