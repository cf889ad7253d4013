"""Tiny targets with EAGLE-3 drafters for tests: a drafter fitted in seconds to the target's greedy outputs (so drafts
get accepted and the draft layer's rollback is exercised), checkpoints in the public layout (and malformed ones), and
a from-scratch reference of the drafting (no cache, one causal pass)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from ddtree.engine.drafter.eagle3 import Eagle3Drafter
from ddtree.train.mtp import causal_mask


@torch.no_grad()
def greedy_rows(target, n: int = 8, prompt_len: int = 6, new: int = 32, seed: int = 0) -> torch.Tensor:
    """[n, prompt_len + new]: random prompts and the target's greedy continuations."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (n, prompt_len), generator=g)
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)


def aux_states(target, drafter: Eagle3Drafter, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, 3 Ht]: the target's hidden states before each aux layer (HF's hidden_states[j]), concatenated."""
    hs = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[j] for j in drafter.aux_layer_ids], dim=-1)


def fitted_drafter(target, seed: int = 0, steps: int = 60, lr: float = 1e-2, draft_vocab_size: int = 96) -> Eagle3Drafter:
    """A random drafter whose draft vocabulary is the target's most frequent greedy tokens (as EAGLE-3's pruned
    vocabularies are built), fitted one step deep (teacher-forced: (aux state at p, token p + 1) -> token p + 2)."""
    rows = greedy_rows(target, seed=seed)
    n = target.config.get_text_config().num_hidden_layers
    drafter = Eagle3Drafter.random_for_target(target, seed=seed, draft_vocab_size=draft_vocab_size,
                                              aux_layer_ids=[1, n // 2, n - 1])  # the last: what predicts best
    vocab = target.config.get_text_config().vocab_size
    counts = torch.bincount(rows.flatten(), minlength=vocab).double() + torch.rand(vocab, dtype=torch.float64) * 1e-3
    ids = counts.topk(draft_vocab_size).indices.sort().values
    with torch.no_grad():
        drafter.d2t.copy_(ids - torch.arange(draft_vocab_size))
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
    drafter.bind(target)
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[ids] = torch.arange(draft_vocab_size)
    with torch.no_grad():
        aux = aux_states(target, drafter, rows)[:, :-2]
    inp, want = rows[:, 1:-1], to_draft[rows[:, 2:]]
    t = inp.shape[1]
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    drafter.train()
    with torch.enable_grad():
        for _ in range(steps):
            out = drafter(drafter.embed(inp), aux, torch.arange(t)[None], causal_mask(t, aux.dtype), DynamicCache())
            logits = drafter.lm_head(drafter.norm(out))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, draft_vocab_size), want.reshape(-1),
                                                     ignore_index=-1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return drafter.eval()


@torch.no_grad()
def reference_draft_logits(target, drafter: Eagle3Drafter, committed: list[int], drafts: list[int]) -> torch.Tensor:
    """The drafter's logits after `committed` (the last one the root) and then `drafts`, recomputed from scratch:
    the target's plain forward for its aux states, every draft-layer entry in one causal pass, no cache kept.

    Entry p < len(committed) - 1 reads (committed[p + 1], fc(aux states at p)); each draft then reads (itself, the
    layer's output of the entry before) one position on. Returns the last entry's logits over the target's ids."""
    ids = torch.tensor([committed])
    fused = drafter.fc(aux_states(target, drafter, ids)[:, : len(committed) - 1])
    toks, chain = committed[1:], []
    for j in range(len(drafts) + 1):
        seq = toks + drafts[:j]
        hs = torch.cat([fused, *chain[:j]], dim=1)
        n = len(seq)
        out = drafter(drafter.embed(torch.tensor([seq])), hs, torch.arange(n)[None], causal_mask(n, hs.dtype),
                      DynamicCache())
        chain.append(out[:, -1:])
    return drafter.logits(chain[-1][0, 0]).float()


def rewrite_checkpoint(src: Path, dest: Path, *, drop: tuple[str, ...] = (), tensors: dict | None = None,
                       config: dict | None = None, rename: dict | None = None) -> Path:
    """A copy of the checkpoint at `src` with tensors dropped, replaced or renamed and config.json keys changed."""
    dest.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    state.update(tensors or {})
    for old, new in (rename or {}).items():
        state = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in state.items()}
    save_file(state, str(dest / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest
