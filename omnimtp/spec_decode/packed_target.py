"""The target causal LM of speculative decoding on packed weights and a shared-length KV cache.

On a small model transformers' decoder forward is mostly framework time (mask building, cache objects,
output recording, module calls): ~9.6 ms of a 13.6 ms k = 3 verify step on the shipped demo LM. Here a
forward is `omnimtp.runtime`'s decoder stack (`PackedDecoder.from_causal_lm`): fused QKV (+ bias),
optional qk-norm, partial rotary, dense SiLU MLPs and glm4_moe's MoE layers exactly as transformers
computes them. The cache is a `KVCache` whose slots (one per row) all share one length, as the spec
loop's transformers cache does: `packed_forward` appends T positions to every row, `crop` drops the
speculative tail, and a 2-D `kv_mask [B, length + T]` says which positions are real (left padding,
rejected drafts of ragged rows). New tokens attend to valid positions up to their own (causal by slot).

Supported: glm4_moe (dense and MoE layers), llama, qwen2, qwen3 with rope_type "default", SiLU MLPs
and no sliding window. `unsupported_reason(target)` says why another model is not.

Quantized (CPU): `packed_target(target, quantize)` packs the decoder with every layer's linears quantized
(`PackedDecoder.quantized`: q/k/v, o, gate/up, down; a MoE layer's shared and routed experts) and the LM head in
int8 (`with_quantized_lm_head`), as the omni thinker's; embeddings, norms and routers stay float. Those kernels
compute each row on its own at any row count, so a verify block's rows and a batch's rows get the bits each gets
alone. A target loaded from a quantized checkpoint (`omnimtp quantize`) holds no float weights for its layers:
its packed decoder is the one made from the stored matrices (`stored_packed_target`), whatever quantize asks.

    packed = packed_target(target)                     # cached per model and mode; repacked if weights change
    cache = KVCache(packed, max_batch_size=1)
    hidden = packed_forward(packed, cache, ids, positions, kv_mask)      # [B, T, H], appends T slots
    logits = packed_logits(packed, hidden[:, -1:])                       # [B, 1, V] float32

`omnimtp.spec_decode.generate` runs speculative decoding (`target_backend`) and plain decoding
(`plain_generate`) on it.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from omnimtp.runtime.decoder import (
    ROW_KERNEL,
    ROW_KERNEL_MAX_ROWS,
    PackedDecoder,
    shared_length_forward,
    unsupported_layer_reason,
    weights_fingerprint,
)
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.runtime.ops import check_quantize, linear, rms_norm

SUPPORTED_MODEL_TYPES = ("glm4_moe", "llama", "qwen2", "qwen3")


def unsupported_reason(target) -> str | None:
    """None if `PackedDecoder.from_causal_lm(target)` can pack this model, else why not (one sentence)."""
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
        if hasattr(layer.mlp, "experts") and model_type != "glm4_moe":
            return f"layer {index}: {model_type} MoE layers are not supported by the packed target"
        reason = unsupported_layer_reason(layer)
        if reason is not None:
            return f"layer {index}: {reason} by the packed target"
    return None


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {quantize: (fingerprint, PackedDecoder)}
_STORED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its quantized checkpoint's PackedDecoder


def packed_target(target, quantize: str | None = None) -> PackedDecoder:
    """`PackedDecoder.from_causal_lm(target).with_row_kernel()` (ValueError naming why a model is not
    supported), cached per model and mode (repacked when its weights change): a verify of k + 1 rows and a plain
    step run the same row kernel where it builds, so they cost about the same and agree bit for bit.

    quantize: None (float), or a mode of `ops.QUANTIZE_MODES`: the layers quantized as they are packed and the LM
    head in int8 (module docstring); ValueError naming `quantize` for an unknown mode or a target off the CPU. A
    target with a stored quantized decoder (`stored_packed_target`) returns it for None or its own mode, and
    refuses another."""
    stored = _STORED.get(target)
    if stored is not None:
        if quantize is not None and quantize != stored.quantize:
            raise ValueError(f"quantize={quantize!r}: the target was loaded from a quantized checkpoint of "
                             f"{stored.quantize!r} weights (quantize the float checkpoint again for another mode)")
        check_quantize(stored.quantize, target.get_output_embeddings().weight.device)  # (moved off the CPU)
        return stored
    if quantize is not None:
        check_quantize(quantize, target.get_output_embeddings().weight.device)
    fingerprint = weights_fingerprint(target)
    entries = _PACKED.setdefault(target, {})
    entry = entries.get(quantize)
    if entry is None or entry[0] != fingerprint:
        reason = unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"quantize={quantize!r}: {reason}" if quantize is not None else f"target: {reason}")
        packed = PackedDecoder.from_causal_lm(target, quantize=quantize)  # each layer quantized as it is packed
        if quantize is not None:
            packed = packed.with_quantized_lm_head(packed.lm_head)
        entry = (fingerprint, packed.with_row_kernel())  # (a quantized decoder is left as it is)
        entries[quantize] = entry
    return entry[1]


def stored_packed_target(target, quantize: str, stored: list[dict]) -> PackedDecoder:
    """The packed decoder of a target loaded from a quantized checkpoint (`omnimtp.quantized_checkpoint`): its
    layers from the stored `quantized_matrices` (the target's own weights for them are placeholders), its LM head
    in int8 as `packed_target(target, quantize)` makes it; what `packed_target` returns for this target from now
    on."""
    reason = unsupported_reason(target)
    if reason is not None:
        raise ValueError(f"quantize={quantize!r}: {reason}")
    packed = PackedDecoder.from_causal_lm(target, quantize=quantize, stored=stored)
    _STORED[target] = packed.with_quantized_lm_head(packed.lm_head)
    return _STORED[target]


def stored_mode(target) -> str | None:
    """The mode of a target loaded from a quantized checkpoint (`stored_packed_target`), which runs only quantized;
    None for any other target."""
    stored = _STORED.get(target)
    return None if stored is None else stored.quantize


def packed_forward(
    packed: PackedDecoder,
    cache: KVCache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    kv_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append T slots to every row of `cache` and run the decoder on them.

    input_ids, position_ids [B, T]; kv_mask [B, cache.length + T] (1 = a real slot; None = all real).
    → post-norm hidden states [B, T, H] (what transformers' decoder returns as last_hidden_state)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or min(input_ids.shape) < 1:
        raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got {getattr(input_ids, 'shape', input_ids)!r}")
    batch_size = input_ids.shape[0]
    if batch_size != cache.max_batch_size:
        raise ValueError(f"input_ids: batch size {batch_size} does not match the cache's {cache.max_batch_size}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids must be [B, T] like input_ids {tuple(input_ids.shape)}")
    x = shared_length_forward(packed, cache, F.embedding(input_ids, packed.embed), position_ids, kv_mask)
    return rms_norm(x, packed.final_norm, packed.eps)


def packed_logits(packed: PackedDecoder, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, H] → logits [B, T, V] float32 (the LM head: int8 in a quantized target, else on the row kernel
    for up to 16 rows)."""
    if packed.quantized_lm_head is not None:
        return linear(hidden, None, packed=packed.quantized_lm_head).float()
    if packed.row_kernel_lm_head is not None and hidden.shape[:-1].numel() <= ROW_KERNEL_MAX_ROWS:
        return linear(hidden, packed.lm_head, packed=packed.row_kernel_lm_head, gemm=ROW_KERNEL).float()
    return linear(hidden, packed.lm_head).float()
