"""concurrency=N in `python -m ddtree.run`: the job's prompts through one Engine.generate_many call per role (and
turn), its samples and verdicts as one prompt at a time gives them, its throughput and latency in the summary, the
tables and MLflow; and the memory a stream needs, refused before loading where it does not fit (docs/concurrency.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddtree.pipeline import models as M


def _samples(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_concurrency_two_gives_the_outputs_of_one_prompt_at_a_time(tmp_path, monkeypatch, small, compose):
    """In-process, tiny fp32 target, T = 0: the batched job's records equal the one-by-one job's, record for record,
    in the same order (the second prompt has two turns: the batch runs turn by turn); the summary's throughput is
    its tokens over its wall seconds, its latency the streams' total seconds' median and p90."""
    import ddtree.engine.loop
    from ddtree.pipeline import job as R

    monkeypatch.chdir(tmp_path)
    calls = []
    real = ddtree.engine.loop.Engine.generate_many

    def counted(self, prompts, **kw):
        calls.append((self.method, len(prompts), kw["concurrency"], kw["seed"]))
        return real(self, prompts, **kw)

    monkeypatch.setattr(ddtree.engine.loop.Engine, "generate_many", counted)

    def job(*extra):
        summary = R.run_job(compose(*small, "device=cpu", "tracking=none", "warmup=false", "compat.enabled=false",
                                    "budget=8", *extra, hydra_node=False))
        return summary, _samples(tmp_path / "samples.jsonl")

    one, rows1 = job()
    assert not calls  # concurrency=1: today's per-prompt path, no batched call
    two, rows2 = job("concurrency=2")
    # a call per role and turn: turn 0 of both prompts, then turn 1 of the one with two turns; sampling (T > 0) is
    # seeded from the job's seed, one seed per turn, whatever the role
    seeds = [calls[0][3], calls[1][3]]
    assert calls == [("ar", 2, 2, seeds[0]), ("ar", 1, 2, seeds[1]), ("ddtree", 2, 2, seeds[0]),
                     ("ddtree", 1, 2, seeds[1])] and seeds[0] != seeds[1]
    key = [(r["id"], r["turn"], r["role"]) for r in rows1]
    assert key == [(r["id"], r["turn"], r["role"]) for r in rows2] == [
        ("tiny-0", 0, "baseline"), ("tiny-0", 0, "method"), ("tiny-1", 0, "baseline"), ("tiny-1", 1, "baseline"),
        ("tiny-1", 0, "method"), ("tiny-1", 1, "method")]
    assert [r["output_ids"] for r in rows1] == [r["output_ids"] for r in rows2]
    assert [r["text"] for r in rows1] == [r["text"] for r in rows2]
    assert set(rows1[0]) == set(rows2[0]) and "queued_s" in rows2[0]
    # verdicts on every output, as one prompt at a time gives them
    assert two["match_rate"] == 1.0 and two["validation"]["suspect"] == 0
    assert two["validation"]["checked"] == one["validation"]["checked"] == 3
    assert [r["validation"] for r in rows1 if r["role"] == "method"] == [
        r["validation"] for r in rows2 if r["role"] == "method"]

    for s, rows in ((one, rows1), (two, rows2)):
        for role, figures in (("method", s), ("baseline", s["baseline"])):
            mine = [r for r in rows if r["role"] == role]
            tokens = sum(len(r["output_ids"]) for r in mine)
            assert figures["throughput_tok_s"] == pytest.approx(tokens / figures["wall_s"])
            lat = [r["ttft_s"] + r["decode_s"] for r in mine]
            assert figures["latency_s"]["median"] == pytest.approx(np.percentile(lat, 50))
            assert figures["latency_s"]["p90"] == pytest.approx(np.percentile(lat, 90))
    # one prompt at a time the wall seconds are the generations' own; batched, the calls'
    assert one["wall_s"] == pytest.approx(sum(r["total_s"] for r in rows1 if r["role"] == "method"))
    assert one["throughput_tok_s"] == pytest.approx(one["tokens_per_s"])
    assert (one["concurrency"], two["concurrency"]) == (1, 2)

    M.MODELS.clear()


def test_the_tables_show_total_throughput_latency_and_concurrency():
    from ddtree.pipeline.sweep_table import format_table

    base = {"model": "m", "method": "ddtree", "budget": 16, "block_size": 16, "num_prompts": 2, "tau": 3.0,
            "tokens_per_s": 10.0, "baseline_tokens_per_s": 5.0, "speedup": 2.0, "match_rate": 1.0,
            "throughput_tok_s": 30.0, "latency_s": {"median": 0.5, "p90": 0.75},
            "baseline": {"throughput_tok_s": 12.5}}
    job = format_table({**base, "concurrency": 8}).splitlines()
    row = job[1]
    assert "concurrency" in job[0] and "total tok/s" in job[0] and "latency p50/p90 s" in job[0]
    assert "30.0" in row and "12.5" in row and "0.50/0.75" in row and " 8 " in row
    assert "concurrency" not in format_table({**base, "concurrency": 1}).splitlines()[0]  # today's job: no column
    assert "total tok/s" not in format_table({k: v for k, v in base.items() if k != "latency_s"})  # ddtree.check's
    rows = [{**base, "concurrency": n, "settings": {"concurrency": str(n)}} for n in (1, 8)]
    sweep = format_table(rows, ["concurrency"]).splitlines()  # a sweep varying it: one column, as its value
    assert sweep[0].split().count("concurrency") == 1 and [r.split()[3] for r in sweep[1:]] == ["1", "8"]


def test_concurrency_one_keeps_the_identity_of_jobs_before_the_setting(compose):
    from ddtree.pipeline.schema import identity_dict

    assert "concurrency" not in identity_dict(compose("concurrency=1", hydra_node=False))
    assert identity_dict(compose("concurrency=8", hydra_node=False))["concurrency"] == 8


def test_the_default_job_runs_batched_through_the_cli(cli, tmp_path, small):
    """The tiny pair (a random Qwen3 and its random DFlash drafter) with the default settings otherwise (method=ddtree,
    budget 64, the baseline, verdicts, MLflow) and concurrency=2: the summary, the samples in prompt order and the
    tracked metrics."""
    from mlflow import MlflowClient

    job, uri = tmp_path / "job", f"sqlite:///{tmp_path}/runs/mlflow.db"
    proc = cli(*small, "concurrency=2", f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = next(line for line in proc.stdout.splitlines() if line.startswith("model"))
    assert {"concurrency", "total", "latency"} <= set(head.split())
    s = json.loads((job / "summary.json").read_text())
    rows = _samples(job / "samples.jsonl")
    assert [(r["id"], r["turn"], r["role"]) for r in rows] == [
        ("tiny-0", 0, "baseline"), ("tiny-0", 0, "method"), ("tiny-1", 0, "baseline"), ("tiny-1", 1, "baseline"),
        ("tiny-1", 0, "method"), ("tiny-1", 1, "method")]
    method = [r for r in rows if r["role"] == "method"]
    assert s["concurrency"] == 2 and s["match_rate"] == 1.0 and s["new_tokens"] == sum(r["num_new_tokens"]
                                                                                      for r in method)
    assert s["throughput_tok_s"] == pytest.approx(s["new_tokens"] / s["wall_s"])
    assert 0 < s["latency_s"]["median"] <= s["latency_s"]["p90"] and s["baseline"]["throughput_tok_s"] > 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ddtree").experiment_id])
    assert run.data.metrics["throughput_tok_s"] == pytest.approx(s["throughput_tok_s"])
    assert {"latency_s.median", "latency_s.p90", "baseline.throughput_tok_s", "baseline.latency_s.p90"} <= set(
        run.data.metrics)
    assert run.data.params["concurrency"] == "2"


QWEN36 = Path(__file__).resolve().parents[1] / "bench" / "configs" / "qwen3_6_27b.json"


def test_bytes_per_stream_at_qwen3_6_27b_dims():
    """KV rows and GDN state by hand from the config's dims: 16 attention layers x 4 KV heads x 256 x K and V x bf16
    a row; 48 GDN layers, each a conv state (2 x 16 x 128 + 48 x 128 channels x 4 taps, bf16) and a float32
    recurrent state (48 heads x 128 x 128); the tree's scratch grows with its nodes."""
    from ddtree.engine.capacity import stream_bytes

    text = json.loads(QWEN36.read_text())["text_config"]
    s = stream_bytes(text, 32768, 65, 2)
    assert s.kv == 16 * 4 * 256 * 2 * 2 * 32768 == 2 * 2**30
    assert s.gdn_state == 48 * ((2 * 16 * 128 + 48 * 128) * 4 * 2 + 48 * 128 * 128 * 4)
    assert stream_bytes(text, 32768, 1, 2).tree < stream_bytes(text, 32768, 17, 2).tree < s.tree < 2**30
    assert s.total == s.kv + s.gdn_state + s.tree and s.drafter_kv == 0
    drafter = {"num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    with_drafter = stream_bytes(text, 32768, 65, 2, drafter)  # a drafter's rows: its layers x 8 KV heads x 128
    assert with_drafter.drafter_kv == 5 * 8 * 128 * 2 * 2 * 32768 and with_drafter.total == s.total + 5 * 2**27
    pure = stream_bytes({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 100, 1, 4)
    assert pure.kv == 2 * 4 * 16 * 2 * 4 * 100 and pure.gdn_state == 0  # no KV-head or head-dim fields: MHA


def test_streams_that_do_not_fit_are_refused_naming_the_largest_that_does():
    """A stated free memory (no GPU needed): 80 GiB free, 51.2 GB of weights to load; the largest concurrency the
    message names fits, one more does not."""
    import re

    from ddtree.errors import ConfigError
    from ddtree.pipeline.preflight import check_streams_fit

    text = json.loads(QWEN36.read_text())["text_config"]
    kw = dict(rows=33_000, nodes=65, dtype_bytes=2, free_bytes=80 * 2**30, weights_bytes=51_200_000_000,
              device="cuda:0")
    with pytest.raises(ConfigError) as e:
        check_streams_fit(text, concurrency=64, **kw)
    line = str(e.value)
    assert "\n" not in line and line.startswith("concurrency: 64 streams of 33,000 rows need about") and "GDN" in line
    fits = int(re.search(r"use concurrency<=(\d+)", line).group(1))
    assert 1 <= fits < 64
    check_streams_fit(text, concurrency=fits, **kw)  # fits
    with pytest.raises(ConfigError):
        check_streams_fit(text, concurrency=fits + 1, **kw)
    with pytest.raises(ConfigError, match="use a shorter max_new_tokens"):  # not even one stream
        check_streams_fit(text, concurrency=2, **{**kw, "free_bytes": 52_000_000_000})


def test_the_job_checks_its_streams_before_loading(compose, small, monkeypatch, tmp_path):
    """configure() hands the check the target's config and one stream's longest conversation (the two-turn prompt:
    its turns' tokens and two answers of max_new_tokens=8); on this CPU the check itself passes (no CUDA)."""
    from ddtree.pipeline import job as R
    from ddtree.pipeline import preflight as P

    seen = []
    monkeypatch.setattr(R, "check_concurrency_fits", lambda rc, facts, context: seen.append((facts, context))
                        or P.check_concurrency_fits(rc, facts, context))
    monkeypatch.chdir(tmp_path)
    R.configure(compose(*small, "concurrency=4", hydra_node=False))
    ((facts, context),) = seen
    assert facts.config["num_hidden_layers"] == 4 and facts.weights_bytes is None  # tiny: built, not read from disk
    tok = M.load_tokenizer(R.to_run_config(compose(*small, hydra_node=False)))
    words = len(tok("Now divide that by 3.", add_special_tokens=False)["input_ids"])
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 times 7?"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)  # (dataset.enable_thinking)
    first = len(tok(text, add_special_tokens=False)["input_ids"])
    assert context == first + words + 2 * 8
    R.configure(compose(*small, hydra_node=False))
    assert len(seen) == 1  # concurrency=1: nothing more to check


@pytest.mark.slow  # a CLI sweep of two jobs (~30 s on a busy CPU)
def test_a_concurrency_sweep_is_a_normal_sweep(cli, tmp_path, small):
    """`concurrency=1,2 -m`: two jobs (their own identities, not one skipped as the other), the same outputs, and a
    sweep table with a concurrency column beside the total tok/s and latency."""
    sweep = tmp_path / "sweep"
    proc = cli(*small, "concurrency=1,2", f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["concurrency"] for s in summaries] == [1, 2] and summaries[0]["config_hash"] != summaries[1]["config_hash"]
    outs = [[r["output_ids"] for r in _samples(sweep / str(i) / "samples.jsonl")] for i in (0, 1)]
    assert outs[0] == outs[1]
    table = proc.stdout[proc.stdout.index(f"sweep {sweep}"):].splitlines()
    assert {"concurrency", "total", "latency"} <= set(table[1].split())


@pytest.mark.slow  # the toy hybrid pair at concurrency 4 (~1 min on 2 shared cores); fast: the tiny pair batched
# through the CLI (above), hybrid targets batched in process (tests/test_batch.py, tests/test_gdn_batch.py)
def test_the_default_toy_job_batched_is_lossless_through_the_cli(cli, tmp_path):
    """`python -m ddtree.run concurrency=4` with every other setting at its default (the shipped hybrid toy pair,
    method=ddtree, budget 64, fp32): every output exact, both roles' throughput recorded (speed: make bench)."""
    job = tmp_path / "job"
    proc = cli("concurrency=4", f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((job / "summary.json").read_text())
    assert s["concurrency"] == 4 and s["match_rate"] == 1.0 and s["validation"]["suspect"] == 0
    assert s["throughput_tok_s"] > 0 and s["baseline"]["throughput_tok_s"] > 0 and s["tau"] > 2
