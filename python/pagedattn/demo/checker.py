"""Checks every attention output row of the serving loop against dense float64 attention.

For every sequence the checker keeps its true key/value history on the host: the
values the model computed for each of its tokens, in the order of its tokens,
independent of blocks, slots and tables. Every row of every step's ``paged_attention``
call (a decode token, or any row of a prompt chunk: the row at position p must equal
causal float64 attention over the sequence's tokens 0 .. p, its cached prefix and
earlier chunks included) is compared with ``pagedattn.reference.causal_attention`` over
that history. A wrong block table, slot, query_start_loc, copy-on-write copy, swap or
prefix-cache block therefore shows up as a mismatch.

Prefix-cache hits: the hit tokens were computed by another (or an earlier incarnation
of the same) sequence; their history comes from a host store of every full block any
sequence computed, keyed by a hash chain over the token ids (the same identity the
block manager uses), never from the paged cache itself. When two sequences compute the
same block, the later one wins in the store, as it does in the manager.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Optional

import numpy as np

from pagedattn.reference import causal_attention

from .backend import Backend

__all__ = ["AttentionMismatch", "Checker", "TOLERANCE"]

# (atol, rtol) of an output against float64 attention over the same rounded inputs: the
# unit tests' tolerances (float32 accumulation, one output rounding) with a 2x margin.
TOLERANCE = {"float32": (4e-5, 4e-5), "float16": (3e-3, 3e-3), "bfloat16": (2.4e-2, 2.4e-2)}


class AttentionMismatch(RuntimeError):
    """An attention output differs from dense float64 attention over the sequence's tokens."""


class _History:
    __slots__ = ("k", "v", "n", "digests")

    def __init__(self, layers: int, heads: int, size: int, cap: int) -> None:
        self.k = np.empty((layers, cap, heads, size), np.float32)
        self.v = np.empty((layers, cap, heads, size), np.float32)
        self.n = 0  # tokens whose K/V are complete in every layer
        self.digests: list[bytes] = []  # hash chain of the full blocks recorded so far

    def reserve(self, n: int) -> None:
        cap = self.k.shape[1]
        if n <= cap:
            return
        new = max(n, 2 * cap)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = np.empty((old.shape[0], new) + old.shape[2:], np.float32)
            grown[:, : self.n] = old[:, : self.n]
            setattr(self, name, grown)

    def copy(self) -> _History:
        h = _History.__new__(_History)
        h.k, h.v, h.n, h.digests = self.k.copy(), self.v.copy(), self.n, list(self.digests)
        return h


def _chain(prev: bytes, tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(prev + np.ascontiguousarray(tokens, dtype=np.int32).tobytes(), digest_size=16).digest()


class Checker:
    def __init__(
        self,
        backend: Backend,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        scale: float,
        dtype: str,
        sample: float = 1.0,
        seed: int = 0,
        prefix_caching: bool = True,
    ) -> None:
        self.be = backend
        self.layers, self.heads, self.size = num_layers, num_kv_heads, head_size
        self.bs = block_size
        self.scale = scale
        self.dtype = dtype
        self.atol, self.rtol = TOLERANCE[dtype]
        self.sample = float(sample)
        self.rng = np.random.default_rng([seed, 2])
        self.prefix_caching = prefix_caching
        self.hist: dict[int, _History] = {}
        self.store: dict[bytes, tuple[int, np.ndarray, np.ndarray]] = {}  # digest -> (block, k, v)
        self.block_digest: dict[int, bytes] = {}  # physical block -> digest last recorded there
        self.checked = {"decode": 0, "prefill": 0}  # output rows compared (all layers)
        self.worst = 0.0  # largest |out - ref| / (atol + rtol |ref|) seen
        self.seconds = 0.0
        self._batch: Optional[tuple] = None

    # -- sequences ----------------------------------------------------------------------
    def start(self, sid: int, tokens: np.ndarray, hit: int) -> None:
        """A sequence (re)enters the cache: its first ``hit`` tokens came from the prefix cache."""
        h = _History(self.layers, self.heads, self.size, max(len(tokens), 16))
        prev = b""
        for b in range(hit // self.bs):
            prev = _chain(prev, tokens[b * self.bs : (b + 1) * self.bs])
            entry = self.store.get(prev)
            if entry is None:
                raise AttentionMismatch(
                    f"sequence {sid}: the block manager reported a prefix-cache hit on block {b} "
                    f"(tokens {b * self.bs}..{(b + 1) * self.bs - 1}), but no sequence ever computed that prefix"
                )
            h.k[:, b * self.bs : (b + 1) * self.bs] = entry[1]
            h.v[:, b * self.bs : (b + 1) * self.bs] = entry[2]
            h.digests.append(prev)
        h.n = hit
        self.hist[sid] = h

    def fork(self, parent: int, child: int) -> None:
        self.hist[child] = self.hist[parent].copy()

    def drop(self, sid: int) -> None:
        del self.hist[sid]

    def length(self, sid: int) -> int:
        return self.hist[sid].n

    # -- prefix store -------------------------------------------------------------------
    def record_blocks(self, sid: int, tokens: np.ndarray, block_table: Callable[[], list]) -> None:
        """Stores the full blocks of the sequence not recorded yet (call after each step)."""
        if not self.prefix_caching:
            return
        h = self.hist[sid]
        full = h.n // self.bs
        if full <= len(h.digests):
            return
        table = block_table()
        prev = h.digests[-1] if h.digests else b""
        for b in range(len(h.digests), full):
            prev = _chain(prev, tokens[b * self.bs : (b + 1) * self.bs])
            sl = slice(b * self.bs, (b + 1) * self.bs)
            self.store[prev] = (int(table[b]), h.k[:, sl].copy(), h.v[:, sl].copy())
            self.block_digest[int(table[b])] = prev
            h.digests.append(prev)

    def prune(self, is_cached: Callable[[int], bool]) -> None:
        """Forgets store entries whose block the manager no longer holds for that prefix."""
        for digest, (block, _, _) in list(self.store.items()):
            if self.block_digest.get(block) != digest or not is_cached(block):
                del self.store[digest]
                if self.block_digest.get(block) == digest:
                    del self.block_digest[block]

    # -- steps --------------------------------------------------------------------------
    def begin_step(self, sids: list[int], query_lens: list[int], decode: list[bool]) -> None:
        """The next observed layers are one step: sequence sids[i] owns query_lens[i] rows
        (its next tokens), a decode token when decode[i], else a prompt chunk."""
        for sid, t in zip(sids, query_lens):
            self.hist[sid].reserve(self.hist[sid].n + t)
        n = len(sids)
        check = self.rng.random(n) < self.sample if self.sample < 1.0 else np.ones(n, bool)
        self._batch = (sids, np.asarray(query_lens, np.int64), list(decode), check)

    def end_step(self) -> None:
        sids, counts, _, _ = self._batch
        for sid, t in zip(sids, counts.tolist()):
            self.hist[sid].n += t
        self._batch = None

    def observe(self, layer: int, q: Any, k: Any, v: Any, out: Any) -> None:
        """Model observer: records the layer's new K/V and checks its attention output rows."""
        t0 = time.perf_counter()
        sids, counts, decode, check = self._batch
        q, k, v, out = (self.be.to_numpy(a) for a in (q, k, v, out))
        row = 0
        for i, (sid, t) in enumerate(zip(sids, counts.tolist())):
            h = self.hist[sid]
            h.k[layer, h.n : h.n + t] = k[row : row + t]
            h.v[layer, h.n : h.n + t] = v[row : row + t]
            if check[i] and t:
                self._compare(
                    "decode" if decode[i] else "prefill", layer, sid, h.n, q[row : row + t], out[row : row + t],
                    h.k[layer, : h.n + t], h.v[layer, : h.n + t],
                )  # fmt: skip
            row += t
        self.seconds += time.perf_counter() - t0

    def _compare(self, phase, layer, sid, first, q, out, k, v) -> None:
        """Rows q / out [t, H, D] at positions first .. first + t - 1 against k / v [first + t, K, D]."""
        ref = causal_attention(q, k, v, self.scale)  # float64 (float32 inputs widen exactly)
        bound = self.atol + self.rtol * np.abs(ref)
        err = np.abs(out.astype(np.float64) - ref)
        finite = np.isfinite(out).all()
        ratio = float(np.max(err / bound)) if finite else float("inf")
        self.checked[phase] += len(q)
        if not ratio <= 1.0:
            worst = np.where(np.isfinite(err), err / bound, np.inf)
            r, head, dim = np.unravel_index(int(np.argmax(worst)), err.shape)
            pos = first + int(r)
            what = "" if phase == "decode" else f" (row {int(r)} of a {len(q)}-row prompt chunk)"
            raise AttentionMismatch(
                f"{phase} attention output of sequence {sid}{what} (layer {layer}, query position {pos}, "
                f"{pos + 1} tokens) differs from dense float64 attention over its own tokens: "
                f"head {head}, dim {dim}: got {float(out[r, head, dim]):.6g}, expected {ref[r, head, dim]:.6g} "
                f"(|error| {err[r, head, dim]:.3g} > atol {self.atol:g} + rtol {self.rtol:g} * |expected|)"
            )
        self.worst = max(self.worst, ratio)
