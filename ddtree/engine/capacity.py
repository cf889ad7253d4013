"""The compiled round's KV capacity rule: how many rows its fixed key and value buffers hold for a generation.

Attention in a compiled graph reads every row of its buffers under a mask (ddtree.engine.compiled), so the rows past
the context are traffic a round pays; and each capacity is a graph shape of its own, compiled once (dynamo keeps the
graphs of every capacity a process has seen). The rule trades the two:

* up to `QUANTUM` rows, the next power of two, at least `MIN_CAPACITY` (short generations: few shapes, and at most
  QUANTUM / 2 rows past what is needed);
* above, the next multiple of a step: QUANTUM rows, or 1/16 of the octave's top where that is larger (from 65,536
  rows on): fewer rows past what is needed than max(QUANTUM, needed / 8).

A 32k-token context (+ 512 new tokens + a 65-node tree: 33,345 rows) gets 36,864 rows where the power of two was
65,536: at Qwen3.6-27B's dims the target and drafter read 0.35 GB of rows past the context a round instead of 2.8 GB
(docs/gpu.md, bytes per compiled round). Shapes up to 32k: 256 .. 4,096 (5) and 8,192 .. 32,768 by 4,096 (7): 12
where powers of two gave 8; one generation uses one (the capacity is set when it starts and holds for its rounds).
Every capacity is a multiple of 256 (a grouped mask's rows are 16-aligned as the fused SDPA kernels want them).
"""

from __future__ import annotations

__all__ = ["MIN_CAPACITY", "QUANTUM", "capacity_bucket"]

MIN_CAPACITY = 256
QUANTUM = 4096  # rows: 0.35 GB a round at Qwen3.6-27B's dims (16 attention layers + 5 drafter layers, bf16)


def capacity_bucket(needed: int) -> int:
    """The KV capacity for `needed` rows (module docstring): the next power of two up to QUANTUM (at least
    MIN_CAPACITY), above it the next multiple of max(QUANTUM, the octave's top / 16)."""
    if needed <= QUANTUM:
        return max(MIN_CAPACITY, 1 << max(0, needed - 1).bit_length())
    step = max(QUANTUM, (1 << (needed - 1).bit_length()) >> 4)
    return -(-needed // step) * step
