"""Qwen3-TTS's 12 Hz speech tokenizer decoder: equal to the `qwen_tts` reference on the same weights, loaded
from the released layout, streamed in chunks that join into the one-shot decode."""

import json

import numpy as np
import pytest
import qwen_tts_reference
import torch
from audio_checks import assert_audible, assert_audio_close, assert_audio_equal, rms_dbfs
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from omnimtp.codec.speech_tokenizer import (
    CausalTransConv,
    SpeechTokenizerDecoder,
    real_size_config,
    tiny_speech_tokenizer,
)
from omnimtp.runtime.kernels import bf16_rows_linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Streamed vs one-shot: the transformer's KV-cache path (n new frames against the cached ones) rounds its
# matmuls differently from the full-sequence forward (~1e-6 on its output), and the conv body's layers run over
# each chunk's inputs and their kept tails (oneDNN blocks a convolution's sums by its input's length); the
# unit-gain conv body carries either to ~3e-5 of the peak (measured).
STREAM_REL = 1e-4
# Ours vs the reference: the same modules' math; measured bit for bit at 40 frames and 1.4e-5 of the peak at
# one frame (the attention of a one-frame sequence takes another SDPA path on one side).
REFERENCE_REL = 1e-4
# The conv stack in bf16 (`to_conv_dtype`) against fp32: measured 22.7 dB SNR on the tiny decoder's audio of
# random codes (23.5 at the released widths, random weights: benchmarks/quantized_quality.py). Its streamed
# chunks and its one-shot decode run a layer as a bf16 matmul where its input is short and as oneDNN's bf16
# convolution where it is long (`streaming.SHORT_MATMUL_MAX_STEPS`): their sums round to bf16 differently, and
# the stack carries a rounding that falls the other way to a few % of the peak (0.6B, random weights: today's
# bf16 path against itself at other chunkings 5-7 % of the peak, max), as far from fp32 either way.
BF16_MIN_SNR_DB = 20.0
BF16_STREAM_SNR_DB = 20.0
BF16_STREAM_FP32_SNR_LOSS_DB = 1.0


@pytest.fixture(scope="module")
def decoder():
    return tiny_speech_tokenizer(seed=0)


@pytest.fixture(scope="module")
def saved(decoder, tmp_path_factory):
    path = tmp_path_factory.mktemp("speech_tokenizer")
    decoder.save_pretrained(path)
    return path


def _codes(num_frames, seed=0, codebook_size=2048):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, codebook_size, (16, num_frames), generator=generator)


def _stream(decoder, codes, bounds):
    stream = decoder.new_stream()
    return [decoder.decode_streams([stream], [codes[:, a:b]], [b == bounds[-1]])[0]
            for a, b in zip(bounds, bounds[1:], strict=False)]


def _reference_decode(reference, codes):
    with torch.no_grad():
        return reference.decode(codes.T[None]).audio_values[0].numpy()  # the reference takes [B, T, 16]


def test_tiny_decoder_is_audible_at_the_real_frame_rate(decoder):
    assert (decoder.sample_rate, decoder.num_quantizers, decoder.samples_per_frame) == (24000, 16, 1920)
    audio = decoder.decode(_codes(30))
    assert audio.dtype == np.float32 and audio.shape == (30 * 1920,)
    rms = float(np.sqrt(np.mean(audio.astype(np.float64) ** 2)))
    assert 0.02 <= rms <= 0.5, rms
    assert np.mean(np.abs(audio) >= 1.0) < 0.01  # not a clipped square wave


def test_decode_equals_the_reference_on_our_saved_weights(decoder, saved):
    reference = qwen_tts_reference.load_speech_tokenizer(saved)
    for num_frames, seed in ((1, 1), (40, 2)):
        codes = _codes(num_frames, seed)
        ours = decoder.decode(codes)
        assert_audible(ours)
        assert_audio_close(ours, _reference_decode(reference, codes), rel=REFERENCE_REL)


def test_our_loader_reads_the_reference_save(decoder, saved, tmp_path):
    """The reference's own save_pretrained (its config.json, its key names) loads into ours."""
    qwen_tts_reference.load()
    reference = qwen_tts_reference.new_speech_tokenizer(json.loads((saved / "config.json").read_text()))
    weights = load_file(str(saved / "model.safetensors"))
    reference.decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in weights.items()})
    reference.save_pretrained(tmp_path)
    ours = SpeechTokenizerDecoder.from_pretrained(tmp_path)
    codes = _codes(20, 3)
    assert_audio_close(ours.decode(codes), _reference_decode(reference, codes), rel=REFERENCE_REL)


def test_released_layout_with_and_without_encoder_weights(decoder, saved, tmp_path):
    """Encoder weights and config (the Mimi encoder, used only for voice cloning) are ignored; the decoder is
    the same either way."""
    weights = load_file(str(saved / "model.safetensors"))
    encoder_weights = {
        "encoder.encoder.layers.0.conv.weight": torch.randn(4, 1, 7),
        "encoder.quantizer.semantic_residual_vector_quantizer.layers.0.codebook.embed_sum": torch.randn(8, 4),
        "encoder.encoder_transformer.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
    }
    save_file({**weights, **encoder_weights}, str(tmp_path / "model.safetensors"))
    config = json.loads((saved / "config.json").read_text())
    config["encoder_config"] = {"hidden_size": 4, "num_quantizers": 32, "codebook_dim": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with_encoder = SpeechTokenizerDecoder.from_pretrained(tmp_path)
    without_encoder = SpeechTokenizerDecoder.from_pretrained(saved)
    for (name, ours), (_, theirs) in zip(with_encoder.state_dict().items(), decoder.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name
    codes = _codes(8, 4)
    assert_audio_equal(with_encoder.decode(codes), decoder.decode(codes))
    assert_audio_equal(without_encoder.decode(codes), decoder.decode(codes))


def test_missing_or_foreign_decoder_weights_are_refused(saved, tmp_path):
    weights = load_file(str(saved / "model.safetensors"))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    dropped = next(k for k in weights if "cluster_usage" in k)
    save_file({k: v for k, v in weights.items() if k != dropped}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="path: .*missing .*cluster_usage"):
        SpeechTokenizerDecoder.from_pretrained(tmp_path)
    save_file({**weights, "decoder.extra.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="path: .*unexpected .*decoder.extra|path: .*unexpected .*extra"):
        SpeechTokenizerDecoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="path"):
        SpeechTokenizerDecoder.from_pretrained(tmp_path / "absent")


def test_save_load_round_trip_is_bit_exact(decoder, saved):
    loaded = SpeechTokenizerDecoder.from_pretrained(saved)
    assert loaded.tokenizer_config == decoder.tokenizer_config
    codes = _codes(6, 5)
    assert_audio_equal(loaded.decode(codes), decoder.decode(codes))


def test_streamed_chunks_join_into_the_one_shot_decode(decoder):
    codes = _codes(60, 6)
    one_shot = decoder.decode(codes)
    bounds = [0, 1, 26, 51, 60]  # a 1-frame first chunk, then 25 frames
    chunks = _stream(decoder, codes, bounds)
    assert [len(c) for c in chunks] == [1920 * (b - a) for a, b in zip(bounds, bounds[1:], strict=False)]
    offsets = np.cumsum([0] + [len(c) for c in chunks])
    for start, chunk in zip(offsets, chunks, strict=False):
        assert_audio_close(chunk, one_shot[start : start + len(chunk)], rel=STREAM_REL)  # each chunk, not just the sum
    assert_audio_close(np.concatenate(chunks), one_shot, rel=STREAM_REL)


def test_runs_of_one_frame_chunks_join_into_the_one_shot_decode(decoder):
    """One frame at a time, several times in a row (at the start, in the middle, at the end): each chunk's
    left context is then built only from earlier one-frame chunks."""
    codes = _codes(40, 8)
    bounds = [0, 1, 2, 3, 4, 20, 21, 22, 23, 37, 38, 39, 40]
    chunks = _stream(decoder, codes, bounds)
    one_shot = decoder.decode(codes)
    offsets = np.cumsum([0] + [len(c) for c in chunks])
    for start, chunk in zip(offsets[:-1], chunks, strict=True):
        assert_audio_close(chunk, one_shot[start : start + len(chunk)], rel=STREAM_REL)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 14), min_size=1, max_size=5), st.integers(0, 1000))
def test_any_chunking_joins_into_the_one_shot_decode(decoder, sizes, seed):
    bounds = np.cumsum([0] + sizes).tolist()
    codes = _codes(bounds[-1], seed)
    assert_audio_close(np.concatenate(_stream(decoder, codes, bounds)), decoder.decode(codes), rel=STREAM_REL)


def test_the_pre_conv_keeps_its_last_inputs(decoder):
    """The causal pre-conv (kernel 3) keeps its last 2 quantizer frames between chunks: zeroing them, or keeping
    one frame fewer, moves the next chunk far beyond the streaming tolerance. (The conv body's states:
    tests/test_codec_streaming.py, on this decoder and on Qwen3-Omni's.)"""
    codes = _codes(6, 7)
    stream = decoder.new_stream()
    assert stream.quantized_tail.shape == (1, decoder.codebook_dim, 2)
    decoder.decode_streams([stream], [codes[:, :3]])
    expected = decoder.decode_streams([stream], [codes[:, 3:]])[0]
    peak = float(np.abs(expected).max())
    for spoil in (torch.zeros_like, lambda tail: torch.cat([torch.zeros_like(tail[..., :1]), tail[..., 1:]], -1)):
        stream = decoder.new_stream()
        decoder.decode_streams([stream], [codes[:, :3]])
        stream.quantized_tail = spoil(stream.quantized_tail)
        moved = float(np.abs(decoder.decode_streams([stream], [codes[:, 3:]])[0] - expected).max())
        assert moved > 5 * STREAM_REL * peak


def test_a_streams_conv_state_at_the_released_widths():
    """At the released widths a stream's conv body keeps 22 tails, 134,208 values (0.54 MB in fp32): per layer its
    kernel's reach at its own rate (6, 18, 54 for the residual units' dilations 1, 3, 9; one input for each
    decoder block's transposed conv, none for the upsamplers', whose kernel is their stride)."""
    with torch.device("meta"):
        real = SpeechTokenizerDecoder(real_size_config())
    states = real._streaming.new_conv_states()
    widths = [state.shape[-1] for state in states]
    assert widths == [0, 6, 0, 6, 6] + [1, 6, 18, 54] * 4 + [6]
    assert sum(state.numel() for state in states) == 134_208
    assert real.new_stream().quantized_tail.shape == (1, 512, 2)


def test_batched_streams_equal_single_streams_bit_for_bit(decoder):
    codes = [_codes(30, 11), _codes(30, 12), _codes(30, 13)]
    bounds = [[0, 1, 26, 30], [0, 1, 26, 30], [0, 2, 3, 30]]
    streams = [decoder.new_stream() for _ in codes]
    steps = [
        decoder.decode_streams(
            streams, [c[:, b[step] : b[step + 1]] for c, b in zip(codes, bounds, strict=True)], [step == 2] * 3
        )
        for step in range(3)
    ]
    for k in range(len(codes)):
        single = np.concatenate(_stream(decoder, codes[k], bounds[k]))
        assert_audio_equal(np.concatenate([chunks[k] for chunks in steps]), single)


def _snr_db(actual, expected) -> float:
    expected = np.asarray(expected, dtype=np.float64)
    return float(10 * np.log10((expected**2).sum() / ((np.asarray(actual, dtype=np.float64) - expected) ** 2).sum()))


def test_a_bf16_conv_stack_keeps_the_streaming_guarantees_within_a_stated_error(decoder, saved):
    """`to_conv_dtype(torch.bfloat16)` (the `codec_dtype="bfloat16"` opt-in): the conv stack runs in bf16 while
    the quantizer, pre-conv and transformer stay fp32; the audio is float32 and audible, within BF16_MIN_SNR_DB
    of the fp32 decoder's (docs/tts.md states the measured error), and its streamed chunks join into its
    one-shot decode and do not depend on the streams decoded beside them."""
    bf16 = SpeechTokenizerDecoder.from_pretrained(saved).to_conv_dtype(torch.bfloat16)
    assert decoder.conv_dtype == torch.float32 and bf16.conv_dtype == torch.bfloat16
    assert {p.dtype for part in (bf16.quantizer, bf16.pre_conv, bf16.pre_transformer) for p in part.parameters()} == {
        torch.float32}
    codes = [_codes(40, 7), _codes(40, 8)]
    one_shot = bf16.decode(codes[0])
    assert one_shot.dtype == np.float32
    assert_audible(one_shot)
    assert BF16_MIN_SNR_DB <= _snr_db(one_shot, decoder.decode(codes[0])) < 60  # < 60: it ran in bf16
    bounds = [0, 1, 14, 40]
    alone = np.concatenate(_stream(bf16, codes[0], bounds))
    assert _snr_db(alone, one_shot) >= BF16_STREAM_SNR_DB
    reference = decoder.decode(codes[0])  # the streamed chunks as close to fp32 as the one-shot decode
    assert _snr_db(alone, reference) >= _snr_db(one_shot, reference) - BF16_STREAM_FP32_SNR_LOSS_DB
    streams = [bf16.new_stream() for _ in codes]
    steps = zip(bounds, bounds[1:], strict=False)
    together = [bf16.decode_streams(streams, [c[:, a:b] for c in codes]) for a, b in steps]
    assert_audio_equal(np.concatenate([chunks[0] for chunks in together]), alone)
    with pytest.raises(ValueError, match="conv stack runs in torch.bfloat16"):  # its fp32 weights are gone
        bf16.save_pretrained(saved.parent / "rounded")
    assert not (saved.parent / "rounded").exists()


def test_a_bf16_stacks_short_inputs_run_as_bf16_matmuls_on_its_own_weights(decoder, saved):
    """A bf16 conv stack runs an input of up to `streaming.SHORT_MATMUL_MAX_STEPS` steps of its causal convolutions
    of kernel > 1 and of its transposed convolutions as one bf16 matmul on the layer's own weights (no
    convolution op, no packed or fp32 copy of a weight), each within bf16 rounding of the convolution; a longer
    input, and a pointwise convolution of more than `streaming.BF16_ROWS_MAX_STEPS` steps, stays a convolution. A
    stream's bf16 audio stays bit for bit the same alone and batched."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCausalConvNet,
        Qwen3OmniMoeCausalTransConvNet,
    )

    from omnimtp.codec import streaming

    bf16 = SpeechTokenizerDecoder.from_pretrained(saved).to_conv_dtype(torch.bfloat16)
    weights = {name: (p.data_ptr(), p.dtype) for name, p in bf16.named_parameters()}
    causal = [m for m in bf16.modules() if isinstance(m, Qwen3OmniMoeCausalConvNet) and m.conv.groups == 1
              and m.conv.weight.dtype == torch.bfloat16]
    transposed = [m for m in bf16.modules() if isinstance(m, CausalTransConv)]
    assert len(transposed) >= 4 and any(m.kernel_size > 1 and m.dilation > 1 for m in causal)
    generator = torch.Generator().manual_seed(6)

    def run(layer, steps):
        x = torch.randn(2, layer.conv.in_channels, steps, generator=generator).to(torch.bfloat16)
        with torch.no_grad(), torch.profiler.profile() as profile:
            ours = layer(x)
        ran_conv = any("conv" in event.key for event in profile.key_averages())
        base = Qwen3OmniMoeCausalTransConvNet if layer in transposed else Qwen3OmniMoeCausalConvNet
        with torch.no_grad():
            expected = base.forward(layer, x).float()
        # each side rounds its fp32 sums to bf16 (and the transposed one its bias add): a few bf16 steps apart
        torch.testing.assert_close(ours.float(), expected, rtol=0, atol=2**-6 * float(expected.abs().max()))
        return ran_conv

    for layer in causal + transposed:
        short = run(layer, 32)  # a frame's steps at the released decoder's 768-channel blocks
        assert short == (layer in causal and layer.kernel_size == 1), layer
        assert run(layer, streaming.SHORT_MATMUL_MAX_STEPS + 1) or (
            layer in transposed and layer.conv.weight.numel() >= streaming.TRANSPOSED_MATMUL_MIN_WEIGHTS)
    codes = [_codes(6, 21), _codes(6, 22)]
    streams = [bf16.new_stream() for _ in codes]
    together = [bf16.decode_streams(streams, [c[:, a:b] for c in codes]) for a, b in ((0, 1), (1, 3), (3, 6))]
    for k in range(len(codes)):
        alone = np.concatenate(_stream(bf16, codes[k], [0, 1, 3, 6]))
        assert_audio_equal(np.concatenate([chunks[k] for chunks in together]), alone)
    assert {name: (p.data_ptr(), p.dtype) for name, p in bf16.named_parameters()} == weights
    assert not any("_row_kernel_weight" in m.__dict__ for m in bf16.modules())


@pytest.mark.skipif(not bf16_rows_linear.available(), reason=f"{bf16_rows_linear.unavailable_reason()}")
def test_a_bf16_stacks_few_step_inputs_run_all_streams_rows_in_one_kernel_call(saved, monkeypatch):
    """Inputs of up to `streaming.BF16_ROWS_MAX_STEPS` steps a stream of a bf16 stack's convolutions (pointwise
    ones too), transposed convolutions and ConvNeXt linears run on the bf16 rows kernel, each layer one call for
    all the streams decoded together (no convolution or torch matmul op), on the layers' own weights; a stream's
    audio is the same bits alone and batched; without the kernel (a CPU without AVX512_BF16) the stack runs as
    before, within bf16 rounding of it."""
    from omnimtp.codec import streaming

    bf16 = SpeechTokenizerDecoder.from_pretrained(saved).to_conv_dtype(torch.bfloat16)
    weights = {name: (p.data_ptr(), p.dtype) for name, p in bf16.named_parameters()}
    calls = []
    kernel = bf16_rows_linear.bf16_rows_linear

    def counted(x, weight, bias=None):
        calls.append((x.shape[:-1], weight.data_ptr()))
        return kernel(x, weight, bias)

    monkeypatch.setattr(bf16_rows_linear, "bf16_rows_linear", counted)
    pointwise = [m for m in bf16.modules() if type(m) is streaming.PointwiseCausalConv]
    transposed = [m for m in bf16.modules() if isinstance(m, CausalTransConv)]
    generator = torch.Generator().manual_seed(7)
    assert pointwise and transposed
    for layer in pointwise[:2] + transposed[:2]:
        x = torch.randn(3, layer.conv.in_channels, streaming.BF16_ROWS_MAX_STEPS, generator=generator)
        calls.clear()
        with torch.no_grad(), torch.profiler.profile() as profile:
            layer(x.to(torch.bfloat16))
        ran = {event.key for event in profile.key_averages()}
        assert calls and calls[0][0][0] == 3 and not any("conv" in k or k in ("aten::mm", "aten::linear") for k in ran)
    codes = [_codes(3, 31), _codes(3, 32)]
    streams = [bf16.new_stream() for _ in codes]
    calls.clear()
    together = [bf16.decode_streams(streams, [c[:, a : a + 1] for c in codes]) for a in range(3)]
    assert calls and all(shape[0] == 2 for shape, _ in calls)  # both streams' rows in every call
    called = {ptr for _, ptr in calls}
    assert called <= {p.data_ptr() for p in bf16.parameters()}  # the layers' own weights
    upsampling = [m for m in bf16.upsample.modules() if isinstance(m, CausalTransConv | torch.nn.Linear)]
    assert upsampling and {m.conv.weight.data_ptr() if isinstance(m, CausalTransConv) else m.weight.data_ptr()
                           for m in upsampling} <= called  # every upsampling layer's few steps ran on it
    alone = [np.concatenate(_stream(bf16, c, [0, 1, 2, 3])) for c in codes]
    for k in range(len(codes)):
        assert_audio_equal(np.concatenate([chunks[k] for chunks in together]), alone[k])
    assert {name: (p.data_ptr(), p.dtype) for name, p in bf16.named_parameters()} == weights
    monkeypatch.setattr(bf16_rows_linear, "available", lambda: False)
    calls.clear()
    without = np.concatenate(_stream(bf16, codes[0], [0, 1, 2, 3]))
    assert not calls  # (the tiny widths' short sums: within rounding, here the same bits)
    assert float(np.abs(without - alone[0]).max()) <= 0.05 * float(np.abs(alone[0]).max())


def test_a_bf16_stacks_matmul_only_transposed_weights_are_laid_out_for_their_matmul(decoder, saved, monkeypatch):
    """In a bf16 stack, a transposed convolution of `streaming.TRANSPOSED_MATMUL_MIN_WEIGHTS` or more (the
    released decoder's 1536 → 768 layer; lowered here) holds its weight as its matmul's [C_out·k, C_in] matrix:
    the same shape and values, no second copy of it, and the decoder's audio the same bit for bit as with the
    weight as it was (the layer's matmul reads the same values either way), alone and batched."""
    from omnimtp.codec import streaming

    monkeypatch.setattr(streaming, "TRANSPOSED_MATMUL_MIN_WEIGHTS", 0)
    bf16 = SpeechTokenizerDecoder.from_pretrained(saved).to_conv_dtype(torch.bfloat16)
    layers = [m for m in bf16.modules() if isinstance(m, CausalTransConv)]
    originals = [m for m in decoder.modules() if isinstance(m, CausalTransConv)]
    assert len(layers) == len(originals) >= 4
    for layer, original in zip(layers, originals, strict=True):
        weight = layer.conv.weight
        assert weight.flatten(1).t().is_contiguous() and not weight.is_contiguous()
        assert torch.equal(weight, original.conv.weight.to(torch.bfloat16))
        assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()  # this layout only
    codes = [_codes(30, 23), _codes(30, 24)]
    bounds = [0, 1, 3, 30]
    streams = [bf16.new_stream() for _ in codes]
    steps = zip(bounds, bounds[1:], strict=False)
    together = [bf16.decode_streams(streams, [c[:, a:b] for c in codes]) for a, b in steps]
    for layer in layers:  # the same values laid out as the convolution's weight
        layer.conv.weight.data = layer.conv.weight.detach().contiguous()
    for k in range(len(codes)):
        assert_audio_equal(np.concatenate([chunks[k] for chunks in together]),
                           np.concatenate(_stream(bf16, codes[k], bounds)))


@pytest.mark.parametrize("form", ["matmul", "row kernel"])
def test_transposed_convolutions_as_matmuls_keep_every_guarantee(decoder, saved, monkeypatch, form):
    """The matmul forms a released-width decoder's transposed convolutions run in (the tiny ones run as
    convolutions), forced on every layer: the large layers' matmul (every input length), and the row kernel's
    (inputs of up to `streaming.ROW_KERNEL_MAX_ROWS` steps of layers of `streaming.ROW_KERNEL_MIN_WEIGHTS` or
    more; longer ones stay convolutions here). Each layer equals its convolution within float rounding and
    runs no convolution, and the decoder still equals the reference, joins its streamed chunks into the
    one-shot decode, and gives a batched stream bit for bit what it gives alone."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCausalTransConvNet

    from omnimtp.codec import streaming
    from omnimtp.runtime.kernels import small_batch_linear

    layers = [m for m in decoder.modules() if isinstance(m, CausalTransConv)]
    assert len(layers) >= 4 and all(m.conv.weight.numel() < streaming.ROW_KERNEL_MIN_WEIGHTS for m in layers)
    assert {m.conv.kernel_size[0] // m.conv.stride[0] for m in layers} == {1, 2}  # the upsamplers; the blocks
    if form == "matmul":
        monkeypatch.setattr(streaming, "TRANSPOSED_MATMUL_MIN_WEIGHTS", 0)
        monkeypatch.setattr(streaming, "ROW_KERNEL_MAX_ROWS", 0)
    elif small_batch_linear.available():
        monkeypatch.setattr(streaming, "ROW_KERNEL_MIN_WEIGHTS", 0)
    else:
        pytest.skip(f"no row kernel here: {small_batch_linear.unavailable_reason()}")
    kernel_rows = []
    run = small_batch_linear._run
    monkeypatch.setattr(small_batch_linear, "_run", lambda x, *rest: kernel_rows.append(x.shape[0]) or run(x, *rest))
    generator = torch.Generator().manual_seed(3)
    for layer in layers:
        x = torch.randn(2, layer.conv.in_channels, 7, generator=generator)
        kernel_rows.clear()
        with torch.no_grad(), torch.profiler.profile() as profile:
            ours = layer(x)
        expected = Qwen3OmniMoeCausalTransConvNet.forward(layer, x)
        assert not any("conv" in event.key for event in profile.key_averages())
        assert kernel_rows == ([2 * 7] if form == "row kernel" else [])  # both requests' steps in one call
        assert ours.shape == expected.shape == (2, layer.conv.out_channels, 7 * layer.conv.stride[0])
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    test_decode_equals_the_reference_on_our_saved_weights(decoder, saved)
    test_streamed_chunks_join_into_the_one_shot_decode(decoder)
    test_batched_streams_equal_single_streams_bit_for_bit(decoder)


def test_decode_leaves_the_callers_codes_alone(decoder):
    codes = _codes(3, 14)
    before = codes.clone()
    decoder.decode(codes)
    decoder.decode_streams([decoder.new_stream()], [codes])
    assert torch.equal(codes, before)
    assert rms_dbfs(decoder.decode(codes.numpy())) > -40  # numpy ids are accepted too


@pytest.mark.parametrize("codes, message", [
    (torch.zeros(15, 4, dtype=torch.long), r"codes: must be \[16, T>=1\]"),
    (torch.zeros(16, 0, dtype=torch.long), r"codes: must be \[16, T>=1\]"),
    (torch.zeros(16, dtype=torch.long), r"codes: must be \[16, T>=1\]"),
    (torch.full((16, 2), 2048), r"codes: code ids must be in \[0, 2048\)"),
    (torch.full((16, 2), -1), r"codes: code ids must be in \[0, 2048\)"),
    (torch.zeros(16, 2), "codes: codes must be integer ids"),
])
def test_bad_codes_are_a_value_error_naming_them(decoder, codes, message):
    with pytest.raises(ValueError, match=message):
        decoder.decode(codes)


def test_bad_stream_blocks_are_a_value_error_naming_them(decoder):
    stream = decoder.new_stream()
    with pytest.raises(ValueError, match="blocks"):
        decoder.decode_streams([stream], [])
    with pytest.raises(ValueError, match=r"blocks\[1\]: code ids"):
        decoder.decode_streams([stream, decoder.new_stream()], [_codes(1), torch.full((16, 1), 4096)])
    with pytest.raises(ValueError, match="is_final"):
        decoder.decode_streams([stream], [_codes(1)], [True, False])
    assert stream.num_frames == 0  # a refused call decodes nothing


def test_importing_the_reference_leaves_transformers_models_buildable():
    """`qwen_tts` puts a RoPE initializer into transformers' global table; `qwen_tts_reference` keeps it to the
    reference's modules, so later tests in the same process still build Qwen3-Omni models."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from omnimtp.models.tiny import tiny_qwen3_omni_config

    qwen_tts_reference.load()
    code2wav = Qwen3OmniMoeCode2Wav(tiny_qwen3_omni_config().code2wav_config)
    assert torch.isfinite(code2wav.pre_transformer.rotary_emb.inv_freq).all()
