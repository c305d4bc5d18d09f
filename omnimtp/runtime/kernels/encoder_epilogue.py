"""The output pass of an audio encoder's int8 GEMM in one pass (`encoder_epilogue.c`, next to this file; why and the
numerics there), built and loaded as `small_batch_linear`'s kernel is.

    scale_bias_gelu(sums, row_scales, bias, gelu=True, out=rows)   # rows = gelu(sums * row_scales + bias)
    q, scales = scale_bias_gelu_u8(sums, row_scales, bias, gelu=True)  # those rows quantized for the next GEMM

sums: oneDNN's fp32 output of a "w8a8" GEMM (each exact sum times its column's weight scale); out: fp32 or bf16.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnimtp.runtime.kernels import small_batch_linear

_SOURCE = Path(__file__).with_name("encoder_epilogue.c")


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.omnimtp_encoder_epilogue
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fn = lib.omnimtp_encoder_epilogue_u8
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    fn.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int]


_KERNEL = small_batch_linear.Companion(
    _SOURCE, "omnimtp_encoder_epilogue_supported", "needs AVX-512F and AVX-512DQ (this CPU lacks them)", _declare
)
_library = _KERNEL.library
available = _KERNEL.available
unavailable_reason = _KERNEL.unavailable_reason


def _rows(t: torch.Tensor, name: str) -> int:
    """The row stride of a 2-D CPU tensor whose rows are contiguous; ValueError naming it otherwise."""
    if t.dim() != 2 or t.device.type != "cpu" or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be a 2-D CPU tensor with contiguous rows, got {tuple(t.shape)} strides "
                         f"{t.stride()} on {t.device}")
    return t.stride(0)


def _checked(sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None) -> ctypes.CDLL:
    """The library, after checking sums [M, N] fp32, row_scales [M] or [M, 1] fp32 and bias [N] fp32 or None
    (ValueError naming the argument)."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the encoder epilogue kernel is not available: {unavailable_reason()}")
    if sums.dim() != 2 or sums.dtype != torch.float32:
        raise ValueError(f"sums must be [M, N] fp32, got {tuple(sums.shape)} {sums.dtype}")
    num_rows, num_columns = sums.shape
    scales = row_scales.reshape(-1)
    if scales.shape != (num_rows,) or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(f"row_scales must be {num_rows} contiguous fp32 values, got {tuple(row_scales.shape)} "
                         f"{row_scales.dtype}")
    if bias is not None and (bias.shape != (num_columns,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be [{num_columns}] contiguous fp32, got {tuple(bias.shape)} {bias.dtype}")
    return lib


def scale_bias_gelu(
    sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, gelu: bool, out: torch.Tensor
) -> torch.Tensor:
    """out [M, N] (fp32 or bf16; may be sums itself) = sums [M, N] fp32 * row_scales [M, 1] (+ bias [N]), then
    GELU (the exact, erf one) when `gelu`: every element in one pass, the multiply and the add rounded as torch's
    `mul_` and `add_` round them, GELU within 5e-7 of the float64 exact (erf) GELU for |x| <= 15 (see the C
    source), bf16 rounded once. Rows may be strided (each row contiguous). Returns out. ValueError for shapes or
    dtypes it does not take; RuntimeError without the kernel (`available()`)."""
    lib = _checked(sums, row_scales, bias)
    if out.shape != sums.shape or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out must be {tuple(sums.shape)} fp32 or bf16, got {tuple(out.shape)} {out.dtype}")
    sum_stride, out_stride = _rows(sums, "sums"), _rows(out, "out")
    num_rows, num_columns = sums.shape
    if out.numel() == 0:
        return out
    status = lib.omnimtp_encoder_epilogue(
        sums.data_ptr(), num_rows, num_columns, sum_stride, row_scales.data_ptr(),
        None if bias is None else bias.data_ptr(), int(gelu), out.data_ptr(), out_stride,
        int(out.dtype == torch.bfloat16), torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"the encoder epilogue kernel failed ({status})")
    return out


def scale_bias_gelu_u8(
    sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, gelu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scale_bias_gelu`'s fp32 rows quantized for the next "w8a8" GEMM as `small_batch_linear.quantize_rows_u8`
    quantizes them (the same bytes and scales), without writing them in fp32: (q [M, N] uint8 with zero point 128,
    scales [M, 1] fp32). sums' rows may be strided (each contiguous)."""
    lib = _checked(sums, row_scales, bias)
    sum_stride = _rows(sums, "sums")
    num_rows, num_columns = sums.shape
    q = torch.empty(num_rows, num_columns, dtype=torch.uint8)
    scales = torch.empty(num_rows, 1, dtype=torch.float32)
    if q.numel() == 0:
        return q, scales
    status = lib.omnimtp_encoder_epilogue_u8(
        sums.data_ptr(), num_rows, num_columns, sum_stride, row_scales.data_ptr(),
        None if bias is None else bias.data_ptr(), int(gelu), q.data_ptr(), scales.data_ptr(), torch.get_num_threads(),
    )
    if status == -1:
        raise MemoryError("omnimtp_encoder_epilogue_u8: out of memory")
    if status != 0:
        raise RuntimeError(f"the encoder epilogue kernel failed ({status})")
    return q, scales
