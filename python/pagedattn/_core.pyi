"""Type stubs of the compiled core, pagedattn._core (use the pagedattn package, not this module).

Written by hand; tests/python/test_stubs.py checks every name and parameter against the
built module. Arrays are any DLPack producer (NumPy, PyTorch, CuPy, JAX, ...): a function
that returns a new array returns one of its query's (or input's) type. Arrays the block
manager makes are NumPy arrays of the dtypes written below.
"""

from collections.abc import Sequence
from typing import Any, Generic, Literal, Optional, Protocol, TypedDict, TypeVar, Union, overload

import numpy as np
import numpy.typing as npt

class SupportsDLPack(Protocol):
    """Any array that exports itself through DLPack (NumPy, PyTorch, CuPy, JAX, ...)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

_Array = TypeVar("_Array", bound=SupportsDLPack)
_Out = TypeVar("_Out", bound=SupportsDLPack)

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
# Integer ids or token ids: a sequence of ints or an integer array.
IntSequence = Union[Sequence[int], npt.NDArray[np.integer[Any]], SupportsDLPack]
# Block pairs [P, 2]: a sequence of (src, dst) pairs or an integer array.
BlockPairs = Union[Sequence[Sequence[int]], Sequence[tuple[int, int]], SupportsDLPack]
# A CUDA stream: an int cudaStream_t handle or an object with __cuda_stream__ (torch, CuPy, ...).
Stream = Optional[object]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
FP8DType = Literal["fp8", "fp8_e4m3", "fp8_e5m2"]
Kernel = Literal["auto", "single_pass", "partitioned"]
Layout = Literal["vllm", "nhd", "hnd"]

__version__: str
with_cuda: bool

class OutOfBlocksError(RuntimeError): ...

class Supported(TypedDict):
    dtypes: list[str]
    kv_cache_dtypes: tuple[str, ...]
    layouts: tuple[str, ...]
    kernels: tuple[str, ...]
    cuda_head_sizes: list[int]
    cuda_head_size_align: int
    cuda_max_head_size: int
    cuda_block_sizes: list[int]
    cpu_max_head_size: int
    cpu_max_block_size: int
    max_context_tokens: int
    variants: tuple[str, ...]

class DecodePlan(TypedDict):
    num_partitions: int
    partition_size: int
    reduce_kernel: bool
    head_tiles: int
    ctas: int
    threads_per_cta: int
    workspace_bytes: int
    varlen_kernel: str

class PrefixCacheStats(TypedDict):
    queried_tokens: int
    hit_tokens: int
    hit_rate: float
    evictions: int

@overload
def paged_attention(
    query: _Array,
    key_cache: SupportsDLPack,
    value_cache: SupportsDLPack,
    block_tables: SupportsDLPack,
    seq_lens: SupportsDLPack,
    *,
    out: None = None,
    scale: Optional[float] = None,
    alibi_slopes: Optional[SupportsDLPack] = None,
    kv_cache_dtype: KVCacheDType = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kernel: Kernel = "auto",
    partition_size: int = 0,
    workspace: Optional[SupportsDLPack] = None,
    check_block_tables: bool = False,
    query_start_loc: Optional[SupportsDLPack] = None,
    max_query_len: Optional[int] = None,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: Optional[SupportsDLPack] = None,
    layout: Optional[Layout] = None,
    stream: Stream = None,
) -> _Array:
    """Paged attention over the KV cache; returns a new array of the query's type, dtype and device.

    query [S, H, D] (one token per sequence), or [T, H, D] with query_start_loc int32 [S+1]
    (sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; max_query_len bounds them).
    Variants: sliding_window=W (keys p - W + 1 .. p), soft_cap=c (c * tanh(logit / c)), sinks float32 [H].
    """

@overload
def paged_attention(
    query: SupportsDLPack,
    key_cache: SupportsDLPack,
    value_cache: SupportsDLPack,
    block_tables: SupportsDLPack,
    seq_lens: SupportsDLPack,
    *,
    out: _Out,
    scale: Optional[float] = None,
    alibi_slopes: Optional[SupportsDLPack] = None,
    kv_cache_dtype: KVCacheDType = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kernel: Kernel = "auto",
    partition_size: int = 0,
    workspace: Optional[SupportsDLPack] = None,
    check_block_tables: bool = False,
    query_start_loc: Optional[SupportsDLPack] = None,
    max_query_len: Optional[int] = None,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: Optional[SupportsDLPack] = None,
    layout: Optional[Layout] = None,
    stream: Stream = None,
) -> _Out:
    """Paged attention over the KV cache, written into `out` (like the query); returns `out`."""

class PreparedDecode(Generic[_Array]):
    """A paged_attention call validated once; run() launches it and returns the output."""

    def __init__(
        self,
        query: _Array,
        key_cache: SupportsDLPack,
        value_cache: SupportsDLPack,
        block_tables: SupportsDLPack,
        seq_lens: SupportsDLPack,
        *,
        out: Optional[_Array] = None,
        scale: Optional[float] = None,
        alibi_slopes: Optional[SupportsDLPack] = None,
        kv_cache_dtype: KVCacheDType = "auto",
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        kernel: Kernel = "auto",
        partition_size: int = 0,
        workspace: Optional[SupportsDLPack] = None,
        check_block_tables: bool = False,
        query_start_loc: Optional[SupportsDLPack] = None,
        max_query_len: Optional[int] = None,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
        sinks: Optional[SupportsDLPack] = None,
        layout: Optional[Layout] = None,
        stream: Stream = None,
    ) -> None: ...
    def run(self, stream: Stream = None) -> _Array: ...
    def __call__(self, stream: Stream = None) -> _Array: ...
    @property
    def out(self) -> _Array: ...

def reshape_and_cache(
    key: SupportsDLPack,
    value: SupportsDLPack,
    key_cache: SupportsDLPack,
    value_cache: SupportsDLPack,
    slot_mapping: SupportsDLPack,
    *,
    kv_cache_dtype: KVCacheDType = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    layout: Optional[Layout] = None,
    stream: Stream = None,
) -> None:
    """Writes key / value [T, K, D] into the cache slots of slot_mapping (int32 / int64 [T]), in place."""

def decode_workspace_size(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_blocks_per_seq: int,
    dtype: object,
    layout: Layout = "vllm",
    device: int = 0,
    *,
    scale: Optional[float] = None,
    kv_cache_dtype: KVCacheDType = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kernel: Kernel = "auto",
    partition_size: int = 0,
    check_block_tables: bool = False,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> int:
    """Bytes of CUDA scratch paged_attention needs for these sizes and options (0: none)."""

def decode_plan(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_blocks_per_seq: int,
    dtype: object,
    layout: Layout = "vllm",
    device: int = 0,
    *,
    scale: Optional[float] = None,
    kv_cache_dtype: KVCacheDType = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kernel: Kernel = "auto",
    partition_size: int = 0,
    check_block_tables: bool = False,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> DecodePlan:
    """How paged_attention runs on CUDA for these sizes and options."""

def kv_cache_shape(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: object,
    layout: Layout = "vllm",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key_shape, value_shape) of a paged KV cache; dtype: a NumPy / torch dtype or a name."""

def exchange_api_available(obj: object) -> bool: ...
def num_threads() -> int: ...
def supported() -> Supported: ...
def copy_blocks(
    key_caches: Union[SupportsDLPack, Sequence[SupportsDLPack]],
    value_caches: Union[SupportsDLPack, Sequence[SupportsDLPack]],
    block_mapping: BlockPairs,
    *,
    stream: Stream = None,
) -> None:
    """cache[dst] = cache[src] for every (src, dst) pair and every cache of the lists."""

def swap_blocks(src: SupportsDLPack, dst: SupportsDLPack, block_mapping: BlockPairs, *, stream: Stream = None) -> None:
    """dst[d] = src[s] for every (s, d) pair: GPU <-> pinned host, or host <-> host."""

def quantize_fp8(
    src: SupportsDLPack, dst: _Out, *, scale: float = 1.0, fp8_dtype: FP8DType = "fp8_e4m3", stream: Stream = None
) -> _Out:
    """dst (uint8) = fp8(src / scale), rounded to nearest even, saturating; returns dst."""

def dequantize_fp8(
    src: SupportsDLPack, dst: _Out, *, scale: float = 1.0, fp8_dtype: FP8DType = "fp8_e4m3", stream: Stream = None
) -> _Out:
    """dst (float32 / float16 / bfloat16) = fp8 value of src (uint8 codes) * scale; returns dst."""

class StepMetadata:
    """What one BlockManager.step hands the forward pass (arrays passed in as out= are returned as given)."""

    @property
    def block_tables(self) -> Int32Array: ...
    @property
    def seq_lens(self) -> Int32Array: ...
    @property
    def context_lens(self) -> Int32Array: ...
    @property
    def query_start_loc(self) -> Int32Array: ...
    @property
    def slot_mapping(self) -> Int64Array: ...
    @property
    def copy_pairs(self) -> Int64Array: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def max_query_len(self) -> int: ...

class PrefixPeek:
    """What add_sequence would find in the prefix cache for a prompt (BlockManager.peek_prefix)."""

    @property
    def cached_tokens(self) -> int: ...
    @property
    def new_blocks(self) -> int: ...
    @property
    def reused_cached_blocks(self) -> int: ...
    @property
    def fits(self) -> bool: ...

class BlockManager:
    """Host-side KV block manager (see pagedattn.block_manager)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
        watermark: float = 0.0,
        sliding_window: int = 0,
    ) -> None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def watermark_blocks(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_available_blocks(self) -> int: ...
    @property
    def num_free_cpu_blocks(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def num_pending_copies(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, seq_id: int) -> bool: ...
    @property
    def prefix_cache_stats(self) -> PrefixCacheStats: ...
    def reset_prefix_cache_stats(self) -> None: ...
    def add_sequence(self, seq_id: int, token_ids: IntSequence, *, extra_key: int = 0) -> int: ...
    def append_tokens(self, seq_id: int, token_ids: IntSequence) -> Int64Array: ...
    def append_tokens_batch(self, seq_ids: IntSequence, token_ids: IntSequence) -> Int64Array: ...
    def add_sequence_by_count(self, seq_id: int, num_tokens: int) -> int: ...
    def peek_prefix(self, token_ids: IntSequence, *, extra_key: int = 0) -> PrefixPeek: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def fork_batch(self, parent_ids: Union[IntSequence, int], child_ids: IntSequence) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def free_batch(self, seq_ids: IntSequence) -> None: ...
    def reset_incremental_export(self) -> None: ...
    def step_into(
        self,
        seq_ids: IntSequence,
        token_ids: Optional[IntSequence] = None,
        *,
        query_lens: Optional[IntSequence] = None,
        block_tables: Optional[SupportsDLPack] = None,
        seq_lens: Optional[SupportsDLPack] = None,
        context_lens: Optional[SupportsDLPack] = None,
        query_start_loc: Optional[SupportsDLPack] = None,
        slot_mapping: Optional[SupportsDLPack] = None,
        pad: int = 0,
        incremental: bool = True,
    ) -> StepMetadata: ...
    def step(
        self,
        seq_ids: IntSequence,
        token_ids: Optional[IntSequence] = None,
        *,
        query_lens: Optional[IntSequence] = None,
        block_tables: Optional[SupportsDLPack] = None,
        seq_lens: Optional[SupportsDLPack] = None,
        context_lens: Optional[SupportsDLPack] = None,
        query_start_loc: Optional[SupportsDLPack] = None,
        slot_mapping: Optional[SupportsDLPack] = None,
        max_blocks: Optional[int] = None,
        pad: int = 0,
    ) -> StepMetadata: ...
    def take_copy_pairs(self) -> Int64Array: ...
    def swap_out(self, seq_ids: IntSequence) -> Int64Array: ...
    def swap_in(self, seq_ids: IntSequence) -> Int64Array: ...
    def can_allocate(self, token_ids: Union[IntSequence, int], *, extra_key: int = 0) -> bool: ...
    def can_append(self, seq_id: int, num_tokens: int = 1) -> bool: ...
    def can_append_batch(self, seq_ids: IntSequence) -> bool: ...
    def can_swap_out(self, seq_ids: IntSequence) -> bool: ...
    def can_swap_in(self, seq_ids: IntSequence) -> bool: ...
    @overload
    def block_tables(
        self, seq_ids: IntSequence, *, out: None = None, max_blocks: Optional[int] = None, pad: int = 0
    ) -> Int32Array: ...
    @overload
    def block_tables(
        self, seq_ids: IntSequence, *, out: _Out, max_blocks: Optional[int] = None, pad: int = 0
    ) -> _Out: ...
    @overload
    def seq_lens(self, seq_ids: IntSequence, *, out: None = None) -> Int32Array: ...
    @overload
    def seq_lens(self, seq_ids: IntSequence, *, out: _Out) -> _Out: ...
    def csr(self, seq_ids: IntSequence, *, pad: int = 0) -> tuple[Int32Array, Int32Array, Int32Array]: ...
    def slots(self, seq_id: int, start: int = 0, stop: Optional[int] = None) -> Int64Array: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def token_ids(self, seq_id: int) -> Int32Array: ...
    def seq_len(self, seq_id: int) -> int: ...
    def num_computed(self, seq_id: int) -> int: ...
    def is_swapped(self, seq_id: int) -> bool: ...
    def sequence_ids(self) -> list[int]: ...
    def ref_count(self, block: int) -> int: ...
    def cpu_ref_count(self, block: int) -> int: ...
    def is_cached(self, block: int) -> bool: ...
    def check_invariants(self) -> None: ...
