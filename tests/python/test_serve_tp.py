"""Tensor-parallel serving (``--tensor-parallel N``): the ranks through torch.distributed
(gloo on the CPU) against the one-process run of the same seed, the KV-head replication
case, the one-broadcast-per-step protocol replayed without processes, the command line
under torchrun, and the errors (no torch, heads that do not split, a wrong launch)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from test_serve import SMALL_MODEL, small_config

import pagedattn
from pagedattn.demo import Engine, ModelConfig
from pagedattn.demo.backend import NumpyBackend
from pagedattn.demo.cli import main as cli_main
from pagedattn.demo.engine import make_rank_state
from pagedattn.demo.model import Shard, check_tensor_parallel
from pagedattn.demo.replica import Follower, Leader, StepTrace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_rank(cfg, backend=None):
    """The plain single-process run (no torch.distributed) and its trace."""
    e = Engine(cfg, backend or NumpyBackend())
    trace = StepTrace(e.model)
    return e.run(), trace.steps


def spawn_ranks(cfg, world, tmp_path, device="cpu"):
    from pagedattn.demo.parallel import run_engines

    rc = run_engines(cfg, world, str(tmp_path), trace=True, device=device)
    assert rc == 0
    out = []
    for r in range(world):
        with open(tmp_path / f"rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


def assert_same_run(base, base_trace, ranks, tol):
    """Every rank ran the one-rank run's steps: its heads' attention outputs, the residual
    stream after the all-reduce and rank 0's logits match, within ``tol`` = (atol, rtol)."""
    atol, rtol = tol
    s = ranks[0]["summary"]
    # One scheduler: the same schedule, preemptions, forks and prefix-cache hits as one process.
    assert s["tokens_generated"] == base.generated
    assert s["step_mix"]["steps"] == len(base.step_log)
    assert s["steps"]["decode_tokens"] == [r.decode_tokens for r in base.step_log]
    assert s["steps"]["prefill_tokens"] == [r.prefill_tokens for r in base.step_log]
    assert (s["forks"], s["preemptions_swap"], s["preemptions_recompute"]) == (base.forks, base.swaps, base.recomputes)
    assert s["prefix_cache_hit_tokens"] == base.manager.prefix_cache_stats["hit_tokens"]
    assert s["cow_block_copies"] == base.kv.blocks_copied
    # Every rank checked every row of its own heads against float64.
    for r, res in enumerate(ranks):
        checked = res["summary"]["tensor_parallel"]["per_rank"][r] if r == 0 else None
        got = (
            (checked["checked_decode_outputs"], checked["checked_prefill_outputs"])
            if r == 0
            else (res["checked"]["decode"], res["checked"]["prefill"])
        )
        assert got == (base.checker.checked["decode"], base.checker.checked["prefill"])
    layers = base.cfg.model.num_layers
    for r, res in enumerate(ranks):
        tr, sh = res["trace"], res["shard"]
        assert len(tr) == len(base_trace)
        heads = slice(sh.q_start, sh.q_start + sh.num_heads)
        for i, (got, want) in enumerate(zip(tr, base_trace)):
            for li in range(layers):
                np.testing.assert_allclose(
                    got["attn"][li], want["attn"][li][:, heads], atol=atol, rtol=rtol, err_msg=f"rank {r} step {i}"
                )
                np.testing.assert_allclose(got["x"][li], want["x"][li], atol=atol, rtol=rtol)
                # The all-reduce hands every rank the same sum.
                np.testing.assert_array_equal(got["x"][li], ranks[0]["trace"][i]["x"][li])
    for got, want in zip(ranks[0]["trace"], base_trace):
        np.testing.assert_allclose(got["logits"], want["logits"], atol=atol, rtol=rtol)
    # One all-reduce per layer per step; one broadcast per step (plus the final STOP and
    # the rare second broadcast that grows the buffer).
    tp = s["tensor_parallel"]
    steps = len(base.step_log)
    for r in tp["per_rank"]:
        assert r["all_reduce_calls"] == layers * steps
        assert r["broadcast_calls"] == steps + 1 + r["broadcast_grows"]
    assert 0.0 < tp["communication_share"] < 1.0
    # The ranks share a host, so the collectives' time after the last rank arrived is known.
    assert 0.0 <= tp["all_reduce_seconds_after_last_arrival"] <= tp["all_reduce_seconds"]
    assert 0.0 <= tp["broadcast_seconds_after_last_arrival"] <= tp["broadcast_seconds"]
    assert tp["communication_share_after_last_arrival"] <= tp["communication_share"]


# ---------------------------------------------------------------------------------------
# real ranks: spawned processes joined through torch.distributed (gloo)
# ---------------------------------------------------------------------------------------
def test_two_cpu_ranks_match_the_one_rank_run(tmp_path):
    """Grouped-query 4/2 heads over 2 ranks (2 query heads and 1 KV head each), a pool
    small enough to preempt by swapping, forks (copy-on-write) and prefix-cache hits."""
    pytest.importorskip("torch.distributed")
    cfg = small_config()
    base, base_trace = one_rank(cfg)
    assert base.swaps > 0 and base.forks > 0 and base.kv.blocks_copied > 0
    assert base.manager.prefix_cache_stats["hit_tokens"] > 0
    ranks = spawn_ranks(cfg, 2, tmp_path)
    assert [(r["shard"].q_start, r["shard"].kv_start) for r in ranks] == [(0, 0), (2, 1)]
    # float16 attention inputs: after the first all-reduce a sum rounded differently can
    # move a rounded query/key by one unit in the last place; the checker's tolerance.
    assert_same_run(base, base_trace, ranks, (3e-3, 3e-3))


def test_kv_heads_replicated_when_ranks_exceed_them(tmp_path):
    """4 query heads, 1 KV head, 2 ranks: each rank holds 2 query heads and a copy of the
    KV head; preemption by recomputation (prefix-cache hits on the recomputed prompts)."""
    pytest.importorskip("torch.distributed")
    model = dataclasses.replace(SMALL_MODEL, num_kv_heads=1)
    cfg = small_config(model=model, preempt="recompute", dtype="float32", max_num_batched_tokens=32)
    base, base_trace = one_rank(cfg)
    assert base.recomputes > 0 and max(base.prefill_chunks) > 1
    ranks = spawn_ranks(cfg, 2, tmp_path)
    assert [(r["shard"].q_start, r["shard"].kv_start, r["shard"].num_kv_heads) for r in ranks] == [
        (0, 0, 1),
        (2, 0, 1),
    ]
    assert_same_run(base, base_trace, ranks, (2e-5, 2e-5))


def test_torchrun_serves_on_two_ranks_and_reports_communication(tmp_path):
    """The README command: torchrun --nproc-per-node 2 -m pagedattn --tensor-parallel 2."""
    pytest.importorskip("torch.distributed.run")
    out = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "pagedattn", "--tensor-parallel", "2", "--requests", "6", "--quiet", "--json", str(out),
        "--device", "cpu",  # two gloo ranks on any host (a one-GPU host cannot hold two NCCL ranks)
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tensor parallel: 2 ranks (torchrun), each 2 query / 1 KV heads; all-reduce over gloo" in p.stdout
    assert "of rank 0's step time: all-reduce" in p.stdout
    assert "after last arrival" in p.stdout  # torchrun's ranks share this host's clock
    assert "on each of the 2 ranks, its own heads" in p.stdout
    s = json.loads(out.read_text())
    tp = s["tensor_parallel"]
    assert tp["ranks"] == 2 and tp["launch"] == "torchrun" and len(tp["per_rank"]) == 2
    assert tp["all_reduces"] == 2 * s["step_mix"]["steps"]  # two layers
    assert tp["step_seconds"] > 0 and s["checked_decode_outputs"] > 0
    for r in tp["per_rank"]:
        assert r["checked_decode_outputs"] == s["checked_decode_outputs"]


def _fail_on_rank_1(rank, world, init_method, seconds):
    """A spawned rank: rank 1 fails at once, the others would wait ``seconds``."""
    import time

    if rank == 1:
        return 3
    time.sleep(seconds)
    return 0


def test_the_first_failing_rank_decides_the_exit_code_and_stops_the_others():
    import time

    from pagedattn.demo.parallel import spawn

    t0 = time.perf_counter()
    assert spawn(_fail_on_rank_1, 3, 120.0) == 3
    assert time.perf_counter() - t0 < 60  # ranks 0 and 2 were terminated, not waited for
    assert spawn(_fail_on_rank_1, 1, 0.0) == 0


# ---------------------------------------------------------------------------------------
# the step protocol, replayed in one process (no torch)
# ---------------------------------------------------------------------------------------
class LoopbackComm:
    """One rank's stand-in for Comm: rank 0's broadcasts are queued for a follower that
    replays them afterwards; with one rank holding every head the all-reduce is the identity."""

    backend = "loopback"

    def __init__(self, queue, rank):
        self.queue, self.rank, self.world = queue, rank, 1
        self.stats = dict.fromkeys(
            ("all_reduce_calls", "all_reduce_seconds", "all_reduce_bytes", "broadcast_calls", "broadcast_seconds",
             "broadcast_bytes", "broadcast_grows", "message_bytes"), 0
        )  # fmt: skip

    def all_reduce(self, partial):
        self.stats["all_reduce_calls"] += 1
        return partial

    def broadcast(self, message=None):
        self.stats["broadcast_calls"] += 1
        if self.rank == 0:
            self.queue.append(message.copy())
            return message
        return self.queue.pop(0)

    def gather(self, obj):
        return [obj]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # swaps, forks, copy-on-write, prefix hits
        dict(preempt="recompute", max_num_batched_tokens=32, check_sample=0.5),  # chunks, recomputes, sampled checks
    ],
)
def test_a_follower_replays_rank_0s_messages_exactly(kw):
    """Every block copy, swap, checker record and step reaches the follower: replaying
    rank 0's messages reproduces its attention outputs bit for bit and its checks."""
    cfg = small_config(**kw)
    queue = []
    shard = Shard.of(cfg.model, 1, 0)
    leader = Leader(shard, LoopbackComm(queue, 0), "loopback")
    e = Engine(cfg, NumpyBackend(), tp=leader)
    lead_trace = StepTrace(e.model)
    e.run()
    assert e.swaps + e.recomputes > 0 and e.forks > 0
    assert len(queue) == len(e.step_log) + 1  # one message per step, then STOP
    follower = Follower(*make_rank_state(cfg, NumpyBackend(), shard, LoopbackComm(queue, 1)), LoopbackComm(queue, 1))
    follow_trace = StepTrace(follower.model)
    follower.run()
    assert not queue and follower.steps == len(e.step_log)
    assert follower.checker.checked == e.checker.checked and follower.checker.checked["prefill"] > 0
    assert len(follower.checker.store) == len(e.checker.store)  # the same prefix store, pruned alike
    assert follower.kv.blocks_copied == e.kv.blocks_copied
    assert follower.kv.blocks_swapped_out == e.kv.blocks_swapped_out
    for a, b in zip(lead_trace.steps, follow_trace.steps):
        for la, lb in zip(a["attn"], b["attn"]):
            np.testing.assert_array_equal(la, lb)
    for la, lb in zip(e.kv.key, follower.kv.key):  # the caches end identical, NaN where never written
        np.testing.assert_array_equal(la, lb)


def test_a_lost_swap_shows_on_the_follower():
    """A follower that misses a swap-in reads stale blocks: its float64 check fails."""
    from pagedattn.demo import AttentionMismatch, replica

    cfg = small_config(preempt="swap", num_cpu_blocks=96)
    queue = []
    shard = Shard.of(cfg.model, 1, 0)
    leader = Leader(shard, LoopbackComm(queue, 0))
    e = Engine(cfg, NumpyBackend(), tp=leader).run()
    assert e.swap_ins > 0
    comm = LoopbackComm(queue, 1)
    follower = Follower(*make_rank_state(cfg, NumpyBackend(), shard, comm), comm)
    follower.kv.swap_in = lambda pairs: None  # the swap-in records are dropped on this rank
    with pytest.raises(AttentionMismatch):
        follower.run()
    with pytest.raises(RuntimeError, match="unknown record 99"):
        follower._apply(replica._Reader(np.asarray([99], np.int64)))


def test_collective_time_after_the_last_rank_arrived():
    from pagedattn.demo.report import after_last_arrival

    def rank(host, calls):
        return {"host": host, "call_times": {"all_reduce": calls, "broadcast": []}}

    # Call 1: rank 1 arrives 3 s after rank 0, both leave at 5: 2 s of collective.
    # Call 2: rank 0 arrives last (at 7) and leaves at 7.5: 0.5 s.
    ranks = [rank("a", [(0.0, 5.0), (7.0, 7.5)]), rank("a", [(3.0, 5.0), (6.0, 7.5)])]
    assert after_last_arrival(ranks, "all_reduce") == pytest.approx(2.5)
    assert after_last_arrival(ranks, "broadcast") == 0.0
    assert after_last_arrival([rank("a", [(0.0, 1.0)]), rank("b", [(0.0, 1.0)])], "all_reduce") is None  # two clocks
    assert after_last_arrival([rank("a", [(0.0, 1.0)]), rank("a", [])], "all_reduce") is None
    assert after_last_arrival([{"host": "a", "call_times": None}], "all_reduce") is None


# ---------------------------------------------------------------------------------------
# sharding and errors
# ---------------------------------------------------------------------------------------
def test_shards_split_query_heads_and_share_kv_heads():
    m = ModelConfig(num_heads=8, num_kv_heads=2)
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in (Shard.of(m, 2, r) for r in range(2))] == [
        (0, 4, 0, 1),
        (4, 4, 1, 1),
    ]
    # 8 ranks over 2 KV heads: ranks 0-3 hold KV head 0, ranks 4-7 KV head 1.
    assert [Shard.of(m, 8, r).kv_start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    for world in (1, 2, 4, 8):
        for r in range(world):
            s = Shard.of(m, world, r)
            group = m.num_heads // m.num_kv_heads  # query head h reads KV head h // group
            assert {h // group for h in range(s.q_start, s.q_start + s.num_heads)} == set(
                range(s.kv_start, s.kv_start + s.num_kv_heads)
            )
    with pytest.raises(ValueError, match="must divide the query heads"):
        check_tensor_parallel(m, 3)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        check_tensor_parallel(ModelConfig(num_heads=12, num_kv_heads=4), 6)
    with pytest.raises(ValueError, match="rank must be in"):
        Shard.of(m, 2, 2)


def test_cli_refuses_ranks_that_do_not_divide_the_heads(capsys):
    pytest.importorskip("torch.distributed")
    assert cli_main(["--tensor-parallel", "3", "--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel 3: the model has 4 query / 2 KV heads; the rank count must divide the query heads" in err


def test_cli_without_torch_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    assert cli_main(["--tensor-parallel", "2", "--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: --tensor-parallel needs PyTorch (torch.distributed)" in err and "pip install torch" in err


def test_cli_launch_errors(monkeypatch, capsys):
    pytest.importorskip("torch.distributed")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    assert cli_main(["--tensor-parallel", "2", "--tp-launch", "torchrun", "--requests", "2"]) == 2
    assert "--tp-launch torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" in (
        capsys.readouterr().err
    )
    env = dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli_main(["--tensor-parallel", "2", "--requests", "2"]) == 2
    assert "--tensor-parallel 2, but torchrun started 4 processes (WORLD_SIZE)" in capsys.readouterr().err
    # torchrun without --tensor-parallel: every process would serve the whole workload.
    assert cli_main(["--requests", "2"]) == 2
    assert "started by torchrun with WORLD_SIZE=4: pass --tensor-parallel 4" in capsys.readouterr().err
    assert cli_main(["--tensor-parallel", "2", "--gpu-lib", "cupy", "--requests", "2"]) == 2
    assert "use --gpu-lib torch" in capsys.readouterr().err


def test_importing_the_package_and_the_job_does_not_import_torch():
    code = "import sys, pagedattn, pagedattn.demo.cli, pagedattn.demo.parallel; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------
# one GPU rank (NCCL, world size 1): the lead's H100 run
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_one_cuda_rank_over_nccl_matches_the_plain_cuda_run(tmp_path):
    torch = pytest.importorskip("torch")
    if not pagedattn.built_with_cuda():
        pytest.skip("pagedattn built without CUDA")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    if not torch.distributed.is_nccl_available():
        pytest.skip("this PyTorch has no NCCL")
    from pagedattn.demo.backend import TorchBackend

    cfg = small_config(max_num_batched_tokens=32)
    base, base_trace = one_rank(cfg, TorchBackend("cuda"))
    ranks = spawn_ranks(cfg, 1, tmp_path, device="cuda")
    tp = ranks[0]["summary"]["tensor_parallel"]
    assert tp["all_reduce_backend"] == "nccl" and tp["metadata_backend"] == "gloo"
    # One rank: the all-reduce is the identity and the run repeats the plain run (within the
    # float16 tolerance: another process may get another cuBLAS kernel for the same shapes).
    assert_same_run(base, base_trace, ranks, (3e-3, 3e-3))
