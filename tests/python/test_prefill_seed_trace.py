"""The seeds' chunked-prefill trace, end to end on the CPU: two 484-token prompts under a
512-token budget (OPT-125m-like attention: 12 heads, head size 64, block size 16, small
random weights), scheduled by the block manager, written into the paged cache by its
slot_mapping with reshape_and_cache, and attended with paged_attention(query_start_loc=...).

The seed's attention metadata for the three steps (sequence order as the engine logged it):
  1: seq_lens [28, 484], query_start_loc [0, 28, 512], context_lens [0, 0]    (B's first 28, all of A)
  2: seq_lens [485, 484], query_start_loc [0, 1, 457], context_lens [484, 28]  (A decodes, B's last 456)
  3: seq_lens [486, 485], query_start_loc [0, 1, 2], context_lens [485, 484]   (two decodes)
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from conftest import LAYOUTS
from pagedattn.reference import causal_attention

H, D, BS, PROMPT, BUDGET = 12, 64, 16, 484, 512
A, B = 0, 1


class Model:
    """Just the attention of one layer: token ids -> q, k, v by small random projections."""

    def __init__(self, rng, vocab=1000, width=32):
        self.embed = rng.standard_normal((vocab, width)) * 0.5
        self.wq, self.wk, self.wv = (rng.standard_normal((width, H * D)) / np.sqrt(width) for _ in range(3))

    def qkv(self, tokens):
        x = self.embed[np.asarray(tokens)]
        return tuple((x @ w).reshape(len(tokens), H, D) for w in (self.wq, self.wk, self.wv))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_seed_trace(rng, layout, dtype):
    model = Model(rng)
    tokens = {A: list(rng.integers(0, 1000, PROMPT)), B: list(rng.integers(0, 1000, PROMPT))}
    num_blocks = 80
    m = pagedattn.BlockManager(num_blocks, BS)
    kshape, vshape = pagedattn.kv_cache_shape(num_blocks, BS, H, D, dtype, layout)
    kc = np.full(kshape, np.nan, dtype)
    vc = np.full(vshape, np.nan, dtype)
    m.add_sequence(A, tokens[A])
    m.add_sequence(B, tokens[B])
    scale = 0.125  # OPT-125m's 1 / sqrt(64)

    def run_step(md, order, new_rows):
        """Writes the step's K / V by slot_mapping, attends, checks every output row
        against float64 causal attention on the unpaged K / V of the whole sequence."""
        q_rows, k_rows, v_rows = [], [], []
        for sid, (lo, hi) in zip(order, new_rows):
            q, k, v = model.qkv(tokens[sid][lo:hi])
            q_rows.append(q)
            k_rows.append(k)
            v_rows.append(v)
        q = np.concatenate(q_rows).astype(dtype)
        pagedattn.reshape_and_cache(np.concatenate(k_rows).astype(dtype), np.concatenate(v_rows).astype(dtype),
                                    kc, vc, md.slot_mapping)  # fmt: skip
        out = pagedattn.paged_attention(q, kc, vc, md.block_tables, md.seq_lens, query_start_loc=md.query_start_loc,
                                        max_query_len=md.max_query_len, scale=scale)  # fmt: skip
        assert out.shape == (md.num_tokens, H, D)
        for i, sid in enumerate(order):
            n = int(md.seq_lens[i])
            _, k, v = model.qkv(tokens[sid][:n])  # every key so far, never paged
            # the cache holds dtype-rounded keys and values: the reference uses the same
            k = k.astype(dtype).astype(np.float64)
            v = v.astype(dtype).astype(np.float64)
            lo, hi = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
            ref = causal_attention(q[lo:hi].astype(np.float64), k, v, scale)
            tol = 2e-5 if dtype == np.float32 else 1.5e-3
            np.testing.assert_allclose(out[lo:hi].astype(np.float64), ref, rtol=tol, atol=tol,
                                       err_msg=f"sequence {sid}")  # fmt: skip
        return out

    # Step 1: B's first chunk of 28 and all of A's 484 tokens: the 512-token budget.
    md = m.step([B, A], query_lens=[BUDGET - PROMPT, PROMPT])
    assert md.seq_lens.tolist() == [28, 484]
    assert md.query_start_loc.tolist() == [0, 28, 512]
    assert md.context_lens.tolist() == [0, 0]
    assert md.num_tokens == 512 and md.max_query_len == 484
    run_step(md, [B, A], [(0, 28), (0, 484)])

    # Step 2: A's first decode token (sampled: any id) and B's remaining 456 over its 28 cached.
    tokens[A].append(int(rng.integers(0, 1000)))
    m.append_tokens(A, [tokens[A][-1]])
    md = m.step([A, B], query_lens=[1, PROMPT - 28])
    assert md.seq_lens.tolist() == [485, 484]
    assert md.query_start_loc.tolist() == [0, 1, 457]
    assert md.context_lens.tolist() == [484, 28]
    assert md.num_tokens == 457 and md.max_query_len == 456
    run_step(md, [A, B], [(484, 485), (28, 484)])

    # Step 3: two decodes.
    new = [int(t) for t in rng.integers(0, 1000, 2)]
    tokens[A].append(new[0])
    tokens[B].append(new[1])
    md = m.step([A, B], new)
    assert md.seq_lens.tolist() == [486, 485]
    assert md.query_start_loc.tolist() == [0, 1, 2]
    assert md.context_lens.tolist() == [485, 484]
    out = run_step(md, [A, B], [(485, 486), (484, 485)])
    # A step of decodes only is the decode call itself.
    q = np.stack([model.qkv([tokens[A][-1]])[0][0], model.qkv([tokens[B][-1]])[0][0]]).astype(dtype)
    decode = pagedattn.paged_attention(q, kc, vc, md.block_tables, md.seq_lens, scale=scale)
    np.testing.assert_array_equal(out, decode)
