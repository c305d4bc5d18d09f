"""The target causal LM of speculative decoding on packed weights and one static KV buffer.

On a small model transformers' decoder forward is mostly framework time (mask building, cache objects,
output recording, module calls): ~9.6 ms of a 13.6 ms k = 3 verify step on the shipped demo LM. Here a
forward is a short loop of tensor ops over weights packed once (`PackedTarget.from_model`):

- per layer: fused QKV (+ bias), the q/k norm weights stacked per head when the model has them,
  fused gate/up of a dense MLP; RMSNorm in fp32 with the weight applied after casting back;
- RoPE with the module's `inv_freq` and `attention_scaling`, on the first `rotary_dim` channels of
  each head (partial rotary, as transformers' `apply_rotary_pos_emb`);
- glm4_moe's MoE layers as transformers computes them: sigmoid router in fp32 with
  `e_score_correction_bias` for the choice only, group-limited top-k, optional renormalisation,
  `routed_scaling_factor`, each token's weighted expert outputs summed in rank order (the default
  `grouped_mm` experts), plus the shared experts;
- attention through SDPA over a `PackedKVCache`, which keeps the spec loop's cache semantics: ONE
  length for the whole batch, a 2-D `kv_mask [B, length + T]` of valid slots (left padding, rejected
  drafts of ragged rows), `crop`. New tokens attend to valid slots up to their own (causal by slot).

Supported: glm4_moe (dense and MoE layers), llama, qwen2, qwen3 with rope_type "default", SiLU MLPs
and no sliding window. `unsupported_reason(target)` says why another model is not.

    packed = packed_target(target)                     # cached per model; repacked if weights change
    cache = PackedKVCache(packed, batch_size=1)
    hidden = packed_forward(packed, cache, ids, positions, kv_mask)      # [B, T, H], appends T slots
    logits = packed_logits(packed, hidden[:, -1:])                       # [B, 1, V] float32

`omnimtp.spec_decode.generate` runs speculative decoding (`target_backend`) and plain decoding
(`plain_generate`) on it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnimtp.packed_decoder import _cast, _linear, _rms_norm, expert_outputs

SUPPORTED_MODEL_TYPES = ("glm4_moe", "llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class _Router:
    """glm4_moe's `Glm4MoeTopkRouter` (weights as transformers keeps them: fp32)."""

    weight: torch.Tensor  # [E, H] fp32
    correction_bias: torch.Tensor  # [E] fp32
    num_groups: int
    top_k_groups: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Nq + 2 Nkv) * D, H]
    qkv_bias: torch.Tensor | None  # [(Nq + 2 Nkv) * D]
    qk_norm: torch.Tensor | None  # [Nq + Nkv, D]: q_norm for the query heads, k_norm for the key heads
    o: torch.Tensor  # [H, Nq * D]
    o_bias: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H] dense MLP, or the shared experts' [2Is, H] in a MoE layer
    down: torch.Tensor  # [H, I]
    router: _Router | None  # None: dense layer
    expert_gate_up: torch.Tensor | None  # [E, 2 Ie, H] (transformers' own tensor)
    expert_down: torch.Tensor | None  # [E, H, Ie]


@dataclass(frozen=True)
class PackedTarget:
    """The packed weights of a causal LM (see the module docstring). Immutable; `packed_target`
    caches one per model."""

    layers: tuple[_Layer, ...]
    embed: torch.Tensor  # [V, H] (the module's own tensor)
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the module's own tensor)
    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32
    rope_source: torch.Tensor  # [D] channel each channel's rotate_half partner comes from (`_rope`)
    attention_scaling: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # the attention modules' softmax scale (head_dim ** -0.5 in every supported family)
    hidden_size: int
    eps: float
    dtype: torch.dtype
    device: torch.device

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]


    @classmethod
    def from_model(cls, target) -> "PackedTarget":
        """target: a transformers causal LM of a supported family (ValueError naming why not)."""
        reason = unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"target: {reason}")
        decoder = target.get_decoder()
        config = decoder.config
        dtype = decoder.embed_tokens.weight.dtype
        with torch.no_grad():
            layers = tuple(_pack_layer(layer, config, dtype) for layer in decoder.layers[: config.num_hidden_layers])
        rotary = decoder.rotary_emb
        head_dim = decoder.layers[0].self_attn.head_dim
        half = rotary.inv_freq.shape[0]  # the rotary channels' halves swap; pass-through channels stay
        channels = torch.arange(head_dim, device=rotary.inv_freq.device)
        return cls(
            layers=layers,
            embed=decoder.embed_tokens.weight.detach(),
            final_norm=_cast(decoder.norm.weight, dtype),
            lm_head=target.get_output_embeddings().weight.detach(),
            inv_freq=rotary.inv_freq.detach().float().clone(),
            rope_source=torch.where(channels < 2 * half, (channels + half) % (2 * half), channels),
            attention_scaling=float(rotary.attention_scaling),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            scaling=float(decoder.layers[0].self_attn.scaling),
            hidden_size=config.hidden_size,
            eps=config.rms_norm_eps,
            dtype=dtype,
            device=decoder.embed_tokens.weight.device,
        )


def unsupported_reason(target) -> str | None:
    """None if `PackedTarget.from_model(target)` can pack this model, else why not (one sentence)."""
    config = getattr(target, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not supported by the packed target (supported: {SUPPORTED_MODEL_TYPES})"
    decoder = target.get_decoder()
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        return f"rope_type {rope_type!r} is not supported by the packed target (only 'default')"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} is not supported by the packed target (only 'silu')"
    if target.get_output_embeddings() is None:
        return "the model has no output embeddings (lm_head)"
    for index, layer in enumerate(decoder.layers[: config.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "sliding_window", None) is not None:
            return f"layer {index} uses a sliding window, which the packed target does not support"
        if (attn.q_proj.bias is None) != (attn.k_proj.bias is None) or (attn.q_proj.bias is None) != (
            attn.v_proj.bias is None
        ):
            return f"layer {index}: q/k/v projections must all have biases or none"
        if hasattr(mlp, "experts"):
            if model_type != "glm4_moe":
                return f"layer {index}: {model_type} MoE layers are not supported by the packed target"
            experts = mlp.experts
            if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or not getattr(
                experts, "is_concatenated", True
            ):
                return f"layer {index}: only concatenated [gate; up] experts without bias are supported"
            if mlp.gate.num_experts // mlp.gate.num_group < 2:
                return f"layer {index}: group-limited routing needs >= 2 experts per group"
        elif mlp.gate_proj.bias is not None:
            return f"layer {index}: MLP biases are not supported by the packed target"
    return None


def _pack_layer(layer, config, dtype: torch.dtype) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    qk_norm = None
    if getattr(attn, "q_norm", None) is not None:
        qk_norm = _cast(torch.cat([
            attn.q_norm.weight.expand(config.num_attention_heads, attn.head_dim),
            attn.k_norm.weight.expand(config.num_key_value_heads, attn.head_dim),
        ]), dtype)
    qkv_bias = None
    if attn.q_proj.bias is not None:
        qkv_bias = _cast(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]), dtype)
    common = dict(
        input_norm=_cast(layer.input_layernorm.weight, dtype),
        qkv=_cast(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), dtype),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o=_cast(attn.o_proj.weight, dtype),
        o_bias=None if attn.o_proj.bias is None else _cast(attn.o_proj.bias, dtype),
        post_norm=_cast(layer.post_attention_layernorm.weight, dtype),
    )
    if not hasattr(mlp, "experts"):
        return _Layer(
            **common, gate_up=_cast(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), dtype),
            down=_cast(mlp.down_proj.weight, dtype), router=None, expert_gate_up=None, expert_down=None,
        )
    gate, shared = mlp.gate, mlp.shared_experts
    router = _Router(
        weight=gate.weight.detach().float(),
        correction_bias=gate.e_score_correction_bias.detach().float(),
        num_groups=gate.num_group,
        top_k_groups=gate.topk_group,
        top_k=gate.top_k,
        norm_topk_prob=bool(gate.norm_topk_prob),
        routed_scaling_factor=float(gate.routed_scaling_factor),
    )
    return _Layer(
        **common,
        gate_up=_cast(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]), dtype),
        down=_cast(shared.down_proj.weight, dtype),
        router=router,
        expert_gate_up=mlp.experts.gate_up_proj.detach(),
        expert_down=mlp.experts.down_proj.detach(),
    )


_PACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model → (weights fingerprint, PackedTarget)


def _fingerprint(target) -> tuple:
    """Identity and in-place version of every parameter: changes when a weight is replaced or edited."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in target.parameters())


def packed_target(target) -> PackedTarget:
    """`PackedTarget.from_model(target)`, cached per model (repacked when its weights change)."""
    fingerprint = _fingerprint(target)
    entry = _PACKED.get(target)
    if entry is None or entry[0] != fingerprint:
        entry = (fingerprint, PackedTarget.from_model(target))
        _PACKED[target] = entry
    return entry[1]


class PackedKVCache:
    """A static KV buffer [L, 2, B, Nkv, capacity, D] with one length for the whole batch.

    Same semantics as the spec loop's transformers cache: `packed_forward` appends T slots to every
    row, `crop(n)` keeps the first n slots (n < 0: drops the last -n, as `DynamicCache.crop`); which
    slots a row may attend to is the caller's `kv_mask`. The buffer doubles when it fills."""

    def __init__(self, packed: PackedTarget, batch_size: int, capacity: int = 256):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.batch_size = batch_size
        self.length = 0
        self.buffer = torch.zeros(
            len(packed.layers), 2, batch_size, packed.num_kv_heads, capacity, packed.head_dim,
            dtype=packed.dtype, device=packed.device,
        )  # [L, 2, B, Nkv, S_cap, D]

    @property
    def capacity(self) -> int:
        return self.buffer.shape[4]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"n must be an integer, got {n!r}")
        self.length = max(0, self.length + n) if n < 0 else min(n, self.length)

    def reserve(self, length: int) -> None:
        """Make room for `length` slots (the buffer at least doubles)."""
        if length <= self.capacity:
            return
        grown = self.buffer.new_zeros((*self.buffer.shape[:4], max(length, 2 * self.capacity), self.buffer.shape[5]))
        grown[:, :, :, :, : self.length] = self.buffer[:, :, :, :, : self.length]
        self.buffer = grown


def _rope(packed: PackedTarget, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] → cos, signed_sin [B, T, 1, D] as the module computes them (fp32 angles, then cast)
    on the first rotary_dim channels, padded with cos = 1, signed_sin = 0 on the channels RoPE passes
    through (x * 1 + y * 0 == x exactly). signed_sin = [-sin, sin] halves, so on the rotary channels
    rotate_half(x) * sin == x[..., packed.rope_source] * signed_sin."""
    freqs = positions[..., None].float() * packed.inv_freq  # [B, T, rd/2]
    cos = (freqs.cos() * packed.attention_scaling).to(dtype)
    sin = (freqs.sin() * packed.attention_scaling).to(dtype)
    parts_cos, parts_sin = [cos, cos], [-sin, sin]
    num_pass = packed.head_dim - packed.rotary_dim
    if num_pass:
        parts_cos.append(cos.new_ones((*cos.shape[:-1], num_pass)))
        parts_sin.append(sin.new_zeros((*sin.shape[:-1], num_pass)))
    return torch.cat(parts_cos, dim=-1)[:, :, None], torch.cat(parts_sin, dim=-1)[:, :, None]


def _glm4_moe(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    """glm4_moe's MoE block on tokens x [N, H] → [N, H]: routed experts (router exactly as
    `Glm4MoeTopkRouter`, outputs weighted and summed over the top-k in rank order) + shared experts.
    Only the experts some token picked are computed."""
    router = layer.router
    num_tokens, num_experts = x.shape[0], router.weight.shape[0]
    scores = F.linear(x.float(), router.weight).sigmoid()  # [N, E]
    scores_for_choice = scores + router.correction_bias
    group_scores = scores_for_choice.view(-1, router.num_groups, num_experts // router.num_groups).topk(2, dim=-1)[0]
    group_idx = torch.topk(group_scores.sum(dim=-1), k=router.top_k_groups, dim=-1, sorted=False)[1]  # [N, G']
    group_mask = torch.zeros(num_tokens, router.num_groups, device=x.device).scatter_(1, group_idx, 1)
    score_mask = group_mask[:, :, None].expand(-1, -1, num_experts // router.num_groups).reshape(-1, num_experts)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    top_experts = torch.topk(scores_for_choice, k=router.top_k, dim=-1, sorted=False)[1]  # [N, k]
    top_weights = scores.gather(1, top_experts)
    if router.norm_topk_prob:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
    top_weights = top_weights * router.routed_scaling_factor  # [N, k] fp32

    top_k = router.top_k
    outputs = expert_outputs(x, top_experts, layer.expert_gate_up, layer.expert_down)  # [N*k, H]
    routed = (outputs * top_weights.view(-1, 1)).view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
    return routed + _dense_mlp(layer, x)


def _linear_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """nn.Linear: the bias is added inside the matmul as transformers' module does (one rounding in bf16)."""
    return _linear(x, weight) if bias is None else F.linear(x, weight, bias)


def _dense_mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    gate, up = _linear(x, layer.gate_up).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, layer.down)


def _attention_mask(
    kv_mask: torch.Tensor | None, start: int, num_new: int, dtype: torch.dtype, device
) -> torch.Tensor | None:
    """Additive SDPA mask [B, 1, T, start + T] (0 = attend, -inf = not): valid slots up to the query's own
    slot. SDPA turns a boolean mask into exactly this on every call; building it once per forward saves
    that per layer. None when every slot is valid and T == 1. A query always sees its own slot, so rows
    of padding tokens (no valid key at all) stay finite instead of NaN; real tokens never attend to them."""
    num_columns = start + num_new
    if kv_mask is not None and bool(kv_mask.all()):
        kv_mask = None
    if kv_mask is None and num_new == 1:
        return None
    columns = torch.arange(num_columns, device=device)
    slots = start + torch.arange(num_new, device=device)
    mask = columns[None, :] <= slots[:, None]  # [T, S] causal by slot
    if kv_mask is None:
        mask = mask[None]  # [1, T, S] broadcast over rows
    else:
        mask = mask[None] & kv_mask.bool()[:, None, :]  # [B, T, S]
        mask = mask | (columns[None, :] == slots[:, None])[None]
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))[:, None]


def packed_forward(
    packed: PackedTarget,
    cache: PackedKVCache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    kv_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append T slots to every row of `cache` and run the decoder on them.

    input_ids, position_ids [B, T]; kv_mask [B, cache.length + T] (1 = a real slot; None = all real).
    → post-norm hidden states [B, T, H] (what transformers' decoder returns as last_hidden_state)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or min(input_ids.shape) < 1:
        raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got {getattr(input_ids, 'shape', input_ids)!r}")
    batch_size, num_new = input_ids.shape
    if batch_size != cache.batch_size:
        raise ValueError(f"input_ids: batch size {batch_size} does not match the cache's {cache.batch_size}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids must be [B, T] like input_ids {tuple(input_ids.shape)}")
    start = cache.length
    if kv_mask is not None and tuple(kv_mask.shape) != (batch_size, start + num_new):
        raise ValueError(f"kv_mask must be [B, {start + num_new}] (cache length + T), got {tuple(kv_mask.shape)}")
    num_columns = start + num_new
    cache.reserve(num_columns)
    mask = _attention_mask(kv_mask, start, num_new, packed.dtype, input_ids.device)  # [B, 1, T, S] or None
    cos, signed_sin = _rope(packed, position_ids, packed.dtype)  # [B, T, 1, rd]
    num_heads, num_kv_heads, head_dim = packed.num_heads, packed.num_kv_heads, packed.head_dim
    x = F.embedding(input_ids, packed.embed)  # [B, T, H]
    for i, layer in enumerate(packed.layers):
        residual = x
        qkv = _linear_bias(_rms_norm(x, layer.input_norm, packed.eps), layer.qkv, layer.qkv_bias)
        qkv = qkv.view(batch_size, num_new, num_heads + 2 * num_kv_heads, head_dim)  # [B, T, Nq+2Nkv, D]
        qk = qkv[:, :, : num_heads + num_kv_heads]
        if layer.qk_norm is not None:
            qk = _rms_norm(qk, layer.qk_norm, packed.eps)
        qk = qk * cos + qk[..., packed.rope_source] * signed_sin  # RoPE on queries and keys at once
        keys, values = cache.buffer[i, 0], cache.buffer[i, 1]  # [B, Nkv, S_cap, D]
        keys[:, :, start:num_columns] = qk[:, :, num_heads:].transpose(1, 2)
        values[:, :, start:num_columns] = qkv[:, :, num_heads + num_kv_heads :].transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            qk[:, :, :num_heads].transpose(1, 2), keys[:, :, :num_columns], values[:, :, :num_columns],
            attn_mask=mask, scale=packed.scaling, enable_gqa=True,
        )  # [B, Nq, T, D]; query head h reads key head h // (Nq / Nkv), as transformers' sdpa attention
        attn = attn.transpose(1, 2).reshape(batch_size, num_new, num_heads * head_dim)
        x = residual + _linear_bias(attn, layer.o, layer.o_bias)
        residual = x
        normed = _rms_norm(x, layer.post_norm, packed.eps).view(batch_size * num_new, -1)
        mlp = _dense_mlp(layer, normed) if layer.router is None else _glm4_moe(layer, normed)
        x = residual + mlp.view(batch_size, num_new, -1)
    cache.length = num_columns
    return _rms_norm(x, packed.final_norm, packed.eps)


def packed_logits(packed: PackedTarget, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, H] → logits [B, T, V] float32 (the LM head)."""
    return _linear(hidden, packed.lm_head).float()
