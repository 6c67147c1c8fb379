"""The CPU path is memory-safe whatever another thread does to the index arrays.

The calls validate block_tables / seq_lens / slot_mapping / block_mapping and then run
with the GIL released; a second thread keeps writing out-of-range values into those
arrays (and putting the valid ones back) while the main thread calls the op in a loop.
A racing change may give a wrong answer or a typed error (IndexError / ValueError),
never an access out of bounds: each scenario runs in its own interpreter, which must exit
cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_HARNESS = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    import pagedattn

    def race(call, arrays_bad_good, seconds):
        stop = threading.Event()
        def hammer():
            while not stop.is_set():
                for arr, bad, good in arrays_bad_good:
                    arr[...] = bad
                for arr, bad, good in arrays_bad_good:
                    arr[...] = good
        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        calls = errors = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                call()
            except (IndexError, ValueError) as e:
                errors += 1
                msg = str(e)
                assert msg and "\\n" not in msg.strip(), msg
            calls += 1
        stop.set()
        t.join()
        print("OK", calls, errors)

    rng = np.random.default_rng(0)
    S, H, K, D, B, N, M = 8, 4, 2, 64, 16, 64, 8
    kc, vc = (rng.standard_normal(s).astype(np.float32) for s in pagedattn.kv_cache_shape(N, B, K, D, np.float32))
    """
)

SCENARIOS = {
    "decode_block_tables_and_seq_lens": """
        q = rng.standard_normal((S, H, D)).astype(np.float32)
        bt = rng.permutation(N)[: S * M].reshape(S, M).astype(np.int32)
        sl = np.full(S, M * B, np.int32)
        out = np.empty_like(q)
        race(lambda: pagedattn.paged_attention(q, kc, vc, bt, sl, out=out),
             [(bt, np.int32(2**30), bt.copy()), (sl, np.int32(2**30), sl.copy())], SECONDS)
    """,
    "decode_negative_block_ids": """
        q = rng.standard_normal((S, H, D)).astype(np.float32)
        bt = rng.permutation(N)[: S * M].reshape(S, M).astype(np.int32)
        sl = np.full(S, M * B, np.int32)
        race(lambda: pagedattn.paged_attention(q, kc, vc, bt, sl),
             [(bt, np.int32(-2**30), bt.copy())], SECONDS)
    """,
    "reshape_and_cache_slot_mapping": """
        T = 512
        key = rng.standard_normal((T, K, D)).astype(np.float32)
        value = rng.standard_normal((T, K, D)).astype(np.float32)
        slots = rng.permutation(N * B)[:T].astype(np.int64)
        race(lambda: pagedattn.reshape_and_cache(key, value, kc, vc, slots),
             [(slots, np.int64(2**40), slots.copy())], SECONDS)
    """,
    "copy_blocks_mapping": """
        pairs = np.stack([np.arange(0, 32), np.arange(32, 64)], axis=1).astype(np.int64)
        race(lambda: pagedattn.copy_blocks([kc], [vc], pairs),
             [(pairs, np.int64(2**40), pairs.copy())], SECONDS)
    """,
    "swap_blocks_mapping": """
        dst = np.zeros_like(kc)
        pairs = np.stack([np.arange(N), np.arange(N)], axis=1).astype(np.int32)
        race(lambda: pagedattn.swap_blocks(kc, dst, pairs),
             [(pairs, np.int32(2**30), pairs.copy())], SECONDS)
    """,
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_index_arrays_changed_during_calls(scenario):
    code = _HARNESS + f"SECONDS = {float(os.environ.get('PAGEDATTN_RACE_SECONDS', '2'))}\n"
    code += textwrap.dedent(SCENARIOS[scenario])
    env = dict(os.environ, PAGEDATTN_NUM_THREADS="2")
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario}: timed out")
    assert r.returncode == 0, f"{scenario}: exit code {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    words = r.stdout.split()
    assert words[0] == "OK" and int(words[1]) > 0, r.stdout
