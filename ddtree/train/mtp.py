"""Training an MTP head for a target that has none (the toy): the objective, a short fit, and the checkpoint.

    python -m ddtree.train.mtp --target assets/toy/target --prompts assets/toy/train_prompts.jsonl \\
        --eval-prompts assets/toy/prompts.jsonl --install         # the shipped toy head (make toy-mtp)

The objective is the head's inference step, teacher-forced: at position p it reads the token at p + 1 and the
target's output hidden state at p (after the final norm, what the serving engines hand it) and predicts the
token at p + 2; `unroll` > 1 adds the recursive steps (the head's own output as the next hidden state, one
token further), as it drafts them. The data are the target's own greedy answers (ddtree.train.data), so the
head learns what verification accepts. `--install` writes the head beside the target's weights as the public
checkpoints ship it: tensors `mtp.*` in a second safetensors file, named by `model.safetensors.index.json`
(transformers still loads the target from model.safetensors and ignores them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.engine.drafter.mtp import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, MTPHead

MTP_SHARD = "model-mtp.safetensors"


def causal_mask(t: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive [1, 1, t, t] causal mask."""
    m = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)
    return m[None, None]


def mtp_loss(head: MTPHead, hidden: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
             unroll: int = 1) -> tuple[torch.Tensor, list[float]]:
    """Mean cross-entropy of the head over `unroll` recursive steps, and each step's accuracy.

    hidden [B, T, H]: the target's output hidden states of ids [B, T]; valid [B, T] bool: positions whose token
    is a training label (answers, not padding). Step s (1-based) at position p reads token p + s with the
    step-(s-1) output at p (the target's hidden for s = 1) at rotary position p + s - 1 and predicts p + s + 1."""
    B, T, _ = hidden.shape
    h = hidden
    losses, accs = [], []
    for s in range(1, unroll + 1):
        n = T - s - 1  # positions p with a label at p + s + 1
        if n <= 0:
            break
        h = h[:, :n]
        pos = torch.arange(s - 1, s - 1 + n, device=ids.device)[None].expand(B, n)
        out = head(head.embed(ids[:, s: s + n]), h, pos, causal_mask(n, h.dtype, h.device), None)
        logits = head.logits(out).float()
        labels = ids[:, s + 1: s + 1 + n]
        keep = valid[:, s + 1: s + 1 + n]
        losses.append(F.cross_entropy(logits[keep], labels[keep]))
        accs.append(float((logits[keep].argmax(-1) == labels[keep]).float().mean()))
        h = out
    return torch.stack(losses).mean(), accs


def init_from_target(head: MTPHead, target) -> None:
    """A warm start: the layer from the target's last full-attention layer, fc passing the normed hidden state."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    types = getattr(target.config.get_text_config(), "layer_types", None) or []
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if full:
        head.layers[0].load_state_dict(base.layers[full[-1]].state_dict())
    h = head.fc.weight.shape[0]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        head.fc.weight[:, :h] = torch.randn(h, h) * 0.02
        head.norm.weight.copy_(base.norm.weight)


@torch.no_grad()
def target_hidden(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's output hidden state (after the final norm) at every position: [B, T, H]."""
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    return base(input_ids=ids).last_hidden_state


def batches(records: list[dict], batch_size: int, pad: int, rng: random.Random):
    """(group, ids [B, T], valid [B, T]): right-padded batches of similar lengths, shuffled."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["input_ids"]))
    groups = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    for g in groups:
        T = max(len(records[i]["input_ids"]) for i in g)
        ids = torch.full((len(g), T), pad, dtype=torch.long)
        valid = torch.zeros(len(g), T, dtype=torch.bool)
        for r, i in enumerate(g):
            seq = records[i]["input_ids"]
            ids[r, : len(seq)] = torch.tensor(seq)
            for a, b in records[i]["spans"]:
                valid[r, a:b] = True
        yield tuple(g), ids, valid


def fit(head: MTPHead, target, records: list[dict], *, epochs: int = 2, lr: float = 2e-3, batch_size: int = 32,
        unroll: int = 2, pad: int = 0, seed: int = 0, log=print, keep_hidden: bool = False) -> list[dict]:
    """AdamW over the head's parameters (the target's embeddings and head stay frozen); cosine schedule.
    keep_hidden: compute each batch's target hidden states once (few records, many epochs)."""
    rng = random.Random(seed)
    params = [p for p in head.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = epochs * math.ceil(len(records) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 20) * 0.5 * (1 + math.cos(math.pi * k / total)))
    curve, step, t0 = [], 0, time.perf_counter()
    kept: dict[tuple, torch.Tensor] = {}
    head.train()
    for epoch in range(epochs):
        for group, ids, valid in batches(records, batch_size, pad, rng):
            hidden = kept.get(group)
            if hidden is None:
                hidden = target_hidden(target, ids)
                if keep_hidden:
                    kept[group] = hidden
            loss, accs = mtp_loss(head, hidden, ids, valid, unroll)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 20 == 0 or step == total:
                row = {"step": step, "epoch": epoch, "loss": round(float(loss.detach()), 4), "acc": accs,
                       "seconds": round(time.perf_counter() - t0, 1)}
                curve.append(row)
                log(f"mtp train: {json.dumps(row)}")
    head.eval()
    return curve


def install(head: MTPHead, target_dir: Path) -> Path:
    """Write the head beside the target's weights: `mtp.*` in MTP_SHARD, both files named by the index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file(head.checkpoint_state(), target_dir / MTP_SHARD, metadata={"format": "pt"})
    (target_dir / MTP_SHARD).chmod(0o644)  # as the target's own files (safetensors writes 0600)
    weight_map = {}
    with safe_open(target_dir / WEIGHTS_NAME, framework="pt") as f:
        weight_map.update(dict.fromkeys(f.keys(), WEIGHTS_NAME))
    with safe_open(target_dir / MTP_SHARD, framework="pt") as f:
        weight_map.update(dict.fromkeys(f.keys(), MTP_SHARD))
    size = sum((target_dir / n).stat().st_size for n in (WEIGHTS_NAME, MTP_SHARD))
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (target_dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    cfg_path = target_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return target_dir / MTP_SHARD


def evaluate_tau(target, head: MTPHead, tokenizer, prompts_path: str, *, steps: int = 3, topk: int = 1,
                 budget: int = 64, max_samples: int = 16, max_new_tokens: int = 128) -> dict:
    """tau (mean committed tokens a round) of method=mtp over the prompts, and its greedy match with AR."""
    from ddtree.engine.loop import Engine
    from ddtree.pipeline.prompts import encode, read_jsonl
    from ddtree.train.data import stop_ids

    stops = stop_ids(tokenizer, target)
    mtp = Engine(target, head, method="mtp", steps=steps, topk=topk, budget=budget)
    ar = Engine(target, None, method="ar")
    rounds = tokens = matched = 0
    prompts = read_jsonl(prompts_path)[:max_samples]
    for p in prompts:
        ids = encode(tokenizer, [{"role": "user", "content": p.turns[0]}], chat_template=True)
        x = torch.tensor([ids])
        r = mtp.generate(x, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        a = ar.generate(x, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        rounds, tokens = rounds + len(r.acceptance_lengths), tokens + len(r.output_ids) - 1
        matched += r.output_ids == a.output_ids
    return {"steps": steps, "topk": topk, "budget": budget if topk > 1 else None, "prompts": len(prompts),
            "tau": tokens / max(rounds, 1), "match_rate": matched / max(len(prompts), 1)}


def engine_sequences(target, drafter, tokenizer, prompts_path: str, out_dir: Path, *, max_samples: int | None,
                     max_new_tokens: int, log=print) -> None:
    """ddtree.train.data's sequences (the target's greedy answers), decoded by the engine with a DFlash drafter:
    the same tokens as greedy decoding (lossless), several times faster than `generate` on a CPU hybrid.
    Resumable as ddtree.train.data.generate_sequences (a partial file keeps finished records)."""
    from ddtree.engine.loop import Engine
    from ddtree.pipeline.prompts import encode, read_jsonl
    from ddtree.train.data import PARTIAL, SEQUENCES, read_sequences, stop_ids

    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / PARTIAL
    done = {r["id"] for r in read_sequences(partial)} if partial.exists() else set()
    stops, t0, n = stop_ids(tokenizer, target), time.perf_counter(), 0
    engine = Engine(target, drafter, method="dflash")
    with open(partial, "a") as f:
        for p in read_jsonl(prompts_path)[: max_samples or None]:
            if p.id in done:
                continue
            ids = encode(tokenizer, [{"role": "user", "content": p.turns[0]}], chat_template=True)
            ans = engine.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, stop_token_ids=stops).output_ids
            f.write(json.dumps({"id": p.id, "input_ids": ids + ans, "spans": [[len(ids), len(ids) + len(ans)]]}) + "\n")
            f.flush()  # whole lines only: a restart reads this file back
            n += 1
            if n % 200 == 0:
                log(f"data: {n} answers ({time.perf_counter() - t0:.0f} s)")
    partial.replace(out_dir / SEQUENCES)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ddtree.train.mtp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's checkpoint folder")
    ap.add_argument("--prompts", required=True, help="training prompts (JSONL, the run pipeline's format)")
    ap.add_argument("--eval-prompts", default=None)
    ap.add_argument("--drafter", default=None, help="a DFlash drafter for the target: the answers are decoded by "
                    "the engine (lossless, faster on a CPU hybrid) instead of transformers' generate")
    ap.add_argument("--work", default="runs/train/mtp", help="where the generated answers are kept (resumable)")
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep-hidden", action=argparse.BooleanOptionalAction, default=True,
                    help="keep each batch's target hidden states in memory after the first epoch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--install", action="store_true", help="write the head into the target's folder")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddtree.train.data import SEQUENCES, generate_sequences, read_sequences

    t0 = time.perf_counter()
    # use_kernels=False: as load_checkpoint (transformers >= 5.25 kernelizes by default)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32, use_kernels=False).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    work = Path(a.work)
    if not (work / SEQUENCES).exists() and a.drafter:
        from ddtree.engine.drafter import DFlashDrafter

        drafter = DFlashDrafter.from_pretrained(a.drafter, dtype=torch.float32, device="cpu").eval()
        engine_sequences(target, drafter, tokenizer, a.prompts, work, max_samples=a.max_samples,
                         max_new_tokens=a.max_new_tokens)
    if not (work / SEQUENCES).exists():
        generate_sequences(target, tokenizer, a.prompts, work, max_samples=a.max_samples,
                           max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, seed=a.seed)
    records = read_sequences(work / SEQUENCES)[: a.max_samples or None]
    t_data = time.perf_counter() - t0
    head = MTPHead(target.config, attn_implementation="sdpa")
    head.bind(target)
    init_from_target(head, target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    curve = fit(head, target, records, epochs=a.epochs, lr=a.lr, batch_size=a.batch_size, unroll=a.unroll,
                pad=pad, seed=a.seed, keep_hidden=a.keep_hidden)
    report = {"records": len(records), "data_seconds": round(t_data, 1),
              "train_seconds": round(time.perf_counter() - t0 - t_data, 1), "final": curve[-1] if curve else None}
    if a.eval_prompts:
        report["eval"] = evaluate_tau(target, head, tokenizer, a.eval_prompts)
    if a.install:
        report["installed"] = str(install(head, Path(a.target)))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
