"""Tiny random models built from configs and their offline character tokenizer: what `model.tiny` builds for smoke
runs, and what tests and benchmarks build. No downloads.

The tokenizer: specials first, then printable ASCII plus newline and tab, then filler tokens up to `vocab_size`;
other characters map to <unk>. The chat template is Qwen-style (<|im_start|>role ... <|im_end|>).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from transformers import AutoConfig, PreTrainedModel

from ddtree.engine.families import auto_model_class, family

_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False)


def tiny_config(model_type: str = "qwen3", vocab_size: int = 128, num_hidden_layers: int = 4, **overrides):
    """A small config of a real transformers model type (its family's hints from ddtree.engine.families)."""
    row = family(model_type)
    kw = dict(_COMMON, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers, **row.tiny)
    if row.hybrid_every:  # hybrid: linear-attention (GDN) layers, every n-th one full attention
        kw["layer_types"] = [("full_attention" if (i + 1) % row.hybrid_every == 0 else "linear_attention")
                             for i in range(num_hidden_layers)]
    elif row.sliding_every:  # sliding-window layers, every n-th one full attention
        kw["layer_types"] = [("full_attention" if (i + 1) % row.sliding_every == 0 else "sliding_attention")
                             for i in range(num_hidden_layers)]
    if "vocab_size_per_layer_input" in AutoConfig.for_model(row.tiny_text or model_type).to_dict():  # Gemma 4
        kw["vocab_size_per_layer_input"] = kw["vocab_size"]
    kw.update(overrides)
    if row.tiny_text:  # a multimodal wrapper: the tiny text config inside it, a tiny vision tower beside
        return AutoConfig.for_model(model_type, text_config=AutoConfig.for_model(row.tiny_text, **kw).to_dict(),
                                    **row.tiny_outer)
    return AutoConfig.for_model(model_type, **kw)


def slow_decay_(model: PreTrainedModel, decay: float = 0.05) -> PreTrainedModel:
    """Make GDN layers remember: random A_log forgets within ~1 token and hides rollback bugs."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            with torch.no_grad():
                p.fill_(math.log(decay))
    return model


def tiny_model(model_type: str = "qwen3", seed: int = 0, attn_implementation: str = "eager",
               dtype: torch.dtype = torch.float32, slow_decay: bool = True, **config_overrides) -> PreTrainedModel:
    cfg = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    model = auto_model_class(model_type).from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    if slow_decay:
        slow_decay_(model)
    real_sinks_(model)
    return model.eval()


def real_sinks_(model: PreTrainedModel, std: float = 1.0) -> PreTrainedModel:
    """Attention sinks (gpt-oss) of a real model's spread: initialised near 0 they barely move a row's weights."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


# ---------------------------------------------------------------- the tokenizer

SPECIALS = ("<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>")
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n", "\t")
MIN_VOCAB = len(SPECIALS) + len(CHARS)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 128):
    """A PreTrainedTokenizerFast whose ids all fall below `vocab_size` (>= MIN_VOCAB)."""
    return _build(vocab_size)


@lru_cache(maxsize=8)
def _build(vocab_size: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        from ddtree.errors import ConfigError

        raise ConfigError("model.tiny.vocab_size", f"the tiny tokenizer needs >= {MIN_VOCAB} ids, got {vocab_size}",
                          f"use model.tiny.vocab_size={MIN_VOCAB} or more")
    tokens = list(SPECIALS) + list(CHARS)
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<|mask|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast
