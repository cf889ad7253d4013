"""method=eagle3: an EAGLE-3 drafter (the public checkpoint layout) as a chain and as an EAGLE-2 dynamic tree.

References: HF greedy `generate` (lossless), a from-scratch recomputation of the drafter's chain (no cache kept, one
causal pass: tests/eagle3_support.py: reference_draft_logits), the exact two-token joint at T > 0 (chi-square), and
the layout SGLang's and vLLM's loaders read (docs/eagle3.md).
"""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_support import fitted_drafter, greedy_rows, reference_draft_logits, rewrite_checkpoint
from safetensors.torch import load_file
from sampling_support import assert_first_two_tokens_follow, exact_joint
from torch._dynamo.utils import counters

import ddtree
from ddtree.engine.drafter.eagle3 import Eagle3Drafter, Eagle3Proposer
from ddtree.engine.loop import Engine
from ddtree.errors import ConfigError
from ddtree.testing.reference import eagle_tree_reference, hf_greedy, tree_paths
from ddtree.tiny import tiny_model

_PAIRS: dict = {}


def pair(model_type: str, vocab_size: int = 128, draft_vocab_size: int = 96):
    """A tiny target and an EAGLE-3 drafter fitted to its greedy outputs (drafts get accepted several deep)."""
    key = (model_type, vocab_size)
    if key not in _PAIRS:
        target = tiny_model(model_type, seed=0, vocab_size=vocab_size)
        _PAIRS[key] = target, fitted_drafter(target, seed=1, draft_vocab_size=draft_vocab_size)
    return _PAIRS[key]


def _prompts(target, n: int = 3) -> list[torch.Tensor]:
    """Two of the prompts the drafter was fitted on (long accepted paths) and random ones."""
    rows = greedy_rows(target, seed=1)
    g = torch.Generator().manual_seed(7)
    return [rows[i:i + 1, :6] for i in range(2)] + [torch.randint(3, 128, (1, 9), generator=g) for _ in range(n - 2)]


GRID = [(1, 64), (3, 12), (2, 5)]  # (topk, budget): the chain, a tree, a tree cut by its budget


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_chain_and_trees_equal_hf_greedy(model_type):
    target, drafter = pair(model_type)
    accepted = 0
    for topk, budget in GRID:
        with Engine(target, drafter, method="eagle3", steps=3, topk=topk, budget=budget, compile="false") as engine:
            assert engine.proposer.max_nodes == (4 if topk == 1 else budget + 1)
            for ids in _prompts(target):
                r = engine.generate(ids, max_new_tokens=32)
                assert r.output_ids == hf_greedy(target, ids, 32), (topk, budget)
                accepted += sum(a - 1 for a in r.acceptance_lengths)
    assert accepted > 30  # drafts were accepted, several deep: the draft layer's cache was rolled back


def test_chain_drafts_equal_the_from_scratch_drafter():
    """Every round's chain is the draft layer applied recursively, recomputed without a cache over everything
    committed: the layer's KV cache across rounds, its roll-back after drafting and the positions are right."""
    target, drafter = pair("qwen3")
    rounds = []

    class Recording(Eagle3Proposer):
        def propose(self, state):
            tree = super().propose(state)
            rounds.append((state.input_ids[0].tolist() + list(state.generated), tree.tokens[1:].tolist()))
            return tree

    ids = _prompts(target)[0]
    r = ddtree.generate(target, None, ids, method="eagle3", proposer=Recording(target, drafter, steps=3),
                        max_new_tokens=24)
    assert any(a > 2 for a in r.acceptance_lengths) and len(rounds) > 3
    for committed, drafts in rounds:
        for j, tok in enumerate(drafts):
            assert int(reference_draft_logits(target, drafter, committed, drafts[:j]).argmax()) == tok


@pytest.mark.parametrize("budget", [6, 64])  # the best nodes; all of them
def test_tree_drafts_equal_the_from_scratch_drafter(budget):
    """The EAGLE-2 tree: every node's children are the top-k of the drafter along the node's own path (recomputed
    from scratch per path; only draft-vocabulary ids), the frontier the k best by cumulative log-probability, the
    kept nodes the `budget` best."""
    target, drafter = pair("llama")
    k, steps, rounds = 2, 3, []

    class Recording(Eagle3Proposer):
        def propose(self, state):
            tree = super().propose(state)
            rounds.append((state.input_ids[0].tolist() + list(state.generated), tree))
            return tree

    prop = Recording(target, drafter, steps=steps, topk=k, budget=budget)
    ddtree.generate(target, None, _prompts(target)[1], method="eagle3", proposer=prop, max_new_tokens=16)
    for committed, tree in rounds[:3]:
        want = eagle_tree_reference(lambda path, c=committed: reference_draft_logits(target, drafter, c, path),
                                    k, steps, budget)
        assert all(bool(drafter.t2d[t]) for path in want for t in path)  # draft-vocabulary ids only
        got = tree_paths(tree)
        assert sorted(got) == sorted(want)
        for path, score in want.items():
            assert abs(got[path] - score) < 1e-4, path


def test_checkpoint_round_trip_in_the_public_layout(tmp_path):
    target, drafter = pair("llama")
    d = drafter.save_pretrained(tmp_path / "eagle3")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 96
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["num_hidden_layers"] == 1
    state = load_file(str(d / "model.safetensors"))
    h = target.config.hidden_size
    assert state["fc.weight"].shape == (h, 3 * h) and state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert state["lm_head.weight"].shape == (96, h) and state["d2t"].shape == (96,) and state["t2d"].shape == (128,)
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight"} <= set(state)
    assert "embed_tokens.weight" not in state  # the target's are read
    ids = _prompts(target)[0]
    want = ddtree.generate(target, drafter, ids, method="eagle3", topk=2, budget=6, max_new_tokens=16)
    for name, folder in (("public", d), ("vllm names", rewrite_checkpoint(d, tmp_path / "v", rename={
            "midlayer.": "model.layers.0."}))):
        back = Eagle3Drafter.from_pretrained(folder)
        for k, v in drafter.checkpoint_state().items():
            assert torch.equal(back.checkpoint_state()[k], v), (name, k)
        got = ddtree.generate(target, back, ids, method="eagle3", topk=2, budget=6, max_new_tokens=16)
        assert got.output_ids == want.output_ids and got.acceptance_lengths == want.acceptance_lengths, name
    # a checkpoint with embeddings of its own drafts with them (not the target's)
    own = rewrite_checkpoint(d, tmp_path / "own", tensors={"embed_tokens.weight": torch.randn(128, h)})
    back = Eagle3Drafter.from_pretrained(own).bind(target)
    assert back.embed_tokens is not None and not torch.equal(back.embed(ids), target.get_input_embeddings()(ids))
    r = ddtree.generate(target, back, ids, method="eagle3", max_new_tokens=16)
    assert r.output_ids == hf_greedy(target, ids, 16)


@pytest.mark.parametrize("change,words", [
    (dict(drop=("d2t",)), "has no d2t"),
    (dict(tensors={"fc.weight": torch.zeros(64, 128)}), "fc.weight is [64, 128]; EAGLE-3 fuses three"),
    (dict(config={"draft_vocab_size": 90}), "lm_head.weight is 96 rows"),
    (dict(tensors={"d2t": torch.full((96,), 500)}), "d2t maps draft ids outside"),
    (dict(config={"num_hidden_layers": 2}), "declares 2 draft layers"),
    (dict(config={"eagle_config": {"use_aux_hidden_state": False}}), "EAGLE-1/2 drafter"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}), "three layer ids"),
    (dict(drop=("midlayer.mlp.up_proj.weight",)), "missing midlayer.mlp.up_proj.weight"),
])
def test_malformed_checkpoints_are_refused_in_one_line(tmp_path, change, words):
    target = tiny_model("qwen3", seed=0)
    good = Eagle3Drafter.random_for_target(target, seed=2, draft_vocab_size=96).save_pretrained(tmp_path / "good")
    bad = rewrite_checkpoint(good, tmp_path / "bad", **change)
    with pytest.raises(ConfigError) as err:
        Eagle3Drafter.from_pretrained(bad)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("drafter.name_or_path: ") and words in msg, msg


def test_a_folder_without_weights_or_config_is_refused(tmp_path):
    good = Eagle3Drafter.random_for_target(tiny_model("qwen3", seed=0), seed=2).save_pretrained(tmp_path / "good")
    (good / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"^drafter.name_or_path: .* has no weights"):
        Eagle3Drafter.from_pretrained(good)
    (good / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"^drafter.name_or_path: .* has no config.json"):
        Eagle3Drafter.from_pretrained(good)


def test_a_drafter_made_for_another_target_is_refused():
    target = tiny_model("qwen3", seed=0)
    deep = Eagle3Drafter.random_for_target(tiny_model("qwen3", seed=0, num_hidden_layers=8), seed=2,
                                           aux_layer_ids=[1, 4, 7])
    with pytest.raises(ConfigError, match=r"^drafter: the EAGLE-3 drafter reads target layers \[1, 4, 7\]; the target "
                                          r"has 4"):
        Engine(target, deep, method="eagle3")
    wide = Eagle3Drafter.random_for_target(tiny_model("qwen3", seed=0, hidden_size=96, head_dim=24), seed=2)
    with pytest.raises(ConfigError, match=r"^drafter: the EAGLE-3 drafter fuses hidden states of width 96"):
        Engine(target, wide, method="eagle3")
    with pytest.raises(ConfigError, match=r"^drafter: method=eagle3 needs a drafter"):
        Engine(target, None, method="eagle3")
    with pytest.raises(ConfigError, match=r"^eagle3.topk: must be an integer >= 1"):
        Engine(target, Eagle3Drafter.random_for_target(target), method="eagle3", topk=0)


def test_the_default_aux_layers_are_the_serving_engines():
    """No aux ids in the checkpoint: (2, L // 2, L - 3) of the target's L layers, the hidden states before them."""
    target = tiny_model("llama", seed=0, num_hidden_layers=8)
    drafter = Eagle3Drafter.random_for_target(target, seed=3)
    assert drafter.config.aux_layer_ids is None and drafter.aux_layer_ids == [2, 4, 5]
    assert drafter.target_layer_ids == [1, 3, 4]  # ddtree.engine.target.context_features numbering: outputs of j - 1
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    r = ddtree.generate(target, drafter, ids, method="eagle3", topk=2, budget=8, max_new_tokens=12)
    assert r.output_ids == hf_greedy(target, ids, 12)


@pytest.mark.parametrize("backend", ["eager", pytest.param(None, id="inductor", marks=pytest.mark.slow)])
def test_the_compiled_draft_drafts_as_the_eager_one(backend, dynamo_clean):
    """compile=true: the round's verification and, from a generation's second round on, the draft (StaticMTP over the drafter's step: the
    drafter's own forward on a fixed buffer) are graphs; chain and trees equal HF greedy and the eager engine (same
    acceptance, same trees), without a recompile or a graph break (inductor: the chain only, as compile=true runs)."""
    target, drafter = pair("qwen3")
    g = torch.Generator().manual_seed(7)
    prompts = [_prompts(target)[0], torch.randint(3, 128, (1, 4), generator=g), torch.randint(3, 128, (1, 26),
                                                                                              generator=g)]
    for topk, budget in GRID[: 3 if backend else 1]:
        kw = dict(method="eagle3", steps=3, topk=topk, budget=budget)
        engine = Engine(target, drafter, compile="true", compile_backend=backend, **kw)
        eager = Engine(target, drafter, compile="false", **kw)
        assert engine.round == "compiled" and engine.round_note is None  # the draft compiled too
        engine.generate(prompts[1], max_new_tokens=12)
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for ids in prompts:
                (res, got), (ref, want) = _drafts(engine, ids), _drafts(eager, ids)
                assert res.output_ids == ref.output_ids == hf_greedy(target, ids, 24), (topk, budget)
                assert res.acceptance_lengths == ref.acceptance_lengths
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
        assert engine.static.draft.ready  # the later rounds drafted through the graph


def _drafts(engine, ids):
    """(the generation, the trees its proposer drafted)."""
    trees, propose = [], engine.proposer.propose
    engine.proposer.propose = lambda state: trees.append(propose(state)) or trees[-1]
    try:
        return engine.generate(ids, max_new_tokens=24), trees
    finally:
        del engine.proposer.propose


V, T, N = 12, 1.0, 600


@pytest.mark.slow  # ~15 s each here (4 cores), more on a shared 2-core CPU
@pytest.mark.parametrize("topk,budget", [(1, 64), (3, 8)])
def test_first_two_tokens_follow_target(topk, budget):
    """T > 0: the first two tokens are distributed as the target's exact joint (chi-square); the chain is verified
    by speculative sampling against the drafter's rows (zero outside its draft vocabulary), the tree by the walk."""
    target, drafter = pair("qwen3", vocab_size=V, draft_vocab_size=8)
    ids = torch.tensor([[1, 5, 2, 7]])
    probs = exact_joint(target, ids, T)
    engine = Engine(target, drafter, method="eagle3", steps=2, topk=topk, budget=budget)
    g = torch.Generator().manual_seed(11)
    assert_first_two_tokens_follow(lambda: engine.generate(ids, temperature=T, max_new_tokens=3, generator=g), probs, N)


# ---------------------------------------------------------------- through the CLI (python -m ddtree.run)

def test_report_and_sweep_table_name_the_eagle3_shape():
    from ddtree.pipeline.report import markdown_table
    from ddtree.pipeline.sweep_table import method_cell

    assert method_cell({"method": "eagle3", "eagle3": {"steps": 4, "topk": 2}}) == "eagle3 4x2"
    entry = {"speedup": 2.0, "tau": 3.0, "budget": 16, "verdicts": "4 ok"}
    cell = {"temperature": 0.0, "title": "toy", "model": "toy", "dflash": entry, "ddtree_best": entry,
            "ddtree": [entry], "gain": 1.0}
    best = {**entry, "speedup": 1.5, "shape": "eagle3 3x2 b8"}
    head, _, row = markdown_table([{**cell, "mtp": [best], "mtp_best": best}]).splitlines()[2:5]
    assert head.endswith("EAGLE3 speedup | EAGLE3 tau | EAGLE3 shape | EAGLE3 verdicts |")
    assert row.endswith("| 1.50x | 3.00 | eagle3 3x2 b8 | 4 ok |")


def test_cli_default_settings_run_a_random_drafter(cli, small, tmp_path):
    job = tmp_path / "job"
    proc = cli(*small, "method=eagle3", "tracking=none", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["method"], summary["eagle3"], summary["budget"], summary["match_rate"]) == (
        "eagle3", {"steps": 3, "topk": 1}, None, 1.0)
    assert "EAGLE-3 drafter sdpa" in proc.stdout


@pytest.mark.slow  # two CLI jobs; fast: the checkpoint round trip and the malformed ones refused in process (above),
# EAGLE-3 through the CLI with default settings (test_cli_default_settings_run_a_random_drafter)
def test_cli_loads_a_checkpoint_and_refuses_a_malformed_one(cli, tmp_path):
    common = ("model=tiny_llama", "dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8", "tracking=none",
              "method=eagle3", "drafter=pretrained", "eagle3.topk=2", "budget=4")
    target = tiny_model("llama", seed=0, vocab_size=128, num_hidden_layers=4)  # what model=tiny_llama builds
    good = Eagle3Drafter.random_for_target(target, seed=5, aux_layer_ids=[1, 2, 3]).save_pretrained(tmp_path / "e3")
    job = tmp_path / "job"
    proc = cli(*common, f"drafter.name_or_path={good}", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["eagle3"], summary["budget"], summary["match_rate"], summary["drafter"]) == (
        {"steps": 3, "topk": 2}, 4, 1.0, str(good))
    assert "eagle3 3x2" in proc.stdout  # the sweep table's method cell names its shape
    bad = rewrite_checkpoint(good, tmp_path / "bad", drop=("d2t",))
    proc = cli(*common, f"drafter.name_or_path={bad}", f"hydra.run.dir={tmp_path / 'b'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: drafter.name_or_path: ") and "has no d2t" in lines[0]
