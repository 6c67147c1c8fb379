"""The Hopper varlen kernel's lookups on a mixed step, simulated: how many items a
persistent grid looks up, and how often a skip of empty runs would move the item counter,
for the grid without persistence, persistent without the skip (the kernel now), the skip
the kernel had until 2026-11-29 (`prefill_skip_run`: the last search round's own
sequences; removed, since it measured no faster) and the wider one of the branch
`wip/skip-wide` (the 32 sequences up to the round's end).

The lookup mirrors `prefill_item_warp` (cuda/prefill_params.cuh) for valid index arrays:
a two-round search of the flat grid's first() values, then (for the skips) the run of
empty tiles below the found tile among the last round's sequences. The deal mirrors
`prefill_item_index`: CTA b takes item b first, and from then on holds one index
prefetched from the counter, taken before each lookup. Time is modelled, not measured: a lookup costs `--lookup-us`, a
fresh block `--start-us`, an item with rows `--item-us` plus `--tile-us` per key tile.

    python benchmarks/skip_sim.py [--decodes 127] [--sms 132] [--lookup-us 3]
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deal_sim import tiles_of  # noqa: E402  (a row tile's key tiles, the same flat grid)

KBM = 128  # packed rows per row tile (deal_sim.ROWS)
G, K = 4, 8  # query heads per KV head; KV heads (GQA 32/8)


def lookup(qsl, seq_lens, c, persistent, wide):
    """(kind, run_lo, seq, tile) of tile c: kind "attend", or "empty" with the lowest tile
    of the run of empty tiles the lookup saw (c itself where it saw none)."""
    S = len(seq_lens)
    lo, hi = 0, S - 1
    while True:
        stride = (hi - lo + 32) // 32
        lanes = [lo + lane * stride for lane in range(32)]
        first = [qsl[i] * G // KBM + i if i <= hi else None for i in lanes]
        le = [lane for lane in range(32) if first[lane] is not None and first[lane] <= c]
        if not le:
            return "empty", c, None, None
        k = le[-1]
        if stride > 1:
            nlo = lo + k * stride
            hi = min(hi, nlo + stride - 1)
            lo = max(0, hi - 31) if persistent and wide and hi - nlo < 32 else nlo
            continue
        run_lo = c
        if persistent:
            q = [qsl[i + 1] - qsl[i] if i <= hi else 0 for i in lanes]
            empty = [lanes[x] <= hi and q[x] <= 1 for x in range(32)]  # valid arrays: no faults
            past = [first[x] + -(-q[x] * G // KBM) if first[x] is not None else None for x in range(32)]
            busy = [x for x in range(k + 1) if not empty[x]]
            ordered = all(past[x] <= first[x + 1] for x in range(k))
            lowest = past[busy[-1]] if busy else first[0]
            if ordered:
                run_lo = max(0, min(c, lowest))
        s = lanes[k]
        tile = c - first[k]
        q_s = qsl[s + 1] - qsl[s]
        if tile >= -(-q_s * G // KBM) or q_s == 1:
            return "empty", run_lo, None, None
        return "attend", c, s, tile


def key_tiles(qsl, seq_lens, s, tile):
    q = qsl[s + 1] - qsl[s]
    return tiles_of(q, seq_lens[s] - q, G)[tile]


def simulate(mode, qsl, seq_lens, a):
    tiles = -(-qsl[-1] * G // KBM) + len(seq_lens)
    n = tiles * K

    def cost(kind, s, t):
        return a.item_us + a.tile_us * key_tiles(qsl, seq_lens, s, t) if kind == "attend" else 0.0

    looks = moves = 0
    if mode == "flat":  # one block per item, dealt by the hardware one at a time per multiprocessor
        free = [0.0] * a.sms
        end = 0.0
        for j in range(n):
            t0 = heapq.heappop(free)
            kind, _, s, t = lookup(qsl, seq_lens, tiles - 1 - j // K, False, False)
            looks += 1
            t1 = t0 + a.start_us + a.lookup_us + cost(kind, s, t)
            end = max(end, t1)
            heapq.heappush(free, t1)
        return end, looks, moves
    counter, end = 0, 0.0
    events = [(0.0, b, b) for b in range(a.sms)]
    while events:
        t0, b, j = heapq.heappop(events)
        if j >= n:
            end = max(end, t0)
            continue
        nxt = a.sms + counter  # prefetched before the lookup, as the kernel does
        counter += 1
        kind, run_lo, s, t = lookup(qsl, seq_lens, tiles - 1 - j // K, True, mode == "wide")
        looks += 1
        if kind == "empty" and mode != "noskip":
            run_end = (tiles - run_lo) * K
            if nxt < run_end:
                moves += 1
                counter = max(counter, run_end - a.sms)
                nxt = a.sms + counter
                counter += 1
        heapq.heappush(events, (t0 + a.lookup_us + cost(kind, s, t), b, nxt))
    return end, looks, moves


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, nargs="*", default=[127, 511])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--lookup-us", type=float, default=3.0)
    ap.add_argument("--start-us", type=float, default=1.0)
    ap.add_argument("--item-us", type=float, default=3.0)
    ap.add_argument("--tile-us", type=float, default=1.94)
    a = ap.parse_args()
    for nd in a.decodes:
        seqs = [(2048, 512)] + [(2048, 1)] * nd  # the benchmark's mixed step
        qsl = [0]
        for _, q in seqs:
            qsl.append(qsl[-1] + q)
        seq_lens = [n for n, _ in seqs]
        print(f"chunk 512 at 2048 + {nd} decodes at 2048")
        for mode in ("flat", "noskip", "narrow", "wide"):
            end, looks, moves = simulate(mode, qsl, seq_lens, a)
            print(f"  {mode:7s} modelled {end:6.1f} us, {looks:5d} lookups, counter moved {moves:3d} times")


if __name__ == "__main__":
    main()
