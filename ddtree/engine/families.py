"""What ddtree knows about each model family, in one table keyed by `model_type` (Liger-Kernel style).

A row says what a family has (tree-exact GDN, recurrent layers, its own MTP head); which methods that lets it run
is the methods table's question (ddtree.engine.methods.supports). A family absent from the table is treated as pure
attention, checked at run time by `TargetSession.check_method` (a cache with linear-attention layers no row covers
is refused).

    family("qwen3_5_text").gdn          # True: tree-exact Gated DeltaNet (ddtree.engine.gdn)
    family("qwen3").own_head            # False: no MTP head of its own (method=mtp drafts with the target's)
    family("mamba2").recurrent          # True: recurrent layers, no exact tree verification
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ddtree.errors import ConfigError

# Embedding access: how the authors' code reaches the target's embeddings / head on this family.
DIRECT = "direct"  # target.model.embed_tokens and target.lm_head exist
NESTED = "nested"  # a multimodal wrapper nests the text model; compat's embedding-access patch resolves it

# Position layout of a family's base model, for ddtree.engine.forward.LeanForward (None: the plain model call).
ROPE = "rope"  # the rotary table and the layers take the [B, T] position ids
MROPE_TEXT = "mrope_text"  # the rotary table takes them 3 times ([3, B, T], text-only M-RoPE), the layers once

# Tiny-config hints (ddtree.tiny): a hybrid's linear-attention geometry, a MoE's experts.
# a Qwen3.5/3.6 wrapper's vision tower at test size (the tiny text model's width: 64)
_QWEN_VISION_TINY = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                         spatial_merge_size=1, temporal_patch_size=1)
_HYBRID_TINY = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4)
_MOE_TINY = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# families a published DFlash drafter serves (docs/targets.md): windows of 8, shorter than a prompt plus a tree
_WINDOW = dict(sliding_window=8)
_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
               first_k_dense_replace=1)
_LOCAL_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)


@dataclass(frozen=True)
class Family:
    """One model_type. `gdn_class`: "module:Class" of its Gated DeltaNet layer when it has one."""

    model_type: str
    recurrent: bool = False  # recurrent layers that cannot verify a draft tree or roll back exactly: the baseline only
    gdn_class: str | None = None
    embedding_access: str = DIRECT
    wrapper_class: str | None = None  # "module:Class" of the nesting wrapper model, when NESTED
    tiny: Mapping[str, Any] = field(default_factory=dict)  # config overrides a tiny test model needs
    hybrid_every: int = 0  # tiny hybrids: every n-th layer is full attention, the others linear (0: no GDN)
    sliding_every: int = 0  # tiny models: every n-th layer is full attention, the others sliding-window ones
    traits: str = ""  # what its layers have beyond plain attention (the support table's column)
    sinks: bool = False  # learned attention sinks: a flash kernel that drops them (transformers: silently) is refused
    lean: str | None = None  # ROPE / MROPE_TEXT: LeanForward reproduces its base model's forward bitwise
    # the family's own MTP head (ddtree.engine.drafter.mtp): "module:Class" of its decoder layer and RMSNorm;
    # mtp_mrope: its rotary table takes the positions 3 times (text-only M-RoPE) where `lean` does not say so
    mtp_layer: str | None = None
    mtp_norm: str | None = None
    mtp_mrope: bool = False
    # a multimodal wrapper's tiny test model: its text config's model_type and the wrapper's own overrides (vision)
    tiny_text: str | None = None
    tiny_outer: Mapping[str, Any] = field(default_factory=dict)
    # its input embedding module does more than a lookup (Muse-Glimmer's adds a weight-less norm): the drafters read
    # the matrix's rows as the public code does, and the authors' code, which calls the module, is refused
    embeds_more: bool = False

    @property
    def gdn(self) -> bool:
        return self.gdn_class is not None

    @property
    def own_head(self) -> bool:
        """It carries an MTP head of its own (the drafter of method=mtp)."""
        return self.mtp_layer is not None


_QWEN3_5_GDN = "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5GatedDeltaNet"
_QWEN3_5_MOE_GDN = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeGatedDeltaNet"
_QWEN3_NEXT_GDN = "transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextGatedDeltaNet"
_Q35, _Q35M, _QN = ("transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5",
                    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5Moe",
                    "transformers.models.qwen3_next.modeling_qwen3_next:Qwen3Next")
_MTP_QWEN3_5 = dict(mtp_layer=_Q35 + "DecoderLayer", mtp_norm=_Q35 + "RMSNorm", mtp_mrope=True)
_MTP_QWEN3_5_MOE = dict(mtp_layer=_Q35M + "DecoderLayer", mtp_norm=_Q35M + "RMSNorm", mtp_mrope=True)
_MTP_QWEN3_NEXT = dict(mtp_layer=_QN + "DecoderLayer", mtp_norm=_QN + "RMSNorm")

# Recurrent-state families whose layers cannot verify a tree or roll back rejected tokens exactly.
_AR_ONLY_TYPES = ("falcon_h1", "nemotron_h", "granitemoehybrid", "mamba", "mamba2", "lfm2", "lfm2_moe", "lfm2_vl",
                  "jamba", "bamba", "zamba", "zamba2", "falcon_mamba", "recurrent_gemma", "rwkv", "minimax",
                  "olmo_hybrid")

_ROWS: tuple[Family, ...] = (
    Family("qwen3", lean=ROPE),
    Family("llama", lean=ROPE),
    Family("gemma2"),
    # families a published DFlash drafter serves (tests/test_targets.py: the fp32 grid and a bf16 verdict row each)
    Family("gpt_oss", tiny={**_LOCAL_EXPERTS, **_WINDOW}, sliding_every=2, sinks=True,
           traits="sliding 1/2, sinks, MoE"),
    Family("gemma3_text", tiny={**_WINDOW, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
           sliding_every=3, traits="sliding 5/6"),
    Family("gemma4_text", tiny={**_WINDOW, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 16},
           sliding_every=3, traits="sliding 5/6, per-layer inputs"),
    Family("qwen3_moe", tiny=_MOE_TINY, traits="MoE"),
    Family("minimax_m2", tiny=_LOCAL_EXPERTS, traits="MoE"),
    Family("deepseek_v3", tiny={**_ROUTED, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4},
           traits="MLA, MoE"),
    Family("laguna", tiny={**_MOE_TINY, **_WINDOW}, sliding_every=2, traits="sliding, MoE"),
    Family("glm4_moe", tiny=_ROUTED, traits="MoE, partial RoPE"),
    Family("qwen3_5_text", gdn_class=_QWEN3_5_GDN, tiny=_HYBRID_TINY, hybrid_every=4, lean=MROPE_TEXT,
           **_MTP_QWEN3_5),
    Family("qwen3_5", gdn_class=_QWEN3_5_GDN, embedding_access=NESTED, tiny=_HYBRID_TINY, hybrid_every=4,
           wrapper_class="transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5Model", tiny_text="qwen3_5_text",
           tiny_outer=dict(vision_config=_QWEN_VISION_TINY), **_MTP_QWEN3_5),
    Family("qwen3_5_moe_text", gdn_class=_QWEN3_5_MOE_GDN, tiny={**_HYBRID_TINY, **_MOE_TINY}, hybrid_every=4,
           lean=MROPE_TEXT, **_MTP_QWEN3_5_MOE),
    Family("qwen3_5_moe", gdn_class=_QWEN3_5_MOE_GDN, embedding_access=NESTED, tiny={**_HYBRID_TINY, **_MOE_TINY},
           hybrid_every=4, wrapper_class="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:Qwen3_5MoeModel",
           tiny_text="qwen3_5_moe_text", tiny_outer=dict(vision_config=_QWEN_VISION_TINY), **_MTP_QWEN3_5_MOE),
    Family("qwen3_next", gdn_class=_QWEN3_NEXT_GDN, tiny={**_HYBRID_TINY, **_MOE_TINY}, hybrid_every=4, lean=ROPE,
           **_MTP_QWEN3_NEXT),
    Family("qwen3_vl", embedding_access=NESTED,
           wrapper_class="transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLModel"),
    Family("qwen3_vl_moe", embedding_access=NESTED,
           wrapper_class="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeModel"),
    # image-text-to-text only (no causal-LM class): the text model through the wrapper; text layers sliding 3 of 4
    # with NoPE full-attention layers, logits times output_multiplier then soft-capped (docs/targets.md)
    Family("muse_glimmer", embedding_access=NESTED, embeds_more=True, traits="sliding 3/4, NoPE",
           wrapper_class="transformers.models.muse_glimmer.modeling_muse_glimmer:MuseGlimmerModel",
           tiny={**_WINDOW, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, tiny_text="muse_glimmer_text",
           tiny_outer=dict(vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=2, patch_size=4, pos_emb_height=4, pos_emb_width=4),
                           out_hidden_size=64, projector_hidden_size=32, image_token_id=3, video_token_id=4)),
    # a wrapper whose head lives on a nested causal LM (target.lm_head -> language_model.lm_head)
    Family("nemotron_h_omni", recurrent=True, embedding_access=NESTED,
           wrapper_class="transformers.models.nemotron_h_omni.modeling_nemotron_h_omni:NemotronH_Omni_Reasoning_V3"),
    *(Family(name, recurrent=True) for name in _AR_ONLY_TYPES),
)

FAMILIES: Mapping[str, Family] = MappingProxyType({row.model_type: row for row in _ROWS})
_ATTENTION_ONLY = Family("")  # an unknown model_type: pure attention until the cache says otherwise


def family(model_type: str) -> Family:
    """The table row of `model_type`; an unknown type is pure attention (checked again at run time)."""
    return FAMILIES.get(model_type, _ATTENTION_ONLY)


def model_type(model: Any) -> str:
    """The text model's model_type (a multimodal wrapper's `text_config`, else the config's own)."""
    cfg = model.config
    text = getattr(cfg, "text_config", None)
    return getattr(text, "model_type", None) or cfg.model_type


def auto_model_class(model_type: str) -> Any:
    """The transformers Auto class that builds a causal LM of `model_type`: AutoModelForCausalLM, else (a multimodal
    wrapper with no causal-LM class, such as Muse-Glimmer's) AutoModelForImageTextToText."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT,
    )

    if model_type not in CAUSAL and model_type in IMAGE_TEXT:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def check_family_has_mtp(mtype: str) -> None:
    """Refuse a family without an MTP head of its own (before any weights load)."""
    if not family(mtype).own_head:
        raise ConfigError("method", f"method=mtp needs the target's own MTP head, and a '{mtype}' target has none "
                          "(Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints carry one)",
                          "use method=dflash or method=ddtree with a drafter, or method=ar")


def gdn_classes() -> tuple[str, ...]:
    """"module:Class" of every Gated DeltaNet layer the table names, each once, in table order."""
    return tuple(dict.fromkeys(row.gdn_class for row in _ROWS if row.gdn_class))


def has_tp_plan(model_type: str) -> bool:
    """Whether transformers ships a tensor-parallel plan for the family (its config class's `base_model_tp_plan`):
    what `from_pretrained(..., tp_plan="auto")` shards; a multimodal wrapper's, its text model's. False for a
    model_type transformers does not know."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        return False
    text = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    return bool(getattr(config_class, "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None))
