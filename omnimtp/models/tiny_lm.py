"""Tiny, seeded causal LMs built from the real transformers classes: GLM-4.5 (Glm4Moe), DeepSeek-V3, GLM-5
(GlmMoeDsa) and the hybrid Qwen3-Next / Qwen3.5 / Qwen3.5-MoE.

They keep the structure our MTP code depends on — a MoE decoder block (router with group-limited
top-k, shared experts), the first `first_k_dense_replace` layers dense, MLA attention for DeepSeek-V3 and
GLM-5 (whose layers each run a DSA indexer), Gated-DeltaNet linear-attention layers before a full-attention
layer for the Qwen hybrids, one MTP layer — and shrink only widths and depths, so a forward takes
milliseconds on CPU. `initializer_range=0.2` keeps both the logits' argmax and the routers' top-k away from near-ties,
so greedy comparisons between differently batched forwards (speculative vs plain) are stable.

Token ids: the vocab has `TINY_LM_VOCAB_SIZE` entries; `TINY_LM_EOS_TOKEN_ID` is EOS and
`TINY_LM_PAD_TOKEN_ID` pads ragged prompts.
"""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

TINY_LM_VOCAB_SIZE = 64
TINY_LM_PAD_TOKEN_ID = 0
TINY_LM_BOS_TOKEN_ID = 1
TINY_LM_EOS_TOKEN_ID = 2
TINY_LM_FAMILIES = ("glm4_moe", "deepseek_v3", "glm_moe_dsa", "qwen3_next", "qwen3_5", "qwen3_5_moe")


def _shared_fields(vocab_size, hidden_size, num_hidden_layers, first_k_dense_replace, initializer_range) -> dict:
    """The sizes and ids both tiny families share: MoE with 4 routed experts (top-2) + 1 shared, one NextN layer."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_hidden_layers,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=first_k_dense_replace,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        pad_token_id=TINY_LM_PAD_TOKEN_ID,
        bos_token_id=TINY_LM_BOS_TOKEN_ID,
        eos_token_id=TINY_LM_EOS_TOKEN_ID,
        num_nextn_predict_layers=1,
    )


def tiny_glm4_moe_config(
    *,
    vocab_size: int = TINY_LM_VOCAB_SIZE,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    first_k_dense_replace: int = 1,
    initializer_range: float = 0.2,
) -> Glm4MoeConfig:
    """GLM-4.5's real sizes: hidden 5120, 92 layers (MTP layer 92), 160 routed experts, top-8."""
    config = Glm4MoeConfig(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        partial_rotary_factor=0.5,
        n_group=1,
        topk_group=1,
        use_qk_norm=True,
        **_shared_fields(vocab_size, hidden_size, num_hidden_layers, first_k_dense_replace, initializer_range),
    )
    config._attn_implementation = "sdpa"
    return config


def tiny_deepseek_v3_config(
    *,
    vocab_size: int = TINY_LM_VOCAB_SIZE,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    first_k_dense_replace: int = 1,
    initializer_range: float = 0.2,
) -> DeepseekV3Config:
    """DeepSeek-V3's real sizes: hidden 7168, 61 layers (MTP layer 61), MLA, 256 routed experts, top-8."""
    config = DeepseekV3Config(
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        **_shared_fields(vocab_size, hidden_size, num_hidden_layers, first_k_dense_replace, initializer_range),
    )
    config._attn_implementation = "sdpa"
    return config


def tiny_glm_moe_dsa_config(
    *,
    vocab_size: int = TINY_LM_VOCAB_SIZE,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    first_k_dense_replace: int = 1,
    index_topk: int = 4,
    index_share_for_mtp_iteration: bool = True,
    initializer_range: float = 0.2,
) -> GlmMoeDsaConfig:
    """GLM-5's real sizes: hidden 6144, 78 layers (MTP layer 78), MLA, DSA indexer with 32 heads choosing
    index_topk = 2048 keys, 256 routed experts, top-8, `index_share_for_mtp_iteration: true` (GLM-5.2).
    The indexer here has 2 heads, so many keys score exactly 0 after its ReLU and top-k breaks ties: the
    case where the order of keys and their number decide the selection."""
    fields = _shared_fields(vocab_size, hidden_size, num_hidden_layers, first_k_dense_replace, initializer_range)
    fields.pop("num_nextn_predict_layers")
    config = GlmMoeDsaConfig(
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        index_topk=index_topk,
        index_head_dim=16,
        index_n_heads=2,
        num_nextn_predict_layers=1,
        index_share_for_mtp_iteration=index_share_for_mtp_iteration,
        **fields,
    )
    config._attn_implementation = "sdpa"
    return config


def _qwen_hybrid_config(config_class, vocab_size, hidden_size, num_hidden_layers, initializer_range, **fields):
    """A Qwen3-Next / Qwen3.5 config (sdpa): Gated DeltaNet (linear attention) layers except every
    `num_hidden_layers`-th, which is gated full attention with a quarter of each head rotated; one MTP layer
    (`mtp_num_hidden_layers`). fields: the family's MLP sizes."""
    config = config_class(
        **fields,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        layer_types=["linear_attention"] * (num_hidden_layers - 1) + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden_size // 4,
        linear_value_head_dim=hidden_size // 4,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        pad_token_id=TINY_LM_PAD_TOKEN_ID,
        bos_token_id=TINY_LM_BOS_TOKEN_ID,
        eos_token_id=TINY_LM_EOS_TOKEN_ID,
        mtp_num_hidden_layers=1,
    )
    config._attn_implementation = "sdpa"
    return config


def _moe_fields(hidden_size) -> dict:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                shared_expert_intermediate_size=hidden_size // 2)


def tiny_qwen3_next_config(
    *, vocab_size: int = TINY_LM_VOCAB_SIZE, hidden_size: int = 64, num_hidden_layers: int = 2,
    initializer_range: float = 0.2,
) -> Qwen3NextConfig:
    """Qwen3-Next-80B-A3B's real sizes: hidden 2048, 48 layers (full attention every 4th), 512 experts, top-10."""
    return _qwen_hybrid_config(
        Qwen3NextConfig, vocab_size, hidden_size, num_hidden_layers, initializer_range,
        intermediate_size=2 * hidden_size, **_moe_fields(hidden_size),
    )


def tiny_qwen3_5_config(
    *, vocab_size: int = TINY_LM_VOCAB_SIZE, hidden_size: int = 64, num_hidden_layers: int = 2,
    initializer_range: float = 0.2,
) -> Qwen3_5TextConfig:
    """Qwen3.5 (dense) text model; the real 27B: hidden 5120, 64 layers (full attention every 4th)."""
    return _qwen_hybrid_config(
        Qwen3_5TextConfig, vocab_size, hidden_size, num_hidden_layers, initializer_range,
        intermediate_size=2 * hidden_size,
    )


def tiny_qwen3_5_moe_config(
    *, vocab_size: int = TINY_LM_VOCAB_SIZE, hidden_size: int = 64, num_hidden_layers: int = 2,
    initializer_range: float = 0.2,
) -> Qwen3_5MoeTextConfig:
    """Qwen3.5-MoE text model; the real 397B-A17B: hidden 4096, 60 layers, 512 experts, top-10."""
    return _qwen_hybrid_config(
        Qwen3_5MoeTextConfig, vocab_size, hidden_size, num_hidden_layers, initializer_range, **_moe_fields(hidden_size),
    )


_TINY_CONFIGS = {
    "glm4_moe": (tiny_glm4_moe_config, Glm4MoeForCausalLM),
    "deepseek_v3": (tiny_deepseek_v3_config, DeepseekV3ForCausalLM),
    "glm_moe_dsa": (tiny_glm_moe_dsa_config, GlmMoeDsaForCausalLM),
    "qwen3_next": (tiny_qwen3_next_config, Qwen3NextForCausalLM),
    "qwen3_5": (tiny_qwen3_5_config, Qwen3_5ForCausalLM),
    "qwen3_5_moe": (tiny_qwen3_5_moe_config, Qwen3_5MoeForCausalLM),
}


def tiny_lm_config(family: str, **kwargs):
    """The tiny config of `family` (one of `TINY_LM_FAMILIES`)."""
    if family not in _TINY_CONFIGS:
        raise ValueError(f"family must be one of {TINY_LM_FAMILIES}, got {family!r}")
    return _TINY_CONFIGS[family][0](**kwargs)


def tiny_lm(family: str = "glm4_moe", seed: int = 0, **config_kwargs):
    """A seeded tiny causal LM of `family` in eval mode (float32, CPU). Same seed → same weights."""
    config = tiny_lm_config(family, **config_kwargs)
    model_cls = _TINY_CONFIGS[family][1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = TINY_LM_PAD_TOKEN_ID
    model.generation_config.eos_token_id = TINY_LM_EOS_TOKEN_ID
    return model.eval()
