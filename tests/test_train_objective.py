"""The training objective: blocks as the engine calls the drafter, and the block loss."""

from __future__ import annotations

import random

import pytest
import torch
from train_support import MASK, _direct_features, _records, _target

from ddtree.engine.drafter import DFlash2Drafter, DFlashDrafter
from ddtree.train.features import Sample
from ddtree.train.objective import IGNORE, block_loss, drafter_hidden, make_batch, valid_anchors

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", [DFlashDrafter, DFlash2Drafter])  # DFlash2: its convolutions stay in each block
def test_blocks_mirror_the_engine_call(kind):
    """All anchors in one masked forward == one drafter call per anchor, fed as the engine feeds it."""
    target = _target()
    drafter = kind.random_for_target(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 3],
                                              mask_token_id=MASK, seed=3)
    records = _records(3, seed=2)
    with torch.no_grad():
        samples = [Sample(torch.tensor(r["input_ids"]), _direct_features(target, r["input_ids"], [1, 3]),
                          [tuple(r["spans"][0])]) for r in records]
        batch = make_batch(samples, 4, 6, MASK, random.Random(0))
        embed = target.get_input_embeddings().weight
        hidden = drafter_hidden(drafter, embed, batch)
        checked = 0
        for b, s in enumerate(samples):
            start, end = s.spans[0]
            for j, a in enumerate(batch.anchors[b].tolist()):
                if a < 0:
                    continue
                assert start <= a < end - 1
                block = torch.full((1, 4), MASK)
                block[0, 0] = s.input_ids[a]
                ref = drafter(embed[block], s.features[:a][None], torch.arange(a)[None],
                              torch.arange(a, a + 4)[None])
                torch.testing.assert_close(hidden[b, j * 4:(j + 1) * 4], ref[0], atol=1e-5, rtol=1e-5)
                want = [t if a + k < end else IGNORE for k, t in
                        enumerate(s.input_ids[a + 1:a + 4].tolist() + [IGNORE] * 3, start=1)][:3]
                assert batch.labels[b, j].tolist() == want
                checked += 1
    assert checked >= 10


def test_block_loss_counts_leading_hits():
    """tau_proxy = 1 + the hits before the first miss; labels past the span end are ignored."""
    vocab, h = 8, 8
    lm_head = torch.eye(vocab, h) * 20
    labels = torch.tensor([[[1, 2, 3], [4, 5, IGNORE]]])
    predicted = torch.tensor([[0, 1, 7, 3, 0, 4, 5, 6]])  # block 0: hit, miss, hit; block 1: hit, hit
    hidden = lm_head[predicted.view(-1)].view(1, 8, h)
    _, stats = block_loss(hidden, lm_head, labels, 4)
    # block 0: hit, miss, hit -> 1 accepted; block 1: hit, hit, (end) -> 2 accepted
    assert stats["tau_proxy"] == pytest.approx(1 + 1.5)
    assert stats["acc"] == pytest.approx(4 / 5)
    assert valid_anchors([(3, 6)]) == [3, 4]
