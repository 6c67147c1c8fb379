"""pagedattn in forked children: after the parent used the CPU thread pool, and while
another thread of the parent is inside a call at the moment of the fork.

Each scenario runs in its own interpreter (PAGEDATTN_NUM_THREADS=4, so the pool has
worker threads whatever the machine) under a timeout: a hang fails the test instead of
hanging the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

# Builds a problem with enough (sequence, KV head) tasks to reach the pool's workers and
# its float64 reference; defines PROBLEM, EXPECTED and check(out) -> bool.
_SETUP = textwrap.dedent(
    """
    import os, sys, threading, time, warnings
    import numpy as np
    import pagedattn
    from pagedattn.reference import paged_attention_ref
    warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
    rng = np.random.default_rng(7)
    S, H, K, D, B, N = 6, 8, 4, 64, 16, 64
    q = rng.standard_normal((S, H, D)).astype(np.float32)
    kc, vc = (rng.standard_normal(s).astype(np.float32) for s in pagedattn.kv_cache_shape(N, B, K, D, np.float32))
    bt = rng.permutation(N)[: S * 8].reshape(S, 8).astype(np.int32)
    sl = np.array([1, 17, 40, 64, 100, 128], dtype=np.int32)
    ARGS = (q, kc, vc, bt, sl)
    EXPECTED = paged_attention_ref(*ARGS)
    def check(out):
        return bool(np.allclose(out, EXPECTED, atol=2e-5, rtol=2e-5))
    # A varlen call whose sequence spans two tiles per KV head (160 rows, groups of 2): its
    # context is converted once, into the buffer the process keeps for later calls.
    VQ = rng.standard_normal((160, H, D)).astype(np.float32)
    VARGS = (VQ, kc, vc, rng.permutation(N)[:10].reshape(1, 10).astype(np.int32), np.array([160], np.int32))
    QSL = np.array([0, 160], np.int32)
    EXPECTED_V = paged_attention_ref(*VARGS, query_start_loc=QSL)
    """
)

# The call each scenario repeats: call() and good(out) -> bool.
_CALLS = {
    "decode": "call = lambda: pagedattn.paged_attention(*ARGS)\ngood = check\n",
    "varlen": (
        "call = lambda: pagedattn.paged_attention(*VARGS, query_start_loc=QSL)\n"
        "good = lambda out: bool(np.allclose(out, EXPECTED_V, atol=2e-5, rtol=2e-5))\n"
    ),
}


def _run(body: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PAGEDATTN_NUM_THREADS="4")
    code = _SETUP + textwrap.dedent(body)
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout} s (a forked child hung); output so far: {e.stdout!r} {e.stderr!r}")


def test_multiprocessing_fork_worker_after_parent_used_the_pool():
    r = _run(
        """
        import multiprocessing as mp
        assert check(pagedattn.paged_attention(*ARGS))  # the parent builds its pool
        def work(seed):
            return pagedattn.paged_attention(*ARGS)
        ctx = mp.get_context("fork")
        with ctx.Pool(2) as workers:
            outs = workers.map_async(work, range(4)).get(timeout=30)
        assert len(outs) == 4 and all(check(o) for o in outs), "a worker returned a wrong answer"
        assert check(pagedattn.paged_attention(*ARGS))  # the parent's pool still works
        print("OK")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK"


def _asan_runtime_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


# GCC's AddressSanitizer runtime does not hold its allocator's locks across fork(): a
# child forked while another thread is inside operator new can block forever on a lock of
# ASan's allocator (seen: every thread of the child waiting in
# SizeClassAllocator64::GetFromAllocator). glibc's malloc takes its locks around fork, so
# the plain build runs this test; the sanitizer run skips it.
@pytest.mark.skipif(_asan_runtime_loaded(), reason="ASan's allocator is not fork-safe with threads running")
@pytest.mark.parametrize("kind", ["decode", "varlen"])
def test_fork_while_another_thread_is_inside_a_call(kind):
    # A thread keeps the pool busy; the main thread forks repeatedly, so forks land in
    # the middle of calls (pool locks held, workers mid-task; for varlen, the kept
    # conversion buffer taken). Every child must compute the right answer, and nothing
    # may hang.
    r = _run(
        _CALLS[kind]
        + textwrap.dedent(
            """
        stop = threading.Event()
        calls = [0]
        errors = []
        def hammer():
            try:
                while not stop.is_set():
                    if not good(call()):
                        errors.append("wrong answer in the parent's thread")
                    calls[0] += 1
            except BaseException as e:
                errors.append(repr(e))
        t = threading.Thread(target=hammer)
        t.start()
        while calls[0] < 3:
            time.sleep(0.001)
        failed = 0
        forks = 40
        for i in range(forks):
            pid = os.fork()
            if pid == 0:
                ok = True
                for _ in range(3):
                    ok = ok and good(call())
                os._exit(0 if ok else 1)
            deadline = time.monotonic() + 30
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    stop.set(); t.join()
                    print(f"child {i} hung")
                    sys.exit(3)
                time.sleep(0.002)
            if os.waitstatus_to_exitcode(status) != 0:
                failed += 1
            time.sleep(0.003 * (i % 4))  # vary where in a call the next fork lands
        stop.set()
        t.join()
        assert not errors, errors
        assert failed == 0, f"{failed} of {forks} children failed"
        assert calls[0] > forks // 4, calls[0]
        print("OK", calls[0])
        """
        )
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.startswith("OK")
