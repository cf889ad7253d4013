"""Drafter training (ddtree.train): extraction, the objective, a short training run, the trained checkpoint."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from ddtree.engine.drafter import DFlashDrafter
from ddtree.errors import ConfigError
from ddtree.testing.tiny import tiny_model
from ddtree.train.config import OptimConfig, to_train_config
from ddtree.train.features import FeatureShards, Sample, extract_features, shard_name
from ddtree.train.objective import IGNORE, block_loss, drafter_hidden, make_batch, valid_anchors
from ddtree.train.trainer import FrozenTarget, latest_checkpoint, train_drafter

VOCAB = 128
MASK = VOCAB - 1


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and a busy 2-core machine oversubscribed by OpenMP crawls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_extraction_round_trip(tmp_path: Path, model_type: str):
    target = _target(model_type)
    records = _records(7, seed=1)
    layer_ids = [0, 2, 3]
    manifest = extract_features(target, records, layer_ids, tmp_path, shard_size=3, batch_size=2,
                                dtype=torch.float32, log=lambda _: None)
    assert manifest["num_shards"] == 3 and manifest["num_sequences"] == 7
    shards = FeatureShards(tmp_path)
    samples = list(shards)
    assert len(samples) == 7 and shards.target_layer_ids == layer_ids
    assert [s.id for s in samples] != [r["id"] for r in records]  # dealt into shards in a seeded order
    by_id = {s.id: s for s in samples}
    for rec in records:
        s = by_id[rec["id"]]
        assert s.input_ids.tolist() == rec["input_ids"]
        assert [list(x) for x in s.spans] == rec["spans"]
        torch.testing.assert_close(s.features, _direct_features(target, rec["input_ids"], layer_ids),
                                   atol=1e-5, rtol=1e-5)

    # restartable: a missing shard is redone, finished shards are left alone
    kept = (tmp_path / shard_name(0)).stat().st_mtime_ns
    (tmp_path / shard_name(1)).unlink()
    extract_features(target, records, layer_ids, tmp_path, shard_size=3, batch_size=2, dtype=torch.float32,
                     log=lambda _: None)
    assert (tmp_path / shard_name(0)).stat().st_mtime_ns == kept
    torch.testing.assert_close(FeatureShards(tmp_path).load(1)[0].features, samples[3].features)


def test_blocks_mirror_the_engine_call():
    """All anchors in one masked forward == one drafter call per anchor, fed as the engine feeds it."""
    target = _target()
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=2, block_size=4, target_layer_ids=[1, 3],
                                              mask_token_id=MASK, seed=3)
    records = _records(3, seed=2)
    with torch.no_grad():
        samples = [Sample(torch.tensor(r["input_ids"]), _direct_features(target, r["input_ids"], [1, 3]),
                          [tuple(r["spans"][0])]) for r in records]
        batch = make_batch(samples, 4, 6, MASK, random.Random(0))
        embed = target.get_input_embeddings().weight
        hidden = drafter_hidden(drafter, embed, batch)
        checked = 0
        for b, s in enumerate(samples):
            start, end = s.spans[0]
            for j, a in enumerate(batch.anchors[b].tolist()):
                if a < 0:
                    continue
                assert start <= a < end - 1
                block = torch.full((1, 4), MASK)
                block[0, 0] = s.input_ids[a]
                ref = drafter(embed[block], s.features[:a][None], torch.arange(a)[None],
                              torch.arange(a, a + 4)[None])
                torch.testing.assert_close(hidden[b, j * 4:(j + 1) * 4], ref[0], atol=1e-5, rtol=1e-5)
                want = [t if a + k < end else IGNORE for k, t in
                        enumerate(s.input_ids[a + 1:a + 4].tolist() + [IGNORE] * 3, start=1)][:3]
                assert batch.labels[b, j].tolist() == want
                checked += 1
    assert checked >= 10


def test_block_loss_counts_leading_hits():
    """tau_proxy = 1 + the hits before the first miss; labels past the span end are ignored."""
    vocab, h = 8, 8
    lm_head = torch.eye(vocab, h) * 20
    labels = torch.tensor([[[1, 2, 3], [4, 5, IGNORE]]])
    predicted = torch.tensor([[0, 1, 7, 3, 0, 4, 5, 6]])  # block 0: hit, miss, hit; block 1: hit, hit
    hidden = lm_head[predicted.view(-1)].view(1, 8, h)
    _, stats = block_loss(hidden, lm_head, labels, 4)
    # block 0: hit, miss, hit -> 1 accepted; block 1: hit, hit, (end) -> 2 accepted
    assert stats["tau_proxy"] == pytest.approx(1 + 1.5)
    assert stats["acc"] == pytest.approx(4 / 5)
    assert valid_anchors([(3, 6)]) == [3, 4]


def _train(tmp_path: Path, target, steps: int, **optim) -> tuple[DFlashDrafter, dict, list[float]]:
    feats = tmp_path / "features"
    if not (feats / "manifest.json").exists():
        extract_features(target, _records(48, seed=5, pattern=True), [1, 3], feats, shard_size=16,
                         dtype=torch.float32, log=lambda _: None)
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                              mask_token_id=MASK, seed=0)
    losses: list[float] = []

    def log(msg: str) -> None:
        if " loss " in msg:
            losses.append(float(msg.split(" loss ")[1].split()[0]))

    cfg = OptimConfig(lr=3e-3, warmup_steps=5, batch_size=8, anchors_per_seq=6, max_steps=steps, log_every=5,
                      save_every=10, loss_decay=None, **optim)
    summary = train_drafter(drafter, FrozenTarget.of(target), FeatureShards(feats), cfg, tmp_path, log=log)
    return drafter, summary, losses


def test_short_training_run_loss_falls_and_resumes(tmp_path: Path):
    torch.manual_seed(0)
    target = _target()
    drafter, summary, losses = _train(tmp_path, target, 100)
    assert len(losses) == 20
    assert losses[-1] < 0.6 * losses[0], losses
    assert summary["final_tau_proxy"] > 1.5
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000100"
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 2  # keep_checkpoints

    # resume: a run that stopped at step 90 and is restarted ends where an uninterrupted run ends
    shutil.rmtree(tmp_path / "checkpoints" / "step_000100")
    resumed, _, more = _train(tmp_path, target, 100)
    assert len(more) == 2  # steps 95 and 100 only
    for (k, a), b in zip(drafter.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_trained_checkpoint_loads_back_and_generates_losslessly(tmp_path: Path, model_type: str):
    import ddtree

    torch.manual_seed(0)
    target = _target(model_type, seed=1)
    drafter, _, _ = _train(tmp_path, target, 20)
    drafter.save_pretrained(tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": MASK}
    loaded = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    for (k, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k

    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    for method, budget in (("dflash", None), ("ddtree", 8)):
        out = ddtree.generate(target, loaded, prompt, method=method, budget=budget, max_new_tokens=24)
        assert out.output_ids == ref, (method, out.output_ids, ref)


def test_config_errors_name_the_setting(tmp_path: Path):
    with pytest.raises(ConfigError, match="target.name_or_path"):
        to_train_config({"out_dir": str(tmp_path)})
    base = {"out_dir": str(tmp_path), "target": {"name_or_path": "x"}, "data": {"source": "texts"}}
    with pytest.raises(ConfigError, match="data.texts"):
        to_train_config(base)
    with pytest.raises(ConfigError, match="stages"):
        to_train_config({**base, "stages": ["extract", "fly"]})
    with pytest.raises(ConfigError, match="optim.nope"):
        to_train_config({**base, "stages": ["train"], "optim": {"nope": 1}})
    cfg = to_train_config({**base, "stages": ["train"], "drafter": {"block_size": 8}})
    assert cfg.drafter.block_size == 8


def test_hydra_config_composes():
    from hydra import compose, initialize_config_dir

    from ddtree.train.config import REPO_ROOT, register

    register()
    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3"):
        for overrides in (["target.name_or_path=x", "tracking=none"], ["train/experiment=toy"]):
            cfg = compose("train", overrides=overrides)
            tc = to_train_config({k: v for k, v in cfg.items() if k != "hydra"} | {"stages": ["train"]})
            assert tc.out_dir and tc.tracking.experiment == "ddtree-train"  # the shared group, train's experiment


def _tiny_tokenizer():
    from ddtree.testing.tokenizer import tiny_tokenizer

    return tiny_tokenizer(VOCAB)


def test_text_sequences_span_the_assistant_turns(tmp_path: Path):
    from ddtree.train.data import read_sequences, text_sequences

    tok = _tiny_tokenizer()
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello you"},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]},
            {"text": "plain text row"}]
    src = tmp_path / "texts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text_sequences(tok, str(src), tmp_path, log=lambda _: None)
    chat, plain = read_sequences(tmp_path / "sequences.jsonl")
    answers = [tok.decode(chat["input_ids"][s:e]) for s, e in chat["spans"]]
    assert answers == ["hello you<|im_end|>", "ok<|im_end|>"]
    assert plain["spans"] == [[1, len(plain["input_ids"])]]


def test_generated_answers_are_the_targets_greedy_output(tmp_path: Path):
    from ddtree.pipeline.prompts import encode
    from ddtree.train.data import generate_sequences, read_sequences

    tok = _tiny_tokenizer()
    target = _target()
    prompts = [{"id": i, "turns": [t]} for i, t in enumerate(["abc", "xyz", "hello there", "q"])]
    prompts.append({"id": "multi", "turns": ["one", "two"]})
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    stats = generate_sequences(target, tok, str(src), tmp_path, max_new_tokens=12, batch_size=2,
                               log=lambda _: None)
    recs = {r["id"]: r for r in read_sequences(tmp_path / "sequences.jsonl")}
    assert stats["sequences"] == 6 and set(recs) == {"0", "1", "2", "3", "multi#0", "multi#1"}
    for p in prompts[:4]:
        ids = encode(tok, [{"role": "user", "content": p["turns"][0]}], chat_template=True)
        with torch.no_grad():
            ref = target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=tok.eos_token_id, pad_token_id=0)[0].tolist()
        ref = ref[:ref.index(tok.eos_token_id, len(ids)) + 1] if tok.eos_token_id in ref[len(ids):] else ref
        rec = recs[str(p["id"])]
        assert rec["input_ids"] == ref and rec["spans"] == [[len(ids), len(ref)]]


# ---------------------------------------------------------------- the toy pair

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "assets" / "toy"


def _toy_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"toy_{name}", REPO / "toy" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_toy_corpus_is_deterministic_and_holds_prompts_out():
    corpus = _toy_module("corpus")
    a = corpus.build(num_train=600, num_valid=20, num_prompts=18, num_train_prompts=50, seed=3)
    b = corpus.build(num_train=600, num_valid=20, num_prompts=18, num_train_prompts=50, seed=3)
    assert a == b
    held = {p["turns"][0] for p in a["prompts"]}
    assert len(held) == 18 and len({p["category"] for p in a["prompts"]}) == 9
    assert not held & {r["messages"][0]["content"] for r in a["train"] + a["valid"]}
    assert len(a["train_prompts"]) == 50 and not held & {p["turns"][0] for p in a["train_prompts"]}


def test_toy_tokenizer_chat_template(tmp_path: Path):
    corpus, tokenizer = _toy_module("corpus"), _toy_module("tokenizer")
    data = corpus.build(num_train=300, num_valid=10, num_prompts=9, num_train_prompts=10)
    tok = tokenizer.train_tokenizer([tokenizer.render(r["messages"]) for r in data["train"]], vocab_size=400)
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    msgs = data["train"][0]["messages"]
    text = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.render(msgs[:1]) + "<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|mask|>") == 3
    ids = tok(tokenizer.render(msgs), add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == tokenizer.render(msgs)


@pytest.mark.skipif(not (ASSETS / "drafter" / "config.json").exists(), reason="assets/toy not built (make toy)")
def test_shipped_toy_pair_is_lossless():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ddtree
    from ddtree.pipeline.prompts import encode, read_jsonl

    target = AutoModelForCausalLM.from_pretrained(ASSETS / "target").eval()
    tok = AutoTokenizer.from_pretrained(ASSETS / "target")
    drafter = DFlashDrafter.from_pretrained(ASSETS / "drafter")
    drafter.check_compatible(target)
    assert sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file()) <= 20 * 2**20
    prompt = read_jsonl(ASSETS / "prompts.jsonl")[0]
    ids = torch.tensor([encode(tok, [{"role": "user", "content": prompt.turns[0]}], chat_template=True)])
    ar = ddtree.generate(target, None, ids, method="ar", max_new_tokens=40, stop_token_ids=[tok.eos_token_id])
    assert ar.output_ids[-1] == tok.eos_token_id  # the toy target ends its answers
    tree = ddtree.generate(target, drafter, ids, method="ddtree", budget=16, max_new_tokens=40,
                           stop_token_ids=[tok.eos_token_id])
    assert tree.output_ids == ar.output_ids and tree.tau > 2


# ---------------------------------------------------------------- the pipeline: online features, curve, resume

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


def test_online_features_train_the_offline_drafter_step_by_step(tmp_path: Path, capsys):
    """features=online (target in the loop, nothing on disk) == offline shards: losses per step and the drafter."""
    from ddtree.train.pipeline import run

    quiet = {"tracking.backend": "none", "eval.every": None}
    run(to_train_config(_pipeline_cfg(tmp_path, "offline", **quiet)))
    off = _losses(capsys.readouterr().out)
    run(to_train_config(_pipeline_cfg(tmp_path, "online", features="online", **quiet)))
    on = _losses(capsys.readouterr().out)
    assert (tmp_path / "offline" / "features" / "manifest.json").exists()
    assert not (tmp_path / "online" / "features").exists()
    assert [s for s, _ in off] == list(range(1, 7)) and [s for s, _ in on] == list(range(1, 7))
    assert [v for _, v in on] == pytest.approx([v for _, v in off], abs=2e-4)  # logged with 4 decimals
    assert off[-1][1] < off[0][1]
    _same_weights(tmp_path / "offline" / "drafter", tmp_path / "online" / "drafter")

    # online resume: a run stopped after step 3 and restarted ends with the same drafter
    shutil.copytree(tmp_path / "online" / "drafter", tmp_path / "uninterrupted")
    shutil.rmtree(tmp_path / "online" / "checkpoints" / "step_000006")
    shutil.rmtree(tmp_path / "online" / "drafter")
    run(to_train_config(_pipeline_cfg(tmp_path, "online", features="online", **quiet)))
    assert [s for s, _ in _losses(capsys.readouterr().out)] == [4, 5, 6]
    _same_weights(tmp_path / "uninterrupted", tmp_path / "online" / "drafter")


def test_acceptance_curve_in_mlflow_and_the_drafter_loads_in_the_run_pipeline(tmp_path: Path):
    """Every eval.every steps: DFlash and DDTree tau and tok/s in MLflow beside the loss; best checkpoint by tau."""
    from ddtree.train.pipeline import run

    run(to_train_config(_pipeline_cfg(tmp_path, "curve", features="online", **{"optim.log_every": 3})))
    assert [s for s, _ in _history(tmp_path, "curve", "train/loss")] == [3, 6]
    tau = _history(tmp_path, "curve", "curve/ddtree_4.tau")
    assert [s for s, _ in tau] == [3, 6] and [s for s, _ in _history(tmp_path, "curve", "curve/dflash.tau")] == [3, 6]
    assert len(_history(tmp_path, "curve", "curve/ddtree_4.tokens_per_s")) == 2
    best = json.loads((tmp_path / "curve" / "checkpoints" / "best.json").read_text())
    assert best["step"] == max(tau, key=lambda t: (t[1], -t[0]))[0]
    assert (tmp_path / "curve" / "checkpoints" / best["path"] / "model.safetensors").exists()

    # the drafter's config carries what the run pipeline needs: it loads with no drafter override
    from ddtree.pipeline.models import load_drafter, load_target
    from ddtree.pipeline.schema import to_run_config

    rc = to_run_config(OmegaConf.create({"model": {"name": "mine", "name_or_path": str(_target_dir(tmp_path))},
                                         "drafter": {"kind": "pretrained",
                                                     "name_or_path": str(tmp_path / "curve" / "drafter")}}))
    target, _ = load_target(rc, "cpu")
    drafter = load_drafter(rc, target, "cpu")
    assert (drafter.block_size, drafter.target_layer_ids, drafter.mask_token_id) == (4, [1, 3], 7)


class _Payload:
    """A pickle that would run code when loaded (what a tampered trainer_state.pt can hold)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_tampered_trainer_state_is_refused_in_one_line(tmp_path: Path):
    from ddtree.train.trainer import STATE, TrainState, make_optimizer, resume, save_checkpoint

    target = _target()
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                              mask_token_id=MASK)
    opt = make_optimizer(drafter, OptimConfig())
    ckpt = save_checkpoint(drafter, opt, TrainState(step=5, micro=5), tmp_path, keep=2)
    state, path = resume(tmp_path, drafter, opt, torch.device("cpu"))
    assert (state.step, path) == (5, ckpt)

    marker = tmp_path / "code_ran"
    torch.save({"optimizer": opt.state_dict(), "step": 5, "micro": 5, "x": _Payload(marker)}, ckpt / STATE)
    with pytest.raises(ConfigError) as e:
        resume(tmp_path, drafter, opt, torch.device("cpu"))
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and STATE in msg and "force=[train]" in msg


def test_disk_plan_refuses_an_extraction_that_does_not_fit(tmp_path: Path, capsys):
    """Offline extraction that would not fit is refused before writing, naming features=online."""
    from ddtree.train.pipeline import run

    cfg = _pipeline_cfg(tmp_path, "big", stages=["data", "extract"], **{"tracking.backend": "none",
                                                                         "extract.keep_free_gb": 1e9})
    with pytest.raises(ConfigError, match=r"^features: offline extraction needs .* use features=online"):
        run(to_train_config(cfg))
    assert "B/token" in capsys.readouterr().out  # the plan: bytes per token, total, free space
    assert not list((tmp_path / "big" / "features").glob("shard_*"))
    cfg["features"] = "online"
    run(to_train_config(cfg))  # the suggested fix works: nothing to extract


@pytest.mark.slow
def test_disk_plan_refusal_is_one_line_from_the_cli(tmp_path: Path):
    """python -m ddtree.train: the refusal is one line on stderr, exit 2, no traceback."""
    import subprocess
    import sys

    _pipeline_cfg(tmp_path, "x")  # writes the texts
    out = tmp_path / "big"
    args = [f"out_dir={out}", f"target.name_or_path={_target_dir(tmp_path)}", "data.source=texts",
            f"data.texts={tmp_path / 'texts.jsonl'}", "stages=[data,extract]", "tracking=none", "device=cpu",
            "drafter.target_layer_ids=[1,3]", "extract.keep_free_gb=1e9"]
    p = subprocess.run([sys.executable, "-m", "ddtree.train", *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert errors[0].startswith("error: features: offline extraction needs") and "features=online" in errors[0]
    assert "B/token" in p.stdout and "free" in p.stdout  # the plan, printed before the refusal
    assert not list((out / "features").glob("shard_*"))


def test_hub_chat_dataset_answers_regenerated_by_the_target(tmp_path: Path):
    """data.source=hub reads a chat dataset through `datasets` (a local json file here: nothing downloaded)."""
    from ddtree.pipeline.prompts import encode
    from ddtree.train.config import HubDataConfig
    from ddtree.train.data import hub_prompts, read_sequences, text_sequences
    from ddtree.train.pipeline import run

    rows = [{"id": "a", "conversations": [{"from": "human", "value": "abc"}, {"from": "gpt", "value": "their xyz"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"},
                                          {"from": "human", "value": "more"}, {"from": "gpt", "value": "ok"}]}]
    src = tmp_path / "chat.json"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hub = HubDataConfig(path="json", data_files=[str(src)], cache_dir=str(tmp_path / "cache"))
    assert [(p.id, p.turns) for p in hub_prompts(hub)] == [("a", ("abc",)), ("b", ("hello", "more"))]

    tok = _tiny_tokenizer()
    text_sequences(tok, None, tmp_path / "own", hub=hub, log=lambda _: None)  # regenerate=false: their answers
    own = read_sequences(tmp_path / "own" / "sequences.jsonl")
    assert [[tok.decode(r["input_ids"][s:e]) for s, e in r["spans"]] for r in own] == [
        ["their xyz<|im_end|>"], ["hi there<|im_end|>", "ok<|im_end|>"]]

    cfg = _pipeline_cfg(tmp_path, "hub", stages=["data"], **{
        "tracking.backend": "none", "data.source": "hub", "data.max_new_tokens": 6, "data.batch_size": 2,
        "data.hub": {"path": "json", "data_files": [str(src)], "cache_dir": str(tmp_path / "cache")}})
    run(to_train_config(cfg))
    recs = {r["id"]: r for r in read_sequences(tmp_path / "hub" / "data" / "sequences.jsonl")}
    assert set(recs) == {"a", "b#0", "b#1"}
    target = AutoModelForCausalLM.from_pretrained(_target_dir(tmp_path)).eval()
    ids = encode(tok, [{"role": "user", "content": "abc"}], chat_template=True)
    with torch.no_grad():
        ref = target.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=0)[0].tolist()
    ref = ref[:ref.index(tok.eos_token_id, len(ids)) + 1] if tok.eos_token_id in ref[len(ids):] else ref
    assert recs["a"]["input_ids"] == ref and recs["a"]["spans"] == [[len(ids), len(ref)]]


@pytest.mark.slow
@pytest.mark.parametrize("features,fsdp", [("offline", False), ("online", False), ("offline", True)])
def test_two_gloo_processes_train_the_one_process_drafter_with_grad_accum_2(tmp_path: Path, features: str,
                                                                            fsdp: bool):
    """torchrun --nproc_per_node=2 (CPU, gloo, each rank its own target; answers regenerated on both ranks)
    == 1 process with optim.grad_accum=2: the same sequences and the same drafter."""
    import subprocess
    import sys

    from ddtree.train.pipeline import run

    held_out = tmp_path / "prompts.jsonl"
    held_out.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"say {i}" * (1 + i % 3)]}) + "\n"
                                for i in range(12)))
    gen = {"data.source": "generate", "data.prompts": str(held_out), "data.max_new_tokens": 10, "data.batch_size": 3}
    run(to_train_config(_pipeline_cfg(tmp_path, "one", features=features, **{
        "tracking.backend": "none", "eval.every": None, "optim.grad_accum": 2, **gen})))
    cfg = _pipeline_cfg(tmp_path, "two")
    args = [f"out_dir={tmp_path / 'two'}", f"target.name_or_path={cfg['target']['name_or_path']}",
            f"features={features}", "data.source=generate", f"data.prompts={held_out}", "data.max_new_tokens=10",
            "data.batch_size=3", "stages=[data,extract,train]", "extract.dtype=float32", "extract.batch_size=4",
            "tracking=none", "device=cpu", "drafter.num_layers=1", "drafter.block_size=4",
            "drafter.target_layer_ids=[1,3]", "extract.shard_size=8", "optim.lr=3e-3", "optim.warmup_steps=2",
            "optim.batch_size=4", "optim.anchors_per_seq=4", "optim.max_steps=6", "optim.log_every=1",
            "optim.save_every=3", "optim.loss_decay=null", "optim.grad_accum=1", f"optim.fsdp={str(fsdp).lower()}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    p = subprocess.run([*torchrun, "-m", "ddtree.train", *args], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "x 2 proc" in p.stdout
    sequences = [(tmp_path / n / "data" / "sequences.jsonl").read_text() for n in ("one", "two")]
    assert sequences[0] == sequences[1] and (tmp_path / "two" / "data" / "rank1").is_dir()
    _same_weights(tmp_path / "one" / "drafter", tmp_path / "two" / "drafter")
