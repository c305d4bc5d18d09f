"""The "w8a8" convolution (`omnimtp.runtime.ops.conv2d`: each output position's patch a row quantized to int8 on its
own, the weight int8 per output channel, oneDNN's int8 GEMM): its patch rows are the unfolded input's rows quantized
as the w8a8 linear quantizes rows, it equals the matmul of the dequantized patches and weight up to fp32 rounding, a
position's values are the same alone, in any batch and any blocking, and Qwen3-ASR's int8_compute encoder runs its
480 -> 480 convolutions on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.ops import conv2d, many_row_mode_reason, quantize_conv_weight

needs_w8a8 = pytest.mark.skipif(many_row_mode_reason("cpu") is not None, reason=f"w8a8: {many_row_mode_reason('cpu')}")
needs_kernel = pytest.mark.skipif(not sbl.available(), reason="omnimtp's C kernel is not available")

RTOL = 1e-5  # fp32 rounding of an exact int32 sum times two scales, relative to sum_k |x_k w_k|
# (kernel, stride, padding): the encoder's 3 x 3 / 2 / 1, and an uneven one
GEOMETRIES = [((3, 3), (2, 2), (1, 1)), ((3, 2), (1, 2), (0, 1))]


def _unfolded_rows(x: torch.Tensor, kernel, stride, padding) -> torch.Tensor:
    """x [B, H, W, C] → the patch rows [B * Ho * Wo, kh * kw * C] in (i, j, c) order, by torch's unfold."""
    batch, _, _, channels = x.shape
    columns = F.unfold(x.float().permute(0, 3, 1, 2), kernel, padding=padding, stride=stride)  # [B, C*kh*kw, L]
    taps = kernel[0] * kernel[1]
    return columns.view(batch, channels, taps, -1).permute(0, 3, 2, 1).reshape(-1, taps * channels)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kernel", "stride", "padding"), GEOMETRIES)
def test_patch_rows_are_the_unfolded_rows_quantized(dtype, kernel, stride, padding):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 9, 7, 5, generator=g) * torch.rand(3, 9, 7, 1, generator=g) * 4).to(dtype)
    x[1, 2, 3] = 0.0
    x_before = x.clone()
    q, scales = sbl.quantize_patches_u8(x, kernel, stride, padding)
    expected_q, expected_scales = sbl.quantize_rows_u8(_unfolded_rows(x, kernel, stride, padding))
    assert torch.equal(q, expected_q) and torch.equal(scales, expected_scales)
    for row0, num_rows in ((0, 1), (7, 11), (q.shape[0] - 3, 3)):  # any range of rows, the same bytes
        part_q, part_scales = sbl.quantize_patches_u8(x, kernel, stride, padding, row0, num_rows)
        assert torch.equal(part_q, q[row0 : row0 + num_rows])
        assert torch.equal(part_scales, scales[row0 : row0 + num_rows])
    assert torch.equal(x, x_before)
    with pytest.raises(ValueError, match="outside"):
        sbl.quantize_patches_u8(x, kernel, stride, padding, q.shape[0] - 1, 2)
    with pytest.raises(ValueError, match="x must be"):
        sbl.quantize_patches_u8(x[0], kernel, stride, padding)


@needs_w8a8
@pytest.mark.parametrize(("kernel", "stride", "padding"), GEOMETRIES)
def test_equals_the_dequantized_convolution_and_is_close_to_the_float_one(kernel, stride, padding):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, 10, 24, generator=g)  # [B, H, W, C]
    weight = torch.randn(40, 24, *kernel, generator=g) * 0.05
    bias = torch.randn(40, generator=g)
    weight_before = weight.clone()
    q = quantize_conv_weight(weight, "w8a8")
    assert q.mode == "w8a8"
    out = conv2d(x, q, bias, kernel, stride, padding)
    exact = F.conv2d(x.permute(0, 3, 1, 2), weight, bias, stride, padding).permute(0, 2, 3, 1)
    assert out.shape == exact.shape and out.dtype == torch.float32
    rows_u8, row_scales = sbl.quantize_patches_u8(x, kernel, stride, padding)
    xd, wd = (rows_u8.float() - 128) * row_scales, q.dequantized()
    reference = (xd.double() @ wd.double().T + bias.double()).view(exact.shape)
    bound = (RTOL * (xd.abs() @ wd.abs().T).double() + 1e-6).view(exact.shape)
    assert ((out.double() - reference).abs() <= bound).all()
    # the weight in [O, kh, kw, C] order: within half a step of its channel's grid
    permuted = weight.permute(0, 2, 3, 1).reshape(40, -1)
    assert ((wd - permuted).abs() <= permuted.abs().amax(1, keepdim=True) / 127 / 2 * (1 + 1e-5)).all()
    assert (out - exact).norm() / exact.norm() < 0.02
    assert torch.equal(weight, weight_before)
    # bf16 in, bf16 out: the same sums rounded once
    out_bf16 = conv2d(x.bfloat16(), q, bias, kernel, stride, padding)
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, conv2d(x.bfloat16().float(), q, bias, kernel, stride, padding).bfloat16())


@needs_w8a8
def test_a_position_is_the_same_bits_alone_in_any_batch_and_any_blocking():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, 12, 32, generator=g).bfloat16() * torch.rand(5, 1, 1, 1, generator=g).bfloat16() * 8
    q = quantize_conv_weight(torch.randn(48, 32, 3, 3, generator=g) * 0.05, "w8a8")
    bias = torch.randn(48, generator=g)
    geometry = ((3, 3), (2, 2), (1, 1))
    batch = conv2d(x, q, bias, *geometry)
    for start, size in ((0, 1), (3, 1), (1, 3)):
        assert torch.equal(conv2d(x[start : start + size], q, bias, *geometry), batch[start : start + size])
    for block_rows in (1, 7, 48, 10_000):
        assert torch.equal(conv2d(x, q, bias, *geometry, block_rows=block_rows), batch)


def test_the_weight_is_checked_naming_the_argument():
    with pytest.raises(ValueError, match="mode"):
        quantize_conv_weight(torch.zeros(4, 4, 3, 3), "w4a8")
    with pytest.raises(ValueError, match="weight"):
        quantize_conv_weight(torch.zeros(4, 36), "w8a8")


@needs_w8a8
def test_int8_compute_encoder_runs_its_wide_convolutions_on_w8a8():
    """The tiny Qwen3-ASR encoder in int8_compute: the convolutions of many input channels are W8A8Conv2d (the
    first, of one channel, stays bf16 and hands them channels-last rows), each the w8a8 convolution of its bf16
    input with its GELU in the same pass and its output bf16, the first one's GELU applied by oneDNN (the fp32
    GELU rounded once to bf16), and the conv stack's rows are close to the float one's."""
    from omnimtp.models.qwen3_asr import Bf16Conv2d, W8A8Conv2d, fast_audio_encoder, tiny_qwen3_asr

    tower = tiny_qwen3_asr(0).thinker.audio_tower
    encoder = fast_audio_encoder(tower, "w8a8")
    assert isinstance(encoder.conv2d1, Bf16Conv2d)
    assert isinstance(encoder.conv2d2, W8A8Conv2d) and isinstance(encoder.conv2d3, W8A8Conv2d)
    assert isinstance(fast_audio_encoder(tower, "bf16").conv2d2, Bf16Conv2d)
    g = torch.Generator().manual_seed(3)
    chunks = torch.randn(3, 1, tower.config.num_mel_bins, 100, generator=g)
    with torch.no_grad():
        # the first convolution's rows channels last for the next (a zero second input channel), GELU'd once
        first = encoder.conv2d1(chunks)
        conv = tower.conv2d1
        assert first.is_contiguous(memory_format=torch.channels_last) and first.dtype == torch.bfloat16
        exact = F.gelu(F.conv2d(chunks.bfloat16().float(), conv.weight.bfloat16().float(),
                                conv.bias.bfloat16().float(), conv.stride, conv.padding))
        assert torch.allclose(first.float(), exact, rtol=2 ** -8, atol=1e-5)
        # the exact (erf) GELU of the fp32 sums, rounded once (the tanh approximation's bf16 values differ)
        assert (first == exact.bfloat16()).float().mean() > 0.995
        plain = Bf16Conv2d(conv)(chunks)
        assert not plain.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(plain, F.conv2d(chunks.bfloat16(), conv.weight.bfloat16(), conv.bias.bfloat16(),
                                           conv.stride, conv.padding))
        second = encoder.conv2d2(first)
        conv = tower.conv2d2
        expected = conv2d(first.permute(0, 2, 3, 1).contiguous(), encoder.conv2d2.quantized, conv.bias.float(),
                          conv.kernel_size, conv.stride, conv.padding, gelu=True)
        assert second.dtype == torch.bfloat16 and second.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(second.permute(0, 2, 3, 1), expected)
        fast_rows = encoder.conv2d3(second).float()
        exact_rows = F.gelu(tower.conv2d3(F.gelu(tower.conv2d2(F.gelu(tower.conv2d1(chunks))))))
    assert (fast_rows - exact_rows).norm() / exact_rows.norm() < 0.05


@needs_w8a8
def test_the_convolutions_gelu_is_applied_to_its_fp32_output_once():
    """conv2d(gelu=True): the exact GELU of the fp32 values conv2d(gelu=False) computes in fp32, rounded once to the
    input's dtype (fp32 here: within the GELU's 2e-6 of `F.gelu` of them), blocks or not."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 7, 6, generator=g)
    weight = quantize_conv_weight(torch.randn(5, 6, 3, 3, generator=g) * 0.3, "w8a8")
    bias = torch.randn(5, generator=g)
    plain = conv2d(x, weight, bias, (3, 3), (2, 2), (1, 1))
    for block_rows in (4096, 7):
        fused = conv2d(x, weight, bias, (3, 3), (2, 2), (1, 1), block_rows=block_rows, gelu=True)
        assert torch.allclose(fused, F.gelu(plain), rtol=0, atol=2e-6 * max(1.0, plain.abs().max().item()))
    assert not torch.allclose(fused, plain, atol=1e-2)
