"""Tiny, seeded GLM-4.5 (Glm4Moe) and DeepSeek-V3 causal LMs built from the real transformers classes.

They keep the structure our MTP code depends on — a MoE decoder block (router with group-limited
top-k, shared experts), the first `first_k_dense_replace` layers dense, MLA attention for DeepSeek-V3,
`num_nextn_predict_layers = 1` — and shrink only widths and depths, so a forward takes milliseconds on
CPU. `initializer_range=0.2` keeps both the logits' argmax and the routers' top-k away from near-ties,
so greedy comparisons between differently batched forwards (speculative vs plain) are stable.

Token ids: the vocab has `TINY_LM_VOCAB_SIZE` entries; `TINY_LM_EOS_TOKEN_ID` is EOS and
`TINY_LM_PAD_TOKEN_ID` pads ragged prompts.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

TINY_LM_VOCAB_SIZE = 64
TINY_LM_PAD_TOKEN_ID = 0
TINY_LM_BOS_TOKEN_ID = 1
TINY_LM_EOS_TOKEN_ID = 2
TINY_LM_FAMILIES = ("glm4_moe", "deepseek_v3")


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


def tiny_lm_config(family: str, **kwargs):
    """The tiny config of `family` ("glm4_moe" or "deepseek_v3")."""
    if family == "glm4_moe":
        return tiny_glm4_moe_config(**kwargs)
    if family == "deepseek_v3":
        return tiny_deepseek_v3_config(**kwargs)
    raise ValueError(f"family must be one of {TINY_LM_FAMILIES}, got {family!r}")


def tiny_lm(family: str = "glm4_moe", seed: int = 0, **config_kwargs):
    """A seeded tiny causal LM of `family` in eval mode (float32, CPU). Same seed → same weights."""
    config = tiny_lm_config(family, **config_kwargs)
    model_cls = Glm4MoeForCausalLM if family == "glm4_moe" else DeepseekV3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = TINY_LM_PAD_TOKEN_ID
    model.generation_config.eos_token_id = TINY_LM_EOS_TOKEN_ID
    return model.eval()
