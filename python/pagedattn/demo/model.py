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

__all__ = ["ModelConfig", "StepInputs", "TinyDecoder"]

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


class TinyDecoder:
    def __init__(self, cfg: ModelConfig, backend: Backend, attn_dtype: str, seed: int) -> None:
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.cfg = cfg
        self.be = backend
        self.attn_dtype = attn_dtype
        self.scale = 1.0 / float(np.sqrt(cfg.head_size))
        rng = np.random.default_rng([seed, 0])
        d, h, k, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_size

        def w(rows: int, cols: int, gain: float = 1.0) -> Any:
            m = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / np.sqrt(rows))
            return backend.from_numpy(m)

        # Embeddings stay on the host: a step gathers a few rows and uploads [T, d].
        self.tok_emb = rng.standard_normal((cfg.vocab, d), dtype=np.float32)
        self.pos_emb = rng.standard_normal((cfg.max_len, d), dtype=np.float32) * np.float32(0.5)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(
                dict(
                    norm1=backend.from_numpy(np.ones(d, np.float32)),
                    qkv=w(d, (h + 2 * k) * hd),
                    out=w(h * hd, d, 0.5),
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
        c = self.cfg
        qkv = self.be.cast(self.be.rmsnorm(x, layer["norm1"]) @ layer["qkv"], self.attn_dtype)
        qkv = qkv.reshape(qkv.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_size)
        h, k = c.num_heads, c.num_kv_heads
        return qkv[:, :h], qkv[:, h : h + k], qkv[:, h + k :]

    def _finish_layer(self, layer: dict, x: Any, attn: Any) -> Any:
        attn = self.be.cast(attn, "float32").reshape(attn.shape[0], self.cfg.num_heads * self.cfg.head_size)
        x = x + attn @ layer["out"]
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
            x = self._finish_layer(layer, x, attn)
        return self._logits(be.take(x, np.asarray(logit_rows, dtype=np.int64)))
