"""The target's own multi-token-prediction (MTP) head: Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints carry one.

The public format (what vLLM's `qwen3_5_mtp.py` / `qwen3_next_mtp.py` and SGLang's `qwen3_5_mtp.py` load):
`mtp_num_hidden_layers` (1) in the text config; in the target's safetensors, beside its own weights,

    mtp.fc.weight                    [H, 2H], no bias, over cat(pre_fc_norm_embedding(embed(token)),
                                                               pre_fc_norm_hidden(hidden))
    mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight, mtp.norm.weight   (the family's RMSNorm)
    mtp.layers.0.*                   one full-attention decoder layer of the family (MoE families: MoE), own KV cache

The embeddings and the head are the target's. `hidden` is what the serving engines hand the head: the target
model's output hidden state (after its final norm) at position p, with the token at p + 1; the layer runs at
rotary position p and its output (after `mtp.norm`) gives the logits of the token at p + 2 through the target's
head. A further draft step feeds that output back as `hidden` with the drafted token, one position on.

transformers drops these tensors at load (`_keys_to_ignore_on_load_unexpected = ['^mtp.*']`); this module reads
them from the checkpoint files (a single file or shards with an index; a multimodal wrapper's names as
published: `mtp.` at the top level, `model.mtp.` / `model.language_model.mtp.` also accepted).
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ddtree.engine.compiled import _FrozenLayer
from ddtree.engine.families import check_family_has_mtp, family, model_type
from ddtree.engine.fixed_kv import grouped_attention, grouped_bias
from ddtree.engine.forward import _MLPS, LeanLayer
from ddtree.errors import ConfigError

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# where checkpoints put the head, the published one first
MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.", "language_model.mtp.")
_METHOD_FIX = "use method=dflash or method=ddtree with a drafter, or method=ar"


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def mtp_layer_count(config) -> int:
    """The config's `mtp_num_hidden_layers` (0 when absent)."""
    return int(getattr(_text_config(config), "mtp_num_hidden_layers", 0) or 0)


def _local_dir(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """The checkpoint folder: local, or the hub snapshot's safetensors index / single file (no download of shards)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(name_or_path), revision=revision,
                                      allow_patterns=["config.json", WEIGHTS_INDEX_NAME]))
    except (HFValidationError, HfHubHTTPError, LocalEntryNotFoundError) as e:
        raise ConfigError("model.name_or_path", f"{name_or_path!s} is neither a local directory nor a reachable hub "
                          f"repository ({type(e).__name__})", "pass the target's checkpoint directory or hub id") from e


def _shard_names(directory: Path) -> dict[str, str]:
    """{tensor name: shard file} of a checkpoint folder, read from the index or the safetensors header alone."""
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / WEIGHTS_NAME
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), WEIGHTS_NAME)
    return {}


def mtp_tensor_map(name_or_path: str | os.PathLike, revision: str | None = None) -> tuple[Path, str, dict[str, str]]:
    """(folder, prefix, {tensor name: shard}) of the checkpoint's MTP tensors; ConfigError when it has none.

    Reads the index or the header only: no weights load here."""
    directory = _local_dir(name_or_path, revision)
    names = _shard_names(directory)
    for prefix in MTP_PREFIXES:
        found = {k: v for k, v in names.items() if k.startswith(prefix)}
        if found:
            return directory, prefix, found
    raise ConfigError("method", f"method=mtp needs the target's MTP head, but the checkpoint {name_or_path!s} has no "
                      f"MTP tensors (none named {MTP_PREFIXES[0]}*)",
                      "use a checkpoint that ships its mtp.* weights (the original Qwen3.5/3.6/Next release), or " +
                      _METHOD_FIX)


def check_mtp_checkpoint(name_or_path: str | os.PathLike, mtype: str, revision: str | None = None) -> None:
    """Every check of `method=mtp` on a checkpoint that can run before its weights load."""
    check_family_has_mtp(mtype)
    mtp_tensor_map(name_or_path, revision)


def _fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors (`mlp.experts.{e}.{gate,up,down}_proj.weight`, Qwen3-Next's published layout) as the
    fused `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] transformers' MoE blocks hold."""
    pat = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state.items():
        m = pat.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for base, parts in groups.items():
        n = len(parts["down_proj"])
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], 0)
                                                   for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out


def head_attention(target_attention: str) -> str:
    """The MTP head's attention backend: the target's where the head's layer runs it (eager, sdpa), else sdpa. The
    head has no setting of its own (attention.drafter is the DFlash drafter's)."""
    return target_attention if target_attention in ("eager", "sdpa") else "sdpa"


def mtp_layer_config(target_config, attn_implementation: str = "sdpa"):
    """The target's text config for one full-attention layer (index 0), as the serving engines build the MTP layer."""
    cfg = copy.deepcopy(_text_config(target_config))
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    if hasattr(cfg, "full_attention_interval"):
        cfg.full_attention_interval = 1
    cfg._attn_implementation = head_attention(attn_implementation)
    return cfg


class MTPHead(nn.Module):
    """One MTP layer of the target's family, with the fc and the norms around it; the target's embeddings, rotary
    table and head are borrowed (`bind`), never copied. `target_layer_ids`: the feature the engine hands it, the
    target's last layer after the final norm (ddtree.engine.target.context_features numbering)."""

    def __init__(self, target_config, attn_implementation: str = "sdpa"):
        super().__init__()
        mtype = model_type(_SimpleModel(target_config))
        check_family_has_mtp(mtype)
        n = mtp_layer_count(target_config) or 1
        if n != 1:
            raise ConfigError("method", f"method=mtp runs one MTP layer; this checkpoint declares "
                              f"mtp_num_hidden_layers={n}", _METHOD_FIX)
        row = family(mtype)
        self.model_type = mtype
        self.config = mtp_layer_config(target_config, attn_implementation)
        self.num_target_layers = _text_config(target_config).num_hidden_layers
        h, eps = self.config.hidden_size, self.config.rms_norm_eps
        norm_cls = _import(row.mtp_norm)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_cls(h, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=eps)
        self.layers = nn.ModuleList([_import(row.mtp_layer)(self.config, 0)])
        self.norm = norm_cls(h, eps=eps)
        self._mrope = row.lean == "mrope_text" or row.mtp_mrope
        self._borrowed: tuple | None = None
        self._lean_layer: LeanLayer | None = None

    # ---- what the engine reads -------------------------------------------------------------------------------
    @property
    def target_layer_ids(self) -> list[int]:
        return [self.num_target_layers - 1]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def check_compatible(self, target: nn.Module) -> None:
        tc = _text_config(target.config)
        if tc.hidden_size != self.config.hidden_size or tc.num_hidden_layers != self.num_target_layers:
            raise ConfigError("method", "the MTP head was built for another target (hidden size or depth differs)",
                              "load the head from the target's own checkpoint")

    def bind(self, target: nn.Module) -> None:
        """Borrow the target's embeddings, head and rotary table (kept out of this module's parameters)."""
        self.check_compatible(target)
        base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        rotary = base.rotary_emb if hasattr(base, "rotary_emb") else base.language_model.rotary_emb
        self._borrowed = (target.get_input_embeddings(), target.get_output_embeddings(), rotary)

    def new_kv(self, capacity: int, streams: int = 1) -> torch.Tensor:
        """The head's KV cache: a fixed buffer [2, streams, Hkv, capacity, d] (keys, values) in its dtype on its
        device, row r holding the entry at row r (`step` writes and reads it)."""
        attn = self.layers[0].self_attn
        return torch.zeros(2, streams, self.config.num_key_value_heads, capacity, attn.head_dim, dtype=self.dtype,
                           device=self.fc.weight.device)

    # ---- the forward ------------------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._borrowed[0](ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._borrowed[1](hidden)

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
             visible: torch.Tensor, kv: torch.Tensor, layer: LeanLayer | None = None) -> torch.Tensor:
        """One MTP step, the only one drafting runs (the eager proposer's, the compiled round's StaticMTP, the batched
        round's): ids [B, q], hidden [B, q, H] (the hidden states before them), positions and rows [q] (rotary
        positions; the rows of `kv`, a `new_kv` buffer, that receive the q keys and values; [B, q]: each stream's
        own, ddtree.engine.batch), visible [q, C] or [B, q, C] (bool: which of the first C rows of `kv` each query
        attends over, its own included) or C alone (every one of them: no mask). Returns [B, q, H] after mtp.norm.
        layer: the layer's lean form (default the eager one; `traced_step` passes the traceable one)."""
        layer = layer or self._lean()
        b, q = ids.shape
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(self.embed(ids)), self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = positions.view(-1, q).expand(b, q)
        rope = self._borrowed[2](x, pos[None].expand(3, b, q) if self._mrope else pos)
        h = layer.norm1(x)
        query, gate = layer._queries(h)
        key, value = layer._keys_values(h)
        query, key = layer.rotary(query, key, *rope)
        if rows.dim() == 1:
            kv.index_copy_(-2, rows, torch.stack([key, value]))
        else:  # each stream's own rows
            new = torch.stack([key, value])
            kv.scatter_(-2, rows[None, :, None, :, None].expand(new.shape), new)
        width = visible if isinstance(visible, int) else visible.shape[-1]
        bias = None if isinstance(visible, int) else grouped_bias(visible, query.shape[1] // kv.shape[2], query.dtype)
        keys, values = (kv if width == kv.shape[-2] else kv.narrow(-2, 0, width)).unbind(0)
        out = grouped_attention(query, keys, values, bias, layer.attn.scaling)
        out = out.transpose(1, 2)  # [B, q, heads, d], as the gate
        if gate is not None:
            out = out * torch.sigmoid(gate)
        x = layer._feed_forward(x + layer.o(out.reshape(b, q, -1)))
        return self.norm(x)

    def _lean(self) -> LeanLayer:
        """The layer as the engine drives it (ddtree.engine.forward.LeanLayer: its norms check their weights'
        versions), built once."""
        if self._lean_layer is None:
            self._lean_layer = LeanLayer(self.layers[0])
        return self._lean_layer

    def why_not_traced(self, device: torch.device) -> str | None:
        """Why the step cannot be traced into the compiled round (StaticMTP), in words; None where it can."""
        layer = self.layers[0]
        impl = self.config._attn_implementation
        if impl not in ("eager", "sdpa"):
            return f"the MTP head's attention is {impl}"
        if self.fc.weight.device != device:
            return "the MTP head is on another device"
        if not LeanLayer.supports(layer):
            return f"the MTP head's layer ({type(layer).__name__}) is not a layer the lean forward drives"
        if type(layer.mlp).__name__ not in _MLPS:
            return f"the MTP head's MLP ({type(layer.mlp).__name__}) routes tokens (MoE): not traced yet"
        return None

    def traced_step(self):
        """`step` in a form torch.compile traces (the layer's norms frozen: their weights read once, here)."""
        with torch.inference_mode():
            layer = _FrozenLayer(self.layers[0])
        return functools.partial(self.step, layer=layer)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache: DynamicCache | None) -> torch.Tensor:
        """The head through transformers' own layer, batched and differentiable: what training runs
        (ddtree.train.mtp) and the tests' from-scratch reference; drafting runs `step`. embeds, hidden [B, q, H],
        position_ids [B, q], mask additive [B, 1, q, past + q] (None: every key visible). Returns [B, q, H] after
        mtp.norm."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope_ids = position_ids[None].expand(3, *position_ids.shape) if self._mrope else position_ids
        rope = self._borrowed[2](x, rope_ids)
        x = self.layers[0](x, position_embeddings=rope, attention_mask=mask, position_ids=position_ids, cache=cache)
        if isinstance(x, tuple):
            x = x[0]
        return self.norm(x)

    # ---- building ---------------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: nn.Module, name_or_path: str | os.PathLike | None = None,
                    revision: str | None = None, attn_implementation: str | None = None) -> MTPHead:
        """The head stored in `target`'s checkpoint (default: the folder or hub id it was loaded from), bound to it,
        in its dtype on its embeddings' device."""
        path = name_or_path or getattr(target, "name_or_path", None) or target.config._name_or_path
        check_family_has_mtp(model_type(target))
        if not path:
            raise ConfigError("method", "method=mtp reads the MTP head from the target's checkpoint, and this "
                              "target was not loaded from one", "load the target with from_pretrained, or pass "
                              "an MTPHead as the drafter")
        directory, prefix, names = mtp_tensor_map(path, revision)
        from safetensors import safe_open

        emb = target.get_input_embeddings().weight
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(names.values())):
            with safe_open(directory / shard, framework="pt") as f:
                for name in f.keys():
                    if name in names:
                        state[name.removeprefix(prefix)] = f.get_tensor(name)
        impl = attn_implementation or target.config._attn_implementation
        head = cls(target.config, attn_implementation=impl)
        head.load_state_dict(_fuse_experts(state), strict=True)
        head = head.to(device=emb.device, dtype=emb.dtype).eval()
        head.bind(target)
        return head

    @classmethod
    def random_for_target(cls, target: nn.Module, seed: int = 0, std: float = 0.02) -> MTPHead:
        """A random head for `target` (tiny test models built in code), bound to it."""
        gen = torch.Generator().manual_seed(seed)
        head = cls(target.config, attn_implementation=target.config._attn_implementation)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.dim() >= 2 or "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        emb = target.get_input_embeddings().weight
        head = head.to(device=emb.device, dtype=emb.dtype).eval()
        head.bind(target)
        return head

    def checkpoint_state(self, prefix: str = "mtp.") -> dict[str, torch.Tensor]:
        """This head's tensors under the published names (fused experts as transformers holds them)."""
        return {prefix + k: v.detach().contiguous() for k, v in self.state_dict().items()}


class _SimpleModel:
    """model_type() reads `.config`: a config alone, wrapped."""

    def __init__(self, config):
        self.config = config


def mtp_expand(head, logits: torch.Tensor, hidden: torch.Tensor, k: int, steps: int, step) -> tuple:
    """MTP's EAGLE-style expansion, every step's frontier k nodes of one depth (the eager proposer's, the compiled
    head's, ddtree.engine.drafter.mtp_static.StaticMTP, and, with a stream dimension, the batched round's:
    ddtree.engine.batch). logits [..., V] and hidden [..., H]: the head's guess after the root and the output that
    made it (leading dimensions: one stream, none, or N streams, [N, V] and [N, H], each expanded alone, row for row
    as one stream's). step(s, f_tok [..., k], f_src [..., k, H], f_anc [..., k, s - 1]) runs the head on the frontier
    at depth s (its token, the output that predicted it, its ancestors' cache entries) and returns (outputs
    [..., k, H], the entries it wrote [..., k]). Returns the pool (toks, scores, parents [..., n] and depths: one
    tensor / int per depth).

    The pool holds every drafted node in creation order (k at depth 1, then k * k children per step); a frontier
    node carries its token, cumulative score, pool index, the head output that predicted it (its input when
    expanded) and the head-cache entries of its ancestors (the entries its query may see). Ties between equal
    scores go to the earlier node (stable sorts), on every device."""
    dev = logits.device
    lead = logits.shape[:-1]
    vals, idx = torch.log_softmax(logits, -1).topk(k)
    toks, scores, parents, depths = [idx], [vals], [torch.full_like(idx, -1)], [1]
    f_tok, f_score, f_pool = idx, vals, torch.arange(k, device=dev).expand(*lead, k)
    f_src = hidden.unsqueeze(-2).expand(*lead, k, hidden.shape[-1])
    f_anc = torch.zeros(*lead, k, 0, dtype=torch.long, device=dev)  # [..., k, depth - 1]: the ancestors' entries
    size = k
    child = torch.arange(k * k, device=dev) // k  # candidate c's parent, as a row of the frontier
    for s in range(1, steps):  # the frontier is at depth s; token s sits at start + s, read one before
        out, entries = step(s, f_tok, f_src, f_anc)
        lv, li = torch.log_softmax(head.logits(out).float(), -1).topk(k)  # [..., k, k]
        c_tok, c_score = li.flatten(-2), (f_score[..., None] + lv).flatten(-2)
        toks.append(c_tok)
        scores.append(c_score)
        parents.append(f_pool[..., child])
        depths.append(s + 1)
        sel = torch.sort(-c_score, dim=-1, stable=True).indices[..., :k].sort(dim=-1).values  # the k best, in order
        up = child[sel]  # [..., k]: each one's parent, as a row of the frontier
        f_tok, f_score, f_pool = c_tok.gather(-1, sel), c_score.gather(-1, sel), size + sel
        f_anc = torch.cat([f_anc, entries[..., None]], -1).gather(-2, up[..., None].expand(*up.shape, s))
        f_src = out.gather(-2, up[..., None].expand(*up.shape, out.shape[-1]))
        size += k * k
    return toks, scores, parents, depths


def mtp_tree_tensors(root: torch.Tensor, toks: list, scores: list, parents: list, depths: list,
                     budget: int) -> tuple[torch.Tensor, ...]:
    """(tokens, parents, depths, scores) of the `budget` best nodes of an mtp_expand pool, root first: fixed shapes
    (min(budget, pool) + 1 nodes), no host read. One stream (root a scalar, the pool's tensors [n]) or N streams
    (roots [N], the pool's tensors [N, n]: outputs [N, nodes], row i stream i's tree alone)."""
    # cumulative log-probabilities never grow along a path: the best nodes (ties: the earlier) are closed
    # under ancestors; flat order = creation order puts parents first
    dev = root.device
    tok, score, parent = torch.cat(toks, -1), torch.cat(scores, -1), torch.cat(parents, -1)
    lead = tok.shape[:-1]
    depth = torch.cat([torch.full((n.shape[-1],), d, dtype=torch.long, device=dev)
                       for n, d in zip(toks, depths, strict=True)])
    size = tok.shape[-1]
    n = min(budget, size)
    keep = torch.sort(-score, dim=-1, stable=True).indices[..., :n].sort(dim=-1).values
    flat = torch.zeros_like(tok).scatter_(-1, keep, torch.arange(1, n + 1, device=dev).expand(*lead, n))
    kp = parent.gather(-1, keep)
    zero = torch.zeros(*lead, 1, dtype=torch.long, device=dev)
    return (torch.cat([root.reshape(*lead, 1).long(), tok.gather(-1, keep)], -1),
            torch.cat([zero - 1, torch.where(kp >= 0, flat.gather(-1, kp.clamp(min=0)), 0)], -1),
            torch.cat([zero, depth[keep]], -1), torch.cat([zero.float(), score.gather(-1, keep)], -1))
