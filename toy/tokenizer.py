"""A small byte-level BPE tokenizer trained on the toy corpus, saved as a Hugging Face tokenizer.

    python toy/tokenizer.py --data runs/toy/data --out runs/toy/tokenizer

Byte-level, so any prompt text encodes (no unknown token); the corpus' words and numbers each
become one token. ChatML-style chat template; eos = <|im_end|>, pad = <|endoftext|>, and a
<|mask|> token that the DFlash drafter uses for its block positions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def render(messages: list[dict]) -> str:
    """The chat template in Python, for training text (equal to apply_chat_template's output)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def corpus_texts(data_dir: Path) -> list[str]:
    texts = []
    for split in ("train", "valid"):
        with open(data_dir / f"{split}.jsonl") as f:
            texts += [render(json.loads(line)["messages"]) for line in f]
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=["<|im_start|>", "<|mask|>"],
                                   model_max_length=2048, clean_up_tokenization_spaces=False)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="runs/toy/data")
    p.add_argument("--out", default="runs/toy/tokenizer")
    p.add_argument("--vocab-size", type=int, default=1024)
    args = p.parse_args(argv)
    tok = train_tokenizer(corpus_texts(Path(args.data)), args.vocab_size)
    tok.save_pretrained(args.out)
    print(f"tokenizer: vocab {len(tok)} -> {args.out}")


if __name__ == "__main__":
    main()
