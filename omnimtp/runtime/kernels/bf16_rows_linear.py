"""A linear layer over a few rows in bf16 on a CPU with AVX512_BF16, reading the weight once for all rows in the
layout torch keeps it in (`bf16_rows_linear.c`, next to this file: how and why there), built and loaded as
`small_batch_linear`'s kernel is.

    out = bf16_rows_linear(x, weight, bias)   # x [..., K] bf16, weight [N, K] bf16 (any strides, one of them 1)

Each output element is one dot product whose order depends on K and the weight's layout only: a row's output is
bit for bit the same alone as among any other rows (a batch of streams gets each stream's bits). Products of bf16,
sums in fp32: torch's bf16 `F.linear` within rounding.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnimtp.runtime import tracing
from omnimtp.runtime.kernels import small_batch_linear

_SOURCE = Path(__file__).with_name("bf16_rows_linear.c")


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.omnimtp_bf16_rows_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int, ctypes.c_int]


_KERNEL = small_batch_linear.Companion(
    _SOURCE, "omnimtp_bf16_rows_linear_supported", "needs AVX512_BF16 (this CPU lacks it)", _declare
)
_library = _KERNEL.library
available = _KERNEL.available
unavailable_reason = _KERNEL.unavailable_reason


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `bf16_rows_linear` takes these: bf16 CPU tensors, weight [N, K] with one stride 1 (an nn.Linear's
    or a convolution's weight, or a transposed convolution's taps: a transposed view), x [..., K], no gradient
    recorded, not under torch.compile, on a CPU that runs the kernel."""
    return (
        x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
        and weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1] and 1 in weight.stride()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not tracing.is_compiling() and available()
    )


def bf16_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """F.linear(x, weight, bias) in bf16 → [..., N] in out_dtype (bf16, as torch's op gives, or the fp32 sums):
    x [..., K], weight [N, K] (`applies`), bias [N] (any float dtype; added in fp32 before the sum is rounded).
    Each output row depends only on its own input row (bit for bit, whatever the other rows). ValueError for
    tensors `applies` refuses or another out_dtype; RuntimeError without the kernel (`available()`). No
    gradients."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the bf16 rows linear kernel is not available: {unavailable_reason()}")
    if not applies(x, weight):
        raise ValueError(
            f"bf16_rows_linear: x [..., K] and weight [N, K] bf16 CPU tensors, the weight with a stride of 1, no "
            f"gradient recorded, got "
            f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype} strides {weight.stride()}"
        )
    num_out, num_in = weight.shape
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != num_out):
        raise ValueError(f"bias must be [{num_out}], got {tuple(bias.shape)}")
    rows = x.reshape(-1, num_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], num_out, dtype=out_dtype)
    if out.numel() == 0:
        return out
    if num_in == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    bias32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
    n_stride, k_stride = weight.stride()
    if k_stride != 1:
        n_stride = 1  # the columns' layout
    status = lib.omnimtp_bf16_rows_linear(
        rows.data_ptr(), rows.shape[0], num_in, rows.stride(0), weight.data_ptr(), num_out, n_stride, k_stride,
        None if bias32 is None else bias32.data_ptr(), out.data_ptr(), num_out, int(out_dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    if status == -1:
        raise MemoryError("bf16_rows_linear: out of memory")
    if status != 0:
        raise ValueError(f"bf16_rows_linear: the kernel refused the call (status {status})")
    return out
