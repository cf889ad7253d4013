"""method=mtp: the target's own MTP head as a chain and as an EAGLE-style tree, in the one engine.

References: HF greedy `generate` (lossless), a from-scratch recomputation of the head's drafts (no cache, plain
causal attention: tests/mtp_support.py: reference_head_logits), the exact two-token joint at T > 0 (chi-square),
and the checkpoint layout the serving engines load (`mtp.*` tensors beside the target's own).
"""

from __future__ import annotations

import json

import pytest
import torch
from mtp_support import fitted_head, reference_head_logits, save_target_with_mtp
from sampling_support import assert_first_two_tokens_follow, exact_joint
from transformers import AutoModelForCausalLM

import ddtree
from ddtree.engine.drafter.mtp import MTPHead, check_mtp_checkpoint, mtp_tensor_map
from ddtree.engine.loop import Engine
from ddtree.engine.proposers import MTPProposer
from ddtree.errors import ConfigError
from ddtree.testing.reference import eagle_tree_reference, tree_paths
from ddtree.tiny import tiny_model

_PAIRS: dict = {}


def pair(model_type: str, vocab_size: int = 128):
    """A tiny slow-decay hybrid target and an MTP head fitted to its greedy outputs (drafts get accepted)."""
    key = (model_type, vocab_size)
    if key not in _PAIRS:
        target = tiny_model(model_type, seed=0, vocab_size=vocab_size)
        _PAIRS[key] = target, fitted_head(target, seed=1)
    return _PAIRS[key]


def _prompts(n: int, vocab: int = 128, length: int = 9) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (1, length), generator=g) for _ in range(n)]


def _greedy(target, ids: torch.Tensor, new: int) -> list[int]:
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


GRID = [(1, 64), (3, 12), (2, 5)]  # (topk, budget): the chain, a tree, a tree cut by its budget


def _check_grid(model_type: str, prompts: int, new: int = 32) -> None:
    target, head = pair(model_type)
    accepted = 0
    for topk, budget in GRID:
        engine = Engine(target, head, method="mtp", steps=3, topk=topk, budget=budget)
        for ids in _prompts(prompts):
            r = engine.generate(ids, max_new_tokens=new)
            assert r.output_ids == _greedy(target, ids, new), (model_type, topk, budget)
            accepted += sum(a - 1 for a in r.acceptance_lengths)
    assert accepted > prompts * len(GRID) * 3  # drafts were accepted, and rejected (rollback) along the way


def test_dense_hybrid_chain_and_tree_equal_greedy():
    _check_grid("qwen3_5_text", prompts=2, new=24)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_moe_and_next_chain_and_tree_equal_greedy(model_type):
    _check_grid(model_type, prompts=1, new=24)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_grid_equals_greedy_many_prompts(model_type):
    _check_grid(model_type, prompts=6, new=48)


class _Recording(MTPProposer):
    """Records, per round, the committed tokens, the tree it proposed and the head's logits it computed."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rounds: list[tuple[list[int], object, list[torch.Tensor]]] = []
        self.logits: list[torch.Tensor] = []
        plain = self.head.logits
        self.head.logits = lambda h: self.logits.append(plain(h)) or self.logits[-1]

    def propose(self, state):
        self.logits = []
        tree = super().propose(state)
        committed = state.input_ids[0].tolist() + list(state.generated)
        self.rounds.append((committed, tree, list(self.logits)))
        return tree

    def release(self) -> None:
        """The head's own `logits` again (the head is shared with other tests)."""
        del self.head.logits


def test_chain_drafts_equal_the_from_scratch_head():
    """Every round's chain is the head applied recursively, recomputed without a cache over everything committed:
    the KV cache, its crop after drafting and the positions are right across rounds."""
    target, head = pair("qwen3_5_text")
    prop = _Recording(target, head, steps=3)
    r = ddtree.generate(target, None, _prompts(1)[0], method="mtp", proposer=prop, max_new_tokens=24)
    prop.release()
    assert len(prop.rounds) > 3 and any(a > 1 for a in r.acceptance_lengths)
    for committed, tree, logits in prop.rounds:
        drafts = tree.tokens[1:].tolist()
        assert len(logits) == len(drafts) == 3
        for j in range(len(drafts)):
            ref = reference_head_logits(target, head, committed, drafts[:j])
            assert int(ref.argmax()) == drafts[j]
            torch.testing.assert_close(logits[j].float(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [6, 64])  # the best nodes; all of them (the deepest follow the frontier choice)
def test_tree_drafts_equal_the_from_scratch_head(budget):
    """The EAGLE tree: every node's children are the top-k of the head along the node's own path (recomputed
    from scratch per path), the frontier the k best by cumulative log-probability, the kept nodes the best."""
    target, head = pair("qwen3_5_text")
    k, steps = 2, 3
    prop = _Recording(target, head, steps=steps, topk=k, budget=budget)
    ddtree.generate(target, None, _prompts(2)[1], method="mtp", proposer=prop, max_new_tokens=16)
    prop.release()
    for committed, tree, _ in prop.rounds[:3]:
        want = eagle_tree_reference(lambda path, c=committed: reference_head_logits(target, head, c, path),
                                    k, steps, budget)
        got = tree_paths(tree)  # path -> its cumulative score
        assert sorted(got) == sorted(want)
        for path, score in want.items():  # the cumulative log-probabilities, not only their order
            assert abs(got[path] - score) < 1e-4, path


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_the_step_equals_transformers_layer(model_type):
    """MTPHead.step (the one step drafting runs, eager and compiled) over its fixed buffer equals the head through
    transformers' own layer (`forward`, no cache, plain causal mask): a context read in one call, then a step that
    sees every row, then two queries that see only some rows (a tree's frontier)."""
    from mtp_support import causal_mask

    target = tiny_model(model_type, seed=0)
    head = MTPHead.random_for_target(target, seed=5, std=0.2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (1, 9), generator=g)
    hidden = torch.randn(1, 9, head.config.hidden_size, generator=g)
    with torch.inference_mode():
        ref = head(head.embed(ids), hidden, torch.arange(9)[None], causal_mask(9, hidden.dtype), None)
        kv = head.new_kv(32)
        pos = torch.arange(6)
        got = [head.step(ids[:, :6], hidden[:, :6], pos, pos, torch.arange(6)[None] <= pos[:, None], kv)]
        got.append(head.step(ids[:, 6:7], hidden[:, 6:7], pos[-1:] + 1, pos[-1:] + 1, 7, kv))
        # rows 7 and 8 as two queries written at rows 20, 21: row 7 sees 0..6 and itself; row 8 sees 0..6, 20, 21
        vis = torch.zeros(2, 22, dtype=torch.bool)
        vis[:, :7] = True
        vis[0, 20] = vis[1, 20] = vis[1, 21] = True
        got.append(head.step(ids[:, 7:9], hidden[:, 7:9], torch.tensor([7, 8]), torch.tensor([20, 21]), vis, kv))
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type,per_expert,prefix", [
    ("qwen3_5_text", False, "mtp."),
    ("qwen3_5_moe_text", False, "mtp."),  # fused experts, as Qwen3.5 MoE checkpoints ship them
    ("qwen3_next", True, "mtp."),  # one tensor per expert, as Qwen3-Next ships them
    ("qwen3_5_text", False, "model.language_model.mtp."),
])
def test_loads_the_public_layout(tmp_path, model_type, per_expert, prefix):
    target = tiny_model(model_type, seed=0)
    head = MTPHead.random_for_target(target, seed=4, std=0.1)
    d = save_target_with_mtp(target, head, tmp_path / "ckpt", prefix=prefix, per_expert=per_expert)
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    names = {k for k in index if k.startswith(prefix)}
    assert {f"{prefix}fc.weight", f"{prefix}pre_fc_norm_embedding.weight", f"{prefix}pre_fc_norm_hidden.weight",
            f"{prefix}norm.weight", f"{prefix}layers.0.self_attn.q_proj.weight",
            f"{prefix}layers.0.input_layernorm.weight"} <= names
    if per_expert:
        assert f"{prefix}layers.0.mlp.experts.0.gate_proj.weight" in names
    loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # transformers ignores mtp.*
    assert mtp_tensor_map(d)[1] == prefix
    back = MTPHead.from_target(loaded)
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ids = _prompts(1)[0]
    a = ddtree.generate(loaded, None, ids, method="mtp", steps=2, max_new_tokens=12)  # the head read from disk
    assert a.output_ids == _greedy(loaded, ids, 12)


def test_refused_before_weights_load(tmp_path):
    target = tiny_model("qwen3_5_text", seed=0)
    bare = save_target_with_mtp(target, None, tmp_path / "bare")
    with pytest.raises(ConfigError, match=r"^method: .*no MTP tensors.*— use"):
        check_mtp_checkpoint(bare, "qwen3_5_text")
    with pytest.raises(ConfigError, match=r"^method: .*'qwen3' target has none"):
        check_mtp_checkpoint(bare, "qwen3")
    with pytest.raises(ConfigError, match=r"^method: .*'qwen3' target has none"):
        ddtree.generate(tiny_model("qwen3"), None, _prompts(1)[0], method="mtp", max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"^mtp.steps: must be an integer >= 1"):
        ddtree.generate(target, None, _prompts(1)[0], method="mtp", steps=0, max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"^mtp.topk"):
        ddtree.generate(target, None, _prompts(1)[0], method="mtp", topk=0, max_new_tokens=4)


V, T, N = 12, 1.0, 600


@pytest.mark.slow  # ~3 min each on a shared 2-core CPU
@pytest.mark.parametrize("topk,budget", [(1, 64), (3, 8)])
def test_first_two_tokens_follow_target(topk, budget):
    """T > 0 on the hybrid: the first two tokens are distributed as the target's exact joint (chi-square)."""
    target, head = pair("qwen3_5_text", vocab_size=V)
    ids = torch.tensor([[1, 5, 2, 7]])
    probs = exact_joint(target, ids, T)
    engine = Engine(target, head, method="mtp", steps=2, topk=topk, budget=budget)
    g = torch.Generator().manual_seed(11)
    assert_first_two_tokens_follow(lambda: engine.generate(ids, temperature=T, max_new_tokens=3, generator=g), probs, N)


# ---------------------------------------------------------------- through the CLI (python -m ddtree.run)

def _saved(tmp_path, head: bool):
    from ddtree.tiny import tiny_tokenizer

    target = tiny_model("qwen3_5_text", seed=0)
    h = MTPHead.random_for_target(target, seed=2) if head else None
    return save_target_with_mtp(target, h, tmp_path / ("with_mtp" if head else "bare"), tokenizer=tiny_tokenizer(128))


@pytest.mark.slow  # CLI subprocesses, ~30 s: make test-slow
def test_cli_runs_the_checkpoint_head_and_refuses_a_bare_one(cli, tmp_path):
    common = ("model=hf", "dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8", "tracking=none",
              f"runs_dir={tmp_path / 'runs'}")
    job = tmp_path / "job"
    proc = cli(*common, f"model.name_or_path={_saved(tmp_path, True)}", "method=mtp", "mtp.topk=2", "budget=4",
               f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["method"], summary["mtp"], summary["budget"], summary["match_rate"]) == (
        "mtp", {"steps": 3, "topk": 2}, 4, 1.0)
    assert "mtp 3x2" in proc.stdout
    bad = cli(*common, f"model.name_or_path={_saved(tmp_path, False)}", "method=mtp", f"hydra.run.dir={tmp_path / 'b'}")
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: method: ") and "no MTP tensors" in lines[0]
    assert not (tmp_path / "b" / "samples.jsonl").exists()
    pure = cli("model=tiny_qwen3", "dataset=tiny", "method=mtp", "tracking=none", f"runs_dir={tmp_path / 'runs'}")
    assert pure.returncode == 2 and "'qwen3' target has none" in pure.stderr


@pytest.mark.slow  # three jobs through Hydra's launcher (~2 min on a shared 2-core CPU)
def test_cli_sweep_puts_mtp_beside_dflash_and_ddtree(cli, tmp_path):
    proc = cli("model=tiny_qwen3_5", "dataset=tiny", "dataset.max_samples=1", "max_new_tokens=6", "tracking=none",
               f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", "budget=8",
               "method=mtp,dflash,ddtree", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("sweep "):]
    rows = [line.split()[1:3] for line in table.splitlines()[2:] if line.strip()]
    assert rows == [["mtp", "3"], ["dflash", "-"], ["ddtree", "8"]], table  # method (mtp: its steps), budget


def test_report_and_sweep_table_name_the_mtp_shape():
    from ddtree.pipeline.report import markdown_table
    from ddtree.pipeline.sweep_table import method_cell

    assert method_cell({"method": "mtp", "mtp": {"steps": 3, "topk": 1}}) == "mtp 3"
    assert method_cell({"method": "mtp", "mtp": {"steps": 4, "topk": 2}}) == "mtp 4x2"
    assert method_cell({"method": "ddtree"}) == "ddtree"
    entry = {"speedup": 2.0, "tau": 3.0, "budget": 16, "verdicts": "4 ok"}
    cell = {"temperature": 0.0, "title": "toy", "model": "toy", "dflash": entry, "ddtree_best": entry,
            "ddtree": [entry], "gain": 1.0}
    assert "MTP" not in markdown_table([cell])  # no MTP run: the table as before
    md = markdown_table([{**cell, "mtp": [entry], "mtp_best": {**entry, "speedup": 1.5, "shape": "mtp 3"}}])
    head, _, row = md.splitlines()[2:5]
    assert head.endswith("MTP speedup | MTP tau | MTP shape | MTP verdicts |")
    assert row.endswith("| 1.50x | 3.00 | mtp 3 | 4 ok |")


def test_multimodal_wrapper_as_published(tmp_path):
    """Qwen3.5/3.6 ship as the multimodal wrapper: the language model under model.language_model.*, the head
    under mtp.* at the top level. Loaded with transformers' image-text-to-text class, it drafts with the right
    hidden state (the first draft's logits equal the from-scratch head's) and stays lossless."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ddtree.tiny import tiny_config

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    cfg = AutoConfig.for_model("qwen3_5", text_config=tiny_config("qwen3_5_text").to_dict(), vision_config=vision)
    torch.manual_seed(0)
    wrapper = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).eval()
    d = save_target_with_mtp(wrapper, MTPHead.random_for_target(wrapper, seed=3, std=0.1), tmp_path / "w")
    names = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.embed_tokens.weight" in names and "mtp.fc.weight" in names
    target = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    ids = _prompts(1)[0]
    prop = _Recording(target, None, steps=3, topk=2, budget=6)  # the head read from the checkpoint
    r = ddtree.generate(target, None, ids, method="mtp", proposer=prop, max_new_tokens=12)
    prop.release()
    assert r.output_ids == _greedy(target, ids, 12)
    committed, _, logits = prop.rounds[0]
    torch.testing.assert_close(logits[0].float(), reference_head_logits(target, prop.head, committed, []),
                               atol=1e-4, rtol=1e-4)
