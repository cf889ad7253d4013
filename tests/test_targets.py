"""The targets users run: every family a published DFlash drafter serves, attention=auto, quantized checkpoints.

Each family is a tiny random model of its real transformers class (ddtree.engine.families: sliding windows of 8,
shorter than a prompt plus a tree; gpt-oss with learned sinks of a real spread), on the backend attention=auto picks
for it on this device; every method equals HF greedy decoding in fp32, and in bf16 no output is suspect. A quantized
target is checked against HF greedy of the same quantized model (docs/targets.md).
"""

from __future__ import annotations

import json

import pytest
import torch

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.families import FAMILIES, family
from ddtree.engine.methods import family_methods
from ddtree.engine.output_check import ValidationRule, Validator
from ddtree.pipeline.preflight import auto_attention, flat_config
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# the families a published DFlash drafter serves (transformers 5.25 has no `kimi_k2` type: Kimi-K2's text model is a
# deepseek_v3, and kimi_k25 is a multimodal wrapper of one)
SERVED = ("gpt_oss", "gemma3_text", "gemma4_text", "qwen3_moe", "minimax_m2", "deepseek_v3", "laguna", "glm4_moe")
METHODS = (("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 64))


def _auto(name: str) -> str:
    return auto_attention(flat_config(tiny_config(name).to_dict()), "cpu", "float32")


def _pair(name: str, vocab: int, dtype=torch.float32, seed: int = 2):
    target = tiny_model(name, seed=seed, attn_implementation=_auto(name), vocab_size=vocab, dtype=dtype)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=8, seed=1, num_layers=1).to(dtype)
    return target, drafter


def _prompts(vocab: int, lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]


def test_the_served_families_are_table_rows_with_their_traits():
    for name in SERVED:
        row = family(name)
        assert name in FAMILIES and row.traits and "ddtree" in family_methods(name), name
    assert family("gpt_oss").sinks and sum(r.sinks for r in FAMILIES.values()) == 1
    windows = {n: tiny_config(n) for n in SERVED if family(n).sliding_every}
    assert set(windows) == {"gpt_oss", "gemma3_text", "gemma4_text", "laguna"}
    for name, cfg in windows.items():  # both layer kinds, and a window shorter than a prompt plus a tree
        assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types) and cfg.sliding_window == 8, name


def test_attention_auto_takes_sdpa_where_the_class_does_and_eager_for_sinks():
    assert {n: _auto(n) for n in SERVED} == {n: ("eager" if n == "gpt_oss" else "sdpa") for n in SERVED}
    assert _auto("qwen3") == "sdpa" and auto_attention(None, "cpu", "float32") == "sdpa"
    # on CUDA without a flash kernel that takes sinks (none installed here) gpt-oss stays on eager
    assert auto_attention(flat_config(tiny_config("gpt_oss").to_dict()), "cuda", "bfloat16") == "eager"
    sinks = [p for n, p in tiny_model("gpt_oss").named_parameters() if n.endswith("sinks")]
    assert sinks and all(p.abs().max() > 0.5 for p in sinks)  # real sinks, not ~0


def test_the_attention_line_names_the_backends_that_run():
    """The drafter's backend is printed for a DFlash drafter; the MTP head has no setting of its own (the target's
    backend where its layer runs it, else sdpa); AR has no drafter."""
    from ddtree.pipeline.preflight import attention_backends, attention_line
    from ddtree.pipeline.schema import RunConfig

    cases = {("dflash", "sdpa"): ("target sdpa, drafter eager (auto: target, drafter)", "eager"),
             ("mtp", "sdpa"): ("target sdpa, MTP head sdpa (auto: target)", "sdpa"),
             ("mtp", "eager"): ("target eager, MTP head eager (auto: target)", "eager"),
             ("mtp", "flash_attention_2"): ("target flash_attention_2, MTP head sdpa (auto: target)", "sdpa"),
             ("ar", "sdpa"): ("target sdpa (auto: target)", None)}
    for (method, target), (line, drafter) in cases.items():
        rc = RunConfig(method=method)
        rc.attention.target, rc.attention.drafter = target, "eager"
        rc.tags = {"ddtree.attention_auto": "target, drafter"}
        assert attention_line(rc) == line
        assert attention_backends(rc) == {"target": target, "drafter": drafter}


@pytest.mark.parametrize("name", SERVED)
def test_served_family_every_method_equals_hf_greedy(name):
    """The fp32 grid's fast row: a prompt longer than the window, 20 tokens, every method and budget."""
    target, drafter = _pair(name, vocab=64)
    for ids in _prompts(64, (11,)):
        ref = hf_greedy(target, ids, 20)
        for method, budget in METHODS:
            out = ddtree.generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=20)
            assert out.output_ids == ref, (name, method, budget)


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("vocab", [12, 128])
def test_served_family_grid_fp32(name, vocab):
    """The fp32 lossless grid: 3 prompt lengths around the window, two vocabularies (12: deep acceptances)."""
    target, drafter = _pair(name, vocab=vocab)
    deepest = 0
    for ids in _prompts(vocab, (1, 6, 19)):
        ref = hf_greedy(target, ids, 32)
        for method, budget in (*METHODS, ("ddtree", 4)):
            out = ddtree.generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=32)
            assert out.output_ids == ref, (name, vocab, method, budget, ids.shape[1])
            deepest = max(deepest, max(out.acceptance_lengths, default=1))
    if vocab == 12:
        assert deepest >= 3  # trees accepted deeper than the window's edge moves


def _assert_no_suspect(target, drafter, prompts, new: int, budget: int, label: str) -> None:
    """bf16: every DFlash and DDTree output exact or a tie against HF greedy under the verdicts (docs/validation.md)."""
    base = [hf_greedy(target, p, new) for p in prompts]
    v = Validator(target, max_new_tokens=new, rule=ValidationRule(calibration_outputs=2))
    v.calibrate(zip(prompts, base, strict=True))
    for method, b_ in (("dflash", None), ("ddtree", budget)):
        for p, b in zip(prompts, base, strict=True):
            out = ddtree.generate(target, drafter, p, method=method, budget=b_, max_new_tokens=new).output_ids
            assert v.verdict(p, out, b).verdict in ("exact", "tie"), (label, method)


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVED)
def test_served_family_bf16_verdicts(name):
    """bf16: exact equality is no test (ties); every output is exact or a tie, none suspect (docs/validation.md)."""
    target, drafter = _pair(name, vocab=300, dtype=torch.bfloat16, seed=1)
    prompts = _prompts(300, (5, 13, 21))
    _assert_no_suspect(target, drafter, prompts, 40, 32, name)


def test_gpt_oss_bf16_tree_verification_keeps_the_modules_sink_arithmetic():
    """A float32 merge of the sink (the split parts) against the eager module's bf16 softmax over [logits, sink] made a
    suspect output here; the module's own eager function over one mask keeps DDTree equal to greedy."""
    target, drafter = _pair("gpt_oss", vocab=300, dtype=torch.bfloat16, seed=1)
    ids = _prompts(300, (5,))[0]
    ref = hf_greedy(target, ids, 40)
    out = ddtree.generate(target, drafter, ids, method="ddtree", budget=32, max_new_tokens=40).output_ids
    assert out == ref


def _cli_job(cli, small, tmp_path, *overrides: str):
    """(stdout, summary.json) of one small job through `python -m ddtree.run`, with AR's outputs all matched."""
    job = tmp_path / "job"
    proc = cli(*small, *overrides, "budget=16", "tracking=none", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["match_rate"] == 1.0
    return proc.stdout, summary


@pytest.mark.slow  # fast: attention=auto's choice for gpt-oss and its line in process (above)
def test_gpt_oss_runs_through_the_cli_with_the_default_attention(cli, small, tmp_path):
    """No attention override: attention=auto picks eager for gpt-oss (sdpa is refused by its class) and says so."""
    out, summary = _cli_job(cli, small, tmp_path, "model.tiny.model_type=gpt_oss", "model.name=tiny_gpt_oss")
    assert "attention: target eager, drafter sdpa (auto: target, drafter)" in out
    assert summary["attention"]["target"] == "eager"


# ---------------------------------------------------------------- quantized targets

TOY = "assets/toy"
QUANTIZED = {"torchao_int8": "int8", "quanto_int8": "quanto_int8"}


def _toy_quantized(preset: str):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from ddtree.pipeline.quantization import transformers_config

    root = Path(__file__).resolve().parents[1] / TOY
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32,
                                                  quantization_config=transformers_config("t", preset)).eval()
    return target, DFlashDrafter.from_pretrained(root / "drafter"), root


@pytest.mark.parametrize("backend", ["torchao_int8", pytest.param("quanto_int8", marks=pytest.mark.slow)])
def test_quantized_toy_target_every_method_equals_hf_greedy_of_itself(backend):
    """torchao int8 weight-only (tensor-subclass weights in nn.Linear) and quanto int8 (QLinear): the engine calls
    every quantized projection (the tree-exact GDN included) and each method equals HF greedy of the same model."""
    pytest.importorskip("torchao" if backend.startswith("torchao") else "optimum.quanto")
    from transformers import AutoTokenizer

    from ddtree.engine.gdn import layer_consts
    from ddtree.engine.weights import plain_linear
    from ddtree.pipeline.prompts import encode, read_jsonl

    target, drafter, root = _toy_quantized(QUANTIZED[backend])
    gdn = target.model.layers[0].linear_attn
    assert not plain_linear(gdn.in_proj_a) and layer_consts(gdn).ab_weight is None  # called, not concatenated
    tok = AutoTokenizer.from_pretrained(root / "target")
    for prompt in read_jsonl(root / "prompts.jsonl")[:2]:
        ids = torch.tensor([encode(tok, [{"role": "user", "content": prompt.turns[0]}], chat_template=True)])
        ref = hf_greedy(target, ids, 32)
        for method, budget in (*METHODS, ("mtp", None)):
            out = ddtree.generate(target, None if method == "mtp" else drafter, ids, method=method, budget=budget,
                                  max_new_tokens=32)
            assert out.output_ids == ref, (backend, method, budget)
            assert method in ("ar",) or out.tau > 1.5, (backend, method, out.tau)  # the trained pair still drafts


@pytest.mark.slow
def test_quantized_toy_target_in_bf16_has_no_suspect_output():
    """torchao int8 weights, bf16 activations: every DFlash and DDTree output exact or a tie under the verdicts."""
    pytest.importorskip("torchao")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddtree.pipeline.prompts import encode, read_jsonl
    from ddtree.pipeline.quantization import transformers_config

    _, drafter, root = _toy_quantized("int8")
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.bfloat16,
                                                  quantization_config=transformers_config("t", "int8")).eval()
    drafter = drafter.to(torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(root / "target")
    prompts = [torch.tensor([encode(tok, [{"role": "user", "content": p.turns[0]}], chat_template=True)])
               for p in read_jsonl(root / "prompts.jsonl")[:3]]
    _assert_no_suspect(target, drafter, prompts, 48, 16, "int8")


@pytest.mark.parametrize("overrides,problem", [
    (("model.quantization=fp8",), "runs on cuda only"),
    (("model.quantization=nf4",), "runs on cuda only"),
    (("model.quantization=int3",), "unknown quantization preset 'int3'"),
    (("model.quantization={quant_method:hqq,nbits:4}",), "pip install hqq"),
    (("model.quantization={quant_method:quanto,weights:int9}",), "transformers cannot build a quanto config"),
    (("model.quantization={weights:int8}",), "a mapping with quant_method"),
    (("drafter.quantization=nf4", "method=dflash"), "cannot quantize"),
])
def test_quantization_settings_are_refused_before_model_work(overrides, problem, compose):
    from ddtree.errors import ConfigError
    from ddtree.pipeline.config_checks import validate

    pytest.importorskip("torchao")
    with pytest.raises(ConfigError, match=problem) as e:
        validate(compose("device=cpu", *overrides))
    assert e.value.setting.endswith(".quantization") and "\n" not in str(e.value)
    validate(compose("device=cpu", "model.quantization=int8", "drafter.quantization=quanto_int8"))


@pytest.mark.slow  # fast: an int8 target through the CLI (the diagnosis sweep below, which checks the same line and
# summary), the hybrid toy in int8 in process, the refusals in process and quanto_int4's through the CLI
def test_a_quantized_tiny_target_runs_through_the_cli(cli, small, tmp_path):
    pytest.importorskip("torchao")
    out, summary = _cli_job(cli, small, tmp_path, "model=tiny_qwen3_5", "model.quantization=int8")
    assert "quantization: target int8, drafter its own precision" in out
    assert summary["quantization"] == {"target": "int8", "drafter": None}
    bad = cli(*small, "model.quantization=fp8", "tracking=none", f"hydra.run.dir={tmp_path / 'bad'}")
    assert bad.returncode == 2 and "model.quantization" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


RUN_ON_CPU = {"int8", "quanto_int8"}  # the presets run through the CLI on a CPU by the tests here


def test_every_preset_runs_on_the_cpu_or_is_refused_in_one_line(compose):
    """The presets the docs list: each one either is refused on a CPU in one line before model work (and why), or is
    one a CLI test here runs on a CPU (RUN_ON_CPU); a new preset that validates must join that set."""
    from ddtree.errors import ConfigError
    from ddtree.pipeline.config_checks import validate
    from ddtree.pipeline.quantization import PRESETS

    pytest.importorskip("torchao")
    pytest.importorskip("optimum.quanto")
    accepted = set()
    for preset in PRESETS:
        try:
            validate(compose("device=cpu", f"model.quantization={preset}"))
            accepted.add(preset)
        except ConfigError as e:
            assert e.setting == "model.quantization" and "\n" not in str(e)
    assert accepted == RUN_ON_CPU
    with pytest.raises(ConfigError, match="inference_mode"):  # quanto int4 failed in every method, AR included
        validate(compose("device=cpu", "model.quantization={quant_method:quanto,weights:int4}"))


def test_quanto_int4_is_refused_through_the_cli_in_one_line(cli, small, tmp_path):
    bad = cli(*small, "model.quantization=quanto_int4", "tracking=none", f"hydra.run.dir={tmp_path / 'bad'}")
    assert bad.returncode == 2 and "inference_mode" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_quanto_int8_runs_through_the_cli(cli, small, tmp_path):
    pytest.importorskip("optimum.quanto")
    _, summary = _cli_job(cli, small, tmp_path, "model=tiny_qwen3_5", "model.quantization=quanto_int8")
    assert summary["quantization"] == {"target": "quanto_int8", "drafter": None}


def test_the_diagnosis_shows_a_quantized_job_beside_the_unquantized_one(cli, small, tmp_path):
    """A sweep over model.quantization: diagnosis.md puts the quantized job's tau next to the unquantized one's."""
    pytest.importorskip("torchao")
    sweep = tmp_path / "sweep"
    proc = cli(*small, "max_new_tokens=10", "budget=4", "tracking=none", "model.quantization=null,int8",
               f"hydra.sweep.dir={sweep}",
               "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quantization: target int8, drafter its own precision" in proc.stdout
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted((s["quantization"] for s in summaries), key=lambda q: q["target"] or "") == [
        {"target": None, "drafter": None}, {"target": "int8", "drafter": None}]
    assert all(s["match_rate"] == 1.0 for s in summaries)
    import subprocess
    import sys

    diag = subprocess.run([sys.executable, "-m", "ddtree.diagnose", str(sweep)], capture_output=True, text=True,
                          timeout=300)
    assert diag.returncode == 0, diag.stderr[-2000:]
    doc = json.loads((sweep / "diagnosis.json").read_text())
    assert [(q["quantization"], q["unquantized"]) for q in doc["quantized"]] == [("target int8", "0")]
    assert "Quantized: 1 (target int8) tau" in (sweep / "diagnosis.md").read_text()
