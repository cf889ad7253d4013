"""EAGLE-3 drafters (Li et al., 2025) in the public checkpoint format, and method=eagle3's proposer.

The format as loaded here (read from SGLang's and vLLM's loaders; docs/eagle3.md names the sources):
config.json, a Llama config of the draft layer plus

    draft_vocab_size             rows of its own lm_head (absent: the target's vocab_size)
    target_hidden_size           the target's width, where it differs from the draft layer's (absent: hidden_size)
    eagle_config.eagle_aux_hidden_state_layer_ids   (or the same key at the top level) the three target layers whose
                                 *inputs* are fused (id j: the hidden state before layer j, HF's hidden_states[j]);
                                 absent: (2, L // 2, L - 3) of the target's L layers, the serving engines' default
    norm_before_residual         (optional, false) the residual after hidden_norm rather than before it

and its tensors (safetensors, one file or shards with an index; pytorch_model.bin also read):

    fc.weight                    [H, 3 Ht] fusing the three aux hidden states (concatenated in id order)
    midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight
    midlayer.self_attn.{q,k,v}_proj.weight  [.., 2H]: over cat(input_layernorm(embedding), hidden_norm(hidden))
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight [draft_vocab_size, H]
    d2t [draft_vocab_size] (int): target id = draft id + d2t[draft id];  t2d [vocab_size] (bool): in the draft vocab
    embed_tokens.weight          optional: absent, the target's input embeddings are read

(`layers.0.` is accepted for `midlayer.`, and a leading `model.`, as vLLM accepts them.)

Positions as the serving engines run it: the draft layer at rotary position p reads the target's aux hidden states
at p (fused by fc) with the embedding of token p + 1, and its output predicts token p + 2 (logits over the draft
vocabulary, mapped to the target's ids by d2t; the rest -inf). A further step feeds that output (before `norm`) back
as the hidden state with the drafted token, one position on. The draft layer keeps its own KV cache across rounds, a
fixed buffer (`new_kv`) whose drafted rows are written over next round, as method=mtp's head does: the proposer is
MTPProposer's rounds over this layer's `step`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from ddtree.engine.checks import check_budget, check_mtp_args
from ddtree.engine.proposers import MTPProposer
from ddtree.errors import ConfigError

SETTING = "drafter.name_or_path"
_FIX = "point drafter.name_or_path at an EAGLE-3 checkpoint in the public layout (docs/eagle3.md)"
_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def default_aux_layers(num_target_layers: int) -> list[int]:
    """The serving engines' aux layers where a checkpoint names none: early, middle, late (inputs of those layers)."""
    n = num_target_layers
    return [2, n // 2, n - 3]


@dataclass(frozen=True)
class Eagle3Config:
    """What the draft layer is, read from config.json (`from_dict`): the Llama config of its one layer and the EAGLE-3
    fields around it."""

    layer: LlamaConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: default_aux_layers of the target
    norm_before_residual: bool = False

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> Eagle3Config:
        raw = dict(raw)
        inner = raw.pop("transformer_layer_config", None)  # speculators' layout: the layer's config nested
        if isinstance(inner, dict):
            raw = {**inner, **raw}
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        if eagle.get("use_aux_hidden_state") is False:
            raise ConfigError(SETTING, f"{where} sets eagle_config.use_aux_hidden_state=false: an EAGLE-1/2 drafter, "
                              "not EAGLE-3 (no fc over three target layers)", _FIX)
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if not isinstance(raw.get(key), int):
                raise ConfigError(SETTING, f"{where} has no integer {key}", _FIX)
        if int(raw.get("num_hidden_layers", 1) or 1) != 1:
            raise ConfigError(SETTING, f"{where} declares {raw['num_hidden_layers']} draft layers; EAGLE-3 "
                              "drafters here run one (midlayer)", _FIX)
        if aux is not None and (not isinstance(aux, list) or len(aux) != 3 or
                                not all(isinstance(j, int) and j >= 1 for j in aux)):
            raise ConfigError(SETTING, f"{where}: eagle_aux_hidden_state_layer_ids must be three layer ids >= 1, "
                              f"got {aux!r}", _FIX)
        keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "eagle_config",
                                                             "transformer_layer_config", "auto_map")}
        keep["num_hidden_layers"] = 1
        layer = LlamaConfig(**keep)
        layer._attn_implementation = "sdpa"
        return cls(layer=layer, draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                   target_hidden_size=int(raw.get("target_hidden_size") or raw["hidden_size"]),
                   aux_layer_ids=tuple(aux) if aux is not None else None,
                   norm_before_residual=bool(raw.get("norm_before_residual", False)))

    def to_dict(self) -> dict[str, Any]:
        """config.json as the public checkpoints write it (LlamaForCausalLMEagle3)."""
        d = self.layer.to_dict()
        for k in ("_attn_implementation_autoset", "transformers_version", "dtype", "torch_dtype"):
            d.pop(k, None)
        d.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                 draft_vocab_size=self.draft_vocab_size, target_hidden_size=self.target_hidden_size,
                 norm_before_residual=self.norm_before_residual)
        if self.aux_layer_ids is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                                 "use_aux_hidden_state": True}
        return d


class _Attention(nn.Module):
    """The draft layer's attention: queries, keys and values over [embedding ‖ hidden] (2H), RoPE, its KV cache."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        bias = bool(getattr(c, "attention_bias", False))
        self.q_proj = nn.Linear(2 * c.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple, mask: torch.Tensor | None, cache: DynamicCache) -> torch.Tensor:
        b, q, _ = x.shape
        query = self.q_proj(x).view(b, q, self.heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *rope)
        key, value = cache.update(key, value, 0)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class _MidLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(c)


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter: fc, one draft layer (`midlayer`), norm, its own lm_head over the draft vocabulary with
    d2t / t2d; the target's embeddings where the checkpoint has none, borrowed by `bind` (never copied)."""

    def __init__(self, config: Eagle3Config, own_embeddings: bool = False):
        super().__init__()
        c = config.layer
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, c.hidden_size, bias=bool(getattr(c, "bias", False)))
        self.midlayer = _MidLayer(c)
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embeddings else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(c)
        self._borrowed: tuple = (None,)  # (the target's input embeddings,): a tuple, kept out of the parameters
        self.num_target_layers: int | None = None

    # ---- what the engine reads -------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def aux_layer_ids(self) -> list[int]:
        """The three aux ids (inputs of those target layers), the checkpoint's or the default (after `bind`)."""
        ids = self.config.aux_layer_ids
        return list(ids) if ids is not None else default_aux_layers(self.num_target_layers)

    @property
    def target_layer_ids(self) -> list[int]:
        """The aux hidden states in ddtree.engine.target.context_features numbering (output of layer j - 1)."""
        return [j - 1 for j in self.aux_layer_ids]

    def check_compatible(self, target: nn.Module) -> None:
        """Refuse a target this drafter was not made for, in one line: widths, depth, vocabulary."""
        tc = target.config.get_text_config()
        fix = "use the EAGLE-3 drafter trained for this target"
        if tc.hidden_size != self.config.target_hidden_size:
            raise ConfigError("drafter", f"the EAGLE-3 drafter fuses hidden states of width "
                              f"{self.config.target_hidden_size}; the target's are {tc.hidden_size}", fix)
        if self.embed_tokens is None and tc.hidden_size != self.config.hidden_size:
            raise ConfigError("drafter", f"the EAGLE-3 drafter has no embeddings of its own and its width "
                              f"{self.config.hidden_size} is not the target's {tc.hidden_size}", fix)
        ids = self.config.aux_layer_ids or default_aux_layers(tc.num_hidden_layers)
        if min(ids) < 1 or max(ids) >= tc.num_hidden_layers:
            raise ConfigError("drafter", f"the EAGLE-3 drafter reads target layers {list(ids)}; the target has "
                              f"{tc.num_hidden_layers} (ids 1..{tc.num_hidden_layers - 1})", fix)
        top = int((self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)).max())
        if top >= tc.vocab_size or self.config.vocab_size > tc.vocab_size:
            raise ConfigError("drafter", f"the EAGLE-3 drafter's vocabulary reaches id {max(top, self.config.vocab_size - 1)}; "
                              f"the target's has {tc.vocab_size} ids", fix)

    def bind(self, target: nn.Module) -> Eagle3Drafter:
        """Check against `target` and borrow its input embeddings (where the checkpoint has none) and its depth."""
        self.check_compatible(target)
        self.num_target_layers = target.config.get_text_config().num_hidden_layers
        self._borrowed = (target.get_input_embeddings() if self.embed_tokens is None else None,)
        self._vocab = target.config.get_text_config().vocab_size
        self._target_ids = self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)
        return self

    def new_kv(self, capacity: int, streams: int = 1) -> torch.Tensor:
        """The draft layer's KV cache: a fixed buffer [2, streams, Hkv, capacity, d] (keys, values) in its dtype on
        its device (`step` writes and reads it)."""
        attn = self.midlayer.self_attn
        return torch.zeros(2, streams, attn.kv_heads, capacity, attn.head_dim, dtype=self.dtype,
                           device=self.fc.weight.device)

    # ---- the forward ------------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._borrowed[0])(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's ids of the layer's outputs `hidden` [..., H]: the draft vocabulary's at their
        target ids (d2t), -inf elsewhere."""
        draft = self.lm_head(self.norm(hidden))
        full = draft.new_full((*draft.shape[:-1], self._vocab), float("-inf"))
        return full.index_copy_(-1, self._target_ids, draft)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: DynamicCache) -> torch.Tensor:
        """embeds [B, q, H] (the tokens), hidden [B, q, 3 Ht] (the target's aux states before them, fused here) or
        [B, q, H] (the layer's own earlier outputs), position_ids [B, q], mask additive [B, 1, q, past + q] (None:
        every key visible). Returns the layer's outputs [B, q, H] (before `norm`: what a further step reads)."""
        if hidden.shape[-1] != self.config.hidden_size:  # the target's three states: fused (as SGLang tells them)
            hidden = self.fc(hidden)
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        h = residual + layer.self_attn(x, self.rotary(hidden, position_ids), mask, cache)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
             visible: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """One draft step, the only one drafting runs (the eager proposer's, the compiled round's, the batched
        round's): the forward over the fixed buffer `kv` (`new_kv`). ids [B, q], hidden [B, q, 3 Ht or H], positions
        and rows [q] (rotary positions; the rows receiving the q keys and values; [B, q]: each stream's own,
        ddtree.engine.batch), visible [q, C] or [B, q, C] (bool: which of the first C rows each query attends over,
        its own included) or C alone (every one of them: no mask). Returns [B, q, H]."""
        b, q = ids.shape
        if isinstance(visible, int):
            mask, width = None, visible
        else:
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=visible.device)
            mask = mask.masked_fill_(~visible, torch.finfo(self.dtype).min).view(-1, 1, q, visible.shape[-1])
            width = visible.shape[-1]
        return self(self.embed(ids), hidden, positions.view(-1, q).expand(b, q), mask, _FixedRows(kv, rows, width))

    def traced_step(self):
        """`step` as torch.compile traces it (StaticMTP's round): the same."""
        return self.step

    def why_not_traced(self, device: torch.device) -> str | None:
        """Why the step cannot be traced into the compiled round, in words; None where it can."""
        return "the EAGLE-3 drafter is on another device" if self.fc.weight.device != device else None

    # ---- building ---------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", revision: str | None = None) -> Eagle3Drafter:
        """An EAGLE-3 checkpoint (a local folder or a hub id): config.json and its tensors; a malformed one is
        refused in one line. Bind it to its target (`bind`) before drafting."""
        directory = _local_dir(name_or_path, revision)
        cfg_file = directory / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(SETTING, f"{name_or_path!s} has no config.json", _FIX)
        config = Eagle3Config.from_dict(json.loads(cfg_file.read_text()), f"{name_or_path!s}/config.json")
        state = _read_tensors(directory, name_or_path)
        drafter = cls(config, own_embeddings="embed_tokens.weight" in state)
        drafter.load_checkpoint_state(state, str(name_or_path))
        return drafter.to(device=device, dtype=dtype or drafter.dtype).eval()

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], where: str = "the checkpoint") -> None:
        """Load tensors under the public names, refusing a malformed set in one line (before any copy)."""
        c = self.config
        d2t = state.get("d2t")
        if d2t is None and c.draft_vocab_size < c.vocab_size:
            raise ConfigError(SETTING, f"{where} has no d2t: its lm_head's {c.draft_vocab_size} draft ids cannot be "
                              f"mapped to the target's {c.vocab_size}", _FIX)
        fc = state.get("fc.weight")
        if fc is None or fc.dim() != 2 or fc.shape[1] != 3 * c.target_hidden_size:
            width = "missing" if fc is None else f"{list(fc.shape)}"
            raise ConfigError(SETTING, f"{where}: fc.weight is {width}; EAGLE-3 fuses three target hidden states "
                              f"([{c.hidden_size}, 3 x {c.target_hidden_size}])", _FIX)
        head = state.get("lm_head.weight")
        if head is None or head.shape[0] != c.draft_vocab_size:
            rows = "missing" if head is None else f"{head.shape[0]} rows"
            raise ConfigError(SETTING, f"{where}: lm_head.weight is {rows}; config.json's draft_vocab_size is "
                              f"{c.draft_vocab_size}", _FIX)
        if d2t is not None:
            if d2t.dim() != 1 or d2t.shape[0] != c.draft_vocab_size or d2t.is_floating_point():
                raise ConfigError(SETTING, f"{where}: d2t must be {c.draft_vocab_size} integer offsets, got "
                                  f"{d2t.dtype} {list(d2t.shape)}", _FIX)
            ids = d2t.long() + torch.arange(d2t.shape[0])
            if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size or ids.unique().numel() != ids.numel():
                raise ConfigError(SETTING, f"{where}: d2t maps draft ids outside the target's {c.vocab_size} ids "
                                  "or two onto one", _FIX)
        state = {**state, "d2t": d2t.long() if d2t is not None else torch.zeros(c.draft_vocab_size, dtype=torch.long)}
        if "t2d" not in state:
            t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
            t2d[state["d2t"] + torch.arange(c.draft_vocab_size)] = True
            state["t2d"] = t2d
        state["t2d"] = state["t2d"].bool()
        own = self.state_dict()
        own.pop("rotary.inv_freq", None)
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            what = "; ".join(p for p in (f"missing {', '.join(missing[:4])}" if missing else "",
                                         f"unexpected {', '.join(extra[:4])}" if extra else "") if p)
            raise ConfigError(SETTING, f"{where} is not an EAGLE-3 checkpoint of this config: {what}", _FIX)
        wrong = [k for k in own if tuple(state[k].shape) != tuple(own[k].shape)]
        if wrong:
            k = wrong[0]
            raise ConfigError(SETTING, f"{where}: {k} is {list(state[k].shape)}, config.json makes it "
                              f"{list(own[k].shape)}", _FIX)
        self.load_state_dict(state, strict=False)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """This drafter's tensors under the public names (the borrowed embeddings not among them)."""
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        return state

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """config.json and model.safetensors in the public layout (what `from_pretrained` reads)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        save_file(self.checkpoint_state(), str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    @classmethod
    def random_for_target(cls, target: nn.Module, seed: int = 0, std: float = 0.02,
                          draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None,
                          norm_before_residual: bool = False) -> Eagle3Drafter:
        """A random drafter for `target` (tiny models built in code): the target's widths, a draft vocabulary of
        `draft_vocab_size` target ids (default: half of them, a seeded choice), bound to it."""
        tc = target.config.get_text_config()
        gen = torch.Generator().manual_seed(seed)
        vd = draft_vocab_size or max(1, tc.vocab_size // 2)
        layer = LlamaConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                            num_attention_heads=tc.num_attention_heads,
                            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
                            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
                            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), vocab_size=tc.vocab_size,
                            max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
                            num_hidden_layers=1, tie_word_embeddings=False)
        layer._attn_implementation = "sdpa"
        config = Eagle3Config(layer, draft_vocab_size=vd, target_hidden_size=tc.hidden_size,
                              aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids else None,
                              norm_before_residual=norm_before_residual)
        drafter = cls(config)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            ids = torch.randperm(tc.vocab_size, generator=gen)[:vd].sort().values
            drafter.d2t.copy_(ids - torch.arange(vd))
            drafter.t2d.zero_()
            drafter.t2d[ids] = True
        emb = target.get_input_embeddings().weight
        return drafter.to(device=emb.device, dtype=emb.dtype).eval().bind(target)


def _local_dir(name_or_path: str | os.PathLike, revision: str | None) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(name_or_path), revision=revision,
                                      allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json",
                                                      "pytorch_model.bin"]))
    except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError) as e:
        raise ConfigError(SETTING, f"{name_or_path!s} is neither a local directory nor a reachable hub repository "
                          f"({type(e).__name__})", _FIX) from e


def _read_tensors(directory: Path, name: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under the public names (`layers.0.` read as `midlayer.`, `model.` dropped)."""
    from safetensors.torch import load_file

    single, index, binary = (directory / n for n in _NAMES)
    if index.is_file():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(directory / shard)))
    elif single.is_file():
        state = load_file(str(single))
    elif binary.is_file():
        state = torch.load(binary, map_location="cpu", weights_only=True)
    else:
        raise ConfigError(SETTING, f"{name!s} has no weights ({', '.join(_NAMES)})", _FIX)
    out = {}
    for k, v in state.items():
        k = k.removeprefix("model.")
        out["midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k] = v
    return out


class _FixedRows:
    """The draft layer's KV cache in a fixed buffer [2, 1, Hkv, Cd, d]: `update` writes the step's keys and values
    at `rows` and returns the first `width` rows (its query sees them under the step's mask)."""

    def __init__(self, kv: torch.Tensor, rows: torch.Tensor, width: int):
        self.kv, self.rows, self.width = kv, rows, width

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        new = torch.stack([key, value])
        if self.rows.dim() == 1:
            kv = self.kv.index_copy_(-2, self.rows, new)
        else:  # [B, q]: each stream's own rows (ddtree.engine.batch)
            kv = self.kv.scatter_(-2, self.rows[None, :, None, :, None].expand(new.shape), new)
        return (kv if self.width == kv.shape[-2] else kv.narrow(-2, 0, self.width)).unbind(0)


class Eagle3Proposer(MTPProposer):
    """method=eagle3: MTPProposer's rounds (the committed tokens read into the draft layer's cache, then a chain of
    `steps` or, topk > 1, an EAGLE-2 style tree of the `budget` best nodes; drafted rows written over next round) over
    an EAGLE-3 drafter; under compile its draft from a generation's second round on is StaticMTP's graph over the
    drafter's `step`."""

    def __init__(self, target, drafter: Eagle3Drafter, *, steps: int, topk: int = 1, budget: int = 64):
        check_mtp_args(steps, topk, "eagle3")
        check_budget(budget)
        if not isinstance(drafter, Eagle3Drafter):
            raise ConfigError("drafter", "method=eagle3 drafts with an EAGLE-3 drafter, not "
                              f"{type(drafter).__name__}", "set drafter=pretrained drafter.name_or_path=<an EAGLE-3 "
                              "checkpoint> (docs/eagle3.md)")
        self.head = drafter.bind(target)
        self.steps, self.topk, self.budget = steps, topk, budget
        self.feature_layers = drafter.target_layer_ids
        self.max_nodes = (steps if topk == 1 else budget) + 1
        self.kv = None
        self.ctx_len = 0
        self._tokens = None
        self._capacity = 0
