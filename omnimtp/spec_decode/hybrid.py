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

A verify block runs its linear layers on the recurrent rule (`verify_blocks`), the decode step's rule.
transformers' forward takes the chunked rule for every cached forward of more than one token, and its PyTorch
fallback (no flash-linear-attention, as on a CPU) pads each row's block to a 64-token chunk. At Qwen3-Next's
widths (32 value heads of 128 × 128) the rule alone then took 2.3–5.9× as long on a 2–4-token block at 1 and
4 rows; a whole verify of such layers, whose matmuls dominate, 4–22 % longer (`python
benchmarks/hybrid_rollback.py --widths qwen3_next`, a noisy 2-core box); the sampled verifies of the tests'
tiny models 2.5×. The rule goes back to chunks where the states the recurrent rule streams for every token
outgrow the caches: more than RECURRENT_MAX_TOKENS tokens a row, or more than RECURRENT_MAX_STATE_BYTES of
state × tokens (at 16 rows of 3–8 tokens the recurrent rule took 0.4–1.3× as long as the chunked).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

RECURRENT_MAX_TOKENS = 8
RECURRENT_MAX_STATE_BYTES = 64 << 20  # rows × tokens × one row's recurrent state
_verifying = contextvars.ContextVar("omnimtp_hybrid_verifying", default=False)
_install_lock = threading.Lock()


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


def _short_block(query: torch.Tensor, initial_state: torch.Tensor | None) -> bool:
    if not _verifying.get() or initial_state is None:
        return False
    batch_size, num_tokens = query.shape[:2]
    row_bytes = initial_state[0].numel() * initial_state.element_size()
    return num_tokens <= RECURRENT_MAX_TOKENS and batch_size * num_tokens * row_bytes <= RECURRENT_MAX_STATE_BYTES


def _install_recurrent_blocks(module) -> None:
    """Route `module`'s chunked gated delta rule to its recurrent rule for short verify blocks (once)."""
    chunked = module.torch_chunk_gated_delta_rule
    if getattr(chunked, "omnimtp_chunked", None) is not None:
        return

    def gated_delta_rule(query, key, value, *args, **kwargs):  # transformers passes all but q, k, v by name
        if not args and _short_block(query, kwargs.get("initial_state")):
            kwargs.pop("chunk_size", None)
            return module.torch_recurrent_gated_delta_rule(query, key, value, **kwargs)
        return chunked(query, key, value, *args, **kwargs)

    gated_delta_rule.omnimtp_chunked = chunked
    module.torch_chunk_gated_delta_rule = gated_delta_rule


@contextlib.contextmanager
def verify_blocks(target):
    """Within: cached forwards of `target` in this thread run short blocks through its linear layers on the
    recurrent rule (see the module docstring); other forwards, and other threads, keep transformers' choice."""
    layers = target.get_decoder().layers
    modules = {sys.modules[type(layers[i].linear_attn).__module__] for i in linear_layer_indices(target)}
    with _install_lock:
        for module in modules:
            if hasattr(module, "torch_chunk_gated_delta_rule") and hasattr(module, "torch_recurrent_gated_delta_rule"):
                _install_recurrent_blocks(module)
    token = _verifying.set(True)
    try:
        yield
    finally:
        _verifying.reset(token)
