"""A tiny decoder-only transformer with random weights, served through pagedattn.

Pre-norm blocks (RMSNorm, attention, RMSNorm, SiLU MLP), learned position embeddings,
grouped-query attention (``num_heads`` query heads share ``num_kv_heads`` key/value
heads) and one fused QKV projection. The weights are drawn from a seed: the point is
the attention path, not the text. Activations are float32; queries, keys and values
are rounded to the attention dtype (what the KV cache stores).

One :meth:`TinyDecoder.forward` runs a whole engine step: the decode tokens of the
running sequences and the prompt chunks being prefilled, concatenated into T rows. Per
layer, the rows' keys and values go into the paged cache with
``pagedattn.reshape_and_cache`` (by the step's slot mapping) and then ONE
``pagedattn.paged_attention`` call with ``query_start_loc`` serves every row: sequence
i owns rows ``query_start_loc[i] .. query_start_loc[i+1]``, its last tokens, which
attend causally to everything the cache holds for it (a cached prefix, its own earlier
chunks, the chunk itself). A decode is the one-row case. Q, K and V are strided views
into the fused QKV array: no copies. There is no other attention path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from .backend import Backend
from .kvcache import PagedKVCache

__all__ = ["ModelConfig", "Shard", "StepInputs", "TinyDecoder", "kv_heads_per_rank"]

# observer(layer, q, k, v, out): called once per layer with the step's queries [T, H, D],
# keys and values [T, K, D] (attention dtype) and attention output [T, H, D].
Observer = Callable[[int, Any, Any, Any, Any], None]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The attention metadata of one step, host arrays from ``BlockManager.step`` (S
    sequences, T scheduled tokens, M block-table width)."""

    block_tables: np.ndarray  # int32 [S, M]
    seq_lens: np.ndarray  # int32 [S]: tokens in the cache after this step's writes
    query_start_loc: np.ndarray  # int32 [S+1]: sequence i owns rows [qsl[i], qsl[i+1])
    slot_mapping: np.ndarray  # int64 [T]: the cache slot of every row's key and value
    max_query_len: int  # the longest q_i (a host-side bound for the GPU grid)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 512
    d_model: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    d_ff: int = 512
    max_len: int = 1024

    def describe(self) -> str:
        kind = "grouped-query" if self.num_kv_heads < self.num_heads else "multi-head"
        return (
            f"{self.num_layers} layers, d_model {self.d_model}, {self.num_heads} query / {self.num_kv_heads} KV heads "
            f"({kind}), head size {self.head_size}, vocab {self.vocab}"
        )

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * itemsize


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """ValueError unless ``world`` ranks can share the model's heads: N must divide the
    query heads, and divide the KV heads (N <= K) or be a multiple of them (N > K: each KV
    head is replicated on N / K ranks)."""
    h, k = cfg.num_heads, cfg.num_kv_heads
    what = f"--tensor-parallel {world}: the model has {h} query / {k} KV heads;"
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise ValueError(f"--tensor-parallel must be a whole number of ranks >= 1, got {world!r}")
    if h % world:
        raise ValueError(f"{what} the rank count must divide the query heads ({h})")
    if world <= k and k % world:
        raise ValueError(f"{what} a rank count up to {k} must divide the KV heads")
    if world > k and world % k:
        raise ValueError(f"{what} a rank count above {k} must be a multiple of the KV heads (each is replicated)")


def kv_heads_per_rank(cfg: ModelConfig, world: int) -> int:
    """KV heads each of ``world`` ranks holds (K / N, or 1 replicated head when N > K)."""
    return max(cfg.num_kv_heads // world, 1)


@dataclasses.dataclass(frozen=True)
class Shard:
    """The heads rank ``rank`` of ``world`` holds: query heads [q_start, q_start + num_heads)
    and KV heads [kv_start, kv_start + num_kv_heads) of the full model."""

    rank: int
    world: int
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int

    @classmethod
    def of(cls, cfg: ModelConfig, world: int, rank: int) -> Shard:
        check_tensor_parallel(cfg, world)
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        hq = cfg.num_heads // world
        kq = kv_heads_per_rank(cfg, world)
        # A query head h reads KV head h // (H / K); the rank's first query head names its first KV head.
        kv_start = (rank * hq) // (cfg.num_heads // cfg.num_kv_heads)
        return cls(rank, world, rank * hq, hq, kv_start, kq)

    def describe(self, cfg: ModelConfig) -> str:
        rep = self.world // cfg.num_kv_heads if self.world > cfg.num_kv_heads else 1
        kv = f"{self.num_kv_heads} of {cfg.num_kv_heads} KV heads" + (f" (each on {rep} ranks)" if rep > 1 else "")
        return f"{self.num_heads} of {cfg.num_heads} query heads and {kv}"


class TinyDecoder:
    def __init__(
        self,
        cfg: ModelConfig,
        backend: Backend,
        attn_dtype: str,
        seed: int,
        *,
        shard: Optional[Shard] = None,
        comm: Optional[Any] = None,
    ) -> None:
        """``shard``: the heads this rank holds (None: all of them, one process); ``comm``:
        the ranks' all-reduce (``comm.all_reduce(partial) -> sum over ranks``), needed with
        a shard."""
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if shard is not None and comm is None:
            raise ValueError("a sharded TinyDecoder needs comm (the ranks' all-reduce)")
        self.cfg = cfg
        self.be = backend
        self.attn_dtype = attn_dtype
        self.scale = 1.0 / float(np.sqrt(cfg.head_size))
        self.shard = shard
        self.comm = comm
        # Called after each layer's attention with (layer, attention output [T, h, D], the
        # residual stream [T, d] after the all-reduce): the trace of a tensor-parallel run.
        self.layer_hook: Optional[Callable[[int, Any, Any], None]] = None
        rng = np.random.default_rng([seed, 0])
        d, h, k, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        self.num_heads = shard.num_heads if shard else h  # heads computed here
        self.num_kv_heads = shard.num_kv_heads if shard else k
        if shard is None:
            qkv_cols = out_rows = slice(None)
        else:  # the full weights are drawn (same stream as one process), then sliced
            heads = np.arange(shard.q_start, shard.q_start + shard.num_heads)
            kvh = np.arange(shard.kv_start, shard.kv_start + shard.num_kv_heads)
            cols = np.concatenate([heads, h + kvh, h + k + kvh])[:, None] * hd + np.arange(hd)
            qkv_cols, out_rows = cols.reshape(-1), (heads[:, None] * hd + np.arange(hd)).reshape(-1)

        def w(rows: int, cols: int, gain: float = 1.0, take_rows=slice(None), take_cols=slice(None)) -> Any:
            m = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / np.sqrt(rows))
            return backend.from_numpy(np.ascontiguousarray(m[take_rows][:, take_cols]))

        # Embeddings stay on the host: a step gathers a few rows and uploads [T, d].
        self.tok_emb = rng.standard_normal((cfg.vocab, d), dtype=np.float32)
        self.pos_emb = rng.standard_normal((cfg.max_len, d), dtype=np.float32) * np.float32(0.5)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                dict(
                    norm1=backend.from_numpy(np.ones(d, np.float32)),
                    qkv=w(d, (h + 2 * k) * hd, take_cols=qkv_cols),
                    out=w(h * hd, d, 0.5, take_rows=out_rows),
                    norm2=backend.from_numpy(np.ones(d, np.float32)),
                    up=w(d, cfg.d_ff),
                    down=w(cfg.d_ff, d, 0.5),
                )
            )
        self.norm_f = backend.from_numpy(np.ones(d, np.float32))
        self.unembed = w(d, cfg.vocab)

    # -- pieces -------------------------------------------------------------------------
    def _embed(self, tokens: np.ndarray, positions: np.ndarray) -> Any:
        if positions.size and int(positions.max()) >= self.cfg.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds the model's max_len {self.cfg.max_len}")
        return self.be.from_numpy(self.tok_emb[tokens] + self.pos_emb[positions])

    def _qkv(self, layer: dict, x: Any) -> tuple[Any, Any, Any]:
        """q [T, H, D], k / v [T, K, D] in the attention dtype: strided views of one array."""
        h, k = self.num_heads, self.num_kv_heads
        qkv = self.be.cast(self.be.rmsnorm(x, layer["norm1"]) @ layer["qkv"], self.attn_dtype)
        qkv = qkv.reshape(qkv.shape[0], h + 2 * k, self.cfg.head_size)
        return qkv[:, :h], qkv[:, h : h + k], qkv[:, h + k :]

    def _finish_layer(self, li: int, layer: dict, x: Any, attn: Any) -> Any:
        flat = self.be.cast(attn, "float32").reshape(attn.shape[0], self.num_heads * self.cfg.head_size)
        proj = flat @ layer["out"]
        if self.comm is not None:  # row-parallel output projection: the ranks' partial sums meet here
            proj = self.comm.all_reduce(proj)
        x = x + proj
        if self.layer_hook is not None:
            self.layer_hook(li, attn, x)
        return x + self.be.silu(self.be.rmsnorm(x, layer["norm2"]) @ layer["up"]) @ layer["down"]

    def _logits(self, x: Any) -> np.ndarray:
        return self.be.to_numpy(self.be.rmsnorm(x, self.norm_f) @ self.unembed)

    # -- the step -----------------------------------------------------------------------
    def forward(
        self,
        kv: PagedKVCache,
        tokens: np.ndarray,
        positions: np.ndarray,
        step: StepInputs,
        logit_rows: np.ndarray,
        observer: Optional[Observer] = None,
    ) -> np.ndarray:
        """Runs one step's rows; returns the logits [R, V] of rows ``logit_rows`` [R].

        ``tokens`` / ``positions`` [T]: every scheduled token of the step, sequence after
        sequence as ``step.query_start_loc`` delimits them (a decode is one row, a prompt
        chunk several); ``step`` carries the block manager's metadata for the call.
        """
        be = self.be
        x = self._embed(tokens, positions)
        slots = be.index(step.slot_mapping)
        tables, lens, qsl = be.index(step.block_tables), be.index(step.seq_lens), be.index(step.query_start_loc)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)
            kv.write(li, k, v, slots)
            attn = kv.attend(li, q, tables, lens, qsl, step.max_query_len, self.scale)
            if observer is not None:
                observer(li, q, k, v, attn)
            x = self._finish_layer(li, layer, x, attn)
        return self._logits(be.take(x, np.asarray(logit_rows, dtype=np.int64)))
