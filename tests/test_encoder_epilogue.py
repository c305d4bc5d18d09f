"""The int8_compute audio encoder's fused pieces: the int8 GEMM's output pass (`encoder_epilogue`: row scale, bias,
the exact GELU, fp32 or bf16 out, in one pass), the windows' attention on the bf16 kernel (`EncoderAttention`: each
window alone, a shorter last window by its key counts), and the encoder built of them (`W8A8AudioEncoder`) against
the float tower and the unfused int8 one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnimtp.runtime.kernels import bf16_attention, encoder_epilogue
from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.ops import many_row_mode_reason, quantize_weight, w8a8_linear, w8a8_linear_epilogue

needs_epilogue = pytest.mark.skipif(not encoder_epilogue.available(), reason=f"{encoder_epilogue.unavailable_reason()}")
needs_w8a8 = pytest.mark.skipif(many_row_mode_reason("cpu") is not None, reason=f"w8a8: {many_row_mode_reason('cpu')}")
needs_bf16_attention = pytest.mark.skipif(not bf16_attention.available(),
                                          reason=f"{bf16_attention.unavailable_reason()}")

GELU_ATOL = 2e-6  # the fused GELU against float64's exact one, times max(1, |x|)


def _exact_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x.double())


@needs_epilogue
def test_epilogue_scales_rows_adds_the_bias_and_applies_the_exact_gelu_in_one_pass():
    g = torch.Generator().manual_seed(0)
    sums = torch.randn(37, 100, generator=g) * 4  # 100 columns: a 4-lane tail after 6 registers
    sums[3, 5] = 0.0
    row_scales, bias = torch.rand(37, 1, generator=g) + 0.1, torch.randn(100, generator=g)
    before = sums.clone()
    linear = torch.empty_like(sums)
    encoder_epilogue.scale_bias_gelu(sums, row_scales, bias, False, linear)
    assert torch.equal(sums, before)
    assert torch.equal(linear, sums * row_scales + bias)  # torch's mul then add, bit for bit (no FMA)
    assert torch.equal(encoder_epilogue.scale_bias_gelu(sums, row_scales, None, False, torch.empty_like(sums)),
                       sums * row_scales)
    gelu = encoder_epilogue.scale_bias_gelu(sums, row_scales, bias, True, torch.empty_like(sums))
    bound = GELU_ATOL * linear.abs().clamp(min=1).double()
    assert ((gelu.double() - _exact_gelu(linear)).abs() <= bound).all()
    assert ((F.gelu(linear).double() - _exact_gelu(linear)).abs() <= bound).all()  # torch's own, same bound
    # bf16 out: the fp32 result rounded once, into every other row of a wider buffer (strided rows)
    wide = torch.zeros(37, 2, 128, dtype=torch.bfloat16)
    encoder_epilogue.scale_bias_gelu(sums, row_scales, bias, True, wide[:, 1, :100])
    assert torch.equal(wide[:, 1, :100], gelu.to(torch.bfloat16))
    assert not wide[:, 0].any() and not wide[:, 1, 100:].any()
    # in place, and each row alone the same bits as among the others
    in_place = sums.clone()
    encoder_epilogue.scale_bias_gelu(in_place, row_scales, bias, True, in_place)
    assert torch.equal(in_place, gelu)
    for row in (0, 20, 36):
        alone = encoder_epilogue.scale_bias_gelu(sums[row:row + 1], row_scales[row:row + 1], bias, True,
                                                 torch.empty(1, 100))
        assert torch.equal(alone[0], gelu[row])


@needs_epilogue
def test_epilogue_gelu_at_the_edges_and_bad_arguments():
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -10.0, 10.0, 1e-40, -3.0, 3.0]])
    out = encoder_epilogue.scale_bias_gelu(x, torch.ones(1, 1), None, True, torch.empty_like(x))
    assert out[0, :3].isnan().all() and F.gelu(x[0, :3]).isnan().all()  # NaN and infinities: NaN, as torch's
    assert out[0, 3] == 0 and out[0, 5] == 0 and out[0, 6] == 10.0
    assert torch.allclose(out[0, 8:].double(), _exact_gelu(x[0, 8:]), rtol=0, atol=1e-6)
    bf16 = encoder_epilogue.scale_bias_gelu(x, torch.ones(1, 1), None, True, torch.empty(1, 10, dtype=torch.bfloat16))
    assert bf16[0, 0].isnan() and torch.equal(bf16[0, 3:], out[0, 3:].to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        encoder_epilogue.scale_bias_gelu(x, torch.ones(1, 1), torch.zeros(3), False, torch.empty_like(x))
    with pytest.raises(ValueError, match="row_scales"):
        encoder_epilogue.scale_bias_gelu(x, torch.ones(2, 1), None, False, torch.empty_like(x))
    with pytest.raises(ValueError, match="out"):
        encoder_epilogue.scale_bias_gelu(x, torch.ones(1, 1), None, False, torch.empty(1, 10, dtype=torch.float16))


@needs_epilogue
@pytest.mark.parametrize("num_columns", [4096, 100, 7])
def test_epilogue_quantized_out_is_the_row_quantizer_of_its_fp32_rows(num_columns):
    """The u8 output (the next int8 GEMM's input): the bytes and scales `quantize_rows_u8` makes of the fp32 rows the
    pass would write, a NaN row's 128s and NaN scale included; a row the same alone as among the others."""
    g = torch.Generator().manual_seed(num_columns)
    sums = torch.randn(21, num_columns, generator=g) * 3
    sums[4, 2] = float("nan")
    row_scales, bias = torch.rand(21, 1, generator=g) + 0.1, torch.randn(num_columns, generator=g)
    for gelu in (True, False):
        rows = encoder_epilogue.scale_bias_gelu(sums, row_scales, bias, gelu, torch.empty_like(sums))
        expected_q, expected_scales = sbl.quantize_rows_u8(rows)
        q, scales = encoder_epilogue.scale_bias_gelu_u8(sums, row_scales, bias, gelu)
        assert torch.equal(q, expected_q) and torch.equal(scales.nan_to_num(-1), expected_scales.nan_to_num(-1))
        assert scales[4].isnan() and (q[4] == 128).all() and (q[5] != 128).any()
        alone_q, alone_scales = encoder_epilogue.scale_bias_gelu_u8(sums[7:8], row_scales[7:8], bias, gelu)
        assert torch.equal(alone_q[0], q[7]) and torch.equal(alone_scales[0], scales[7])


@needs_w8a8
def test_w8a8_linear_epilogue_is_the_w8a8_linear_plus_its_bias_then_gelu():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(13, 96, generator=g), quantize_weight(torch.randn(80, 96, generator=g) * 0.1, "w8a8")
    bias = torch.randn(80, generator=g)
    plain = w8a8_linear(x, weight).add_(bias)
    assert torch.equal(w8a8_linear_epilogue(x, weight, bias), plain)
    fused = w8a8_linear_epilogue(x, weight, bias, gelu=True)
    assert ((fused.double() - _exact_gelu(plain)).abs() <= GELU_ATOL * plain.abs().clamp(min=1).double()).all()
    out = torch.empty(13, 80, dtype=torch.bfloat16)
    assert w8a8_linear_epilogue(x, weight, bias, gelu=True, out=out) is out
    assert torch.equal(out, fused.to(torch.bfloat16))


@needs_w8a8
def test_conv_out_reads_the_channels_last_rows_with_the_linears_bits():
    """`W8A8ConvOut` on the last convolution's channels-last bf16 rows [B, C, F, T]: bit for bit the "w8a8" linear of
    the rows flattened channel by channel (the reference's transpose and view) in fp32."""
    from omnimtp.models.qwen3_asr import EncoderLinear, W8A8ConvOut

    g = torch.Generator().manual_seed(2)
    module = torch.nn.Linear(6 * 5, 24)
    with torch.no_grad():
        module.weight.copy_(torch.randn(24, 30, generator=g) * 0.2)
        module.bias.copy_(torch.randn(24, generator=g))
    rows = torch.randn(3, 6, 5, 7, generator=g).bfloat16().contiguous(memory_format=torch.channels_last)
    b, c, f, t = rows.shape
    expected = EncoderLinear(module, "w8a8")(rows.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
    out = W8A8ConvOut(module, channels=6)(rows)
    assert out.dtype == torch.float32 and torch.equal(out, expected)


# --- the encoder's attention and the encoder ------------------------------------------------------------------


def _tower(seed: int = 3, heads: int = 4, width: int = 64):
    """A tiny Qwen3-ASR audio tower with nonzero biases; 16-wide heads (the bf16 kernel takes multiples of 16)."""
    from omnimtp.models.qwen3_asr import tiny_qwen3_asr

    tower = tiny_qwen3_asr(seed, audio=dict(d_model=width, encoder_attention_heads=heads,
                                            encoder_ffn_dim=2 * width)).thinker.audio_tower
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in tower.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.5)
    return tower


def _windows_on_sdpa(attention, module, rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The attention of `module` (transformers' layer attention) with q/k/v from the same int8 GEMM as `attention`,
    each window on fp32 SDPA, before out_proj: [N, E]."""
    qkv = w8a8_linear_epilogue(rows, attention.qkv, attention.qkv_bias)
    q, k, v = (part.view(-1, attention.num_heads, attention.head_dim).transpose(0, 1)
               for part in qkv.split(rows.shape[1], dim=1))
    windows = [F.scaled_dot_product_attention(*parts, scale=module.scaling)
               for parts in zip(*(t.split(lengths, dim=1) for t in (q, k, v)), strict=True)]
    return torch.cat(windows, dim=1).transpose(0, 1).reshape(rows.shape)


@needs_w8a8
@needs_bf16_attention
def test_encoder_attention_runs_each_window_alone_on_the_bf16_kernel():
    """Windows of 24 rows then a last one of 10 (one audio), and uneven ones (two audios): fp32 SDPA's values window
    by window within bf16 rounding; a window's rows the same bits whatever the other windows' rows; the last,
    shorter window the same bits alone as after the others."""
    from omnimtp.models.qwen3_asr import EncoderAttention

    tower = _tower()
    module = tower.layers[0].self_attn
    attention = EncoderAttention(module)
    assert attention.on_kernel()
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(58, 64, generator=g)
    captured = []
    attention.out_proj.register_forward_hook(lambda _, args, __: captured.append(args[0]))
    for lengths in ([24, 24, 10], [24, 10, 24]):
        cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
        with torch.no_grad():
            out = attention(rows, cu_seqlens)
            exact = _windows_on_sdpa(attention, module, rows, lengths)
        assert out.shape == rows.shape
        error = ((captured[-1] - exact).norm() / exact.norm()).item()
        assert 0 < error < 5e-3, (lengths, error)
    with torch.no_grad():
        out = attention(rows, torch.tensor([0, 24, 48, 58]))
        changed = rows.clone()
        changed[:24] = torch.randn(24, 64, generator=g)
        other = attention(changed, torch.tensor([0, 24, 48, 58]))
        assert torch.equal(other[24:], out[24:]) and not torch.equal(other[:24], out[:24])
        assert torch.equal(attention(rows[48:], torch.tensor([0, 10])), out[48:])


@needs_w8a8
def test_w8a8_encoder_is_close_to_the_float_tower_and_to_the_unfused_int8_one():
    """`fast_audio_encoder(tower, "w8a8")` (GELUs fused, the windows on the bf16 kernel where it runs) on 2030
    frames (windows of 104 rows, then 56): within 5 % of the float tower's rows, and its error not materially
    above the unfused int8 encoder's (the same int8 GEMMs, transformers' forward with torch's GELU and SDPA)."""
    import copy

    from omnimtp.models.qwen3_asr import (
        Bf16Conv2d,
        EncoderLinear,
        W8A8AudioEncoder,
        W8A8Conv2d,
        encode_audio,
        fast_audio_encoder,
    )
    from omnimtp.runtime.ops import linear

    tower = _tower()
    encoder = fast_audio_encoder(tower, "w8a8")
    assert isinstance(encoder, W8A8AudioEncoder)
    assert encoder.layers[0].fc1.gelu and encoder.proj1.gelu and not encoder.layers[0].fc2.gelu
    assert isinstance(encoder.layers[0].fc1, EncoderLinear) and encoder.layers[0].fc1.quantized.mode == "w8a8"

    class Unfused(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.quantized, self.bias = quantize_weight(module.weight.detach().float(), "w8a8"), module.bias

        def forward(self, x):
            return linear(x.float(), None, self.bias, packed=self.quantized)

    unfused = copy.deepcopy(tower)
    for name, module in tower.named_modules():
        parent_name, _, child = name.rpartition(".")
        parent = unfused.get_submodule(parent_name) if parent_name else unfused
        if isinstance(module, torch.nn.Linear):
            setattr(parent, child, Unfused(module))
        elif isinstance(module, torch.nn.Conv2d):
            setattr(parent, child, W8A8Conv2d(module) if module.in_channels > 1 else Bf16Conv2d(module, True))
    g = torch.Generator().manual_seed(8)
    features = torch.randn(1, tower.config.num_mel_bins, 2030, generator=g)
    mask = torch.ones(1, 2030, dtype=torch.long)
    with torch.no_grad():
        exact = encode_audio(tower, features, mask).last_hidden_state
        fused = encode_audio(encoder, features, mask).last_hidden_state
        before = encode_audio(unfused, features, mask).last_hidden_state
        again = encode_audio(tower, features, mask).last_hidden_state
    assert torch.equal(again, exact)  # the tower is not modified
    assert fused.shape == exact.shape == (264, tower.config.output_dim)

    def error(rows):
        return ((rows - exact).norm() / exact.norm()).item()

    assert 0 < error(fused) < 0.05 and error(fused) < 1.25 * error(before), (error(fused), error(before))
    # fc1 → fc2 and proj1 → proj2 hand their rows over quantized: the bits of writing them in fp32 and quantizing
    handing = [encoder.proj1, *(layer.fc1 for layer in encoder.layers)]
    assert all(module.quantize_out for module in handing)
    for module in handing:
        module.quantize_out = False
    with torch.no_grad():
        assert torch.equal(encode_audio(encoder, features, mask).last_hidden_state, fused)
