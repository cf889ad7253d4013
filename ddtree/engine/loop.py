"""One generation loop for every method: propose a tree → verify it → walk → commit."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel

from ddtree.engine import batch, compiled
from ddtree.engine.checks import check_generate_args, check_tree_memory, compile_setting
from ddtree.engine.diagnostics import RoundRecorder
from ddtree.engine.kernels import KernelChecks, checking
from ddtree.engine.methods import DraftSettings, check_method_args, check_target_supported, get_method
from ddtree.engine.options import EngineOptions, scoped
from ddtree.engine.proposers import DecodeState, Proposer
from ddtree.engine.result import GenerationResult
from ddtree.engine.target import TargetBinding, TargetSession, context_features, model_type
from ddtree.engine.timing import StageTimer
from ddtree.engine.tree import host_walk, rejection_walk, walk
from ddtree.errors import ConfigError

__all__ = ["Engine", "generate", "check_generate_args", "context_features"]


log = logging.getLogger("ddtree.engine")


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token after each row: argmax, or one independent sample per row."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(probs.shape[:-1])


def _walk_asking_head(tree, ask) -> tuple:
    """host_walk(tree, ask), and the seconds spent in `ask` (the head: target forward work)."""
    spent = 0.0

    def timed(nodes: list[int]) -> list[int]:
        nonlocal spent
        t = time.perf_counter()
        try:
            return ask(nodes)
        finally:
            spent += time.perf_counter() - t

    return host_walk(tree, timed), spent


def make_proposer(method: str, target, drafter, settings: DraftSettings) -> Proposer:
    """The proposer of `method` (ddtree.engine.methods) from its settings (budget; block_size; steps, topk: the
    draft depth and branching of mtp and eagle3; scoring: ddtree's node scores; the engine's options), after the
    argument checks every engine shares."""
    s = settings
    m = check_method_args(method, has_drafter=drafter is not None, budget=s.budget, block_size=s.block_size,
                          steps=s.steps, topk=s.topk)
    return m.make_proposer(target, drafter, s)


class Engine:
    """`target` (and `drafter`) prepared once for many generations of one method: the checks, the proposer and the
    target's binding (tree attention, lean forward, GDN patch: ddtree.engine.target.TargetBinding) are built here,
    and each `generate` call starts only a fresh cache. `generate()` below is one Engine, one call.

    It drives the models as they are when it is built: after hooking, patching or moving one, build a new Engine.
    `close()` (or leaving a `with Engine(...) as engine:` block) restores what it changed on the target.

    Its arguments, by group (every one after `drafter` a keyword; each as `generate()` takes it):

    * the model pair: `target`, a transformers causal LM; `drafter`, the model of the method's drafter kind
      (ddtree.engine.drafter_kinds: a DFlash drafter, an MTP head, an EAGLE-3 drafter), or None (AR; the target's
      own MTP head).
    * the method and its settings (`engine.settings`, ddtree.engine.methods.DraftSettings: each method reads its
      own): `method`; `budget` (tree methods' node budget; "auto" for ddtree: chosen every round, through
      `generate_many`); `block_size` (a DFlash drafter's block); `steps`, `topk` (mtp, eagle3: draft depth, children
      per node); `scoring` (ddtree: marginal or pair); or `proposer`, a custom Proposer in place of the method's. How its rounds run: `compile`, `tree_attention`, `sync_timing`,
      `record`.
    * the options (`engine.options`, ddtree.engine.options.EngineOptions): `options`, a whole EngineOptions, and
      its fields as keywords (each given overrides it): `compile_backend`, torch.compile's backend for the
      compiled round (None: inductor; "eager"/"aot_eager" trace without generating code: tests);
      `tune_host_allocator`, set glibc's malloc thresholds for the whole process on a CPU target (faster
      verification; ddtree.engine.host); `device_path`, the CPU-only branches turned off (True: all of them, a CPU
      run then takes a CUDA run's code; or names of ddtree.engine.host.HOST_BRANCHES); `kernels`, the fused ops'
      setting ("auto", "strict", "composite"); `flex_compile`, compiled flex attention (None: on CUDA only);
      `auto_compile`, whether compile="auto" compiles on CUDA. Without `options`, each one left at None is an
      enclosing `ddtree.engine.host.device_path()` block's, else the environment's (DDTREE_HOST_MALLOC,
      DDTREE_DEVICE_PATH, DDTREE_KERNELS, DDTREE_FLEX_COMPILE, DDTREE_COMPILE, DDTREE_COMPILE_BACKEND). They are
      resolved once here and handed to what the engine builds (its target binding, its compiled round, its
      proposer); `kernel_checks` (ddtree.engine.kernels.KernelChecks) holds what its fused ops' checks found,
      entered around its own calls: two engines in one process each keep theirs.
    """

    def __init__(self, target: PreTrainedModel, drafter=None, *,
                 # the method and its settings
                 method: str = "ddtree", budget: int | str | None = 64, block_size: int | None = None,
                 steps: int | None = None, topk: int | None = None, scoring: str | None = None,
                 proposer: Proposer | None = None,
                 # how its rounds run
                 compile: str | bool = "auto", tree_attention: str = "auto", sync_timing: bool = False,
                 record: bool = True,
                 # the options (EngineOptions): whole, and field by field
                 options: EngineOptions | None = None, compile_backend: str | None = None,
                 tune_host_allocator: bool | None = None, device_path: bool | str | Iterable[str] | None = None,
                 kernels: str | None = None, flex_compile: bool | None = None, auto_compile: bool | None = None):
        compile = compile_setting(compile)  # a mistyped setting is refused before any work
        # budget="auto": the tree chosen every round from the load (ddtree.engine.adaptive, through generate_many);
        # the proposer is built for the largest candidate
        self.load_budget = None  # budget="auto"'s controller (ddtree.engine.adaptive), made by the first batched call
        self.budget_auto = budget == "auto" and get_method(method).auto_budget
        if budget == "auto":
            if not self.budget_auto and get_method(method).reads_budget:
                raise ConfigError("budget", f"budget=auto chooses DDTree's tree every round; method={method} has none",
                                  "use method=ddtree with budget=auto, or a number")
            budget = max(batch.AUTO_CANDIDATES) if self.budget_auto else None  # (a method that reads none: None)
        self.options = EngineOptions.resolve(base=options, device_path=device_path, kernels=kernels,
                                             flex_compile=flex_compile, auto_compile=auto_compile,
                                             compile_backend=compile_backend, tune_host_allocator=tune_host_allocator)
        self.settings = DraftSettings(budget=budget, block_size=block_size, steps=steps, topk=topk, scoring=scoring,
                                      options=self.options)
        self.kernel_checks = KernelChecks(self.options.kernels)
        self.binding = None
        with checking(self.kernel_checks):
            self._build(target, drafter, method, proposer, compile=compile, tree_attention=tree_attention,
                        sync_timing=sync_timing, record=record)

    def _build(self, target, drafter, method: str, proposer: Proposer | None, *, compile: str, tree_attention: str,
               sync_timing: bool, record: bool) -> None:
        budget = self.settings.budget
        check_target_supported(model_type(target), method)
        self.spec = get_method(method)
        if self.spec.reads_budget and budget:  # a tree that cannot fit is refused here, not by the allocator
            check_tree_memory(target.config.get_text_config().to_dict(), budget, target.dtype.itemsize,
                              str(target.device))
        custom = self.custom_proposer = proposer is not None
        if proposer is None:
            if self.spec.drafter_kind is not None:  # its row's check of the pair (a DFlash drafter's widths, ...)
                self.spec.drafter_kind.check(target, drafter)
            proposer = make_proposer(method, target, drafter, self.settings)
        self.target, self.drafter, self.method, self.budget, self.proposer = target, drafter, method, budget, proposer
        self.sync_timing = sync_timing
        self.record = record  # per-round diagnosis records (ddtree.engine.diagnostics), where the proposer drafts
        # the Proposer contract (ddtree.engine.proposers.Proposer): what it reads, how big its trees get, what compiles
        self.binding = TargetBinding(target, proposer.feature_layers, tree_attention=tree_attention,
                                     options=self.options)
        self.tree_max = proposer.max_nodes + 1
        if proposer.max_nodes > 1:  # it drafts: the target must verify its trees exactly
            TargetSession(target, binding=self.binding).check_method(self.spec)
        # the compiled round (ddtree.engine.compiled), or None: the eager one; `round_note`: why (what) runs eagerly
        self.compile = compile
        # generate_many's compiled round (ddtree.engine.batch.CompiledRound, built on first use), or why it failed
        self.batch_static: batch.CompiledRound | None = None
        self.batch_failed: str | None = None
        unfit = None if proposer.compilable else ("a custom proposer" if custom else f"method={method}")
        self.static, self.round_note = compiled.static_round_for(self.binding, unfit, compile)
        # a fallback: the setting asked for the compiled round here (true; auto on CUDA) and some of it runs eagerly
        self.round_fallback = self.round_note is not None and (
            compile == "true" or (compile == "auto" and compiled.auto_compiles(self.binding)))
        if self.static is not None:  # the drafter's forward and DDTree's tree build compiled too, where they can be
            eager_draft = self.static.attach(proposer)
            if eager_draft is not None:
                self.round_note, self.round_fallback = f"the draft runs eagerly: {eager_draft}", True

    @property
    def round(self) -> str:
        """"compiled" (the target's side of a round runs as graphs: ddtree.engine.compiled) or "eager"."""
        return "eager" if self.static is None else "compiled"

    def generate(self, input_ids: torch.Tensor, *, temperature: float = 0.0, max_new_tokens: int = 256,
                 stop_token_ids: Iterable[int] | None = None,
                 generator: torch.Generator | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` after `input_ids` [1, P], losslessly (see `generate()`)."""
        if self.binding is None:
            raise RuntimeError("Engine.generate after close(): build a new Engine")
        check_generate_args(temperature, max_new_tokens, input_ids)
        if self.budget_auto:  # the per-round choice is the batched round's (one stream; keyed sampling at T > 0)
            seed = 0 if generator is None else int(generator.initial_seed())
            return self.generate_many([input_ids], concurrency=1, temperature=temperature,
                                      max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed)[0]
        with checking(self.kernel_checks):  # its fused ops' checks (called under transformers' forward too)
            return self._generate_scoped(input_ids, temperature, max_new_tokens, stop_token_ids, generator)

    def _generate_scoped(self, input_ids, temperature, max_new_tokens, stop_token_ids, generator) -> GenerationResult:
        self.binding.ensure()
        if self.static is None or self.compile != "auto":
            return self._noted(_generate(self, input_ids, temperature, max_new_tokens, stop_token_ids, generator))
        # compile=auto never fails where the eager round runs: a compiled generation that raises (a compiler or
        # CUDA-graph failure on this machine) is logged and run again eagerly, the sampler's state as it was
        state = generator.get_state() if generator is not None else None
        try:
            return self._noted(_generate(self, input_ids, temperature, max_new_tokens, stop_token_ids, generator))
        except Exception as err:  # noqa: BLE001 (any failure of the compiled round: the eager one is the reference)
            why = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
            log.warning("compile=auto: the compiled round failed (%s); this engine runs the eager round from now "
                        "on (compile=false skips the attempt)", why)
            self.static.detach(self.proposer)
            self.static = None
            self.round_note, self.round_fallback = f"compile=auto: the compiled round failed ({why})", True
            if state is not None:
                generator.set_state(state)
        return self._noted(_generate(self, input_ids, temperature, max_new_tokens, stop_token_ids, generator))

    def generate_many(self, prompts: Sequence[torch.Tensor], *, concurrency: int = 8, temperature: float = 0.0,
                      max_new_tokens: int = 256, stop_token_ids: Iterable[int] | None = None, seed: int = 0,
                      budget: int | str | None = None) -> list[GenerationResult]:
        """Generate after each of `prompts` (each [1, P] or [P]) with up to `concurrency` streams decoding in one
        batched round (ddtree.engine.batch): one `GenerationResult` per prompt, in prompt order. When a stream ends
        the next prompt takes its slot (its prefill runs between rounds). Lossless per stream: at T = 0 each output
        is greedy decoding of its prompt alone; at T > 0 stream i samples with its own keyed noise (seed, i), so
        its output does not depend on the other streams or on `concurrency`. budget: this call's (None: the
        engine's; "auto": chosen every round for the whole batch, ddtree.engine.adaptive).
        Each result's ttft_s/decode_s count from the stream's own start; queued_s is its wait for a slot."""
        if self.binding is None:
            raise RuntimeError("Engine.generate_many after close(): build a new Engine")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError("concurrency", f"must be an integer >= 1, got {concurrency!r}", "use e.g. concurrency=8")
        prompts = [p if p.dim() == 2 else p[None] for p in prompts]
        for p in prompts:
            check_generate_args(temperature, max_new_tokens, p)
        if budget is None:
            budget = "auto" if self.budget_auto else self.budget
        if min(concurrency, len(prompts)) == 1 and temperature <= 0 and budget == self.budget:
            return self._one_at_a_time(prompts, max_new_tokens, stop_token_ids)
        # its fused ops' checks; its options for the code transformers' forward calls (the batched round calls the
        # model itself: ddtree.engine.options)
        with scoped(self.options), checking(self.kernel_checks):
            self.binding.ensure()
            rounds, note = self._batch_round()
            args = (self, prompts, concurrency, temperature, max_new_tokens, stop_token_ids, seed, budget)
            try:
                results = batch.generate_many(*args, compiled=rounds)
            except ConfigError:
                raise
            except Exception as err:  # noqa: BLE001 (a failure of the compiled round: the eager one is the reference)
                if rounds is None:
                    raise
                why = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
                log.warning("compile=%s: the compiled batched round failed (%s); this engine runs the eager batched "
                            "round from now on (compile=false skips the attempt)", self.compile, why)
                self.batch_failed = note = f"compile={self.compile}: the compiled batched round failed ({why})"
                self.batch_static = rounds = None
                results = batch.generate_many(*args, compiled=None)
        fallback = note is not None and (self.compile == "true" or (
            self.compile == "auto" and compiled.auto_compiles(self.binding)))
        for r in results:
            r.round, r.round_note, r.round_fallback = ("eager" if rounds is None else "compiled"), note, fallback
        return results

    def _batch_round(self) -> tuple[batch.CompiledRound | None, str | None]:
        """(the compiled batched round, or None: the eager one; why the eager one runs, in words, or None)."""
        if self.compile == "false" or (self.compile == "auto" and not compiled.auto_compiles(self.binding)):
            return None, self.round_note
        if self.batch_failed is not None:
            return None, self.batch_failed
        why = batch.why_not_compiled(self)
        if why is not None:
            log.info("compile=%s: the batched round runs eagerly: %s", self.compile, why)
            return None, f"compile={self.compile}: {why}"
        if self.batch_static is None:
            self.batch_static = batch.CompiledRound(self.binding.device, self.options.compile_backend)
        return self.batch_static, None

    def _one_at_a_time(self, prompts: list[torch.Tensor], max_new_tokens: int,
                       stop_token_ids: Iterable[int] | None) -> list[GenerationResult]:
        """generate_many with one slot at T = 0: the one-stream round (the compiled one where it runs), which gives
        what the batched round gives with one slot, with fewer ops (its lean split attention, lazy head, host walk)."""
        t0 = time.perf_counter()
        out = []
        for ids in prompts:
            queued = time.perf_counter() - t0
            result = self.generate(ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
            result.queued_s = queued
            out.append(result)
        return out

    def _noted(self, result: GenerationResult) -> GenerationResult:
        """`result` with the round that made it (compiled or eager), why (what) ran eagerly, and whether a fallback."""
        result.round, result.round_note, result.round_fallback = self.round, self.round_note, self.round_fallback
        return result

    def close(self) -> None:
        """Restore the target as it was before this engine (attention implementation, hooked forwards). Idempotent."""
        if self.binding is not None:
            self.binding.restore()
            self.binding = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate(target: PreTrainedModel, drafter, input_ids: torch.Tensor, *,
             # the generation
             temperature: float = 0.0, max_new_tokens: int = 256, stop_token_ids: Iterable[int] | None = None,
             generator: torch.Generator | None = None,
             # the method and its settings; how its rounds run (as Engine's)
             method: str = "ddtree", budget: int | None = 64, block_size: int | None = None,
             steps: int | None = None, topk: int | None = None, scoring: str | None = None,
             proposer: Proposer | None = None, compile: str | bool = "auto", tree_attention: str = "auto",
             sync_timing: bool = False, record: bool = True,
             # the options (as Engine's)
             options: EngineOptions | None = None, compile_backend: str | None = None,
             tune_host_allocator: bool | None = None, device_path: bool | str | Iterable[str] | None = None,
             kernels: str | None = None, flex_compile: bool | None = None,
             auto_compile: bool | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` after `input_ids` [1, P] with `method`, losslessly.

    At temperature 0 the output equals plain greedy decoding of `target`; at T > 0 every token
    is a sample of the target's distribution. A custom `proposer` replaces the method's drafter.
    sync_timing: synchronise the device at every stage boundary (8 host syncs a round); by default a CUDA run times
    its stages with CUDA events read after the generation, and the round's one host read is the walk's.
    tree_attention: "split" (ddtree.engine.attention, any backend; the target is switched to the tree
    implementation wrapping its backend), "dense" (a 4-D mask over past + tree; eager/sdpa) or "auto"
    (split, but dense for a small mask on a CPU eager/sdpa target without sliding layers: cheaper there).
    record: keep the per-round diagnosis (`GenerationResult.diagnosis`; ddtree.engine.diagnostics) where the proposer
    drafts: a few small ops a round and one host read per generation.
    Many prompts on the same models: build one `Engine` and call its `generate` (the set-up runs once).
    method="mtp" drafts with the target's own MTP head (`drafter`: an MTPHead, or None to read it from the target's
    checkpoint): `steps` tokens a round (default 3), `topk` > 1 an EAGLE-style tree of the `budget` best nodes.
    compile: "auto" (the compiled round, ddtree.engine.compiled, on a CUDA target it can run; eager elsewhere, and
    eager from then on where a compiled generation fails: logged, the generation rerun),
    "true" (compiled on any device; a target it cannot run is refused) or "false" (eager). Build an `Engine` to
    keep the compiled graphs across generations.
    scoring: method=ddtree's node scores: "marginal" (the drafter's per-position distributions), "pair" (a DFlash2
    drafter's candidate selector: each child scored given its parent; ddtree.engine.selector) or "auto" (None, the
    default: pair for a DFlash2 drafter, marginal for a DFlash one).
    options (an EngineOptions), compile_backend, tune_host_allocator, device_path, kernels, flex_compile,
    auto_compile: the engine's options, as `Engine` takes them (ddtree.engine.options; None: the environment's).
    """
    check_generate_args(temperature, max_new_tokens, input_ids)
    with Engine(target, drafter, method=method, budget=budget, block_size=block_size, steps=steps, topk=topk,
                scoring=scoring, proposer=proposer,
                compile=compile, tree_attention=tree_attention, sync_timing=sync_timing, record=record,
                options=options, compile_backend=compile_backend, tune_host_allocator=tune_host_allocator,
                device_path=device_path, kernels=kernels, flex_compile=flex_compile,
                auto_compile=auto_compile) as engine:  # one call: the model as found
        return engine.generate(input_ids, temperature=temperature, max_new_tokens=max_new_tokens,
                               stop_token_ids=stop_token_ids, generator=generator)


def _generate(engine: Engine, input_ids: torch.Tensor, temperature: float, max_new_tokens: int,
              stop_token_ids: Iterable[int] | None, generator: torch.Generator | None) -> GenerationResult:
    proposer, method, budget, spec = engine.proposer, engine.method, engine.budget, engine.spec
    stops = set(stop_token_ids or ())
    timer = StageTimer(input_ids.device, engine.sync_timing)
    capacity = input_ids.shape[1] + max_new_tokens + engine.tree_max
    if engine.static is not None:  # the compiled round: fixed-capacity buffers, device-side length
        session = engine.static.session(capacity)
    else:
        session = TargetSession(engine.target, capacity=capacity, binding=engine.binding)
    proposer.reset(capacity)
    result = GenerationResult(output_ids=[], method=method, prompt_len=input_ids.shape[1], temperature=temperature,
                              budget=budget if spec.reads_budget else None, block_size=proposer.block_size)
    rec = RoundRecorder(temperature, proposer.record_scores) if engine.record and proposer.diagnoses else None

    t0 = time.perf_counter()
    logits, feats = session.prefill(input_ids)
    root = _choose(logits, temperature, generator)
    out = [int(root)]
    result.ttft_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    done = out[0] in stops or len(out) >= max_new_tokens
    if out[0] in stops:
        result.stopped_by = "stop_token"
    path = None
    while not done:
        state = DecodeState(root=root, start=session.length, prompt_len=input_ids.shape[1], generated=out,
                            new_context=feats, temperature=temperature, generator=generator, timer=timer,
                            input_ids=input_ids, path=path)
        tree = proposer.propose(state)
        # greedy on a CPU lean target: the head (and last layer) only on the walked rows (TargetSession.lazy_head)
        lazy = temperature <= 0 and engine.static is None and session.lazy_head(tree)
        with timer.stage("verify"):
            verified, feats = session.verify(tree, head=False) if lazy else session.verify(tree)
        head_s = 0.0
        with timer.stage("commit"):
            choice = None
            if lazy:
                w, head_s = _walk_asking_head(tree, verified.argmax)
                t_feats = time.perf_counter()
                feats = verified.features(w.path_list)  # before the commit moves the cache rows it reads
                head_s += time.perf_counter() - t_feats
            elif temperature > 0 and tree.draft_probs is not None:  # a sampled chain: speculative sampling
                w = rejection_walk(tree, verified, temperature, generator)  # the round's one host read
            else:
                choice = _choose(verified, temperature, generator)
                w = walk(tree, choice)  # the round's one host read
            session.commit(tree, w.path, w.path_list)
            if feats is not None and not lazy and not getattr(session, "keeps_features", False):
                feats = feats[:, w.path]  # (the compiled round hands them to the compiled drafter in its commit)
            new, root, path = w.tokens, w.next_root, w.path
            if rec is not None:  # no host read: ddtree.engine.diagnostics
                rec.round(proposer.record_logits(tree, w.path, len(w.path_list) - 1), tree, w.path, len(w.path_list) - 1, root, choice,
                          proposer.last_top1)
        timer.move("commit", "verify", head_s)  # the walked rows' last layer and head: target forward work (CPU only)
        # stop at (and including) a stop token; never past max_new_tokens
        room = max_new_tokens - len(out)
        for i, t in enumerate(new[:room]):
            if t in stops:
                new, done, result.stopped_by = new[: i + 1], True, "stop_token"
                break
        new = new[:room]
        out.extend(new)
        result.acceptance_lengths.append(len(new))
        done = done or len(out) >= max_new_tokens
    result.decode_s = time.perf_counter() - t1
    result.output_ids = out
    result.stage_seconds = timer.finish()
    if rec is not None:
        result.diagnosis = rec.finish()
    return result
