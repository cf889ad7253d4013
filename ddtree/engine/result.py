"""What one generation returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class GenerationResult:
    """One prompt, one method.

    acceptance_lengths: tokens committed per round *including* the bonus token (the field's
    convention; AR rounds are all 1). The prefill's first token is not a round.
    stage_seconds: wall seconds summed over rounds per stage: draft (drafter forward),
    tree (building the draft tree), verify (one target forward), commit (walk + cache commit).
    """

    output_ids: list[int]
    method: str
    prompt_len: int
    acceptance_lengths: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    ttft_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # everything after the first token
    stopped_by: str = "max_new_tokens"  # or "stop_token"
    budget: int | None = None
    block_size: int | None = None
    temperature: float = 0.0
    # per-round drafter ranks and node agreement (ddtree.engine.diagnostics), where recorded; else None
    diagnosis: dict | None = None
    # which round made it: "compiled" (ddtree.engine.compiled) or "eager"; why (what) ran eagerly, or None; and
    # whether that was a fallback (compile=true, or auto on CUDA, asked for the compiled round)
    round: str = "eager"
    round_note: str | None = None
    round_fallback: bool = False
    # Engine.generate_many: seconds this stream waited for a slot before its prefill, and the streams it shared
    # rounds with at most (1: a generation alone)
    queued_s: float = 0.0
    streams: int = 1
    # budget="auto" with Engine.generate_many: the controller's record against the load (LoadBudget.summary), shared
    # by the call's results; None otherwise
    load_budget: dict | None = None

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def num_new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round, bonus included."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("load_budget")  # (one record for a whole generate_many call: the job's summary keeps it once)
        d.update(rounds=self.rounds, num_new_tokens=self.num_new_tokens, tau=self.tau,
                 total_s=self.total_s, tokens_per_s=self.tokens_per_s)
        return d
