"""Pretrain the tiny toy target on the synthetic corpus (CPU, minutes).

    python toy/pretrain.py --data runs/toy/data --tokenizer runs/toy/tokenizer --out runs/toy/target
    python toy/pretrain.py --arch qwen3 ...        # pure-attention variant

Default architecture: a hybrid Qwen3.5 text model (Gated DeltaNet + full attention, the
mission's family). Loss on assistant tokens only (prompts are random by design). Writes a
Hugging Face checkpoint (config.json, model.safetensors, tokenizer files) plus metrics.json
with held-out exact-match accuracy of greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer import render  # noqa: E402

IGNORE = -100


def target_config(arch: str, vocab_size: int, hidden: int, layers: int, eos_id: int, pad_id: int):
    heads = max(1, hidden // 32)
    kw = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
              max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=10000.0,
              eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    if arch == "qwen3_5_text":
        # GDN layers with a full-attention layer every third layer (Qwen3.5 uses every fourth)
        kw.update(layer_types=["full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(layers)],
                  linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2), linear_key_head_dim=32,
                  linear_value_head_dim=32, linear_conv_kernel_dim=4)
    elif arch != "qwen3":
        raise SystemExit(f"--arch: unknown {arch!r}; use qwen3_5_text or qwen3")
    return AutoConfig.for_model(arch, **kw)


def encode(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) with labels only on the assistant turn (its content and the closing eos)."""
    out = []
    for r in rows:
        prompt = render(r["messages"][:-1]) + "<|im_start|>assistant\n"
        full = render(r["messages"])
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        assert ids[:len(p_ids)] == p_ids, "prompt tokenization is not a prefix of the conversation"
        ids = ids[:-1]  # drop the trailing "\n" after <|im_end|>: generation stops at eos
        labels = [IGNORE] * len(p_ids) + ids[len(p_ids):]
        out.append((ids, labels))
    return out


def batches(data, batch_size: int, rng: random.Random, pad_id: int):
    """Shuffled batches, sorted by length within groups of 32 batches to cut padding."""
    idx = list(range(len(data)))
    rng.shuffle(idx)
    group = batch_size * 32
    chunks = []
    for g in range(0, len(idx), group):
        part = sorted(idx[g:g + group], key=lambda i: len(data[i][0]))
        chunks += [part[b:b + batch_size] for b in range(0, len(part), batch_size)]
    rng.shuffle(chunks)
    for ch in chunks:
        n = max(len(data[i][0]) for i in ch)
        ids = torch.full((len(ch), n), pad_id, dtype=torch.long)
        lab = torch.full((len(ch), n), IGNORE, dtype=torch.long)
        att = torch.zeros((len(ch), n), dtype=torch.long)
        for j, i in enumerate(ch):
            x, y = data[i]
            ids[j, :len(x)] = torch.tensor(x)
            lab[j, :len(y)] = torch.tensor(y)
            att[j, :len(x)] = 1
        yield ids, lab, att


def loss_of(model, ids, lab, att):
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), lab[:, 1:].reshape(-1),
                                             ignore_index=IGNORE)


@torch.no_grad()
def greedy_eval(model, tok, rows: list[dict], max_new_tokens: int = 120) -> dict:
    """Exact match of greedy decoding against the reference answer, per category."""
    model.eval()
    per: dict[str, list[int]] = {}
    ends = 0
    for r in rows:
        q, ref = r["messages"][0]["content"], r["messages"][1]["content"]
        prompt = render([{"role": "user", "content": q}]) + "<|im_start|>assistant\n"
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        ended = tok.eos_token_id in new
        ends += ended
        text = tok.decode(new[:new.index(tok.eos_token_id)] if ended else new)
        per.setdefault(r["category"], []).append(int(ended and text.strip() == ref))
    model.train()
    acc = {k: sum(v) / len(v) for k, v in sorted(per.items())}
    total = sum(sum(v) for v in per.values()) / max(1, len(rows))
    return {"exact_match": total, "ends_with_eos": ends / max(1, len(rows)), "per_category": acc}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="runs/toy/data")
    p.add_argument("--tokenizer", default="runs/toy/tokenizer")
    p.add_argument("--out", default="runs/toy/target")
    p.add_argument("--arch", default="qwen3_5_text", choices=["qwen3_5_text", "qwen3"])
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    p.add_argument("--eval-examples", type=int, default=80)
    p.add_argument("--init", default=None, help="continue from this checkpoint instead of a random init")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data_dir, out = Path(args.data), Path(args.out)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    train_rows = [json.loads(line) for line in open(data_dir / "train.jsonl")]
    valid_rows = [json.loads(line) for line in open(data_dir / "valid.jsonl")]
    train, valid = encode(tok, train_rows), encode(tok, valid_rows)

    cfg = target_config(args.arch, len(tok), args.hidden, args.layers, tok.eos_token_id, tok.pad_token_id)
    if args.init:
        model = AutoModelForCausalLM.from_pretrained(args.init, attn_implementation="sdpa", dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = int(steps_per_epoch * args.epochs)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, total - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    print(f"target {args.arch}: {n_params / 1e6:.2f}M params, {len(train)} train convs, {total} steps")
    model.train()
    step, t0, ema = 0, time.time(), None
    while step < total:
        for ids, lab, att in batches(train, args.batch_size, rng, tok.pad_token_id):
            if step >= total:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = loss_of(model, ids, lab, att)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            step += 1
            if step % 25 == 0 or step == total:
                print(f"step {step}/{total} loss {ema:.4f} lr {lr_at(step):.2e} {time.time() - t0:.0f}s", flush=True)

    model.eval()
    with torch.no_grad():
        vb = list(batches(valid, 64, random.Random(0), tok.pad_token_id))
        vloss = sum(loss_of(model, *b).item() for b in vb) / len(vb)
    ev = greedy_eval(model, tok, valid_rows[:args.eval_examples])
    metrics = {"arch": args.arch, "params": n_params, "steps": total, "train_s": round(time.time() - t0, 1),
               "valid_loss": vloss, **ev}
    print(json.dumps(metrics, indent=1))
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"saved target -> {out}")


if __name__ == "__main__":
    main()
