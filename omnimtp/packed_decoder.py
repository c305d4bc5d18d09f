"""Qwen3-Omni's thinker and talker decoders: one forward on packed weights and a slot KV cache.

The weights are a `PackedDecoder` (`omnimtp.runtime.decoder`) and the cache a `KVCache`
(`omnimtp.runtime.kv_cache`) with one slot per sequence: slot s holds its sequence's positions
0..length-1 with no padding, so a sequence never attends to another's keys and its RoPE position is its
cache index plus the slot's offset. For text and audio rows the three M-RoPE axes (temporal, height,
width) carry the same position, so M-RoPE is exactly the 1-D rotary embedding on those positions (`Rope`;
tests check it against the module); a prompt with images or video passes its 3-D positions.

    decoder = PackedDecoder.from_module(model.talker.model)           # weights, shareable
    cache = KVCache(decoder, max_batch_size=4)                        # per run
    out = decoder_forward(decoder, cache, prefill[None], slots=[0])   # [1, L, H] → out.last_hidden [1, H]
    out = decoder_forward(decoder, cache, step_embeds[:, None], slots=[0, 1])   # one position per row
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from omnimtp.runtime.decoder import PackedDecoder, decoder_layers
from omnimtp.runtime.kv_cache import KVCache
from omnimtp.runtime.ops import CAUSAL, rms_norm

__all__ = ["DecoderOutput", "KVCache", "PackedDecoder", "decoder_forward"]


class DecoderOutput(NamedTuple):
    last_hidden: torch.Tensor  # [R, H] after the final norm, at each row's last new position
    captured: torch.Tensor | None  # [R, T, H] hidden state `capture_layer` (transformers' hidden_states index)
    final: torch.Tensor | None = None  # [R, T, H] after the final norm at every new position (`all_final=True`)


def decoder_forward(
    decoder: PackedDecoder,
    cache: KVCache | None,
    embeds: torch.Tensor,
    slots: list[int] | None,
    capture_layer: int | None = None,
    rope_positions: torch.Tensor | None = None,
    layer_adds: tuple[torch.Tensor, ...] = (),
    all_final: bool = False,
    output_index: torch.Tensor | None = None,
) -> DecoderOutput:
    """Append T positions to each of R slots and run the decoder on them.

    embeds [R, T, H]: row r's next T input embeddings, for slot slots[r] (its positions continue at
    that slot's length). capture_layer: also return hidden state k as transformers' `hidden_states[k]`
    numbers them (0 = the input embeddings, k < L = output of layer k-1, L = after the final norm).
    Returns DecoderOutput(last_hidden [R, H] after the final norm at each row's last position,
    captured [R, T, H] or None). Rows at equal lengths need no mask; a batch-1 decode step runs on 1-D
    vectors with its position's RoPE rows cached (`PackedDecoder.step_tables`).

    RoPE positions: each new position's cache index plus its slot's `cache.rope_offsets`, unless
    rope_positions [3, R, T] (M-RoPE ids, as transformers' `get_rope_index` makes them for a multimodal
    prompt) are given; then each slot's offset becomes max + 1 − its new length, so decoding continues
    where transformers' rope_deltas put it. The mask is causal by cache index either way. layer_adds:
    see `decoder_layers` (deepstack features of a prefill). all_final: also return every new position's
    row after the final norm (`final` [R, T, H]: what a speculative verify and an MTP head read).

    output_index [R, K]: only these K new positions of each row are wanted (every position's keys and values are
    still made): the last layer runs its queries, output projection and MLP on them alone, and last_hidden, final
    (and captured at capture_layer L) are theirs: [R, H] at the last of them, [R, K, H].

    cache None (slots None): each row's T positions are a whole sequence at cache indices 0..T-1, attending to
    their own keys and values, none of them kept (one forward with nothing after it: the aligner's)."""
    num_layers = decoder.num_layers
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3 or embeds.shape[2] != decoder.hidden_size:
        raise ValueError(f"embeds must be [R, T, {decoder.hidden_size}], got {getattr(embeds, 'shape', embeds)!r}")
    if embeds.dtype != decoder.dtype or min(embeds.shape[:2]) < 1:
        raise ValueError(
            f"embeds must have dtype {decoder.dtype}, R >= 1 and T >= 1, got {embeds.dtype}, {tuple(embeds.shape)}"
        )
    if cache is None:
        if slots is not None:
            raise ValueError(f"slots must be None without a cache, got {slots!r}")
    elif not isinstance(slots, (list, tuple)) or len(slots) != embeds.shape[0]:
        raise ValueError(f"slots must be a list of {embeds.shape[0]} slot indices (one per row), got {slots!r}")
    else:
        slots = list(slots)
        cache.check_slots(slots)
    if capture_layer is not None and not 0 <= capture_layer <= num_layers:
        raise ValueError(f"capture_layer must be in [0, {num_layers}], got {capture_layer!r}")
    num_rows, num_new, _ = embeds.shape
    if rope_positions is not None and tuple(rope_positions.shape) != (3, num_rows, num_new):
        raise ValueError(f"rope_positions must be [3, {num_rows}, {num_new}], got {tuple(rope_positions.shape)}")
    if output_index is not None and (output_index.dim() != 2 or output_index.shape[0] != num_rows
                                     or output_index.dtype != torch.int64):
        raise ValueError(f"output_index must be int64 [{num_rows}, K], got {output_index.dtype} "
                         f"{list(output_index.shape)}")
    if cache is None:
        return _uncached_forward(decoder, embeds, capture_layer, rope_positions, layer_adds, all_final, output_index)
    offsets = [cache.rope_offsets[slot] for slot in slots]
    where = cache.plan(slots, num_new)
    if (
        num_rows == 1 and num_new == 1 and rope_positions is None and not layer_adds and output_index is None
    ):  # a batch-1 decode step
        rope = decoder.step_tables(where.start + offsets[0])
        x, captured = decoder_layers(
            decoder, embeds.view(-1), rope, cache.layer_views, where, None, capture_layer
        )  # [H]
        cache.commit(slots, num_new)
        last_hidden = rms_norm(x, decoder.final_norm, decoder.eps)
        if capture_layer == num_layers:
            captured = last_hidden
        return DecoderOutput(
            last_hidden.view(1, -1), None if captured is None else captured.view(1, 1, -1),
            last_hidden.view(1, 1, -1) if all_final else None,
        )
    positions = where.positions
    if positions is None:
        positions = where.start + torch.arange(num_new, device=embeds.device).expand(num_rows, -1)  # [R, T]
    if rope_positions is None:
        rope_positions = (
            positions if not any(offsets) else positions + torch.tensor(offsets, device=embeds.device)[:, None]
        )
    else:
        ends = rope_positions.amax(dim=(0, 2)).tolist()  # [R]
        for slot, end in zip(slots, ends, strict=True):
            cache.rope_offsets[slot] = int(end) + 1 - (cache.lengths[slot] + num_new)
    rope = decoder.rope.tables(rope_positions, embeds.dtype)  # [R, T, 1, D]
    mask = None
    if num_new > 1 and where.start == 0 and where.num_columns == num_new and not decoder.fp32_attention:
        # every row's first T positions: SDPA's is_causal, the same values as the bool mask
        mask = CAUSAL
    elif num_new > 1 or where.start is None:  # causal by cache index, and past each row's own length
        columns = torch.arange(where.num_columns, device=embeds.device)
        mask = (columns[None, None] <= positions[:, :, None])[:, None]  # [R, 1, T, S] bool
    x, captured = decoder_layers(
        decoder, embeds, rope, cache.layer_views, where, mask, capture_layer, layer_adds=tuple(layer_adds),
        output_index=output_index,
    )
    cache.commit(slots, num_new)
    return _output(decoder, x, captured, capture_layer, all_final)


def _uncached_forward(
    decoder, embeds, capture_layer, rope_positions, layer_adds, all_final, output_index
) -> DecoderOutput:
    """`decoder_forward` without a cache: positions 0..T-1 of every row, causal, keys and values not kept."""
    num_rows, num_new, _ = embeds.shape
    if rope_positions is None:
        rope_positions = torch.arange(num_new, device=embeds.device).expand(num_rows, -1)  # [R, T]
    rope = decoder.rope.tables(rope_positions, embeds.dtype)  # [R, T, 1, D]
    mask = None if num_new == 1 else CAUSAL
    x, captured = decoder_layers(
        decoder, embeds, rope, None, None, mask, capture_layer, layer_adds=tuple(layer_adds), output_index=output_index
    )
    return _output(decoder, x, captured, capture_layer, all_final)


def _output(decoder, x, captured, capture_layer, all_final) -> DecoderOutput:
    """The forward's `DecoderOutput` from the last layer's output x [R, T, H] (before the final norm)."""
    if capture_layer == decoder.num_layers or all_final:
        final = rms_norm(x, decoder.final_norm, decoder.eps)
        return DecoderOutput(
            final[:, -1], final if capture_layer == decoder.num_layers else captured, final if all_final else None
        )
    return DecoderOutput(rms_norm(x[:, -1], decoder.final_norm, decoder.eps), captured)
