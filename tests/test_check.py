"""`python -m ddtree.check`: another engine's outputs judged against the same target.

The target is the shipped toy (assets/toy/target, fp32). Outputs come from an independent reference (Hugging Face
`generate`): served by a real `transformers serve` process (slow suite), by a small real HTTP server (tests/
check_server.py: error paths, engine-specific answers, sampling), or saved in a file with a token planted
wrong at a known position, or a near-tie built into the target's head.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from ddtree.errors import ConfigError
from ddtree.paths import DATA_ROOT
from ddtree.pipeline.output_verdicts import SuspectOutputs

TOY = DATA_ROOT / "assets" / "toy" / "target"
PROMPTS = [json.loads(line) for line in (DATA_ROOT / "assets" / "toy" / "prompts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def toy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(TOY, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(TOY))


def prompt_ids(tok, user: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def check(compose, tmp_path, monkeypatch, *overrides: str):
    from ddtree.pipeline.check import run_check

    monkeypatch.chdir(tmp_path)  # without a Hydra runtime the check writes to the cwd
    return run_check(compose(*overrides, f"runs_dir={tmp_path / 'runs'}", config_name="check", hydra_node=False))


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- file source


def test_file_outputs_exact_and_a_planted_token_suspect_at_its_position(toy, tmp_path, monkeypatch, compose):
    model, tok = toy
    rows, planted = [], 5
    for i, p in enumerate(PROMPTS[:3]):
        out = greedy(model, prompt_ids(tok, p["turns"][0]), 24)
        if i == 1:  # a token the target does not choose, far from its best
            logits = model(torch.tensor([prompt_ids(tok, p["turns"][0]) + out[:planted]])).logits[0, -1]
            out = out[:planted] + [int(logits.argmin())] + out[planted + 1:]
        rows.append({"id": p["id"], "prompt": p["turns"][0], **({"output_ids": out} if i != 2 else
                                                               {"output": tok.decode(out, skip_special_tokens=True)})})
    f = write_jsonl(tmp_path / "outputs.jsonl", rows)
    s = check(compose, tmp_path, monkeypatch, "source=file", f"file.path={f}", "max_new_tokens=24", "tracking=none")
    recs = {r["id"]: r for r in lines(tmp_path / "check.jsonl")}
    assert recs[PROMPTS[0]["id"]]["check"]["verdict"] == "exact"
    assert recs[PROMPTS[2]["id"]]["check"]["verdict"] == "exact" and recs[PROMPTS[2]["id"]]["ids_from"] == "text"
    bad = recs[PROMPTS[1]["id"]]["check"]
    assert bad["verdict"] == "suspect" and bad["position"] == planted
    assert bad["misses"][0]["position"] == planted and bad["misses"][0]["kind"] == "not_argmax"
    assert bad["misses"][0]["margin"] > bad["misses"][0]["allowed"]  # the logits and the margin are the evidence
    v = s["validation"]
    assert (v["exact"], v["tie"], v["suspect"], v["first_suspect_position"]) == (2, 0, 1, planted)
    assert json.loads((tmp_path / "summary.json").read_text())["validation"]["suspect"] == 1

    # validation=strict: the results are written, then exit code 3 (SuspectOutputs)
    with pytest.raises(SuspectOutputs, match="1 of 3 outputs are suspect"):
        check(compose, tmp_path, monkeypatch, "source=file", f"file.path={f}", "max_new_tokens=24", "tracking=none",
              "validation=strict")


def test_a_constructed_near_tie_is_a_tie(toy, tmp_path, monkeypatch, compose):
    """Two rows of the head made equal but for one fp32 step: wherever the target picks one, the other is a tie."""
    model, tok = toy
    target = tmp_path / "tied"
    shutil.copytree(TOY, target, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    ids = prompt_ids(tok, PROMPTS[0]["turns"][0])
    out = greedy(model, ids, 12)
    at = 3
    a = out[at]
    b = next(t for t in range(model.config.vocab_size) if t not in out and t not in (tok.eos_token_id, 0))
    head = model.lm_head.weight.data
    old = head[b].clone()
    try:
        head[b] = head[a]
        model.save_pretrained(target)
    finally:
        head[b] = old
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert greedy(tied, ids, at + 1)[at] == min(a, b)  # equal logits: the lower id wins greedy decoding
    other = max(a, b)
    planted = greedy(tied, ids, at) + [other]
    planted += greedy(tied, ids + planted, 12 - len(planted))  # the target's own continuation after the tie
    f = write_jsonl(tmp_path / "tie.jsonl", [{"id": "t", "prompt": PROMPTS[0]["turns"][0], "output_ids": planted}])
    s = check(compose, tmp_path, monkeypatch, "source=file", f"file.path={f}", "max_new_tokens=12", "tracking=none",
              "model=hf", f"model.name_or_path={target}", "model.dtype=float32")
    (rec,) = lines(tmp_path / "check.jsonl")
    assert rec["check"]["verdict"] == "tie" and rec["check"]["near_ties"] >= 1
    assert rec["check"]["worst_margin_steps"] <= 4
    assert s["validation"]["tie"] == 1 and s["validation"]["suspect"] == 0


def test_a_multi_turn_file_is_judged_turn_by_turn(toy, tmp_path, monkeypatch, compose):
    """A later turn's input holds the engine's own earlier answer (as a chat client sends it)."""
    model, tok = toy
    turns = [PROMPTS[0]["turns"][0], PROMPTS[1]["turns"][0]]
    first = greedy(model, prompt_ids(tok, turns[0]), 16)
    messages = [{"role": "user", "content": turns[0]},
                {"role": "assistant", "content": tok.decode(first, skip_special_tokens=True)},
                {"role": "user", "content": turns[1]}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    second = greedy(model, ids, 16)
    f = write_jsonl(tmp_path / "two.jsonl", [{"id": "two", "turns": turns, "output_ids": [first, second]}])
    s = check(compose, tmp_path, monkeypatch, "source=file", f"file.path={f}", "max_new_tokens=16", "tracking=none")
    assert [r["check"]["verdict"] for r in lines(tmp_path / "check.jsonl")] == ["exact", "exact"]
    assert s["validation"]["exact"] == 2 and s["num_prompts"] == 1


@pytest.mark.parametrize("content, match", [
    ("", "holds no outputs"),
    ('{"id": 1, "prompt": "hi", "output": "x"}\n{not json\n', "line 2 is not valid JSON"),
    ('{"id": 1, "prompt": "hi"}\n', "neither 'output' nor 'output_ids'"),
    ('{"id": 1, "output": "x"}\n', "'prompt' .* or 'turns'"),
    ('{"id": 1, "turns": ["a", "b"], "output": "x"}\n', "2 user turn"),
    ('{"id": 1, "prompt": "hi", "output_ids": [5, 99999]}\n', "outside the target's vocabulary"),
])
def test_bad_files_stop_with_one_line_naming_file_path(content, match, tmp_path, monkeypatch, compose):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ConfigError, match=f"^file.path: .*{match}"):
        check(compose, tmp_path, monkeypatch, "source=file", f"file.path={f}", "tracking=none")


def test_settings_are_checked_before_any_server_or_weight(tmp_path, monkeypatch, compose):
    for bad, setting in (("source=socket", "source"), ("repeats=0", "repeats"), ("endpoint.api=grpc", "endpoint.api"),
                         ("temperature=-1", "temperature"), ("file.path=null", "endpoint.url")):
        with pytest.raises(ConfigError, match=f"^{setting}:"):
            check(compose, tmp_path, monkeypatch, bad, "tracking=none")
    with pytest.raises(ConfigError, match="^file.path: is not set"):
        check(compose, tmp_path, monkeypatch, "source=file", "tracking=none")


# ---------------------------------------------------------------- a small real HTTP server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_errors_stop_with_one_line(toy, tmp_path, monkeypatch, compose):
    from check_server import Behaviour, FakeEngine

    model, tok = toy
    base = ("dataset.max_samples=2", "max_new_tokens=8", "tracking=none")
    down = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ConfigError, match=r"^endpoint.url: cannot reach .*Connection refused"):
        check(compose, tmp_path, monkeypatch, f"endpoint.url={down}", *base)
    for behaviour, setting, match in ((Behaviour(status=400), "endpoint.url", "HTTP 400"),
                                      (Behaviour(status=503), "endpoint.url", "HTTP 503"),
                                      (Behaviour(delay_s=3.0), "endpoint.timeout_s", "did not answer within 1 s")):
        with FakeEngine(model, tok, behaviour) as srv, pytest.raises(ConfigError, match=f"^{setting}: .*{match}"):
            check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", "endpoint.timeout_s=1", *base)
    with FakeEngine(model, tok) as srv, pytest.raises(ConfigError, match="^endpoint.model: 'qwen' is not served"):
        check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", "endpoint.model=qwen", *base)
    with FakeEngine(model, tok, Behaviour(text_edit=lambda t: t + " 81 82")) as srv, \
            pytest.raises(ConfigError, match="^endpoint: prompt .* does not round-trip .* ask the server for token ids"):
        check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", *base)


def test_engine_token_ids_and_reported_acceptance(toy, tmp_path, monkeypatch, compose):
    from check_server import Behaviour, FakeEngine

    model, tok = toy
    for behaviour, reported in ((Behaviour(token_ids=True, vllm_metrics=True), "vllm /metrics"),
                                (Behaviour(sglang_meta=True), "sglang meta_info")):
        with FakeEngine(model, tok, behaviour) as srv:
            s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", "dataset.max_samples=3",
                      "max_new_tokens=16", "tracking=none")
        assert s["validation"]["exact"] == 3 and s["validation"]["suspect"] == 0
        assert s["server_acceptance"]["reported_by"] == reported
        assert s["ids_from"] == ({"engine": 3, "text": 0} if behaviour.token_ids else {"engine": 0, "text": 3})
        assert s["tokens_per_s"] > 0 and all(r["latency_s"] > 0 for r in lines(tmp_path / "check.jsonl"))
    assert s["server_acceptance"]["mean_acceptance_length"] == pytest.approx(
        sum(r["num_new_tokens"] for r in lines(tmp_path / "check.jsonl"))
        / sum(max(1, r["num_new_tokens"] // 2) for r in lines(tmp_path / "check.jsonl")), rel=0.2)


def test_a_server_failing_mid_dataset_keeps_what_was_checked_and_the_rerun_resumes(toy, tmp_path, monkeypatch,
                                                                                    compose):
    from check_server import Behaviour, FakeEngine
    from mlflow import MlflowClient

    model, tok = toy
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    args = ("dataset.max_samples=4", "max_new_tokens=8", f"tracking.uri={uri}")
    with FakeEngine(model, tok, Behaviour(fail_after=2)) as srv:
        (tmp_path / "a").mkdir()
        with pytest.raises(ConfigError, match=r"^endpoint.url: .*HTTP 500.*after 2 of 4 outputs.*rerun"):
            check(compose, tmp_path / "a", monkeypatch, f"endpoint.url={srv.url}", *args)
        kept = lines(tmp_path / "a" / "check.jsonl")
        assert [r["check"]["verdict"] for r in kept] == ["exact", "exact"]  # what was gathered got its verdicts
        summary = json.loads((tmp_path / "a" / "summary.json").read_text())
        assert summary["complete"] is False and "HTTP 500" in summary["error"]
        (tmp_path / "b").mkdir()
        srv.b.fail_after, served = None, srv.b.served
        s = check(compose, tmp_path / "b", monkeypatch, f"endpoint.url={srv.url}", *args)
        assert srv.b.served - served == 2  # only the two missing prompts were asked again
    assert s["complete"] and s["validation"]["exact"] == 4
    assert sum(1 for r in lines(tmp_path / "b" / "check.jsonl") if r.get("resumed_from")) == 2
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ddtree-check")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert runs[1].data.metrics["validation.exact"] == 4


def test_ddtree_ar_baseline_from_runs_is_compared(toy, tmp_path, monkeypatch, compose):
    from check_server import FakeEngine

    from ddtree.pipeline.job import run_job

    model, tok = toy
    (tmp_path / "ar").mkdir()
    monkeypatch.chdir(tmp_path / "ar")
    run_job(compose("method=ar", "dataset.max_samples=2", "max_new_tokens=12", "tracking=none", "warmup=false",
                    f"runs_dir={tmp_path / 'runs'}", hydra_node=False))
    (tmp_path / "runs").mkdir(exist_ok=True)
    shutil.move(str(tmp_path / "ar"), str(tmp_path / "runs" / "ar"))  # a finished job under runs_dir
    with FakeEngine(model, tok) as srv:
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", "dataset.max_samples=2",
                  "max_new_tokens=12", "tracking=none")
    assert s["baseline"] == {"job_dir": str(tmp_path / "runs" / "ar"), "compared": 2, "equal": 2}
    assert s["match_rate"] == 1.0 and s["validation"]["exact"] == 2


# ---------------------------------------------------------------- greedy means greedy: the server's sampler defaults


def penalized(model, tok, user: str, n: int, penalty: float) -> list[int]:
    """The independent reference of a server that applies a repetition penalty: HF generate with it."""
    ids = prompt_ids(tok, user)
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, repetition_penalty=penalty,
                              pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()


def test_greedy_requests_switch_off_each_servers_sampler_defaults(toy, tmp_path, monkeypatch, compose):
    """A server applying a repetition penalty by default (llama-cpp-python: repeat_penalty 1.1; vLLM/SGLang: the
    model's generation_config) is exact when ddtree's requests set the neutral values; the same server asked
    without them (endpoint.server=none) is suspect where HF generate with that penalty departs from greedy, with
    the sampler hint in the reason."""
    from check_server import Behaviour, FakeEngine

    model, tok = toy
    base = ("dataset.max_samples=3", "max_new_tokens=16", "tracking=none")
    llama_cpp_python = dict(owned_by="me", permissions=True, default_penalty=2.0)
    with FakeEngine(model, tok, Behaviour(**llama_cpp_python)) as srv:
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", *base)
        sent = srv.b.requests[-1]
    assert s["server"] == "llama-cpp-python" and s["validation"]["suspect"] == 0, s["validation"]
    assert (sent["repeat_penalty"], sent["presence_penalty"], sent["frequency_penalty"], sent["min_p"]) == (1.0, 0, 0, 0)
    assert s["sampler"]["repeat_penalty"] == 1.0 and s["sampler"]["temperature"] == 0

    with FakeEngine(model, tok, Behaviour(**llama_cpp_python)) as srv:  # what ddtree sent before: a sampler verdict
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", "endpoint.server=none", *base)
        assert "repeat_penalty" not in srv.b.requests[-1]
    recs = lines(tmp_path / "check.jsonl")
    want = {}
    for p in PROMPTS[:3]:
        a, b = greedy(model, prompt_ids(tok, p["turns"][0]), 16), penalized(model, tok, p["turns"][0], 16, 2.0)
        want[p["id"]] = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    assert sum(w is not None for w in want.values()) >= 2  # the penalty changes outputs (else the test proves nothing)
    assert {r["prompt_id"]: r["check"].get("position") for r in recs} == want
    for r in recs:
        if r["check"]["verdict"] == "suspect":  # the verdict stays; the reason says where to look
            assert "sampler setting the server applies" in r["check"]["reason"] and r["check"]["sampler_hint"]

    with FakeEngine(model, tok, Behaviour(**llama_cpp_python)) as srv:  # the user's own value wins
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", "endpoint.extra={repeat_penalty: 2.0}",
                  *base)
    assert s["sampler"]["repeat_penalty"] == 2.0 and s["validation"]["suspect"] == sum(
        w is not None for w in want.values())


def test_each_server_gets_the_fields_it_reads(toy, tmp_path, monkeypatch, compose):
    """vLLM (repetition_penalty from generation_config.json) gets its own field names; a server not recognised
    gets OpenAI's standard fields alone, so one that refuses unknown fields (transformers serve: 422) still
    answers."""
    from check_server import Behaviour, FakeEngine

    model, tok = toy
    base = ("dataset.max_samples=3", "max_new_tokens=4", "tracking=none")
    assert any(greedy(model, prompt_ids(tok, p["turns"][0]), 4) != penalized(model, tok, p["turns"][0], 4, 2.0)
               for p in PROMPTS[:3])  # the penalty changes an output: leaving it on would be suspect
    with FakeEngine(model, tok, Behaviour(owned_by="vllm", default_penalty=2.0, penalty_field="repetition_penalty",
                                          token_ids=True)) as srv:
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", *base)
        sent = srv.b.requests[-1]
    assert s["server"] == "vllm" and s["validation"]["suspect"] == 0
    assert (sent["repetition_penalty"], sent["top_k"], sent["min_p"]) == (1.0, -1, 0.0) and "repeat_penalty" not in sent
    taken = {"model", "messages", "max_tokens", "temperature", "top_p", "stream", "seed", "presence_penalty",
             "frequency_penalty"}
    with FakeEngine(model, tok, Behaviour(owned_by="local", fields=taken)) as srv:
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", *base)
        assert set(srv.b.requests[-1]) <= taken
    assert s["server"] == "openai" and s["validation"]["suspect"] == 0
    with FakeEngine(model, tok, Behaviour(owned_by="local", fields=taken)) as srv, \
            pytest.raises(ConfigError, match="^endpoint.url: .*HTTP 422.*endpoint.extra may hold a field"):
        check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", "endpoint.server=llama-cpp-python", *base)


def test_sampler_hint_reads_the_evidence():
    from ddtree.pipeline.check import sampler_hint

    miss = {"kind": "not_argmax", "position": 3, "emitted": 7, "expected": 9, "emitted_rank": 1}
    assert "runner-up" in sampler_hint(miss, [1, 2, 3])
    assert "already occurs 2x" in sampler_hint({**miss, "emitted_rank": 40}, [9, 1, 9])
    assert sampler_hint({**miss, "emitted_rank": 40}, [7, 9, 1]) is None  # far down the list, no repetition
    assert sampler_hint({**miss, "kind": "short_without_stop", "emitted": None}, [9, 9]) is None


# ---------------------------------------------------------------- every command of docs/check.md


def doc_commands(text: str) -> list[tuple[list[str], bool]]:
    """(overrides, a whole command) for every `python -m ddtree.check` command in the page's code blocks
    (continuation lines joined, comments dropped) and every inline `endpoint.…=…` setting it tells a user to pass.
    A sweep (`endpoint.url=a,b` under -m) becomes one command per value."""
    import re
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
            if "python -m ddtree.check" in cmd:
                words = shlex.split(cmd.split("python -m ddtree.check", 1)[1], comments=True)
                found.append(([w for w in words if w not in ("-m", "--multirun")], True))
    for span in re.findall(r"`(\+?endpoint\.[^`]*=[^`]*)`", text):
        found.append((shlex.split(span), False))
    parser, out = OverridesParser.create(), []
    for words, whole in found:
        sweeps = [o for o in parser.parse_overrides(words) if o.is_sweep_override()]
        if not sweeps:
            out.append((words, whole))
        for o in sweeps:
            for value in o.sweep_string_iterator():
                out.append(([w for w in words if w != o.input_line] + [f"{o.key_or_group}={value}"], whole))
    return out


def test_every_command_in_docs_check_md_composes(compose):
    """Each command of docs/check.md composes and passes the settings checks as written; each inline setting
    composes (the fragments complete a command), and `endpoint.extra` receives what was written."""
    from ddtree.pipeline.check import check_settings, to_check_config

    cmds = doc_commands((DATA_ROOT / "docs" / "check.md").read_text())
    assert len(cmds) >= 10 and (["endpoint.extra={return_token_ids: true}"], False) in cmds
    for words, whole in cmds:
        if not any(w.startswith(("endpoint.url=", "source=")) for w in words):
            words = [*words, "endpoint.url=http://127.0.0.1:8000/v1"]
        cc = to_check_config(compose(*words, config_name="check", hydra_node=False))
        if whole:
            check_settings(cc)
        for w in words:
            key, value = w.lstrip("+").split("=", 1)
            if key == "endpoint.extra":
                assert cc.endpoint.extra and set(cc.endpoint.extra) <= set(value.strip("{}").replace(":", ",")
                                                                           .replace(" ", "").split(",")), w
    cc = to_check_config(compose("endpoint.extra={return_meta_info: true, return_token_ids: true}",
                                 "endpoint.extra.top_k=-1", config_name="check", hydra_node=False))
    assert cc.endpoint.extra == {"return_meta_info": True, "return_token_ids": True, "top_k": -1}


# ---------------------------------------------------------------- T > 0


@pytest.mark.slow  # ~30 s: 120 sampled answers over HTTP (the fast suite tests saved samples, below)
def test_sampled_outputs_get_target_probabilities_and_distribution_tests(toy, tmp_path, monkeypatch, compose):
    from check_server import Behaviour, FakeEngine

    model, tok = toy
    args = ("dataset.max_samples=1", "max_new_tokens=3", "temperature=3.0", "repeats=60", "tracking=none")
    with FakeEngine(model, tok, Behaviour(token_ids=True)) as srv:  # sampled text need not re-tokenize the same
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", *args)
    recs = lines(tmp_path / "check.jsonl")
    assert len(recs) == 60 and all(len(r["target_probs"]) == len(r["output_ids"]) for r in recs)
    assert s["validation"]["ok"] == 60 and s["validation"]["suspect"] == 0
    (first,) = s["sampling"]["first_token"]
    assert first["samples"] == 60 and first["pvalue"] > 1e-3 and s["sampling"]["pit"]["pvalue"] > 1e-3
    with FakeEngine(model, tok, Behaviour(token_ids=True, temperature_scale=0.5)) as srv:  # a sharper distribution
        s = check(compose, tmp_path, monkeypatch, f"endpoint.url={srv.url}", *args)
    assert min(s["sampling"]["pit"]["pvalue"], s["sampling"]["first_token"][0]["pvalue"]) < 1e-3


def test_saved_samples_of_one_prompt_get_the_distribution_tests(toy, tmp_path, monkeypatch, compose):
    model, tok = toy
    ids = prompt_ids(tok, PROMPTS[0]["turns"][0])
    torch.manual_seed(0)
    with torch.no_grad():
        outs = model.generate(torch.tensor([ids] * 40), max_new_tokens=2, do_sample=True, temperature=3.0, top_k=0,
                              top_p=1.0)[:, len(ids):].tolist()
    f = write_jsonl(tmp_path / "samples.jsonl", [{"id": "p", "prompt": PROMPTS[0]["turns"][0], "repeat": k,
                                                  "output_ids": o} for k, o in enumerate(outs)])
    s = check(compose, tmp_path, monkeypatch, "source=file", f"file.path={f}", "max_new_tokens=2", "temperature=3.0",
              "tracking=none")
    assert s["repeats"] == 40 and s["num_prompts"] == 1 and s["validation"]["ok"] == 40
    (first,) = s["sampling"]["first_token"]
    assert first["samples"] == 40 and first["pvalue"] > 1e-3 and s["sampling"]["pit"]["tokens"] == 80
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "p", "prompt": "a", "output": "x"}] * 2)
    with pytest.raises(ConfigError, match="^file.path: dup.jsonl line 2: duplicate id 'p'"):
        check(compose, tmp_path, monkeypatch, "source=file", f"file.path={dup}", "tracking=none")


# ---------------------------------------------------------------- the real server (transformers serve)


@pytest.mark.slow  # `transformers serve` starts in ~25-60 s on a shared 2-core machine
def test_transformers_serve_outputs_are_exact(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    exe = Path(sys.executable).with_name("transformers")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([str(exe), "serve", str(TOY), "--host", "127.0.0.1", "--port", str(port),
                               "--device", "cpu", "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(url + "/models", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "transformers serve did not start"
                time.sleep(2)
        proc = subprocess.run([sys.executable, "-m", "ddtree.check", f"endpoint.url={url}", "dataset.max_samples=6",
                               "max_new_tokens=48", f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'job'}",
                               "validation=strict"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (s["validation"]["exact"], s["validation"]["suspect"], s["outputs"]) == (6, 0, 6)
    assert "6 ok (6 exact)" in proc.stdout


def test_the_cli_exits_3_on_a_suspect_output_and_2_on_a_bad_file(toy, tmp_path):
    """Through `python -m ddtree.check` itself: Hydra, the one-line errors and the exit codes."""
    model, tok = toy
    ids = prompt_ids(tok, PROMPTS[0]["turns"][0])
    out = greedy(model, ids, 8)
    out[2] = (out[2] + 1) % model.config.vocab_size
    f = write_jsonl(tmp_path / "o.jsonl", [{"id": "a", "prompt": PROMPTS[0]["turns"][0], "output_ids": out}])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDTREE_TRACEBACK": ""}
    run = [sys.executable, "-m", "ddtree.check", "source=file", "max_new_tokens=8", "tracking=none",
           f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'job'}"]
    proc = subprocess.run([*run, f"file.path={f}", "validation=strict"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "1 SUSPECT of 1 outputs; first suspect position 2" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("error: validation.strict: 1 of 1 outputs are suspect")
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    proc = subprocess.run([*run, f"file.path={tmp_path / 'bad.jsonl'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: file.path: bad.jsonl line 1")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # fast: the rule check's verdicts come from (method_side_verdict) on a tied MoE in process
# (tests/test_output_check.py::test_a_router_tie_is_a_shape_tie_not_a_suspect), the check's verdicts above
def test_a_moe_router_tie_is_a_shape_tie_not_a_suspect(tmp_path, monkeypatch, compose):
    """A bf16 MoE checkpoint whose routers tie on purpose (ddtree.testing.tied_routers.tied_router_model): the outputs of
    transformers' own cached greedy decoding lose by many steps in one forward at some positions, where a router
    picked the other expert; the check computes those positions as decoding did and calls them `tie`."""
    from ddtree.pipeline.prompts import encode
    from ddtree.testing.tied_routers import tied_router_model
    from ddtree.tiny import tiny_tokenizer

    model, tok = tied_router_model("qwen3_moe", vocab_size=128), tiny_tokenizer(128)
    target = tmp_path / "tied_moe"
    model.save_pretrained(target)
    tok.save_pretrained(target)
    def ids(user: str) -> list[int]:  # as the check encodes a prompt (the toy dataset's settings: no thinking)
        return encode(tok, [{"role": "user", "content": user}], chat_template=True, enable_thinking=False)

    rows = [{"id": p["id"], "prompt": p["turns"][0], "output_ids": greedy(model, ids(p["turns"][0]), 32)}
            for p in PROMPTS[:4]]
    f = write_jsonl(tmp_path / "moe.jsonl", rows)
    s = check(compose, tmp_path, monkeypatch, "source=file", f"file.path={f}", "max_new_tokens=32", "tracking=none",
              "model=hf", f"model.name_or_path={target}")
    recs = lines(tmp_path / "check.jsonl")
    assert s["validation"]["suspect"] == 0, [r["check"].get("reason") for r in recs]
    tied = [r["check"] for r in recs if r["check"].get("num_shape_ties")]
    assert tied and all(c["verdict"] == "tie" for c in tied)
    one, *_ = tied[0]["shape_ties"][0]["computations"]
    assert one["computation"] == "one forward over the sequence" and one["margin_steps"] > 4 and one["routing"]
