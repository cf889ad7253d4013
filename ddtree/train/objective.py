"""The block-diffusion training objective, mirroring what the engine feeds the drafter.

At inference a round anchored at position a (the last committed token, not yet seen by the
target) runs the drafter on the block [x_a, mask, ..., mask] at positions a..a+bs-1, with
context = target features of every committed token before it (positions < a); block position
k predicts x_{a+k}. Training draws several anchors per sequence and runs all their blocks in
one forward: queries are the blocks side by side, keys are [whole sequence's context ‖ blocks],
and an additive mask shows block j the context positions < a_j and its own block only. The
loss is cross-entropy through the target's frozen lm_head, position k weighted by
exp(-(k-1)/decay), since a draft is accepted only up to its first miss.
"""

from __future__ import annotations

import inspect
import random
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.engine.drafter_kinds import TRAINED_KIND
from ddtree.train.config import SELECTOR_LOSSES
from ddtree.train.features import Sample

IGNORE = -100


@dataclass
class BlockBatch:
    block_ids: torch.Tensor  # [B, n*bs] tokens of the blocks: [x_a, mask, ...] per anchor
    block_pos: torch.Tensor  # [B, n*bs] positions a..a+bs-1 per anchor
    ctx_features: torch.Tensor  # [B, L, F] features of the whole (right-padded) sequence
    ctx_pos: torch.Tensor  # [B, L]
    anchors: torch.Tensor  # [B, n] anchor positions, -1 for padding anchors
    labels: torch.Tensor  # [B, n, bs-1] x_{a+k} for k = 1..bs-1, IGNORE outside the span
    block_size: int

    def to(self, device, dtype: torch.dtype | None = None) -> BlockBatch:
        feats = self.ctx_features.to(device, dtype) if dtype is not None else self.ctx_features.to(device)
        return BlockBatch(self.block_ids.to(device), self.block_pos.to(device), feats, self.ctx_pos.to(device),
                          self.anchors.to(device), self.labels.to(device), self.block_size)


def valid_anchors(spans: list[tuple[int, int]]) -> list[int]:
    """Positions a with a >= 1 and a + 1 inside the same span (at least one token to predict)."""
    return [a for s, e in spans for a in range(max(s, 1), e - 1)]


def make_batch(samples: list[Sample], block_size: int, anchors_per_seq: int, mask_token_id: int,
               rng: random.Random, anchors: list[list[int]] | None = None) -> BlockBatch:
    """Blocks for `samples`: `anchors_per_seq` random anchors each (or the given `anchors`)."""
    bs, n = block_size, anchors_per_seq
    if anchors is None:
        anchors = []
        for s in samples:
            pool = valid_anchors(s.spans)
            anchors.append(sorted(rng.sample(pool, min(n, len(pool)))))
    n = max(1, max(len(a) for a in anchors))
    B, L = len(samples), max(len(s.input_ids) for s in samples)
    fdim = samples[0].features.shape[-1]
    ctx = torch.zeros(B, L, fdim, dtype=samples[0].features.dtype, device=samples[0].features.device)
    block_ids = torch.full((B, n, bs), mask_token_id, dtype=torch.long)
    block_pos = torch.zeros(B, n, bs, dtype=torch.long)
    anc = torch.full((B, n), -1, dtype=torch.long)
    labels = torch.full((B, n, bs - 1), IGNORE, dtype=torch.long)
    k = torch.arange(bs)
    for b, (s, avec) in enumerate(zip(samples, anchors, strict=True)):
        ctx[b, :len(s.input_ids)] = s.features
        for j, a in enumerate(avec):
            end = next(e for st, e in s.spans if st <= a < e)
            anc[b, j] = a
            block_ids[b, j, 0] = s.input_ids[a]
            block_pos[b, j] = a + k
            m = min(bs - 1, end - a - 1)  # targets a+1 .. a+m stay inside the span
            labels[b, j, :m] = s.input_ids[a + 1:a + 1 + m]
    return BlockBatch(block_ids.view(B, n * bs), block_pos.view(B, n * bs), ctx,
                      torch.arange(L).expand(B, L).contiguous(), anc, labels, bs)


def block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, n*bs, L + n*bs]: block j sees context positions < a_j and its own block."""
    B, n = anchors.shape
    bs = block_size
    q_anchor = anchors.repeat_interleave(bs, dim=1)  # [B, n*bs]
    ctx_visible = torch.arange(ctx_len, device=anchors.device)[None, None, :] < q_anchor[:, :, None]
    q_block = torch.arange(n * bs, device=anchors.device) // bs
    own = (q_block[:, None] == q_block[None, :]).expand(B, -1, -1)
    visible = torch.cat([ctx_visible, own], dim=-1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=anchors.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


@contextmanager
def _added_mask(drafter, mask: torch.Tensor):
    """Add `mask` to every attention call of the drafter (for drafters without an attention_mask argument)."""
    attend = drafter._attend

    def masked(module, q, k, v, m, **kw):
        return attend(module, q, k, v, mask if m is None else m + mask, **kw)

    drafter._attend = masked
    try:
        yield
    finally:
        drafter._attend = attend


def _accepts_mask(drafter) -> bool:
    return "attention_mask" in inspect.signature(drafter.forward).parameters


def drafter_hidden(drafter, embed_weight: torch.Tensor, batch: BlockBatch, call=None) -> torch.Tensor:
    """The drafter's hidden states [B, n*bs, H] for every block of the batch, in one forward.

    `call`: the module to call instead of `drafter` itself (a DDP wrapper around it).
    """
    call = drafter if call is None else call
    dtype = drafter.dtype
    noise = drafter.embed_block(embed_weight, batch.block_ids).to(dtype)  # as the engine embeds a block
    feats = batch.ctx_features.to(dtype)
    mask = block_mask(batch.anchors, feats.shape[1], batch.block_size, dtype)
    if _accepts_mask(drafter):
        return call(noise, feats, batch.ctx_pos, batch.block_pos, attention_mask=mask)
    with _added_mask(drafter, mask):
        return call(noise, feats, batch.ctx_pos, batch.block_pos)


def position_weights(block_size: int, decay: float | None, device=None) -> torch.Tensor:
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.ones_like(k) if decay is None else torch.exp(-(k - 1) / decay)


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, block_size: int,
               decay: float | None = None, lm_head_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy of block positions 1..bs-1, and accuracy statistics.

    Only positions with a label go through the lm_head (the vocabulary is the large dimension).
    """
    B, n, _ = labels.shape
    h = hidden.view(B, n, block_size, -1)[:, :, 1:]  # position 0 is the given token
    valid = labels != IGNORE
    w = position_weights(block_size, decay, hidden.device).expand_as(labels)[valid]
    logits = F.linear(h[valid], lm_head_weight.to(h.dtype), lm_head_bias).float()
    tgt = labels[valid]
    ce = F.cross_entropy(logits, tgt, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp_min(1e-9)
    with torch.no_grad():
        hit = torch.zeros_like(labels, dtype=torch.bool)
        hit[valid] = logits.argmax(-1) == tgt
        # accepted length of a greedy chain: leading hits before the first miss (or the span end)
        lead = (hit | ~valid).int().cumprod(-1) & valid.int()
        real = valid[:, :, 0]
        stats = {"loss": loss.item(), "ce": ce.mean().item(), "acc": hit[valid].float().mean().item(),
                 "acc_first": hit[:, :, 0][real].float().mean().item() if real.any() else 0.0,
                 # tau proxy: accepted drafts + the bonus token, on teacher-forced context
                 "tau_proxy": (lead.sum(-1)[real].float().mean().item() + 1.0) if real.any() else 1.0,
                 "tokens": int(valid.sum())}
    return loss, stats


def selector_loss(drafter, hidden: torch.Tensor, lm_head_weight: torch.Tensor, batch: BlockBatch,
                  decay: float | None = None, lm_head_bias: torch.Tensor | None = None, *, rule: str = "public",
                  alpha: float = 1.0, inject_gold: bool = True, stop_gradient: bool = False
                  ) -> tuple[torch.Tensor, dict]:
    """A DFlash2 drafter's candidate-selector term, to add to `block_loss` (alpha included), and its statistics.

    At each labelled block position t the candidates are the top-k of the drafter's logits (the serving set),
    scored S_t(a, .) with a the true previous token (the anchor at t = 0: teacher forcing); the term is a k-way
    cross-entropy of the label among them, position k weighted as block_loss weights it.

    rule="public" (the published DFlash2 recipes): alpha x sum_t w_t CE_t / sum_t w_t, the denominator the block
    loss's (every labelled position); with inject_gold the label replaces the k-th candidate where the top-k misses
    it, without it such a position adds nothing to the numerator (the strict set); stop_gradient detaches the logits
    and the hidden states inside the term, so only the selector's own parameters learn from it.
    rule="ours" (ddtree's first loss, written before any recipe could be read; docs/dflash2.md compares both with NeMo's): the label always injected, the
    term normalised over the positions it scores, gradients everywhere. Where every position is scored, as with
    injection, the two are the same number.
    """
    if rule not in SELECTOR_LOSSES:
        raise ValueError(f"unknown selector loss {rule!r}")
    if rule == "ours" and (not inject_gold or stop_gradient):
        raise ValueError("the 'ours' selector loss always injects the label and never stops gradients")
    labels, bs = batch.labels, batch.block_size
    B, n, _ = labels.shape
    h = hidden.view(B, n, bs, -1)[:, :, 1:]
    valid = labels != IGNORE
    anchor = batch.block_ids.view(B, n, bs)[:, :, :1]
    prev = torch.cat([anchor, labels[:, :, :-1]], dim=-1)  # the token before each position
    valid = valid & (prev != IGNORE)
    w = position_weights(bs, decay, hidden.device).expand_as(labels)[valid]
    rows, tgt, before = h[valid], labels[valid], prev[valid]
    logits = drafter.head_logits(lambda x: F.linear(x, lm_head_weight.to(x.dtype), lm_head_bias), rows)
    sel = TRAINED_KIND.selector(drafter)
    k = sel.top_k
    strict = logits.detach().topk(k, dim=-1).indices  # the serving candidate set
    covered = (strict == tgt[:, None]).any(-1)
    cands = strict.clone()
    if inject_gold:
        cands[~covered, -1] = tgt[~covered]
    scored = covered | inject_gold  # positions whose label is among the loss's candidates
    where = (cands == tgt[:, None]).float().argmax(-1)
    srows, slogits = (rows.detach(), logits.detach()) if stop_gradient else (rows, logits)
    scores = _pair_scores(sel, slogits.gather(1, cands), cands, before, srows)
    ce = F.cross_entropy(scores, where, reduction="none")
    # ours: over the positions it scores (all: it always injects); public: the block loss's denominator
    raw = (ce * w * scored).sum() / (w * scored if rule == "ours" else w).sum().clamp_min(1e-9)
    with torch.no_grad():
        stats = {"selector_loss": raw.item(),
                 "selector_acc": (scores.argmax(-1) == where)[scored].float().mean().item() if scored.any() else 0.0,
                 "selector_coverage": covered.float().mean().item() if len(tgt) else 0.0,
                 **selector_metrics(sel, batch, valid, logits.detach(), strict, rows.detach())}
    return alpha * raw, stats


def _pair_scores(sel, unary: torch.Tensor, cands: torch.Tensor, before: torch.Tensor, rows: torch.Tensor
                 ) -> torch.Tensor:
    """S(a, b) = unary(b) + sum_r P[a]_r (W h)_r Q[b]_r for rows [..., H], candidates [..., k], predecessors [...]."""
    ctx = sel.predecessor_codebook[before].float() * sel.hidden_projection(rows).float()
    return unary + (ctx[..., None, :] * sel.successor_codebook[cands].float()).sum(-1)


@torch.no_grad()
def selector_metrics(sel, batch: BlockBatch, valid: torch.Tensor, logits: torch.Tensor, strict: torch.Tensor,
                     rows: torch.Tensor) -> dict[str, float]:
    """What the published recipes report of a DFlash2 drafter, on teacher-forced blocks, all on the strict top-k
    (the serving set: nothing injected): unary top-k recall (the label among the candidates) and mass (the unary
    distribution's probability on them), the unary top-1 accuracy, the selector's teacher-forced accuracy (argmax of
    S_t(true previous token, .)), and the selector walking its own choices from the anchor as it serves: its
    accuracy at positions its path reached (path_acc) and its accepted length (path_tau, 1 + leading hits, as
    tau_proxy counts the unary chain); oracle_tau: 1 + the leading positions whose label is a candidate, the most
    any walk over these candidates accepts. The selector's numbers read its scores, never the unary head's argmax."""
    labels, bs = batch.labels, batch.block_size
    B, n, L = labels.shape
    tgt = labels[valid]
    if not len(tgt):
        return {}
    anchor = batch.block_ids.view(B, n, bs)[:, :, 0]
    prev_tf = torch.cat([anchor[..., None], labels[:, :, :-1]], dim=-1)[valid]
    hit = strict == tgt[:, None]
    probs = logits.softmax(-1)
    unary = logits.gather(1, strict)
    tf = strict.gather(1, _pair_scores(sel, unary, strict, prev_tf, rows).argmax(-1, keepdim=True))[:, 0]
    # the walk, per block: dense [B, n, L, ...] (zeros where no label; such positions never count)
    k = strict.shape[-1]
    cand_d = torch.zeros(B, n, L, k, dtype=strict.dtype, device=strict.device)
    unary_d = torch.zeros(B, n, L, k, dtype=unary.dtype, device=unary.device)
    proj = sel.hidden_projection(rows).float()
    proj_d = torch.zeros(B, n, L, proj.shape[-1], dtype=proj.dtype, device=proj.device)
    cand_d[valid], unary_d[valid], proj_d[valid] = strict, unary, proj
    hit_d = torch.zeros_like(valid)
    hit_d[valid] = hit.any(-1)
    P, Q = sel.predecessor_codebook.float(), sel.successor_codebook.float()
    prev = anchor
    alive = valid[:, :, 0].clone()
    oracle = alive.clone()
    real = alive.clone()
    path_len = torch.zeros(B, n, device=labels.device)
    oracle_len = torch.zeros_like(path_len)
    reached = correct_sum = 0
    for t in range(L):
        s = unary_d[:, :, t] + ((P[prev] * proj_d[:, :, t])[:, :, None, :] * Q[cand_d[:, :, t]]).sum(-1)
        choice = cand_d[:, :, t].gather(-1, s.argmax(-1, keepdim=True))[..., 0]
        eligible = alive & valid[:, :, t]
        right = eligible & (choice == labels[:, :, t])
        reached += int(eligible.sum())
        correct_sum += int(right.sum())
        alive = right
        oracle = oracle & valid[:, :, t] & hit_d[:, :, t]
        path_len += alive.float()
        oracle_len += oracle.float()
        prev = choice
    nreal = max(1, int(real.sum()))
    return {"unary_recall": hit.any(-1).float().mean().item(),
            "unary_mass": probs.gather(1, strict).sum(-1).mean().item(),
            "unary_acc": (strict[:, 0] == tgt).float().mean().item(),
            "selector_acc_tf": (tf == tgt).float().mean().item(),
            "path_acc": correct_sum / max(1, reached),
            "path_tau": 1.0 + path_len[real].sum().item() / nreal,
            "oracle_tau": 1.0 + oracle_len[real].sum().item() / nreal}
