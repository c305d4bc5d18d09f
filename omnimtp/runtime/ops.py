"""The tensor math every decoder shares: RMSNorm, linear layers (+ packed-GEMM kinds), RoPE, attention.

Each function is the one implementation of its op; numeric variants that callers need (the fp32 fused
RMSNorm, the code predictor's fp32 manual attention, the one-row `torch.mv` path) are named options of
it, so a fix or a faster kernel reaches every decoder at once.

    normed = rms_norm(x, weight, eps)                           # transformers' Qwen3 RMSNorm
    y = linear(x, weight, bias)                                 # nn.Linear; one row runs torch.mv
    q = quantize_weight(weight, "int4"); y = linear(x, weight, packed=q)   # int8 / int4 (/ w4a8) weights
    q = quantize_weight(weight, "w8a8"); y = linear(x, None, packed=q)     # many rows: oneDNN's int8 GEMM
    y = w8a8_linear_epilogue(x, q, bias, gelu=True)             # + bias, GELU in the GEMM's one output pass
    qe = quantize_experts(experts, "w4a8"); y = expert_linear(rows, qe, ids, offsets)  # routed experts, one call
    cos, signed_sin = rope.tables(positions, dtype)             # [R, T, 1, D] (positions [R, T] or [3, R, T])
    qk = apply_rope(qk, cos, signed_sin, rope.source)           # queries and keys at once
    out = attention(q, keys, values, mask, scale)               # SDPA, GQA; [R, T, Nq * D]
    out = attention(q, keys, values, mask, scale, bf16_many_rows=True)  # a prompt's forward in bf16 (AVX512_BF16)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from omnimtp.runtime import tracing
from omnimtp.runtime.kernels import bf16_attention, encoder_epilogue, small_batch_linear


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous detached copy (or the tensor itself when nothing changes) in `dtype`."""
    return t.detach().to(dtype).contiguous()


# ---------------------------------------------------------------------------------------------
# RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, fused: bool = True) -> torch.Tensor:
    """transformers' Qwen3 RMSNorm: x * rsqrt(mean(x²) + eps) in fp32, weight applied after casting back.

    fused=True: `F.rms_norm` without a weight computes that formula in one op; in fp32 there is no cast
    and `F.rms_norm` with the weight computes the same products (x * rsqrt(...)) * weight in one call.
    fused=False: the formula op by op, exactly as the module writes it (the code predictor's choice: its
    compiled graphs and its bits stay what they are). weight [D] or stacked per head [heads, D], or None:
    x normalised alone (for a caller that folded the weight into the matmul after it)."""
    if weight is None:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    if not fused:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if x.dtype == torch.float32 and weight.dim() == 1 and weight.dtype == torch.float32:
        if x.device.type == "cpu" and not tracing.is_compiling():
            # `F.rms_norm`'s CPU kernels one by one (x², sum, / D, + eps, rsqrt, · x, · weight: the same
            # values), with D and eps as fp32 tensors made once: its scalar operands cost a conversion
            # each call, about a quarter of its time on a small decoder's rows
            size, eps_tensor = _norm_constants(x.shape[-1], eps)
            return x * torch.rsqrt((x * x).sum(-1, keepdim=True).div_(size).add_(eps_tensor)) * weight
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


_NORM_CONSTANTS: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def _norm_constants(size: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(size, eps) as 0-dim fp32 CPU tensors, kept per (size, eps)."""
    key = (size, eps)
    if key not in _NORM_CONSTANTS:
        with torch.inference_mode(False):  # ordinary tensors: autograd may save them
            _NORM_CONSTANTS[key] = (torch.tensor(float(size)), torch.tensor(eps, dtype=torch.float32))
    return _NORM_CONSTANTS[key]


# ---------------------------------------------------------------------------------------------
# Linear layers and packed-weight GEMMs (CPU only)

PACKED_GEMM_KINDS = ("row", "mkl", "onednn")
# fp32 "mkl": batches of at least this many rows use MKL-packed weights (below it plain kernels are as
# fast); "row" under torch.compile: the kernel runs from this many rows (below it, plain kernels),
# or for matrices of at least COMPILED_KERNEL_MIN_WEIGHTS elements (4 MB: ~250 us to read).
PACKED_GEMM_MIN_ROWS = 4
COMPILED_KERNEL_MIN_WEIGHTS = 1 << 20


def packed_gemm_kinds(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The packed-weight matmuls that can run `dtype` batches on `device`, best first: "row" (fp32:
    omnimtp's own small-batch kernel, `omnimtp.runtime.kernels.small_batch_linear`, on x86 CPUs with
    AVX-512F or AVX2 and a C compiler; built on the first call), "mkl" (fp32: MKL's packed SGEMM), "onednn" (bf16:
    oneDNN's reordered weights, where oneDNN supports bf16). Every kind is a CPU kernel: any other device
    (cuda, meta, ...) gets none, and its linears run as plain torch ops."""
    if torch.device(device).type != "cpu":
        return []
    kinds = []
    if dtype == torch.float32 and small_batch_linear.available():
        kinds.append("row")
    if dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        kinds.append("mkl")
    if (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        kinds.append("onednn")
    return kinds


def packed_gemm_kind(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """The best packed-weight matmul for `dtype` on `device` (see packed_gemm_kinds), or None."""
    kinds = packed_gemm_kinds(device, dtype)
    return kinds[0] if kinds else None


def packed_gemm_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this torch build can run `dtype` matmuls on packed weights on `device` (see packed_gemm_kind)."""
    return packed_gemm_kind(device, dtype) is not None


# `torch.ops.mkl._mkl_linear` as an opaque op, so torch.compile calls it instead of lowering it (inductor's own
# lowering expects the packed weight to be a frozen constant)
_mkl_packed_linear_op = small_batch_linear.opaque_op(
    "mkl_packed_linear", "(Tensor x, Tensor packed, Tensor weight, int rows) -> Tensor",
    lambda x, packed, weight, rows: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows),
    lambda x, packed, weight, rows: x.new_empty(x.shape[0], weight.shape[0]),
)
# oneDNN's linear on a reordered (opaque) weight, kept opaque under torch.compile as above
_onednn_packed_linear_op = small_batch_linear.opaque_op(
    "onednn_packed_linear", "(Tensor x, Tensor packed, int out_features) -> Tensor",
    lambda x, packed, out_features: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    lambda x, packed, out_features: x.new_empty(x.shape[0], out_features),
)


@dataclass(frozen=True)
class PackedGemm:
    """A packed-weight matmul kind (CPU only; see `packed_gemm_kinds`).

    kind "mkl" (fp32): MKL's packed SGEMM (what inductor's freezing pass uses for CPU linears) reorders
    a weight once for a given row count; small-batch fp32 matmuls on it run about 1.6x faster than
    `F.linear` on a CPU. `rows` is that count: inputs must have a multiple of it, and run as that many
    calls back to back (the later ones find the matrix in cache).
    kind "onednn" (bf16): oneDNN's reordered weights (what inductor's freezing uses for bf16 linears);
    any row count, one call; `rows` is None. oneDNN gives the same values as `F.linear`; MKL's packed
    SGEMM differs from it by rounding only.
    kind "row" (fp32): `omnimtp.runtime.kernels.small_batch_linear`: weights in panels, several streamed
    at once, at a core's read bandwidth for 1..16 rows; any row count, one call, `rows` is None; equal to
    `F.linear` up to rounding, each row computed on its own."""

    kind: str  # "row", "mkl" or "onednn"
    rows: int | None

    def pack(self, weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
        """nn.Linear weight [out, in] → its packed form (rows_hint: the row count oneDNN tunes for)."""
        if self.kind == "row":
            return small_batch_linear.pack_weight(weight)
        if self.kind == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(weight, self.rows)
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


# "int8" and "int4": weight-only (activations and sums in float); "w4a8": int4 weights with the activations
# quantized to int8 per row and group of inputs as each matmul starts (dynamic), the sums exact integers
QUANTIZE_MODES = ("int8", "int4", "w4a8")
INT4_GROUP_SIZE = 128  # inputs per int4 scale (the common choice: GPTQ, AWQ, torchao's default)
INT8_BLOCK_ROWS = 8192  # rows a matrix is quantized in at a time (a multiple of the kernel's 16-row panels)
# Kinds for linears of many rows (an audio encoder, a prefill, the aligner's one forward), not `--quantize` modes:
# "w8a8": int8 weights per output channel and the activations quantized to int8 per row as each matmul starts
# (dynamic), the sums exact int32s, on oneDNN's int8 GEMM (`vpdpbusd`; twice the bf16 GEMM's rate on an AVX-512 CPU)
MANY_ROW_MODES = ("w8a8",)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight quantized for omnimtp's CPU kernel (`small_batch_linear.quantize_int8` /
    `quantize_int4`); `linear` runs it when passed as `packed`. Weight-only (int8_activations False): the
    activations, sums and output stay float. int8_activations (the "w4a8" mode, int4 weights): each call
    quantizes its input per row and group of `group_size` inputs (`small_batch_linear.w4a8_linear`).
    "w8a8" (`MANY_ROW_MODES`; int8 weights, group_size None, int8_activations): `packed` is oneDNN's reordered int8
    weight (`onednn::qlinear_prepack`), run by oneDNN's int8 GEMM with each row quantized to int8 over all its
    inputs (`w8a8_linear`). `dequantized` [N, K] fp32 is the weight the kernel multiplies by and
    `dequantized_input(x)` the input (what tests compare against)."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    group_size: int | None  # None: int8 per output channel; else int4 per channel and group of inputs
    int8_activations: bool = False

    @property
    def mode(self) -> str:
        """"int8", "int4", "w4a8" or "w8a8"."""
        if self.group_size is None:
            return "w8a8" if self.int8_activations else "int8"
        return "w4a8" if self.int8_activations else "int4"

    def dequantized_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input [M, K] the kernel multiplies by: x itself (weight-only), or x rounded to its int8 grid."""
        if not self.int8_activations:
            return x
        if self.group_size is None:  # "w8a8": the kernel's own rounding of each row
            x_u8, scales = small_batch_linear.quantize_rows_u8(x.float())
            return (x_u8.float() - 128) * scales
        xq, scales = small_batch_linear.quantize_activations_int8(x, self.group_size)
        return (xq.view(x.shape[0], -1, self.group_size) * scales[..., None]).view_as(x)

    def expert(self, index: int) -> QuantizedWeight:
        """Expert `index`'s matrix of a stacked form (`quantize_experts`), as views."""
        return replace(self, packed=self.packed[index], scales=self.scales[index])

    def dequantized(self) -> torch.Tensor:
        if self.mode == "w8a8":  # oneDNN's weight reads back as the int8 matrix [K, N]
            return self.packed.to_dense().t().float() * self.scales[:, None]
        if self.group_size is None:
            q = self.packed.transpose(1, 2).reshape(-1, self.packed.shape[1]).float()
            return (q * self.scales[:, None])[: self.out_features]
        in_features = self.scales.shape[1] * self.group_size
        q = small_batch_linear.unpack_int4(self.packed, in_features).float()  # [N', K]
        scales = self.scales.transpose(1, 2).reshape(q.shape[0], -1).repeat_interleave(self.group_size, dim=1)
        return (q * scales)[: self.out_features]


def check_quantize(quantize: str | None, device: torch.device | str) -> None:
    """ValueError naming `quantize` unless it is None or a mode in QUANTIZE_MODES with a kernel on `device`
    (omnimtp's CPU kernel: an x86 CPU with AVX2 or AVX-512F and a C compiler; "w4a8" runs AVX512-VNNI where
    the CPU has it, else AVX2, with the same values)."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be None or one of {QUANTIZE_MODES}, got {quantize!r}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantize={quantize!r} has no kernel on {torch.device(device)} (CPU only)")
    if not small_batch_linear.available():
        raise ValueError(f"quantize={quantize!r} has no kernel here: {small_batch_linear.unavailable_reason()}")


def many_row_mode_reason(device: torch.device | str) -> str | None:
    """None where "w8a8" (`MANY_ROW_MODES`) runs on `device`, else why not: oneDNN's int8 GEMM on a CPU with
    AVX512-VNNI (without VNNI oneDNN pairs u8 x s8 products in int16, which saturate: the sums would not be
    exact)."""
    if torch.device(device).type != "cpu":
        return f"it has no kernel on {torch.device(device)} (CPU only)"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return "this torch build has no oneDNN int8 GEMM (onednn::qlinear_pointwise)"
    if small_batch_linear.w4a8_isa() != "AVX512-VNNI":
        return "it needs a CPU with AVX512-VNNI"
    return None


def check_many_row_mode(mode: str, device: torch.device | str, name: str = "mode") -> None:
    """ValueError naming `name` unless `mode` is in MANY_ROW_MODES and runs on `device` (`many_row_mode_reason`)."""
    if mode not in MANY_ROW_MODES:
        raise ValueError(f"{name} must be one of {MANY_ROW_MODES}, got {mode!r}")
    reason = many_row_mode_reason(device)
    if reason is not None:
        raise ValueError(f"{name}={mode!r}: {reason}")


def quantize_weight(weight: torch.Tensor, mode: str, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """nn.Linear weight [N, K] → its quantized form ("int8": symmetric per output channel; "int4" and "w4a8":
    symmetric per output channel and group of `group_size` inputs, or of all K inputs when K is not a
    multiple of it; "w4a8" then quantizes the activations per row and the same groups; "w8a8" (`MANY_ROW_MODES`):
    "int8"'s weights and scales, reordered for oneDNN's int8 GEMM, the activations quantized per row). The weight
    is not modified."""
    if mode in MANY_ROW_MODES:
        check_many_row_mode(mode, weight.device)
        w = weight.detach().float()  # "int8"'s quantization (`small_batch_linear.quantize_int8`), unpacked
        scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [N]
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        return QuantizedWeight(packed, scales, weight.shape[0], None, int8_activations=True)
    check_quantize(mode, weight.device)
    if mode == "int8":  # rows in blocks (whole 16-row panels): an LM head's float copies stay a block's
        blocks = [small_batch_linear.quantize_int8(block) for block in weight.split(INT8_BLOCK_ROWS)]
        packed, scales = (torch.cat(parts) for parts in zip(*blocks, strict=True))
        return QuantizedWeight(packed, scales, weight.shape[0], None)
    group = group_size if weight.shape[1] % group_size == 0 else weight.shape[1]
    if mode == "w4a8" and group % 8 and group != weight.shape[1]:
        raise ValueError(f"group_size={group_size}: w4a8 needs groups of whole words of 8 inputs")
    # rows in blocks, as "int8"'s: an LM head's temporaries (int64 nibbles, 8 bytes an input) stay a block's
    blocks = [small_batch_linear.quantize_int4(block, group) for block in weight.split(INT8_BLOCK_ROWS)]
    packed, scales = (torch.cat(parts) for parts in zip(*blocks, strict=True))
    return QuantizedWeight(packed, scales, weight.shape[0], group, int8_activations=mode == "w4a8")


def quantize_experts(weights: torch.Tensor, mode: str, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Every routed expert's matrix, weights [E, N, K] (transformers' fused expert tensors, [gate; up] or down), →
    one QuantizedWeight whose packed and scales carry a leading [E] dimension (`QuantizedWeight.expert(e)`:
    expert e's), each expert quantized as `quantize_weight` quantizes a matrix, one at a time into the stacked
    tensors. `expert_linear` runs it. The weights are not modified."""
    first = quantize_weight(weights[0], mode, group_size)
    packed = first.packed.new_empty((weights.shape[0], *first.packed.shape))
    scales = first.scales.new_empty((weights.shape[0], *first.scales.shape))
    packed[0], scales[0] = first.packed, first.scales
    for index in range(1, weights.shape[0]):
        quantized = quantize_weight(weights[index], mode, group_size)
        packed[index], scales[index] = quantized.packed, quantized.scales
    return replace(first, packed=packed, scales=scales)


def expert_linear(
    x: torch.Tensor, weight: QuantizedWeight, experts: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Rows grouped by expert through their experts' quantized matrices (`quantize_experts`) in one kernel call:
    x [T, K], rows offsets[i]..offsets[i + 1] - 1 by expert experts[i] (int64 [G + 1] and [G]) → [T, N] in x's
    dtype, each row the bits `linear(row, packed=weight.expert(e))` gives it alone."""
    out = small_batch_linear.quantized_experts(
        x.float(), weight.packed, weight.scales, weight.out_features, weight.group_size, weight.int8_activations,
        experts, offsets,
    )
    return out.to(x.dtype)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | QuantizedWeight | None = None,
    gemm: PackedGemm | None = None,
) -> torch.Tensor:
    """nn.Linear: x [..., in] @ weight[out, in].T (+ bias, added inside the matmul as the module does: one
    rounding in bf16). packed: `weight` packed by `gemm`, or None; or `weight` quantized
    (`quantize_weight`), which then runs on omnimtp's kernel in fp32 for any row count (weight and gemm
    unused, weight may be None; the bias added after the matmul) and returns x's dtype. A bias with a
    oneDNN-packed weight is added inside oneDNN's matmul (eager; under torch.compile `F.linear` runs).

    "row": every row count runs omnimtp's kernel (a row's values do not depend on the other rows),
    except, under torch.compile, fewer than PACKED_GEMM_MIN_ROWS rows of a small matrix. Otherwise a
    single row without bias goes through matrix-vector kernels, which stream the weights at close to
    memory bandwidth (CPU bf16 GEMM with one row runs at half of it or less)."""
    if isinstance(packed, QuantizedWeight):
        rows = x.shape[:-1].numel()
        if packed.mode == "w8a8":
            out = w8a8_linear(x.reshape(rows, x.shape[-1]).float(), packed).to(x.dtype)
        else:
            kernel = small_batch_linear.w4a8_linear if packed.int8_activations else small_batch_linear.quantized_linear
            out = kernel(
                x.reshape(rows, x.shape[-1]).float(), packed.packed, packed.scales, packed.out_features,
                packed.group_size,
            ).to(x.dtype)
        out = out.view(*x.shape[:-1], packed.out_features)
        if bias is None:
            return out
        # the kernel's output is a new tensor: the bias added in place (the same sums, no second output to allocate)
        in_place = bias.dtype == out.dtype and not (torch.is_grad_enabled() and bias.requires_grad)
        return out.add_(bias) if in_place else out + bias
    onednn = packed is not None and gemm.kind == "onednn" and not tracing.is_compiling()
    if bias is not None and not onednn:
        return F.linear(x, weight, bias)
    rows = x.shape[:-1].numel()
    # Under torch.compile the kernel is an opaque custom op whose Python dispatch costs ~25-50 us a
    # call: fewer than PACKED_GEMM_MIN_ROWS rows of a small matrix stay on `torch.mv` / `F.linear`
    # (inductor's own code), where that cost would dominate; a large matrix takes far longer to read.
    if packed is not None and gemm.kind == "row" and (
        not tracing.is_compiling() or rows >= PACKED_GEMM_MIN_ROWS
        or weight.numel() >= COMPILED_KERNEL_MIN_WEIGHTS
        or weight.is_meta  # held as its pack alone (`PackedDecoder.row_kernel_only`): no other path
    ):
        out = small_batch_linear.small_batch_linear_unchecked(x.reshape(rows, x.shape[-1]), packed, weight.shape[0])
        return out.view(*x.shape[:-1], weight.shape[0])
    if rows == 1 and bias is None:
        if x.dim() == 1:  # a one-row step on 1-D vectors
            return torch.mv(weight, x)
        return torch.mv(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
    if packed is None or gemm.kind == "row":
        return F.linear(x, weight)
    x2d = x.reshape(rows, x.shape[-1])
    compiling = tracing.is_compiling()
    if gemm.kind == "onednn":
        if compiling:
            out = _onednn_packed_linear_op(x2d, packed, weight.shape[0])
        else:  # the bias (if any) added inside oneDNN's matmul
            out = torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    outs = []
    for chunk in x2d.split(gemm.rows):  # [gemm.rows, in] each
        if compiling:
            outs.append(_mkl_packed_linear_op(chunk, packed, weight, gemm.rows))
        else:
            outs.append(torch.ops.mkl._mkl_linear(chunk, packed, weight, None, gemm.rows))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.view(*x.shape[:-1], weight.shape[0])


def w8a8_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] fp32 @ W.T → [M, N] fp32 for a "w8a8" weight (`quantize_weight`): each row quantized to int8 over
    all its K inputs (`small_batch_linear.quantize_rows_u8`: scale = max|x| / 127), shifted to unsigned bytes
    (zero point 128) for oneDNN's u8 x s8 int8 GEMM, whose int32 sums are exact; the sum of a row
    and a column goes to fp32 times the column's weight scale (in oneDNN), then times the row's scale. A row's
    values do not depend on the other rows; an all-zero row gives zeros, a row with a NaN or an infinity NaNs."""
    x_u8, row_scales = small_batch_linear.quantize_rows_u8(x)  # [M, K] uint8, [M, 1]
    return _w8a8_matmul(x_u8, row_scales, weight)


def _w8a8_matmul(x_u8: torch.Tensor, row_scales: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Rows already quantized (x_u8 [M, K] uint8 with zero point 128, row_scales [M, 1]) @ a "w8a8" weight → [M, N]
    fp32: oneDNN's u8 x s8 GEMM, each exact int32 sum to fp32 times its column's weight scale, then its row's."""
    return w8a8_sums(x_u8, weight).mul_(row_scales)


def w8a8_sums(x_u8: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """Rows already quantized (x_u8 [M, K] uint8 with zero point 128) @ a "w8a8" weight → [M, N] fp32 before the rows'
    scales: oneDNN's u8 x s8 GEMM, each exact int32 sum to fp32 times its column's weight scale (what a fused pass
    after it scales by its row's, `kernels.w8a8_epilogues`)."""
    return torch.ops.onednn.qlinear_pointwise(
        x_u8, 1.0, 128, weight.packed, weight.scales, _weight_zero_points(weight.out_features), None, 1.0, 0,
        torch.float32, "none", [], "",
    )


class QuantizedRows(NamedTuple):
    """Rows quantized for a "w8a8" GEMM as `small_batch_linear.quantize_rows_u8` quantizes them: q [M, K] uint8
    (zero point 128), scales [M, 1] fp32."""

    q: torch.Tensor
    scales: torch.Tensor


def _quantized_sums(x: torch.Tensor | QuantizedRows, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(oneDNN's column-scaled sums [M, N] fp32, the rows' scales [M, 1]) of x [M, K] fp32 (quantized here) or rows
    already quantized."""
    rows = x if isinstance(x, QuantizedRows) else QuantizedRows(*small_batch_linear.quantize_rows_u8(x))
    return w8a8_sums(rows.q, weight), rows.scales


def w8a8_linear_epilogue(
    x: torch.Tensor | QuantizedRows, weight: QuantizedWeight, bias: torch.Tensor | None, *, gelu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w8a8_linear(x, weight)` + bias, then GELU (the exact, erf one) when `gelu`, with the rows' scales, the bias
    and GELU in one pass over oneDNN's output (`encoder_epilogue.scale_bias_gelu`): x [M, K] fp32 (or its rows
    already quantized, `QuantizedRows`) → [M, N], a new fp32 tensor, or written into `out` ([M, N] fp32 or bf16
    with contiguous rows, e.g. a view of a larger buffer). Before GELU the values are bit for bit
    `w8a8_linear(x, weight).add_(bias)`'s; a row's values do not depend on the other rows. bias: fp32 [N] or
    None."""
    sums, row_scales = _quantized_sums(x, weight)  # [M, N], [M, 1]
    return encoder_epilogue.scale_bias_gelu(sums, row_scales, bias, gelu, sums if out is None else out)


def w8a8_linear_quantized_out(
    x: torch.Tensor | QuantizedRows, weight: QuantizedWeight, bias: torch.Tensor | None, *, gelu: bool = False
) -> QuantizedRows:
    """`w8a8_linear_epilogue`'s output quantized for the next "w8a8" GEMM in the same pass
    (`encoder_epilogue.scale_bias_gelu_u8`): the bytes and scales `quantize_rows_u8` would make of it, its fp32
    rows never written (fc1 → GELU → fc2)."""
    sums, row_scales = _quantized_sums(x, weight)
    return QuantizedRows(*encoder_epilogue.scale_bias_gelu_u8(sums, row_scales, bias, gelu))


# the most patch rows a "w8a8" convolution quantizes and multiplies at a time: its memory stays a block's (4096 rows
# of a 3 x 3 kernel over 480 channels: 18 MB of bytes and 8 MB of sums), whatever the input's size
CONV_BLOCK_ROWS = 4096


def quantize_conv_weight(weight: torch.Tensor, mode: str) -> QuantizedWeight:
    """An nn.Conv2d weight [O, C, kh, kw] → the matrix [O, kh * kw * C] (`quantize_weight` of it in `mode`, a
    MANY_ROW_MODES kind) that `conv2d` multiplies each patch row by: per output channel, as a linear's."""
    if mode not in MANY_ROW_MODES:
        raise ValueError(f"mode must be one of {MANY_ROW_MODES} for a convolution, got {mode!r}")
    if weight.dim() != 4:
        raise ValueError(f"weight must be a Conv2d weight [O, C, kh, kw], got {tuple(weight.shape)}")
    return quantize_weight(weight.detach().float().permute(0, 2, 3, 1).reshape(weight.shape[0], -1), mode)


def conv2d(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, kernel_size: tuple[int, int],
    stride: tuple[int, int], padding: tuple[int, int], block_rows: int = CONV_BLOCK_ROWS, gelu: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """nn.Conv2d (zero padding, no dilation or groups) as a "w8a8" linear (`quantize_conv_weight`): x [B, H, W, C]
    channels last (fp32 or bf16) → [B, Ho, Wo, O] in x's dtype (or out_dtype: fp32 or bf16). Each output position's
    patch (kh x kw x C inputs) is a row quantized to int8 on its own (`small_batch_linear.quantize_patches_u8`: what
    `w8a8_linear` does to its rows, without unfolding the input), times the weight on oneDNN's int8 GEMM (exact int32
    sums), then the row's and the channel's scales and the bias (fp32 [O] or None) in fp32, and GELU (the exact, erf
    one) when `gelu`, in one pass that rounds once to the output's dtype (`encoder_epilogue.scale_bias_gelu`). Rows
    go in equal blocks of at most `block_rows` (memory bounded by a block). A position's values depend only on its
    own patch: the same alone, in any batch and any blocking."""
    batch, height, width, _ = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    out_height, out_width = (height + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1
    out = x.new_empty(batch, out_height, out_width, weight.out_features, dtype=out_dtype or x.dtype)
    rows = out.view(-1, weight.out_features)
    x = x.contiguous()
    num_blocks = max(-(-rows.shape[0] // block_rows), 1)
    block_rows = max(-(-rows.shape[0] // num_blocks), 1)  # equal blocks: no short last one
    for row0 in range(0, rows.shape[0], block_rows):
        num_rows = min(block_rows, rows.shape[0] - row0)
        x_u8, row_scales = small_batch_linear.quantize_patches_u8(x, (kh, kw), (sh, sw), (ph, pw), row0, num_rows)
        sums = w8a8_sums(x_u8, weight)
        encoder_epilogue.scale_bias_gelu(sums, row_scales, bias, gelu, rows[row0:row0 + num_rows])
    return out


_WEIGHT_ZERO_POINTS: dict[int, torch.Tensor] = {}


def _weight_zero_points(num_columns: int) -> torch.Tensor:
    """The symmetric weights' zero points (0 for each column, int64 [N]), made once per width."""
    if num_columns not in _WEIGHT_ZERO_POINTS:
        with torch.inference_mode(False):  # an ordinary tensor, whatever mode the first call runs in
            _WEIGHT_ZERO_POINTS[num_columns] = torch.zeros(num_columns, dtype=torch.int64)
    return _WEIGHT_ZERO_POINTS[num_columns]


def gated_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor | None,
    down: torch.Tensor,
    gate: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    packed: tuple[torch.Tensor, torch.Tensor] | None = None,
    gemm: PackedGemm | None = None,
) -> torch.Tensor:
    """SiLU-gated MLP x [..., H] → down(silu(gate(x)) * up(x)) [..., H]. gate_up [2I, H] fused, or separate
    gate, up [I, H] (transformers' own tensors, used without a copy). packed: (gate_up, down) packed by
    `gemm`, or quantized (`quantize_weight`: then gate_up and down may be None)."""
    packed_gate_up, packed_down = (None, None) if packed is None else packed
    if gate is not None:
        gate_out, up_out = linear(x, gate), linear(x, up)
    else:
        gate_out, up_out = linear(x, gate_up, packed=packed_gate_up, gemm=gemm).chunk(2, dim=-1)
    return linear(F.silu(gate_out) * up_out, down, packed=packed_down, gemm=gemm)


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings


@dataclass(frozen=True)
class Rope:
    """RoPE as a transformers rotary module computes it: fp32 angles position * inv_freq, cos / sin
    scaled by `attention_scaling`, cast to the model dtype, on the first `rotary_dim` channels of each head
    (partial rotary, rotate_half convention; the other channels pass through).

    M-RoPE: with position ids [3, R, T] (temporal, height, width) and `mrope_section`, the angles of
    channel pairs are taken from the axes in the module's layout (`mrope_angles`): interleaved (Qwen3-Omni)
    or in consecutive sections (Qwen2.5-Omni). For text and audio rows the three axes carry the same
    position, so the sections select equal angles and M-RoPE is exactly 1-D RoPE on [R, T] positions: the
    decoders pass those."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32
    attention_scaling: float
    head_dim: int
    mrope_section: tuple[int, ...] | None = None
    is_mrope_interleaved: bool = True
    # [D] channel each channel's rotate_half partner comes from, when rotary_dim < head_dim; None: a roll
    source: torch.Tensor | None = None

    @classmethod
    def from_module(cls, rotary, head_dim: int) -> Rope:
        """rotary: a transformers rotary embedding module (its `inv_freq`, `attention_scaling` and, for
        M-RoPE, `mrope_section`)."""
        inv_freq = rotary.inv_freq.detach().float().clone()
        half = inv_freq.shape[0]
        source = None
        if 2 * half != head_dim:
            channels = torch.arange(head_dim, device=inv_freq.device)
            source = torch.where(channels < 2 * half, (channels + half) % (2 * half), channels)
        section = getattr(rotary, "mrope_section", None)
        return cls(
            inv_freq=inv_freq, attention_scaling=float(rotary.attention_scaling), head_dim=head_dim,
            mrope_section=None if section is None else tuple(section),
            is_mrope_interleaved=section is None or _is_interleaved_layout(rotary, half), source=source,
        )

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [R, T] (or [3, R, T] M-RoPE ids) → cos, signed_sin [R, T, 1, D] in `dtype`.
        signed_sin = [-sin, sin] halves, so rotate_half(x) * sin == partner(x) * signed_sin; on channels
        RoPE passes through, cos = 1 and signed_sin = 0 (x * 1 + y * 0 == x exactly)."""
        if positions.dim() == 3:
            freqs = mrope_angles(
                self.inv_freq, positions, self.mrope_section, self.is_mrope_interleaved
            )  # [R, T, rd/2]
        else:
            freqs = positions[..., None].float() * self.inv_freq  # [R, T, rd/2]
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        parts_cos, parts_sin = [cos, cos], [-sin, sin]
        num_pass = self.head_dim - self.rotary_dim
        if num_pass:
            parts_cos.append(cos.new_ones((*cos.shape[:-1], num_pass)))
            parts_sin.append(sin.new_zeros((*sin.shape[:-1], num_pass)))
        return torch.cat(parts_cos, dim=-1)[:, :, None], torch.cat(parts_sin, dim=-1)[:, :, None]


def mrope_angles(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, mrope_section, is_interleaved: bool = True
) -> torch.Tensor:
    """M-RoPE angles: position_ids [3, R, T] (temporal, height, width) → [R, T, D/2].

    Interleaved (Qwen3-Omni, transformers' `recomposition_frequencies` there): channel pair i takes the
    temporal axis' angle, except pairs 1, 4, 7, ... below 3 * mrope_section[1] (height) and 2, 5, 8, ...
    below 3 * mrope_section[2] (width). Example: mrope_section (2, 1, 1), D/2 = 4: pairs (t, h, w, t).
    Sections (Qwen2.5-Omni): the first mrope_section[0] pairs take the temporal axis, the next
    mrope_section[1] the height, the last mrope_section[2] the width; (2, 1, 1): pairs (t, t, h, w)."""
    if mrope_section is None:
        raise ValueError("mrope_section is needed for [3, R, T] position ids")
    freqs = position_ids[..., None].float() * inv_freq  # [3, R, T, D/2]
    if not is_interleaved:
        return torch.cat([part[axis % 3] for axis, part in enumerate(freqs.split(list(mrope_section), dim=-1))], dim=-1)
    angles = freqs[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        index = slice(offset, mrope_section[axis] * 3, 3)
        angles[..., index] = freqs[axis, ..., index]
    return angles


def _is_interleaved_layout(rotary, num_pairs: int) -> bool:
    """Whether a transformers M-RoPE module interleaves its axes: its own `recomposition_frequencies` on
    angles that name their axis (0, 1, 2) shows which axis channel pair 1 takes (interleaved: height;
    in sections it stays temporal whenever mrope_section[0] > 1). A module without it: interleaved."""
    if not hasattr(rotary, "recomposition_frequencies"):
        return True
    probe = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, num_pairs).clone()
    recomposed = rotary.recomposition_frequencies(probe)[..., :num_pairs].reshape(-1)  # [D/2]
    layout = mrope_angles(torch.ones(num_pairs), torch.arange(3).view(3, 1, 1), rotary.mrope_section, False).reshape(-1)
    return not torch.equal(recomposed, layout)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, source: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., heads, D] rotated: x * cos + partner(x) * signed_sin, with partner the rotate_half channel
    (a roll by D/2 for full rotary, a gather by `source` for partial rotary: the same values)."""
    partner = x.roll(x.shape[-1] // 2, dims=-1) if source is None else x.index_select(-1, source)
    return x * cos + partner * signed_sin


# ---------------------------------------------------------------------------------------------
# Attention


def _decode_attention_mask(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, kv_rows: torch.Tensor | None = None
) -> tuple[bool, object]:
    """(whether one query position a row runs on omnimtp's kernel, the kernel's mask [R or 1, S] or None). It
    does for query [R, Nq, D] in fp32 or bf16 on a CPU with the kernel, keys and values [R, Nkv, S, D] (with
    kv_rows: [B, Nkv, S, D]) in its dtype with contiguous rows, head_dim and group in its range, mask None or bool
    [R or 1, 1, 1, S], no gradient, not under torch.compile."""
    num_rows, num_heads, head_dim = query.shape
    if not (
        query.dtype == keys.dtype == values.dtype and query.dtype in small_batch_linear.DECODE_ATTENTION_DTYPES
        and query.device.type == "cpu"
        and keys.stride(-1) == 1 and values.stride(-1) == 1
        and keys.shape[0] == values.shape[0] == (num_rows if kv_rows is None else keys.shape[0])
        and head_dim <= small_batch_linear.DECODE_ATTENTION_MAX_HEAD_DIM
        and num_heads % keys.shape[1] == 0
        and num_heads // keys.shape[1] <= small_batch_linear.DECODE_ATTENTION_MAX_GROUP
        and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
                              and mask.shape[0] in (1, num_rows) and mask.shape[3] == keys.shape[2]))
        and not (torch.is_grad_enabled() and (query.requires_grad or keys.requires_grad or values.requires_grad))
        and not tracing.is_compiling() and small_batch_linear.available()
    ):
        return False, None
    return True, None if mask is None else mask[:, 0, 0]


# The mask of a square causal block from position 0 (every row's T new positions are its first T columns): SDPA
# runs it with is_causal, skipping the blocks above the diagonal; the same values as the bool mask it stands for.
CAUSAL = "causal"


def causal_mask(num_positions: int, device) -> torch.Tensor:
    """The bool mask [1, 1, T, T] that `CAUSAL` stands for (True = attend)."""
    columns = torch.arange(num_positions, device=device)
    return (columns[None, :] <= columns[:, None])[None, None]


def _bf16_many_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale: float):
    """`attention(bf16_many_rows=True)` on the bf16 kernel → [R, T, Nq * D], or None where it does not apply."""
    num_new, num_keys = query.shape[1], keys.shape[2]
    if not bf16_attention.applies(query, keys, values):
        return None
    if isinstance(mask, str):  # CAUSAL
        counts = bf16_attention.causal_key_counts(num_new, num_keys) if num_new == num_keys else None
    elif mask is None:
        counts = torch.full((1, num_new), num_keys, dtype=torch.int64)
    else:
        counts = bf16_attention.prefix_key_counts(mask) if mask.shape[-1] == num_keys else None
    if counts is None:
        return None
    return bf16_attention.bf16_attention(query, keys, values, counts, scale)


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    fp32_manual: bool = False,
    bf16_many_rows: bool = False,
    kv_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention: query [R, T, Nq, D]; keys, values [R, Nkv, S, D] → [R, T, Nq * D]. Query
    head h uses key head h // (Nq / Nkv), as transformers' `repeat_kv` does. One row at one position may
    come as query [Nq, D] (keys, values [1, Nkv, S, D]) → [Nq * D]. One position a row (T = 1) in fp32 or bf16
    on a CPU, with no mask or a bool one, runs on omnimtp's kernel (`small_batch_linear.decode_attention`: each
    key and value read once for its query heads, sums in fp32: fp32 SDPA's values up to fp32 rounding, bf16 ones
    rounded once at the end; 1.6-3.2x SDPA's speed at 64-4096 keys in fp32: `benchmarks/decode_attention.py`; a
    row's values the same alone and in any batch), the rest on SDPA.

    Default: SDPA, as transformers' "sdpa" attention runs it; mask [R or 1, 1, T, S], bool (True =
    attend) or additive, or None (every column visible), or `CAUSAL` (T = S > 1: SDPA's is_causal).
    fp32_manual: scores, softmax and the weighted sum written out in fp32 (as SDPA's CPU kernels compute
    them) whatever the dtype, with an additive mask [T, S] shared by the rows: plain matmuls that
    torch.compile fuses (the code predictor's compiled step).
    bf16_many_rows: several positions a row (T > 1) in fp32 with a mask of each query seeing keys 0..n-1 (None,
    `CAUSAL`, or a bool mask of that form: a causal one by cache position) run on omnimtp's bf16 kernel where it
    applies (`bf16_attention`: AVX512_BF16, bf16 products and fp32 sums, fp32 SDPA's values within bf16 rounding,
    each position's output the same bits whatever the other positions and rows); the rest as without it.
    kv_rows: None, or int64 [R] the row of keys and values [B, Nkv, S, D] each query row (T = 1) reads: several
    positions of one sequence, each its own query row with its own mask row, attend to its cache slot in place
    (`small_batch_linear.decode_attention`'s kv_rows; elsewhere the rows are gathered first)."""
    if kv_rows is not None:
        on_kernel, rows_mask = _decode_attention_mask(query[:, 0], keys, values, mask, kv_rows)
        if on_kernel and query.dim() == 4 and query.shape[1] == 1 and not fp32_manual:
            return small_batch_linear.decode_attention(query[:, 0], keys, values, scale, rows_mask, kv_rows)[:, None]
        keys, values = keys.index_select(0, kv_rows), values.index_select(0, kv_rows)
    if bf16_many_rows and query.dim() == 4 and query.shape[1] > 1 and not fp32_manual:
        out = _bf16_many_rows(query, keys, values, mask, scale)
        if out is not None:
            return out
    if query.dim() == 2:
        on_kernel, rows_mask = _decode_attention_mask(query[None], keys, values, mask)
        if on_kernel:
            return small_batch_linear.decode_attention(query, keys, values, scale, rows_mask)
        out = F.scaled_dot_product_attention(
            query.view(1, query.shape[0], 1, query.shape[1]), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [1, Nq, 1, D]
        return out.view(-1)
    num_rows, num_new, num_heads, head_dim = query.shape
    if isinstance(mask, str):  # CAUSAL
        if fp32_manual or num_new != keys.shape[2]:
            mask = causal_mask(num_new, query.device)
        else:
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2), keys, values, is_causal=True, scale=scale, enable_gqa=True
            )  # [R, Nq, T, D]
            return out.transpose(1, 2).reshape(num_rows, num_new, num_heads * head_dim)
    if num_new == 1 and not fp32_manual:  # one position a row: the kernel where it applies (as above)
        on_kernel, rows_mask = _decode_attention_mask(query[:, 0], keys, values, mask)
        if on_kernel:
            return small_batch_linear.decode_attention(query[:, 0], keys, values, scale, rows_mask)[:, None]
    if not fp32_manual:
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [R, Nq, T, D]
        return out.transpose(1, 2).reshape(num_rows, num_new, num_heads * head_dim)
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q = query.view(num_rows, num_new, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    q = q.reshape(num_rows, num_kv_heads, num_new * group, head_dim)  # rows ordered (t, g)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale  # [R, Nkv, T*g, S]
    scores = scores.view(num_rows, num_kv_heads, num_new, group, -1) + mask[:, None]
    probs = scores.softmax(dim=-1).view(num_rows, num_kv_heads, num_new * group, -1)
    out = torch.matmul(probs, values.float()).to(query.dtype)  # [R, Nkv, T*g, D]
    out = out.view(num_rows, num_kv_heads, num_new, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_rows, num_new, num_heads * head_dim)
