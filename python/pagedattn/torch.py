"""PyTorch operators: pagedattn inside ``torch.compile`` and CUDA graphs.

``import pagedattn.torch`` registers the library's calls as operators of the ``pagedattn``
namespace (``import pagedattn`` alone never imports torch):

- ``torch.ops.pagedattn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
  <options>) -> Tensor``: a new output, contiguous, like the query;
- ``torch.ops.pagedattn.paged_attention.out(query, ..., seq_lens, out, workspace=None, <options>)
  -> ()``: writes the caller's ``out`` (and uses the caller's CUDA scratch ``workspace``);
- ``torch.ops.pagedattn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
  kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0) -> ()``: writes the caches;
- ``torch.ops.pagedattn.copy_blocks(key_caches, value_caches, block_mapping) -> ()``: writes
  every cache of the two lists;
- ``torch.ops.pagedattn.swap_blocks(src, dst, block_mapping) -> ()``: writes ``dst``.

The options are the plain calls' keywords (``help(pagedattn.paged_attention)``), passed by
keyword, with one rename: the decode-kernel choice ``kernel`` is ``decode_kernel`` in the
operators (Inductor reserves the name). :func:`paged_attention` here takes the plain call's
arguments, ``kernel`` and ``out`` included, and picks the operator.

Their schemas declare what each one writes, and each has a fake (meta) implementation that
computes output shapes from metadata alone, so ``torch.compile(fullgraph=True)`` traces a model
through them without a graph break and ``mode="reduce-overhead"`` captures them in CUDA graphs.
The implementations are the plain calls (``pagedattn.paged_attention`` and friends) on the
tensors: they run on torch's current CUDA stream (the capture stream while a graph is being
captured), and without ``workspace`` the partitioned kernel's scratch comes from the library
(a pool per stream, graph-owned memory during a capture).

The operators are for inference: the output of ``paged_attention`` raises ``RuntimeError`` when
backpropagated through, and the writing operators raise ``RuntimeError`` when called with grad
mode on and an input that requires grad (their written tensors cannot carry a gradient). In
eager code the plain calls cost less host time than the operators (the dispatcher's work); the
operators are what a compiled or captured model needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from . import _api, cache_ops

if TYPE_CHECKING:
    from ._core import Layout  # a typing-only alias of the stubs

__all__ = ["paged_attention", "reshape_and_cache", "copy_blocks", "swap_blocks", "empty_kv_cache"]

_NS = "pagedattn"

# The options of the attention operators, as (name, schema type, default): the keywords of
# pagedattn.paged_attention except `out`, `workspace` (the .out overload's arguments) and
# `stream` (always torch's current stream). An option of the plain call becomes an option of
# the operators by one line here: the schemas and the forwarding are generated from this table.
ATTENTION_OPTIONS: tuple[tuple[str, str, Any], ...] = (
    ("scale", "float?", None),
    ("alibi_slopes", "Tensor?", None),
    ("kv_cache_dtype", "str", "auto"),
    ("k_scale", "float", 1.0),
    ("v_scale", "float", 1.0),
    ("decode_kernel", "str", "auto"),  # the plain call's `kernel` (see _PLAIN_NAMES)
    ("partition_size", "int", 0),
    ("check_block_tables", "bool", False),
    ("query_start_loc", "Tensor?", None),
    ("max_query_len", "int?", None),
    ("sliding_window", "int", 0),
    ("soft_cap", "float", 0.0),
    ("sinks", "Tensor?", None),
    ("layout", "str?", None),
)
# Operator arguments named differently from the plain call's keyword: Inductor's lowering of
# an operator passes its arguments next to its own `kernel` parameter, so no argument may be
# called `kernel`.
_PLAIN_NAMES = {"decode_kernel": "kernel"}
# The options of reshape_and_cache (the keywords of pagedattn.reshape_and_cache but `stream`).
CACHE_WRITE_OPTIONS: tuple[tuple[str, str, Any], ...] = (
    ("kv_cache_dtype", "str", "auto"),
    ("k_scale", "float", 1.0),
    ("v_scale", "float", 1.0),
    ("layout", "str?", None),
)


def _schema_default(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)


def _options_schema(options: Sequence[tuple[str, str, Any]]) -> str:
    return ", ".join(f"{t} {name}={_schema_default(d)}" for name, t, d in options)


_ATTENTION_INPUTS = "Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens"
# Options are positional arguments with defaults (custom operators take no keyword-only
# tensors): pass them by keyword. New options go at the end, so existing calls keep working.
_ATTENTION_SCHEMA = f"({_ATTENTION_INPUTS}, {_options_schema(ATTENTION_OPTIONS)}) -> Tensor"
_ATTENTION_OUT_SCHEMA = (
    f"({_ATTENTION_INPUTS}, Tensor(a!) out, Tensor(b!)? workspace=None, {_options_schema(ATTENTION_OPTIONS)}) -> ()"
)
_CACHE_WRITE_SCHEMA = (
    "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
    f"{_options_schema(CACHE_WRITE_OPTIONS)}) -> ()"
)
_COPY_BLOCKS_SCHEMA = "(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()"
_SWAP_BLOCKS_SCHEMA = "(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()"


def _keywords(table: Sequence[tuple[str, str, Any]]) -> tuple[str, ...]:
    return tuple(_PLAIN_NAMES.get(name, name) for name, _, _ in table)


_ATTENTION_KEYWORDS = _keywords(ATTENTION_OPTIONS)
_CACHE_WRITE_KEYWORDS = _keywords(CACHE_WRITE_OPTIONS)


def _named(keywords: tuple[str, ...], values: Sequence[Any]) -> dict[str, Any]:
    """The option values of an operator call (the dispatcher may leave trailing defaults out)
    as the plain call's keywords."""
    return dict(zip(keywords, values))


def _op(name: str, schema: str, mutates: Sequence[str], impl: Callable[..., Any]) -> Any:
    return torch.library.custom_op(f"{_NS}::{name}", impl, mutates_args=tuple(mutates), schema=schema)


# The writing operators are defined on this library, which owns every kernel they have: the
# implementation, and the Autograd and ADInplaceOrView kernels below (custom_op registers its
# own kernels for those keys, and torch versions differ in whether a second registration may
# replace them).
_lib = torch.library.Library(_NS, "FRAGMENT")


def _writing_op(name: str, schema: str, impl: Callable[..., Any]) -> str:
    qualname = f"{_NS}::{name}"
    torch.library.define(qualname, schema, lib=_lib, tags=(torch.Tag.pt2_compliant_tag,))
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    return qualname


# ---- implementations: the plain calls on the tensors (stream: torch's current one) ----


def _attention_impl(query, key_cache, value_cache, block_tables, seq_lens, *options):
    out = query.new_empty(query.shape)
    _api.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, out=out, **_named(_ATTENTION_KEYWORDS, options)
    )  # fmt: skip
    return out


def _attention_out_impl(query, key_cache, value_cache, block_tables, seq_lens, out, workspace=None, *options):
    _api.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, out=out, workspace=workspace,
        **_named(_ATTENTION_KEYWORDS, options),
    )  # fmt: skip


def _cache_write_impl(key, value, key_cache, value_cache, slot_mapping, *options):
    _api.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **_named(_CACHE_WRITE_KEYWORDS, options))


def _copy_blocks_impl(key_caches, value_caches, block_mapping):
    cache_ops.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def _swap_blocks_impl(src, dst, block_mapping):
    cache_ops.swap_blocks(src, dst, block_mapping)


_attention = _op("paged_attention", _ATTENTION_SCHEMA, (), _attention_impl)
_attention_out = _writing_op("paged_attention.out", _ATTENTION_OUT_SCHEMA, _attention_out_impl)
_cache_write = _writing_op("reshape_and_cache", _CACHE_WRITE_SCHEMA, _cache_write_impl)
_copy_blocks = _writing_op("copy_blocks", _COPY_BLOCKS_SCHEMA, _copy_blocks_impl)
_swap_blocks = _writing_op("swap_blocks", _SWAP_BLOCKS_SCHEMA, _swap_blocks_impl)


# ---- fake implementations: shapes from metadata, and the checks metadata allows ----
# The compiled call validates everything again; these checks make a traced model fail at
# trace time, with the plain call's error types, instead of at its first run.


def _expect(ok: Any, op: str, message: str, exc: type[Exception] = ValueError) -> None:
    if not ok:
        raise exc(f"pagedattn::{op}: {message}")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _check_devices(op: str, device: torch.device, **tensors: Optional[torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None:
            _expect(t.device == device, op, f"{name} is on {t.device}, expected {device} (like the others)")


def _check_index(op: str, name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    _expect(t.dim() == ndim, op, f"{name}: expected {ndim} dimensions, got shape {_shape(t)}")
    allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
    got = str(t.dtype).replace("torch.", "")
    _expect(t.dtype in dtypes, op, f"{name}: expected {allowed}, got {got}", TypeError)


def _check_attention(op, query, key_cache, value_cache, block_tables, seq_lens, options) -> None:
    qsl = options.get("query_start_loc")
    _check_devices(
        op, query.device, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        seq_lens=seq_lens, alibi_slopes=options.get("alibi_slopes"), query_start_loc=qsl,
        sinks=options.get("sinks"),
    )  # fmt: skip
    _expect(query.dim() == 3, op, f"query: expected [S, H, D] (or [T, H, D]), got shape {_shape(query)}")
    _expect(key_cache.dim() in (4, 5), op, f"key_cache: expected 4 or 5 dimensions, got shape {_shape(key_cache)}")
    _check_index(op, "block_tables", block_tables, 2, (torch.int32,))
    _check_index(op, "seq_lens", seq_lens, 1, (torch.int32,))
    num_seqs = seq_lens.shape[0]
    rows = block_tables.shape[0]
    _expect(rows == num_seqs, op, f"block_tables has {rows} rows but seq_lens {num_seqs} sequences")
    if qsl is None:
        _expect(
            query.shape[0] == num_seqs, op,
            f"query has {query.shape[0]} rows but seq_lens {num_seqs} sequences "
            "(more query rows per sequence need query_start_loc)",
        )  # fmt: skip
    else:
        _check_index(op, "query_start_loc", qsl, 1, (torch.int32,))
        n = qsl.shape[0]
        _expect(n == num_seqs + 1, op, f"query_start_loc: expected {num_seqs + 1} entries (S + 1), got {n}")


@_attention.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, *options):
    options = _named(_ATTENTION_KEYWORDS, options)
    _check_attention("paged_attention", query, key_cache, value_cache, block_tables, seq_lens, options)
    return query.new_empty(query.shape)


@torch.library.register_fake(_attention_out, lib=_lib)
def _(query, key_cache, value_cache, block_tables, seq_lens, out, workspace=None, *options):
    op, options = "paged_attention.out", _named(_ATTENTION_KEYWORDS, options)
    _check_attention(op, query, key_cache, value_cache, block_tables, seq_lens, options)
    _check_devices(op, query.device, out=out, workspace=workspace)
    _expect(
        out.shape == query.shape and out.dtype == query.dtype, op,
        f"out: expected shape {_shape(query)} and dtype {query.dtype} (the query's), "
        f"got shape {_shape(out)} and dtype {out.dtype}",
    )  # fmt: skip


@torch.library.register_fake(_cache_write, lib=_lib)
def _(key, value, key_cache, value_cache, slot_mapping, *options):
    op = "reshape_and_cache"
    _check_devices(op, key.device, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    _expect(key.dim() == 3, op, f"key: expected [T, K, D], got shape {_shape(key)}")
    _expect(value.shape == key.shape, op, f"value: expected shape {_shape(key)} (the key's), got {_shape(value)}")
    _check_index(op, "slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    _expect(
        slot_mapping.shape[0] == key.shape[0], op,
        f"slot_mapping: expected {key.shape[0]} slots (one per key row), got {slot_mapping.shape[0]}",
    )  # fmt: skip


def _check_block_mapping(op: str, block_mapping: torch.Tensor) -> None:
    _check_index(op, "block_mapping", block_mapping, 2, (torch.int32, torch.int64))
    _expect(block_mapping.shape[1] == 2, op, f"block_mapping: expected [P, 2], got shape {_shape(block_mapping)}")


@torch.library.register_fake(_copy_blocks, lib=_lib)
def _(key_caches, value_caches, block_mapping):
    _check_block_mapping("copy_blocks", block_mapping)


@torch.library.register_fake(_swap_blocks, lib=_lib)
def _(src, dst, block_mapping):
    _check_block_mapping("swap_blocks", block_mapping)
    _expect(
        src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype, "swap_blocks",
        f"src {_shape(src)} {src.dtype} and dst {_shape(dst)} {dst.dtype} differ in block shape or dtype",
    )  # fmt: skip


# ---- autograd: inference operators ----

_NO_GRAD_HINT = "run the model under torch.inference_mode() or torch.no_grad()"


def _attention_setup_context(ctx, inputs, output) -> None:
    pass


def _attention_backward(ctx, grad):
    raise RuntimeError(
        "pagedattn::paged_attention has no backward: the pagedattn operators are for inference; " + _NO_GRAD_HINT
    )


_attention.register_autograd(_attention_backward, setup_context=_attention_setup_context)


# The writing operators' Autograd and ADInplaceOrView kernels: the first refuses grad, the
# second bumps the version counters of the written tensors by their (fixed) positions. Both
# hand the call on with `redispatch`, so an eager call crosses the dispatcher once (generic
# kernels that re-bind every argument to the schema on each call cost more than the library
# call itself).


def _writing_kernels(name: str, op: Any) -> None:
    written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    below_autograd = torch._C._after_autograd_keyset
    below_inplace_or_view = torch._C._after_ADInplaceOrView_keyset

    def autograd_kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args, **kwargs):
            raise RuntimeError(
                f"pagedattn::{name} has no backward and was called with an input that requires grad: "
                f"the pagedattn operators are for inference; {_NO_GRAD_HINT}, or detach the inputs"
            )
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args, **kwargs)

    def inplace_or_view_kernel(keyset, *args, **kwargs):
        for i in written:
            if i < len(args) and args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return op.redispatch(keyset & below_inplace_or_view, *args, **kwargs)

    _lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    _lib.impl(name, inplace_or_view_kernel, "ADInplaceOrView", with_keyset=True)


for _name, _overload in (
    ("paged_attention.out", torch.ops.pagedattn.paged_attention.out),
    ("reshape_and_cache", torch.ops.pagedattn.reshape_and_cache.default),
    ("copy_blocks", torch.ops.pagedattn.copy_blocks.default),
    ("swap_blocks", torch.ops.pagedattn.swap_blocks.default),
):
    _writing_kernels(_name, _overload)


# ---- Python entry points: the plain calls' signatures, on the operators ----


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[torch.Tensor] = None,
    **options: Any,
) -> torch.Tensor:
    """:func:`pagedattn.paged_attention` as operators: ``torch.ops.pagedattn.paged_attention``,
    or its ``.out`` overload when ``out`` is given (then returns ``out``). Same options."""
    if "kernel" in options:
        options["decode_kernel"] = options.pop("kernel")
    if out is None:
        if workspace is not None:
            raise ValueError("paged_attention: workspace is taken with out= only (the .out overload)")
        return torch.ops.pagedattn.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, **options)
    torch.ops.pagedattn.paged_attention.out(
        query, key_cache, value_cache, block_tables, seq_lens, out=out, workspace=workspace, **options
    )  # fmt: skip
    return out


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **options: Any) -> None:
    """:func:`pagedattn.reshape_and_cache` as ``torch.ops.pagedattn.reshape_and_cache``."""
    torch.ops.pagedattn.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, **options)


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """:func:`pagedattn.copy_blocks` as ``torch.ops.pagedattn.copy_blocks`` (lists of caches;
    ``block_mapping`` an int64 / int32 tensor [P, 2] on the host or the caches' GPU)."""
    torch.ops.pagedattn.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """:func:`pagedattn.swap_blocks` as ``torch.ops.pagedattn.swap_blocks`` (``block_mapping``
    an int64 / int32 tensor [P, 2] in host memory)."""
    torch.ops.pagedattn.swap_blocks(src, dst, block_mapping)


def empty_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    *,
    layout: Layout = "vllm",
    device: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), uninitialised, shaped by :func:`pagedattn.kv_cache_shape`
    (``dtype`` torch.uint8 for fp8 caches)."""
    key_shape, value_shape = _api.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype, layout)
    return (torch.empty(key_shape, dtype=dtype, device=device), torch.empty(value_shape, dtype=dtype, device=device))
