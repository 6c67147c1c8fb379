"""CPU decode at the largest valid sequence length: seq_len = 2**31 - 1 with 1024-token blocks
(2**21 blocks in the table). The block count of such a sequence used to be computed in 32-bit
arithmetic that overflows, and the call failed at once with ``ValueError:
vector::_M_default_append``. Attending over 2**31 tokens takes minutes on a CPU, so the test
checks that the call gets past its set-up into the kernel (still running after a few
seconds, or finished with the right answer), in a subprocess it then stops."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("pagedattn")

SCRIPT = textwrap.dedent(
    """
    import numpy as np, pagedattn
    bs, L = 1024, 2**31 - 1
    ks, vs = pagedattn.kv_cache_shape(1, bs, 1, 64, "float32")
    kc = np.zeros(ks, np.float32)      # every logit 0: uniform attention
    vc = np.ones(vs, np.float32)       # so the output is exactly 1
    bt = np.zeros((1, -(-L // bs)), np.int32)
    q = np.ones((1, 1, 64), np.float32)
    print("started", flush=True)
    out = pagedattn.paged_attention(q, kc, vc, bt, np.array([L], np.int32))
    print("ok" if np.allclose(out, 1.0, atol=1e-3) else f"wrong {out.ravel()[:4]}", flush=True)
    """
)


def test_decode_with_seq_len_2_pow_31_minus_1_reaches_the_kernel():
    p = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        if p.poll() is None:  # computing over 2**31 tokens: past every size computation
            return
        out, err = p.communicate()
        assert p.returncode == 0 and out.split() == ["started", "ok"], out + err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
