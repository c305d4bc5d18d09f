"""MP3, Opus (Ogg) and AAC: each decodes, with a decoder we did not write (libsndfile for MP3 and Opus, FFmpeg
through PyAV for AAC), to the PCM path's samples within its codec's error; a stream's bytes are the whole
file's; the speech route streams them and the CLI writes them by extension."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import openai
import pytest
import soundfile as sf
import soxr
from audio_checks import assert_audible
from server_harness import running_server

from omnimtp.families.qwen3_tts import Qwen3TTSFamily
from omnimtp.server.app import create_app
from omnimtp.server.audio import StreamEncoder, encode_audio, format_of_path, to_pcm16
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLE_RATE = 24_000
# Signal-to-error ratios (dB) each codec keeps on noise-like audio (the tiny models' speech, the hardest case
# for a perceptual codec) at our bit rates; a wrong rate, a lost or shifted chunk, or garbage falls below 3 dB.
# mp3 measured 11.4 dB on the tiny Qwen3-TTS's "Hello there." (seed 3), which moves with the decoder's rounding.
MIN_SNR_DB = {"mp3": 10.0, "opus": 6.0, "aac": 20.0}


def _decode(data: bytes, fmt: str) -> np.ndarray:
    """float samples at SAMPLE_RATE, decoded by libsndfile (mp3, opus) or FFmpeg (aac)."""
    if fmt == "aac":
        with av.open(io.BytesIO(data)) as container:
            rate = container.streams.audio[0].rate
            samples = np.concatenate([frame.to_ndarray()[0] for frame in container.decode(audio=0)])
    else:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    return samples if rate == SAMPLE_RATE else soxr.resample(samples, rate, SAMPLE_RATE)


def _snr_db(decoded: np.ndarray, reference: np.ndarray) -> float:
    """The reference's level over the error's, after aligning for the codec's delay (up to 3,000 samples)."""
    reference = to_pcm16(reference).astype(np.float64) / 32767.0
    assert_audible(reference)
    decoded = np.pad(decoded.astype(np.float64), (0, 3_000 + len(reference)))
    size = 1 << int(np.ceil(np.log2(len(decoded) + len(reference))))
    correlation = np.fft.irfft(np.fft.rfft(decoded, size) * np.conj(np.fft.rfft(reference, size)), size)
    delay = int(np.argmax(correlation[:3_000]))
    error = decoded[delay:delay + len(reference)] - reference
    return 10 * np.log10(float(reference @ reference) / float(error @ error))


def _noise_like(num_samples: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(num_samples) / SAMPLE_RATE)
    return (tone + 0.1 * rng.standard_normal(num_samples)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_lossy_formats_decode_to_the_pcm_samples_and_stream_as_the_whole_file(fmt):
    samples = _noise_like(SAMPLE_RATE)
    whole = encode_audio(samples, SAMPLE_RATE, fmt)
    assert _snr_db(_decode(whole, fmt), samples) >= MIN_SNR_DB[fmt]
    encoder = StreamEncoder(fmt, SAMPLE_RATE)
    parts = [encoder.push(samples[start:start + 1920]) for start in range(0, len(samples), 1920)]
    parts.append(encoder.finish())
    assert sum(1 for part in parts[:-1] if part) >= len(parts) // 2  # bytes leave as the audio comes
    streamed = _decode(b"".join(parts), fmt)  # (an Ogg stream's serial number is random: compare the samples)
    assert np.array_equal(streamed, _decode(whole, fmt))
    assert encode_audio(np.zeros(0, dtype=np.float32), SAMPLE_RATE, fmt) == b""


def test_a_file_name_picks_its_format():
    assert [format_of_path(f"a{ext}") for ext in (".wav", ".FLAC", ".mp3", ".opus", ".ogg", ".aac")] == [
        "wav", "flac", "mp3", "opus", "opus", "aac"]
    with pytest.raises(ValueError, match="--output must end in .wav, .flac, .mp3, .opus, .ogg, .aac, got 'a.m4a'"):
        format_of_path("a.m4a", "--output")


@pytest.fixture(scope="module")
def client():
    engine = Engine(Qwen3TTSFamily.tiny(0, "custom_voice"), model_id="tiny-tts", max_frames=12, max_batch_size=4)
    with running_server(create_app(engine)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_speech_route_streams_every_format_as_the_pcm_samples(client):
    request = dict(model="tiny-tts", voice="aiden", input="Hello there.", extra_body={"seed": 3})
    pcm = np.frombuffer(client.audio.speech.create(response_format="pcm", **request).content, dtype="<i2")
    reference = pcm.astype(np.float32) / 32767.0
    for fmt in ("mp3", "opus", "aac"):
        with client.audio.speech.with_streaming_response.create(response_format=fmt, **request) as response:
            assert response.headers["content-type"] == {"mp3": "audio/mpeg", "opus": "audio/ogg",
                                                        "aac": "audio/aac"}[fmt]
            data = b"".join(response.iter_bytes())
        assert np.array_equal(_decode(data, fmt), _decode(encode_audio(reference, SAMPLE_RATE, fmt), fmt))
        assert _snr_db(_decode(data, fmt), reference) >= MIN_SNR_DB[fmt], fmt


def test_speech_batch_route_gives_each_item_what_it_gets_alone(client):
    items = [{"input": "Hello there.", "voice": "aiden", "seed": 3, "temperature": 0.9, "response_format": "pcm"},
             {"input": "Good morning to you.", "voice": "vivian", "seed": 5, "temperature": 0.9,
              "response_format": "pcm"},
             {"input": "Hi.", "voice": "nobody", "seed": 1},
             {"input": "Short.", "voice": "aiden", "seed": 7, "response_format": "mp3"}]
    batch = client.post("/audio/speech/batch", body={"items": items}, cast_to=object)["data"]
    assert [item["index"] for item in batch] == [0, 1, 2, 3]
    assert batch[2]["error"]["param"] == "items[2].voice" and "nobody" in batch[2]["error"]["message"]
    for index in (0, 1):
        alone = client.audio.speech.create(model="tiny-tts", **{k: v for k, v in items[index].items()
                                                                if k in ("input", "voice", "response_format")},
                                           extra_body={"seed": items[index]["seed"], "temperature": 0.9}).content
        assert_audible(np.frombuffer(alone, dtype="<i2"))
        assert base64.b64decode(batch[index]["audio"]) == alone, index
    assert batch[3]["response_format"] == "mp3" and _decode(base64.b64decode(batch[3]["audio"]), "mp3").size


def test_a_whitespace_item_is_its_own_400_and_an_item_cut_at_max_frames_says_length(client):
    """A batch of a whitespace-only text and a text longer than 12 frames can say: the first item is an error
    of its own (400 naming items[0].input), not the batch's; the second is cut at the engine's max_frames with
    finish_reason "length"."""
    items = [{"input": " \n\t ", "voice": "aiden"},
             {"input": "This sentence is far longer than twelve frames of speech can say.", "voice": "aiden",
              "seed": 3, "response_format": "pcm"}]
    batch = client.post("/audio/speech/batch", body={"items": items}, cast_to=object)["data"]
    error = batch[0]["error"]
    assert (error["status"], error["param"], error["code"]) == (400, "items[0].input", "invalid_value")
    pcm = np.frombuffer(base64.b64decode(batch[1]["audio"]), dtype="<i2")
    assert batch[1]["finish_reason"] == "length" and len(pcm) == 12 * 1920  # 1920 samples a frame


def test_a_batch_items_schema_error_names_the_item_as_its_own_errors_do(client):
    """One spelling for an item's field: a schema error in item 1 is `items[1].speed`, as `items[2].voice` is."""
    items = [{"input": "Hi.", "voice": "aiden"}, {"input": "Hi.", "voice": "aiden", "speed": "fast"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/audio/speech/batch", body={"items": items}, cast_to=object)
    error = caught.value.body
    error = error.get("error", error)
    assert error["param"] == "items[1].speed" and error["message"].startswith("items[1].speed"), error
