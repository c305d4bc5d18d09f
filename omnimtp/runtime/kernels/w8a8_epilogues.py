"""The elementwise passes between the int8 GEMMs of a "w8a8" decoder layer of many rows, in C (`w8a8_epilogues.c`,
next to this file: what each pass computes and its numerics), built and loaded as `small_batch_linear`'s kernel is.

    x, rows = residual_norm(sums, row_scales, bias, residual, norm_weight, eps)    # after o / down: x and next rows
    rows = gated(sums, row_scales)                                                # after gate_up: down's rows
    attention_inputs(sums, row_scales, bias, qk_norm, eps, cos, signed_sin, partner, num_heads, num_kv_heads)

`sums` is oneDNN's output of a "w8a8" GEMM ([N, width] fp32: each row's exact int32 sums times the column's weight
scale, `ops.w8a8_sums`) and row_scales [N, 1] its rows' quantization scales; "rows" are (bytes [N, K] uint8 with zero
point 128, scales [N, 1] fp32), what the next GEMM multiplies (`small_batch_linear.quantize_rows_u8`'s form).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnimtp.runtime.kernels import small_batch_linear

_SOURCE = Path(__file__).with_name("w8a8_epilogues.c")
MAX_HEAD_DIM = 256


def _declare(lib: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.omnimtp_w8a8_residual_norm.restype = None
    lib.omnimtp_w8a8_residual_norm.argtypes = [pointer, size, size] + [pointer] * 4 + [ctypes.c_float] + [pointer] * 3
    lib.omnimtp_w8a8_residual_norm.argtypes += [ctypes.c_int]
    lib.omnimtp_w8a8_gated.restype = None
    lib.omnimtp_w8a8_gated.argtypes = [pointer, size, size] + [pointer] * 3 + [ctypes.c_int]
    lib.omnimtp_w8a8_attention_inputs.restype = None
    lib.omnimtp_w8a8_attention_inputs.argtypes = [pointer] + [size] * 4 + [pointer] * 3 + [ctypes.c_float]
    lib.omnimtp_w8a8_attention_inputs.argtypes += [pointer, pointer, size, size, pointer, ctypes.c_int]


_KERNEL = small_batch_linear.Companion(
    _SOURCE, "omnimtp_w8a8_epilogues_supported", "needs AVX-512 (F, BW, VL, DQ); this CPU lacks it", _declare
)
_library = _KERNEL.library
available = _KERNEL.available
unavailable_reason = _KERNEL.unavailable_reason


def _checked(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor | None:
    """t as a contiguous CPU tensor of `shape` and dtype (None stays None); ValueError naming it otherwise."""
    if t is None:
        return None
    if tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name} must be a {dtype} CPU tensor {list(shape)}, got {t.dtype} {list(t.shape)} on "
                         f"{t.device}")
    return t.contiguous()


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the w8a8 epilogues are not available: {unavailable_reason()}")
    return lib


def residual_norm(
    sums: torch.Tensor, row_scales: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """sums [N, H] (contiguous fp32) → (x, rows): x = residual + (sums * row_scales + bias), written over sums
    (row_scales None: x is sums, unchanged; bias, residual None: not added), and with norm_weight [H] the rows of
    RMSNorm(x) * norm_weight quantized (bytes [N, H], scales [N, 1]), else None."""
    if sums.dim() != 2 or not sums.is_contiguous():
        raise ValueError(f"sums must be a contiguous [N, H] tensor, got {list(sums.shape)}")
    num_rows, width = sums.shape
    sums = _checked("sums", sums, (num_rows, width))
    row_scales = _checked("row_scales", row_scales, (num_rows, 1))
    bias, norm_weight = _checked("bias", bias, (width,)), _checked("norm_weight", norm_weight, (width,))
    residual = _checked("residual", residual, (num_rows, width))
    rows = None
    q = scales = buffer = None
    if norm_weight is not None:
        q = torch.empty(num_rows, width, dtype=torch.uint8)
        scales = torch.empty(num_rows, 1, dtype=torch.float32)
        buffer = torch.empty(torch.get_num_threads(), width, dtype=torch.float32)
        rows = (q, scales)
    if num_rows and width:
        _lib().omnimtp_w8a8_residual_norm(
            sums.data_ptr(), num_rows, width, _pointer(row_scales), _pointer(bias), _pointer(residual),
            _pointer(norm_weight), eps, _pointer(q), _pointer(scales), _pointer(buffer), torch.get_num_threads(),
        )
    return sums, rows


def gated(sums: torch.Tensor, row_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sums [N, 2I] ([gate | up], contiguous fp32) → the rows of silu(gate * s) * (up * s), s = row_scales [N, 1],
    quantized (bytes [N, I], scales [N, 1]). The gate half of sums is overwritten (with those values)."""
    if sums.dim() != 2 or sums.shape[1] % 2 or not sums.is_contiguous():
        raise ValueError(f"sums must be a contiguous [N, 2I] tensor, got {list(sums.shape)}")
    num_rows, width = sums.shape
    sums = _checked("sums", sums, (num_rows, width))
    row_scales = _checked("row_scales", row_scales, (num_rows, 1))
    q = torch.empty(num_rows, width // 2, dtype=torch.uint8)
    scales = torch.empty(num_rows, 1, dtype=torch.float32)
    if num_rows and width:
        _lib().omnimtp_w8a8_gated(sums.data_ptr(), num_rows, width // 2, row_scales.data_ptr(), q.data_ptr(),
                                  scales.data_ptr(), torch.get_num_threads())
    return q, scales


def attention_inputs(
    sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, qk_norm: torch.Tensor | None, eps: float,
    cos: torch.Tensor, signed_sin: torch.Tensor, partner: torch.Tensor, num_heads: int, num_kv_heads: int,
) -> torch.Tensor:
    """sums [R, T, Nq + 2 Nkv, D] (contiguous fp32: the qkv GEMM's rows) in place → itself: times row_scales [R * T,
    1] (+ bias [(Nq + 2 Nkv) D]); the query and key heads then RMSNormed per head times qk_norm [Nq + Nkv, D] (None:
    not normed) and rotated by RoPE: cos, signed_sin [R or 1, T, 1, D] (`Rope.tables`), the rotate_half partner of
    channel d partner[d] (int64 [D])."""
    if sums.dim() != 4 or not sums.is_contiguous() or sums.dtype != torch.float32:
        raise ValueError(f"sums must be a contiguous fp32 [R, T, heads, D] tensor, got {list(sums.shape)}")
    num_rows, num_new, num_all, head_dim = sums.shape
    if num_all != num_heads + 2 * num_kv_heads or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"sums must hold {num_heads} + 2 x {num_kv_heads} heads of at most {MAX_HEAD_DIM} channels, "
                         f"got {list(sums.shape)}")
    count = num_rows * num_new
    row_scales = _checked("row_scales", row_scales, (count, 1))
    bias = _checked("bias", bias, (num_all * head_dim,))
    qk_norm = _checked("qk_norm", qk_norm, (num_heads + num_kv_heads, head_dim))
    table_rows = cos.shape[0]
    if table_rows not in (1, num_rows):
        raise ValueError(f"cos must be [{num_rows} or 1, {num_new}, 1, {head_dim}], got {list(cos.shape)}")
    cos = _checked("cos", cos, (table_rows, num_new, 1, head_dim))
    signed_sin = _checked("signed_sin", signed_sin, (table_rows, num_new, 1, head_dim))
    partner = _checked("partner", partner, (head_dim,), torch.int64)
    if count:
        _lib().omnimtp_w8a8_attention_inputs(
            sums.data_ptr(), count, num_heads, num_kv_heads, head_dim, row_scales.data_ptr(), _pointer(bias),
            _pointer(qk_norm), eps, cos.data_ptr(), signed_sin.data_ptr(), num_new,
            0 if table_rows == 1 else num_new * head_dim, partner.data_ptr(), torch.get_num_threads(),
        )
    return sums
