"""Tiny targets with MTP heads for tests and benchmarks: a head fitted in seconds (so drafts get accepted and
rollback is exercised), checkpoints saved in the public layout, and a from-scratch reference of the drafting."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ddtree.engine.drafter.mtp import MTPHead
from ddtree.train.mtp import causal_mask, fit


@torch.no_grad()
def greedy_records(target, n: int = 8, prompt_len: int = 6, new: int = 32, seed: int = 0) -> list[dict]:
    """The target's greedy continuations of random prompts, as training records (ddtree.train.data's format)."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (n, prompt_len), generator=g)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
    return [{"input_ids": row, "spans": [[prompt_len, prompt_len + new]]} for row in out.tolist()]


def fitted_head(target, seed: int = 0, steps: int = 30, lr: float = 1e-2) -> MTPHead:
    """A random head fitted briefly to the target's own greedy outputs (fp32; a few seconds on a tiny target)."""
    head = MTPHead.random_for_target(target, seed=seed)
    records = greedy_records(target, seed=seed)
    with torch.enable_grad():
        fit(head, target, records, epochs=steps, lr=lr, batch_size=len(records), unroll=2, seed=seed,
            log=lambda _: None, keep_hidden=True)
    return head.eval()


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused experts as Qwen3-Next's published per-expert tensors."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def save_target_with_mtp(target, head: MTPHead | None, directory: str | Path, *, prefix: str = "mtp.",
                         per_expert: bool = False, tokenizer=None) -> Path:
    """`target` saved by transformers, then (head given) its MTP tensors as the public checkpoints ship them:
    `prefix`* in a second safetensors shard, both shards named by model.safetensors.index.json, and
    `mtp_num_hidden_layers: 1` in config.json. per_expert: MoE experts one tensor each (Qwen3-Next's layout)."""
    d = Path(directory)
    target.save_pretrained(d, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)
    if head is None:
        return d
    state = head.checkpoint_state(prefix)
    state = _per_expert(state) if per_expert else state
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    index_path = d / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        from safetensors import safe_open

        (single,) = shards
        (d / single).rename(d / "model-00001-of-00002.safetensors")
        with safe_open(d / "model-00001-of-00002.safetensors", framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model-00001-of-00002.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, d / "model-00002-of-00002.safetensors",
              metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(state, "model-00002-of-00002.safetensors"))
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


@torch.no_grad()
def reference_head_logits(target, head: MTPHead, committed: list[int], drafts: list[int]) -> torch.Tensor:
    """The head's logits after `committed` (the last one the root) and then `drafts`, recomputed from scratch:
    the target's plain forward for its hidden states, every head entry in one causal pass, no cache.

    Entry p < len(committed) - 1 reads (committed[p + 1], target hidden at p); each draft then reads (itself, the
    head's output of the entry before) one position on. Returns the last entry's logits [V] (float)."""
    ids = torch.tensor([committed])
    hidden = target(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
    toks, h = committed[1:], hidden[:, : len(committed) - 1]
    chain = []  # chain[j]: the output the draft j + 1 reads (the last committed entry's, then each draft's)
    for j in range(len(drafts) + 1):
        seq = toks + drafts[:j]
        hs = torch.cat([h, *chain[:j]], dim=1)
        n = len(seq)
        out = head(head.embed(torch.tensor([seq])), hs, torch.arange(n)[None], causal_mask(n, hs.dtype), None)
        chain.append(out[:, -1:])
    return head.logits(chain[-1][0, 0]).float()
