"""Helpers shared by the training tests (tests/test_train_*.py): tiny targets, records, short runs, pipeline configs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from ddtree.engine.drafter import DFlashDrafter
from ddtree.tiny import tiny_model
from ddtree.train.config import OptimConfig
from ddtree.train.features import FeatureShards, extract_features
from ddtree.train.trainer import FrozenTarget, train_drafter

VOCAB = 128
MASK = VOCAB - 1


def _target(model_type: str = "qwen3", seed: int = 0):
    model = tiny_model(model_type, seed=seed, vocab_size=VOCAB, num_hidden_layers=4, attn_implementation="sdpa")
    with torch.no_grad():  # confident logits, as a trained target has (a random lm_head gives near-uniform ones)
        model.get_output_embeddings().weight.mul_(20)
    return model


def _records(n: int, seed: int = 0, pattern: bool = False) -> list[dict]:
    """Sequences of a random prompt then an answer; `pattern`: the answer counts up by one (learnable)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(100) for _ in range(rng.randint(3, 8))]
        if pattern:
            start = rng.randrange(100)
            answer = [(start + k) % 100 for k in range(rng.randint(10, 20))]
        else:
            answer = [rng.randrange(100) for _ in range(rng.randint(4, 12))]
        out.append({"id": f"r{i}", "input_ids": prompt + answer, "spans": [[len(prompt), len(prompt) + len(answer)]]})
    return out


def _direct_features(model, ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[0]


def _train(tmp_path: Path, target, steps: int, drafter: DFlashDrafter | None = None,
           **optim) -> tuple[DFlashDrafter, dict, list[float]]:
    feats = tmp_path / "features"
    if not (feats / "manifest.json").exists():
        extract_features(target, _records(48, seed=5, pattern=True), [1, 3], feats, shard_size=16,
                         dtype=torch.float32, log=lambda _: None)
    drafter = drafter or DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=4,
                                                         target_layer_ids=[1, 3], mask_token_id=MASK, seed=0)
    losses: list[float] = []

    def log(msg: str) -> None:
        if " loss " in msg:
            losses.append(float(msg.split(" loss ")[1].split()[0]))

    cfg = OptimConfig(lr=3e-3, warmup_steps=5, batch_size=8, anchors_per_seq=6, max_steps=steps, log_every=5,
                      save_every=10, loss_decay=None, **optim)
    summary = train_drafter(drafter, FrozenTarget.of(target), FeatureShards(feats), cfg, tmp_path, log=log)
    return drafter, summary, losses


def _tiny_tokenizer():
    from ddtree.tiny import tiny_tokenizer

    return tiny_tokenizer(VOCAB)


REPO = Path(__file__).resolve().parent.parent


ASSETS = REPO / "assets" / "toy"


def _toy_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"toy_{name}", REPO / "toy" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _target_dir(tmp_path: Path) -> Path:
    """A tiny target (and the character tokenizer) saved as a checkpoint directory, as a user points at one."""
    path = tmp_path / "target"
    if not (path / "config.json").exists():
        _target(seed=2).save_pretrained(path)
        _tiny_tokenizer().save_pretrained(path)
    return path


def _pipeline_cfg(tmp_path: Path, out: str, **over) -> dict:
    texts = tmp_path / "texts.jsonl"
    if not texts.exists():
        rng = random.Random(0)
        rows = [{"messages": [{"role": "user", "content": f"count from {i}"},
                              {"role": "assistant", "content": "".join(chr(97 + (i + k) % 26)
                                                                       for k in range(rng.randint(8, 16)))}]}
                for i in range(20)]
        texts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        prompts = [{"id": f"h{i}", "turns": [f"count from {i}"]} for i in range(30, 32)]
        (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    cfg = {"out_dir": str(tmp_path / out), "stages": ["data", "extract", "train"], "device": "cpu",
           "target": {"name_or_path": str(_target_dir(tmp_path))},
           "data": {"source": "texts", "texts": str(texts)},
           "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [1, 3]},
           "extract": {"shard_size": 8, "batch_size": 4, "dtype": "float32"},
           "optim": {"lr": 3e-3, "warmup_steps": 2, "batch_size": 4, "anchors_per_seq": 4, "max_steps": 6,
                     "log_every": 1, "save_every": 3, "loss_decay": None},
           "eval": {"prompts": str(tmp_path / "held_out.jsonl"), "every": 3, "curve_budget": 4,
                    "curve_samples": 2, "max_new_tokens": 12},
           "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "run_name": out}}
    for key, value in over.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def _history(tmp_path: Path, run_name: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ddtree-train")
    run = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'")[0]
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def _losses(text: str) -> list[tuple[int, float]]:
    return [(int(ln.split("step ")[1].split("/")[0]), float(ln.split(" loss ")[1].split()[0]))
            for ln in text.splitlines() if ln.startswith("train: step") and " loss " in ln]


def _same_weights(a: Path, b: Path) -> None:
    x, y = DFlashDrafter.from_pretrained(a).state_dict(), DFlashDrafter.from_pretrained(b).state_dict()
    for k in x:
        torch.testing.assert_close(x[k], y[k], atol=1e-5, rtol=1e-4, msg=k)


class _Payload:
    """A pickle that would run code when loaded (what a tampered trainer_state.pt can hold)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))
