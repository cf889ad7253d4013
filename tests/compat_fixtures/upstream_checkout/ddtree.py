"""Stand-in for the authors' ddtree.py, written for these tests (not their code).

The same functions as theirs (build_ddtree_tree, follow_verified_tree, compact_dynamic_cache,
ddtree_generate), with their signatures and call style: the tree is verified in one target forward
under an additive 4-D mask, then the cache's appended window is compacted to the accepted path and
cropped with an absolute length. Imports its siblings by top-level name, as theirs do.
"""

import heapq

import torch
from dflash import cuda_time, dflash_generate, draft_block, empty_stage_times, finish, stopped
from loguru import logger
from model import extract_context_feature, sample
from transformers import DynamicCache

STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")


def build_ddtree_tree(draft_logits, budget):
    """The `budget` most likely prefixes under per-depth log-probabilities, best first.

    Returns (node token ids, node depths, parents with -1 for the root, child maps, visibility, sub-times).
    """
    logp = torch.log_softmax(draft_logits.float(), dim=-1).cpu()
    k = min(budget, logp.shape[-1])
    top, ids = logp.topk(k, dim=-1)
    tokens, depths, parents, children = [], [], [-1], [{}]
    frontier = [(-float(top[0, 0]), 0, 0, 0)]  # (-log weight, parent node, depth index, rank)
    while frontier and len(tokens) < budget:
        neg, parent, d, r = heapq.heappop(frontier)
        node, tok = len(tokens) + 1, int(ids[d, r])
        tokens.append(tok)
        depths.append(d + 1)
        parents.append(parent)
        children.append({})
        children[parent][tok] = node
        if r + 1 < k:  # the next sibling
            heapq.heappush(frontier, (neg + float(top[d, r]) - float(top[d, r + 1]), parent, d, r + 1))
        if d + 1 < logp.shape[0]:  # the best child
            heapq.heappush(frontier, (neg - float(top[d + 1, 0]), node, d + 1, 0))
    n = len(parents)
    visibility = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        visibility[i] |= visibility[parents[i]]
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(depths, dtype=torch.long), parents, children, \
        visibility, {}


def follow_verified_tree(child_maps, posterior):
    posterior = posterior[0].tolist()
    path, node = [0], 0
    while posterior[node] in child_maps[node]:
        node = child_maps[node][posterior[node]]
        path.append(node)
    return path, posterior[node]


def compact_dynamic_cache(past_key_values, past_length, keep_current_indices):
    for layer in past_key_values.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        keep = torch.tensor(keep_current_indices, dtype=torch.long, device=layer.keys.device)
        for tensor in (layer.keys, layer.values):
            kept = tensor[..., past_length:, :].index_select(-2, keep)
            tensor[..., past_length : past_length + keep.numel(), :] = kept
    past_key_values.crop(past_length + len(keep_current_indices))


@torch.inference_mode()
def ddtree_generate(model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids,
                    temperature=0.0, tree_budget=None):
    if block_size <= 1:
        return dflash_generate(model=model, target=target, input_ids=input_ids, mask_token_id=mask_token_id,
                               max_new_tokens=max_new_tokens, block_size=block_size,
                               stop_token_ids=stop_token_ids, temperature=temperature)
    tree_budget = block_size - 1 if tree_budget is None else tree_budget
    logger.info(f"ddtree_generate (stand-in), budget {tree_budget}")
    device = model.device
    num_input = input_ids.shape[1]
    limit = num_input + max_new_tokens
    out = torch.full((1, limit + block_size + 1), mask_token_id, dtype=torch.long, device=device)
    positions = torch.arange(out.shape[1], device=device)[None]
    cache, draft_cache = DynamicCache(), DynamicCache()
    times = empty_stage_times(STAGES)

    t = cuda_time()
    o = target(input_ids, position_ids=positions[:, :num_input], past_key_values=cache, use_cache=True,
               logits_to_keep=1, output_hidden_states=True)
    out[:, :num_input] = input_ids
    out[:, num_input : num_input + 1] = sample(o.logits, temperature)
    hidden = extract_context_feature(o.hidden_states, model.target_layer_ids)
    ttft = cuda_time() - t
    decode_start = cuda_time()
    start, lengths, stamps = num_input, [], []
    while start < limit:
        t = cuda_time()
        _, logits = draft_block(model, target, out, positions, hidden, draft_cache, start, block_size)
        times["draft"] += cuda_time() - t
        t = cuda_time()
        tokens, depths, parents, children, visibility, _ = build_ddtree_tree(logits[0], tree_budget)
        times["tree_build"] += cuda_time() - t
        t = cuda_time()
        n = len(parents)
        ids = torch.cat([out[:, start : start + 1], tokens[None].to(device)], dim=1)
        pos = start + torch.cat([torch.zeros(1, dtype=torch.long), depths])[None].to(device)
        mask = torch.full((1, 1, n, start + n), torch.finfo(target.dtype).min, dtype=target.dtype, device=device)
        mask[..., :start] = 0
        mask[0, 0, :, start:].masked_fill_(visibility.to(device), 0)
        times["tree_compile"] += cuda_time() - t
        t = cuda_time()
        o = target(ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                   output_hidden_states=True)
        times["verify"] += cuda_time() - t
        t = cuda_time()
        path, next_token = follow_verified_tree(children, sample(o.logits, temperature))
        keep = torch.tensor(path, dtype=torch.long, device=device)
        out[:, start : start + len(path)] = ids.index_select(1, keep)
        out[:, start + len(path)] = next_token
        compact_dynamic_cache(cache, start, path)
        hidden = extract_context_feature(o.hidden_states, model.target_layer_ids).index_select(1, keep)
        lengths.append(len(path))
        start += len(path)
        times["commit"] += cuda_time() - t
        stamps.append(cuda_time() - decode_start)
        if stopped(out, start - len(path), start + 1, stop_token_ids):
            break
    out = out[:, :limit]
    out = out[:, out[0] != mask_token_id]  # as in the authors' code: drops every mask id, not only the tail
    return finish(out, num_input, limit, mask_token_id, stop_token_ids, lengths, times, ttft, decode_start, stamps)
