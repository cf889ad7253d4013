"""`engine=upstream`: the DDTree authors' own generate functions, run on our models, prompts and metrics.

    from ddtree.upstream.engine import load_upstream_engine, generate_upstream
    up = load_upstream_engine("/path/to/ddtree-checkout")      # compat patches + their modules
    res = generate_upstream(up, target, drafter, input_ids, method="ddtree", budget=32)

What runs, per method (their `benchmark.py` does the same):

* ddtree: their `ddtree_generate(tree_budget=budget)`;
* dflash: their `dflash_generate(block_size=...)`;
* ar:     their `dflash_generate(block_size=1)`, their own AR baseline (no drafter is called).

The drafter is their `DFlashDraftModel`, built from our drafter's config (the public config.json
dict) and holding our drafter's very tensors (`upstream_drafter`), so both engines draft with the
same weights. The target is ours, unchanged; the compat patches make their 4.x-era code run on it
(see docs/compat.md).

Their outputs map onto `GenerationResult` as follows (their raw numbers stay in `.upstream`):

* output_ids: their output after the prompt. Their code removes every token equal to the drafter's
  mask token id from its output, generated ones included; AR runs with mask id -1 (no token).
* acceptance_lengths: theirs (accepted nodes incl. the root = tokens a round adds, bonus included),
  capped so that they add up to the tokens kept, as ours do. Their loop runs while the root's
  position is below prompt + max_new_tokens, so it can run a last round whose tokens all fall past
  the limit: that round stays, with 0.
* ttft_s: their time_to_first_token (prefill + first token). decode_s: wall clock of the whole call
  minus ttft_s, as ours (their own decode time, which leaves out the first round's drafter call, is
  in `.upstream["decode_s"]`).
* stage_seconds: draft, tree (tree_build + tree_compile), verify, commit from their stage times.
  Their draft stage leaves out the first round's drafter call; their dflash puts the draft argmax
  in draft (ours: tree). Per-stage times of the first round's draft are not measured by their code.
* stopped_by: "stop_token" when the last token kept is a stop token.

At temperature > 0 their code samples from torch's global generator: it is seeded from `generator`
for the call (and restored after), so a prompt's samples are reproducible, but not the same draws as
the native engine's.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ddtree.engine.checks import check_block_size, check_generate_args
from ddtree.engine.methods import DEFAULT_BUDGET, check_method_args
from ddtree.engine.result import STAGES, GenerationResult
from ddtree.errors import ConfigError

NO_TOKEN = -1  # the mask id for AR: their output filter then drops nothing


@dataclass
class UpstreamResult(GenerationResult):
    """A GenerationResult from the authors' code; `upstream` holds their own numbers as they report them."""

    engine: str = "upstream"
    upstream: dict[str, Any] = field(default_factory=dict)


def load_upstream_engine(path: str | Path | None, *, only=None, skip=(), patch: bool = True):
    """load_upstream(path): patches applied, their modules imported; a bad path is a ConfigError (UpstreamError)."""
    from ddtree.upstream.loader import load_upstream

    return load_upstream(path, only=only, skip=list(skip or ()), patch=patch)


# drafter -> ((their class, its tensors), its twin): one twin per drafter, so repeated calls time generation, not construction
_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def upstream_drafter(upstream, drafter: torch.nn.Module) -> torch.nn.Module:
    """Their DFlashDraftModel holding `drafter`'s tensors (shared, not copied); theirs is returned as is.

    Built once per drafter and checkout (the twin shares the tensors, so later weight updates show through)."""
    cls = upstream.DFlashDraftModel
    if isinstance(drafter, cls):
        return drafter
    key = (cls, tuple((t.data_ptr(), t.dtype, t.device) for t in drafter.state_dict().values()))
    known = _TWINS.get(drafter)
    if known is not None and known[0] == key:  # same checkout, same tensors (not moved, cast or reloaded)
        return known[1]
    twin = _build_twin(cls, drafter)
    _TWINS[drafter] = (key, twin)
    return twin


def _build_twin(cls, drafter: torch.nn.Module) -> torch.nn.Module:
    config = cls.config_class(**drafter.config.to_dict())
    impl = getattr(drafter, "attn_implementation", None)
    if impl is not None:
        config._attn_implementation = impl
    device = drafter.device
    # its random init is overwritten below: keep it off the global generator that sampling reads
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), torch.device(device):
        twin = cls(config)
    try:
        twin.load_state_dict(drafter.state_dict(), strict=True, assign=True)
    except RuntimeError as e:
        raise ConfigError("upstream.path", f"the authors' DFlashDraftModel does not take this drafter's weights "
                          f"({str(e).splitlines()[0]})", "use a checkout whose model/ matches the public "
                          "DFlash checkpoint format") from None
    return twin.eval()


class _NoDrafter:
    """What their dflash_generate(block_size=1) reads from `model`: only where to allocate."""

    def __init__(self, device: torch.device):
        self.device = device


def generate_upstream(upstream, target, drafter, input_ids: torch.Tensor, *, method: str = "ddtree",
                      budget: int | None = 64, temperature: float = 0.0, max_new_tokens: int = 256,
                      stop_token_ids=None, generator: torch.Generator | None = None,
                      block_size: int | None = None) -> UpstreamResult:
    """One generation with the authors' code; the same arguments and result as `ddtree.generate`."""
    spec = check_method_args(method, has_drafter=drafter is not None, budget=budget, block_size=block_size)
    if not spec.authors_code:
        raise ConfigError("engine", f"the authors' code has no method={method}", "use the native engine (ddtree.generate)")
    check_generate_args(temperature, max_new_tokens, input_ids)
    stops = sorted(set(stop_token_ids or ()))
    kw: dict[str, Any] = dict(target=target, input_ids=input_ids, max_new_tokens=max_new_tokens,
                              stop_token_ids=stops or None, temperature=temperature)
    if spec.drafter_kind is None:  # AR: their dflash_generate(block_size=1), which never calls a drafter
        fn, model, mask_id, size, tree_budget = upstream.dflash_generate, _NoDrafter(input_ids.device), NO_TOKEN, 1, None
    else:
        model = upstream_drafter(upstream, drafter)
        mask_id, size = int(model.mask_token_id), int(block_size or model.block_size)
        check_block_size(size)  # the drafter's own, when no block size is passed
        fn, tree_budget = upstream.dflash_generate, None
        if spec.verifies_tree:
            fn, tree_budget = upstream.ddtree_generate, int(budget if budget is not None else DEFAULT_BUDGET)
            kw["tree_budget"] = tree_budget
    kw.update(model=model, mask_token_id=mask_id, block_size=size)

    cuda = input_ids.device.type == "cuda"
    devices = [input_ids.device.index or 0] if cuda else []
    with torch.random.fork_rng(devices=devices, enabled=temperature > 0):
        if temperature > 0:
            torch.manual_seed(generator.initial_seed() if generator is not None else torch.initial_seed())
        if cuda:
            torch.cuda.synchronize(input_ids.device)
        t0 = time.perf_counter()
        raw = fn(**kw)
        wall = time.perf_counter() - t0  # their output is copied to the host at the end: nothing in flight
    filtered = not any(p.get("id") == "upstream-mask-filter" and p.get("status") == "applied"
                       for p in upstream.patches or ())
    return to_result(raw, input_ids, method=method, mask_token_id=mask_id if filtered else NO_TOKEN, stops=stops,
                     wall_s=wall,
                     temperature=temperature, budget=tree_budget, block_size=size if spec.reads_block_size else None,
                     max_new_tokens=max_new_tokens)


def to_result(raw: SimpleNamespace, input_ids: torch.Tensor, *, method: str, mask_token_id: int, stops: list[int],
              wall_s: float, temperature: float, budget: int | None, block_size: int | None,
              max_new_tokens: int) -> UpstreamResult:
    """Their SimpleNamespace as an UpstreamResult (see the module docstring for the mapping)."""
    prompt = input_ids[0].tolist()
    dropped = sum(1 for t in prompt if t == mask_token_id)  # their mask filter (unpatched) drops prompt tokens too
    tokens = [int(t) for t in raw.output_ids[0].tolist()[len(prompt) - dropped:]][:max_new_tokens]
    lengths, left = [], max(0, len(tokens) - 1)  # the first token comes from the prefill, not a round
    for n in raw.acceptance_lengths:
        lengths.append(min(int(n), left))
        left -= lengths[-1]
    times = dict(raw.stage_times)
    stage = dict.fromkeys(STAGES, 0.0)
    stage.update(draft=times.get("draft", 0.0), verify=times.get("verify", 0.0), commit=times.get("commit", 0.0),
                 tree=times.get("tree_build", 0.0) + times.get("tree_compile", 0.0))
    ttft = float(raw.time_to_first_token)
    return UpstreamResult(
        output_ids=tokens, method=method, prompt_len=len(prompt), acceptance_lengths=lengths, stage_seconds=stage,
        ttft_s=ttft, decode_s=max(0.0, wall_s - ttft),
        stopped_by="stop_token" if tokens and tokens[-1] in stops else "max_new_tokens",
        budget=budget, block_size=block_size, temperature=temperature,
        upstream={"acceptance_lengths": [int(n) for n in raw.acceptance_lengths],
                  "num_output_tokens": int(raw.num_output_tokens),
                  "time_per_output_token": float(raw.time_per_output_token),
                  "decode_s": float(raw.time_per_output_token) * max(int(raw.num_output_tokens), 1),
                  "stage_seconds": {k: float(v) for k, v in times.items()},
                  "round_timestamps": [float(t) for t in getattr(raw, "round_timestamps", ()) or ()]})
