"""Qwen3-Omni's thinker and talker decoders on packed weights and a slot KV buffer.

transformers' forward spends a large share of a small-batch decode step in framework code (mask
building, cache objects, output recording, module calls). Here one forward is a short loop of tensor
ops over weights packed once:

- per layer: fused QKV; the q/k norm weights stacked per head (one RMSNorm for queries and keys);
  one small "MLP input" matrix per layer = [router rows; shared-expert gate row] (the talker's MoE),
  [router rows] (the thinker's MoE) or the dense MLP's gate/up rows; the routed experts and the
  shared expert's projections are used as transformers stores them (no copy: at batch 1 the shared
  expert is most of the talker's bytes, and fusing its gate/up would only duplicate them);
- RMSNorm statistics in fp32 and the weight applied after casting back, as transformers does;
- routing as transformers' `TopKRouter` (softmax in fp32, top-k, optional renormalisation) and the
  experts as its default `grouped_mm` path (weighted outputs summed over the top-k in rank order);
  only the experts some row selected are computed;
- the KV cache is a static buffer [L, 2, B_max, Nkv, S_cap, D] with one slot per sequence, written by
  index. Slot s holds its sequence's positions 0..length-1 with no padding, so a sequence never
  attends to another's keys and its RoPE position is its cache index. The buffer grows (doubling)
  when a sequence outgrows it;
- RoPE: for text and audio rows the three MRoPE axes (temporal, height, width) carry the same
  position, so the interleaved sections select equal angles and MRoPE is exactly the plain 1-D
  rotary embedding with the module's `inv_freq` (tests check this against the module).

    decoder = PackedDecoder.from_module(model.talker.model)         # weights, shareable
    cache = SlotKVCache(decoder, max_batch_size=4)                    # per run
    out = decoder_forward(decoder, cache, prefill[None], slots=[0])   # [1, L, H] → out.last_hidden [1, H]
    out = decoder_forward(decoder, cache, step_embeds[:, None], slots=[0, 1])   # one position per row
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Nq + 2 Nkv) * D, H]; matrices are nn.Linear-shaped [out, in]
    qk_norm: torch.Tensor  # [Nq + Nkv, D]: q_norm for the query heads, k_norm for the key heads
    o: torch.Tensor  # [H, Nq * D]
    post_norm: torch.Tensor  # [H]
    mlp_in: torch.Tensor  # [E + 1, H] router + shared-expert gate rows, [E, H] router rows, or dense [2I, H]
    shared_gate_proj: torch.Tensor | None  # [Is, H] (transformers' own tensor)
    shared_up_proj: torch.Tensor | None  # [Is, H]
    mlp_down: torch.Tensor | None  # [H, I] of the dense MLP or the shared expert; None for experts only
    expert_gate_up: torch.Tensor | None  # [E, 2 Ie, H] (transformers' own tensor)
    expert_down: torch.Tensor | None  # [E, H, Ie]
    num_experts: int  # 0: dense MLP
    top_k: int
    norm_topk_prob: bool
    has_shared_expert: bool
    # per-expert views of expert_gate_up / expert_down (no copy), so a decode step indexes a tuple
    expert_gate_up_views: tuple[torch.Tensor, ...] = ()
    expert_down_views: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class PackedDecoder:
    """The packed weights of one decoder stack (see the module docstring). Immutable; share it
    between runs. Later changes to the module's weights are not seen (except the experts, which are
    the module's own tensors)."""

    layers: tuple[_Layer, ...]
    final_norm: torch.Tensor  # [H]
    inv_freq: torch.Tensor  # [D/2] fp32
    attention_scaling: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    eps: float
    dtype: torch.dtype
    device: torch.device
    # position → (cos, signed_sin) [1, 1, 1, D] of a one-row, one-position step, filled as positions
    # are first used (the same `_rope` call on [[position]], so the same values)
    step_rope: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_module(cls, model, dtype: torch.dtype | None = None) -> "PackedDecoder":
        """model: transformers' `Qwen3OmniMoeThinkerTextModel` (thinker.model.language_model) or
        `Qwen3OmniMoeTalkerModel` (talker.model). dtype: default the module's own."""
        if not hasattr(model, "layers") or not hasattr(model, "rotary_emb") or not hasattr(model, "norm"):
            raise ValueError(f"model must be a Qwen3-Omni thinker text model or talker model, got {type(model).__name__}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
        config = model.config
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"model: rope_type {rope_type!r} is not supported (only 'default')")
        dtype = dtype or next(model.parameters()).dtype
        with torch.no_grad():
            layers = tuple(_pack_layer(layer, config, dtype) for layer in model.layers)
        attn = model.layers[0].self_attn
        rotary = model.rotary_emb
        return cls(
            layers=layers,
            final_norm=_cast(model.norm.weight, dtype),
            inv_freq=rotary.inv_freq.detach().float().clone(),
            attention_scaling=float(rotary.attention_scaling),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=attn.head_dim,
            hidden_size=config.hidden_size,
            eps=config.rms_norm_eps,
            dtype=dtype,
            device=rotary.inv_freq.device,
        )


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype).contiguous()


def _pack_layer(layer, config, dtype: torch.dtype) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_proj.bias is not None or attn.sliding_window is not None:
        raise ValueError("model: attention biases and sliding windows are not supported by PackedDecoder")
    if config.hidden_act != "silu":
        raise ValueError(f"model: hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    qk_norm = torch.cat([
        attn.q_norm.weight.expand(config.num_attention_heads, attn.head_dim),
        attn.k_norm.weight.expand(config.num_key_value_heads, attn.head_dim),
    ])
    common = dict(
        input_norm=_cast(layer.input_layernorm.weight, dtype),
        qkv=_cast(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), dtype),
        qk_norm=_cast(qk_norm, dtype),
        o=_cast(attn.o_proj.weight, dtype),
        post_norm=_cast(layer.post_attention_layernorm.weight, dtype),
    )
    if not hasattr(mlp, "experts"):  # dense MLP
        return _Layer(
            **common, mlp_in=_cast(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), dtype),
            mlp_down=_cast(mlp.down_proj.weight, dtype), shared_gate_proj=None, shared_up_proj=None,
            expert_gate_up=None, expert_down=None,
            num_experts=0, top_k=0, norm_topk_prob=False, has_shared_expert=False,
        )
    experts = mlp.experts
    if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or not getattr(
        experts, "is_concatenated", True
    ):
        raise ValueError("model: only concatenated [gate; up] experts without bias are supported")
    rows = [mlp.gate.weight]
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        rows.append(mlp.shared_expert_gate.weight)
    expert_gate_up, expert_down = _cast(experts.gate_up_proj, dtype), _cast(experts.down_proj, dtype)
    return _Layer(
        **common,
        mlp_in=_cast(torch.cat(rows), dtype),
        shared_gate_proj=None if shared is None else _cast(shared.gate_proj.weight, dtype),
        shared_up_proj=None if shared is None else _cast(shared.up_proj.weight, dtype),
        mlp_down=None if shared is None else _cast(shared.down_proj.weight, dtype),
        expert_gate_up=expert_gate_up,
        expert_down=expert_down,
        expert_gate_up_views=tuple(expert_gate_up.unbind(0)),
        expert_down_views=tuple(expert_down.unbind(0)),
        num_experts=mlp.gate.num_experts,
        top_k=mlp.gate.top_k,
        norm_topk_prob=bool(mlp.gate.norm_topk_prob),
        has_shared_expert=shared is not None,
    )


class SlotKVCache:
    """The KV buffer [L, 2, B_max, Nkv, S_cap, D] of a `PackedDecoder` and each slot's length.

    `decoder_forward` appends to slots; `keep` compacts (slot i takes the old slot keep[i]); `reset`
    empties a slot for a new sequence. Columns at or past a slot's length are never attended to."""

    def __init__(self, decoder: PackedDecoder, max_batch_size: int, capacity: int = 256):
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.max_batch_size = max_batch_size
        self.lengths = [0] * max_batch_size
        self.buffer = torch.zeros(
            len(decoder.layers), 2, max_batch_size, decoder.num_kv_heads, capacity, decoder.head_dim,
            dtype=decoder.dtype, device=decoder.device,
        )  # [L, 2, B_max, Nkv, S_cap, D]
        self.layer_views = _layer_views(self.buffer)

    @property
    def capacity(self) -> int:
        return self.buffer.shape[4]

    def reset(self, slot: int) -> None:
        self._check_slots([slot])
        self.lengths[slot] = 0

    def keep(self, slots: list[int]) -> None:
        """Compact: slot i becomes the old slot slots[i] for i < len(slots); the rest are emptied."""
        self._check_slots(slots)
        if slots != list(range(len(slots))):
            index = torch.tensor(slots, device=self.buffer.device)
            self.buffer[:, :, : len(slots)] = self.buffer.index_select(2, index)
        self.lengths = [self.lengths[s] for s in slots] + [0] * (self.max_batch_size - len(slots))

    def reserve(self, length: int) -> None:
        """Make room for `length` positions per slot (the buffer doubles at least)."""
        if length <= self.capacity:
            return
        grown = self.buffer.new_zeros((*self.buffer.shape[:4], max(length, 2 * self.capacity), self.buffer.shape[5]))
        grown[:, :, :, :, : self.capacity] = self.buffer
        self.buffer = grown
        self.layer_views = _layer_views(grown)

    def _check_slots(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots) or any(
            isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.max_batch_size for s in slots
        ):
            raise ValueError(f"slots must be distinct integers in [0, {self.max_batch_size}), got {slots!r}")


def _layer_views(buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) views [B_max, Nkv, S_cap, D] of the buffer, made once per buffer."""
    return [(layer[0], layer[1]) for layer in buffer.unbind(0)]


class DecoderOutput(NamedTuple):
    last_hidden: torch.Tensor  # [R, H] after the final norm, at each row's last new position
    captured: torch.Tensor | None  # [R, T, H] hidden state `capture_layer` (transformers' hidden_states index)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm: x * rsqrt(mean(x²) + eps) in fp32, weight applied after casting
    back (F.rms_norm without a weight is that formula in one op). In fp32 there is no cast, and
    F.rms_norm with the weight computes the same products (x * rsqrt(...)) * weight in one call."""
    if x.dtype == torch.float32 and weight.dim() == 1 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T; one row goes through matrix-vector kernels (bandwidth-bound)."""
    if x.shape[:-1].numel() == 1:
        return torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def _rope(decoder: PackedDecoder, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [R, T] → cos, signed_sin [R, T, 1, D] as the module computes them (fp32 angles, then
    cast); signed_sin = [-sin, sin] halves, so rotate_half(x) * sin == x.roll(D/2) * signed_sin."""
    freqs = positions[..., None].float() * decoder.inv_freq  # [R, T, D/2]
    cos = (freqs.cos() * decoder.attention_scaling).to(dtype)
    sin = (freqs.sin() * decoder.attention_scaling).to(dtype)
    return torch.cat([cos, cos], dim=-1)[:, :, None], torch.cat([-sin, sin], dim=-1)[:, :, None]


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention through SDPA, as transformers' default "sdpa" attention runs it.
    query [R, T, Nq, D]; keys, values [R, Nkv, S, D]; mask [R, 1, T, S] bool (True = attend) or None
    (every column visible) → [R, T, Nq * D]. Query head h uses key head h // (Nq / Nkv)."""
    num_rows, num_new, num_heads, head_dim = query.shape
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(num_rows, num_new, num_heads * head_dim)


def _experts(layer: _Layer, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """Routed experts over tokens x [N, H] → [N, H], as transformers' router + `grouped_mm` experts:
    softmax in fp32, top-k, optional renormalisation, weights cast back; each token's k weighted
    expert outputs summed in rank order. Only the experts some token picked are computed."""
    num_tokens, top_k = x.shape[0], layer.top_k
    probs = router_logits.softmax(dim=-1, dtype=torch.float)  # [N, E]
    top_weights, top_experts = torch.topk(probs, top_k, dim=-1)  # [N, k]
    if layer.norm_topk_prob:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    top_weights = top_weights.to(router_logits.dtype)
    if num_tokens == 1:  # a decode step: the same kernels as below with a fraction of the ops
        row = x[0]  # [H]
        outputs = []
        for expert in top_experts[0].tolist():
            gate, up = torch.mv(layer.expert_gate_up_views[expert], row).chunk(2)
            outputs.append(torch.mv(layer.expert_down_views[expert], F.silu(gate) * up))
        weighted = torch.stack(outputs) * top_weights.view(-1, 1)  # [k, H]
        return weighted.view(1, top_k, -1).sum(dim=1)
    outputs = expert_outputs(x, top_experts, layer.expert_gate_up, layer.expert_down)  # [N*k, H]
    weighted = outputs * top_weights.view(-1, 1)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1)


def expert_outputs(
    x: torch.Tensor, top_experts: torch.Tensor, expert_gate_up: torch.Tensor, expert_down: torch.Tensor
) -> torch.Tensor:
    """Each token's picked SiLU-gated experts, unweighted: x [N, H], top_experts [N, k] →
    [N*k, H] with row token * k + rank. expert_gate_up [E, 2I, H], expert_down [E, H, I] (transformers'
    fused expert tensors). Only the experts some token picked are computed, each once over its tokens."""
    top_k = top_experts.shape[1]
    selections: dict[int, list[int]] = {}  # expert → flat (token * k + rank) indices
    for flat, expert in enumerate(top_experts.view(-1).tolist()):
        selections.setdefault(expert, []).append(flat)
    outputs = x.new_empty((x.shape[0] * top_k, x.shape[1]))  # [N*k, H]
    for expert, flat in selections.items():
        if len(flat) == 1:
            rows = x[flat[0] // top_k][None]  # [1, H]
            index = slice(flat[0], flat[0] + 1)
        else:
            index = torch.tensor(flat, device=x.device)
            rows = x.index_select(0, index // top_k)  # [n, H]
        gate, up = _linear(rows, expert_gate_up[expert]).chunk(2, dim=-1)
        outputs[index] = _linear(F.silu(gate) * up, expert_down[expert])
    return outputs


def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's MLP on tokens x [N, H] → [N, H]."""
    projected = _linear(x, layer.mlp_in)  # [N, E + 1], [N, E] or [N, 2I]
    if layer.num_experts == 0:
        gate, up = projected.chunk(2, dim=-1)
        return _linear(F.silu(gate) * up, layer.mlp_down)
    num_experts = layer.num_experts
    out = _experts(layer, x, projected[:, :num_experts])
    if layer.has_shared_expert:
        gate, up = _linear(x, layer.shared_gate_proj), _linear(x, layer.shared_up_proj)
        shared = _linear(F.silu(gate) * up, layer.mlp_down)
        out = out + torch.sigmoid(projected[:, num_experts:]) * shared
    return out


def decoder_forward(
    decoder: PackedDecoder,
    cache: SlotKVCache,
    embeds: torch.Tensor,
    slots: list[int],
    capture_layer: int | None = None,
) -> DecoderOutput:
    """Append T positions to each of R slots and run the decoder on them.

    embeds [R, T, H]: row r's next T input embeddings, for slot slots[r] (its positions continue at
    that slot's length). capture_layer: also return hidden state k as transformers' `hidden_states[k]`
    numbers them (0 = the input embeddings, k < L = output of layer k-1, L = after the final norm).
    Returns DecoderOutput(last_hidden [R, H] after the final norm at each row's last position,
    captured [R, T, H] or None)."""
    num_layers = len(decoder.layers)
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.shape[2] != decoder.hidden_size:
        raise ValueError(f"embeds must be [R, T, {decoder.hidden_size}], got {getattr(embeds, 'shape', embeds)!r}")
    if embeds.dtype != decoder.dtype or min(embeds.shape[:2]) < 1:
        raise ValueError(f"embeds must have dtype {decoder.dtype}, R >= 1 and T >= 1, got {embeds.dtype}, {tuple(embeds.shape)}")
    if not isinstance(slots, (list, tuple)) or len(slots) != embeds.shape[0]:
        raise ValueError(f"slots must be a list of {embeds.shape[0]} slot indices (one per row), got {slots!r}")
    slots = list(slots)
    cache._check_slots(slots)
    if capture_layer is not None and not 0 <= capture_layer <= num_layers:
        raise ValueError(f"capture_layer must be in [0, {num_layers}], got {capture_layer!r}")
    if embeds.shape[:2] == (1, 1):  # a batch-1 decode step
        cache.reserve(cache.lengths[slots[0]] + 1)
        last_hidden, captured = _one_row_step(decoder, cache, embeds.view(-1), slots[0], capture_layer)
        cache.lengths[slots[0]] += 1
        return DecoderOutput(last_hidden.view(1, -1), None if captured is None else captured.view(1, 1, -1))
    return _rows_forward(decoder, cache, embeds, slots, capture_layer)


def _rows_forward(
    decoder: PackedDecoder, cache: SlotKVCache, embeds: torch.Tensor, slots: list[int], capture_layer: int | None
) -> DecoderOutput:
    """`decoder_forward` on checked arguments, any R and T."""
    num_layers = len(decoder.layers)
    num_rows, num_new, _ = embeds.shape
    starts = [cache.lengths[s] for s in slots]
    num_columns = max(starts) + num_new  # columns any row attends to
    cache.reserve(num_columns)
    device = embeds.device
    is_uniform = min(starts) == max(starts)  # every row writes the same columns
    # Consecutive slots are a view of the buffer (no gather); with equal starts the write is a slice too.
    rows = slice(slots[0], slots[0] + num_rows) if slots == list(range(slots[0], slots[0] + num_rows)) else None
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(num_new, device=device)  # [R, T]
    cos, signed_sin = _rope(decoder, positions, embeds.dtype)  # [R, T, 1, D]
    slot_index = torch.tensor(slots, device=device)
    mask = None
    if num_new > 1 or not is_uniform:
        columns = torch.arange(num_columns, device=device)
        mask = (columns[None, None] <= positions[:, :, None])[:, None]  # [R, 1, T, S]
    num_heads, num_kv_heads, head_dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
    half = head_dim // 2
    x = embeds
    captured = x if capture_layer == 0 else None
    for i, layer in enumerate(decoder.layers):
        residual = x
        qkv = _linear(_rms_norm(x, layer.input_norm, decoder.eps), layer.qkv)
        qkv = qkv.view(num_rows, num_new, num_heads + 2 * num_kv_heads, head_dim)  # [R, T, Nq+2Nkv, D]
        qk = _rms_norm(qkv[:, :, : num_heads + num_kv_heads], layer.qk_norm, decoder.eps)
        qk = qk * cos + qk.roll(half, dims=-1) * signed_sin  # RoPE on queries and keys at once
        keys, values = cache.layer_views[i]  # [B_max, Nkv, S_cap, D]
        new_keys, new_values = qk[:, :, num_heads:], qkv[:, :, num_heads + num_kv_heads :]  # [R, T, Nkv, D]
        if rows is not None and is_uniform:
            keys[rows, :, starts[0] : num_columns] = new_keys.transpose(1, 2)
            values[rows, :, starts[0] : num_columns] = new_values.transpose(1, 2)
        else:
            keys[slot_index[:, None], :, positions] = new_keys
            values[slot_index[:, None], :, positions] = new_values
        if rows is not None:
            keys, values = keys[rows, :, :num_columns], values[rows, :, :num_columns]
        else:
            keys = keys.index_select(0, slot_index)[:, :, :num_columns]
            values = values.index_select(0, slot_index)[:, :, :num_columns]
        attn = _attend(qk[:, :, :num_heads], keys, values, mask)  # [R, T, Nq*D]
        x = residual + _linear(attn, layer.o)
        residual = x
        normed = _rms_norm(x, layer.post_norm, decoder.eps).view(num_rows * num_new, -1)
        x = residual + _mlp(layer, normed).view(num_rows, num_new, -1)
        if capture_layer == i + 1 and capture_layer < num_layers:
            captured = x
    for r, slot in enumerate(slots):
        cache.lengths[slot] = starts[r] + num_new
    if capture_layer == num_layers:
        captured = _rms_norm(x, decoder.final_norm, decoder.eps)
        return DecoderOutput(captured[:, -1], captured)
    return DecoderOutput(_rms_norm(x[:, -1], decoder.final_norm, decoder.eps), captured)


def _one_row_step(
    decoder: PackedDecoder, cache: SlotKVCache, x: torch.Tensor, slot: int, capture_layer: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`decoder_forward` for one row and one position (a batch-1 decode step) on 1-D vectors: the
    same kernels on the same values as the general path (tests check it bit for bit), without its
    [R, T] reshapes and index bookkeeping. x [H] → (last_hidden [H], captured [H] or None)."""
    start = cache.lengths[slot]
    if start not in decoder.step_rope:  # this position's RoPE rows, as the general path computes them
        cos, signed_sin = _rope(decoder, torch.tensor([[start]], device=x.device), x.dtype)
        decoder.step_rope[start] = (cos.view(-1), signed_sin.view(-1))
    cos, signed_sin = decoder.step_rope[start]  # [D]
    num_heads, num_kv_heads, head_dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
    num_qk = num_heads + num_kv_heads
    captured = x if capture_layer == 0 else None
    for i, layer in enumerate(decoder.layers):
        residual = x
        qkv = torch.mv(layer.qkv, _rms_norm(x, layer.input_norm, decoder.eps)).view(num_qk + num_kv_heads, head_dim)
        qk = _rms_norm(qkv[:num_qk], layer.qk_norm, decoder.eps)  # [Nq + Nkv, D]
        qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * signed_sin  # RoPE on queries and keys at once
        keys, values = cache.layer_views[i]  # [B_max, Nkv, S_cap, D]
        keys[slot, :, start] = qk[num_heads:]
        values[slot, :, start] = qkv[num_qk:]
        query = qk[:num_heads].view(1, num_heads, 1, head_dim)
        keys, values = keys[slot : slot + 1, :, : start + 1], values[slot : slot + 1, :, : start + 1]
        attn = F.scaled_dot_product_attention(query, keys, values, enable_gqa=True).view(-1)  # [Nq * D]
        x = residual + torch.mv(layer.o, attn)
        residual = x
        x = residual + _one_row_mlp(layer, _rms_norm(x, layer.post_norm, decoder.eps))
        if capture_layer == i + 1 and capture_layer < len(decoder.layers):
            captured = x
    last_hidden = _rms_norm(x, decoder.final_norm, decoder.eps)
    if capture_layer == len(decoder.layers):
        captured = last_hidden
    return last_hidden, captured


def _one_row_mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    """`_mlp` of one token x [H] → [H] (as `_experts`' one-token path for the routed experts)."""
    projected = torch.mv(layer.mlp_in, x)  # [E + 1], [E] or [2I]
    if layer.num_experts == 0:
        gate, up = projected.chunk(2)
        return torch.mv(layer.mlp_down, F.silu(gate) * up)
    num_experts, top_k = layer.num_experts, layer.top_k
    probs = projected[:num_experts].softmax(dim=-1, dtype=torch.float)  # [E]
    top_weights, top_experts = torch.topk(probs, top_k)  # [k]
    if layer.norm_topk_prob:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    top_weights = top_weights.to(projected.dtype)
    outputs = []
    for expert in top_experts.tolist():
        gate, up = torch.mv(layer.expert_gate_up_views[expert], x).chunk(2)
        outputs.append(torch.mv(layer.expert_down_views[expert], F.silu(gate) * up))
    out = (torch.stack(outputs) * top_weights.view(-1, 1)).view(1, top_k, -1).sum(dim=1).view(-1)  # [H]
    if layer.has_shared_expert:
        gate, up = torch.mv(layer.shared_gate_proj, x), torch.mv(layer.shared_up_proj, x)
        shared = torch.mv(layer.mlp_down, F.silu(gate) * up)
        out = out + torch.sigmoid(projected[num_experts:]) * shared
    return out
