"""Stand-in for the authors' dflash.py: a 4.x-style draft/verify/rollback loop."""

import time

import torch
from model import ToyDrafter, sample
from transformers import DynamicCache


def cuda_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


@torch.inference_mode()
def dflash_generate(target, input_ids: torch.Tensor, max_new_tokens: int, block_size: int = 4):
    drafter = ToyDrafter()
    cache = DynamicCache()
    started = cuda_time()
    out = target(input_ids, past_key_values=cache, use_cache=True)
    tokens = torch.cat([input_ids, sample(out.logits[:, -1:])], dim=1)
    start = input_ids.shape[1]
    accepted = []
    while tokens.shape[1] - input_ids.shape[1] < max_new_tokens:
        block = torch.cat([tokens[:, -1:], drafter.propose(tokens[:, -1:], block_size - 1)], dim=1)
        out = target(block, past_key_values=cache, use_cache=True)
        posterior = sample(out.logits)
        n = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
        tokens = torch.cat([tokens, block[:, 1 : n + 1], posterior[:, n : n + 1]], dim=1)
        start += n + 1
        cache.crop(start)
        accepted.append(n + 1)
    elapsed = cuda_time() - started
    return tokens[:, : input_ids.shape[1] + max_new_tokens], accepted, elapsed
