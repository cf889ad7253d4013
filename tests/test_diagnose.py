"""The diagnosis (`python -m ddtree.diagnose`): the per-round records, the tau model against exact enumeration and a
scripted drafter with known rank distributions run through the real engine, and the CLI on the toy and tiny pairs."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddtree.engine.diagnostics import RANK_CAP, SKETCH, RoundRecorder
from ddtree.engine.loop import Engine
from ddtree.engine.tree import best_first_tree, chain_tree, walk
from ddtree.errors import ConfigError
from ddtree.pipeline import diagnose as D
from ddtree.pipeline.diagnose import analysis, model, stats, text
from ddtree.testing.ranks import RankScriptedProposer, exact_tau
from ddtree.tiny import tiny_model

REPO = Path(__file__).resolve().parents[1]


def _enumerated(main, off, budget):
    """1 + the `budget` largest path probabilities over every rank path (the slow obvious reference)."""
    L, K = len(main), len(main[0])
    probs = []
    for depth in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=depth):
            p, on = 1.0, True
            for d, r in enumerate(ranks):
                p *= (main if on else off)[d][r]
                on = on and r == 0
            probs.append(p)
    return 1.0 + sum(sorted(probs, reverse=True)[:budget])


def _table(rng, L, K):
    rows = []
    for _ in range(L):
        w = [rng.random() ** 2 for _ in range(K)]
        s = sum(w) / rng.uniform(0.5, 1.0)  # some mass past the K ranks
        rows.append([x / s for x in w])
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_predicted_tau_is_the_sum_of_the_best_paths(seed):
    rng = random.Random(seed)
    L, K = 3, 4
    main, off = _table(rng, L, K), _table(rng, L, K)
    pad = lambda t: [row + [0.0] * (RANK_CAP - K) for row in t]  # noqa: E731
    taus = model.predict_taus(pad(main), pad(off), 84)
    for b in range(1, 85):
        assert taus[b] == pytest.approx(_enumerated(main, off, b), rel=1e-12), b
    assert model.chain_tau(pad(main)) == pytest.approx(1 + main[0][0] + main[0][0] * main[1][0]
                                                   + main[0][0] * main[1][0] * main[2][0])


def test_the_mass_past_the_rank_cap_spreads_over_the_vocabulary():
    """A flat drafter: big trees hold ranks past RANK_CAP; the model spreads the measured mass beyond evenly."""
    rng = random.Random(7)
    V, L = RANK_CAP + 5, 2
    main, off = _table(rng, L, 4), _table(rng, L, 4)
    flat = lambda t: [row + [0.0] * (RANK_CAP - 4) + [(1 - sum(row)) / (V - RANK_CAP)] * (V - RANK_CAP)  # noqa: E731
                      for row in t]
    capped = lambda t: [row + [0.0] * (RANK_CAP - 4) + [1 - sum(row)] for row in t]  # noqa: E731
    taus = model.predict_taus(capped(main), capped(off), 300, vocab=V)
    for b in (1, 5, 9, 10, 40, 41, 100, 300):
        assert taus[b] == pytest.approx(_enumerated(flat(main), flat(off), b), rel=1e-12), b
    assert model.predict_taus(capped(main), capped(off), 50)[50] < taus[50]  # without the vocabulary: left out


def test_a_chain_prediction_is_its_own_accepted_tau():
    """From a chain's own rounds, 1 + sum_d prod p_d(0) telescopes to the mean accepted depth + 1."""
    rng = random.Random(0)
    L, depths, ranks = 6, [], []
    for _ in range(300):
        a = 0
        while a < L and rng.random() < 0.7:
            a += 1
        depths.append(a)
        ranks.append([0] * a + ([rng.randrange(1, 40) if rng.random() < 0.5 else 1] if a < L else []))
    rec = {"depth": depths, "ranks": [[min(r, RANK_CAP) for r in rs] for rs in ranks],
           "probs": [[500] * len(rs) for rs in ranks], "prob_scale": 1000}
    st = D.collect([rec], L)
    main, _ = stats.rank_probabilities(st)
    assert model.chain_tau(main) == pytest.approx(1 + sum(depths) / len(depths), rel=1e-12)


def test_a_sampled_chain_from_tree_rounds_matches_its_exact_tau():
    """T > 0: a DFlash chain drafts a sample of the drafter's tempered row q_d at each depth and the target accepts it
    when its own sample (from p_d) is the same token: the exact expected tau is 1 + sum_k prod_{d<=k} sum_v p_d(v) q_d(v).
    Tree rounds record the target's sampled path up to a random depth, with each token's tempered drafter cost."""
    rng = random.Random(5)
    L, V = 5, 6
    p = [[8.0] + [rng.random() for _ in range(V - 1)] for _ in range(L)]  # both lean on token 0: long chains
    q = [[6.0] + [rng.random() for _ in range(V - 1)] for _ in range(L)]
    p = [[x / sum(r) for x in r] for r in p]
    q = [[x / sum(r) for x in r] for r in q]
    exact, run = 1.0, 1.0
    for d in range(L):
        run *= sum(a * b for a, b in zip(p[d], q[d], strict=True))
        exact += run
    tcosts = []
    for _ in range(20000):
        m = rng.randint(1, L)  # how far this round's tree followed the target (independent of the samples here)
        xs = [rng.choices(range(V), p[d])[0] for d in range(m)]
        tcosts.append([round(-1000 * math.log(q[d][x])) for d, x in enumerate(xs)])
    rec = {"tree": 8, "temperature": 1.0, "cost_scale": 1000, "rows": [[[0]] * L], "tcosts": tcosts}
    assert analysis.record_temperature([rec]) == 1.0
    assert analysis.sampled_chain_tau([rec]) == pytest.approx(exact, abs=0.02)
    chain = {"tree": None, "depth": [0, 1, 2, 5], "temperature": 1.0}
    assert analysis.sampled_chain_tau([chain]) == 3.0  # a chain's own rounds: their accepted tau


# ---------------------------------------------------------------- the recorder against a slow reference


def _slow_round(logits, tree, choice):
    """The recorder's round by plain Python loops: path ranks/probs and the node table."""
    toks, pars, deps = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    want = choice.tolist()
    path = [0]
    while True:
        kids = [i for i in range(len(toks)) if pars[i] == path[-1] and toks[i] == want[path[-1]]]
        if not kids:
            break
        path.append(kids[0])
    target = [toks[i] for i in path[1:]] + [want[path[-1]]]
    L = logits.shape[0]
    ranks, probs = [], []
    for d, t in enumerate(target[:L]):
        row = logits[d].tolist()
        ranks.append(min(sum(x > row[t] for x in row), RANK_CAP))
        probs.append(round(1000 * torch.softmax(logits[d].double(), -1)[t].item()))
    top1 = logits.argmax(-1).tolist()
    table = [[0] * 8 for _ in range(L + 1)]
    for i in range(1, len(toks)):
        on, j = True, pars[i]
        while j > 0:
            on = on and toks[j] == top1[deps[j] - 1]
            j = pars[j]
        col = (0 if on else 4) + 2 * (toks[i] == top1[deps[i] - 1]) + (toks[i] == want[pars[i]])
        table[deps[i]][col] += 1
    return len(path) - 1, ranks, probs, table


@pytest.mark.parametrize("seed", range(3))
def test_recorder_matches_a_slow_reference(seed):
    g = torch.Generator().manual_seed(seed)
    L, V = 6, 40
    logits = torch.randn(L, V, generator=g) * 2
    root = torch.tensor(5)
    lp = torch.log_softmax(logits, -1)
    for tree in (chain_tree(root, logits.argmax(-1)), best_first_tree(root, lp, 24, host=False),
                 best_first_tree(root, lp, 24, host=True)):
        # the target follows the tree a few levels, through some non-top-1 children
        choice = torch.randint(0, V, (len(tree),), generator=g)
        kids = {}
        for i, p in enumerate(tree.parents.tolist()[1:], 1):
            kids.setdefault(p, []).append(i)
        node = 0
        for _ in range(4):
            if node not in kids:
                break
            nxt = kids[node][-1 if seed % 2 else 0]
            choice[node] = tree.tokens[nxt]
            node = nxt
        w = walk(tree, choice)
        rec = RoundRecorder()
        rec.round(logits, tree, w.path, len(w.path_list) - 1, w.next_root, choice)
        out = rec.finish()
        depth, ranks, probs, table = _slow_round(logits, tree, choice)
        assert out["depth"] == [depth] and out["ranks"] == [ranks] and out["probs"] == [probs]
        if not tree.is_chain:
            assert out["nodes"] == table
        # costs along the path and the rows' sketch, in thousandths of a nat (float32 on one side: +-1)
        nll = -torch.log_softmax(logits.double(), -1)
        want = (tree.tokens[w.path[1:]].tolist() + [int(w.next_root)])[: len(ranks)]
        close = lambda a, b: all(abs(x - y) <= 1 for x, y in zip(a, b, strict=True))  # noqa: E731
        assert close(out["costs"][0], [round(1000 * nll[d, t].item()) for d, t in enumerate(want)])
        srt = nll.sort(-1).values
        assert out["sketch"] == [r for r in SKETCH if r < V] and len(out["rows"][0]) == L
        for d in range(L):
            assert close(out["rows"][0][d], [round(1000 * srt[d, r].item()) for r in out["sketch"]])
        # need: the smallest budget whose best-first tree holds each accepted node (by its tokens)
        if tree.is_chain:
            assert out["need"] == [None] and out["tree"] is None
            continue
        assert out["tree"] == len(tree) - 1
        need = []
        for d in range(1, depth + 1):
            prefix = want[:d]
            for b in range(1, 25):
                small = best_first_tree(root, lp, b, host=False)
                st, sp = small.tokens.tolist(), small.parents.tolist()
                paths = {0: ()}
                for i in range(1, len(st)):
                    paths[i] = paths[sp[i]] + (st[i],)
                if tuple(prefix) in paths.values():
                    need.append(b)
                    break
        assert out["need"] == [need]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_recording_reads_nothing_from_the_device_in_a_round():
    dev = torch.device("cuda")
    logits = torch.randn(15, 500, device=dev)
    root = torch.tensor(3, device=dev)
    for tree in (chain_tree(root, logits.argmax(-1)),
                 best_first_tree(root, torch.log_softmax(logits, -1), 64, host=False)):
        choice = torch.randint(0, 500, (len(tree),), device=dev)
        w = walk(tree, choice)  # the round's own host read
        tree.ancestor_index()
        rec = RoundRecorder()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rec.round(logits, tree, w.path, len(w.path_list) - 1, w.next_root, choice)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert len(rec.finish()["ranks"]) == 1


# ---------------------------------------------------------------- the engine with a scripted drafter

PROBS = [[0.75, 0.15, 0.05], [0.6, 0.2, 0.1], [0.7, 0.15, 0.05], [0.5, 0.3, 0.1]]  # L = 4, three scripted ranks


@pytest.fixture(scope="module")
def scripted_runs():
    target = tiny_model("qwen3", seed=0, vocab_size=64)
    prompts = [torch.tensor([[3 + i, 5, 7 + i, 11]]) for i in range(3)]
    new = 120
    ar = Engine(target, None, method="ar")  # the continuation the scripted drafter knows (AR = greedy: test_engine)
    refs = [ar.generate(p, max_new_tokens=new + len(PROBS) + 2).output_ids for p in prompts]
    out = {}
    for budget in (None, 4, 12):
        diag = []
        for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
            prop = RankScriptedProposer(ref, 64, PROBS, budget, seed=100 * i + (budget or 0))
            eng = Engine(target, None, method="dflash" if budget is None else "ddtree", budget=budget, proposer=prop)
            res = eng.generate(p, max_new_tokens=new)
            assert res.output_ids == ref[:new]  # lossless
            diag.append(res.diagnosis)
        out[budget] = diag
    return out


@pytest.mark.parametrize("budget", [None, 4, 12])
def test_scripted_drafter_measured_and_predicted_tau_match_the_exact_value(scripted_runs, budget):
    diag = scripted_runs[budget]
    depths = [a for d in diag for a in d["depth"]]
    n = len(depths)
    mean = 1 + sum(depths) / n
    sd = (sum((1 + a - mean) ** 2 for a in depths) / (n - 1)) ** 0.5
    exact = exact_tau(PROBS, budget)
    assert abs(mean - exact) < 4 * sd / n ** 0.5 + 1e-9, (mean, exact)  # the engine does what the model says
    # the recorded ranks are the scripted ones: never past the third rank on the accepted path
    assert all(r < 3 for d in diag for rs in d["ranks"] for r in rs[:-1])
    assert all(len(rs) == min(a + 1, len(PROBS)) for d in diag for a, rs in zip(d["depth"], d["ranks"], strict=True))
    # the model from every run's records predicts this budget within a few standard errors
    st = D.collect([d for b in scripted_runs.values() for d in b], len(PROBS))
    pred, _ = D.predicted_curves(st, (1, 4, 12))
    assert abs(pred[1 if budget is None else budget] - exact) < 4 * sd / n ** 0.5 + 0.05, (pred, exact)


def test_scripted_drafter_off_path_accuracy_equals_main(scripted_runs):
    """Independence holds by construction: the off-path and depth-matched main-path accuracy agree."""
    st = D.collect([d for b in scripted_runs.values() for d in b], len(PROBS))
    acc = stats.main_vs_off(st)
    off, main = acc["off"], acc["depth_matched_main"]["rate"]
    assert off["n"] > 30 and off["lo"] - 0.05 < main < off["hi"] + 0.05


# a drafter whose scores do not track acceptance: over-confident in its top-1 at depths 1-2, so its trees go deep
# where the target's tokens are often its second choice (the random drafter's problem, scripted)
ACCEPT = [[0.55, 0.35, 0.05], [0.6, 0.3, 0.05], [0.7, 0.2, 0.05], [0.5, 0.3, 0.1]]
SCORES = [[0.9, 0.06, 0.03], [0.85, 0.1, 0.04], [0.8, 0.12, 0.05], [0.7, 0.2, 0.07]]


@pytest.fixture(scope="module")
def uncalibrated_runs():
    target = tiny_model("qwen3", seed=0, vocab_size=64)
    prompts = [torch.tensor([[3 + i, 5, 7 + i, 11]]) for i in range(3)]
    new = 100
    ar = Engine(target, None, method="ar")
    refs = [ar.generate(p, max_new_tokens=new + len(ACCEPT) + 2).output_ids for p in prompts]
    out = {}
    for budget in (None, 4, 12):
        diag = []
        for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
            prop = RankScriptedProposer(ref, 64, ACCEPT, budget, seed=7 + 100 * i + (budget or 0), scores=SCORES)
            eng = Engine(target, None, method="dflash" if budget is None else "ddtree", budget=budget, proposer=prop)
            res = eng.generate(p, max_new_tokens=new)
            assert res.output_ids == ref[:new]
            diag.append(res.diagnosis)
        out[budget] = diag
    return out


def _mean_sd(diag):
    depths = [a for d in diag for a in d["depth"]]
    n = len(depths)
    mean = 1 + sum(depths) / n
    return mean, (sum((1 + a - mean) ** 2 for a in depths) / (n - 1)) ** 0.5 / n ** 0.5


@pytest.mark.parametrize("calibration", [None, 4, 12])
def test_the_replay_predicts_a_drafter_whose_scores_do_not_track_acceptance(uncalibrated_runs, calibration):
    """Each job's records alone predict every budget's exact tau: the replay rebuilds each round's own tree from the
    drafter's recorded scores (exact up to the run's budget, the rank model below the known path past it). The best
    tree by measured acceptance (the rank model alone) is far off for this drafter."""
    diag = uncalibrated_runs[calibration]
    L = len(ACCEPT)
    st = D.collect(diag, L)
    assert model.replayable(diag)
    pred, _ = D.predicted_curves(st, (1, 4, 12), diag)
    rank_model, _ = D.predicted_curves(st, (1, 4, 12))
    _, se = _mean_sd(diag)
    for b in (4, 12):
        exact = exact_tau(ACCEPT, b, SCORES)
        measured, se_b = _mean_sd(uncalibrated_runs[b])
        assert abs(measured - exact) < 4 * se_b, (b, measured, exact)  # the engine does what the scripted drafter says
        assert abs(pred[b] - exact) < 4 * se + 0.03, (b, pred[b], exact)
        if b == 4:
            assert rank_model[b] - exact > 0.2, (rank_model[b], exact)  # the old model's optimism, for contrast
    assert pred[1] == pytest.approx(rank_model[1])  # the chain: the rank model is already the replay


def test_the_replay_is_exact_where_the_target_path_is_known():
    """Round by round, against the trees themselves: the replayed depth of a tree of budget b equals walking
    best_first_tree(b) of that round's rows along the target's tokens, wherever the recorded path decides it (always
    up to the budget run; past it, until the path's last recorded node is in the tree)."""
    target = tiny_model("qwen3", seed=0, vocab_size=64)
    p = torch.tensor([[4, 5, 9, 11]])
    ref = Engine(target, None, method="ar").generate(p, max_new_tokens=70).output_ids
    decided = 0
    for budget in (None, 12):
        prop = RankScriptedProposer(ref, 64, ACCEPT, budget, seed=3, scores=SCORES)
        dg = Engine(target, None, method="dflash" if budget is None else "ddtree", budget=budget,
                    proposer=prop).generate(p, max_new_tokens=60).diagnosis
        rounds = model._prepared(dg, 16)
        assert len(rounds) == len(prop.history)
        for (pos, logits), rnd in zip(prop.history, rounds, strict=True):
            needs, m = rnd.needs(), len(rnd.ranks)
            for b in range(1, 17):
                tree = best_first_tree(torch.tensor(ref[pos - 1]), torch.log_softmax(logits, -1), b, host=False)
                toks, pars = tree.tokens.tolist(), tree.parents.tolist()
                node, depth = 0, 0
                while pos + depth < len(ref):
                    kids = [i for i in range(len(toks)) if pars[i] == node and toks[i] == ref[pos + depth]]
                    if not kids:
                        break
                    node, depth = kids[0], depth + 1
                j = sum(n <= b for n in needs)
                if budget is not None and b <= budget:
                    assert j < m or m == len(ACCEPT)  # the run's own budget and below: always decided
                if j < m or m == len(ACCEPT):
                    decided += 1
                    assert rnd.depths([b], (None, None), 64) == [float(depth)], (budget, b, pos, needs)
    assert decided > 300


def test_jobs_at_different_temperatures_are_predicted_apart(uncalibrated_runs):
    """A sweep over temperatures: each job is predicted from the jobs at its own temperature, and the write-up holds."""
    def job(name, budget, temp, diag):
        depths = [a for d in diag for a in d["depth"]]
        return D.JobData(name, "dflash" if budget is None else "ddtree", budget,
                         {"tau": 1 + sum(depths) / len(depths), "temperature": temp}, [{"diagnosis": d} for d in diag])

    jobs = [job("c0", None, 0.0, uncalibrated_runs[None]), job("t0", 4, 0.0, uncalibrated_runs[4]),
            job("t1", 12, 1.0, uncalibrated_runs[12])]
    doc = D.diagnose(jobs)
    assert set(doc["predicted_by_temperature"]) == {0.0, 1.0}
    by = {m["name"]: m for m in doc["measured"]}
    assert by["t1"]["temperature"] == 1.0 and by["t1"]["predicted"] == pytest.approx(by["t1"]["accepted"])  # its own
    assert by["t0"]["predicted"] == pytest.approx(by["t0"]["accepted"])
    assert all(r["budget"] == 12 for r in doc["cross"] if r["calibration"] == "t1")
    md = "\n".join(text.markdown_section(doc, []))
    assert "(T=1)" in md and "| t1 (12) |" in md


def test_chain_rounds_that_never_reach_the_last_position_are_diagnosed():
    """A DFlash-only sweep: chain rounds carry no per-depth node counts, so the statistics' depth came from the deepest
    accepted path; where no round reached the drafter's last position, the replay's continuation below the known path
    read past the tables (an IndexError in `continuation`). The statistics cover every position the rounds drafted."""
    target = tiny_model("qwen3", seed=0, vocab_size=64)
    p = torch.tensor([[4, 5, 9, 11]])
    ref = Engine(target, None, method="ar").generate(p, max_new_tokens=50).output_ids
    probs = [[0.3, 0.3, 0.2]] * 8  # a weak top-1: a chain of 8 accepted is ~1 in 15,000
    prop = RankScriptedProposer(ref, 64, probs, None, seed=5)
    dg = Engine(target, None, method="dflash", proposer=prop).generate(p, max_new_tokens=40).diagnosis
    assert max(len(r) for r in dg["ranks"]) < len(probs) == len(dg["rows"][0])  # the case: no round reached it
    job = D.JobData("c", "dflash", None, {"tau": 1 + sum(dg["depth"]) / len(dg["depth"]), "temperature": 0.0},
                    [{"diagnosis": dg}])
    doc = D.diagnose([job])
    assert doc["drafter_positions"] == len(probs)
    assert all(math.isfinite(t) and t >= 1 for t in doc["predicted"].values()), doc["predicted"]


def test_recording_off_records_nothing():
    target = tiny_model("qwen3", seed=0, vocab_size=64)
    p = torch.tensor([[3, 5, 7]])
    ref = Engine(target, None, method="ar").generate(p, max_new_tokens=20).output_ids
    eng = Engine(target, None, method="ddtree", budget=4, proposer=RankScriptedProposer(ref, 64, PROBS, 4),
                 record=False)
    assert eng.generate(p, max_new_tokens=12).diagnosis is None


# ---------------------------------------------------------------- the CLI


def _run(args, cwd, module="ddtree.run", timeout=600):
    # this checkout's ddtree, whatever the venv's editable install points at
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DDTREE_TRACEBACK": "", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_cli_diagnoses_a_toy_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _run(["+experiment=toy", "method=dflash,ddtree", "budget=8,32", "dataset.max_samples=6",
                 "max_new_tokens=48", "tracking=none", f"runs_dir={tmp_path}/runs", f"hydra.sweep.dir={sweep}", "-m"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run([str(sweep)], tmp_path, module="ddtree.diagnose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((sweep / "diagnosis.json").read_text())
    assert {m["budget"] for m in doc["measured"]} == {1, 8, 32}
    for m in doc["measured"]:
        assert m["predicted"] == pytest.approx(m["accepted"], rel=0.25), m  # few prompts: a loose check here
    assert doc["verdict"].split(":")[0] in {"drafter-limited", "tree-limited", "verification-limited"}
    assert doc["verdict"] in proc.stdout
    md = (sweep / "diagnosis.md").read_text()
    assert doc["verdict"] in md and "| budget |" in md
    for name in doc["plots"]:
        assert (sweep / name).stat().st_size > 1000
    assert {"diagnosis_depth.png", "diagnosis_tau.png", "diagnosis_speedup.png"} <= set(doc["plots"])
    # a single job dir works too, and a user's cost table replaces the measured one
    job = next(p.parent for p in sweep.rglob("summary.json") if json.loads(p.read_text())["method"] == "ddtree")
    table = tmp_path / "cost.csv"
    table.write_text("budget,ms\nar,10\n1,12\n8,13\n32,20\n")
    proc = _run([str(job), "--cost", str(table), "--out", str(tmp_path / "one")], tmp_path, module="ddtree.diagnose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "diagnosis.json").read_text())
    assert one["cost"]["source"] == "table" and one["best_budget"] in (1, 2, 4, 8, 16, 32)


def test_diagnose_refuses_a_dir_without_jobs_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        D.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "no finished job" in err
    bad = tmp_path / "cost.csv"
    bad.write_text("budget,ms\nx,y\n")
    with pytest.raises(SystemExit) as e:
        D.main([str(REPO / "assets"), "--cost", str(bad)])  # no jobs there either: the first problem is named
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error:")
    with pytest.raises(ConfigError, match="cost"):
        D.read_cost_table(bad)


@pytest.mark.slow  # CLI subprocesses, ~30 s: make test-slow
def test_cli_diagnoses_a_tiny_sweep_and_picks_a_budget(tmp_path):
    """The random-drafter tiny pair: a sweep, its diagnosis, and budget=auto (calibration, costs, choice, outcome)."""
    small = ["model=tiny_qwen3", "dataset=tiny", "dataset.max_samples=2", "max_new_tokens=10", "tracking=none",
             "validation=off", f"runs_dir={tmp_path}/runs"]
    sweep = tmp_path / "sweep"
    proc = _run([*small, "method=dflash,ddtree", "budget=4", f"hydra.sweep.dir={sweep}", "-m"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    D.main([str(sweep), "--no-plots"])  # python -m ddtree.diagnose, in this process
    doc = json.loads((sweep / "diagnosis.json").read_text())
    assert {(m["method"], m["budget"]) for m in doc["measured"]} == {("dflash", 1), ("ddtree", 4)}
    assert doc["rounds"] > 0 and doc["verdict"] in (sweep / "diagnosis.md").read_text()

    job = tmp_path / "auto"
    proc = _run([*small, "budget=auto", "auto.prompts=1", "auto.candidates=[2,4]", "auto.cost_tokens=4",
                 f"hydra.run.dir={job}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    auto = summary["auto_budget"]
    assert summary["budget"] == auto["chosen"] in (2, 4) and set(auto["predicted_tau"]) == {"2", "4"}
    assert auto["outcome"]["measured_tau"] == summary["tau"] and "budget=auto outcome" in proc.stdout
    # budget=auto is for DDTree at T = 0: one line, exit 2, before model work
    proc = _run([*small, "budget=auto", "method=dflash"], tmp_path)
    assert proc.returncode == 2 and "budget=auto" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.slow  # a CLI sweep, ~15 s: make test-slow
def test_cli_diagnoses_a_dflash_sweep_whose_rounds_stop_short(tmp_path):
    """A DFlash-only sweep through the CLI where no round reaches the drafter's last position (max_new_tokens=3: the
    replay's continuation once read past the statistics, an IndexError) and where jobs run no round at all
    (max_new_tokens=1, as an output that stops on its first token: the cross predictions once took the max of no
    budgets). Jobs without rounds are not diagnosed; alone, they give the "no diagnosis" verdict."""
    small = ["model=tiny_qwen3", "dataset=tiny", "dataset.max_samples=2", "tracking=none", "validation=off",
             "baseline=false", "warmup=false", f"runs_dir={tmp_path}/runs"]
    sweep = tmp_path / "sweep"
    proc = _run([*small, "method=dflash", "max_new_tokens=1,3", f"hydra.sweep.dir={sweep}", "-m"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    D.main([str(sweep), "--no-plots"])  # python -m ddtree.diagnose, in this process
    doc = json.loads((sweep / "diagnosis.json").read_text())
    assert [m["budget"] for m in doc["measured"]] == [1] and doc["rounds"] > 0
    assert sorted(j["rounds"] for j in doc["jobs"])[0] == 0
    zeros = tmp_path / "zeros"  # two jobs that ran no round
    for name in ("a", "b"):
        shutil.copytree(sweep / "0", zeros / name)
    D.main([str(zeros), "--no-plots"])
    assert json.loads((zeros / "diagnosis.json").read_text())["verdict"].startswith("no diagnosis")
