"""Streamed code2wav == one-shot code2wav, with no samples lost at chunk boundaries, each chunk running its own
frames' convolutions only (Qwen3-Omni's code2wav, and the same tests on Qwen3-TTS's 12 Hz decoder)."""

import numpy as np
import pytest
import torch
from audio_checks import assert_audible, assert_audio_close, assert_audio_equal
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnimtp.codec import streaming
from omnimtp.codec.speech_tokenizer import tiny_speech_tokenizer
from omnimtp.codec.streaming import StreamingCode2Wav
from omnimtp.models.tiny import scale_code2wav_to_speech_level, tiny_qwen3_omni_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def code2wav():
    config = tiny_qwen3_omni_config().code2wav_config
    config.num_hidden_layers = 2  # two sliding-window layers reach 142 frames back
    with torch.random.fork_rng():
        torch.manual_seed(0)
        code2wav = Qwen3OmniMoeCode2Wav(config).eval()
    scale_code2wav_to_speech_level(code2wav)
    return code2wav


def _codes(num_frames, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (16, num_frames), generator=g)


def _stream(decoder, codes, bounds):
    stream = decoder.new_stream()
    return [decoder.decode([stream], [codes[:, a:b]])[0] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_chunks_join_into_the_one_shot_decode(code2wav):
    decoder = StreamingCode2Wav(code2wav)
    codes = _codes(190)
    with torch.no_grad():
        one_shot = code2wav(codes[None])[0, 0].numpy()
    chunks = _stream(decoder, codes, [0, 2, 27, 52, 77, 102, 127, 152, 177, 190])
    assert len(chunks[0]) == 1920 * 2 - 555
    assert all(len(c) == 1920 * 25 for c in chunks[1:-1])
    joined = np.concatenate(chunks)
    assert joined.shape == (1920 * 190 - 555,) == one_shot.shape
    assert_audio_close(joined, one_shot, rel=1e-5)
    for start, chunk in zip(np.cumsum([0] + [len(c) for c in chunks]), chunks, strict=False):
        assert_audio_close(chunk, one_shot[start : start + len(chunk)], rel=1e-5)  # each chunk, not just the sum


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), st.integers(0, 1000))
def test_any_chunking_is_exact(code2wav, sizes, seed):
    decoder = StreamingCode2Wav(code2wav)
    bounds = np.cumsum([0] + sizes).tolist()
    codes = _codes(bounds[-1], seed)
    with torch.no_grad():
        one_shot = code2wav(codes[None])[0, 0].numpy()
    joined = np.concatenate(_stream(decoder, codes, bounds))
    assert joined.shape == one_shot.shape == (decoder.num_samples(bounds[-1]),)
    assert_audio_close(joined, one_shot, rel=1e-5)


@pytest.mark.parametrize("row_stack_bytes", [streaming.ROW_STACK_BYTES, 1])
def test_batched_streams_equal_single_streams_bit_for_bit(code2wav, row_stack_bytes, monkeypatch):
    """A stream's samples do not depend on the other streams decoded in the same call, whether their
    chunks have the same length or not, and whether the conv stack runs the rows batched (small chunks:
    every chunk of the tiny model) or one at a time (large ones: here forced by a 1-byte threshold)."""
    monkeypatch.setattr(streaming, "ROW_STACK_BYTES", row_stack_bytes)
    rows_per_call = []
    conv_stack = StreamingCode2Wav._conv_stack
    monkeypatch.setattr(StreamingCode2Wav, "_conv_stack", lambda self, hidden, streams, is_start: (
        rows_per_call.append(hidden.shape[0]), conv_stack(self, hidden, streams, is_start))[1])
    decoder = StreamingCode2Wav(code2wav)
    codes = [_codes(40, 1), _codes(40, 2), _codes(40, 3)]
    bounds = [[0, 3, 20, 40], [0, 3, 20, 40], [0, 1, 2, 40]]
    streams = [decoder.new_stream() for _ in codes]
    batched = [
        decoder.decode(streams, [c[:, b[step] : b[step + 1]] for c, b in zip(codes, bounds, strict=True)])
        for step in range(3)
    ]
    is_split = row_stack_bytes == 1
    # each step: streams 0 and 1 share a chunk length, stream 2 has its own; split, the pair runs a row at a time
    assert rows_per_call == ([2, 1, 1, 1] if is_split else [2, 1]) * 3
    for k in range(len(codes)):
        single = np.concatenate(_stream(decoder, codes[k], bounds[k]))
        assert_audio_equal(np.concatenate([chunks[k] for chunks in batched]), single)


# --- both decoders: Qwen3-Omni's code2wav and Qwen3-TTS's 12 Hz decoder --------------------------------------

# Streamed vs one-shot: the conv stack's layers run over each chunk's inputs (and their kept tails) instead of
# the whole signal, and oneDNN rounds a convolution's sums by its input length; measured on the tiny models, the
# conv stack alone (the same transformer output in) ≤ 3e-5 of the peak (Qwen3-TTS's unit-gain convolutions carry a
# 1-LSB difference furthest; Qwen3-Omni's ~5e-7), the whole decoder the same; a dropped state moves it ≥ 1e-2.
SWEEP_REL = 1e-4


@pytest.fixture(scope="module", params=["qwen3_omni", "qwen3_tts"])
def decoders(request):
    """(streaming decoder, one-shot decode of codes [16, T] → numpy, code range) of either family. Qwen3-Omni's
    ConvNeXt blocks get unit gammas (their init, 1e-6, would make those blocks' states inaudible)."""
    if request.param == "qwen3_omni":
        config = tiny_qwen3_omni_config().code2wav_config
        config.num_hidden_layers = 2
        with torch.random.fork_rng():
            torch.manual_seed(0)
            code2wav = Qwen3OmniMoeCode2Wav(config).eval()
        with torch.no_grad():
            for blocks in code2wav.upsample:
                blocks[1].gamma.fill_(1.0)
        scale_code2wav_to_speech_level(code2wav)

        def one_shot(codes):
            with torch.no_grad():
                return code2wav(codes[None])[0, 0].numpy()
        return StreamingCode2Wav(code2wav), one_shot, 128
    tts = tiny_speech_tokenizer(seed=0)
    return tts._streaming, tts.decode, 2048


def _sweep_codes(num_frames, seed, code_range):
    return torch.randint(0, code_range, (16, num_frames), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sizes", [[1], [2], [3], [7], [25], [1, 2, 3, 7, 25, 4]], ids=lambda s: "-".join(map(str, s)))
def test_chunk_size_sweep_joins_into_the_one_shot_decode(decoders, sizes):
    """Chunks of 1, 2, 3, 7 and 25 frames, and mixed sizes, join into the one-shot decode (within SWEEP_REL of its
    peak), each chunk the samples the one-shot decode has in its place (1920 a frame; Qwen3-Omni's first chunk 555
    fewer)."""
    decoder, one_shot, code_range = decoders
    num_frames = max(50, sum(sizes))
    bounds = [0]
    while bounds[-1] < num_frames:
        bounds.append(min(bounds[-1] + sizes[(len(bounds) - 1) % len(sizes)], num_frames))
    codes = _sweep_codes(num_frames, len(sizes), code_range)
    chunks = _stream(decoder, codes, bounds)
    assert [len(c) for c in chunks] == [decoder.num_samples(b) - decoder.num_samples(a)
                                        for a, b in zip(bounds, bounds[1:], strict=False)]
    assert_audio_close(np.concatenate(chunks), one_shot(codes), rel=SWEEP_REL)


def test_every_layer_keeps_its_own_state(decoders):
    """Each stateful layer's kept inputs reach the next chunk: zeroing any one layer's state between two chunks
    moves that chunk beyond the streaming tolerance. The states are as wide as each layer needs: K − 1 inputs
    (dilation included) for a causal conv, ⌈k/s⌉ − 1 for a transposed conv."""
    decoder, _, code_range = decoders
    codes = _sweep_codes(6, 9, code_range)
    kinds = [decoder._kinds[m] for m in decoder.state_layers]
    widths = {(kind, state.shape[-1]) for kind, state in zip(kinds, decoder.new_conv_states(), strict=True)}
    # dilations 1, 3, 9; the upsamplers' transposed convs (kernel = stride) keep nothing, the blocks' one input
    assert widths == {("causal", 6), ("causal", 18), ("causal", 54), ("transposed", 0), ("transposed", 1)}
    reference = decoder.new_stream()
    decoder.decode([reference], [codes[:, :3]])
    expected = decoder.decode([reference], [codes[:, 3:]])[0]
    peak = float(np.abs(expected).max())
    for slot, module in enumerate(decoder.state_layers):
        if decoder.new_conv_states()[slot].shape[-1] == 0:
            continue  # a transposed conv whose kernel is its stride: nothing to keep
        stream = decoder.new_stream()
        decoder.decode([stream], [codes[:, :3]])
        stream.conv_states[slot] = torch.zeros_like(stream.conv_states[slot])
        moved = float(np.abs(decoder.decode([stream], [codes[:, 3:]])[0] - expected).max())
        assert moved > 2 * SWEEP_REL * peak, (slot, type(module).__name__)


def _conv_stack_flops(decoder, codes, history: int) -> int:
    """FLOPs (torch's FLOP counter) of the conv stack for the chunk codes [16, n] of a stream that decoded
    `history` zero frames before it."""
    from torch.utils.flop_counter import FlopCounterMode

    stream = decoder.new_stream()
    if history:
        decoder.decode([stream], [torch.zeros(16, history, dtype=torch.long)])
    hidden = decoder._advance_transformer([stream], [codes])[0][None]
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        decoder._conv_stack(hidden, [stream], False)
    return counter.get_total_flops()


def test_a_chunk_runs_its_own_frames_convolutions_only(decoders):
    """The conv stack's FLOPs for a chunk of n frames do not depend on what the stream decoded before (no left
    context is recomputed), and are n frames' worth of a 25-frame chunk's plus at most 1 % (each transposed conv's
    one kept input; measured 0.85 % at n = 1)."""
    decoder, _, code_range = decoders
    codes = _sweep_codes(25, 4, code_range)
    per_frame = _conv_stack_flops(decoder, codes, 0) / 25
    for n in (1, 2, 4):
        flops = _conv_stack_flops(decoder, codes[:, :n], 20)
        assert flops == _conv_stack_flops(decoder, codes[:, :n], 0) == _conv_stack_flops(decoder, codes[:, :n], 3)
        assert n * per_frame <= flops <= 1.01 * n * per_frame


def test_bad_codes(code2wav):
    decoder = StreamingCode2Wav(code2wav)
    with pytest.raises(ValueError, match="codes"):
        decoder.decode([decoder.new_stream()], [torch.zeros(15, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="codes"):
        decoder.decode([decoder.new_stream()], [])


def test_pointwise_convolutions_skip_the_pad_and_keep_every_bit(code2wav):
    """The streamed decoders run their kernel-1 causal convolutions without transformers' zero-width pad copy:
    the same output bit for bit; wider kernels keep transformers' forward."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCausalConvNet

    from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder
    from omnimtp.codec.streaming import PointwiseCausalConv, use_unpadded_pointwise_convs

    torch.manual_seed(2)
    convs = [Qwen3OmniMoeCausalConvNet(24, 16, 1), Qwen3OmniMoeCausalConvNet(24, 16, 7, dilation=3)]
    x = torch.randn(2, 24, 300)
    with torch.no_grad():
        expected = [conv(x) for conv in convs]
        for conv in convs:
            use_unpadded_pointwise_convs(conv)
        assert [type(conv) for conv in convs] == [PointwiseCausalConv, Qwen3OmniMoeCausalConvNet]
        for conv, want in zip(convs, expected, strict=True):
            assert torch.equal(conv(x), want)
    StreamingCode2Wav(code2wav)
    decoder = SpeechTokenizerDecoder.tiny()
    for module in (code2wav, decoder):
        pointwise = [m for m in module.modules() if isinstance(m, Qwen3OmniMoeCausalConvNet) and m.kernel_size == 1]
        assert pointwise and all(type(m) is PointwiseCausalConv for m in pointwise)


def test_short_chunks_run_the_linears_and_convolutions_on_the_row_kernel_within_rounding(code2wav, monkeypatch):
    """A stream's chunks of up to ROW_KERNEL_MAX_ROWS rows a request run the decoder's linear layers (its
    transformer's, the ConvNeXt blocks') and its causal convolutions (dilated, pointwise) on omnimtp's row
    kernel, each within float rounding of the module's own forward (which runs when the kernel is off), the
    decoder's audio too; batched streams stay bit for bit themselves. The tiny model's matrices are under the
    kernel's minimum: it is lowered here."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCausalConvNet

    from omnimtp.codec.streaming import PointwiseCausalConv, RowKernelCausalConv, RowKernelLinear
    from omnimtp.runtime.kernels import small_batch_linear

    if not small_batch_linear.available():
        pytest.skip(f"no row kernel here: {small_batch_linear.unavailable_reason()}")
    decoder = StreamingCode2Wav(code2wav)
    linears = [m for m in code2wav.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is RowKernelLinear for m in linears)
    convs = [m for m in code2wav.modules()
             if isinstance(m, Qwen3OmniMoeCausalConvNet) and m.stride == 1 and m.conv.groups == 1]  # not depthwise
    assert {type(m) for m in convs} == {RowKernelCausalConv, PointwiseCausalConv}
    assert any(m.dilation > 1 for m in convs if type(m) is RowKernelCausalConv)
    kernel_rows = []
    run = small_batch_linear._run
    monkeypatch.setattr(small_batch_linear, "_run", lambda x, *rest: kernel_rows.append(x.shape[0]) or run(x, *rest))
    codes = _codes(5, seed=5)
    _stream(decoder, codes, [0, 1, 5])
    # the conv stack's matrices are under the minimum; the transformer's layers (qkv, o, gate/up, down) always take
    # the kernel (their rows, every stream's in one forward, must not depend on the other streams)
    assert kernel_rows == [1] * 4 * code2wav.config.num_hidden_layers + [4] * 4 * code2wav.config.num_hidden_layers
    monkeypatch.setattr(streaming, "ROW_KERNEL_MIN_WEIGHTS", 0)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for module in convs:
            x = torch.randn(2, module.conv.in_channels, 9, generator=generator)
            kernel_rows.clear()
            ours = module(x)
            assert kernel_rows == [2 * 9]  # both rows' steps in one call
            expected = Qwen3OmniMoeCausalConvNet.forward(module, x)
            torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    ours = np.concatenate(_stream(decoder, codes, [0, 1, 5]))
    assert 1 in kernel_rows  # the first chunk's frame through the transformer's linears
    test_batched_streams_equal_single_streams_bit_for_bit(code2wav, streaming.ROW_STACK_BYTES, monkeypatch)
    kernel_rows.clear()
    monkeypatch.setattr(streaming, "ROW_KERNEL_MAX_ROWS", 0)
    theirs = np.concatenate(_stream(decoder, codes, [0, 1, 5]))
    assert not kernel_rows
    assert_audio_close(ours, theirs, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_snake_is_transformers_snake_bit_for_bit(code2wav, dtype):
    """The streamed decoders run SnakeBeta in one buffer (no gradient) and as transformers does under
    autograd: the same values either way, and the module's parameters stay where they are."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

    from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder
    from omnimtp.codec.streaming import InplaceSnakeBeta, use_inplace_snake

    torch.manual_seed(1)
    snake = Qwen3OmniMoeSnakeBeta(24).to(dtype)
    with torch.no_grad():
        snake.alpha.normal_(), snake.beta.normal_()
    x = (torch.randn(3, 24, 500) * 4).to(dtype)
    before = x.clone()
    with torch.no_grad():
        expected = snake(x)
    use_inplace_snake(snake)
    assert type(snake) is InplaceSnakeBeta
    with torch.no_grad():
        assert torch.equal(snake(x), expected)
    assert torch.equal(x, before)  # the input is not written to
    x.requires_grad_(True)
    out = snake(x)  # under autograd: transformers' forward, differentiable
    assert torch.equal(out.detach(), expected) and out.requires_grad
    StreamingCode2Wav(code2wav)
    assert not any(type(m) is Qwen3OmniMoeSnakeBeta for m in code2wav.modules())
    assert any(type(m) is InplaceSnakeBeta for m in SpeechTokenizerDecoder.tiny().modules())


# code2wav's conv stack in bf16 (`conv_dtype`, the `codec_dtype="bfloat16"` opt-in) against fp32: measured 31.1 dB
# SNR at the released widths (random weights, benchmarks/omni_codec.py) and 40-41 dB on the tiny models, whose
# narrower convolutions sum fewer rounded products; streamed chunks against a one-shot decode of all frames
# differ where a layer rounds its sums to bf16 otherwise (a short input's bf16 matmul, a long one's oneDNN
# convolution: `streaming.SHORT_MATMUL_MAX_STEPS`) and the stack carries it.
BF16_MIN_SNR_DB = 20.0
BF16_STREAM_SNR_DB = 20.0
BF16_STREAM_FP32_SNR_LOSS_DB = 1.0


def _snr_db(actual, expected) -> float:
    expected = np.asarray(expected, dtype=np.float64)
    return float(10 * np.log10((expected**2).sum() / ((np.asarray(actual, dtype=np.float64) - expected) ** 2).sum()))


def test_a_bf16_conv_stack_runs_on_a_copy_and_keeps_the_streaming_guarantees(code2wav):
    """conv_dtype=torch.bfloat16: the conv stack runs on a bf16 copy that shares the embedding and transformer,
    the given code2wav keeps its float32 weights and values; the audio is float32 and audible, within
    BF16_MIN_SNR_DB of the fp32 decoder's and not equal to it, its streamed chunks join into a one-shot decode
    of all frames, and a stream's audio does not depend on the streams decoded beside it."""
    before = {name: tensor.clone() for name, tensor in code2wav.state_dict().items()}
    fp32 = StreamingCode2Wav(code2wav)
    bf16 = StreamingCode2Wav(code2wav, conv_dtype=torch.bfloat16)
    assert fp32.conv_dtype == torch.float32 and bf16.conv_dtype == torch.bfloat16
    assert bf16.code2wav is not code2wav and bf16.code2wav.pre_transformer is code2wav.pre_transformer
    after = code2wav.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert {p.dtype for p in code2wav.parameters()} == {torch.float32}
    assert StreamingCode2Wav(code2wav, conv_dtype=torch.float32).code2wav is code2wav  # no copy when none is needed

    codes = [_codes(40, 7), _codes(40, 8)]
    one_shot = np.concatenate(_stream(bf16, codes[0], [0, 40]))
    assert one_shot.dtype == np.float32 and one_shot.shape == (1920 * 40 - 555,)
    assert_audible(one_shot)
    assert BF16_MIN_SNR_DB <= _snr_db(one_shot, np.concatenate(_stream(fp32, codes[0], [0, 40]))) < 60  # it ran in bf16
    bounds = [0, 1, 14, 40]
    alone = np.concatenate(_stream(bf16, codes[0], bounds))
    assert _snr_db(alone, one_shot) >= BF16_STREAM_SNR_DB
    reference = np.concatenate(_stream(fp32, codes[0], [0, 40]))
    # the streamed chunks as close to fp32 as the one-shot decode
    assert _snr_db(alone, reference) >= _snr_db(one_shot, reference) - BF16_STREAM_FP32_SNR_LOSS_DB
    streams = [bf16.new_stream() for _ in codes]
    together = [bf16.decode(streams, [c[:, a:b] for c in codes]) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert_audio_equal(np.concatenate([chunks[0] for chunks in together]), alone)


def test_conv_dtype_values():
    """codec_dtype names map to the stack's dtype; anything else is a ValueError naming codec_dtype."""
    from omnimtp.codec.streaming import codec_dtype_of

    assert codec_dtype_of(None) == codec_dtype_of("float32") == torch.float32
    assert codec_dtype_of("bfloat16") == torch.bfloat16
    for bad in ("float16", "bf16", torch.bfloat16, 1):
        with pytest.raises(ValueError, match="codec_dtype"):
            codec_dtype_of(bad)
