"""Rollback of a hybrid target's recurrent state (Qwen3-Next, Qwen3.5, Qwen3.5-MoE).

Their linear-attention (Gated DeltaNet) layers keep, per row, a conv state (the last K mixer inputs,
[B, conv_dim, K]) and a recurrent state ([B, heads, d_k, d_v]) instead of a KV slot per token, so a verify
block's rejected drafts cannot be cropped away (transformers' `DynamicCache.crop` refuses). A verify step:

    saved = snapshot(cache)                         # clone of every linear layer's two states
    target forward on [x, d1..dk]                   # transformers' forward, layer inputs recorded
    row b keeps n_b tokens:
      n_b = k+1 for every row    → nothing to do (the forward's state is the state after the block)
      else rollback(...)         → restore `saved`, then run only the token mixers of the linear
                                   layers on the recorded inputs of the first max n_b tokens, one token
                                   at a time (transformers' decode step), and give each row its state
                                   after its own n_b tokens (rows with n_b = k+1 keep the forward's state)

Why this one (`python benchmarks/hybrid_rollback.py --family qwen3_next --batch-size B --repeats 60`, tiny
Qwen3-Next, 2 layers, a 4-token block of which 2 are kept, shared 2-core CPU, 1 thread, median ms,
B = 1 / 8): the verify forward alone 3.25 / 4.92; + this rollback 4.95 / 6.94; restoring and re-feeding
the kept prefix through the whole target 6.28 / 10.12; running the linear layers token by token inside
every verify, keeping each token's state, 6.36 / 7.42 (whole layers) or 4.65 / 6.00 (only their token
mixers, with our own copy of the layer loop). This rollback costs nothing when every draft is accepted
and keeps transformers' forward as it is; the per-token mixer loop is ~10% cheaper on a step that rejects
but costs 1.4× on one that accepts all, and needs a copy of each family's layer code. The mixer inputs
are causal, so the recomputed state equals the state after decoding the kept tokens one by one: exact up
to float rounding, which is all `generate` gives.

Full-attention layers keep their KV slots and are cropped like any cache (`crop_attention`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin


def linear_layer_indices(target) -> list[int]:
    """Indices of the decoder layers with a recurrent (linear-attention) state; [] for other models."""
    config = target.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    return [i for i, kind in enumerate(layer_types[: config.num_hidden_layers]) if kind == "linear_attention"]


def _linear_states(cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[layer_idx]
    return layer.conv_states[0], layer.recurrent_states[0]


def snapshot(cache, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the (conv, recurrent) states of `layers`."""
    return {i: tuple(state.clone() for state in _linear_states(cache, i)) for i in layers}


def crop_attention(cache, num_tokens: int) -> None:
    """Drop the last `num_tokens` slots of every attention layer; linear-attention layers have none."""
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.crop(-num_tokens)


def rollback(
    target,
    cache,
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]],
    layer_inputs: tuple[torch.Tensor, ...],
    num_kept: torch.Tensor,
) -> None:
    """Put every linear layer's state at each row's own accepted length.

    saved: `snapshot` taken before the verify forward; layer_inputs: its `hidden_states` (entry i [B, T, H]
    is the input of decoder layer i); num_kept [B] in 1..T: tokens of the block row b keeps."""
    num_tokens = layer_inputs[0].shape[1]
    partial = num_kept < num_tokens  # [B] rows whose state must go back
    if not bool(partial.any()):
        return
    num_steps = int(num_kept[partial].max())
    layers = target.get_decoder().layers
    rows = torch.arange(num_kept.shape[0], device=num_kept.device)
    for i, (saved_conv, saved_recurrent) in saved.items():
        conv, recurrent = _linear_states(cache, i)
        after_block = conv.clone(), recurrent.clone()
        conv.copy_(saved_conv)
        recurrent.copy_(saved_recurrent)
        mixer_input = layers[i].input_layernorm(layer_inputs[i][:, :num_steps])  # [B, n, H]
        conv_steps, recurrent_steps = [], []
        for t in range(num_steps):
            layers[i].linear_attn(hidden_states=mixer_input[:, t : t + 1], cache=cache, attention_mask=None)
            conv_steps.append(conv.clone())
            recurrent_steps.append(recurrent.clone())
        step = (num_kept - 1).clamp(max=num_steps - 1)  # [B]
        kept_conv = torch.stack(conv_steps)[step, rows]  # [B, conv_dim, K]
        kept_recurrent = torch.stack(recurrent_steps)[step, rows]  # [B, heads, d_k, d_v]
        conv.copy_(torch.where(partial[:, None, None], kept_conv, after_block[0]))
        recurrent.copy_(torch.where(partial[:, None, None, None], kept_recurrent, after_block[1]))
