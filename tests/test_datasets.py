"""The ten benchmark configs compose and format records in the DFlash/DDTree authors' prompt formats, draw
the same rows as `datasets.Dataset.shuffle(seed).select(...)`, and load from a local copy or the `datasets`
cache; offline without either, the error says how to provide the data. The experiment configs set up the
paper's grid. Nothing here downloads: records are written in the tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.errors import ConfigError
from ddtree.pipeline import config_checks as V
from ddtree.pipeline import models as M
from ddtree.pipeline import schema as C
from ddtree.pipeline.datasets import load_dataset_prompts, load_hub, prompts_from_records, sample_indices

BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
LCB_HEAD = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
            "generate a correct Python program that matches the specification and passes all tests. You will NOT "
            "return anything except for the program\n\n### Question:\n")
LCB_TAIL = "\n\n### Answer: (use the provided format with backticks)"

# config -> (hub, subset, split, max_samples, [(record, expected id, expected user turns)])
BENCHMARKS = {
    "gsm8k": ("openai/gsm8k", "main", "test", 128, [
        ({"question": "Tom has 3 apples and eats one. How many are left?", "answer": "2"}, "0",
         ("Tom has 3 apples and eats one. How many are left?" + BOXED,))]),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", 128, [
        ({"problem": "Solve $x^2 = 4$ for $x > 0$.", "answer": "2", "unique_id": "test/algebra/7.json"},
         "test/algebra/7.json", ("Solve $x^2 = 4$ for $x > 0$." + BOXED,))]),
    "aime24": ("HuggingFaceH4/aime_2024", None, "train", 30, [
        ({"id": 60, "problem": "Find the remainder when 2^{10} is divided by 7.", "answer": "2"}, "60",
         ("Find the remainder when 2^{10} is divided by 7." + BOXED,))]),
    "aime25": ("MathArena/aime_2025", None, "train", 30, [
        ({"problem_idx": 1, "problem": "Find the sum of all bases b > 9.", "answer": 70}, "1",
         ("Find the sum of all bases b > 9." + BOXED,))]),
    "humaneval": ("openai/openai_humaneval", None, "test", 164, [
        ({"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Add two numbers."""\n', "entry_point": "add"},
         "HumanEval/0",
         ("Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
          'def add(a, b):\n    """Add two numbers."""\n\n```',))]),
    "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", 128, [
        ({"task_id": 2, "prompt": "Write a function to find the shared elements from the given two lists.",
          "code": "..."}, "2", ("Write a function to find the shared elements from the given two lists.",))]),
    "livecodebench": ("livecodebench/code_generation_lite", None, "train", 128, [
        ({"question_id": "abc301_a", "question_content": "Print the winner.", "starter_code": ""}, "abc301_a",
         (LCB_HEAD + "Print the winner.\n\n### Format: Write your code in the following format:\n```python\n"
          "# YOUR CODE HERE\n```" + LCB_TAIL,)),
        ({"question_id": "2847", "question_content": "Return the sum.",
          "starter_code": "class Solution:\n    def total(self, nums: List[int]) -> int:\n        "}, "2847",
         (LCB_HEAD + "Return the sum.\n\n### Format: Use the following code structure:\n```python\nclass Solution:\n"
          "    def total(self, nums: List[int]) -> int:\n        \n```" + LCB_TAIL,))]),
    "swe_bench_lite": ("princeton-nlp/SWE-bench_Lite", None, "test", 128, [
        ({"instance_id": "astropy__astropy-12907", "problem_statement": "separability_matrix is wrong for nested models",
          "repo": "astropy/astropy"}, "astropy__astropy-12907",
         ("Problem Statement:\nseparability_matrix is wrong for nested models\nPlease fix the issue described above.",))]),
    "mt_bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", 80, [
        ({"prompt_id": 81, "category": "writing",
          "prompt": ["Compose a travel blog post about Hawaii.", "Rewrite it starting every sentence with A."]}, "81",
         ("Compose a travel blog post about Hawaii.", "Rewrite it starting every sentence with A."))]),
    "alpaca": ("tatsu-lab/alpaca", None, "train", 128, [
        ({"instruction": "Give three tips for staying healthy.", "input": "", "output": "..."}, "0",
         ("Give three tips for staying healthy.",)),
        ({"instruction": "Classify the sentiment.", "input": "I loved it!", "output": "positive"}, "1",
         ("Classify the sentiment.\n\nInput:\nI loved it!",))]),
}
EXPERIMENTS = {"paper": ["qwen3_4b", "qwen3_8b", "qwen3_coder_30b_a3b"], "paper_qwen3_4b": ["qwen3_4b"],
               "paper_qwen3_8b": ["qwen3_8b"], "paper_qwen3_coder_30b_a3b": ["qwen3_coder_30b_a3b"],
               "hybrid": ["qwen3_5_27b", "qwen3_6_27b"]}


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_config_composes_and_formats_records(name, tmp_path, compose):
    hub, subset, split, max_samples, cases = BENCHMARKS[name]
    ds = V.validate(compose("device=cpu", f"dataset={name}")).dataset  # validation reads no data
    assert (ds.name, ds.hub, ds.subset, ds.split, ds.max_samples, ds.shuffle_seed) == (
        name, hub, subset, split, max_samples, 0)
    assert ds.title and ds.chat_template and not ds.enable_thinking
    records = [rec for rec, _, _ in cases]
    expected = [(pid, turns) for _, pid, turns in cases]
    assert [(p.id, p.turns) for p in load_dataset_prompts(ds, records)] == expected
    # a local copy with the same fields stands in for the hub (dataset.path=), through the composed config
    local = _jsonl(tmp_path / f"{name}.jsonl", records)
    ds = V.validate(compose("device=cpu", f"dataset={name}", f"dataset.path={local}")).dataset
    assert [(p.id, p.turns) for p in load_dataset_prompts(ds)] == expected


def test_rows_are_drawn_like_the_authors_shuffle(compose):
    """More rows than max_samples: the rows of datasets' own Dataset.shuffle(seed=0).select(range(k));
    otherwise every row in order."""
    from datasets import Dataset

    ds = V.validate(compose("device=cpu", "dataset=gsm8k")).dataset
    records = [{"question": f"q{i}", "answer": str(i)} for i in range(300)]
    reference = Dataset.from_list(records).shuffle(seed=0).select(range(128))
    prompts = prompts_from_records(ds, records)
    assert [p.turns[0].split("\n")[0] for p in prompts] == list(reference["question"])
    assert [p.id for p in prompts] == [q[1:] for q in reference["question"]]  # ids: row indices in the split
    assert sample_indices(30, 30, 0) == list(range(30)) and sample_indices(5, None, 0) == list(range(5))
    assert sample_indices(10, 3, None) == [0, 1, 2]


def test_load_through_datasets_from_a_folder_offline(tmp_path, compose):
    """The real `datasets.load_dataset` path (data_files in order, one split, cache in tmp) on local files."""
    folder = tmp_path / "lcb"
    folder.mkdir()
    rows = [{"question_id": f"q{i}", "question_content": f"Problem {i}.", "starter_code": "def f():" if i % 2 else ""}
            for i in range(6)]
    _jsonl(folder / "test.jsonl", rows[:4])
    _jsonl(folder / "test2.jsonl", rows[4:])
    ds = V.validate(compose("device=cpu", "dataset=livecodebench", f"dataset.hub={folder}",
                             "dataset.data_files=[test.jsonl,test2.jsonl]", "dataset.max_samples=4")).dataset
    cache = str(tmp_path / "cache")
    assert len(load_hub(ds, cache_dir=cache)) == 6
    prompts = load_dataset_prompts(ds, cache_dir=cache)
    assert prompts == load_dataset_prompts(ds, rows)  # the same rows, ids and formats as from records
    assert len(prompts) == 4 and all(p.turns[0].startswith(LCB_HEAD) for p in prompts)


def test_offline_without_cache_says_how_to_provide_the_data(tmp_path, monkeypatch, compose):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds = V.validate(compose("device=cpu", "dataset=gsm8k", "dataset.hub=ddtree-tests/not-cached")).dataset
    with pytest.raises(ConfigError) as e:
        load_dataset_prompts(ds, cache_dir=str(tmp_path / "empty"))
    msg = str(e.value)
    assert e.value.setting == "dataset" and "not in the local datasets cache" in msg
    assert "dataset.path=" in msg and "python -m ddtree.pipeline.datasets gsm8k" in msg and "question" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(("overrides", "setting"), [
    (["dataset=gsm8k", "dataset.template='{question'"], "dataset.template"),
    (["dataset=gsm8k", "dataset.template=null"], "dataset.template"),
    (["dataset=gsm8k", "dataset.template='{turn}'"], "dataset.template"),
    (["dataset=gsm8k", "dataset.path=/nonexistent/gsm8k.jsonl"], "dataset.path"),
    (["dataset=tiny", "dataset.name=gsm8k"], "dataset.name"),
    (["dataset=gsm8k", "dataset.max_samples=0"], "dataset.max_samples"),
])
def test_bad_dataset_settings_fail_before_loading(overrides, setting, compose):
    with pytest.raises(ConfigError) as e:
        V.validate(compose("device=cpu", *overrides))
    assert e.value.setting == setting and e.value.fix


def test_a_record_without_the_template_fields_is_named(tmp_path, compose):
    ds = V.validate(compose("device=cpu", "dataset=gsm8k")).dataset
    with pytest.raises(ConfigError, match=r"reads the field 'question'.*\(it has: problem\)"):
        load_dataset_prompts(ds, [{"problem": "x"}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a"}\n[1, 2]\n')
    ds = V.validate(compose("device=cpu", "dataset=gsm8k", f"dataset.path={bad}")).dataset
    with pytest.raises(ConfigError, match="line 2 is not a JSON object"):
        load_dataset_prompts(ds)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_configs_set_up_the_paper_grid(name, compose):
    cfg = compose("device=cpu", f"experiment={name}", hydra_node=True)
    rc = V.validate(cfg)
    assert rc.tags["experiment"] == name and rc.tracking.experiment == "ddtree-paper"
    assert (rc.max_new_tokens, rc.drafter.block_size, rc.attention.target, rc.model.dtype) == (2048, 16, "sdpa",
                                                                                               "bfloat16")
    params = dict(cfg.hydra.sweeper.params)
    assert list(params)[0] == "model" and params["model"].split(",") == EXPERIMENTS[name]  # models load once
    assert params["dataset"].split(",") == ["math500", "gsm8k", "aime24", "aime25", "humaneval", "mbpp",
                                            "livecodebench", "swe_bench_lite", "mt_bench", "alpaca"]
    assert set(params["dataset"].split(",")) == set(BENCHMARKS)
    assert params["temperature"] == "0.0,1.0" and params["method"] == "dflash,ddtree"
    assert params["budget"] == "16,32,64,128,256,512,1024"
    assert rc.model.name in EXPERIMENTS[name] and rc.drafter.target == rc.model.name_or_path
    assert rc.dataset.enable_thinking == (name == "hybrid")
    # one job of the grid, as the sweeper composes it
    job = V.validate(compose("device=cpu", f"experiment={name}", f"model={EXPERIMENTS[name][-1]}", "dataset=mt_bench",
                              "temperature=1.0", "method=dflash", "budget=1024"))
    assert (job.dataset.hub, job.temperature, job.method, job.model.name) == (
        "HuggingFaceH4/mt_bench_prompts", 1.0, "dflash", EXPERIMENTS[name][-1])


def test_a_budget_sweep_runs_dflash_once(compose):
    """DFlash ignores the budget, so its jobs at other budgets share one identity (and are skipped as finished)."""
    ident = {(m, b): C.identity_dict(V.validate(compose("device=cpu", "experiment=paper_qwen3_8b", f"method={m}", f"budget={b}")))
             for m in ("dflash", "ddtree") for b in (16, 1024)}
    assert ident[("dflash", 16)] == ident[("dflash", 1024)] and ident[("ddtree", 16)] != ident[("ddtree", 1024)]
    tagged = V.validate(compose("device=cpu", "experiment=paper_qwen3_8b", "tags.experiment=mine"))
    assert tagged.tags == {"experiment": "mine"} and C.identity_dict(tagged) == C.identity_dict(
        V.validate(compose("device=cpu", "experiment=paper_qwen3_8b")))


def test_hub_format_prompts_run_through_a_job(tmp_path, monkeypatch, compose):
    """In-process job on the tiny model: a GSM8K local copy and MT-Bench's two turns in the paper's format."""
    from ddtree.pipeline import job as R

    monkeypatch.chdir(tmp_path)
    gsm = _jsonl(tmp_path / "gsm8k.jsonl", [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(5)])
    mt = _jsonl(tmp_path / "mt.jsonl", [BENCHMARKS["mt_bench"][4][0][0]])
    common = ("model=tiny_qwen3", "method=dflash", "max_new_tokens=4", "baseline=false", "warmup=false",
              "tracking=none", "compat.enabled=false")
    s = R.run_job(compose("device=cpu", *common, "dataset=gsm8k", f"dataset.path={gsm}", "dataset.max_samples=2",
                          hydra_node=False))
    recs = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert s["num_prompts"] == 2 and len(recs) == 2 and {r["id"] for r in recs} <= {str(i) for i in range(5)}
    R.run_job(compose("device=cpu", *common, "dataset=mt_bench", f"dataset.path={mt}", hydra_node=False))
    recs = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["id"], r["turn"]) for r in recs] == [("81", 0), ("81", 1)]
    M.MODELS.clear()
