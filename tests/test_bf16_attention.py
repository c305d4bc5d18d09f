"""The bf16 attention of many positions a row (`omnimtp.runtime.kernels.bf16_attention`): fp32 SDPA's values
within bf16 rounding for the masks a prompt's forward uses (causal, full, causal past a cache's earlier positions,
a different count a row), with grouped-query heads; each position's output the same bits alone as among others;
and a "w8a8" decoder (Qwen3-ASR's and the aligner's int8_compute) running its prompts' attention on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnimtp.runtime import ops
from omnimtp.runtime.kernels import bf16_attention as fa

pytestmark = pytest.mark.skipif(not fa.available(), reason=f"bf16 attention: {fa.unavailable_reason()}")

# bf16 inputs (8 significant bits) and probabilities: a relative error of a few 1e-3 over a head's output
TOLERANCE = 1e-2


def _sdpa(query, keys, values, counts, scale):
    """fp32 SDPA with the bool mask that counts [R or 1, T] stand for → [R, T, Nq * D]."""
    num_rows, num_new, num_heads, head_dim = query.shape
    mask = torch.arange(keys.shape[2])[None, None, :] < counts[:, :, None]  # [R or 1, T, S]
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(num_rows, num_new, num_heads * head_dim)


def _inputs(num_rows, num_new, num_heads, num_kv_heads, num_keys, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(num_rows, num_new, num_heads, head_dim, generator=generator)
    keys = torch.randn(num_rows, num_kv_heads, num_keys, head_dim, generator=generator)
    values = torch.randn(num_rows, num_kv_heads, num_keys, head_dim, generator=generator)
    return query, keys, values


def _relative_error(out, expected):
    return ((out - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize(
    ("shape", "mask"),
    [
        ((1, 150, 4, 2, 150, 128), "causal"),  # more than two key blocks, a register tile's remainder of rows
        ((1, 70, 8, 2, 70, 80), "full"),  # D: one tile of 64 columns and one of 16
        ((2, 37, 3, 3, 101, 16), "past"),  # no grouping; causal after 64 earlier positions
        ((2, 33, 16, 1, 33, 32), "rows"),  # a group of 16 heads; each row its own counts
    ],
)
def test_bf16_attention_is_fp32_sdpa_within_bf16_rounding(shape, mask):
    num_rows, num_new, num_heads, num_kv_heads, num_keys, head_dim = shape
    query, keys, values = _inputs(*shape)
    query, keys, values = 3 * query, 3 * keys, values  # peaked softmaxes: the running maximum moves
    if mask == "full":
        counts = torch.full((1, num_new), num_keys)
    elif mask == "rows":
        counts = torch.stack([torch.arange(1, num_new + 1), torch.randint(1, num_keys + 1, (num_new,))])
    else:
        counts = fa.causal_key_counts(num_new, num_keys)
    scale = head_dim ** -0.5
    out = fa.bf16_attention(query, keys, values, counts, scale)
    expected = _sdpa(query, keys, values, counts, scale)
    assert out.shape == expected.shape
    assert 1e-5 < _relative_error(out, expected) < TOLERANCE  # bf16's rounding, not fp32's
    # each query head reads its own key head: another pairing is far off
    swapped = _sdpa(query.flip(2), keys, values, counts, scale).view(num_rows, num_new, num_heads, head_dim).flip(2)
    if num_kv_heads > 1:
        assert _relative_error(out, swapped.reshape_as(out)) > 0.1


def test_a_positions_output_is_the_same_bits_alone_and_among_others_and_rows():
    query, keys, values = _inputs(2, 90, 4, 2, 90, 64, seed=1)
    counts = torch.stack([torch.arange(1, 91), torch.arange(1, 91).clamp(max=69)])  # row 1: its last keys padding
    together = fa.bf16_attention(query, keys, values, counts, 0.125)
    for row, position in [(0, 0), (0, 40), (0, 89), (1, 64), (1, 89)]:
        n = int(counts[row, position])
        alone = fa.bf16_attention(
            query[row:row + 1, position:position + 1], keys[row:row + 1, :, :n], values[row:row + 1, :, :n],
            torch.tensor([[n]]), 0.125,
        )
        assert torch.equal(alone[0, 0], together[row, position])
    one_row = fa.bf16_attention(query[1:], keys[1:], values[1:], counts[1:], 0.125)
    assert torch.equal(one_row[0], together[1])
    # keys past every count are never read: other values there change nothing
    keys[1, :, 69:] = 1e4
    values[1, :, 69:] = float("nan")
    assert torch.equal(fa.bf16_attention(query, keys, values, counts, 0.125), together)


def test_strided_queries_and_cache_views_are_read_where_they_are():
    qkv = torch.randn(1, 40, 6 + 2 * 2, 32)  # a fused projection's view: queries, keys, values side by side
    query = qkv[:, :, :6]
    cache = torch.randn(2, 1, 2, 64, 32)[:, :, :, :40]  # [keys/values, R, Nkv, capacity → S, D]
    counts = fa.causal_key_counts(40, 40)
    out = fa.bf16_attention(query, cache[0], cache[1], counts, 0.2)
    assert torch.equal(out, fa.bf16_attention(query.contiguous(), cache[0].contiguous(), cache[1].contiguous(),
                                              counts, 0.2))


def test_key_counts_and_tensors_out_of_range_are_value_errors():
    query, keys, values = _inputs(1, 4, 2, 1, 4, 16)
    with pytest.raises(ValueError, match="key_counts"):
        fa.bf16_attention(query, keys, values, torch.tensor([[1, 2, 0, 4]]), 1.0)
    with pytest.raises(ValueError, match="key_counts"):
        fa.bf16_attention(query, keys, values, torch.tensor([[1, 2, 3, 5]]), 1.0)
    with pytest.raises(ValueError, match="key_counts"):
        fa.bf16_attention(query, keys, values, torch.tensor([[1, 2, 3]]), 1.0)
    with pytest.raises(ValueError, match="D a multiple of 16"):
        fa.bf16_attention(query[..., :8], keys[..., :8], values[..., :8], torch.tensor([[1, 2, 3, 4]]), 1.0)
    with pytest.raises(ValueError, match="fp32"):
        fa.bf16_attention(query.bfloat16(), keys.bfloat16(), values.bfloat16(), torch.tensor([[1, 2, 3, 4]]), 1.0)


def test_prefix_key_counts_reads_causal_masks_and_refuses_others():
    causal = ops.causal_mask(5, "cpu")  # [1, 1, 5, 5]
    assert torch.equal(fa.prefix_key_counts(causal), torch.tensor([[1, 2, 3, 4, 5]]))
    past = torch.arange(8)[None, None, None, :] <= torch.tensor([[3, 4], [6, 7]])[:, None, :, None]  # [2, 1, 2, 8]
    assert torch.equal(fa.prefix_key_counts(past), torch.tensor([[4, 5], [7, 8]]))
    holes = causal.clone()
    holes[0, 0, 4, 1] = False
    assert fa.prefix_key_counts(holes) is None
    empty = causal.clone()
    empty[0, 0, 0, 0] = False
    assert fa.prefix_key_counts(empty) is None
    assert fa.prefix_key_counts(torch.zeros(1, 1, 5, 5)) is None  # additive


def test_attention_runs_many_rows_on_the_kernel_only_when_asked_and_where_it_applies():
    query, keys, values = _inputs(1, 50, 4, 2, 50, 32, seed=2)
    counts = fa.causal_key_counts(50, 50)
    kernel = fa.bf16_attention(query, keys, values, counts, 0.2)
    sdpa = ops.attention(query, keys, values, ops.CAUSAL, 0.2)
    assert torch.equal(ops.attention(query, keys, values, ops.CAUSAL, 0.2, bf16_many_rows=True), kernel)
    assert torch.equal(ops.attention(query, keys, values, ops.causal_mask(50, "cpu"), 0.2, bf16_many_rows=True),
                       kernel)
    assert not torch.equal(sdpa, kernel)
    holes = ops.causal_mask(50, "cpu").clone()
    holes[..., 30, 3] = False  # not of the kernel's form: SDPA
    assert torch.equal(ops.attention(query, keys, values, holes, 0.2, bf16_many_rows=True),
                       ops.attention(query, keys, values, holes, 0.2))
    full = ops.attention(query, keys, values, None, 0.2, bf16_many_rows=True)
    assert torch.equal(full, fa.bf16_attention(query, keys, values, torch.full((1, 50), 50), 0.2))
    bf16 = [t.bfloat16() for t in (query, keys, values)]  # the kernel is fp32 only: SDPA
    assert torch.equal(ops.attention(*bf16, ops.CAUSAL, 0.2, bf16_many_rows=True),
                       ops.attention(*bf16, ops.CAUSAL, 0.2))


def test_a_w8a8_decoders_prompt_runs_its_attention_on_the_kernel(monkeypatch):
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward

    if ops.many_row_mode_reason("cpu") is not None:
        pytest.skip(f"w8a8: {ops.many_row_mode_reason('cpu')}")
    model = Qwen3ASRFamily.tiny(0).model.thinker.model
    calls = []
    original = fa.bf16_attention

    def counting(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(fa, "bf16_attention", counting)
    embeds = torch.randn(1, 24, model.config.hidden_size) * 0.1
    for quantize, expected in [("w8a8", 1), ("int8", 0), (None, 0)]:
        decoder = PackedDecoder.from_module(model, quantize=quantize)
        calls.clear()
        cache = KVCache(decoder, 1, capacity=40)
        decoder_forward(decoder, cache, embeds, [0])  # a prompt: causal
        decoder_forward(decoder, cache, embeds[:, :5], [0])  # a block after it: causal past 24 positions
        decoder_forward(decoder, cache, embeds[:, :1], [0])  # a step: one position, not this kernel
        assert len(calls) == 2 * decoder.num_layers * expected, quantize
