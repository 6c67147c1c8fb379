"""End to end: the block manager drives reshape_and_cache and paged_attention on the CPU.

A batch with prefix-cache hits, forks (copy-on-write), a swap out / swap in and a
recompute-style re-admission runs for several decode steps. Every token's K/V is a pure
function of the token prefix it ends (as in a real model), so a reused cached block holds
exactly the right values. After each step every sequence's attention output must equal
dense float64 attention over all of its tokens. Unused cache slots are NaN, so a wrong
block id or slot shows up as NaN.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

pagedattn = pytest.importorskip("pagedattn")

NUM_BLOCKS, BS, KV_HEADS, HEADS, D = 48, 4, 2, 4, 16


def kv_of(tokens):
    """K and V [len, KV_HEADS, D] for every position: a function of the prefix ending there."""
    ks, vs = [], []
    for p in range(len(tokens)):
        seed = zlib.crc32(np.asarray(tokens[: p + 1], dtype=np.int64).tobytes())
        r = np.random.default_rng(seed)
        ks.append(r.standard_normal((KV_HEADS, D)))
        vs.append(r.standard_normal((KV_HEADS, D)))
    return np.array(ks), np.array(vs)


def dense(q, k, v, scale):
    """q [H, D]; k, v [L, K, D] float64 -> [H, D]."""
    group = HEADS // KV_HEADS
    out = np.empty((HEADS, D))
    for h in range(HEADS):
        logits = k[:, h // group, :] @ q[h] * scale
        w = np.exp(logits - logits.max())
        out[h] = (w / w.sum()) @ v[:, h // group, :]
    return out


class Engine:
    def __init__(self):
        self.m = pagedattn.BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True, num_cpu_blocks=32)
        kshape, vshape = pagedattn.kv_cache_shape(NUM_BLOCKS, BS, KV_HEADS, D, np.float32, layout="nhd")
        self.kc = np.full(kshape, np.nan, dtype=np.float32)
        self.vc = np.full(vshape, np.nan, dtype=np.float32)
        self.kc_cpu = np.full((32,) + tuple(kshape[1:]), np.nan, dtype=np.float32)
        self.vc_cpu = np.full((32,) + tuple(vshape[1:]), np.nan, dtype=np.float32)
        self.tokens = {}
        self.rng = np.random.default_rng(0)
        self.checked = 0

    def write(self, md, ids):
        # Copy-on-write copies first, then the new tokens' K/V.
        for src, dst in md.copy_pairs.tolist():
            self.kc[dst] = self.kc[src]
            self.vc[dst] = self.vc[src]
        ks, vs = [], []
        for sid, ctx, q in zip(ids, md.context_lens.tolist(), np.diff(md.query_start_loc).tolist()):
            k, v = kv_of(self.tokens[sid][: ctx + q])
            ks.append(k[ctx:])
            vs.append(v[ctx:])
        if md.num_tokens:
            key = np.concatenate(ks).astype(np.float32)
            value = np.concatenate(vs).astype(np.float32)
            pagedattn.reshape_and_cache(key, value, self.kc, self.vc, md.slot_mapping)

    def add(self, sid, prompt):
        self.tokens[sid] = list(prompt)
        hit = self.m.add_sequence(sid, prompt)
        md = self.m.step([sid])  # prefill: only the tokens not found in the cache
        assert md.context_lens.tolist() == [hit] and md.num_tokens == len(prompt) - hit
        self.write(md, [sid])
        return hit

    def decode(self, ids):
        new = self.rng.integers(0, 50, size=len(ids)).astype(np.int32)
        for sid, t in zip(ids, new.tolist()):
            self.tokens[sid].append(t)
        md = self.m.step(ids, new)
        assert md.query_start_loc.tolist() == list(range(len(ids) + 1))
        self.write(md, ids)
        q = self.rng.standard_normal((len(ids), HEADS, D))
        scale = 1.0 / np.sqrt(D)
        out = pagedattn.paged_attention(
            q.astype(np.float32), self.kc, self.vc, md.block_tables, md.seq_lens, scale=scale
        )
        for i, sid in enumerate(ids):
            k, v = kv_of(self.tokens[sid])
            np.testing.assert_allclose(out[i], dense(q[i], k, v, scale), rtol=2e-4, atol=2e-5)
            self.checked += 1


def test_manager_drives_cache_write_and_attention():
    e = Engine()
    m = e.m
    system = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]  # 2 full blocks + 2 tokens
    assert e.add(0, system + [11, 12, 13]) == 0
    assert e.add(1, system + [21]) == 8  # prefix hit: two blocks reused
    assert m.block_table(1)[:2] == m.block_table(0)[:2]
    e.decode([0, 1])
    # Parallel sampling: fork seq 0 twice; their first appends copy the shared last block.
    m.fork(0, 2)
    m.fork(0, 3)
    assert m.ref_count(m.block_table(0)[-1]) == 3
    e.tokens[2] = list(e.tokens[0])
    e.tokens[3] = list(e.tokens[0])
    e.decode([0, 1, 2, 3])
    assert len({m.block_table(i)[-1] for i in (0, 2, 3)}) == 3
    for _ in range(3):
        e.decode([0, 1, 2, 3])
    # Preempt seq 3 by swapping it out, run a step without it, swap it back in.
    pairs = m.swap_out([3])
    assert pairs.shape[1] == 2 and pairs.shape[0] == len(m.block_table(3))
    e.kc_cpu[pairs[:, 1]] = e.kc[pairs[:, 0]]
    e.vc_cpu[pairs[:, 1]] = e.vc[pairs[:, 0]]
    e.decode([0, 1, 2])
    pairs = m.swap_in([3])
    e.kc[pairs[:, 1]] = e.kc_cpu[pairs[:, 0]]
    e.vc[pairs[:, 1]] = e.vc_cpu[pairs[:, 0]]
    e.decode([0, 1, 2, 3])
    # Preempt seq 2 by recomputation: free it and re-add all of its tokens (prefix hits).
    toks2 = list(e.tokens[2])
    m.free(2)
    hit = e.add(2, toks2)
    assert hit >= 8 and hit % BS == 0
    e.decode([0, 1, 2, 3])
    # A new request sharing the system prompt while the others keep running.
    assert e.add(4, system + [30, 31, 32, 33, 34]) == 8
    for _ in range(2):
        e.decode([0, 1, 2, 3, 4])
    assert e.checked == 2 + 4 * 4 + 3 + 4 + 4 + 10
    assert m.prefix_cache_stats["hit_tokens"] >= 8 * 3
    for sid in list(e.tokens):
        m.free(sid)
    assert m.num_used_blocks == 0
    m.check_invariants()
