"""A dense w4a8 decoder's decode step in one native call.

At one row and one position a decode step of a small decoder is short: Qwen3-TTS's talker reads 8 MB of int4
weights a layer (about 0.2 ms at a core pair's read bandwidth), and the layer's torch ops and kernel calls from
Python (about 65 ops and 5 calls) took as long again. For a decoder quantized to "w4a8" whose layers are all dense
(`PackedDecoder.quantized`), `decoder_layers` hands a decode step (R rows, one new position each, on a `KVCache`'s
layer views) to `small_batch_linear.w4a8_decode_step`, which runs every layer in one call:

    table = step_table(decoder)              # the layers' addresses, made once per decoder (None: not applicable)
    x = run(decoder, table, x, rope, kv_buffer, where, mask)     # what `decoder_layers` returns for that step
    x = run_block(decoder, table, x, rope, kv_buffer, positions) # the code predictor's step: [B, T, H] at [T]

The matmuls are the w4a8 kernel's own (the same bits as `ops.linear` on the same inputs); RMSNorm, RoPE and SiLU
are computed in the kernel in fp32, equal to the torch ops up to rounding (tests/test_w4a8_step.py). Each row is
computed on its own, so a row's values are the same alone and in any batch (a masked key is left out, not
weighted by zero). Prefills, captured hidden states and torch.compile keep the op-by-op path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from omnimtp.runtime import tracing
from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.runtime.kv_cache import KVWrite
from omnimtp.runtime.ops import QuantizedWeight

KV_DTYPES = (torch.float32, torch.bfloat16)  # the caches `run` reads (`PackedDecoder.kv_dtype`)


@dataclass(frozen=True)
class StepTable:
    """A decoder's layers as the native step reads them (the addresses of tensors the decoder holds)."""

    quantized_layers: tuple  # the decoder's, held: the addresses stay valid, and a table is for these layers only
    weights: ctypes.Array  # int64 [L * W4A8_STEP_WEIGHTS]
    shape: tuple[int, int, int, int]  # Nq, Nkv, D, I
    groups: tuple[int, int, int]  # w4a8 group sizes of the matrices with H, Nq * D and I inputs


def step_table(decoder) -> StepTable | None:
    """The native step's table of `decoder` (made on first use, kept in `decoder.native_step`), or None where the
    native step does not apply: a decoder that is not "w4a8" on a CPU in fp32, a MoE layer, partial rotary, or the
    kernel not available. (The numeric variants `fused_norm` and `fp32_attention` are the op-by-op path's: the
    kernel computes its norms and attention in fp32 either way.)"""
    cached = decoder.native_step.get("w4a8")
    if cached is not None and cached[0] is decoder.layers and cached[1] is decoder.quantized_layers:
        return cached[2]
    table = _make_table(decoder)
    decoder.native_step["w4a8"] = (decoder.layers, decoder.quantized_layers, table)
    return table


def _make_table(decoder) -> StepTable | None:
    if (decoder.quantize != "w4a8" or decoder.dtype != torch.float32 or decoder.device.type != "cpu"
            or decoder.quantized_layers is None or decoder.rope.source is not None
            or decoder.head_dim % 2 or decoder.head_dim > small_batch_linear.DECODE_ATTENTION_MAX_HEAD_DIM
            or decoder.num_heads % decoder.num_kv_heads
            or decoder.num_heads // decoder.num_kv_heads > small_batch_linear.DECODE_ATTENTION_MAX_GROUP
            or not small_batch_linear.available()):
        return None
    if any(layer.router is not None for layer in decoder.layers):
        return None
    first = decoder.quantized_layers[0]
    if not all(isinstance(q, QuantizedWeight) and q.int8_activations for q in first):
        return None
    groups = (first[0].group_size, first[1].group_size, first[3].group_size)
    intermediate = first[2].out_features // 2
    addresses = []
    for layer, (qkv, o, gate_up, down) in zip(decoder.layers, decoder.quantized_layers, strict=True):
        if ((qkv.group_size, o.group_size, gate_up.group_size, down.group_size) != (*groups[:2], *groups[::2])
                or (qkv.out_features, o.out_features, gate_up.out_features, down.out_features) != (
                    (decoder.num_heads + 2 * decoder.num_kv_heads) * decoder.head_dim, decoder.hidden_size,
                    2 * intermediate, decoder.hidden_size)
                or not all(isinstance(q, QuantizedWeight) and q.int8_activations and q.packed.is_contiguous()
                           and q.scales.is_contiguous() for q in (qkv, o, gate_up, down))):
            return None
        addresses += [
            _address(layer.input_norm), qkv.packed.data_ptr(), qkv.scales.data_ptr(), _address(layer.qkv_bias),
            _address(layer.qk_norm), o.packed.data_ptr(), o.scales.data_ptr(), _address(layer.o_bias),
            _address(layer.post_norm), gate_up.packed.data_ptr(), gate_up.scales.data_ptr(),
            down.packed.data_ptr(), down.scales.data_ptr(),
        ]
    weights = (ctypes.c_int64 * len(addresses))(*addresses)
    shape = (decoder.num_heads, decoder.num_kv_heads, decoder.head_dim, intermediate)
    return StepTable(decoder.quantized_layers, weights, shape, groups)


def _address(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"a native step's vectors must be contiguous fp32, got {t.dtype}")
    return t.data_ptr()


def applies(x: torch.Tensor, kv_buffer, where, mask) -> bool:
    """Whether `decoder_layers` on these arguments is a decode step the native step runs: x [H] or [R, 1, H] fp32
    without gradients, a `KVWrite` on a `KVCache`'s layer views, mask None, bool (True = attend) or additive (0 =
    attend, -inf = not: `kv_mask_attention_mask`'s) [R or 1, 1, 1, S]."""
    return (
        isinstance(where, KVWrite) and isinstance(kv_buffer, list) and x.dtype == torch.float32
        and (x.dim() == 1 or (x.dim() == 3 and x.shape[1] == 1))
        and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
                              and mask.shape[3] == where.num_columns))
        and not (torch.is_grad_enabled() and x.requires_grad) and not tracing.is_compiling()
    )


def _addresses(values) -> ctypes.Array:
    """Python ints → an int64 array the kernel reads (made each call: nothing holds a cache's old buffer)."""
    values = list(values)
    return (ctypes.c_int64 * len(values))(*values)


def run(decoder, table: StepTable, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_buffer: list,
        where: KVWrite, mask: torch.Tensor | None) -> torch.Tensor:
    """Every layer of `decoder` on a decode step (`applies`): x [H] or [R, 1, H] → the last layer's output in x's
    shape (before the final norm); each row's key and value written at its slot and column of `where`."""
    hidden = decoder.hidden_size
    rows = x.reshape(-1, hidden).clone()  # [R, H], overwritten by the kernel
    num_rows = rows.shape[0]
    head_dim = decoder.head_dim
    cos, signed_sin = (t.reshape(-1, head_dim) for t in rope)
    if cos.shape[0] != num_rows:
        cos, signed_sin = cos.expand(num_rows, -1), signed_sin.expand(num_rows, -1)
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    if where.rows is not None:
        slots = list(range(where.rows.start, where.rows.start + num_rows))
    else:
        slots = where.slot_index.tolist()
    columns = [where.start] * num_rows if where.start is not None else where.positions[:, 0].tolist()
    keys, values = kv_buffer[0]
    if keys.stride() != values.stride() or keys.stride(-1) != 1:
        raise ValueError("kv_buffer: keys and values must share their strides, with contiguous rows")
    if keys.dtype not in KV_DTYPES or values.dtype != keys.dtype:
        raise ValueError(f"kv_buffer: the native step reads a cache in one of {KV_DTYPES}, got {keys.dtype}")
    if mask is not None:
        mask = mask[:, 0, 0].contiguous() if mask.dtype == torch.bool else mask[:, 0, 0] == 0  # [R or 1, S]
    small_batch_linear.w4a8_decode_step(
        rows, table.weights, _addresses(t.data_ptr() for pair in kv_buffer[: decoder.num_layers] for t in pair),
        decoder.num_layers, table.shape, table.groups, decoder.eps, cos, signed_sin, _addresses(slots),
        _addresses(columns), where.num_columns, keys.stride()[:3], mask, decoder.scaling,
        kv_bf16=keys.dtype == torch.bfloat16,
    )
    return rows.view(x.shape)


def run_block(decoder, table: StepTable, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              kv_buffer: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Every layer of `decoder` on x [B, T, H] at cache columns positions [T] (long, increasing) of slots 0..B-1 of
    a fixed buffer kv_buffer [L, 2, B_max, Nkv, S, D] (the code predictor's), causal: position p attends to
    columns 0..p → the last layer's output [B, T, H] (before the final norm). rope: (cos, signed_sin) [T, 1, D]."""
    num_rows, num_new, hidden = x.shape
    rows = x.reshape(-1, hidden).clone()  # [B * T, H], row b * T + t
    head_dim = decoder.head_dim
    cos, signed_sin = (t.reshape(num_new, head_dim).repeat(num_rows, 1) for t in rope)
    columns = positions.tolist() * num_rows
    slots = [b for b in range(num_rows) for _ in range(num_new)]
    base, size = kv_buffer.data_ptr(), kv_buffer.element_size()
    kv = _addresses(base + size * (layer * kv_buffer.stride(0) + half * kv_buffer.stride(1))
                    for layer in range(decoder.num_layers) for half in (0, 1))
    small_batch_linear.w4a8_decode_step(
        rows, table.weights, kv, decoder.num_layers, table.shape, table.groups, decoder.eps, cos, signed_sin,
        _addresses(slots), _addresses(columns), max(columns) + 1, kv_buffer.stride()[2:5], None, decoder.scaling,
        row_keys=_addresses(column + 1 for column in columns),
    )
    return rows.view(num_rows, num_new, hidden)
