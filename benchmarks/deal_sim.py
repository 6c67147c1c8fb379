"""How evenly the Hopper varlen kernel's persistent grid shares its work items, simulated.

The flat grid lists each sequence's row tiles (128 packed rows, longest last) one sequence
after another, a gap tile after each, and every tile once per KV head; a tile's work is its
key tiles (plus a fixed cost per item). Two deals of those items to P CTAs:
  - rounds (the kernel before 2026-11-28): CTA b takes item k P + b in even rounds and
    k P + P - 1 - b in odd ones, walking the list from the longest tile down;
  - counter (since): CTA b takes item b, then the next unclaimed item whenever it is free
    (greedy list scheduling, what a device counter gives).
Printed: the busiest CTA's work over the mean (1.00 is a perfect share).

    python benchmarks/deal_sim.py [--sms 132] [--item-cost 0.6]
"""

from __future__ import annotations

import argparse
import heapq

ROWS = 128  # packed rows per tile, and keys per key tile


def tiles_of(q, ctx, group):
    """Key tiles of each row tile of a sequence with q query rows after ctx cached tokens."""
    out = []
    for t in range(-(-q * group // ROWS)):
        last_row = min(q * group, (t + 1) * ROWS) - 1
        out.append(-(-(ctx + last_row // group + 1) // ROWS))
    return out


def items(seqs, group, kv_heads):
    """The flat grid's items in the kernel's order (top tile first), None for a gap."""
    grid = []
    for q, ctx in seqs:
        grid += tiles_of(q, ctx, group) + [None]
    return [w for w in reversed(grid) for _ in range(kv_heads)]


def rounds(work, sms, cost):
    load = [0.0] * sms
    for k in range(-(-len(work) // sms)):
        for b in range(sms):
            j = k * sms + (sms - 1 - b if k & 1 else b)
            if j < len(work) and work[j] is not None:
                load[b] += work[j] + cost
    return load


def counter(work, sms, cost):
    heap = [(0.0, b) for b in range(sms)]
    for w in work:
        if w is not None:
            t, b = heapq.heappop(heap)
            heapq.heappush(heap, (t + w + cost, b))
    return [t for t, _ in heap]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--item-cost", type=float, default=0.6, help="an item's fixed cost, in key tiles")
    args = ap.parse_args()
    skewed = [(n, 0) for n in (4096, 64, 2048, 512, 256, 2048, 4096, 128, 1024, 64, 256, 64)]
    shapes = {  # name: (sequences as (query rows, cached tokens), group, KV heads)
        "prefill 1 x 8192 (GQA 32/8)": ([(8192, 0)], 4, 8),
        "prefill 8 x 1024 (GQA 32/8)": ([(1024, 0)] * 8, 4, 8),
        "chunk 2048 over 14336 (GQA 32/8)": ([(2048, 14336)], 4, 8),
        "MHA 32, 4 x 2048": ([(2048, 0)] * 4, 1, 32),
        "prefill 16 x 512 (GQA 32/8)": ([(512, 0)] * 16, 4, 8),
        "12 prompts of 64-4096 (GQA 32/8)": (skewed, 4, 8),
        "MHA 32, 8 x 1024": ([(1024, 0)] * 8, 1, 32),
    }
    print(f"{'shape':34s} {'items':>6s} {'rounds':>7s} {'counter':>8s}   (busiest CTA / mean, {args.sms} CTAs)")
    for name, (seqs, group, kv) in shapes.items():
        work = items(seqs, group, kv)
        r = [max(x) / (sum(x) / len(x)) for x in (rounds(work, args.sms, args.item_cost),
                                                   counter(work, args.sms, args.item_cost))]  # fmt: skip
        print(f"{name:34s} {len(work):6d} {r[0]:7.3f} {r[1]:8.3f}")


if __name__ == "__main__":
    main()
