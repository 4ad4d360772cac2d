"""A list-scheduling model of the causal forward's one-CTA-per-tile grid (2026-12-05, nineteenth):
132 SMs take the grid's CTAs in order, each as soon as it is free; a tile costs its key blocks
plus one block's worth of start and end. It compares the grid listed head by head (each head's
tiles longest first; fa3gen before) with L2 sections of heads listed longest first across
them (tile_scheduler.cuh l2_head_section; FA4's sm90 order). Pure Python, no GPU:

    python3 docs/results/causal_order_model.py [--varlen | --bwd]
"""
import heapq
import math
import random
import statistics
import sys

SMS, L2_BYTES = 132, 50 << 20


def tile_blocks(seqlen, tile_m, tile_n):
    """Key blocks of each query tile of one head (causal, seqlen_q = seqlen_k)."""
    return [math.ceil(min((m + 1) * tile_m, seqlen) / tile_n) for m in range(math.ceil(seqlen / tile_m))]


def makespan(costs, overhead=1.0):
    free = [0.0] * SMS
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c + overhead)
    return max(free)


def l2_section(group_bytes, groups):
    """tile_scheduler.cuh l2_head_section: the most groups, a power of two, whose shared bytes
    fit in L2."""
    section = 1
    while 2 * section * group_bytes <= L2_BYTES and 2 * section <= groups:
        section *= 2
    return section


def listed(longest_first, groups, section):
    """Each group's tiles (longest_first) head by head, and in sections of `section` groups
    listed rank-major (tile_scheduler.cuh section_order)."""
    by_head = [c for _ in range(groups) for c in longest_first]
    by_section = [c for first in range(0, groups, section) for c in longest_first
                  for _ in range(min(section, groups - first))]
    return by_head, by_section


def orders(seqlen, d, tile_m, tile_n, head_groups):
    section = l2_section(seqlen * 2 * d * 2, head_groups)  # a head's K and V
    return (*listed(tile_blocks(seqlen, tile_m, tile_n)[::-1], head_groups, section), section)


def varlen_orders(seed, mean, d, tile_m, tile_n):
    """A packed causal batch of 16k tokens, lengths uniform in [1, 2 mean] (issue 16's draw),
    listed as varlen_tiles_kernel lists it: the sequences by work, each head by head (before
    2026-12-05 (twentieth)), or in L2 sections of its heads (since)."""
    rnd, lens, total = random.Random(seed), [], 0
    while total < 16384:
        lens.append(min(rnd.randint(1, 2 * mean), 16384 - total))
        total += lens[-1]
    heads, by_head, by_section = 2048 // d, [], []
    for length in sorted(lens, key=lambda n: -n):
        a, b = listed(tile_blocks(length, tile_m, tile_n)[::-1], heads, l2_section(length * 2 * d * 2, heads))
        by_head += a
        by_section += b
    return by_head, by_section


def bwd_orders(seqlen, d, tile_m, tile_n, head_groups):
    """The causal dense backward: one CTA per key block, which walks the query blocks from the
    diagonal on (key block 0 the longest); its grid head by head, or key block 0 of a
    section's heads first, then key block 1, ... (FA3GEN_BWD_L2_SECTIONS, measured on an H100
    2026-12-05 (twentieth): no gain, removed; docs/results/bwd_l2_sections.patch)."""
    n_blocks, m_blocks = math.ceil(seqlen / tile_n), math.ceil(seqlen / tile_m)
    lengths = [m_blocks - (n * tile_n) // tile_m for n in range(n_blocks)]
    # what a head's CTAs share in L2: Q, dO (16-bit), the fp32 dQ accumulator, LSE and D
    section = l2_section(seqlen * (d * (2 * 2 + 4) + 8), head_groups)
    while head_groups % section:
        section //= 2
    return (*listed(lengths, head_groups, section), section)


if __name__ == "__main__" and "--bwd" in sys.argv:
    # the backward defaults' tiles (query rows x keys): d64 128x128, d128 64x128, d256 64x64
    for d, tile_m, tile_n in ((64, 128, 128), (128, 64, 128), (256, 64, 64)):
        for seqlen in (1024, 4096, 16384):
            by_head, by_section, section = bwd_orders(seqlen, d, tile_m, tile_n, (2048 // d) * (16384 // seqlen))
            ideal = (sum(by_head) + len(by_head)) / SMS
            a, b = makespan(by_head), makespan(by_section)
            print(f"bwd d{d} {tile_m}x{tile_n} seqlen {seqlen}: sections of {section}; makespan / ideal: "
                  f"by head {a / ideal:.3f}, by section {b / ideal:.3f} (x{a / b:.3f})")
elif __name__ == "__main__" and "--varlen" in sys.argv:
    # the varlen defaults' tiles: d64 causal 192x128, d128 128x128, d256 128x64
    for d, tile_m, tile_n in ((64, 192, 128), (128, 128, 128), (256, 128, 64)):
        for mean in (2048, 8192):
            ratios = []
            for seed in range(20):
                by_head, by_section = varlen_orders(seed, mean, d, tile_m, tile_n)
                ideal = (sum(by_head) + len(by_head)) / SMS
                ratios.append((makespan(by_head) / ideal, makespan(by_section) / ideal))
            a, b = (statistics.mean(r[i] for r in ratios) for i in (0, 1))
            print(f"varlen d{d} {tile_m}x{tile_n} mean {mean} (20 batches): makespan / ideal: "
                  f"by head {a:.3f}, by section {b:.3f} (x{a / b:.3f})")
elif __name__ == "__main__":
    for d, tile_m, tile_n in ((64, 192, 128), (128, 128, 128), (256, 128, 80)):
        for seqlen in (4096, 8192, 16384):
            head_groups = (2048 // d) * (16384 // seqlen)
            by_head, by_section, section = orders(seqlen, d, tile_m, tile_n, head_groups)
            ideal = (sum(by_head) + len(by_head)) / SMS
            a, b = makespan(by_head), makespan(by_section)
            print(f"d{d} {tile_m}x{tile_n} seqlen {seqlen}: sections of {section}; makespan / ideal: "
                  f"by head {a / ideal:.3f}, by section {b / ideal:.3f} (x{a / b:.3f})")
