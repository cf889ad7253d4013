"""The config groups compose, every option fits the schema, and bad settings fail before model work."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from ddtree.errors import ConfigError
from ddtree.pipeline import config_checks as V
from ddtree.pipeline import schema as C
from ddtree.pipeline.prompts import TINY_PROMPTS, encode, load_prompts, read_jsonl
from ddtree.tiny import MIN_VOCAB, tiny_tokenizer

GROUPS = ("model", "drafter", "method", "attention", "dataset", "tracking")
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((C.CONF_DIR / g).glob("*.yaml"))]
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": i, "turns": [f"prompt {i}"]}) + "\n" for i in range(5)))
    return p


def _context(group: str, option: str, tmp_path: Path, prompt_file: Path) -> tuple[list[str], str | None]:
    """Overrides that make `group=option` a complete job, and the setting it must refuse (if any)."""
    models = {p.stem for p in (C.CONF_DIR / "model").glob("*.yaml")}
    if (group, option) == ("model", "hf"):  # any checkpoint: it needs one named
        return [], "model.name_or_path"
    if (group, option) == ("drafter", "hf"):  # model=hf brings no drafter: AR as is
        return ["model=hf", "model.name_or_path=Qwen/Qwen3-8B", "method=ar"], None
    if group == "drafter":
        if option in models:
            return [f"model={option}"], None
        if option == "toy_dflash2":  # the toy target's second drafter
            return ["model=toy"], None
        if option == "none":
            return ["method=ar"], None
        if option in ("pretrained", "dflash2"):  # needs a checkpoint: refused without one, accepted with a fitting one
            return [], "drafter.name_or_path"
        return ["model=tiny_qwen3"], None  # drafter=tiny: a random drafter, for the tiny random models
    if (group, option) == ("attention", "flex_attention"):
        return [], None  # ddtree verifies on flex through a BlockMask (ddtree.engine.attention)
    if (group, option) == ("attention", "flash_attention_2"):
        return ["method=dflash"], None if HAS_FLASH else "attention.target"
    if (group, option) == ("dataset", "jsonl"):
        return [f"dataset.path={prompt_file}"], None
    return [], None


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(group, option, tmp_path, prompt_file, compose):
    extra, refused = _context(group, option, tmp_path, prompt_file)
    cfg = compose("device=cpu", f"{group}={option}", *extra)
    assert cfg.hydra.runtime.choices[group] == option
    if refused is None:
        rc = V.validate(cfg)  # schema (typed dataclasses) + every pre-load check
        assert isinstance(rc, C.RunConfig)
    else:
        with pytest.raises(ConfigError) as e:
            V.validate(cfg)
        assert e.value.setting == refused and e.value.fix


def test_option_tables_are_complete(compose):
    options = {g: {o for gg, o in OPTIONS if gg == g} for g in GROUPS}
    assert options["method"] == {"ar", "dflash", "ddtree", "mtp", "eagle3"}
    assert {"eager", "sdpa", "flex_attention", "flash_attention_2"} <= options["attention"]
    assert {"tiny", "jsonl"} <= options["dataset"] and options["tracking"] == {"mlflow", "none"}
    assert {"tiny_qwen3", "tiny_llama", "tiny_qwen3_5", "qwen3_4b", "qwen3_8b", "qwen3_coder_30b_a3b",
            "llama3_1_8b_instruct", "qwen3_5_27b", "qwen3_6_27b", "qwen3_6_35b_a3b"} <= options["model"]
    # `drafter: ${model}` in the defaults list: every model names its default drafter by having one
    assert options["model"] <= options["drafter"] and {"none", "tiny", "pretrained"} <= options["drafter"]
    hub = {o: V.validate(compose("device=cpu", f"model={o}")) for o in options["model"] if not o.startswith("tiny") and o != "hf"}
    assert hub["qwen3_8b"].model.name_or_path == "Qwen/Qwen3-8B"
    assert hub["qwen3_8b"].drafter.name_or_path == "z-lab/Qwen3-8B-DFlash-b16"
    assert hub["llama3_1_8b_instruct"].drafter.name_or_path == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    assert all(rc.drafter.kind == "pretrained" and rc.drafter.target == rc.model.name_or_path for rc in hub.values())


def test_model_hf_names_itself_after_its_checkpoint(tmp_path, compose):
    rc = V.validate(compose("device=cpu", "model=hf", "model.name_or_path=Qwen/Qwen3-8B", "method=ar"))
    assert (rc.model.name, rc.drafter.kind) == ("Qwen/Qwen3-8B", "none")
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert V.validate(compose("device=cpu", "model=hf", f"model.name_or_path={folder}", "method=ar")).model.name == "my-model"
    with pytest.raises(ConfigError, match="drafter=pretrained drafter.name_or_path="):
        V.validate(compose("device=cpu", "model=hf", "model.name_or_path=Qwen/Qwen3-8B"))


def test_defaults_are_the_shipped_toy_pair_offline(compose):
    cfg = compose("device=cpu")
    rc = V.validate(cfg)
    toy = C.REPO_ROOT / "assets" / "toy"
    assert (rc.model.name, rc.model.name_or_path, rc.drafter.kind, rc.drafter.name_or_path) == (
        "toy", str(toy / "target"), "pretrained", str(toy / "drafter"))
    assert (rc.method, rc.dataset.name, rc.dataset.path) == ("ddtree", "toy", str(toy / "prompts.jsonl"))
    assert rc.baseline and not rc.force and rc.temperature == 0.0 and rc.budget == 64
    smoke = V.validate(compose("device=cpu", "model=tiny_qwen3", "dataset=tiny"))  # the random tiny models, by name
    assert (smoke.model.tiny.model_type, smoke.drafter.kind, smoke.dataset.name) == ("qwen3", "random", "tiny")
    runs = str(C.REPO_ROOT / "runs")
    assert C.tracking_uri(rc) == f"sqlite:///{runs}/mlflow.db"
    assert cfg.hydra.run.dir.startswith(runs) and cfg.hydra.sweep.dir.startswith(runs)
    tiny_hybrid = V.validate(compose("device=cpu", "model=tiny_qwen3_5"))
    assert tiny_hybrid.model.tiny.model_type == "qwen3_5_text" and tiny_hybrid.drafter.kind == "random"


def test_overrides_reach_the_schema(compose):
    rc = V.validate(compose("device=cpu", "model=tiny_llama", "drafter.block_size=8", "attention.target=eager",
                             "attention.drafter=sdpa", "tracking.uri=sqlite:////tmp/x.db", "budget=7",
                             "compat.skip=[cache-kwarg]", "dataset.enable_thinking=true"))
    assert (rc.drafter.block_size, rc.attention.target, rc.attention.drafter, rc.budget) == (8, "eager", "sdpa", 7)
    assert C.tracking_uri(rc) == "sqlite:////tmp/x.db" and rc.compat.skip == ["cache-kwarg"]
    assert rc.engine == "native" and rc.upstream.path is None


@pytest.mark.parametrize(("overrides", "setting"), [
    (["budget=0"], "budget"),
    (["budget=-4"], "budget"),
    (["temperature=-0.5"], "temperature"),
    (["max_new_tokens=0"], "max_new_tokens"),
    (["device=tpu"], "device"),
    (["model.dtype=int8"], "model.dtype"),
    (["drafter.block_size=1"], "drafter.block_size"),
    (["dataset.max_samples=0"], "dataset.max_samples"),
    (["tracking.uri=file:///tmp/mlruns"], "tracking.uri"),
    (["engine=nonsense"], "engine"),
    (["engine=upstream"], "upstream.path"),  # the authors' checkout is not set
    (["model=tiny_qwen3", "model.name_or_path=Qwen/Qwen3-8B"], "model.name_or_path"),
    (["drafter=none"], "drafter"),  # ddtree without a drafter
    (["model=qwen3_8b", "drafter=tiny"], "drafter"),  # a random drafter on a real model
    (["model=tiny_qwen3", "drafter=qwen3_8b"], "drafter"),  # a hub drafter recorded for another target
    (["model=qwen3_4b", "drafter=qwen3_8b"], "drafter"),
    (["attention.target=no_such_backend"], "attention.target"),
    (["+surprise=1"], "surprise"),
    (["dataset=jsonl"], "dataset.path"),
    (["dataset=jsonl", "dataset.path=/nonexistent/prompts.jsonl"], "dataset.path"),
    (["drafter=pretrained"], "drafter.name_or_path"),
])
def test_bad_settings_raise_config_error(overrides, setting, compose):
    with pytest.raises(ConfigError) as e:
        V.validate(compose("device=cpu", *overrides))
    assert e.value.setting == setting
    assert "\n" not in str(e.value)


def test_attention_refusals_name_the_fix(monkeypatch, compose):
    with pytest.raises(ConfigError, match="use attention=sdpa") as e:
        V.validate(compose("device=cpu", "attention=flash_attention_2"))  # a tree method needs a tree mask
    assert e.value.setting == "attention.target"
    V.validate(compose("device=cpu", "attention=flex_attention"))  # ddtree: a BlockMask tree (ddtree.engine.attention)
    V.validate(compose("device=cpu", "attention=flex_attention", "method=ar"))  # AR: no tree, no drafter
    V.validate(compose("device=cpu", "attention.target=ddtree_split_eager"))  # a tree implementation by name
    with pytest.raises(ConfigError, match="pip install flash-attn"):  # a wrapper needs its backend's package
        V.validate(compose("device=cpu", "attention.target=ddtree_split_fa2"))
    with pytest.raises(ConfigError, match="drafter does not implement"):
        V.validate(compose("device=cpu", "method=dflash", "attention.drafter=flex_attention"))
    real = importlib.util.find_spec
    monkeypatch.setattr(V.importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install flash-attn"):
        V.validate(compose("device=cpu", "attention=flash_attention_2", "method=dflash"))
    monkeypatch.setattr(V.importlib.util, "find_spec", lambda n, *a: object() if n == "flash_attn" else real(n, *a))
    with pytest.raises(ConfigError, match="installed but cannot be imported"):  # e.g. built for another CUDA
        V.validate(compose("device=cpu", "attention=flash_attention_2", "method=dflash"))
    real_import = importlib.import_module
    monkeypatch.setattr(V.importlib, "import_module", lambda n, *a: object() if n == "flash_attn" else real_import(n, *a))
    with pytest.raises(ConfigError, match="CUDA only"):
        V.validate(compose("device=cpu", "attention=flash_attention_2", "method=dflash"))


def test_tracking_without_mlflow_names_tracking_none(monkeypatch, compose):
    """Where mlflow is not installed (the GPU machine's image: bench/device_kit.sh carries no mlflow), the default
    tracking=mlflow stops before model work with one line naming tracking=none; tracking=none runs."""
    real = importlib.util.find_spec
    monkeypatch.setattr(V.importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    with pytest.raises(ConfigError, match="use tracking=none") as e:
        V.validate(compose("device=cpu"))
    assert e.value.setting == "tracking.backend" and "\n" not in str(e.value)
    V.validate(compose("device=cpu", "tracking=none"))


def _drafter_dir(tmp_path: Path, **fields) -> Path:
    d = tmp_path / "drafter"
    d.mkdir()
    cfg = {"hidden_size": 64, "vocab_size": 128, "num_target_layers": 4, "block_size": 16,
           "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 127}, **fields}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_local_drafter_checked_against_target_before_loading(tmp_path, compose):
    fits = _drafter_dir(tmp_path)
    V.validate(compose("device=cpu", "model=tiny_qwen3", "drafter=pretrained", f"drafter.name_or_path={fits}"))
    (fits / "config.json").write_text(json.dumps({"hidden_size": 4096, "vocab_size": 151936, "num_target_layers": 36,
                                                  "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}))
    with pytest.raises(ConfigError, match="does not fit model=tiny_qwen3") as e:
        V.validate(compose("device=cpu", "model=tiny_qwen3", "drafter=pretrained", f"drafter.name_or_path={fits}"))
    assert "36 target layers" in str(e.value) and "hidden_size 4096" in str(e.value)


def test_identity_ignores_outputs_force_and_tracking(compose):
    a = C.identity_dict(V.validate(compose("device=cpu", "budget=8")))
    b = C.identity_dict(V.validate(compose("device=cpu", "budget=8", "force=true", "runs_dir=/tmp/elsewhere",
                                            "tracking.uri=sqlite:////tmp/other.db", "tracking=none")))
    c = C.identity_dict(V.validate(compose("device=cpu", "budget=16")))
    assert a == b and a != c and "hydra" not in a
    # the scoring is DDTree's alone: a DFlash job's identity ignores it (a scoring sweep runs DFlash once)
    ident = lambda *o: C.identity_dict(V.validate(compose("device=cpu", "experiment=toy_dflash2", *o)))  # noqa: E731
    assert ident("method=dflash", "scoring=pair") == ident("method=dflash")
    assert ident("method=ddtree", "scoring=pair") != ident("method=ddtree", "scoring=marginal")


def test_jsonl_prompts(tmp_path, prompt_file):
    assert [p.id for p in read_jsonl(prompt_file)] == ["0", "1", "2", "3", "4"]
    shuffled = load_prompts("jsonl", str(prompt_file), max_samples=3, shuffle_seed=1)
    assert len(shuffled) == 3 and shuffled == load_prompts("jsonl", str(prompt_file), max_samples=3, shuffle_seed=1)
    assert load_prompts("tiny", max_samples=2) == list(TINY_PROMPTS[:2])
    bad = {"malformed.jsonl": '{"id": 1, "turns": ["a"]}\n{"id": 2, "turns": \n',
           "keys.jsonl": '{"id": 1, "prompt": "a"}\n', "turns.jsonl": '{"id": 1, "turns": []}\n',
           "dup.jsonl": '{"id": 1, "turns": ["a"]}\n{"id": 1, "turns": ["b"]}\n', "empty.jsonl": "\n"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            read_jsonl(tmp_path / name)
        assert e.value.setting == "dataset.path"
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        read_jsonl(tmp_path / "malformed.jsonl")


def test_tiny_tokenizer_fits_the_tiny_vocab():
    tok = tiny_tokenizer(128)
    ids = tok("Hello, world!\n\tx = 1")["input_ids"]
    assert max(ids) < 128 and tok.decode(ids) == "Hello, world!\n\tx = 1"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id < 128
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.decode(encode(tok, msgs, chat_template=True, enable_thinking=False))
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(encode(tok, msgs, chat_template=False)) == "Hi"
    assert len(tiny_tokenizer(MIN_VOCAB)) == MIN_VOCAB
    with pytest.raises(ConfigError):
        tiny_tokenizer(MIN_VOCAB - 1)


def test_one_experiment_spelling_for_runs_and_training(compose):
    """experiment=NAME selects an experiment in both CLIs; the older spellings still reach the same config."""
    from ddtree.pipeline.console import RUN_ALIASES, TRAIN_ALIASES, spell_overrides

    new = compose("device=cpu", *spell_overrides(["experiment=toy"], RUN_ALIASES))
    old = compose("device=cpu", *spell_overrides(["+experiment=toy"], RUN_ALIASES))
    assert new.tags.experiment == old.tags.experiment == "toy" and new.max_new_tokens == old.max_new_tokens == 128
    assert spell_overrides(["experiment=toy", "budget=8"], TRAIN_ALIASES) == ["train/experiment=toy", "budget=8"]
    assert spell_overrides(["train/experiment=toy"], TRAIN_ALIASES) == ["train/experiment=toy"]
    trained = compose(*spell_overrides(["experiment=toy"], TRAIN_ALIASES), config_name="train", hydra_node=False)
    assert trained.target.name_or_path == compose("train/experiment=toy", config_name="train",
                                                  hydra_node=False).target.name_or_path
