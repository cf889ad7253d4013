"""Is this output right? Every generated token checked against one teacher-forced target forward.

Exact match with a baseline is no test in bf16: cached decoding, tree verification and a full forward
round differently, and a near-tie can flip. This module asks the question that holds in any dtype:

* T = 0: at every generated position the emitted token is the target's argmax within a tolerance
  (`Tolerance`: `steps` representable steps of the decoding dtype at the logits' magnitude, or a floor
  calibrated from the AR baseline's own cached-vs-teacher-forced drift, whichever is larger).
* T > 0: every emitted token has a non-negligible target probability (below `false_alarm / (N * V)`,
  a sampled output would trip the check with probability under `false_alarm`).
* Stops and lengths: a stop token the target did not choose, tokens after a stop, or an output shorter
  than `max_new_tokens` without a stop is suspect.
* A second opinion at every miss: the target disagrees with itself when a computation's shape changes (a MoE
  router near a tie picks other experts in one forward over the sequence than in a cached step). Before a token
  is called suspect, its position is computed the ways decoding computes it (`Validator._second_opinions`: the
  prefix through the cache and the position alone, the method's round block, decoding replayed round by round,
  on transformers' own model, never the engine judged); a token that passes under one of them is a shape tie
  (`OutputCheck.shape_ties`: both logits under each computation, and each MoE layer's router margin there), and
  only a token that loses under all of them stays a miss. The calibration leaves routing flips out.

Against a baseline each method output gets one verdict: `exact` (equal, and the shared output passes),
`tie` (they diverge, yet every position of both passes; or some position is a shape tie), `ok` (passes; nothing
to compare: T > 0 or no baseline) or `suspect` (with the evidence and the side that failed). No Hydra, no MLflow.
The statistics it and the reports use (p-values, PIT, chi-square) live in ddtree.engine.stats.

    v = Validator(target, stop_token_ids=[eos], max_new_tokens=256)
    v.calibrate([(prompt_ids, baseline_ids)])
    verdict = v.verdict(prompt_ids, method_ids, baseline_ids)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from ddtree.engine.stats import token_logprobs

VERDICTS = ("exact", "tie", "ok", "suspect")
_DRIFT_TOPK = 8  # drift is measured on the tokens that compete for the argmax, not on the far tail


@dataclass
class ValidationRule:
    """The configurable rule (documented in docs/validation.md)."""

    steps: float = 4.0  # a margin up to this many dtype steps at the logits' magnitude is a tie
    calibrate: bool = True  # derive a floor from the baseline's cached-vs-teacher-forced drift
    calibration_factor: float = 2.0  # floor = factor x the largest drift (a margin moves with two logits)
    calibration_outputs: int = 4  # baseline outputs re-decoded for the calibration (one AR pass each) ...
    calibration_tokens: int = 64  # ... over at most this many of their first tokens
    rescore_dtype: str | None = None  # e.g. "float32": teacher-force in a wider dtype (weights cast, restored)
    false_alarm: float = 1e-3  # T > 0: per-output chance that a correct sampled output is called suspect
    max_evidence: int = 3  # failing positions kept per output


def dtype_step(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of representable `dtype` values at |magnitude| (one ulp), elementwise, float32."""
    fi = torch.finfo(dtype)
    mag = magnitude.float().abs().clamp(min=fi.tiny)
    _, exponent = torch.frexp(mag)  # mag = m * 2**e with m in [0.5, 1): the binade starts at 2**(e-1)
    return torch.ldexp(torch.full_like(mag, fi.eps), exponent - 1)


@dataclass
class Tolerance:
    """How far below the target's best logit an emitted token's logit may be and still count as its choice."""

    dtype: str  # the decoding dtype, whose steps count
    steps: float
    floor: float = 0.0  # logit units, from the calibration
    drift_max: float | None = None  # the largest cached-vs-teacher-forced drift the calibration saw
    drift_median: float | None = None
    calibrated_positions: int = 0
    routing_flips: int = 0  # calibration positions left out: a router chose other experts under the two computations

    def allowed(self, magnitude: torch.Tensor) -> torch.Tensor:
        return (self.steps * dtype_step(getattr(torch, self.dtype), magnitude)).clamp(min=self.floor)

    def in_steps(self, margin: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
        return margin / dtype_step(getattr(torch, self.dtype), magnitude)


@dataclass
class Miss:
    """One position an output fails at (position 0 = the first generated token)."""

    position: int
    kind: str  # not_argmax | improbable | stop_not_chosen | after_stop | short_without_stop | too_long
    emitted: int | None  # None: the output ended here
    expected: int | None  # the target's argmax here (teacher-forced)
    emitted_logit: float | None = None
    expected_logit: float | None = None
    margin: float | None = None  # expected_logit - emitted_logit
    margin_steps: float | None = None  # in steps of the decoding dtype at that magnitude
    allowed: float | None = None
    logprob: float | None = None  # T > 0: the emitted token's target log-probability
    emitted_rank: int | None = None  # tokens the target scores strictly above the emitted one (1: the runner-up)
    # the computations asked for a second opinion (each its argmax, both logits, margin, routing): it lost in all
    computations: list[dict[str, Any]] | None = None


@dataclass
class OutputCheck:
    """One output against its own teacher-forced forward."""

    ok: bool
    length: int
    num_misses: int = 0
    misses: list[Miss] = field(default_factory=list)  # the first `max_evidence`
    near_ties: int = 0  # positions whose token is not the exact argmax, but within tolerance
    worst_margin_steps: float = 0.0
    mean_logprob: float | None = None  # mean target log-probability per token (at the run's temperature)
    min_logprob: float | None = None
    # positions the one forward calls misses that pass where the target computes them as decoding does: how many,
    # and the first `max_evidence`' evidence (both logits under each computation, each MoE layer's routing)
    num_shape_ties: int = 0
    shape_ties: list[dict[str, Any]] = field(default_factory=list)

    @property
    def first_miss(self) -> Miss | None:
        return self.misses[0] if self.misses else None


@dataclass
class Verdict:
    verdict: str  # one of VERDICTS
    reason: str  # one line
    side: str | None = None  # suspect: method | baseline | both
    position: int | None = None  # suspect: the first failing position of the failing side
    divergence: dict[str, Any] | None = None  # where method and baseline part, with both tokens' logits
    method: OutputCheck | None = None
    baseline: OutputCheck | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def _cast(model: PreTrainedModel, dtype: torch.dtype | None):
    """Temporarily hold the model's floating tensors in `dtype`; restored exactly (bf16 -> fp32 -> bf16 is lossless)."""
    if dtype is None or dtype == model.dtype:
        yield
        return
    kept = [(t, t.data) for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()]
    try:
        for t, data in kept:
            t.data = data.to(dtype)
        yield
    finally:
        for t, data in kept:
            t.data = data


def _device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


def _ids(x: Sequence[int] | torch.Tensor) -> list[int]:
    return x.reshape(-1).tolist() if isinstance(x, torch.Tensor) else [int(t) for t in x]


@torch.no_grad()
def teacher_forced_logits(model: PreTrainedModel, prompt_ids: Sequence[int] | torch.Tensor,
                          output_ids: Sequence[int], rescore_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[N + 1, V] float32: row i is the target's logits after prompt + output[:i], from one forward, no cache."""
    prompt, out = _ids(prompt_ids), _ids(output_ids)
    ids = torch.tensor([prompt + out], dtype=torch.long, device=_device(model))
    with _cast(model, rescore_dtype):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(out) + 1).logits
    return logits[0].float()


@torch.no_grad()
def cached_decode_logits(model: PreTrainedModel, prompt_ids: Sequence[int] | torch.Tensor,
                         output_ids: Sequence[int]) -> torch.Tensor:
    """[N, V] float32: the logits AR decoding saw at each position (the engine's cached path, token by token)."""
    from ddtree.engine.target import TargetSession
    from ddtree.engine.tree import root_tree

    prompt, out = _ids(prompt_ids), _ids(output_ids)
    dev = _device(model)
    session = TargetSession(model, capacity=len(prompt) + len(out) + 1)
    row, _ = session.prefill(torch.tensor([prompt], dtype=torch.long, device=dev))
    rows = [row.float()]
    for tok in out[:-1]:
        tree = root_tree(torch.tensor(tok, device=dev))
        logits, _ = session.verify(tree)
        session.commit(tree, torch.zeros(1, dtype=torch.long, device=dev))
        rows.append(logits[0].float())
    return torch.stack(rows)


@dataclass
class DecodeShape:
    """How decoding computed an output (the second opinion's shapes): `width`, the target rows one round verified
    (1: AR; DFlash: its block; DDTree: budget + 1), and the tokens each round committed, bonus included
    (`acceptance_lengths`; None: unknown, taken as AR's one a round). The prefill emitted position 0."""

    width: int = 1
    acceptance_lengths: Sequence[int] | None = None

    def rounds(self, n: int) -> list[tuple[int, int]]:
        """(first output position, tokens committed) of every round over an output of `n` tokens: a round fed
        out[start - 1] (its root) and the tokens it accepted, and its row j predicted out[start + j]."""
        out, start = [], 1
        for a in (self.acceptance_lengths if self.acceptance_lengths is not None else ()):
            if start >= n:
                break
            out.append((start, int(a)))
            start += int(a)
        out.extend((p, 1) for p in range(start, n))  # past (or without) the record: one a round
        return out

    def round_of(self, position: int, n: int) -> tuple[int, int]:
        """(start, row) of the round that emitted `position` (> 0)."""
        return next((s, position - s) for s, a in self.rounds(n) if s <= position < s + a)


def _tokens(ids: list[int], start: int, n: int) -> list[int]:
    """ids[start:start + n], padded with the last id (rows past an output's end: a causal row never sees them)."""
    got = ids[start:start + n]
    return got + [ids[-1]] * (n - len(got))


class _CachedTarget:
    """The target fed in consecutive blocks through one cache (transformers' own model and DynamicCache), as
    decoding feeds it: `feed(n, rows)` gives the float32 logits at those rows of the next `n` tokens and, for a MoE
    target, each router's choice there."""

    def __init__(self, model: PreTrainedModel, ids: list[int], step):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.model, self.ids, self.step = model, ids, step
        self.cache = DynamicCache(config=model.config)
        self.fed = 0
        self.kept: dict[int, tuple[torch.Tensor, list[dict[str, Any]] | None]] = {}  # a replay's rows so far
        # a cache of plain attention layers only can drop a block's rejected rows (sliding and linear-attention
        # layers cannot: a replay then feeds a round's committed rows alone)
        self.croppable = all(type(layer) is DynamicLayer for layer in self.cache.layers)

    @torch.no_grad()
    def feed(self, n: int, rows: Sequence[int] = (), width: int = 0
             ) -> dict[int, tuple[torch.Tensor, list[dict[str, Any]] | None]]:
        """The next `n` tokens, fed as one block (`width` > n and a croppable cache: a block of `width`, the rows
        past `n` dropped after, as a verification keeps only what it accepted). Rows are absolute token indices
        inside the block (the row at index t predicts token t + 1)."""
        from ddtree.engine.routing import RouterTrace, routing_margins

        start, here = self.fed, [t - self.fed for t in rows]
        size = width if width > n and self.croppable else n
        ids = torch.tensor([_tokens(self.ids, start, size)], dtype=torch.long, device=_device(self.model))
        keep = torch.tensor(here or [n - 1], dtype=torch.long, device=ids.device)
        with RouterTrace(self.model, rows=here or [n - 1]) as trace:
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep).logits[0]
        if size > n:
            self.cache.crop(n - size)
        self.fed += n
        return {start + r: (logits[k].float(), routing_margins(trace, k, self.step) if trace.moe else None)
                for k, r in enumerate(here)}


_RESHAPED = ("not_argmax", "improbable", "stop_not_chosen")  # misses a computation's shape can make


def drift(cached: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Per position: the largest |cached - teacher-forced| logit over the cached top tokens ([N])."""
    top = cached.topk(min(_DRIFT_TOPK, cached.shape[-1]), dim=-1).indices
    return (cached.gather(-1, top) - forced.gather(-1, top)).abs().max(dim=-1).values


def _f(x: torch.Tensor | float) -> float:
    return float(f"{float(x):.6g}")  # six significant digits: fp32 steps at small logits are ~1e-7


class Validator:
    """Checks outputs of one target under one run's settings; holds the (calibrated) tolerance."""

    def __init__(self, model: PreTrainedModel, *, rule: ValidationRule | None = None, temperature: float = 0.0,
                 stop_token_ids: Iterable[int] = (), max_new_tokens: int | None = None):
        self.model = model
        self.rule = rule or ValidationRule()
        self.temperature = temperature
        self.stops = set(stop_token_ids)
        self.max_new_tokens = max_new_tokens
        self.rescore = getattr(torch, self.rule.rescore_dtype) if self.rule.rescore_dtype else None
        self.tolerance = Tolerance(dtype=str(model.dtype).removeprefix("torch."), steps=self.rule.steps)

    # ------------------------------------------------------------ calibration

    def calibrate(self, baselines: Iterable[tuple[Sequence[int] | torch.Tensor, Sequence[int]]]) -> Tolerance:
        """Re-decode up to `calibration_outputs` baseline outputs the AR way; floor = factor x the largest drift.
        On a MoE target an output's positions from the first row whose routers chose other experts in the two
        computations on are left out (`routing_flips`: such rows): a flip moves logits by far more than rounding
        (at its row, and after it through the attention to it), and is judged where it matters by the second
        opinion, not by widening every position's tolerance."""
        from ddtree.engine.routing import RouterTrace

        drifts, flips = [], 0
        for prompt, out in itertools.islice(baselines, self.rule.calibration_outputs):
            out = _ids(out)[: self.rule.calibration_tokens]
            if not out:
                continue
            with RouterTrace(self.model, scores=False) as cached_routes:
                cached = cached_decode_logits(self.model, prompt, out)
            with RouterTrace(self.model, scores=False) as forced_routes:
                forced = teacher_forced_logits(self.model, prompt, out, self.rescore)[: len(cached)]
            d = drift(cached, forced)
            if cached_routes.moe:  # from the first position whose routers chose other experts: not drift
                a, b = cached_routes.chosen(), forced_routes.chosen()[: len(cached_routes.chosen())]
                flipped = [r for r, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
                flips += len(flipped)
                if flipped:  # rows: the prompt's, then one a token; row p - 1 + i predicted out[i]
                    d = d[: max(0, flipped[0] - (len(a) - len(d)))]
            drifts.append(d)
        self.tolerance.routing_flips = flips
        if drifts and sum(d.numel() for d in drifts):
            d = torch.cat(drifts)
            self.tolerance.drift_max, self.tolerance.drift_median = _f(d.max()), _f(d.median())
            self.tolerance.floor = _f(self.rule.calibration_factor * d.max())
            self.tolerance.calibrated_positions = int(d.numel())
        return self.tolerance

    # ------------------------------------------------------------ one output

    def check(self, prompt_ids: Sequence[int] | torch.Tensor, output_ids: Sequence[int],
              logits: torch.Tensor | None = None, shape: DecodeShape | None = None) -> tuple[OutputCheck, torch.Tensor]:
        """(the check, the teacher-forced logits [N + 1, V]). Every position is checked, not only the first; a miss
        is asked a second opinion (`shape`: how decoding computed the output; None: AR's token by token)."""
        out = _ids(output_ids)
        if logits is None:
            logits = teacher_forced_logits(self.model, prompt_ids, out, self.rescore)
        n = len(out)
        misses: list[Miss] = []
        check = OutputCheck(ok=True, length=n)
        if n:
            rows = logits[:n]
            emitted = torch.tensor(out, device=rows.device)
            best_logit, best = rows.max(dim=-1)
            own = rows.gather(-1, emitted[:, None])[:, 0]
            margin = best_logit - own
            magnitude = torch.maximum(best_logit.abs(), own.abs())
            allowed = self.tolerance.allowed(magnitude)
            steps = self.tolerance.in_steps(margin, magnitude)
            logprob = token_logprobs(rows, out, self.temperature)
            check.mean_logprob, check.min_logprob = _f(logprob.mean()), _f(logprob.min())
            check.worst_margin_steps = _f(steps.max())
            if self.temperature > 0:
                bad = logprob < math.log(self.rule.false_alarm / (n * rows.shape[-1]))
            else:
                bad = margin > allowed
                check.near_ties = int(((best != emitted) & ~bad).sum())
            for i in bad.nonzero()[:, 0].tolist():
                kind = "stop_not_chosen" if out[i] in self.stops else ("improbable" if self.temperature > 0
                                                                       else "not_argmax")
                misses.append(Miss(i, kind, out[i], int(best[i]), _f(own[i]), _f(best_logit[i]), _f(margin[i]),
                                   _f(steps[i]), _f(allowed[i]), _f(logprob[i]), int((rows[i] > own[i]).sum())))
            if misses:
                misses = self._second_opinions(_ids(prompt_ids), out, misses, rows, shape or DecodeShape(), check)
        stop_at = next((i for i, tok in enumerate(out) if tok in self.stops), None)
        if stop_at is not None and stop_at < n - 1:
            misses.append(Miss(stop_at + 1, "after_stop", out[stop_at + 1], None))
        cap = self.max_new_tokens
        if cap is not None and n > cap:
            misses.append(Miss(cap, "too_long", out[cap], None))
        elif cap is not None and n < cap and stop_at is None:
            misses.append(Miss(n, "short_without_stop", None, int(logits[n].argmax()),
                               expected_logit=_f(logits[n].max())))
        misses.sort(key=lambda m: m.position)
        check.ok = not misses
        check.num_misses = len(misses)
        check.misses = misses[: self.rule.max_evidence]
        return check, logits

    # ------------------------------------------------------------ the second opinion

    def _judge(self, row: torch.Tensor, token: int, expected: int, n: int, name: str) -> dict[str, Any]:
        """One computation's evidence at a position: its argmax, both tokens' logits, the margin, and whether the
        emitted token passes there (T = 0: within the tolerance of its argmax; T > 0: not improbable)."""
        best_logit, best = row.max(dim=-1)
        own = row[token]
        margin = best_logit - own
        mag = torch.maximum(best_logit.abs(), own.abs())
        if self.temperature > 0:
            lp = torch.log_softmax(row / self.temperature, dim=-1)[token]
            passes = bool(lp >= math.log(self.rule.false_alarm / (n * row.shape[-1])))
        else:
            passes = bool(margin <= self.tolerance.allowed(mag))
        return {"computation": name, "argmax": int(best), "emitted_logit": _f(own), "expected_logit": _f(row[expected]),
                "margin": _f(margin), "margin_steps": _f(self.tolerance.in_steps(margin, mag)), "passes": passes}

    def _second_opinions(self, prompt: list[int], out: list[int], misses: list[Miss], forced: torch.Tensor,
                         shape: DecodeShape, check: OutputCheck) -> list[Miss]:
        """Each miss's position computed the ways decoding computes it, cheapest first: the prefix through the
        cache and the position alone (position 0: the prompt alone, the prefill), the method's round block (the
        prefix to the round's start, then `width` rows with the position at its row), then decoding replayed from
        the prompt round by round (one pass, resumed from miss to miss). A token that passes under one of them is a
        shape tie (recorded in `check.shape_ties`, taken out of the misses); the first one that loses under all of
        them stays, with what was tried, and the misses after it are not asked (the output is suspect already)."""
        from ddtree.engine.routing import RouterTrace, routing_margins

        n, p = len(out), len(prompt)
        ids, dtype = prompt + out, getattr(torch, self.tolerance.dtype)

        def step(magnitude: torch.Tensor) -> torch.Tensor:
            return dtype_step(dtype, magnitude)

        asked = [m for m in misses if m.kind in _RESHAPED and m.emitted is not None and m.position < n]
        if not asked:
            return misses
        routing: dict[int, list[dict[str, Any]]] = {}
        with RouterTrace(self.model, rows=[p + m.position - 1 for m in asked]) as trace:
            if trace.moe:  # the one forward's routing at the misses (the logits are had already)
                with _cast(self.model, self.rescore), torch.no_grad():
                    self.model(input_ids=torch.tensor([ids], device=_device(self.model)), use_cache=False,
                               logits_to_keep=1)
                routing = {m.position: routing_margins(trace, k, step) for k, m in enumerate(asked)}
        replay, rounds, wanted = None, shape.rounds(n), {p + m.position - 1 for m in asked}
        tied: set[int] = set()
        for m in asked:
            i, tok, exp = m.position, m.emitted, m.expected
            tf = {**self._judge(forced[i], tok, exp, n, "one forward over the sequence"), "passes": False}
            tried = [{**tf, "routing": routing.get(i)}]
            ways = [("the prompt alone (the prefill)", [p])] if i == 0 else [("the prefix cached, the position alone",
                                                                              [p + i - 1, 1])]
            s, j = shape.round_of(i, n) if i > 0 else (0, 0)
            if i > 0 and shape.width > 1 and j < shape.width:
                ways.append((f"the prefix cached to its round, then the round's block of {shape.width} (row {j})",
                             [p + s - 1, shape.width]))
            passed = None
            for name, chunks in ways:
                target = _CachedTarget(self.model, ids, step)
                for c in chunks[:-1]:
                    target.feed(c)
                row, rt = target.feed(chunks[-1], [p + i - 1])[p + i - 1]
                tried.append({**self._judge(row, tok, exp, n, name), "routing": rt})
                if tried[-1]["passes"]:
                    passed = tried[-1]
                    break
            if passed is None and i > 0:  # decoding replayed: the prompt, then every round's committed rows
                if replay is None:
                    replay = _CachedTarget(self.model, ids, step)
                    replay.feed(p)
                while replay.fed <= p + i - 1:  # only the rows of misses are kept (a row is V logits)
                    s, a = next((s, a) for s, a in rounds if p + s - 1 == replay.fed)
                    replay.kept.update(replay.feed(a, [r for r in range(p + s - 1, p + s - 1 + a) if r in wanted],
                                                   width=shape.width))
                row, rt = replay.kept[p + i - 1]
                how = ("token by token" if shape.width == 1 else
                       f"blocks of {shape.width}, the committed rows kept" if replay.croppable else
                       "its rounds' committed rows")
                tried.append({**self._judge(row, tok, exp, n, f"decoding replayed from the prompt ({how})"),
                              "routing": rt})
                passed = tried[-1] if tried[-1]["passes"] else None
            if passed is None:
                m.computations = tried
                break
            tied.add(i)
            flips = [a["layer"] for a, b in zip(routing.get(i) or [], passed["routing"] or [], strict=False)
                     if a["experts"] != b["experts"]]
            check.num_shape_ties += 1
            if len(check.shape_ties) < self.rule.max_evidence:
                check.shape_ties.append({"position": i, "kind": m.kind, "emitted": tok, "expected": exp,
                                         "computations": tried, "flipped_layers": flips})
        return [m for m in misses if m.position not in tied or m.kind not in _RESHAPED]

    # ------------------------------------------------------------ against the baseline

    def verdict(self, prompt_ids: Sequence[int] | torch.Tensor, method_ids: Sequence[int],
                baseline_ids: Sequence[int] | None = None,
                baseline_check: OutputCheck | None = None, shape: DecodeShape | None = None) -> Verdict:
        """One method output's verdict; `baseline_check` reuses the baseline's check when several methods share it;
        `shape`: how the method computed its output (its second opinions' shapes; None: AR's)."""
        m, (mc, mlog) = _ids(method_ids), self.check(prompt_ids, method_ids, shape=shape)
        if baseline_ids is None:
            if mc.ok and mc.num_shape_ties and self.temperature == 0:
                return Verdict("tie", f"no baseline; {shape_tie_line(mc, self.tolerance.dtype)}", method=mc)
            if mc.ok:
                return Verdict("ok", "every token is the target's choice within tolerance (no baseline)", method=mc)
            return _suspect(mc, None, None, self.tolerance)
        b = _ids(baseline_ids)
        bc = baseline_check if baseline_check is not None else (mc if b == m else self.check(prompt_ids, b)[0])
        div = _divergence(m, b, mlog, self.tolerance)
        if not mc.ok or not bc.ok:
            return _suspect(mc, bc, div, self.tolerance)
        if self.temperature > 0:
            return Verdict("ok", "every token has non-negligible target probability", divergence=div,
                           method=mc, baseline=bc)
        shaped = next((c for c in (mc, bc) if c.num_shape_ties), None)
        if div is None and shaped is None:
            return Verdict("exact", "equals the baseline; every token is the target's choice", method=mc, baseline=bc)
        if div is None:
            return Verdict("tie", f"equals the baseline; {shape_tie_line(shaped, self.tolerance.dtype)}",
                           method=mc, baseline=bc)
        at = div["position"]
        line = f"; {shape_tie_line(shaped, self.tolerance.dtype)}" if shaped is not None else ""
        return Verdict("tie", f"diverges from the baseline at {at} ({div['margin_steps']} {self.tolerance.dtype} "
                       f"steps apart); every position of both passes{line}", divergence=div, method=mc, baseline=bc)


def method_side_verdict(record: dict[str, Any], temperature: float) -> str:
    """The verdict of one output judged on its own side, from its stored verdict record (`Verdict` as
    ddtree.pipeline.output_verdicts stores it): `suspect` where the method's side failed (a baseline that failed its
    own check does not count against it), `ok` at T > 0, `tie` where a token was a near tie or a shape tie (the target
    picks it where it computes the position as decoding does), else `exact`. Validator.verdict's rule, for a judge of
    another engine's outputs (python -m ddtree.check), not a second one."""
    if record["verdict"] == "suspect" and record.get("side") in ("method", "both"):
        return "suspect"
    if temperature > 0:
        return "ok"
    return "tie" if record.get("near_ties") or record.get("num_shape_ties") else "exact"


def shape_tie_line(check: OutputCheck, dtype: str) -> str:
    """One line on an output's first shape tie (docs/validation.md: the MiniMax-M2 example)."""
    t = check.shape_ties[0]
    tf = t["computations"][0]
    ok = next(c for c in t["computations"] if c["passes"])
    more = f" (and {check.num_shape_ties - 1} more)" if check.num_shape_ties > 1 else ""
    routed = (f"; the routers of layer(s) {', '.join(map(str, t['flipped_layers']))} chose other experts"
              if t["flipped_layers"] else "")
    return (f"position {t['position']} is a shape tie{more}: token {t['emitted']} loses to {t['expected']} in one "
            f"forward over the sequence ({tf['emitted_logit']:.4g} vs {tf['expected_logit']:.4g}, "
            f"{tf['margin_steps']:.1f} {dtype} steps) but passes in {ok['computation']} ({ok['emitted_logit']:.4g} vs "
            f"{ok['expected_logit']:.4g}){routed}")


def _divergence(m: list[int], b: list[int], m_logits: torch.Tensor, tol: Tolerance) -> dict[str, Any] | None:
    """Where method and baseline part; both tokens' logits in the shared context (the method's forward)."""
    j = next((i for i, (x, y) in enumerate(zip(m, b, strict=False)) if x != y), None)
    if j is None:
        if len(m) == len(b):
            return None
        j = min(len(m), len(b))
    row = m_logits[j]
    mt = m[j] if j < len(m) else None
    bt = b[j] if j < len(b) else None
    d: dict[str, Any] = {"position": j, "method_token": mt, "baseline_token": bt, "argmax": int(row.argmax())}
    if mt is not None and bt is not None:
        ml, bl = row[mt], row[bt]
        d.update(method_logit=_f(ml), baseline_logit=_f(bl), margin=_f((ml - bl).abs()),
                 margin_steps=_f(tol.in_steps((ml - bl).abs(), torch.maximum(ml.abs(), bl.abs()))))
    else:
        d.update(margin=None, margin_steps=None)
    return d


def _suspect(mc: OutputCheck, bc: OutputCheck | None, div: dict[str, Any] | None, tol: Tolerance) -> Verdict:
    side = "both" if (not mc.ok and bc is not None and not bc.ok) else ("method" if not mc.ok else "baseline")
    first = (mc if not mc.ok else bc).first_miss
    what = {"not_argmax": "is not the target's choice", "improbable": "has negligible target probability",
            "stop_not_chosen": "is a stop token the target did not choose",
            "after_stop": "follows a stop token", "too_long": "is past max_new_tokens",
            "short_without_stop": "is missing: the output ended without a stop token"}[first.kind]
    tok = f"token {first.emitted}" if first.emitted is not None else "a token"
    detail = ""
    if first.margin is not None:
        detail = (f" (margin {first.margin:.4g} = {first.margin_steps:.1f} {tol.dtype} steps > allowed "
                  f"{first.allowed:.4g}; the target wanted {first.expected})")
    elif first.expected is not None:
        detail = f" (the target wanted {first.expected})"
    if first.computations:
        detail += f"; it loses in all {len(first.computations)} computations of that position tried"
    return Verdict("suspect", f"{side}: {tok} at position {first.position} {what}{detail}", side=side,
                   position=first.position, divergence=div, method=mc, baseline=bc)


@dataclass
class JobValidation:
    """A job's verdicts: counts over method outputs, the tolerance used, the first suspects' evidence."""

    checked: int = 0
    exact: int = 0
    tie: int = 0
    ok: int = 0
    suspect: int = 0
    baseline_suspect: int = 0  # baseline outputs that failed their own check (cached decoding drifted)
    shape_ties: int = 0  # positions (method and baseline outputs) that pass only computed as decoding did
    tolerance: dict[str, Any] = field(default_factory=dict)
    rule: dict[str, Any] = field(default_factory=dict)
    logprob_pvalue: float | None = None  # T > 0: paired sign-flip test, method vs baseline mean log-prob
    logprob_mean_difference: float | None = None
    first_suspects: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0  # the whole validation ...
    calibration_seconds: float = 0.0  # ... of which the calibration's AR re-decoding

    def add(self, verdict: Verdict, key: dict[str, Any] | None = None, max_suspects: int = 3) -> None:
        self.checked += 1
        setattr(self, verdict.verdict, getattr(self, verdict.verdict) + 1)
        if verdict.verdict == "suspect" and len(self.first_suspects) < max_suspects:
            self.first_suspects.append({**(key or {}), "reason": verdict.reason, "side": verdict.side,
                                        "position": verdict.position, "divergence": verdict.divergence,
                                        "misses": [asdict(x) for x in _misses(verdict)]})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _misses(v: Verdict) -> list[Miss]:
    return [x for c in (v.method, v.baseline) if c is not None and not c.ok for x in c.misses][:4]
