"""The serving demo's final report, its JSON form, the optional plot and a progress bar.

The step mix comes from :attr:`Engine.step_log` (one record per forward pass): decode
rows against prefill-chunk rows per step, how many steps mixed both (one varlen
``paged_attention`` per layer served them together), how full the token budget ran,
and into how many chunks each prefill was split (recomputations included).

Memory figures are computed from the block manager's state, sampled after every
iteration (:meth:`Engine._sample_memory`):

- **paged utilisation** = tokens held / slots allocated, summed over all samples. Tokens
  held counts each physical slot once (a block shared by forks or a cached system
  prompt holds its tokens once); slots allocated = blocks in use x block size.
- **contiguous utilisation**: the same running sequences, each reserving ``max_len``
  contiguous slots (the longest sequence the model serves, as engines without paging
  do): logical tokens / (sequences x max_len).
- **largest batch**: paged, the most sequences this run decoded at once; contiguous,
  how many ``max_len`` reservations fit in the same pool.

Tensor-parallel runs (:func:`parallel_summary`) add the step time (wall time / engine
steps on rank 0), every rank's time in the all-reduce and in the metadata broadcast and
their share of the step time, bytes moved, and every rank's checks (each checks its own
heads of the same rows). KV figures are per rank (its heads).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

import numpy as np

from .engine import Engine, kv_bytes_per_token

__all__ = ["summarize", "format_report", "write_plot", "Progress", "plot_unavailable_reason", "parallel_summary"]


def step_mix(e: Engine) -> dict[str, Any]:
    """The step-mix figures of a run (from its step log and completed prefills)."""
    log = e.step_log
    dec = np.asarray([r.decode_tokens for r in log], dtype=np.int64)
    pre = np.asarray([r.prefill_tokens for r in log], dtype=np.int64)
    total = dec + pre
    chunks = np.asarray(e.prefill_chunks, dtype=np.int64)
    budget = e.cfg.max_num_batched_tokens
    hist = {int(k): int(v) for k, v in zip(*np.unique(chunks, return_counts=True))}
    return {
        "token_budget": budget,
        "steps": len(log),
        "mixed_steps": int(np.count_nonzero((dec > 0) & (pre > 0))),
        "decode_only_steps": int(np.count_nonzero((dec > 0) & (pre == 0))),
        "prefill_only_steps": int(np.count_nonzero((dec == 0) & (pre > 0))),
        "decode_tokens": int(dec.sum()),
        "prefill_chunk_tokens": int(pre.sum()),
        "mean_tokens_per_step": float(total.mean()) if len(log) else 0.0,
        "peak_tokens_per_step": int(total.max()) if len(log) else 0,
        "full_budget_steps": int(np.count_nonzero(total == budget)),
        "budget_utilisation": float(total.mean() / budget) if len(log) else 0.0,
        "prefills": int(len(chunks)),
        "prompt_chunks": int(chunks.sum()),
        "chunked_prefills": int(np.count_nonzero(chunks > 1)),
        "chunks_per_prefill_mean": float(chunks.mean()) if len(chunks) else 0.0,
        "chunks_per_prefill_max": int(chunks.max()) if len(chunks) else 0,
        "chunks_per_prefill_histogram": hist,
        "interrupted_prefills": e.interrupted_prefills,
    }


def summarize(e: Engine) -> dict[str, Any]:
    cfg, mc = e.cfg, e.cfg.model
    tl = np.asarray(e.timeline, dtype=np.int64).reshape(-1, 5)
    steps, used, held, logical, seqs = (tl[:, i] for i in range(5))
    bs = cfg.block_size
    token_bytes = kv_bytes_per_token(cfg)
    pool_tokens = cfg.num_blocks * bs
    slots = int((used * bs).sum())
    reserved = int((seqs * mc.max_len).sum())
    stats = e.manager.prefix_cache_stats
    ck = e.checker
    tp = parallel_summary(e) if e.tp is not None else None
    worst = max([ck.worst] + [r["worst_error_over_tolerance"] for r in tp["per_rank"]]) if tp else ck.worst
    return {
        "device": e.be.describe(),
        "dtype": cfg.dtype,
        "requests": len(e.requests),
        "sequences": e.next_sid,
        "prompt_tokens": e.prompt_tokens,
        "prefill_tokens_computed": e.prefill_computed,
        "tokens_generated": e.generated,
        "iterations": len(e.timeline),  # engine iterations (idle stretches between arrivals are skipped)
        "last_step": int(e.step_no),
        "decode_steps": e.decode_steps,
        "seconds": e.wall,
        "check_seconds": ck.seconds,
        "tokens_per_second": e.generated / e.wall if e.wall > 0 else 0.0,
        "tokens_per_second_unchecked": e.generated / max(e.wall - ck.seconds, 1e-9),
        "peak_batch": e.peak_batch,
        "mean_batch": e.batch_sum / max(e.decode_steps, 1),
        "forks": e.forks,
        "cow_block_copies": e.kv.blocks_copied,
        "preemptions_swap": e.swaps,
        "preemptions_recompute": e.recomputes,
        "swap_ins": e.swap_ins,
        "blocks_swapped_out": e.kv.blocks_swapped_out,
        "blocks_swapped_in": e.kv.blocks_swapped_in,
        "prefix_caching": cfg.prefix_caching,
        "prefix_cache_queried_tokens": int(stats["queried_tokens"]),
        "prefix_cache_hit_tokens": int(stats["hit_tokens"]),
        "prefix_cache_hit_rate": float(stats["hit_rate"]),
        "prefix_cache_evictions": int(stats["evictions"]),
        "block_size": bs,
        "num_blocks": cfg.num_blocks,
        "num_cpu_blocks": cfg.num_cpu_blocks,
        "kv_bytes_per_token": token_bytes,
        "pool_bytes": pool_tokens * token_bytes,
        "max_len": mc.max_len,
        "paged_utilisation": float(held.sum() / slots) if slots else 0.0,
        "paged_peak_used_blocks": int(used.max()) if len(used) else 0,
        "contiguous_utilisation": float(logical.sum() / reserved) if reserved else 0.0,
        "contiguous_max_batch": pool_tokens // mc.max_len,
        "sharing_ratio": float(logical.sum() / held.sum()) if held.sum() else 1.0,
        "step_mix": step_mix(e),
        "checked_decode_outputs": ck.checked["decode"],
        "checked_prefill_outputs": ck.checked["prefill"],
        "check_sample": cfg.check_sample,
        "worst_error_over_tolerance": worst,
        "tolerance": {"atol": ck.atol, "rtol": ck.rtol},
        "step_seconds": e.wall / len(e.step_log) if e.step_log else 0.0,
        "tensor_parallel": tp,
        "timeline": {
            "step": steps.tolist(),
            "used_blocks": used.tolist(),
            "tokens_held": held.tolist(),
            "logical_tokens": logical.tolist(),
            "sequences": seqs.tolist(),
        },
        "steps": {
            "step": [r.step for r in e.step_log],
            "decode_tokens": [r.decode_tokens for r in e.step_log],
            "prefill_tokens": [r.prefill_tokens for r in e.step_log],
            "chunks": [r.chunks for r in e.step_log],
        },
    }


def parallel_summary(e: Engine) -> dict[str, Any]:
    """The tensor-parallel figures of a run whose engine is rank 0 (``e.tp`` finished)."""
    tp = e.tp
    ranks = tp.ranks or []
    steps = len(e.step_log)
    wall = e.wall if e.wall > 0 else 1e-9
    per_rank = []
    for r in ranks:
        comm = r["all_reduce_seconds"] + r["broadcast_seconds"]
        r = {k: v for k, v in r.items() if k != "call_times"}  # the raw times stay out of the JSON
        per_rank.append({**r, "communication_seconds": comm, "communication_share": comm / max(r["seconds"], 1e-9)})
    r0 = per_rank[0] if per_rank else {}
    after = {name: after_last_arrival(ranks, name) for name in ("all_reduce", "broadcast")}
    return {
        "ranks": tp.shard.world,
        "launch": tp.launch,
        "all_reduce_backend": tp.comm.backend,
        "metadata_backend": "gloo",
        "query_heads_per_rank": tp.shard.num_heads,
        "kv_heads_per_rank": tp.shard.num_kv_heads,
        "steps": steps,
        "step_seconds": e.wall / steps if steps else 0.0,
        "tokens_per_second": e.generated / wall,
        "all_reduce_seconds": r0.get("all_reduce_seconds", 0.0),
        "broadcast_seconds": r0.get("broadcast_seconds", 0.0),
        "communication_share": (r0.get("communication_seconds", 0.0)) / wall,
        # Rank 0's collectives counted from the last rank's arrival (None across hosts).
        "all_reduce_seconds_after_last_arrival": after["all_reduce"],
        "broadcast_seconds_after_last_arrival": after["broadcast"],
        "communication_share_after_last_arrival": (
            (after["all_reduce"] + after["broadcast"]) / wall if None not in after.values() else None
        ),
        "all_reduces": r0.get("all_reduce_calls", 0),
        "all_reduce_bytes": r0.get("all_reduce_bytes", 0),
        "broadcasts": r0.get("broadcast_calls", 0),
        "broadcast_grows": r0.get("broadcast_grows", 0),
        "broadcast_bytes": r0.get("broadcast_bytes", 0),
        "metadata_bytes_per_step": r0.get("message_bytes", 0) / max(steps, 1),
        "per_rank": per_rank,
    }


def after_last_arrival(ranks: list[dict], name: str) -> Optional[float]:
    """Seconds rank 0 spent in the collectives ``name`` after the last rank had entered
    each call (its exit minus the latest entry; never negative), or None when the ranks
    ran on several hosts (no common clock) or did not record the same calls."""
    times = [r.get("call_times") for r in ranks]
    if not times or None in times or len({r.get("host") for r in ranks}) != 1:
        return None
    calls = [np.asarray(t[name], dtype=np.float64).reshape(-1, 2) for t in times]
    if len({len(c) for c in calls}) != 1:
        return None
    last_entry = np.max([c[:, 0] for c in calls], axis=0)
    return float(np.maximum(calls[0][:, 1] - last_entry, 0.0).sum())


def _parallel_lines(s: dict[str, Any]) -> list[str]:
    tp = s["tensor_parallel"]
    ranks = "; ".join(
        f"rank {r['rank']}: {r['all_reduce_seconds'] / max(r['seconds'], 1e-9):.1%} all-reduce + "
        f"{r['broadcast_seconds'] / max(r['seconds'], 1e-9):.1%} broadcast"
        for r in tp["per_rank"]
    )
    grow = f", {tp['broadcast_grows']} of them to grow the buffer" if tp["broadcast_grows"] else ""
    lines = [
        f"tensor parallel: {plural(tp['ranks'], 'rank')} ({tp['launch']}), each {tp['query_heads_per_rank']} query / "
        f"{tp['kv_heads_per_rank']} KV heads; all-reduce over {tp['all_reduce_backend']}, metadata broadcast over "
        f"{tp['metadata_backend']}",
        f"  step time             {tp['step_seconds'] * 1e3:.2f} ms mean over {plural(tp['steps'], 'step')} "
        f"({tp['tokens_per_second']:.0f} tokens/s)",
        f"  communication         {tp['communication_share']:.1%} of rank 0's step time: all-reduce "
        f"{tp['all_reduce_seconds']:.3f} s ({tp['all_reduces']} calls, {_mb(tp['all_reduce_bytes'])}), broadcast "
        f"{tp['broadcast_seconds']:.3f} s ({tp['broadcasts']} calls{grow}; "
        f"{tp['metadata_bytes_per_step'] / 1024:.1f} KB of metadata per step)",
    ]
    if tp["communication_share_after_last_arrival"] is not None:
        lines.append(
            f"  after last arrival    {tp['communication_share_after_last_arrival']:.1%} of rank 0's step time: "
            f"all-reduce {tp['all_reduce_seconds_after_last_arrival']:.3f} s, broadcast "
            f"{tp['broadcast_seconds_after_last_arrival']:.3f} s (the collectives themselves; the rest of the "
            "time above is waiting for the slowest rank)"
        )
    return lines + [
        f"  every rank            {ranks} (a rank's broadcast time includes waiting for rank 0's schedule)",
    ]


def plural(count: int, noun: str) -> str:
    """'1 block', '2 blocks', '0 blocks'."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MB"


def _histogram(h: dict) -> str:
    """{chunks: prefills} -> '1 chunk: 30, 2 chunks: 4' (JSON turns the keys into strings)."""
    items = sorted((int(k), v) for k, v in h.items())
    return ", ".join(f"{k} chunk{'s' if k != 1 else ''}: {v}" for k, v in items) or "none"


def format_report(s: dict[str, Any]) -> str:
    checked = s["checked_decode_outputs"] + s["checked_prefill_outputs"]
    mx = s["step_mix"]
    sample = "" if s["check_sample"] >= 1.0 else f" (a {s['check_sample']:.0%} sample per step)"
    pc = (
        f"{s['prefix_cache_hit_rate']:.1%} of prompt tokens looked up "
        f"({s['prefix_cache_hit_tokens']} / {s['prefix_cache_queried_tokens']}, recomputations included)"
        if s["prefix_caching"]
        else "off"
    )
    lines = [
        f"served {plural(s['requests'], 'request')} ({plural(s['sequences'], 'sequence')}, {s['forks']} forked) "
        f"in {s['seconds']:.2f} s "
        f"on {s['device']}, {s['dtype']}",
        f"  tokens generated      {s['tokens_generated']}  ({s['tokens_per_second']:.0f} tokens/s; "
        f"{s['tokens_per_second_unchecked']:.0f} tokens/s without the float64 checks)",
        f"  prompt tokens         {s['prompt_tokens']}  ({s['prefill_tokens_computed']} run through the model)",
        f"  engine steps          {mx['steps']}  (one paged_attention call per layer each; budget "
        f"{mx['token_budget']} tokens: {mx['mixed_steps']} mixed decode + prefill, {mx['decode_only_steps']} "
        f"decode only, {mx['prefill_only_steps']} prefill only)",
        f"  step tokens           {mx['decode_tokens']} decode + {mx['prefill_chunk_tokens']} prefill-chunk  "
        f"(per step: mean {mx['mean_tokens_per_step']:.1f}, peak {mx['peak_tokens_per_step']}; "
        f"{plural(mx['full_budget_steps'], 'step')} used the whole budget)",
        f"  prompt chunks         {mx['prompt_chunks']} for {plural(mx['prefills'], 'prefill')}  "
        f"({mx['chunked_prefills']} split over several steps, at most {mx['chunks_per_prefill_max']}; "
        f"{_histogram(mx['chunks_per_prefill_histogram'])}; "
        f"{mx['interrupted_prefills']} preempted part-way)",
        f"  decode steps          {s['decode_steps']}  (batch: peak {s['peak_batch']}, mean {s['mean_batch']:.1f})",
        f"  preemptions           {s['preemptions_swap'] + s['preemptions_recompute']}  "
        f"(swap {s['preemptions_swap']}: {plural(s['blocks_swapped_out'], 'block')} out, {s['blocks_swapped_in']} in; "
        f"recompute {s['preemptions_recompute']})",
        f"  copy-on-write         {s['cow_block_copies']} block cop{'y' if s['cow_block_copies'] == 1 else 'ies'}",
        f"  prefix-cache hits     {pc}",
        f"KV memory: pool of {plural(s['num_blocks'], 'block')} x {plural(s['block_size'], 'token')} = "
        f"{_mb(s['pool_bytes'])} "
        f"({s['kv_bytes_per_token']} bytes per token, all layers)",
        f"  paged                 {s['paged_utilisation']:.1%} of allocated slots hold tokens; "
        f"largest batch {plural(s['peak_batch'], 'sequence')}; {s['sharing_ratio']:.2f} sequence tokens per slot "
        "(shared prefixes and forks)",
        f"  contiguous            {s['contiguous_utilisation']:.1%} of reserved slots would hold tokens "
        f"(reserving {s['max_len']} per sequence); largest batch {plural(s['contiguous_max_batch'], 'sequence')}",
        f"checked {checked} attention output rows{sample} ({s['checked_decode_outputs']} decode, "
        f"{s['checked_prefill_outputs']} prefill-chunk; every layer"
        + (f"; on each of the {s['tensor_parallel']['ranks']} ranks, its own heads" if s.get("tensor_parallel") else "")
        + ") against dense float64 attention: all within tolerance "
        f"(worst {s['worst_error_over_tolerance']:.2f} of atol {s['tolerance']['atol']:g} + "
        f"rtol {s['tolerance']['rtol']:g})",
    ]
    if s.get("tensor_parallel"):
        lines += _parallel_lines(s)
    return "\n".join(lines)


def plot_unavailable_reason() -> Optional[str]:
    """None when matplotlib can be imported, else why not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"--plot needs matplotlib, which is not installed ({e}); pip install matplotlib"
    return None


def write_plot(s: dict[str, Any], path: str) -> None:
    """Two panels over the engine steps: KV memory in use, paged (blocks in use, tokens
    held) against contiguous reservation; and each step's rows, decode tokens and
    prefill-chunk tokens stacked under the token budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = s["timeline"]
    step = np.asarray(tl["step"])
    tb = s["kv_bytes_per_token"] / 2**20
    paged = np.asarray(tl["used_blocks"]) * s["block_size"] * tb
    held = np.asarray(tl["tokens_held"]) * tb
    contiguous = np.asarray(tl["sequences"]) * s["max_len"] * tb
    pool = s["pool_bytes"] / 2**20
    fig, (ax, mix) = plt.subplots(
        2, 1, figsize=(8, 7), dpi=120, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )  # fmt: skip
    ax.plot(step, contiguous, color="tab:red", lw=1.2, label=f"contiguous: {s['max_len']} slots reserved per sequence")
    ax.plot(step, paged, color="tab:blue", lw=1.2, label="paged: blocks in use")
    ax.fill_between(step, 0, held, color="tab:blue", alpha=0.25, lw=0, label="tokens actually held")
    ax.axhline(pool, color="black", ls="--", lw=1, label=f"KV pool ({pool:.1f} MB)")
    ax.set_ylabel("KV memory (MB)")
    top = max(pool * 1.15, float(paged.max(initial=0)) * 1.05, min(float(contiguous.max(initial=0)), pool * 4))
    ax.set_ylim(0, top)
    if contiguous.max(initial=0) > top:
        peak = int(np.argmax(contiguous))
        ax.annotate(
            f"contiguous peaks at {contiguous[peak]:.0f} MB ({s['timeline']['sequences'][peak]} sequences)",
            xy=(step[peak], top),
            xytext=(0.02, 0.93),
            textcoords="axes fraction",
            fontsize=8,
            color="tab:red",
            arrowprops=dict(arrowstyle="->", color="tab:red", lw=0.8),
        )
    ax.set_title(
        f"KV memory for the same batch: paged {s['paged_utilisation']:.0%} utilised, "
        f"contiguous {s['contiguous_utilisation']:.0%}"
    )
    ax.legend(loc="center right", fontsize=8)
    _plot_step_mix(mix, s)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_step_mix(ax: Any, s: dict[str, Any]) -> None:
    st, mx = s["steps"], s["step_mix"]
    step = np.asarray(st["step"])
    dec = np.asarray(st["decode_tokens"])
    pre = np.asarray(st["prefill_tokens"])
    ax.bar(step, dec, width=1.0, color="tab:green", lw=0, label="decode tokens")
    ax.bar(step, pre, width=1.0, bottom=dec, color="tab:orange", lw=0, label="prefill-chunk tokens")
    ax.axhline(mx["token_budget"], color="black", ls="--", lw=1, label=f"token budget ({mx['token_budget']})")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the step")
    ax.set_ylim(0, mx["token_budget"] * 1.1)
    ax.set_title(
        f"step mix: {mx['mixed_steps']} of {mx['steps']} steps mixed decodes and prompt chunks; "
        f"{mx['chunked_prefills']} prefill{'s' if mx['chunked_prefills'] != 1 else ''} split over several steps",
        fontsize=10,
    )
    ax.legend(loc="upper right", fontsize=8)


class Progress:
    """A one-line progress bar on stderr (redrawn at most 10 times a second on a terminal;
    a line every few seconds otherwise)."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, width: int = 28) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.1 if self.tty else 5.0
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.drawn = False

    def __call__(self, e: Engine) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval:
            return
        self.last = now
        self._draw(e, now)

    def _draw(self, e: Engine, now: float) -> None:
        done = e.finished_requests
        filled = int(self.width * done / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        rate = e.generated / max(now - self.t0, 1e-9)
        used = e.manager.num_used_blocks
        text = (
            f"[{bar}] {done}/{self.total} requests | step {e.step_no} | batch {len(e.running)} | "
            f"KV {used}/{e.cfg.num_blocks} blocks | {rate:.0f} tok/s"
        )
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.drawn = True

    def close(self, e: Engine) -> None:
        if self.drawn or self.tty:
            self._draw(e, time.perf_counter())
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()
