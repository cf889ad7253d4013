"""What the batched-round tests share: the batched round's device work counted per round at N streams."""

from __future__ import annotations

from ddtree.engine import batch
from ddtree.testing.dispatch import DispatchCount


def per_round_at(engine, prompt, streams: int, new: int, budget) -> tuple[float, float]:
    """(kernel ops, host reads) a round of the batched round itself at `streams` copies of `prompt` (batch.generate_many:
    Engine.generate_many runs the one-stream round at one slot and T = 0), after a first call that builds the
    constants cached per shape; every copy must run every round."""
    def run():
        return batch.generate_many(engine, [prompt] * streams, streams, 0.0, new, None, 0, budget)

    run()
    with DispatchCount() as c:
        results = run()
    rounds = results[0].rounds
    assert all(r.rounds == rounds for r in results)
    return (c.total(c.kernel_ops, exclude=("prefill", "other")) / rounds,
            c.total(c.syncs, exclude=("prefill", "other")) / rounds)
