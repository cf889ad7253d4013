"""Muse-Glimmer as a target (docs/targets.md), and the drafters' block embeddings as the public code makes them (the raw
rows of the target's input embedding matrix times `input_embedding_scale`; docs/dflash2.md).

Muse-Glimmer loads as `MuseGlimmerForConditionalGeneration` (image-text-to-text only): its text layers slide (window 8
in the tiny model) beside a NoPE full-attention layer, its logits are multiplied and soft-capped, and its embedding
module adds a weight-less RMSNorm after the lookup, which the drafters must not see.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from sampling_support import assert_first_two_tokens_follow, exact_joint

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.drafter.dflash2 import DFlash2Drafter
from ddtree.engine.families import FAMILIES, family
from ddtree.engine.methods import family_methods
from ddtree.errors import ConfigError
from ddtree.testing.dflash2 import save_random_dflash2
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _target(vocab: int = 12, seed: int = 2):
    return tiny_model("muse_glimmer", seed=seed, attn_implementation="sdpa", vocab_size=vocab)


def _drafters(target):
    text = target.config.get_text_config()
    return (DFlashDrafter.random_for_target(text, block_size=8, seed=1, num_layers=1),
            DFlash2Drafter.random_for_target(text, block_size=8, seed=1, num_layers=1, selector_top_k=4,
                                             selector_rank=8))


def _prompts(vocab: int, lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]


def test_the_tiny_target_is_the_wrapper_with_its_layers_cap_and_normed_embedding():
    from transformers import MuseGlimmerForConditionalGeneration

    target = _target()
    text = target.config.get_text_config()
    assert type(target) is MuseGlimmerForConditionalGeneration and "muse_glimmer" in FAMILIES
    assert family_methods("muse_glimmer") == family_methods("qwen3") and family("muse_glimmer").embeds_more  # an attention family
    assert text.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and text.sliding_window == 8
    assert text.layer_rope_theta[-1] == 0 and text.layer_rope_theta[0] > 0  # the full-attention layer is NoPE
    assert text.output_multiplier != 1 and text.final_logit_softcapping > 0
    ids = torch.tensor([[1, 5, 2]])
    embedding = target.get_input_embeddings()
    assert not torch.allclose(embedding(ids), embedding.weight[ids])  # the module does more than a lookup


@pytest.mark.parametrize("vocab", [12, 64])
def test_every_method_equals_hf_greedy_in_fp32(vocab):
    """AR, DFlash, DDTree (a DFlash drafter), and the DFlash2 chain and DDTree under both scorings; vocabulary 12
    accepts drafts deep, past the window of 8."""
    target = _target(vocab)
    dflash, dflash2 = _drafters(target)
    cases = [(dflash, "ar", None, None), (dflash, "dflash", None, None), (dflash, "ddtree", 16, None),
             (dflash2, "dflash", None, None), (dflash2, "ddtree", 16, "marginal"), (dflash2, "ddtree", 16, "pair")]
    deepest = 0
    for ids in _prompts(vocab, (1, 11)):
        ref = hf_greedy(target, ids, 20)
        for drafter, method, budget, scoring in cases:
            out = ddtree.generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=20,
                                  scoring=scoring)
            assert out.output_ids == ref, (vocab, method, budget, scoring, ids.shape[1])
            deepest = max(deepest, max(out.acceptance_lengths, default=1))
    assert vocab != 12 or deepest >= 3


def test_verification_reads_the_multiplied_capped_logits():
    """The engine's target logits (prefill and a verified chain) are the wrapper's own: times output_multiplier, then
    soft-capped; not the head's raw logits, whose argmax agrees (so greedy outputs alone would not show it)."""
    from ddtree.engine.target import TargetSession
    from ddtree.engine.tree import chain_tree

    target = _target(64)
    text = target.config.get_text_config()
    ids = _prompts(64, (11,))[0]
    with torch.inference_mode():
        out = target(ids, output_hidden_states=True)
        raw = target.get_output_embeddings()(out.hidden_states[-1])[0]
    cap, mult = text.final_logit_softcapping, text.output_multiplier
    torch.testing.assert_close(out.logits[0], torch.tanh(raw * mult / cap) * cap)
    session = TargetSession(target)
    last, _ = session.prefill(ids[:, :6])
    verified, _ = session.verify(chain_tree(ids[0, 6], ids[0, 7:]))
    torch.testing.assert_close(last, out.logits[0, 5])
    torch.testing.assert_close(verified, out.logits[0, 6:])
    assert not torch.allclose(verified, raw[6:], atol=1e-3)


def _drafter_calls(drafter) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Record what the engine hands the drafter's forward as the block's embeddings, and its hidden states out."""
    seen: list[torch.Tensor] = []
    hidden: list[torch.Tensor] = []
    drafter.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    drafter.register_forward_hook(lambda module, args, out: hidden.append(out.detach().clone()))
    return seen, hidden


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_drafter_sees_the_raw_rows_times_the_scale(kind):
    """The block [anchor, mask, ...] reaches the drafter as rows of the embedding matrix (not the module's normed
    output), times input_embedding_scale; the scale changes the drafts (the drafter's hidden states and the records of
    its probabilities), not the output."""
    target = _target(64)
    drafter = _drafters(target)[kind == "dflash2"]
    scaled = copy.deepcopy(drafter)
    scaled.config.input_embedding_scale = 2.0
    weight = target.get_input_embeddings().weight
    ids = _prompts(64, (11,))[0]
    ref = hf_greedy(target, ids, 12)
    method = "dflash" if kind == "dflash2" else "ddtree"
    hidden, records = {}, {}
    for name, d in (("plain", drafter), ("scaled", scaled)):
        seen, out_hidden = _drafter_calls(d)
        out = ddtree.generate(target, d, ids, method=method, budget=8, max_new_tokens=12, record=True)
        assert out.output_ids == ref and seen, name
        block = torch.tensor([[out.output_ids[0]] + [d.mask_token_id] * (d.block_size - 1)])  # the first round's
        expected = weight[block] * (2.0 if name == "scaled" else 1.0)
        torch.testing.assert_close(seen[0], expected, rtol=0, atol=0)
        assert not torch.allclose(seen[0], target.get_input_embeddings()(block))  # not the normed module's output
        hidden[name], records[name] = out_hidden[0], out.diagnosis
    assert not torch.allclose(hidden["plain"], hidden["scaled"])  # the first round's draft, same context
    assert records["plain"] != records["scaled"]


def test_the_scale_round_trips_and_bad_values_are_refused(tmp_path):
    target = _target(64)
    d = DFlashDrafter.random_for_target(target.config.get_text_config(), block_size=8, seed=1, num_layers=1)
    d.config.input_embedding_scale = 2.0
    d.save_pretrained(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["dflash_config"]["input_embedding_scale"] == 2.0
    assert DFlashDrafter.from_pretrained(tmp_path / "d").config.input_embedding_scale == 2.0
    for bad in (0, -1.0, float("inf"), "2"):
        raw["dflash_config"]["input_embedding_scale"] = bad
        (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ConfigError, match="input_embedding_scale: must be a finite number > 0") as err:
            DFlashDrafter.from_pretrained(tmp_path / "d")
        assert "\n" not in str(err.value)
    raw["dflash_config"].pop("input_embedding_scale")
    raw["input_embedding_scale"] = 3.0  # at the top level (z-lab reads dflash_config first, then the top level)
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    assert DFlashDrafter.from_pretrained(tmp_path / "d").config.input_embedding_scale == 3.0


@pytest.mark.slow  # 400 generations (~20 s on 2 shared cores)
def test_sampling_follows_the_capped_target():
    """T = 1: the first two tokens follow the wrapper's own logits (multiplied, soft-capped): chi-square. The
    multiplier and cap are set so that the cap binds (on about half the logits) and the distribution is peaked enough
    for the test (the real 0.196 and 20 leave a tiny random model's 144 pairs near uniform, every cell sparse)."""
    target = tiny_model("muse_glimmer", seed=2, attn_implementation="sdpa", vocab_size=12, output_multiplier=20.0,
                        final_logit_softcapping=2.0)
    drafter = _drafters(target)[0]
    ids = torch.tensor([[1, 5, 2, 7]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        raw = target.get_output_embeddings()(out.hidden_states[-1])[0, -1] * 20.0
    assert (raw.abs() > 2.0).float().mean() > 0.3 and out.logits.abs().max() < 2.0  # the cap binds
    g = torch.Generator().manual_seed(11)
    assert_first_two_tokens_follow(
        lambda: ddtree.generate(target, drafter, ids, method="ddtree", budget=7, temperature=1.0, max_new_tokens=3,
                                generator=g), exact_joint(target, ids), 400)


def _sweep(cli, tmp_path, *args) -> list[dict]:
    sweep = tmp_path / "sweep"
    proc = cli("model=tiny_muse_glimmer", "dataset=tiny", "max_new_tokens=16", "tracking=none", *args,
               f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]


def _exact(s: dict) -> bool:
    """Equal to the AR baseline, and every output exact under the target's teacher-forced forward."""
    v = s["validation"]
    return s["match_rate"] == 1.0 and v["suspect"] == 0 and v.get("exact") == v["checked"] > 0


def test_cli_runs_every_method_on_a_tiny_muse_glimmer(cli, tmp_path):
    """`python -m ddtree.run model=tiny_muse_glimmer` with default settings (its random DFlash drafter, attention=auto,
    budget 64): AR, DFlash and DDTree."""
    got = _sweep(cli, tmp_path, "method=ar,dflash,ddtree", "dataset.max_samples=2")
    assert sorted(s["method"] for s in got) == ["ar", "ddtree", "dflash"]
    assert all(_exact(s) for s in got if s["method"] != "ar"), [s["validation"] for s in got]


@pytest.mark.slow  # a three-job CLI sweep; fast: every method through the CLI (above), a DFlash2 drafter's scaled
# rows in process (test_the_drafter_sees_the_raw_rows_times_the_scale)
def test_cli_runs_a_dflash2_checkpoint_on_a_tiny_muse_glimmer(cli, tmp_path):
    """A DFlash2 checkpoint for the tiny Muse-Glimmer: its chain and DDTree under both scorings (the default, auto:
    pair over a DFlash2 drafter; budget 64)."""
    d = save_random_dflash2(tiny_model("muse_glimmer", seed=0), tmp_path / "drafter2", seed=4)
    got = _sweep(cli, tmp_path, "drafter=dflash2", f"drafter.name_or_path={d}", "method=dflash,ddtree",
                 "scoring=auto,marginal", "dataset.max_samples=1")
    assert sorted((s["method"], s.get("scoring")) for s in got) == [("ddtree", "marginal"), ("ddtree", "pair"),
                                                                    ("dflash", None)]
    assert all(_exact(s) for s in got), [s["validation"] for s in got]


@pytest.mark.parametrize("case", ["muse_glimmer", "scale"])
def test_cli_refuses_the_authors_code_where_it_would_embed_otherwise(cli, tmp_path, case):
    """engine=upstream calls the target's embedding module, unscaled: refused on Muse-Glimmer (its module adds a norm)
    and for a drafter with input_embedding_scale, in one line before any model work."""
    checkout = tmp_path / "checkout"  # the authors' layout (nothing is imported before the refusal)
    for name in ("ddtree.py", "dflash.py", "model/__init__.py"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text("")
    if case == "scale":
        d = DFlashDrafter.random_for_target(tiny_model("qwen3").config, block_size=8, num_layers=1)
        d.config.input_embedding_scale = 2.0
        d.save_pretrained(tmp_path / "scaled")
        args = ("model=tiny_qwen3", "drafter=pretrained", f"drafter.name_or_path={tmp_path / 'scaled'}")
    else:
        args = ("model=tiny_muse_glimmer",)
    proc = cli(*args, "dataset=tiny", "method=ddtree", "engine=upstream", "tracking=none",
               f"upstream.path={checkout}", f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'job'}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    expected = "adds a norm the drafter never saw" if case == "muse_glimmer" else "scales its input embeddings by 2.0"
    assert len(lines) == 1 and lines[0].startswith("error: engine: ") and expected in lines[0], proc.stderr


def test_a_transformers_without_muse_glimmer_refuses_it_in_one_line(monkeypatch):
    """An older transformers (the device image's 5.17) has no muse_glimmer: refused before any model work."""
    from transformers.models.auto import modeling_auto

    from ddtree.pipeline.preflight import target_facts

    monkeypatch.delitem(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "muse_glimmer")
    cfg = {"model_type": "muse_glimmer", "text_model_type": "muse_glimmer_text"}
    with pytest.raises(ConfigError, match="does not have") as err:
        target_facts(cfg, "model.name_or_path", "ddtree", False)
    assert "\n" not in str(err.value) and "upgrade transformers" in str(err.value)
