"""A tiny decoder-only transformer with random weights, served through pagedattn.

Pre-norm blocks (RMSNorm, attention, RMSNorm, SiLU MLP), learned position embeddings,
grouped-query attention (``num_heads`` query heads share ``num_kv_heads`` key/value
heads) and one fused QKV projection. The weights are drawn from a seed: the point is
the attention path, not the text. Activations are float32; queries, keys and values
are rounded to the attention dtype (what the KV cache stores).

- **Decode** (one new token per sequence): the new token's K/V go into the paged cache
  with ``pagedattn.reshape_and_cache`` and attention is one ``pagedattn.paged_attention``
  call per layer for the whole batch. Q, K and V are strided views into the fused QKV
  array: no copies.
- **Prefill** (the prompt attending to itself): the new tokens' K/V are written with
  ``reshape_and_cache`` too, but the attention itself is computed densely here (matmul
  with a causal mask, per sequence), reading every key and value, including a cached
  prefix that was never recomputed, back from the paged cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from .backend import Backend
from .kvcache import PagedKVCache

__all__ = ["ModelConfig", "TinyDecoder"]

# observer(phase, layer, q, k, v, out): called once per layer with the layer's new
# queries, keys, values (attention dtype) and attention output. phase is "prefill" or "decode".
Observer = Callable[[str, int, Any, Any, Any, Any], None]


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

    def causal_attention(self, q: Any, k: Any, v: Any, context: int) -> Any:
        """Dense attention of q [t, H, D] over k / v [context + t, K, D] (float32), causal."""
        be, c = self.be, self.cfg
        t, n, g = q.shape[0], k.shape[0], c.num_heads // c.num_kv_heads
        qg = be.permute(q.reshape(t, c.num_kv_heads, g, c.head_size), (1, 2, 0, 3))  # [K, g, t, D]
        qg = qg.reshape(c.num_kv_heads, g * t, c.head_size)
        logits = (qg @ be.permute(k, (1, 2, 0))) * self.scale  # [K, g*t, n]
        allowed = np.arange(n)[None, :] <= (context + np.arange(t))[:, None]  # [t, n]
        mask = be.from_numpy(np.where(allowed, 0.0, -np.inf).astype(np.float32))
        p = be.softmax(logits.reshape(c.num_kv_heads, g, t, n) + mask)
        out = p.reshape(c.num_kv_heads, g * t, n) @ be.permute(v, (1, 0, 2))  # [K, g*t, D]
        return be.permute(out.reshape(c.num_kv_heads, g, t, c.head_size), (2, 0, 1, 3)).reshape(
            t, c.num_heads, c.head_size
        )

    # -- steps --------------------------------------------------------------------------
    def prefill(
        self,
        kv: PagedKVCache,
        tokens: np.ndarray,
        positions: np.ndarray,
        query_start_loc: np.ndarray,
        context_lens: np.ndarray,
        block_tables: list[np.ndarray],
        slot_mapping: np.ndarray,
        observer: Optional[Observer] = None,
    ) -> np.ndarray:
        """Runs the uncomputed tokens of a batch of sequences; returns the last token's logits [S, V].

        ``tokens`` / ``positions`` [T]: the new tokens of all sequences, sequence after
        sequence (``query_start_loc`` [S+1] delimits them); ``context_lens`` [S]: tokens
        already in the cache (prefix-cache hits) before each sequence's new ones;
        ``block_tables``: each sequence's block ids; ``slot_mapping`` [T].
        """
        be = self.be
        x = self._embed(tokens, positions)
        slots = be.index(slot_mapping)
        qsl = [int(i) for i in query_start_loc]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)
            kv.write(li, k, v, slots)
            outs = []
            for i in range(len(qsl) - 1):
                a, b, ctx = qsl[i], qsl[i + 1], int(context_lens[i])
                kk, vv = kv.gather(li, block_tables[i], ctx + b - a)  # context and new tokens, from the cache
                qq, kk, vv = (be.cast(t, "float32") for t in (q[a:b], kk, vv))
                outs.append(self.causal_attention(qq, kk, vv, ctx))
            attn = be.concat(outs, axis=0)
            if observer is not None:
                observer("prefill", li, q, k, v, attn)
            x = self._finish_layer(layer, x, attn)
        return self._logits(be.take(x, np.asarray(qsl[1:], dtype=np.int64) - 1))

    def decode(
        self,
        kv: PagedKVCache,
        tokens: np.ndarray,
        positions: np.ndarray,
        block_tables: np.ndarray,
        seq_lens: np.ndarray,
        slot_mapping: np.ndarray,
        observer: Optional[Observer] = None,
    ) -> np.ndarray:
        """One new token per sequence: tokens / positions / slot_mapping [S], block_tables [S, M],
        seq_lens [S] (including the new token). Returns logits [S, V]."""
        be = self.be
        x = self._embed(tokens, positions)
        slots, tables, lens = be.index(slot_mapping), be.index(block_tables), be.index(seq_lens)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)
            kv.write(li, k, v, slots)
            attn = kv.attend(li, q, tables, lens, self.scale)
            if observer is not None:
                observer("decode", li, q, k, v, attn)
            x = self._finish_layer(layer, x, attn)
        return self._logits(x)
