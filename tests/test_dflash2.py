"""DFlash2 drafters: the public layout loaded, malformed checkpoints refused, the convolution and the selector
against from-scratch references, and every method over one lossless (fp32 greedy, T > 0 chi-square, the CLI)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from sampling_support import assert_first_two_tokens_follow, exact_joint

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.drafter.dflash2 import DFlash2Drafter
from ddtree.engine.selector import pair_logprobs, pair_tree, selector_walk
from ddtree.errors import ConfigError
from ddtree.testing.dflash2 import (
    conv_reference,
    pair_paths_reference,
    pair_score,
    save_random_dflash2,
    walk_reference,
)
from ddtree.testing.reference import hf_greedy, tree_paths
from ddtree.tiny import tiny_model

H, V = 64, 128  # the tiny targets' hidden size and vocabulary (conf/model/tiny_qwen3*.yaml)


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    return save_random_dflash2(target, tmp_path_factory.mktemp("dflash2") / "drafter", seed=3)


def test_public_layout_names_and_shapes(saved, target, tmp_path):
    raw = json.loads((saved / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["is_causal"] is False
    dc = raw["dflash_config"]
    assert {k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 4, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
    state = load_file(saved / "model.safetensors")
    taps, groups, r = 4, H // 8, 8
    expected = {
        "layers.0.attention_conv.base_kernel": (2, taps, H),
        "layers.0.attention_conv.kernel_projection.weight": (2 * taps * groups, H),
        "layers.0.mlp_conv.base_kernel": (2, taps, H),
        "layers.0.mlp_conv.kernel_projection.weight": (2 * taps * groups, H),
        "candidate_selector.predecessor_codebook": (V, r),
        "candidate_selector.successor_codebook": (V, r),
        "candidate_selector.hidden_projection.weight": (r, H),
        "fc.weight": (H, H), "hidden_norm.weight": (H,), "norm.weight": (H,),
    }
    assert {k: tuple(state[k].shape) for k in expected} == expected
    loaded = DFlashDrafter.from_pretrained(saved)  # the architecture decides the class
    assert type(loaded) is DFlash2Drafter and loaded.config.selector_top_k == 4
    # the same forward as the drafter that was saved, and a plain DFlash checkpoint still loads as one
    again = DFlash2Drafter.from_pretrained(saved)
    x, ctx = torch.randn(1, 8, H), torch.randn(1, 5, H)
    args = (x, ctx, torch.arange(5)[None], torch.arange(5, 13)[None])
    torch.testing.assert_close(loaded(*args), again(*args), rtol=0, atol=0)
    DFlashDrafter.random_for_target(target.config, block_size=8).save_pretrained(tmp_path / "dflash")
    assert type(DFlashDrafter.from_pretrained(tmp_path / "dflash")) is DFlashDrafter


def _copy(saved, tmp_path, name, config=None, drop=None, reshape=None):
    d = tmp_path / name
    d.mkdir()
    raw = json.loads((saved / "config.json").read_text())
    if config:
        config(raw)
    (d / "config.json").write_text(json.dumps(raw))
    state = load_file(saved / "model.safetensors")
    state.pop(drop, None)
    if reshape:
        state[reshape] = state[reshape][:, :6].contiguous()
    save_file(state, d / "model.safetensors")
    return d


@pytest.mark.parametrize("case,expected", [
    ("missing_selector", "missing keys ['candidate_selector.successor_codebook']"),
    ("group", "conv_group_size: 7 does not divide hidden_size 64"),
    ("rank", "selector_rank: missing"),
    ("codebook_rank", "candidate_selector.predecessor_codebook (128, 6) != (128, 8)"),
    ("taps", "conv_kernel_size: 9 taps exceed the block of 8"),
])
def test_malformed_checkpoint_refused_in_one_line(saved, tmp_path, case, expected):
    edit = {"group": lambda c: c["dflash_config"].update(conv_group_size=7),
            "rank": lambda c: c["dflash_config"].pop("selector_rank"),
            "taps": lambda c: c["dflash_config"].update(conv_kernel_size=9)}.get(case)
    d = _copy(saved, tmp_path, case, config=edit,
              drop="candidate_selector.successor_codebook" if case == "missing_selector" else None,
              reshape="candidate_selector.predecessor_codebook" if case == "codebook_rank" else None)
    with pytest.raises(ConfigError) as err:
        DFlashDrafter.from_pretrained(d)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_convolution_matches_reference(saved):
    drafter = DFlash2Drafter.from_pretrained(saved, dtype=torch.float64)
    conv = drafter.layers[0].attention_conv
    x, src = torch.randn(1, 8, H, dtype=torch.float64), torch.randn(1, 8, H, dtype=torch.float64)
    dyn = conv.corrections(src)
    for side in (0, 1):
        got = conv(x, dyn, side)[0]
        want = conv_reference(x[0], conv.base_kernel, conv.kernel_projection.weight, src[0], side, 8)
        torch.testing.assert_close(got, want)
    # two blocks side by side convolve apart (nothing crosses a block's start)
    two = conv(torch.cat([x, x], 1), torch.cat([dyn, dyn], 1), 1, block=8)
    torch.testing.assert_close(two[:, 8:], conv(x, dyn, 1))


def _block(drafter, target, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(drafter.block_size - 1, H, generator=g)
    logits = drafter.head_logits(target.get_output_embeddings(), hidden)
    return logits, hidden


@torch.no_grad()
def test_selector_walk_and_pair_tree_match_references(saved, target):
    drafter = DFlash2Drafter.from_pretrained(saved)
    short = DFlash2Drafter.random_for_target(target.config, block_size=4, seed=7, selector_top_k=4, selector_rank=8)
    for seed in range(3):
        logits, hidden = _block(drafter, target, seed)
        cand = drafter.candidates(logits, hidden)
        assert selector_walk(cand, torch.tensor(5 + seed)).tolist() == walk_reference(drafter, logits, hidden, 5 + seed)
        # every path of a 3-deep block enumerated (84 of them)
        logits, hidden = _block(short, target, seed)
        cand, anchor = short.candidates(logits, hidden), torch.tensor(5 + seed)
        for budget in (1, 6, 25, 84):
            tree, _ = pair_tree(anchor, pair_logprobs(cand, anchor), cand.ids, budget)
            assert set(tree_paths(tree)) == pair_paths_reference(short, logits, hidden, 5 + seed, budget)
    # the diagnosis's flags: a node is top-1 iff it is its parent's best child under S_t(parent's token, .)
    logits, hidden = _block(short, target, 9)
    cand, anchor = short.candidates(logits, hidden), torch.tensor(3)
    tree, flags = pair_tree(anchor, pair_logprobs(cand, anchor), cand.ids, 30)
    flags = flags.tolist()
    toks, pars, deps = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    ids = cand.ids.tolist()
    want = [True] + [toks[i] == max(ids[deps[i] - 1], key=lambda b: pair_score(short, logits, hidden, deps[i] - 1,
                                                                               toks[pars[i]], b))
                     for i in range(1, len(toks))]
    assert flags == want and not all(want)
    # the pair scores matter: some walk leaves the per-position argmax chain
    chains = [(selector_walk(c, torch.tensor(5)).tolist(), c.ids[:, 0].tolist())
              for c in (drafter.candidates(*_block(drafter, target, s)) for s in range(5))]
    assert any(w != m for w, m in chains)


_PAIRS = {}


def _pair(model_type: str, vocab: int = 16):
    """A small-vocabulary target and a random DFlash2 drafter (drafts often accepted: trees are walked)."""
    if (model_type, vocab) not in _PAIRS:
        target = tiny_model(model_type, seed=3, vocab_size=vocab, num_hidden_layers=2 if model_type == "qwen3" else 4)
        drafter = DFlash2Drafter.random_for_target(target.config, block_size=4, seed=5, selector_top_k=4,
                                                   selector_rank=8, mask_token_id=vocab - 1)
        _PAIRS[model_type, vocab] = target, drafter
    return _PAIRS[model_type, vocab]


CASES = [("dflash", None), ("ddtree", "marginal"), ("ddtree", "pair")]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_fp32_greedy_equals_hf(model_type):
    target, drafter = _pair(model_type)
    accepted = 0
    for p in range(3):
        ids = torch.tensor([[1 + p, 5, 2, 7, 3 + p]])
        ref = hf_greedy(target, ids, 20)
        for method, scoring in CASES:
            r = ddtree.generate(target, drafter, ids, method=method, budget=10, max_new_tokens=20, scoring=scoring)
            assert r.output_ids == ref, (method, scoring, p)
            accepted += sum(a - 1 for a in r.acceptance_lengths)
    assert accepted > 0  # drafts were accepted: the walk went past the root


@pytest.mark.parametrize("method,scoring", [
    pytest.param("dflash", None, marks=pytest.mark.slow),  # ~25 s each on 2 shared cores
    ("ddtree", "pair"),
])
def test_sampling_follows_target(method, scoring):
    """T = 1: the first two tokens' joint distribution is the target's (chi-square), drafts sampled from the
    selector's softmax over the candidates (dflash) or a pair-score tree (ddtree)."""
    vocab, n = 12, 600
    target, drafter = _pair("qwen3", vocab)
    ids = torch.tensor([[1, 5, 2, 7]])
    probs = exact_joint(target, ids)
    g = torch.Generator().manual_seed(11)
    assert_first_two_tokens_follow(
        lambda: ddtree.generate(target, drafter, ids, method=method, budget=7, temperature=1.0, max_new_tokens=3,
                                generator=g, scoring=scoring), probs, n)


@pytest.mark.parametrize("method,scoring,temperature", [*((m, s, 0.0) for m, s in CASES), ("dflash", None, 1.0)])
def test_a_dflash2_round_reads_the_device_once(method, scoring, temperature):
    """On the path a CUDA run takes (ddtree.engine.host.device_path): the walk, the marginal tree and the pair tree
    draft and build on the device: no host read and no host-to-device copy in a round's draft and tree stages; one
    read a round (the walk's; at T > 0 the chain's rejection walk), the prefill's token and the diagnosis records' one
    per generation (tests/test_launches.py is the DFlash drafter's version)."""
    from ddtree.engine import host
    from ddtree.testing.dispatch import DispatchCount

    target, drafter = _pair("qwen3")
    ids = torch.tensor([[1, 5, 2, 7, 3]])
    g = torch.Generator().manual_seed(0)
    with host.device_path():
        engine = ddtree.Engine(target, drafter, method=method, budget=10, scoring=scoring)
        engine.generate(ids, max_new_tokens=4, temperature=temperature, generator=g)  # first-call work
        with torch.no_grad(), DispatchCount() as c:
            res = engine.generate(ids, max_new_tokens=16, temperature=temperature, generator=g)
    assert res.rounds >= 3
    assert c.syncs["draft"] == c.syncs["tree"] == 0, dict(c.sync_names)
    assert c.total(c.syncs) == res.rounds + 2, dict(c.sync_names)


def test_auto_scoring_is_pair_for_a_dflash2_drafter_and_marginal_for_dflash():
    """scoring=auto (None, the default): DDTree over a DFlash2 drafter builds pair trees, over a DFlash one marginal
    trees; the pipeline resolves it from the drafter's config.json before loading (the job's identity says which)."""
    from ddtree.engine.methods import resolve_scoring
    from ddtree.engine.proposers import DDTreeProposer
    from ddtree.engine.selector import PairTreeProposer
    from ddtree.pipeline.preflight import resolve_auto_scoring
    from ddtree.pipeline.schema import RunConfig

    target, drafter = _pair("qwen3")
    dflash = DFlashDrafter.random_for_target(target.config, block_size=4, mask_token_id=15)
    for scoring in (None, "auto"):
        with ddtree.Engine(target, drafter, method="ddtree", budget=4, scoring=scoring) as e:
            assert type(e.proposer) is PairTreeProposer
        with ddtree.Engine(target, dflash, method="ddtree", budget=4, scoring=scoring) as e:
            assert type(e.proposer) is DDTreeProposer
    assert [resolve_scoring(s, True) for s in ("auto", "marginal", "pair")] == ["pair", "marginal", "pair"]
    assert [resolve_scoring(s, False) for s in ("auto", "marginal")] == ["marginal", "marginal"]
    for method, config, expected in [("ddtree", {"architectures": ["DFlash2DraftModel"]}, "pair"),
                                     ("ddtree", {"architectures": ["DFlashDraftModel"]}, "marginal"),
                                     ("ddtree", None, "auto"),  # not on disk: resolved when the drafter loads
                                     ("dflash", {"architectures": ["DFlash2DraftModel"]}, "auto")]:  # not DDTree
        rc = RunConfig(method=method)
        resolve_auto_scoring(rc, config)
        assert rc.scoring == expected, (method, config)


def test_pair_scoring_needs_a_selector():
    target, _ = _pair("qwen3")
    dflash = DFlashDrafter.random_for_target(target.config, block_size=4, mask_token_id=15)
    with pytest.raises(ConfigError, match="scoring: pair scores come from a DFlash2 drafter"):
        ddtree.Engine(target, dflash, method="ddtree", budget=4, scoring="pair")
    with pytest.raises(ConfigError, match="scoring: unknown value 'joint'"):
        ddtree.Engine(target, dflash, method="ddtree", budget=4, scoring="joint")


def _cli_sweep(cli, tmp_path, model: str, drafter_dir, *extra):
    sweep = tmp_path / "sweep"
    proc = cli(f"model={model}", "drafter=dflash2", f"drafter.name_or_path={drafter_dir}", "dataset=tiny",
               "dataset.max_samples=1", "max_new_tokens=8", "tracking=none", "budget=8", f"runs_dir={tmp_path / 'runs'}",
               f"hydra.sweep.dir={sweep}", "method=dflash,ddtree", "scoring=marginal,pair", *extra, "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    return [(s["method"], s.get("scoring"), s["match_rate"]) for s in summaries]


def test_cli_runs_a_dflash2_checkpoint_losslessly(cli, tmp_path, saved):
    """Both methods and both scorings through `python -m ddtree.run`, lossless; the diagnosis of the sweep takes the
    chain's and the pair tree's records (pair scores) apart from the marginal tree's."""
    from ddtree.pipeline.diagnose.analysis import diagnose
    from ddtree.pipeline.diagnose.records import load_jobs

    got = _cli_sweep(cli, tmp_path, "tiny_qwen3", saved)
    # (the scoring is DDTree's alone: the sweep's second DFlash job is skipped as the same config)
    assert sorted(got, key=str) == sorted([("dflash", None, 1.0), ("ddtree", "marginal", 1.0),
                                           ("ddtree", "pair", 1.0)], key=str)
    doc = diagnose(load_jobs(tmp_path / "sweep"))
    parts = doc["by_scoring"]
    assert sorted(parts) == ["marginal", "pair"]
    assert sorted(m["method"] for m in parts["pair"]["measured"]) == ["ddtree", "dflash"]  # the chain: pair scores
    assert [m["method"] for m in parts["marginal"]["measured"]] == ["ddtree"]
    assert parts["pair"]["predicted"] != parts["marginal"]["predicted"]


def test_a_soft_cap_of_0_or_null_is_no_cap_and_a_negative_one_is_refused(saved, tmp_path):
    """As the public code reads it (z-lab: `softcap > 0`; vLLM: `or 0.0`, then `> 0`): 0 and null leave the logits
    as the head and the multiplier make them."""
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(3, H) * 50  # logits far past a cap of 1
    for cap in (0, None, 0.0):
        d = _copy(saved, tmp_path, f"cap{cap}", config=lambda c, cap=cap: c["dflash_config"].update(
            final_logit_softcapping=cap, output_multiplier=0.5))
        drafter = DFlash2Drafter.from_pretrained(d)
        torch.testing.assert_close(drafter.head_logits(head, hidden), head(hidden).float() * 0.5)
    d = _copy(saved, tmp_path, "cap1", config=lambda c: c["dflash_config"].update(final_logit_softcapping=1.0))
    assert DFlash2Drafter.from_pretrained(d).head_logits(head, hidden).abs().max() <= 1.0
    d = _copy(saved, tmp_path, "neg", config=lambda c: c["dflash_config"].update(final_logit_softcapping=-1.0))
    with pytest.raises(ConfigError, match="final_logit_softcapping: must be a finite number >= 0 "):
        DFlash2Drafter.from_pretrained(d)


@pytest.mark.slow  # fast: the soft cap read from a checkpoint (above), the scale (tests/test_muse_glimmer.py), a
# DFlash2 checkpoint through the CLI (test_cli_runs_a_dflash2_checkpoint_losslessly)
def test_cli_runs_checkpoints_with_soft_cap_0_and_an_input_scale(cli, tmp_path, saved):
    """Two published-format checkpoints through `python -m ddtree.run` (default scoring): one declaring
    `final_logit_softcapping: 0`, one `input_embedding_scale: 2.0`; both lossless (the scale changes the drafts:
    tests/test_muse_glimmer.py)."""
    cap0 = _copy(saved, tmp_path, "cap0", config=lambda c: c["dflash_config"].update(final_logit_softcapping=0))
    scaled = _copy(saved, tmp_path, "scaled", config=lambda c: c["dflash_config"].update(input_embedding_scale=2.0))
    sweep = tmp_path / "sweep"
    proc = cli("model=tiny_qwen3", "drafter=dflash2", f"drafter.name_or_path={cap0},{scaled}", "dataset=tiny",
               "dataset.max_samples=1", "max_new_tokens=8", "tracking=none", "budget=8", "method=dflash,ddtree",
               f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert len(got) == 4 and all(s["match_rate"] == 1.0 and s["validation"]["suspect"] == 0 for s in got), got


@pytest.mark.slow  # a three-job compiled CLI sweep; fast: tests/test_compile.py (the DFlash2 drafter's compiled round)
# and tests/test_compile_cli.py (compile=true through the CLI)
def test_cli_compiles_a_dflash2_round(cli, tmp_path, saved, monkeypatch):
    """compile=true through `python -m ddtree.run` (compat on; the graphs traced by dynamo: DDTREE_COMPILE_BACKEND=eager,
    tests/test_compile.py has inductor's): the chain and both scorings lossless, each job's round compiled with
    nothing eager (the drafter's forward, the walk and the trees in the compiled round)."""
    monkeypatch.setenv("DDTREE_COMPILE_BACKEND", "eager")
    got = _cli_sweep(cli, tmp_path, "tiny_qwen3", saved, "compile=true")
    assert len(got) == 3 and all(rate == 1.0 for *_, rate in got), got
    for path in (tmp_path / "sweep").glob("*/summary.json"):
        assert json.loads(path.read_text())["round"] == {"ran": "compiled", "why": None, "fallback": False}


def test_cli_runs_the_toy_dflash2_drafter(cli, tmp_path):
    """The shipped toy DFlash2 drafter (drafter=toy_dflash2, the toy hybrid target) through `python -m ddtree.run`
    with the default scoring (auto: pair for a DFlash2 drafter, recorded as pair): its chain and its pair-scored tree,
    equal to AR on a toy prompt, drafts accepted."""
    sweep = tmp_path / "sweep"
    proc = cli("model=toy", "drafter=toy_dflash2", "dataset.max_samples=1", "max_new_tokens=24", "tracking=none",
               "budget=8", "method=dflash,ddtree", f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted((s["method"], s.get("scoring"), s["match_rate"]) for s in summaries) == [
        ("ddtree", "pair", 1.0), ("dflash", None, 1.0)]
    assert "toy-ddtree-b8-pair:" in proc.stderr, proc.stderr[-2000:]  # the job is named as it ran
    assert all(s["tau"] > 2 for s in summaries), [s["tau"] for s in summaries]


@pytest.mark.slow  # the toy pair at T = 1 through the CLI; fast: the DFlash2 chain's rejection sampling in process
# (tests/test_sampling.py) and T > 0 CLI jobs in tests/test_report.py
def test_cli_samples_the_toy_dflash2_chain(cli, tmp_path):
    """T = 1 through `python -m ddtree.run`: the toy DFlash2 chain sampled and verified by rejection against the
    selector's rows; drafts accepted, every output gets the pipeline's T > 0 verdict (ok: each token probable under
    the target) next to its AR baseline's."""
    job = tmp_path / "job"
    proc = cli("experiment=toy_dflash2", "method=dflash", "temperature=1", "dataset.max_samples=2", "max_new_tokens=24",
               "tracking=none", f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["method"] == "dflash" and summary["tau"] > 1.5, summary["tau"]
    v = summary["validation"]
    assert v["checked"] == 2 and v["ok"] == 2 and v["suspect"] == 0, v
    samples = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert {r["validation"]["verdict"] for r in samples} == {"ok"} and {r["role"] for r in samples} == {"method", "baseline"}


@pytest.mark.slow  # the hybrid target through the CLI (~1 min on 2 shared cores)
def test_cli_runs_a_dflash2_checkpoint_on_a_hybrid(cli, tmp_path):
    d = save_random_dflash2(tiny_model("qwen3_5_text", seed=0), tmp_path / "drafter35", seed=4)
    got = _cli_sweep(cli, tmp_path, "tiny_qwen3_5", d)
    assert all(rate == 1.0 for *_, rate in got) and len(got) == 3  # the chain once, DDTree under both scorings


@pytest.mark.parametrize("args,expected", [
    pytest.param(("scoring=joint",), "error: scoring: unknown value 'joint'", marks=pytest.mark.slow),
    # (the engine's refusal: test_pair_scoring_needs_a_selector)
    pytest.param(("drafter=tiny", "scoring=pair"), "error: scoring: pair scores come from a DFlash2 drafter",
                 marks=pytest.mark.slow),
    (("CONV7",), "error: drafter.dflash_config.conv_group_size: 7 does not divide hidden_size 64"),
])
def test_cli_refuses_in_one_line(cli, tmp_path, saved, args, expected):
    if args == ("CONV7",):
        bad = _copy(saved, tmp_path, "bad", config=lambda c: c["dflash_config"].update(conv_group_size=7))
        args = ("drafter=dflash2", f"drafter.name_or_path={bad}")
    elif "drafter=tiny" not in args:
        args = ("drafter=dflash2", f"drafter.name_or_path={saved}", *args)
    proc = cli("model=tiny_qwen3", "dataset=tiny", "method=ddtree", "tracking=none", *args,
               f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'job'}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr


def test_diagnosis_counts_pair_trees_by_their_own_top1(saved, target):
    """The node table of a pair-scored round: a node is on the drafter's path when every ancestor is its parent's best
    child under pair scores, and top-1 when it is one itself (not the marginal argmax of its depth)."""
    from ddtree.engine.diagnostics import NODE_COLUMNS, RoundRecorder
    from ddtree.engine.tree import walk

    short = DFlash2Drafter.random_for_target(target.config, block_size=4, seed=7, selector_top_k=4, selector_rank=8)
    logits, hidden = _block(short, target, 4)
    cand, anchor = short.candidates(logits, hidden), torch.tensor(3)
    tree, top1 = pair_tree(anchor, pair_logprobs(cand, anchor), cand.ids, 20)
    flags = top1.tolist()
    toks, pars, deps = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    choice = torch.tensor([toks[i] if i < len(toks) else 0 for i in range(1, len(toks) + 1)])  # follows some nodes
    rec = RoundRecorder()
    w = walk(tree, choice)
    rec.round(logits, tree, w.path, len(w.path_list) - 1, w.next_root, choice, top1)
    table = [[0] * NODE_COLUMNS for _ in range(logits.shape[0] + 1)]
    for i in range(1, len(toks)):
        on, j = True, pars[i]
        while j > 0:
            on, j = on and flags[j], pars[j]
        table[deps[i]][(0 if on else 4) + 2 * flags[i] + (toks[i] == int(choice[pars[i]]))] += 1
    assert rec.finish()["nodes"] == table


@torch.no_grad()
def test_diagnosis_records_pair_rows_along_the_target_path(target):
    """The rows a pair-scored round records (selector.path_pair_rows): row t is log p_t(. | a) at its candidates, a the
    target's token before it (the anchor at t = 0) as far as the path is known, then the previous position's best
    marginal candidate; against float64 sums of the formula token by token (testing.dflash2.pair_logprob)."""
    from ddtree.engine.selector import PAIR_FLOOR, path_pair_rows
    from ddtree.engine.tree import walk
    from ddtree.testing.dflash2 import candidates_of, pair_logprob

    short = DFlash2Drafter.random_for_target(target.config, block_size=5, seed=7, selector_top_k=4, selector_rank=8)
    logits, hidden = _block(short, target, 2)
    cand, anchor = short.candidates(logits, hidden), 3
    tree, _ = pair_tree(torch.tensor(anchor), pair_logprobs(cand, torch.tensor(anchor)), cand.ids, 20)
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    deep = max(range(len(toks)), key=lambda i: (tree.depths[i], -i))  # a node two deep or more: its path is taken
    path = [deep]
    while path[-1] > 0:
        path.append(pars[path[-1]])
    path = path[::-1]
    choice = torch.zeros(len(toks), dtype=torch.long)
    for a, b in zip(path, path[1:], strict=False):
        choice[a] = toks[b]
    w = walk(tree, choice)
    accepted = len(w.path_list) - 1
    assert w.path_list == path and accepted >= 2
    rows = path_pair_rows(cand, tree, w.path, accepted, V)
    cands = candidates_of(logits, 4)
    prev = [anchor] + [toks[i] for i in path[1:]]
    for t in range(logits.shape[0]):
        a = prev[t] if t < len(prev) else cands[t - 1][0]
        want = [pair_logprob(short, logits, hidden, t, a, b) if b in cands[t] else PAIR_FLOOR for b in range(V)]
        assert rows[t].tolist() == pytest.approx(want, abs=1e-4), t


def test_training_fits_the_selector_and_stays_lossless(tmp_path):
    """python -m ddtree.train's loop on a DFlash2 drafter: the selector's loss on held-out blocks falls and its
    accuracy among the candidates rises, and the trained checkpoint decodes losslessly with every method."""
    import copy
    import random

    from train_support import MASK, _direct_features, _records, _target, _train

    from ddtree.train.features import Sample
    from ddtree.train.objective import drafter_hidden, make_batch, selector_loss

    torch.manual_seed(0)
    target = _target()
    start = DFlash2Drafter.random_for_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                             mask_token_id=MASK, seed=0, selector_top_k=4, selector_rank=8,
                                             perturb=False)
    before = copy.deepcopy(start)
    drafter, summary, losses = _train(tmp_path, target, 60, drafter=start)
    assert losses[-1] < losses[0] and "final_selector_acc" in summary
    with torch.no_grad():
        samples = [Sample(torch.tensor(r["input_ids"]), _direct_features(target, r["input_ids"], [1, 3]),
                          [tuple(r["spans"][0])]) for r in _records(8, seed=9, pattern=True)]
        batch = make_batch(samples, 4, 6, MASK, random.Random(0))
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        old = selector_loss(before, drafter_hidden(before, embed, batch), head, batch)[1]
        new = selector_loss(drafter, drafter_hidden(drafter, embed, batch), head, batch)[1]
    assert new["selector_loss"] < 0.8 * old["selector_loss"] and new["selector_acc"] > old["selector_acc"], (old, new)
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert type(loaded) is DFlash2Drafter
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    ref = hf_greedy(target, prompt, 16)
    for method, scoring in CASES:
        assert ddtree.generate(target, loaded, prompt, method=method, budget=8, max_new_tokens=16,
                               scoring=scoring).output_ids == ref


@pytest.mark.slow  # fast: the batched pair trees in process (tests/test_batch.py), concurrency through the CLI
# (tests/test_concurrency_run.py), the toy DFlash2 pair through the CLI (above)
def test_cli_runs_the_toy_dflash2_pair_batched(cli, tmp_path):
    """`concurrency=3` with the toy DFlash2 drafter and the default scoring (auto: pair): the pair trees of every
    stream in one batched round (ddtree.engine.selector.batch_pair_tree), every output exact, drafts accepted."""
    job = tmp_path / "job"
    proc = cli("model=toy", "drafter=toy_dflash2", "concurrency=3", "dataset.max_samples=3", "max_new_tokens=16",
               "tracking=none", "budget=8", f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((job / "summary.json").read_text())
    assert (s["method"], s["scoring"], s["concurrency"], s["match_rate"]) == ("ddtree", "pair", 3, 1.0)
    assert s["tau"] > 2 and s["validation"]["suspect"] == 0
