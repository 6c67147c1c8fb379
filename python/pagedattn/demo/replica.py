"""One scheduler, many ranks: rank 0's engine and the other ranks that repeat its steps.

The block manager, the schedule and sampling live on rank 0 (:class:`~.engine.Engine`
with a :class:`Leader`). Every other rank is a :class:`Follower`: the same model slice,
KV caches and checker for its own heads, and no scheduler. Per step, rank 0 sends ONE
broadcast (:meth:`.comm.Comm.broadcast`) of one int64 message holding, in order:

- the operations that changed the caches or the checker since the last step, as rank 0
  ran them: copy-on-write pairs (``copy_blocks``), swap-out and swap-in pairs
  (``swap_blocks``), and the checker's bookkeeping (a sequence starting with its
  prefix-cache hit, a fork, a drop, the full blocks it recorded with their block ids,
  the prefix-store pruning with the manager's answers);
- the step itself: sequence ids, query lengths, how many rows decode, the tokens and
  their positions, block tables, ``seq_lens``, ``query_start_loc``, the slot mapping
  and ``max_query_len``.

A follower applies the operations in order and runs the forward pass, meeting the
other ranks in each layer's all-reduce. Preemption, forks and prefix caching are
decided once, on rank 0, so they behave exactly as on one GPU; every rank's caches
receive the same block operations. A message ends the run (``STOP``), or aborts it when
rank 0's scheduler failed between steps (``ABORT``).

Message layout: a sequence of records ``[op, fields...]``; arrays are preceded by their
length (block tables by their two dimensions). See :class:`_Writer` / :class:`_Reader`.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Callable, Optional

import numpy as np

from .model import Shard, StepInputs

__all__ = ["Leader", "Follower", "StepTrace", "RankStopped", "rank_stats"]

# Record kinds of a message.
COPY, SWAP_OUT, SWAP_IN, START, FORK, DROP, RECORD, PRUNE, STEP, STOP, ABORT = range(1, 12)
_NAMES = {COPY: "copy", SWAP_OUT: "swap-out", SWAP_IN: "swap-in", START: "start", FORK: "fork", DROP: "drop",
          RECORD: "record", PRUNE: "prune", STEP: "step", STOP: "stop", ABORT: "abort"}  # fmt: skip


class RankStopped(RuntimeError):
    """Rank 0 aborted the run (its scheduler failed between steps; it reports why)."""


class _Writer:
    """Collects records into int64 pieces; :meth:`take` joins them into one message."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.records = 0

    def put(self, op: int, *scalars: int) -> None:
        self.parts.append(np.asarray((op, *scalars), dtype=np.int64))
        self.records += 1

    def array(self, a: Any) -> None:
        a = np.asarray(a, dtype=np.int64).reshape(-1)
        self.parts.append(np.asarray([len(a)], dtype=np.int64))
        self.parts.append(a)

    def take(self) -> np.ndarray:
        out = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)
        self.parts, self.records = [], 0
        return out


class _Reader:
    def __init__(self, message: np.ndarray) -> None:
        self.m = message
        self.i = 0

    def done(self) -> bool:
        return self.i >= len(self.m)

    def int(self) -> int:
        v = int(self.m[self.i])
        self.i += 1
        return v

    def ints(self, n: int) -> np.ndarray:
        if n < 0 or self.i + n > len(self.m):
            raise RuntimeError(f"malformed step message: {n} words wanted at word {self.i} of {len(self.m)}")
        v = self.m[self.i : self.i + n]
        self.i += n
        return v

    def array(self, dtype: Any = np.int64) -> np.ndarray:
        return self.ints(self.int()).astype(dtype)


def rank_stats(comm: Any, checker: Any, steps: int, seconds: float) -> dict:
    """One rank's figures, gathered on rank 0 at the end of a run (``call_times``: the
    (entry, exit) times of every collective, with the host whose clock they read)."""
    return {
        "rank": comm.rank, **comm.stats, "steps": steps, "seconds": seconds,
        "host": socket.gethostname(), "call_times": getattr(comm, "times", None),
        "checked_decode_outputs": checker.checked["decode"], "checked_prefill_outputs": checker.checked["prefill"],
        "worst_error_over_tolerance": checker.worst, "check_seconds": checker.seconds,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------
# rank 0
# ---------------------------------------------------------------------------------------
class _RecordedKV:
    """Rank 0's KV cache: every block copy and swap runs here and is recorded for the others."""

    def __init__(self, kv: Any, out: _Writer) -> None:
        self._kv, self._out = kv, out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def _pairs(self, op: int, pairs: np.ndarray) -> None:
        if len(pairs):
            self._out.put(op)
            self._out.array(pairs)

    def copy(self, pairs: np.ndarray) -> None:
        self._kv.copy(pairs)
        self._pairs(COPY, pairs)

    def swap_out(self, pairs: np.ndarray) -> None:
        self._kv.swap_out(pairs)
        self._pairs(SWAP_OUT, pairs)

    def swap_in(self, pairs: np.ndarray) -> None:
        self._kv.swap_in(pairs)
        self._pairs(SWAP_IN, pairs)


class _RecordedChecker:
    """Rank 0's checker: its bookkeeping calls run here and are recorded for the others,
    with whatever they read from the block manager (block ids, cached-block answers)."""

    def __init__(self, checker: Any, out: _Writer) -> None:
        self._ck, self._out = checker, out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ck, name)

    def start(self, sid: int, tokens: np.ndarray, hit: int) -> None:
        self._ck.start(sid, tokens, hit)
        self._out.put(START, sid, hit)
        self._out.array(tokens)

    def fork(self, parent: int, child: int) -> None:
        self._ck.fork(parent, child)
        self._out.put(FORK, parent, child)

    def drop(self, sid: int) -> None:
        self._ck.drop(sid)
        self._out.put(DROP, sid)

    def record_blocks(self, sid: int, tokens: np.ndarray, block_table: Callable[[], list]) -> None:
        read: list[np.ndarray] = []

        def table() -> np.ndarray:
            read.append(np.asarray(block_table(), dtype=np.int64))
            return read[-1]

        self._ck.record_blocks(sid, tokens, table)
        if read:  # the checker stored new full blocks (it reads the table only then)
            self._out.put(RECORD, sid)
            self._out.array(tokens)
            self._out.array(read[0])

    def prune(self, is_cached: Callable[[int], bool]) -> None:
        answers: dict[int, bool] = {}

        def cached(block: int) -> bool:
            answers[int(block)] = bool(is_cached(block))
            return answers[int(block)]

        self._ck.prune(cached)
        self._out.put(PRUNE)
        self._out.array(np.asarray([(b, a) for b, a in answers.items()], dtype=np.int64).reshape(-1))


class Leader:
    """Rank 0's side: wraps the engine's KV cache and checker, and broadcasts each step."""

    def __init__(self, shard: Shard, comm: Any, launch: str = "spawned processes") -> None:
        """``launch``: how the ranks were started, for the report."""
        if shard.rank != 0:
            raise ValueError(f"the Leader runs on rank 0, not rank {shard.rank}")
        self.shard, self.comm, self.launch = shard, comm, launch
        self.out = _Writer()
        self.steps = 0
        self.checker: Any = None
        self.t0 = time.perf_counter()
        self.ranks: Optional[list[dict]] = None  # every rank's statistics, after finish()

    def record_kv(self, kv: Any) -> _RecordedKV:
        return _RecordedKV(kv, self.out)

    def record_checker(self, checker: Any) -> _RecordedChecker:
        self.checker = checker
        return _RecordedChecker(checker, self.out)

    def publish_step(
        self, step_no: int, ids: np.ndarray, query_lens: np.ndarray, num_decodes: int, tokens: np.ndarray,
        positions: np.ndarray, step: StepInputs,
    ) -> None:  # fmt: skip
        """Sends the recorded operations and this step (``step_no`` on the workload clock),
        in one broadcast."""
        bt = np.asarray(step.block_tables)
        w = self.out
        w.put(STEP, step_no, num_decodes, int(step.max_query_len), bt.shape[0], bt.shape[1])
        for a in (ids, query_lens, tokens, positions, bt, step.seq_lens, step.query_start_loc, step.slot_mapping):
            w.array(a)
        self.comm.broadcast(w.take())
        self.steps += 1

    def finish(self) -> None:
        """Ends the run on every rank and gathers their statistics into :attr:`ranks`."""
        self.out.put(STOP)
        self.comm.broadcast(self.out.take())
        self.ranks = self.comm.gather(rank_stats(self.comm, self.checker, self.steps, time.perf_counter() - self.t0))

    def abort(self) -> None:
        self.out = _Writer()  # what was recorded no longer matters
        self.out.put(ABORT)
        self.comm.broadcast(self.out.take())


# ---------------------------------------------------------------------------------------
# the other ranks
# ---------------------------------------------------------------------------------------
class Follower:
    """A rank other than 0: repeats rank 0's steps on its own heads until told to stop."""

    def __init__(self, model: Any, kv: Any, checker: Any, comm: Any) -> None:
        self.model, self.kv, self.checker, self.comm = model, kv, checker, comm
        self.be = model.be
        self.steps = 0
        self.step_no = -1  # the workload clock of the step being run (for error messages)
        self.seconds = 0.0

    def run(self) -> Follower:
        """Applies messages until STOP, then sends this rank's statistics to rank 0;
        raises RankStopped on ABORT."""
        t0 = time.perf_counter()
        while self._apply(_Reader(self.comm.broadcast())):
            pass
        self.be.synchronize()
        self.seconds = time.perf_counter() - t0
        self.comm.gather(rank_stats(self.comm, self.checker, self.steps, self.seconds))
        return self

    def _apply(self, r: _Reader) -> bool:
        """Applies one message; returns False once it held STOP."""
        while not r.done():
            op = r.int()
            if op in (COPY, SWAP_OUT, SWAP_IN):
                pairs = r.array().reshape(-1, 2)
                {COPY: self.kv.copy, SWAP_OUT: self.kv.swap_out, SWAP_IN: self.kv.swap_in}[op](pairs)
            elif op == START:
                sid, hit = r.int(), r.int()
                self.checker.start(sid, r.array(np.int32), hit)
            elif op == FORK:
                parent = r.int()
                self.checker.fork(parent, r.int())
            elif op == DROP:
                self.checker.drop(r.int())
            elif op == RECORD:
                sid = r.int()
                tokens, table = r.array(np.int32), r.array()
                self.checker.record_blocks(sid, tokens, lambda t=table: t)
            elif op == PRUNE:
                pairs = r.array().reshape(-1, 2)
                answers = {int(b): bool(a) for b, a in pairs}
                self.checker.prune(lambda b, a=answers: _answer(a, b))
            elif op == STEP:
                self._step(r)
            elif op == STOP:
                return False
            elif op == ABORT:
                raise RankStopped("rank 0 stopped the run")
            else:
                raise RuntimeError(f"malformed step message: unknown record {op} at word {r.i - 1}")
        return True

    def _step(self, r: _Reader) -> None:
        self.step_no, nd, max_query_len, s, m = r.int(), r.int(), r.int(), r.int(), r.int()
        ids, qlens = r.array(), r.array()
        tokens, positions = r.array(np.int32), r.array()
        tables = r.array(np.int32).reshape(s, m)
        seq_lens, qsl, slots = r.array(np.int32), r.array(np.int32), r.array()
        step = StepInputs(tables, seq_lens, qsl, slots, max_query_len)
        self.checker.begin_step(ids.tolist(), qlens.tolist(), [i < nd for i in range(len(ids))])
        no_rows = np.zeros(0, np.int64)  # rank 0 samples: no logits are needed here
        self.model.forward(self.kv, tokens, positions, step, no_rows, self.checker.observe)
        self.checker.end_step()
        self.steps += 1


def _answer(answers: dict[int, bool], block: int) -> bool:
    try:
        return answers[int(block)]
    except KeyError:
        raise RuntimeError(
            f"the checker asked about block {block}, which rank 0's checker did not: the ranks' states diverged"
        ) from None


# ---------------------------------------------------------------------------------------
# the trace a test compares across rank counts
# ---------------------------------------------------------------------------------------
class StepTrace:
    """Records, for every forward pass of ``model``, each layer's attention output (this
    rank's heads) and residual stream after the all-reduce, and the logits returned."""

    def __init__(self, model: Any) -> None:
        self.steps: list[dict] = []
        self._model = model
        self._forward = model.forward
        model.layer_hook = self._layer
        model.forward = self._wrapped  # an instance attribute shadows the method

    def _wrapped(self, *args: Any, **kw: Any) -> np.ndarray:
        self.steps.append({"attn": [], "x": []})
        logits = self._forward(*args, **kw)
        self.steps[-1]["logits"] = np.asarray(logits, dtype=np.float32).copy()
        return logits

    def _layer(self, layer: int, attn: Any, x: Any) -> None:
        be = self._model.be
        self.steps[-1]["attn"].append(be.to_numpy(attn))
        self.steps[-1]["x"].append(be.to_numpy(x))
