"""Which experts a MoE target's routers chose at a position, and by how much: the evidence of a routing flip.

In bf16 a router whose k-th and (k+1)-th experts score within a rounding step of each other can pick other experts
when the same token is computed in another shape (one forward over the sequence, a cached step, a verification
block): the target then disagrees with itself, by far more than the logits' own rounding. `RouterTrace` records, per
MoE layer, the experts chosen and the selection scores at the rows asked for; `routing_margins` turns a row into
the evidence a verdict keeps (docs/validation.md). transformers' routers (Qwen3-MoE, Qwen3.5/3.6-MoE, Qwen3-Next,
MiniMax-M2, gpt-oss, DeepSeek-V3, GLM-4-MoE, Laguna, ...) all return `(router_logits, weights, chosen indices)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def routers(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, router, its MoE block) of every router module, in layer order (empty for a dense model)."""
    found = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            w = getattr(child, "weight", None)
            if "router" in type(child).__name__.lower() and isinstance(w, torch.Tensor) and w.dim() == 2:
                found.append((f"{parent_name}.{child_name}" if parent_name else child_name, child, parent))
    return found


def _selection_scores(router: nn.Module, block: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The scores the router ranks: its logits, or sigmoid(logits) + the score-correction bias where it has a
    non-zero one (DeepSeek-V3, GLM-4-MoE, MiniMax-M2, Laguna checkpoints)."""
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        bias = getattr(block, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor) and bool(bias.ne(0).any()):
        return logits.float().sigmoid() + bias.float().to(logits.device)
    return logits.float()


class RouterTrace:
    """Forward hooks on every router: per forward call, each layer's chosen experts and selection scores.

        with RouterTrace(model, rows=[5]) as trace:
            model(ids)
        trace.layers   # [(name, scores [len(rows), E] float32, chosen [len(rows), k])] of the last call

    `rows`: the token rows to keep (None: all, e.g. a calibration's); `layers` is the last model call's record,
    `calls` every call's (a cached decode: the prefill, then one call a step), `chosen()` all of them in order."""

    def __init__(self, model: nn.Module, rows: Iterable[int] | None = None, scores: bool = True):
        self.model = model
        self.rows = None if rows is None else list(rows)
        self.keep_scores = scores  # False: the choices alone (a calibration's every row)
        self.calls: list[list[tuple[str, torch.Tensor, torch.Tensor]]] = []
        self._handles: list[Any] = []
        self._found = routers(model)

    @property
    def layers(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        return self.calls[-1] if self.calls else []

    @property
    def moe(self) -> bool:
        return bool(self._found)

    def __enter__(self) -> RouterTrace:
        for i, (name, router, block) in enumerate(self._found):
            self._handles.append(router.register_forward_hook(self._hook(i, name, router, block)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, index: int, name: str, router: nn.Module, block: nn.Module):
        def hook(module, args, output):
            if index == 0:  # the first router of a forward: a new model call
                self.calls.append([])
            if not (isinstance(output, tuple) and len(output) >= 3):
                return
            logits, chosen = output[0], output[2]
            logits = logits.reshape(-1, logits.shape[-1])
            chosen = chosen.reshape(logits.shape[0], -1)
            if self.rows is not None:
                keep = torch.tensor(self.rows, device=logits.device)
                logits, chosen = logits.index_select(0, keep), chosen.index_select(0, keep)
            scores = _selection_scores(router, block, logits).detach().cpu() if self.keep_scores else None
            self.calls[-1].append((name, scores, chosen.detach().cpu()))
        return hook

    def chosen(self) -> list[list[tuple[int, ...]]]:
        """Per kept row of every call in order (a cached decode: its rows in token order), per layer: the chosen
        experts (sorted)."""
        out = []
        for call in self.calls:
            n = call[0][2].shape[0] if call else 0
            out.extend([tuple(sorted(c[r].tolist())) for _, _, c in call] for r in range(n))
        return out


def routing_margins(trace: RouterTrace, row: int, step: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
    """Per MoE layer at one kept row: the chosen experts and the margin of the k-th chosen over the best left out,
    in selection-score units and in steps (`step(magnitude)`: one step of the decoding dtype there): how close the
    router was to a flip."""
    out = []
    for layer, (name, scores, chosen) in enumerate(trace.layers):
        s, c = scores[row], chosen[row]
        left = torch.ones_like(s, dtype=torch.bool)
        left[c] = False
        kth = s[c].min()
        entry: dict[str, Any] = {"layer": layer, "router": name, "experts": sorted(c.tolist())}
        if bool(left.any()):
            nxt = s.masked_fill(~left, float("-inf")).max()
            margin = kth - nxt
            mag = torch.maximum(kth.abs(), nxt.abs())
            entry.update(margin=float(f"{float(margin):.6g}"),
                         margin_steps=float(f"{float(margin / step(mag)):.4g}"))
        out.append(entry)
    return out
