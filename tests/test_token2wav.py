"""Qwen2.5-Omni token2wav: one-shot == transformers bit for bit; streamed chunks are deterministic, have the
one-shot length, stay close to it, and do not depend on the other streams of a call."""

import numpy as np
import pytest
import torch
from audio_checks import assert_audible, assert_audio_equal
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

from omnimtp.codec.token2wav import StreamingToken2Wav, scale_token2wav_weights
from omnimtp.models.tiny_qwen2_5_omni import tiny_qwen2_5_omni_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLES_PER_CODE = 480
NUM_CODES = 100


@pytest.fixture(scope="module")
def token2wav():
    config = tiny_qwen2_5_omni_config().token2wav_config
    config.bigvgan_config.upsample_initial_channel = 64  # BigVGAN halves it 6 times
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2_5OmniToken2WavModel(config).eval()
    scale_token2wav_weights(model, generator=torch.Generator().manual_seed(0))
    return model


@pytest.fixture(scope="module")
def speaker():
    g = torch.Generator().manual_seed(1)
    return {"cond": torch.randn(16, generator=g), "ref_mel": torch.randn(1, 8, 80, generator=g)}


def _codes(num_codes, seed=0, high=65):
    return torch.randint(0, high, (1, num_codes), generator=torch.Generator().manual_seed(seed))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _snr_db(actual, expected):
    error = np.asarray(actual, np.float64) - np.asarray(expected, np.float64)
    return 10 * np.log10(np.sum(np.asarray(expected, np.float64) ** 2) / np.sum(error**2))


def _stream(decoder, speaker, codes, bounds, seed):
    """Decode codes in blocks [bounds[i], bounds[i+1]), the last one final → the chunks."""
    stream = decoder.new_stream(speaker["cond"], speaker["ref_mel"], _gen(seed))
    pairs = list(zip(bounds, bounds[1:], strict=False))
    return [decoder.decode([stream], [codes[:, a:b]], [i == len(pairs) - 1])[0] for i, (a, b) in enumerate(pairs)]


def test_one_shot_is_transformers_with_the_global_rng(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav)
    codes = _codes(NUM_CODES)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = token2wav(codes, speaker["cond"][None], speaker["ref_mel"]).numpy()
    torch.manual_seed(7)
    actual = decoder.one_shot(codes, speaker["cond"], speaker["ref_mel"], None)
    assert actual.dtype == np.float32 and actual.shape == (SAMPLES_PER_CODE * NUM_CODES,)
    assert_audio_equal(actual, expected)
    torch.manual_seed(8)
    assert not np.array_equal(decoder.one_shot(codes, speaker["cond"], speaker["ref_mel"], None), expected)


def test_one_shot_with_a_generator_is_one_randn_from_it(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav, num_steps=6, guidance_scale=0.3, sway_coefficient=-0.5)
    codes = _codes(40, seed=3)
    torch.manual_seed(11)  # the default generator seeded 11 draws what a fresh Generator seeded 11 draws
    with torch.no_grad():
        expected = token2wav(
            codes, speaker["cond"][None], speaker["ref_mel"], num_steps=6, guidance_scale=0.3, sway_coefficient=-0.5
        ).numpy()
    torch.manual_seed(0)
    actual = decoder.one_shot(codes[0], speaker["cond"], speaker["ref_mel"], _gen(11))  # [T] codes
    assert_audio_equal(actual, expected)


def test_one_shot_without_guidance_is_transformers(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav, guidance_scale=0.0)
    codes = _codes(30, seed=4)
    torch.manual_seed(5)
    with torch.no_grad():
        expected = token2wav(codes, speaker["cond"][None], speaker["ref_mel"], guidance_scale=0.0).numpy()
    assert_audio_equal(decoder.one_shot(codes, speaker["cond"], speaker["ref_mel"], _gen(5)), expected)


def test_a_single_final_block_is_the_one_shot_decode(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav, chunk_frames=25)
    codes = _codes(NUM_CODES)
    expected = decoder.one_shot(codes, speaker["cond"], speaker["ref_mel"], _gen(3))
    assert_audio_equal(_stream(decoder, speaker, codes, [0, NUM_CODES], seed=3)[0], expected)
    torch.manual_seed(9)
    stream = decoder.new_stream(speaker["cond"], speaker["ref_mel"], None)
    (actual,) = decoder.decode([stream], [codes], [True])
    torch.manual_seed(9)
    assert_audio_equal(actual, decoder.one_shot(codes, speaker["cond"], speaker["ref_mel"], None))


def test_streamed_noise_is_the_one_shot_noise(token2wav, speaker):
    """The stream's lazy draws, joined, are the one-shot's single randn (a property of CPU randn on whole
    mel frames of 80 values) — so streamed vs one-shot differ by the chunking alone."""
    decoder = StreamingToken2Wav(token2wav, chunk_frames=25)
    draws = []
    draw_noise = decoder._draw_noise
    decoder._draw_noise = lambda *args: draws.append(draw_noise(*args)) or draws[-1]
    codes = _codes(NUM_CODES)
    stream = decoder.new_stream(speaker["cond"], speaker["ref_mel"], _gen(3))
    for start in range(0, NUM_CODES, 13):
        decoder.decode([stream], [codes[:, start : start + 13]], [start + 13 >= NUM_CODES])
    assert len(draws) > 3
    expected = torch.randn([1, 2 * NUM_CODES, 80], generator=_gen(3))
    assert torch.equal(torch.cat(draws, dim=1), expected)


def test_a_stream_keeps_only_the_tail_later_windows_read(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav, chunk_frames=25, look_back_frames=24, vocoder_context_frames=16)
    codes = _codes(NUM_CODES)
    stream = decoder.new_stream(speaker["cond"], speaker["ref_mel"], _gen(3))
    decoder.decode([stream], [codes[:, :90]], [False])  # chunks 0-2 final; chunk 3's window starts at code 48
    assert stream.num_chunks == 3 and stream.codes_start == 48 and stream.noise_start == 96
    assert stream.num_codes == 90 and stream.codes.shape[1] == 42
    assert stream.num_samples == (150 - 32) * 240 and stream.mel_start == 150 - 64  # 16 codes of context kept


@pytest.mark.parametrize("chunk_frames", [25, 50])
def test_streamed_chunks_have_the_one_shot_length_and_stay_close(token2wav, speaker, chunk_frames):
    decoder = StreamingToken2Wav(token2wav, chunk_frames=chunk_frames)
    codes = _codes(NUM_CODES)
    one_shot = decoder.one_shot(codes, speaker["cond"], speaker["ref_mel"], _gen(3))
    bounds = list(range(0, NUM_CODES, 10)) + [NUM_CODES]
    chunks = _stream(decoder, speaker, codes, bounds, seed=3)
    assert [len(c) for c in chunks[:2]] == [0, 0]  # the first chunk waits for its look-ahead codes
    assert all(len(c) % 240 == 0 for c in chunks)
    streamed = np.concatenate(chunks)
    assert streamed.shape == one_shot.shape == (SAMPLES_PER_CODE * NUM_CODES,)
    assert_audible(streamed)
    assert not np.array_equal(streamed, one_shot)  # chunking is an approximation of the one-shot DiT
    assert _snr_db(streamed, one_shot) > 30.0  # measured 56-62 dB on these weights
    assert_audio_equal(np.concatenate(_stream(decoder, speaker, codes, bounds, seed=3)), streamed)  # same seed
    other_seed = np.concatenate(_stream(decoder, speaker, codes, bounds, seed=4))
    assert _snr_db(other_seed, streamed) < 20.0  # the noise comes from the stream's generator


def test_each_seam_is_the_linear_crossfade_of_the_two_windows(token2wav, speaker):
    """Chunk k's first F = crossfade_frames·repeats mel frames are the previous window's look-ahead mel
    times (1 − w_i) plus this window's mel times w_i, w_i = (i + 1) / (F + 1) rising towards the new window;
    every other frame of a chunk is its window's own mel. Checked on every chunk of a stream (the SNR test
    above cannot see a wrong fade)."""
    decoder = StreamingToken2Wav(token2wav, chunk_frames=25)
    r, num_fade = decoder.repeats, decoder.crossfade_frames * decoder.repeats
    windows, chunks = [], []
    sample, finalize = decoder._sample, decoder._finalize_chunk

    def record_window(*args):
        windows.append(sample(*args))
        return windows[-1]

    def record_chunk(stream, chunk_end):
        chunk_start, num_mel = stream.num_chunks * decoder.chunk_frames, stream.num_mel_frames
        finalize(stream, chunk_end)
        chunks.append((chunk_start, chunk_end, stream.mel[:, num_mel - stream.mel_start :].clone()))

    decoder._sample, decoder._finalize_chunk = record_window, record_chunk
    _stream(decoder, speaker, _codes(NUM_CODES), list(range(0, NUM_CODES, 10)) + [NUM_CODES], seed=3)
    assert len(chunks) == len(windows) == 4
    previous_ahead = None
    for (chunk_start, chunk_end, mel), window in zip(chunks, windows, strict=True):
        window_start = decoder._window_start_mel(chunk_start)
        own = window[:, chunk_start * r - window_start : chunk_end * r - window_start]
        assert mel.shape == own.shape
        if previous_ahead is None:
            assert torch.equal(mel, own)  # the first chunk has no seam
        else:
            assert (previous_ahead[:, :num_fade] - own[:, :num_fade]).abs().max() > 1e-2  # the fade matters
            weight = (torch.arange(1, num_fade + 1, dtype=mel.dtype) / (num_fade + 1))[None, :, None]
            faded = previous_ahead[:, :num_fade] * (1 - weight) + own[:, :num_fade] * weight
            torch.testing.assert_close(mel[:, :num_fade], faded, rtol=0, atol=1e-6)
            assert torch.equal(mel[:, num_fade:], own[:, num_fade:])
        previous_ahead = window[:, chunk_end * r - window_start :]


def test_streamed_audio_does_not_depend_on_the_block_split(token2wav, speaker):
    """Chunks run at fixed code positions, so only the codes known before the final call matter."""
    decoder = StreamingToken2Wav(token2wav, chunk_frames=25)
    codes = _codes(NUM_CODES)
    tens = np.concatenate(_stream(decoder, speaker, codes, [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], seed=3))
    ragged = np.concatenate(_stream(decoder, speaker, codes, [0, 1, 37, 38, 64, 90, 100], seed=3))
    assert_audio_equal(ragged, tens)


def test_a_stream_does_not_depend_on_the_other_streams_of_a_call(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav, chunk_frames=25)
    codes = [_codes(NUM_CODES, seed=0), _codes(70, seed=1)]
    bounds = [[0, 40, 80, NUM_CODES], [0, 30, 60, 70]]
    alone = [np.concatenate(_stream(decoder, speaker, codes[i], bounds[i], seed=20 + i)) for i in range(2)]
    streams = [decoder.new_stream(speaker["cond"], speaker["ref_mel"], _gen(20 + i)) for i in range(2)]
    together = [[], []]
    for step in range(3):
        blocks = [codes[i][:, bounds[i][step] : bounds[i][step + 1]] for i in range(2)]
        for i, chunk in enumerate(decoder.decode(streams, blocks, [step == 2, step == 2])):
            together[i].append(chunk)
    for i in range(2):
        assert_audio_equal(np.concatenate(together[i]), alone[i])


def test_empty_blocks(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav, chunk_frames=25)
    codes = _codes(50)
    stream = decoder.new_stream(speaker["cond"], speaker["ref_mel"], _gen(3))
    (nothing,) = decoder.decode([stream], [codes[:, :0]], [False])
    assert nothing.dtype == np.float32 and nothing.shape == (0,)
    decoder.decode([stream], [codes], [False])
    (rest,) = decoder.decode([stream], [codes[:, :0]], [True])  # an empty final block flushes
    assert stream.num_samples == SAMPLES_PER_CODE * 50 and len(rest) > 0


def test_bad_inputs_name_the_argument(token2wav, speaker):
    decoder = StreamingToken2Wav(token2wav)
    cond, ref = speaker["cond"], speaker["ref_mel"]
    with pytest.raises(ValueError, match="codes"):
        decoder.one_shot(torch.zeros(2, 5, dtype=torch.long), cond, ref, None)
    with pytest.raises(ValueError, match="codes"):
        decoder.one_shot(torch.tensor([[1, 2, 66]]), cond, ref, None)  # the embedding has 66 rows
    with pytest.raises(ValueError, match="codes"):
        decoder.one_shot(torch.tensor([[1, -1]]), cond, ref, None)
    with pytest.raises(ValueError, match="codes"):
        decoder.one_shot(torch.zeros(1, 0, dtype=torch.long), cond, ref, None)
    with pytest.raises(ValueError, match="codes"):
        decoder.one_shot(torch.zeros(1, 5), cond, ref, None)  # float codes
    with pytest.raises(ValueError, match="conditioning"):
        decoder.one_shot(_codes(5), torch.zeros(1, 15), ref, None)
    with pytest.raises(ValueError, match="reference_mel"):
        decoder.new_stream(cond, torch.zeros(1, 8, 79), None)
    stream = decoder.new_stream(cond, ref, _gen(0))
    with pytest.raises(ValueError, match="blocks"):
        decoder.decode([stream], [_codes(5)[0]], [False])  # [n] instead of [1, n]
    with pytest.raises(ValueError, match="blocks"):
        decoder.decode([stream], [torch.tensor([[70]])], [False])
    with pytest.raises(ValueError, match="blocks"):
        decoder.decode([stream], [], [False])
    with pytest.raises(ValueError, match="is_final"):
        decoder.decode([stream], [_codes(5)], [])
    decoder.decode([stream], [_codes(5)], [True])
    with pytest.raises(ValueError, match="streams"):
        decoder.decode([stream], [_codes(5)], [True])
    with pytest.raises(ValueError, match="crossfade_frames"):
        StreamingToken2Wav(token2wav, look_ahead_frames=2, crossfade_frames=3)
    with pytest.raises(ValueError, match="chunk_frames"):
        StreamingToken2Wav(token2wav, chunk_frames=0)
    with pytest.raises(ValueError, match="look_back_frames"):
        StreamingToken2Wav(token2wav, look_back_frames=-1)
