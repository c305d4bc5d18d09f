"""Quantized linears on omnimtp's CPU kernel (weight-only int8 per channel and int4 per channel and group; int4
weights with int8 activations per row and group, "w4a8"): the kernel equals the matmul by the dequantized weight
(and, in w4a8, input), the quantization error is what its grid allows, a row's values do not depend on the other
rows, the packed decoder runs quantized, and bad modes are refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import openai
import pytest
import torch
from audio_checks import assert_audible
from hypothesis import given, settings
from hypothesis import strategies as st
from server_harness import running_server
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

from omnimtp.models.tiny import tiny_code_predictor_config
from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.runtime import decoder as decoder_module
from omnimtp.runtime.kernels import small_batch_linear as sbl
from omnimtp.runtime.ops import INT4_GROUP_SIZE, QUANTIZE_MODES, check_quantize, linear, quantize_weight

needs_kernel = pytest.mark.skipif(not sbl.available(), reason=f"kernel unavailable: {sbl.unavailable_reason()}")

# The kernel sums in fp32 in k order, scaling per output (int8) or per group (int4): it equals x @ dequantized.T
# up to fp32 rounding, i.e. relative to sum_k |x_k w_k| ≈ |x| |w| (the bound below, with headroom).
RTOL = 1e-5


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 16), num_groups=st.integers(1, 4), group_size=st.sampled_from([16, 32, 64, 128]),
    out_features=st.integers(1, 80), mode=st.sampled_from(QUANTIZE_MODES), seed=st.integers(0, 99),
)
def test_equals_dequantized_matmul(rows, num_groups, group_size, out_features, mode, seed):
    in_features = num_groups * group_size
    g = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    x_before, weight_before = x.clone(), weight.clone()
    q = quantize_weight(weight, mode, group_size)
    out = linear(x, weight, packed=q)
    xd = q.dequantized_input(x)
    reference = xd @ q.dequantized().T
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    bound = RTOL * (xd.abs() @ q.dequantized().abs().T) + 1e-6
    assert ((out - reference).abs() <= bound).all()
    assert torch.equal(x, x_before) and torch.equal(weight, weight_before)
    # quantization error within half a grid step per weight
    step = q.dequantized() - weight
    if mode == "int8":
        assert (step.abs() <= weight.abs().amax(1, keepdim=True) / 127 / 2 + 1e-6).all()
    else:
        groups = weight.view(out_features, num_groups, group_size).abs().amax(-1) / 7
        assert (step.view(out_features, num_groups, group_size).abs() <= groups[..., None] / 2 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_a_row_is_the_same_alone_as_in_a_batch_and_bias_and_dtype(mode):
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(11, 256, generator=g), torch.randn(50, 256, generator=g), torch.randn(50, generator=g)
    q = quantize_weight(weight, mode)
    batch = linear(x, weight, bias, packed=q)
    for i in (0, 5, 10):
        assert torch.equal(linear(x[i : i + 1], weight, bias, packed=q), batch[i : i + 1])
    assert linear(x.bfloat16(), weight, packed=q).dtype == torch.bfloat16


@needs_kernel
@pytest.mark.parametrize("mode", QUANTIZE_MODES)
@pytest.mark.parametrize("rows", [3, 4, 5, 6, 7, 9, 16])
def test_rows_in_tiles_give_each_row_its_bits_alone(rows, mode):
    """From 3 rows the AVX2 kernels run tiles of 4 and 3 rows, each set of inputs in turn (one or two rows left
    over run as pairs): every row is the same bits as alone, for any batch size, and the dequantized matmul within
    rounding (int4: 3 groups; an odd number of inputs for int8's two sets; a partial last panel of columns)."""
    g = torch.Generator().manual_seed(rows)
    in_features = 383 if mode == "int8" else 384
    x, weight = torch.randn(rows, in_features, generator=g), torch.randn(50, in_features, generator=g)
    q = quantize_weight(weight, mode)
    batch = linear(x, weight, packed=q)
    assert torch.equal(batch, torch.cat([linear(x[i : i + 1], weight, packed=q) for i in range(rows)]))
    xd = q.dequantized_input(x)
    reference = xd @ q.dequantized().T
    assert ((batch - reference).abs() <= RTOL * (xd.abs() @ q.dequantized().abs().T) + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize(("in_features", "group_size"), [(100, 128), (36, 12), (44, 4), (7, 7)])
def test_int4_groups_that_do_not_fall_on_words_of_8_inputs(in_features, group_size):
    """int4 weights are stored 8 inputs to a 32-bit word: a K that is not a multiple of 8 (one group of all K),
    and groups that start or end inside a word, give the dequantized matmul too."""
    g = torch.Generator().manual_seed(in_features)
    x, weight = torch.randn(3, in_features, generator=g), torch.randn(40, in_features, generator=g)
    q = quantize_weight(weight, "int4", group_size)
    assert q.packed.shape == (3, -(-in_features // 8), 16) and q.packed.dtype == torch.int32
    reference = x @ q.dequantized().T
    bound = RTOL * (x.abs() @ q.dequantized().abs().T) + 1e-6
    assert ((linear(x, weight, packed=q) - reference).abs() <= bound).all()
    assert (q.dequantized() - weight).abs().max() < weight.abs().max() / 7


@needs_kernel
@pytest.mark.parametrize(("in_features", "group_size"), [(100, 128), (36, 36), (13, 128), (256, 128), (384, 64)])
def test_w4a8_quantizes_each_row_and_group_of_inputs_and_is_exact_on_that_grid(in_features, group_size):
    """w4a8 rounds each row's group of inputs to max|x| / 127 steps (a K that is not a multiple of 8: one group of
    all K), then sums exactly: the kernel equals the matmul of the rounded input by the dequantized weight within
    fp32 rounding, every rounded input is within half a step of x, and all-zero groups, NaNs and infinities give
    zeros and NaNs where the float matmul would."""
    g = torch.Generator().manual_seed(in_features)
    x, weight = torch.randn(6, in_features, generator=g) * 3, torch.randn(40, in_features, generator=g)
    x[1] = 0.0  # an all-zero row
    x[2, :5] = float("nan")
    x[3, -1] = float("inf")
    before = x.clone()
    q = quantize_weight(weight, "w4a8", group_size)
    out = linear(x, weight, packed=q)
    assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.equal(x.isnan(), before.isnan())
    assert torch.equal(out[1], torch.zeros(40)) and out[2].isnan().all() and out[3].isnan().all()
    fine = [0, 4, 5]
    xd = q.dequantized_input(x[fine])
    steps = x[fine].view(3, -1, q.group_size).abs().amax(-1, keepdim=True) / 127
    assert ((xd - x[fine]).view(3, -1, q.group_size).abs() <= steps / 2 * (1 + 1e-6)).all()
    reference = xd @ q.dequantized().T
    assert ((out[fine] - reference).abs() <= RTOL * (xd.abs() @ q.dequantized().abs().T) + 1e-6).all()
    assert 0 < ((out[fine] - x[fine] @ q.dequantized().T).norm() / reference.norm()).item() < 0.02


@needs_kernel
def test_w4a8_refuses_groups_inside_words_of_8_inputs():
    with pytest.raises(ValueError, match="group_size"):
        quantize_weight(torch.randn(16, 48), "w4a8", 12)
    q = quantize_weight(torch.randn(16, 48), "w4a8", 16)
    for group in (12, 20, 0):
        with pytest.raises(ValueError, match="group_size"):
            sbl.w4a8_linear(torch.randn(2, 48), q.packed, q.scales, 16, group)


@needs_kernel
def test_int4_scales_are_per_output_and_group_of_128_inputs():
    """int4 and w4a8 scale each output channel's groups of 128 inputs (scales [ceil(N/16), K/128, 16], each
    max|w| / 7 of its group: a large weight raises its own group's scale only); a K that 128 does not divide is
    one group."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 384, generator=g)
    weight[:, 130] = 50.0  # the second group of every output
    expected = weight.view(40, 3, 128).abs().amax(-1) / 7  # [N, G]
    assert INT4_GROUP_SIZE == 128
    for mode in ("int4", "w4a8"):
        q = quantize_weight(weight, mode)
        assert q.group_size == 128 and q.scales.shape == (3, 3, 16)
        torch.testing.assert_close(q.scales.transpose(1, 2).reshape(48, 3)[:40], expected)
    odd = quantize_weight(torch.randn(20, 200, generator=g), "int4")
    assert odd.group_size == 200 and odd.scales.shape == (2, 1, 16)


@pytest.mark.parametrize("mode", ["int8", "int4", "w4a8"])
def test_a_matrix_quantized_in_blocks_of_rows_is_the_matrix_quantized_whole(mode, monkeypatch):
    """A large matrix (an LM head) is quantized a block of rows at a time, its temporaries a block's: the same
    bytes and scales as the whole matrix at once, a ragged last block included."""
    from omnimtp.runtime import ops

    weight = torch.randn(100, 256, generator=torch.Generator().manual_seed(1))
    whole = quantize_weight(weight, mode)
    monkeypatch.setattr(ops, "INT8_BLOCK_ROWS", 32)
    blocked = quantize_weight(weight, mode)
    assert torch.equal(blocked.packed, whole.packed) and torch.equal(blocked.scales, whole.scales)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    assert torch.equal(linear(x, None, packed=blocked), linear(x, None, packed=whole))


@needs_kernel
def test_the_isa_argument_reaches_the_kernel(monkeypatch):
    """Every ISA gives the same bits, so which one ran shows only in the kernel's last argument: -1 (this CPU's
    best), 0 (AVX2), 1 (AVX512-VNNI)."""
    lib = sbl._library()
    choices = []
    kernel = lib.omnimtp_w4a8_linear
    monkeypatch.setattr(lib, "omnimtp_w4a8_linear", lambda *args: choices.append(args[-1]) or kernel(*args))
    q = quantize_weight(torch.randn(32, 128), "w4a8")
    x = torch.randn(2, 128)
    isas = [None, "AVX2", "AVX512-VNNI"] if sbl.w4a8_isa() == "AVX512-VNNI" else [None, "AVX2"]
    outs = [sbl.w4a8_linear(x, q.packed, q.scales, q.out_features, q.group_size, isa=isa) for isa in isas]
    assert choices == [-1, 0, 1][: len(isas)]
    assert all(torch.equal(out, outs[0]) for out in outs)


@needs_kernel
@pytest.mark.skipif(sbl.w4a8_isa() != "AVX512-VNNI", reason="compares both paths: needs AVX512-VNNI")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_w4a8_gives_the_same_bits_on_avx512_vnni_and_avx2(rows):
    """The VNNI dot products and AVX2's pair sums form the same integers and the same float ends: a server's
    outputs do not depend on which x86 CPU it landed on (partial last panel, a K past the last whole word)."""
    g = torch.Generator().manual_seed(rows)
    for in_features, group in ((384, 128), (100, 100)):
        q = quantize_weight(torch.randn(72, in_features, generator=g), "w4a8", group)
        x = torch.randn(rows, in_features, generator=g)
        outs = [sbl.w4a8_linear(x, q.packed, q.scales, q.out_features, q.group_size, isa=isa) for isa in sbl.W4A8_ISAS]
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(outs[0], linear(x, None, packed=q))
    with pytest.raises(ValueError, match="isa"):
        sbl.w4a8_linear(x, q.packed, q.scales, q.out_features, q.group_size, isa="SSE2")


@pytest.mark.skipif(sbl.isa() != "AVX512", reason="runs both builds: needs an AVX-512 CPU")
def test_the_avx512_and_avx2_builds_give_the_same_values(monkeypatch, tmp_path):
    """The AVX-512 build runs four panels at once on 16-lane registers, the AVX2 build one panel on two 8-lane
    halves: each column sums in the same order, so every value is the same (a server's outputs do not depend
    on which x86 CPU it landed on). Widths that leave a partial group of panels and a partial panel."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 384, generator=g)
    weights = [quantize_weight(torch.randn(out, 384, generator=g), mode, 128) for out in (16, 72, 100)
               for mode in QUANTIZE_MODES]
    weights.append(quantize_weight(torch.randn(40, 384, generator=g), "int4", 12))  # groups inside words
    outputs = {}
    monkeypatch.setenv("OMNIMTP_CACHE_DIR", str(tmp_path))
    try:
        for build in ("AVX512", "AVX2"):
            monkeypatch.setattr(sbl, "isa", lambda build=build: build)
            sbl._library.cache_clear()
            assert sbl.available(), sbl.unavailable_reason()
            outputs[build] = [
                (sbl.w4a8_linear if q.int8_activations else sbl.quantized_linear)(
                    x, q.packed, q.scales, q.out_features, q.group_size)
                for q in weights
            ]
    finally:
        monkeypatch.undo()
        sbl._library.cache_clear()
    assert len(list(tmp_path.rglob("*.so"))) == 2
    for wide, narrow, q in zip(outputs["AVX512"], outputs["AVX2"], weights, strict=True):
        assert torch.equal(wide, narrow), (q.out_features, q.group_size)
        assert torch.allclose(wide, q.dequantized_input(x) @ q.dequantized().T, rtol=1e-4, atol=1e-3)


def test_bad_quantize_values_are_value_errors_naming_it():
    for bad in ("int3", "INT8", "fp8", 8):
        with pytest.raises(ValueError, match="quantize"):
            check_quantize(bad, "cpu")
    with pytest.raises(ValueError, match="quantize"):
        check_quantize("int8", "meta")
    check_quantize(None, "meta")  # no quantization: nothing to check


@needs_kernel
@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_quantized_decoder_equals_decoder_on_dequantized_weights(mode):
    """The packed decoder on quantized weights == the same decoder with its matrices replaced by their
    dequantized forms (fp32 rounding apart), and differs from fp32 by the quantization only."""
    torch.manual_seed(0)
    model = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(tiny_code_predictor_config()).eval()
    decoder = PackedDecoder.from_module(model.model)
    quantized = decoder.quantized(mode)
    assert decoder.quantized(None) is decoder
    layers = tuple(
        replace(layer, qkv=q[0].dequantized(), o=q[1].dequantized(), gate_up=q[2].dequantized(),
                mlp_down=q[3].dequantized())
        for layer, q in zip(decoder.layers, quantized.quantized_layers, strict=True)
    )
    dequantized = replace(decoder, layers=layers, row_kernel=None)
    embeds = torch.randn(3, 4, decoder.hidden_size, generator=torch.Generator().manual_seed(1))
    outs = [
        decoder_forward(dec, KVCache(dec, 3, 8), embeds, [0, 1, 2]).last_hidden
        for dec in (quantized, dequantized, decoder)
    ]
    if mode == "w4a8":  # the float decoder does not round its activations: int8's error, not int4's
        assert 0 < ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 0.05
    else:
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    error = ((outs[0] - outs[2]).norm() / outs[2].norm()).item()
    assert 0 < error < (0.05 if mode == "int8" else 0.6)  # tiny random model: loose bounds


@needs_kernel
@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_a_decoder_quantized_while_packed_is_the_decoder_packed_then_quantized(mode, monkeypatch):
    """`from_module(quantize=)` quantizes each layer as it packs it (the fused float copies of one layer at a
    time) and holds the same weights as packing everything first and quantizing after."""
    torch.manual_seed(0)
    model = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(tiny_code_predictor_config()).eval()
    packed_then_quantized = PackedDecoder.from_module(model.model).quantized(mode)
    events = []
    pack, quantize = decoder_module.pack_layer, decoder_module.quantize_layer
    monkeypatch.setattr(decoder_module, "pack_layer", lambda *a: events.append("pack") or pack(*a))
    monkeypatch.setattr(decoder_module, "quantize_layer", lambda *a: events.append("quantize") or quantize(*a))
    quantized_while_packed = PackedDecoder.from_module(model.model, quantize=mode)
    assert events == ["pack", "quantize"] * len(model.model.layers)
    assert quantized_while_packed.quantize == mode
    for layer in quantized_while_packed.layers:  # it holds no float matrix it no longer runs
        assert layer.qkv is None and layer.o is None and layer.gate_up is None and layer.mlp_down is None
    for ours, theirs in zip(quantized_while_packed.quantized_layers, packed_then_quantized.quantized_layers,
                            strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales)
    with pytest.raises(ValueError, match="quantize"):
        PackedDecoder.from_module(model.model, quantize="int3")


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_code_predictor_runs_int8_heads_and_equals_its_dequantized_weights(mode, monkeypatch):
    """A quantized code predictor runs its layers in `mode` and its G-1 lm_heads in int8 (each frame calls the
    kernel once per head), and its greedy codes equal a float runner's on the dequantized weights."""
    from omnimtp.talker.code_predictor import CodePredictorRunner

    torch.manual_seed(0)
    cp = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(tiny_code_predictor_config()).eval()
    runner = CodePredictorRunner(cp, 3, quantize=mode)
    w = runner.weights
    heads = w.quantized_lm_heads
    assert len(heads) == cp.config.num_code_groups - 1 and all(h.group_size is None for h in heads)  # int8
    assert w.quantized(mode) is w
    decoder = w.decoder
    layers = tuple(
        replace(layer, qkv=q[0].dequantized(), o=q[1].dequantized(), gate_up=q[2].dequantized(),
                mlp_down=q[3].dequantized())
        for layer, q in zip(decoder.layers, decoder.quantized_layers, strict=True)
    )
    dequantized = replace(w, decoder=replace(decoder, layers=layers, quantize=None, quantized_layers=None),
                          lm_heads=torch.stack([h.dequantized() for h in heads]), quantized_lm_heads=None)
    reference = CodePredictorRunner(cp, 3, packed_gemm=False, weights=dequantized)
    calls = []
    kernel = sbl.quantized_linear
    monkeypatch.setattr(sbl, "quantized_linear", lambda x, packed, scales, n, group: (
        calls.append(packed.data_ptr()), kernel(x, packed, scales, n, group))[1])
    generator = torch.Generator().manual_seed(2)
    hidden, embed = (torch.randn(3, runner.hidden_size, generator=generator) for _ in range(2))
    got = runner.run(hidden, embed).codes
    assert sorted(c for c in calls if c in {h.packed.data_ptr() for h in heads}) == sorted(
        h.packed.data_ptr() for h in heads)  # each head once, quantized
    monkeypatch.setattr(sbl, "quantized_linear", kernel)
    assert torch.equal(got, reference.run(hidden, embed).codes)


# --- a quantized pipeline -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tts_int4():
    from omnimtp import OmniPipeline

    return OmniPipeline.tiny(family="qwen3_tts", quantize="int4", max_frames=12)


@needs_kernel
@pytest.mark.parametrize("mode", ["int4", "w4a8"])
def test_quantized_tts_speaks_audible_audio_seeded_repeats_and_alone_equals_batched(mode, tts_int4, monkeypatch):
    from omnimtp import OmniPipeline
    from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING

    pipeline = tts_int4 if mode == "int4" else OmniPipeline.tiny(family="qwen3_tts", quantize=mode, max_frames=12)
    family = pipeline.family
    assert family.talker_decoder.quantized_layers is not None
    assert family.talker_decoder.row_kernel is None  # never packed in float as well
    assert family.predictor(8).weights.decoder.quantize == mode
    calls = []
    kernel = sbl.w4a8_linear
    monkeypatch.setattr(sbl, "w4a8_linear", lambda *args: (calls.append(1), kernel(*args))[1])
    texts = ["hello there", "a second, longer sentence", "third"]
    batch = pipeline.speech(texts, sampling=QWEN3_TTS_SAMPLING, seed=[5, 6, 7])
    alone = pipeline.speech(texts[1], sampling=QWEN3_TTS_SAMPLING, seed=6)
    again = pipeline.speech(texts[1], sampling=QWEN3_TTS_SAMPLING, seed=6)
    assert bool(calls) == (mode == "w4a8")
    audio = alone.audio
    assert_audible(audio)
    assert torch.equal(torch.as_tensor(alone.codes), torch.as_tensor(batch[1].codes))
    assert torch.equal(torch.as_tensor(alone.codes), torch.as_tensor(again.codes))
    assert (abs(batch[1].audio - audio).max() <= 1e-6 * abs(audio).max()) and batch[1].audio.shape == audio.shape


@needs_kernel
def test_quantized_tts_projects_a_texts_rows_in_one_call_each_row_its_own(tts_int4):
    """Quantized, the trailing text rows come from one int8 projection call whose rows equal each id projected
    alone bit for bit (text in pieces gets the same rows), within int8's error of the float projection."""
    family = tts_int4.family
    ids = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]
    calls = []
    kernel = sbl.quantized_linear
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sbl, "quantized_linear", lambda x, *args: (calls.append(x.shape[0]), kernel(x, *args))[1])
        rows = family.speech_text_rows(ids)
    assert calls == [len(ids), len(ids)]  # fc1 and fc2, each once for every row
    alone = torch.cat([family.speech_text_rows([i]) for i in ids])
    assert torch.equal(rows, alone)
    with torch.no_grad():
        talker = family.talker
        float_rows = talker.text_projection(talker.model.text_embedding(torch.tensor([ids])))[0]
    error = ((rows - float_rows).norm() / float_rows.norm()).item()
    assert 0 < error < 0.02


def _held_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from modules, dataclasses, tuples and lists."""
    import dataclasses

    storages, seen, stack = {}, set(), list(roots)
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storages[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, torch.nn.Module):
            stack += [*item.parameters(), *item.buffers()]
        elif dataclasses.is_dataclass(item):
            stack += [getattr(item, f.name) for f in dataclasses.fields(item)]
        elif isinstance(item, (tuple, list)):
            stack += list(item)
    return sum(storages.values())


@needs_kernel
@pytest.mark.parametrize("mode", QUANTIZE_MODES)
def test_quantized_tts_frees_the_float_matrices_it_replaced(mode):
    """A quantized model the family loaded holds its decoder layers' matrices once, quantized: the packed
    decoders keep no float copies, the module's linears keep no data, and everything the family holds shrinks
    by at least half of those float matrices' bytes (what int8 saves at the least). A model the caller passed
    keeps its weights, and a released model is not saved."""
    from omnimtp import OmniPipeline
    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.models.qwen3_tts import tiny_qwen3_tts

    def held(family):
        return _held_bytes(family.model, family.talker_decoder, family.predictor(4).weights)

    plain, quantized = Qwen3TTSFamily.tiny(0), Qwen3TTSFamily.tiny(0, quantize=mode)
    cp_decoder = quantized.predictor(4).weights.decoder
    assert cp_decoder.quantize == mode and cp_decoder is quantized.predictor(8).weights.decoder  # one shared copy
    for decoder in (quantized.talker_decoder, cp_decoder):
        assert all(layer.qkv is None and layer.o is None and layer.gate_up is None and layer.mlp_down is None
                   for layer in decoder.layers)
    layers = [*plain.talker.model.layers, *plain.talker.code_predictor.model.layers]
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    released = [m for layer in [*quantized.talker.model.layers, *quantized.talker.code_predictor.model.layers]
                for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.untyped_storage().nbytes() <= m.weight.element_size() for m in released)
    assert held(quantized) < held(plain) - float_bytes / 2
    assert_audible(OmniPipeline(family=quantized, max_frames=8).speech("hello there", voice="aiden").audio)
    with pytest.raises(ValueError, match="model"):
        quantized.model.save_pretrained("unused")
    passed = tiny_qwen3_tts(0)
    before = passed.talker.model.layers[0].self_attn.q_proj.weight.clone()
    Qwen3TTSFamily(passed, quantize=mode)
    assert torch.equal(passed.talker.model.layers[0].self_attn.q_proj.weight, before)


RSS_FILE_SCRIPT = """
import gc, json, sys
import torch
from omnimtp.families.qwen3_tts import Qwen3TTSFamily

def rss_file_kb():
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("RssFile")))

def load():
    family = Qwen3TTSFamily.from_pretrained(sys.argv[1], quantize=sys.argv[2] if sys.argv[2] != "none" else None)
    family.predictor(4)
    return family

load()  # the libraries a load maps, mapped before the measured load
gc.collect()
before = rss_file_kb()
family = load()
print(json.dumps({"rss_file_growth_kb": rss_file_kb() - before}))
"""


@needs_kernel
def test_quantized_checkpoint_does_not_stay_mapped(tmp_path):
    """Quantizing reads every page of the weights file; loaded quantized, none of them stays resident (the
    kept weights are copies, so the mapping goes with the released matrices), while fp32 keeps them mapped."""
    import json
    import os
    import subprocess
    import sys

    from omnimtp.codec.speech_tokenizer import tiny_speech_tokenizer
    from omnimtp.models.qwen3_tts import tiny_qwen3_tts
    from omnimtp.tokenizer import byte_tokenizer

    tiny_qwen3_tts(0, talker_hidden_size=1024, num_layers=2).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    tiny_speech_tokenizer(0).save_pretrained(tmp_path / "speech_tokenizer")
    file_kb = os.path.getsize(tmp_path / "model.safetensors") / 1024
    growth = {}
    for mode in ("none", "int8"):
        process = subprocess.run([sys.executable, "-c", RSS_FILE_SCRIPT, str(tmp_path), mode], capture_output=True,
                                 text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        growth[mode] = json.loads(process.stdout.strip().splitlines()[-1])["rss_file_growth_kb"]
    assert growth["none"] > 0.5 * file_kb  # packing fp32 reads the file, which stays mapped under the weights
    assert growth["int8"] < 0.2 * file_kb, (growth, file_kb)


def test_quantize_values_are_checked_where_pipelines_are_made():
    from omnimtp import OmniPipeline

    for family in ("qwen3_tts", "qwen3", "qwen2_5"):
        with pytest.raises(ValueError, match="quantize"):
            OmniPipeline.tiny(family=family, quantize="int2")
    with pytest.raises(ValueError, match="quantize"):
        OmniPipeline(family=OmniPipeline.tiny(family="qwen3_tts").family, quantize="int8")


@needs_kernel
def test_quantized_server_speaks_through_the_openai_client_as_the_pipeline(tts_int4):
    from omnimtp.server.app import create_app
    from omnimtp.server.audio import to_pcm16
    from omnimtp.server.scheduler import Engine

    text, greedy = "Hello there, tiny voice.", {"language": "english", "temperature": 0}
    *chunks, _ = list(tts_int4.stream_speech(text, voice="aiden", language="english"))
    expected = to_pcm16(np.concatenate(chunks)).tobytes()
    engine = Engine(tts_int4.family, model_id="tts-int4", max_frames=12, max_batch_size=4)
    with running_server(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        speech = client.audio.speech.create(
            model="tts-int4", input=text, voice="aiden", response_format="pcm", extra_body=greedy
        )
    assert_audible(np.frombuffer(speech.content, dtype=np.int16).astype(np.float32) / 32768)
    assert speech.content == expected
