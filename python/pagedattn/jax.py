"""pagedattn for JAX: paged attention and cache writes as XLA custom calls.

The functions here work on JAX arrays inside and outside :func:`jax.jit` (and under
:func:`jax.lax.scan`, :func:`jax.vmap`): each is a :func:`jax.ffi.ffi_call` of an XLA FFI
handler compiled into pagedattn's extension, which validates its arguments and runs the
same CPU or CUDA kernels as the eager API (on XLA's CUDA stream). They are functional, as
JAX asks:

- :func:`paged_attention` returns a new array (XLA allocates it);
- :func:`reshape_and_cache` returns the updated ``(key_cache, value_cache)``. The results
  alias the cache operands, so under ``jax.jit(..., donate_argnums=...)`` with the caches
  donated the write lands in place, with no copy of the caches.

Options are static Python values (they become attributes of the XLA call); arrays are
operands. A bad call raises when it runs, with the message of the eager API.

Importing this module imports JAX and registers the handlers; ``import pagedattn`` alone
never imports JAX. The handlers are built when jaxlib's XLA FFI headers are found at build
time (``pip install --no-build-isolation .`` in an environment that has JAX, or
``PAGEDATTN_JAX_FFI=1 pip install .``); without them importing this module raises
ImportError saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import jax
import numpy as np

from . import _core

__all__ = ["paged_attention", "reshape_and_cache"]

_ATTENTION = "pagedattn_paged_attention"
_CACHE_WRITE = "pagedattn_reshape_and_cache"

# How a call behaves under jax.vmap: one call per element of the mapped axis (the
# handlers take unbatched arrays).
_VMAP = "sequential"


def _register(targets: Mapping[str, Mapping[str, Any]]) -> None:
    """Registers the handlers of ``_core._jax_ffi_targets()`` with XLA, per platform."""
    if not targets:
        raise ImportError(
            "pagedattn.jax: this build of pagedattn has no XLA FFI handlers (jaxlib's headers were not found when "
            "it was built). Rebuild with JAX present: `pip install --no-build-isolation .` in an environment that "
            "has jax, or `PAGEDATTN_JAX_FFI=1 pip install .`"
        )
    for platform, handlers in targets.items():
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


# {platform: {target name: capsule}}, empty without the handlers (a private function of the
# module, absent from its public stubs).
_register(_core._jax_ffi_targets())  # type: ignore[attr-defined]


def _shape_dtype(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype)


def paged_attention(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    scale: Optional[float] = None,
    alibi_slopes: Any = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    query_start_loc: Any = None,
    max_query_len: Optional[int] = None,
    kernel: str = "auto",
    partition_size: int = 0,
    check_block_tables: bool = False,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: Any = None,
    layout: Optional[str] = None,
) -> jax.Array:
    """Paged attention over a paged KV cache; returns a new array like the query.

    The arguments and options are those of :func:`pagedattn.paged_attention` (shapes,
    layouts, the varlen form with ``query_start_loc`` and ``max_query_len``, ALiBi, fp8
    caches, ``sliding_window``, ``soft_cap`` and ``sinks``), without ``out``,
    ``workspace`` and ``stream``: XLA allocates the output and gives the stream. An fp8
    cache is a uint8 array, or a float8_e4m3fn / float8_e5m2 array with the matching
    ``kv_cache_dtype``. Options must be static Python values.
    """
    attrs: dict[str, Any] = {
        "kv_cache_dtype": str(kv_cache_dtype),
        "k_scale": np.float32(k_scale),
        "v_scale": np.float32(v_scale),
        "kernel": str(kernel),
        "partition_size": np.int64(partition_size),
        "check_block_tables": bool(check_block_tables),
        "sliding_window": np.int64(sliding_window),
        "soft_cap": np.float32(soft_cap),
    }
    if scale is not None:
        attrs["scale"] = np.float32(scale)
    if max_query_len is not None:
        attrs["max_query_len"] = np.int64(max_query_len)
    if layout is not None:
        attrs["layout"] = str(layout)
    # Arrays the call may go without follow the five it always has, named in order by the
    # attribute "operands" (XLA has no optional operands).
    optional = {"alibi_slopes": alibi_slopes, "query_start_loc": query_start_loc, "sinks": sinks}
    names = [name for name, a in optional.items() if a is not None]
    if names:
        attrs["operands"] = ",".join(names)
    call = jax.ffi.ffi_call(_ATTENTION, _shape_dtype(query), vmap_method=_VMAP)
    return call(query, key_cache, value_cache, block_tables, seq_lens, *(optional[n] for n in names), **attrs)


def reshape_and_cache(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    layout: Optional[str] = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes key / value [T, K, D] into their cache slots; returns the updated caches.

    Arguments and options as :func:`pagedattn.reshape_and_cache`. The results alias
    ``key_cache`` and ``value_cache``: donate them (``jax.jit(..., donate_argnums=...)``)
    and the write happens in their buffers; otherwise XLA copies them first, so the
    arrays passed in are never changed.
    """
    attrs = {
        "kv_cache_dtype": str(kv_cache_dtype),
        "k_scale": np.float32(k_scale),
        "v_scale": np.float32(v_scale),
    }
    if layout is not None:
        attrs["layout"] = str(layout)
    call = jax.ffi.ffi_call(
        _CACHE_WRITE,
        (_shape_dtype(key_cache), _shape_dtype(value_cache)),
        input_output_aliases={2: 0, 3: 1},
        vmap_method=_VMAP,
    )
    new_key_cache, new_value_cache = call(key, value, key_cache, value_cache, slot_mapping, **attrs)
    return new_key_cache, new_value_cache
