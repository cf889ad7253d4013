"""The DFlash2 drafter: the DFlash body (ddtree.engine.drafter.model) plus grouped dynamic causal convolutions in
every layer and a candidate selector that scores adjacent pairs (a candidate given its predecessor).

The public checkpoint format (docs/dflash2.md says which public loaders each name and shape was checked against):
`architectures: ["DFlash2DraftModel"]`, and in `dflash_config` (or at the top level) `conv_kernel_size`,
`conv_group_size`, `selector_rank`, `selector_top_k`, optional `output_multiplier` and `final_logit_softcapping`
(0 or absent: no cap).
Tensors beyond DFlash's:

* `layers.N.attention_conv.{base_kernel [2, taps, H], kernel_projection.weight [2 * taps * (H / group), H]}` and
  the same under `layers.N.mlp_conv`: side 0 convolves a sublayer's (normed) input, side 1 its output. Along the
  rows of one block, zero before the block's first row: `out_t = sum_o (base[side, o] + dyn_t[side, o, g]) * x_{t-o}`,
  the per-row correction `dyn_t` projected from the normed input, one value per group of `group` channels.
* `candidate_selector.{predecessor_codebook [V, r], successor_codebook [V, r], hidden_projection.weight [r, H]}`:
  position t's candidates are the top-`selector_top_k` of its logits, scored given the previous token a as
  `S_t(a, b) = logit_t(b) + <P[a] * (W h_t), Q[b]>` (h_t the final hidden state of the row drafting t).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.engine.checks import DFLASH2_ARCHITECTURE, DFLASH2_KEYS, check_dflash2_fields, dflash2_fields
from ddtree.engine.drafter.config import DFlashConfig
from ddtree.engine.drafter.model import DFlashDecoderLayer, DFlashDrafter
from ddtree.errors import ConfigError

ARCHITECTURE = DFLASH2_ARCHITECTURE


@dataclass
class DFlash2Config(DFlashConfig):
    """DFlashConfig plus DFlash2's convolution and selector fields (None where a checkpoint must declare them)."""

    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    output_multiplier: float | None = None  # logits times this (None: 1)
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap) after the multiplier (None, 0: off)

    def __post_init__(self) -> None:
        self.extra["architectures"] = [ARCHITECTURE]
        super().__post_init__()

    def _validate(self) -> None:
        super()._validate()
        check_dflash2_fields({k: getattr(self, k) for k in DFLASH2_KEYS}, hidden_size=self.hidden_size,
                             block_size=self.block_size, vocab_size=self.vocab_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DFlash2Config:
        """From a public DFlash2 config.json dict: the DFlash2 keys read from dflash_config first, then the top level."""
        rest = copy.deepcopy(raw)
        fields = dflash2_fields(rest)
        if isinstance(rest.get("dflash_config"), dict):
            for key in DFLASH2_KEYS:
                rest["dflash_config"].pop(key, None)
        # at the top level, where DFlashConfig.from_dict reads this class's fields
        return super().from_dict({**rest, **{k: v for k, v in fields.items() if v is not None}})

    def to_dict(self) -> dict[str, Any]:
        """The public DFlash2 config.json dict (the DFlash2 keys in dflash_config)."""
        out = super().to_dict()
        for key in DFLASH2_KEYS:
            value = out.pop(key, None)
            if value is not None:
                out["dflash_config"][key] = value
        return out


class GroupedCausalConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution along one block's rows (side 0 before a sublayer, 1 after)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0  # identity at init, as the public recipe starts
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def corrections(self, x: torch.Tensor) -> torch.Tensor:
        """The per-row tap corrections of both sides: [B, q, 2, taps, groups]."""
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))

    def forward(self, x: torch.Tensor, dyn: torch.Tensor, side: int, block: int | None = None) -> torch.Tensor:
        """x [B, q, H] (q a multiple of `block`, default q: one block), dyn the `corrections` [B, q, 2, taps, G]."""
        b, q, h = x.shape
        block = q if block is None else block
        xs = x.reshape(b * (q // block), block, self.groups, self.group_size)
        d = dyn[:, :, side].reshape(b * (q // block), block, self.taps, self.groups)
        base = self.base_kernel[side].to(x.dtype).view(self.taps, self.groups, self.group_size)
        out = (base[0] + d[:, :, 0, :, None]) * xs
        for o in range(1, min(self.taps, block)):  # taps reaching before the block's first row read zeros
            shifted = F.pad(xs[:, : block - o], (0, 0, 0, 0, o, 0))
            out = out + (base[o] + d[:, :, o, :, None]) * shifted
        return out.reshape(b, q, h)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with a convolution on each side of attention and of the MLP."""

    def __init__(self, config: DFlash2Config, qwen3_config, layer_idx: int):
        super().__init__(config, qwen3_config, layer_idx)
        self.attention_conv = GroupedCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = GroupedCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        self.block_size = config.block_size

    def around(self, x, attention):
        # one block (a round: its rows, possibly fewer than the trained block), or blocks side by side (training)
        q = x.shape[1]
        block = self.block_size if q > self.block_size and q % self.block_size == 0 else q
        h = self.input_layernorm(x)
        dyn = self.attention_conv.corrections(h)
        x = x + self.attention_conv(attention(self.attention_conv(h, dyn, 0, block)), dyn, 1, block)
        h = self.post_attention_layernorm(x)
        dyn = self.mlp_conv.corrections(h)
        return x + self.mlp_conv(self._mlp(self.mlp_conv(h, dyn, 0, block)), dyn, 1, block)


class CandidateSelector(nn.Module):
    """The pair scores' parameters: predecessor / successor codebooks [V, r] and the hidden projection [r, H]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)


@dataclass
class Candidates:
    """One block's selector inputs, float32: position t = 0..L-1 drafts the token after the anchor's t-th successor.

    unary [L, k] the candidates' logits (descending), ids [L, k] their tokens, proj [L, r] W h_t,
    succ [L, k, r] Q of the candidates, rest [L] the other tokens' mass (pair scores' normaliser). The batched round's
    (ddtree.engine.batch) carry a leading stream dimension [N, L, ...] on every field but `pred`."""

    unary: torch.Tensor
    ids: torch.Tensor
    proj: torch.Tensor
    succ: torch.Tensor
    pred: torch.Tensor  # the predecessor codebook [V, r] (float32 view or copy)
    rest: torch.Tensor  # [L] log of sum exp(logit) over the tokens that are not candidates (-inf: none)

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """Every field but the codebook (a parameter), as a compiled graph returns them (`of_outputs` undoes it)."""
        return self.unary, self.ids, self.proj, self.succ, self.rest

    @classmethod
    def of_outputs(cls, outputs: tuple[torch.Tensor, ...], pred: torch.Tensor) -> Candidates:
        unary, ids, proj, succ, rest = outputs
        return cls(unary, ids, proj, succ, pred, rest)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter: the DFlash forward (hidden states of the block) with its layers' convolutions, its logits'
    multiplier and soft cap (`head_logits`) and its candidate selector (`candidates`)."""

    config_class = DFlash2Config
    layer_class = DFlash2DecoderLayer
    ARCHITECTURE = ARCHITECTURE

    def __init__(self, config: DFlash2Config, attn_implementation: str = "sdpa"):
        super().__init__(config, attn_implementation)
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, config.selector_rank,
                                                    config.selector_top_k)

    def check_compatible(self, target: nn.Module) -> None:
        super().check_compatible(target)
        vocab = target.get_output_embeddings().weight.shape[0]
        if self.config.vocab_size != vocab:
            raise ConfigError("drafter.vocab_size", f"the selector's codebooks have {self.config.vocab_size} rows, the "
                              f"target's head {vocab}", "use a DFlash2 drafter trained for this target")

    def head_logits(self, lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter's float32 logits of final hidden states: the target's head, the multiplier, the soft cap."""
        logits = lm_head(hidden).float()
        c = self.config
        if c.output_multiplier is not None and c.output_multiplier != 1:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:  # 0 and None: no cap (the public code reads 0 as off)
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def candidates(self, logits: torch.Tensor, hidden: torch.Tensor) -> Candidates:
        """The selector's inputs for one block: logits [L, V] (head_logits), hidden [L, H] the rows drafting them
        (or N streams' blocks: [N, L, V] and [N, L, H], every field but the codebook with that leading dimension)."""
        sel = self.candidate_selector
        unary, ids = logits.topk(sel.top_k, dim=-1)  # sorted: the best candidate first
        proj = sel.hidden_projection(hidden).float()
        succ = sel.successor_codebook[ids].float()
        whole = logits.logsumexp(-1)
        rest = whole + torch.log1p(-torch.exp(unary.logsumexp(-1) - whole).clamp(max=1.0))
        return Candidates(unary, ids, proj, succ, sel.predecessor_codebook.float(), rest)

    @classmethod
    def random_for_target(cls, target_config: Any, *, conv_kernel_size: int = 4, conv_group_size: int | None = None,
                          selector_rank: int = 16, selector_top_k: int = 8, seed: int = 0, perturb: bool = True,
                          **kwargs: Any) -> DFlash2Drafter:
        """A randomly initialised DFlash2 drafter sized for a target. perturb (tests): convolutions away from the
        identity and codebooks large enough that the pair scores reorder candidates; else (training's start) identity
        convolutions and codebooks of std 0.02 (the pair term near zero)."""
        hidden = target_config.get_text_config().hidden_size
        model = super().random_for_target(
            target_config, seed=seed, conv_kernel_size=conv_kernel_size,
            conv_group_size=conv_group_size or max(1, hidden // 8), selector_rank=selector_rank,
            selector_top_k=selector_top_k, **kwargs)
        generator = torch.Generator().manual_seed(seed + 1)
        std = 1.0 if perturb else 0.02
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, GroupedCausalConv) and perturb:
                    module.base_kernel.add_(torch.randn(module.base_kernel.shape, generator=generator) * 0.2)
            sel = model.candidate_selector
            for p in (sel.predecessor_codebook, sel.successor_codebook):
                p.normal_(0.0, std, generator=generator)
            sel.hidden_projection.weight.normal_(0.0, std, generator=generator)
        return model.eval()


def is_dflash2(drafter: Any) -> bool:
    """Whether `drafter` carries a candidate selector (a DFlash2 drafter)."""
    return isinstance(drafter, DFlash2Drafter)
