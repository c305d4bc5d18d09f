"""The fused passes of a "w8a8" decoder layer of many rows (`omnimtp.runtime.kernels.w8a8_epilogues`): each equals the
torch ops it replaces up to the order of a row's sums (quantized bytes at most one step apart, on a rounding edge,
and rarely), a row's values are the same alone and in any batch, and the fused layer keeps the decoder's results:
a forward within the unfused one's values, the aligner's timestamps and Qwen3-ASR's greedy tokens on the tiny models
unchanged, decode steps and other modes untouched."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from asr_checks import speechlike

from omnimtp.packed_decoder import decoder_forward
from omnimtp.runtime.decoder import PackedDecoder, fuses_w8a8
from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.kernels import w8a8_epilogues as epilogues
from omnimtp.runtime.ops import Rope, apply_rope, many_row_mode_reason, rms_norm

pytestmark = pytest.mark.skipif(
    many_row_mode_reason("cpu") is not None or not epilogues.available(),
    reason=f"w8a8: {many_row_mode_reason('cpu') or epilogues.unavailable_reason()}",
)

EPS = 1e-6
RTOL = 2e-6  # a few fp32 roundings of a row's sum of squares in another order (or of an exp within an ulp)
MAX_FLIPPED = 1e-4  # the share of quantized bytes one step apart: values within RTOL of a rounding edge


def _rows_close(q: torch.Tensor, scales: torch.Tensor, q_ref: torch.Tensor, scales_ref: torch.Tensor) -> None:
    flips = (q.int() - q_ref.int()).abs()
    assert flips.max() <= 1 and flips.count_nonzero() <= MAX_FLIPPED * q.numel() + 1, flips.count_nonzero()
    torch.testing.assert_close(scales, scales_ref, rtol=RTOL, atol=0)


@pytest.mark.parametrize(("rows", "width"), [(5, 64), (37, 100), (300, 1024)])
def test_residual_norm_is_scale_bias_residual_then_rms_norm_and_the_rows_quantization(rows, width):
    g = torch.Generator().manual_seed(width)
    sums, residual = torch.randn(rows, width, generator=g) * 40, torch.randn(rows, width, generator=g)
    row_scales, bias = torch.rand(rows, 1, generator=g) * 0.01 + 1e-3, torch.randn(width, generator=g)
    weight = torch.randn(width, generator=g)
    expected = residual + (sums * row_scales + bias)
    q_ref, scales_ref = sbl.quantize_rows_u8(rms_norm(expected, weight, EPS))
    x, (q, scales) = epilogues.residual_norm(sums, row_scales, bias, residual, weight, EPS)
    assert x.data_ptr() == sums.data_ptr() and torch.equal(x, expected)  # no sum here: the same bits
    _rows_close(q, scales, q_ref, scales_ref)
    # a layer's first pass: x's rows normed and quantized, x left as it is
    before = residual.clone()
    same, (q, scales) = epilogues.residual_norm(residual, None, None, None, weight, EPS)
    assert torch.equal(same, before)
    _rows_close(q, scales, *sbl.quantize_rows_u8(rms_norm(before, weight, EPS)))
    # the last layer's: no norm, no rows
    x, none = epilogues.residual_norm(torch.ones(rows, width), row_scales, None, residual, None, EPS)
    assert none is None and torch.equal(x, residual + row_scales.expand(rows, width))


@pytest.mark.parametrize(("rows", "hidden"), [(5, 48), (37, 100), (300, 3072)])
def test_gated_is_silu_of_the_scaled_gate_times_the_scaled_up_then_quantized(rows, hidden):
    g = torch.Generator().manual_seed(hidden)
    sums, row_scales = torch.randn(rows, 2 * hidden, generator=g) * 300, torch.rand(rows, 1, generator=g) * 0.02
    sums[0, :3] = torch.tensor([-1e6, 1e6, 0.0])  # silu far out on both sides, and at 0
    gate, up = (sums * row_scales).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    q, scales = epilogues.gated(sums, row_scales)
    torch.testing.assert_close(sums[:, :hidden], expected, rtol=RTOL, atol=1e-30)  # the gate half holds h
    _rows_close(q, scales, *sbl.quantize_rows_u8(expected))


def _rope(head_dim: int, rotary_dim: int) -> Rope:
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    source = None
    if rotary_dim < head_dim:
        channels = torch.arange(head_dim)
        half = rotary_dim // 2
        source = torch.where(channels < rotary_dim, (channels + half) % rotary_dim, channels)
    return Rope(inv_freq, 1.0, head_dim, source=source)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "rotary_dim", "rows", "positions", "with_norm"), [
    (4, 2, 16, 16, 2, 9, True),  # tiny, two rows of their own positions
    (4, 2, 32, 16, 1, 7, False),  # partial rotary, a bias and no q/k norm (Qwen2.5's layout)
    (16, 8, 128, 128, 1, 300, True),  # the released Qwen3-ASR / aligner widths
])
def test_attention_inputs_are_scaled_normed_per_head_and_rotated(num_heads, num_kv_heads, head_dim, rotary_dim, rows,
                                                                 positions, with_norm):
    g = torch.Generator().manual_seed(head_dim + rows)
    num_all = num_heads + 2 * num_kv_heads
    sums = torch.randn(rows, positions, num_all, head_dim, generator=g) * 50
    row_scales = torch.rand(rows * positions, 1, generator=g) * 0.05
    bias = None if with_norm else torch.randn(num_all * head_dim, generator=g)
    qk_norm = torch.randn(num_heads + num_kv_heads, head_dim, generator=g) if with_norm else None
    rope = _rope(head_dim, rotary_dim)
    position_ids = torch.arange(positions).expand(rows, -1) + torch.arange(rows)[:, None] * 3
    cos, signed_sin = rope.tables(position_ids, torch.float32)
    scaled = (sums.view(rows * positions, -1) * row_scales).view_as(sums)
    if bias is not None:
        scaled = scaled + bias.view(num_all, head_dim)
    qk = scaled[..., : num_heads + num_kv_heads, :]
    if qk_norm is not None:
        qk = rms_norm(qk, qk_norm, EPS)
    expected_qk = apply_rope(qk, cos, signed_sin, rope.source)
    partner = rope.source if rope.source is not None else torch.arange(head_dim).roll(head_dim // 2)
    out = epilogues.attention_inputs(sums, row_scales, bias, qk_norm, EPS, cos, signed_sin, partner, num_heads,
                                     num_kv_heads)
    assert out.data_ptr() == sums.data_ptr()
    torch.testing.assert_close(out[..., : num_heads + num_kv_heads, :], expected_qk, rtol=RTOL,
                               atol=RTOL * float(expected_qk.abs().max()))
    assert torch.equal(out[..., num_heads + num_kv_heads:, :], scaled[..., num_heads + num_kv_heads:, :])


def test_a_rows_values_are_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(5)
    sums, row_scales = torch.randn(40, 96, generator=g), torch.rand(40, 1, generator=g)
    residual, weight = torch.randn(40, 96, generator=g), torch.randn(96, generator=g)
    x, (q, scales) = epilogues.residual_norm(sums.clone(), row_scales, None, residual, weight, EPS)
    h = sums.clone()
    hq, hs = epilogues.gated(h, row_scales)
    for start, size in ((0, 1), (7, 1), (3, 5), (20, 20)):
        rows = slice(start, start + size)
        x1, (q1, s1) = epilogues.residual_norm(sums[rows].clone(), row_scales[rows], None, residual[rows], weight, EPS)
        assert torch.equal(x1, x[rows]) and torch.equal(q1, q[rows]) and torch.equal(s1, scales[rows])
        h1 = sums[rows].clone()
        q1, s1 = epilogues.gated(h1, row_scales[rows])
        assert torch.equal(q1, hq[rows]) and torch.equal(s1, hs[rows])
        assert torch.equal(h1, h[rows])


def test_bad_tensors_are_refused_naming_them():
    with pytest.raises(ValueError, match="row_scales"):
        epilogues.residual_norm(torch.zeros(4, 8), torch.zeros(3, 1), None, None, None, EPS)
    with pytest.raises(ValueError, match="sums"):
        epilogues.gated(torch.zeros(4, 7), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="norm_weight"):
        epilogues.residual_norm(torch.zeros(4, 8), None, None, None, torch.zeros(8, dtype=torch.float64), EPS)


# --- the fused layer in the decoder --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aligners():
    from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner

    aligner = Qwen3ForcedAligner.tiny(0)
    fast = Qwen3ForcedAligner(aligner.model, aligner.tokenizer, int8_compute=True)
    slow = Qwen3ForcedAligner(aligner.model, aligner.tokenizer, int8_compute=True)
    slow.decoder = replace(slow.decoder, fused_w8a8=False)
    return fast, slow


def test_the_tiny_aligners_forward_and_timestamps_equal_the_unfused_ones(aligners):
    fast, slow = aligners
    decoder = fast.decoder
    x = torch.randn(2, 57, decoder.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert fuses_w8a8(decoder, decoder.layers[0], x, decoder.quantized_layers[0])
        assert not fuses_w8a8(slow.decoder, decoder.layers[0], x, decoder.quantized_layers[0])
        fused = decoder_forward(decoder, None, x, None, capture_layer=1, all_final=True)
        unfused = decoder_forward(slow.decoder, None, x, None, capture_layer=1, all_final=True)
    torch.testing.assert_close(fused.final, unfused.final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.captured, unfused.captured, rtol=1e-5, atol=1e-5)
    for seconds, seed, text in ((2.5, 3, "one two three four five six"), (1.4, 4, "Bonjour à tous, ça va?")):
        samples = speechlike(seconds, seed)
        words = fast.align(samples, text, "en")
        assert words == slow.align(samples, text, "en")
        assert len({w.start for w in words}) > 1


def test_a_released_width_layer_stays_within_the_unfused_ones_quantization_noise():
    """At the released widths (hidden 1024, 16 / 8 heads of 128, MLP 3072) two layers' rows differ from the unfused
    ones only where an input byte flipped on a rounding edge (and the bf16 attention rounded that on): well within
    the int8 rounding both carry against the float layers. The norms' weights are random (each layer its own)."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, num_hidden_layers=2, vocab_size=16)
    module = Qwen3Model(config).eval()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.2, 2.0)
    fused = PackedDecoder.from_module(module, quantize="w8a8")
    unfused, exact = replace(fused, fused_w8a8=False), PackedDecoder.from_module(module)
    x = torch.randn(1, 200, 1024, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, ref, float_out = (decoder_forward(d, None, x, None, all_final=True).final for d in (fused, unfused, exact))
    noise = (ref - float_out).norm()
    assert 0 < (out - ref).norm() < 0.3 * noise and (out - float_out).norm() < 1.1 * noise


def test_decode_steps_and_other_modes_stay_on_the_torch_ops(aligners):
    fast, _ = aligners
    decoder = fast.decoder
    layer, packed = decoder.layers[0], decoder.quantized_layers[0]
    one = torch.randn(3, 1, decoder.hidden_size)
    assert not fuses_w8a8(decoder, layer, one, packed)  # one position a row
    w4a8 = PackedDecoder.from_module(fast.model.thinker.model, quantize="w4a8")
    assert not fuses_w8a8(w4a8, w4a8.layers[0], torch.randn(1, 9, decoder.hidden_size), w4a8.quantized_layers[0])


def test_the_last_layer_on_the_wanted_positions_alone_gives_their_rows_of_the_whole_forward(aligners):
    """output_index: the last layer's queries, o and MLP on those positions only (the aligner's timestamp positions),
    each the same bits as its row of the forward over every position (fused or not)."""
    for decoder in (aligner.decoder for aligner in aligners):
        x = torch.randn(2, 40, decoder.hidden_size, generator=torch.Generator().manual_seed(2))
        wanted = torch.tensor([[0, 5, 6, 39], [3, 4, 20, 21]])
        with torch.no_grad():
            whole = decoder_forward(decoder, None, x, None, all_final=True)
            some = decoder_forward(decoder, None, x, None, all_final=True, output_index=wanted)
        assert torch.equal(some.final, whole.final[torch.arange(2)[:, None], wanted])
        assert torch.equal(some.last_hidden, some.final[:, -1])
    with pytest.raises(ValueError, match="output_index"):
        decoder_forward(decoder, None, x, None, output_index=wanted[0])


def test_qwen3_asr_greedy_tokens_with_int8_compute_equal_the_unfused_ones():
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily

    family = Qwen3ASRFamily.tiny(0)
    fast = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8", int8_compute=True)
    slow = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8", int8_compute=True)
    slow.prefill_decoder = replace(slow.prefill_decoder, fused_w8a8=False)
    for seconds, seed in ((2.0, 4), (1.2, 8)):
        ids, media = fast.transcription_inputs(speechlike(seconds, seed), None, "")
        runs = [f.new_thinker([ids], [None], [None], 12, media=[media]) for f in (fast, slow)]
        tokens = []
        for run in runs:
            while any(reason is None for reason in run.finish_reasons):
                run.step()
            tokens.append(run.output_ids[0])
        assert tokens[0] == tokens[1] and len(tokens[0]) > 1
