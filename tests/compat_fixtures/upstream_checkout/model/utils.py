"""Stand-in helpers: the same names and the same top-level import of `datasets` as the authors' module."""

import torch
from datasets import load_dataset


def extract_context_feature(hidden_states, layer_ids):
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def sample(logits, temperature=0.0):
    if temperature < 1e-5:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(probs.shape[:-1])


def load_and_process_dataset(name):
    return load_dataset(name)
