"""Attention of many query positions a row (a prompt's forward) with bf16 products and fp32 sums, on a CPU with
AVX512_BF16: a FlashAttention-style tiling in C (`bf16_attention.c`, next to this file; how it works and why there),
built and loaded as `small_batch_linear`'s kernel is.

    out = bf16_attention(query, keys, values, key_counts, scale)   # [R, T, Nq, D] fp32 → [R, T, Nq * D]

Each query sees keys 0..n-1, n its entry of key_counts (a causal mask: `causal_key_counts`; a mask of that
form: `prefix_key_counts`). Queries, keys, values and probabilities are rounded to bf16, every sum in fp32:
fp32 SDPA's values within bf16 rounding, and each query's output the same bits alone as among any other
positions and rows.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnimtp.runtime import tracing
from omnimtp.runtime.kernels import small_batch_linear

_SOURCE = Path(__file__).with_name("bf16_attention.c")
MAX_HEAD_DIM = 256
MAX_GROUP = 32  # query heads a key head


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.omnimtp_bf16_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 15 + [ctypes.c_float, ctypes.c_int]


_KERNEL = small_batch_linear.Companion(
    _SOURCE, "omnimtp_bf16_attention_supported", "needs AVX512_BF16 (this CPU lacks it)", _declare
)
_library = _KERNEL.library
available = _KERNEL.available
unavailable_reason = _KERNEL.unavailable_reason


def applies(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `bf16_attention` takes these tensors (shapes as it documents them): fp32 CPU tensors whose last
    dimension is contiguous, query heads D apart, D a multiple of 16 up to MAX_HEAD_DIM, Nq / Nkv up to
    MAX_GROUP, no gradient, not under torch.compile, on a CPU that runs the kernel."""
    num_heads, head_dim = query.shape[2], query.shape[3]
    num_kv_heads = keys.shape[1]
    return (
        query.dtype == keys.dtype == values.dtype == torch.float32 and query.device.type == "cpu"
        and query.stride(3) == 1 and query.stride(2) == head_dim and keys.stride(3) == 1 and values.stride(3) == 1
        and keys.shape == values.shape and keys.shape[0] == query.shape[0] and keys.shape[3] == head_dim
        and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
        and not (torch.is_grad_enabled() and (query.requires_grad or keys.requires_grad or values.requires_grad))
        and not tracing.is_compiling() and available()
    )


def causal_key_counts(num_new: int, num_keys: int) -> torch.Tensor:
    """key_counts [1, T] of T new positions that end a sequence of num_keys (the last T of them): position t sees
    keys 0..num_keys - T + t."""
    return torch.arange(num_keys - num_new + 1, num_keys + 1, dtype=torch.int64)[None]


def prefix_key_counts(mask: torch.Tensor) -> torch.Tensor | None:
    """A bool mask [R or 1, 1, T, S] (True = attend) as key_counts [R or 1, T] where every query's visible keys are
    0..n-1 for some n >= 1 (a causal mask by cache position), else None."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    rows = mask[:, 0]  # [R, T, S]
    counts = rows.sum(-1)  # [R, T]
    if not bool(counts.min() >= 1) or bool((rows[..., 1:] & ~rows[..., :-1]).any()):
        return None
    return counts


def bf16_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_counts: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention of many positions a row: query [R, T, Nq, D]; keys, values [R, Nkv, S, D];
    key_counts int [R or 1, T], each in 1..S: the query at (r, t) attends to keys 0..key_counts[r, t] - 1 → [R, T,
    Nq * D] fp32; query head h reads key head h // (Nq / Nkv), as transformers' `repeat_kv` does. Queries, keys,
    values and the softmax's probabilities rounded to bf16, scores, softmax and sums in fp32 (see the C source).
    A query's output depends only on its query vector, count and the keys and values it sees (bit for bit the
    same alone, with S its count, as among other positions and rows). ValueError for tensors `applies` refuses
    or a count out of range; RuntimeError without the kernel (`available()`). No gradients."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the bf16 attention kernel is not available: {unavailable_reason()}")
    if query.dim() != 4 or keys.dim() != 4 or values.dim() != 4 or not applies(query, keys, values):
        raise ValueError(
            f"bf16_attention: query [R, T, Nq, D], keys and values [R, Nkv, S, D] fp32 CPU tensors with D a multiple "
            f"of 16 up to {MAX_HEAD_DIM} and Nq / Nkv up to {MAX_GROUP}, got {tuple(query.shape)} {query.dtype}, "
            f"{tuple(keys.shape)} {keys.dtype}, {tuple(values.shape)} {values.dtype}"
        )
    num_rows, num_new, num_heads, head_dim = query.shape
    _, num_kv_heads, num_keys, _ = keys.shape
    counts = key_counts.to(torch.int64).contiguous()
    if counts.dim() != 2 or counts.shape[0] not in (1, num_rows) or counts.shape[1] != num_new:
        raise ValueError(f"key_counts must be [{num_rows} or 1, {num_new}], got {tuple(key_counts.shape)}")
    out = torch.empty(num_rows, num_new, num_heads * head_dim, dtype=torch.float32)
    if out.numel() == 0:
        return out
    status = lib.omnimtp_bf16_attention(
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), counts.data_ptr(), out.data_ptr(), num_rows, num_new,
        num_heads, num_kv_heads, num_keys, head_dim, query.stride(0), query.stride(1), keys.stride(0),
        keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        0 if counts.shape[0] == 1 else counts.stride(0), scale, torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"key_counts must each be in 1..{num_keys}, got {int(counts.min())}..{int(counts.max())}")
    if status != 0:
        raise MemoryError("bf16_attention: out of memory")
    return out
