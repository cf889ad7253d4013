"""Stand-in for the authors' dflash.py, written for these tests (not their code).

Same function names, signatures, returned fields and 4.x-era call style as theirs: a bare
`DynamicCache()`, `past_key_values=`, `cache.crop(absolute_length)`, `target.model.embed_tokens`,
a stage timer that calls `torch.cuda.synchronize()`, outputs filtered by the mask token id.
"""

import time
from types import SimpleNamespace

import torch
from model import DFlashDraftModel, extract_context_feature, sample
from transformers import DynamicCache

STAGES = ("draft", "verify", "commit")

__all__ = ["DFlashDraftModel", "cuda_time", "dflash_generate", "empty_stage_times", "finish"]


def cuda_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def empty_stage_times(names) -> dict:
    return dict.fromkeys(names, 0.0)


def draft_block(model, target, out, positions, hidden, draft_cache, start, block_size):
    """The drafter's logits for the block [out[start], mask, ...] (block_size - 1 rows)."""
    block = out[:, start : start + block_size].clone()
    hidden_states = model(
        target_hidden=hidden,
        noise_embedding=target.model.embed_tokens(block),
        position_ids=positions[:, draft_cache.get_seq_length() : start + block_size],
        past_key_values=draft_cache,
        use_cache=True,
        is_causal=False,
    )
    draft_cache.crop(start)
    return block, target.lm_head(hidden_states[:, 1:, :])


def finish(out, num_input, limit, mask_token_id, stop_token_ids, lengths, times, ttft, decode_start, stamps):
    out = out[:, :limit]
    if stop_token_ids:
        hits = torch.isin(out[0, num_input:], torch.tensor(stop_token_ids, device=out.device)).nonzero()
        if hits.numel():
            out = out[:, : num_input + int(hits[0, 0]) + 1]
    produced = out.shape[1] - num_input
    return SimpleNamespace(
        output_ids=out.cpu(),
        num_input_tokens=num_input,
        num_output_tokens=produced,
        time_to_first_token=ttft,
        time_per_output_token=(cuda_time() - decode_start) / max(produced, 1),
        acceptance_lengths=lengths,
        decode_rounds=len(lengths),
        stage_times=times,
        round_timestamps=stamps,
    )


def stopped(out, lo, hi, stop_token_ids) -> bool:
    return bool(stop_token_ids) and any(int(t) in stop_token_ids for t in out[0, lo:hi].tolist())


@torch.inference_mode()
def dflash_generate(model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids,
                    temperature=0.0):
    num_input = input_ids.shape[1]
    limit = num_input + max_new_tokens
    out = torch.full((1, limit + block_size + 1), mask_token_id, dtype=torch.long, device=model.device)
    positions = torch.arange(out.shape[1], device=model.device)[None]
    cache, draft_cache = DynamicCache(), DynamicCache()
    times = empty_stage_times(STAGES)

    t = cuda_time()
    o = target(input_ids, position_ids=positions[:, :num_input], past_key_values=cache, use_cache=True,
               logits_to_keep=1, output_hidden_states=block_size > 1)
    out[:, :num_input] = input_ids
    out[:, num_input : num_input + 1] = sample(o.logits, temperature)
    hidden = extract_context_feature(o.hidden_states, model.target_layer_ids) if block_size > 1 else None
    ttft = cuda_time() - t
    decode_start = cuda_time()
    start, lengths, stamps = num_input, [], []
    while start < limit:
        t = cuda_time()
        block = out[:, start : start + block_size].clone()
        if block_size > 1:
            block, logits = draft_block(model, target, out, positions, hidden, draft_cache, start, block_size)
            block[:, 1:] = sample(logits)
        times["draft"] += cuda_time() - t
        t = cuda_time()
        o = target(block, position_ids=positions[:, start : start + block_size], past_key_values=cache,
                   use_cache=True, output_hidden_states=block_size > 1)
        times["verify"] += cuda_time() - t
        t = cuda_time()
        posterior = sample(o.logits, temperature)
        matched = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
        out[:, start : start + matched + 1] = block[:, : matched + 1]
        out[:, start + matched + 1] = posterior[:, matched]
        start += matched + 1
        cache.crop(start)
        if block_size > 1:
            hidden = extract_context_feature(o.hidden_states, model.target_layer_ids)[:, : matched + 1]
        lengths.append(matched + 1)
        times["commit"] += cuda_time() - t
        stamps.append(cuda_time() - decode_start)
        if stopped(out, start - matched - 1, start + 1, stop_token_ids):
            break
    out = out[:, :limit]
    out = out[:, out[0] != mask_token_id]  # as in the authors' code: drops every mask id, not only the tail
    return finish(out, num_input, limit, mask_token_id, stop_token_ids, lengths, times, ttft, decode_start, stamps)
