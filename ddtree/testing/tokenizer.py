"""An offline character-level tokenizer for the tiny random models (no download, built in code).

Specials first, then printable ASCII plus newline and tab, then filler tokens up to `vocab_size`;
other characters map to <unk>. The chat template is Qwen-style (<|im_start|>role ... <|im_end|>).
"""

from __future__ import annotations

from functools import lru_cache

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
