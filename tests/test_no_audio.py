"""A request whose talker ends before its first frame says so (`finish_reason` "no_audio", and for speech
the `X-Finish-Reason` header), and every response is still a valid file of its format. The seeds are ones
whose sampled talker emits codec EOS at once on the tiny models."""

from __future__ import annotations

import base64
import io
import json
import struct

import httpx
import numpy as np
import pytest
import soundfile as sf
from server_harness import running_server

from omnimtp.families.qwen2_5_omni import Qwen2_5OmniFamily
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.server.app import create_app
from omnimtp.server.audio import encode_audio
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEECH = {"input": "Good morning", "voice": "Ethan", "seed": 2005, "temperature": 1.0}  # Qwen2.5 tiny: no frame
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "seed": 3, "temperature": 0.8, "max_tokens": 4,
        "modalities": ["text", "audio"]}  # Qwen3 tiny: no frame


def _check_empty_flac(data: bytes, sample_rate: int) -> None:
    """A FLAC stream of no frames: marker, one STREAMINFO block (the last), nothing after it (RFC 9639)."""
    assert data[:4] == b"fLaC" and data[4] == 0x80 and int.from_bytes(data[5:8], "big") == 34 and len(data) == 42
    min_block, max_block = struct.unpack(">HH", data[8:12])
    assert 16 <= min_block <= max_block
    fields = int.from_bytes(data[18:26], "big")
    assert (fields >> 44, (fields >> 41) & 7, (fields >> 36) & 31) == (sample_rate, 0, 15)  # mono, 16 bits
    with sf.SoundFile(io.BytesIO(data)) as flac:  # libsndfile reads its header
        assert (flac.format, flac.samplerate, flac.channels, flac.subtype) == ("FLAC", sample_rate, 1, "PCM_16")


def _check_empty_wav(data: bytes, sample_rate: int) -> None:
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == sample_rate and samples.size == 0
    assert struct.unpack("<I", data[40:44])[0] == 0 and len(data) == 44  # an exact data size: 0


def test_no_samples_is_a_valid_file_of_every_format():
    empty = np.zeros(0, dtype=np.float32)
    _check_empty_wav(encode_audio(empty, 24_000, "wav"), 24_000)
    _check_empty_flac(encode_audio(empty, 24_000, "flac"), 24_000)
    assert encode_audio(empty, 24_000, "pcm") == encode_audio(empty, 24_000, "pcm16") == b""
    one = encode_audio(np.full(5, 0.25, dtype=np.float32), 24_000, "flac")  # with samples: libsndfile's file
    assert sf.read(io.BytesIO(one), dtype="int16")[0].tolist() == [8192] * 5


def test_speech_without_a_frame_is_a_valid_empty_file_that_says_so():
    engine = Engine(Qwen2_5OmniFamily.tiny(0), max_frames=50, max_batch_size=2)
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        for fmt in ("wav", "flac", "pcm"):
            response = http.post("/v1/audio/speech", json={**SPEECH, "response_format": fmt})
            assert response.status_code == 200
            assert response.headers["x-finish-reason"] == "no_audio", fmt
            {"wav": _check_empty_wav, "flac": _check_empty_flac}.get(fmt, lambda data, _: data == b"")(
                response.content, 24_000)
            assert fmt != "pcm" or response.content == b""
        response = http.post("/v1/audio/speech", json={**SPEECH, "stream_format": "sse", "response_format": "pcm"})
        assert response.status_code == 200 and response.headers["x-finish-reason"] == "no_audio"
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        assert [event["type"] for event in events] == ["speech.audio.done"]
        wav = http.post("/v1/audio/speech", json={**SPEECH, "stream_format": "sse", "response_format": "wav"})
        wav_events = [json.loads(line[6:]) for line in wav.text.splitlines() if line.startswith("data: ")]
        assert [event["type"] for event in wav_events] == ["speech.audio.delta", "speech.audio.done"]
        header = base64.b64decode(wav_events[0]["audio"])  # the deltas joined: a streamed WAV of no samples
        samples, rate = sf.read(io.BytesIO(header), dtype="int16")
        assert len(header) == 44 and rate == 24_000 and samples.size == 0
        assert events[0]["finish_reason"] == "no_audio" and events[0]["usage"]["output_tokens"] == 0
        # a request that does speak: streamed WAV carries no finish header, its SSE end says "stop" or "length"
        spoken = {**SPEECH, "seed": 1, "temperature": 0.0}
        response = http.post("/v1/audio/speech", json=spoken)
        assert response.status_code == 200 and "x-finish-reason" not in response.headers
        assert sf.read(io.BytesIO(response.content), dtype="int16")[0].size > 0
        response = http.post("/v1/audio/speech", json={**spoken, "response_format": "flac"})
        assert response.headers["x-finish-reason"] in ("stop", "length")


def test_chat_without_a_frame_says_no_audio():
    family = Qwen3OmniFamily.tiny(0)
    engine = Engine(family, max_frames=100, max_batch_size=2)
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        for fmt in ("wav", "flac", "pcm16"):
            response = http.post("/v1/chat/completions", json={**CHAT, "audio": {"voice": "ethan", "format": fmt}})
            assert response.status_code == 200
            reply = response.json()
            assert reply["choices"][0]["finish_reason"] == "no_audio"
            assert reply["usage"]["completion_tokens"] == 4
            assert reply["usage"]["completion_tokens_details"]["audio_tokens"] == 0
            data = base64.b64decode(reply["choices"][0]["message"]["audio"]["data"])
            {"wav": _check_empty_wav, "flac": _check_empty_flac}.get(fmt, lambda data, _: None)(data, 24_000)
            assert fmt != "pcm16" or data == b""
        body = {**CHAT, "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["no_audio"]
        assert not any("data" in c["choices"][0]["delta"].get("audio", {}) for c in chunks)
    sampling = SamplingParams(temperature=0.8)
    output = OmniPipeline(family=family).generate(
        "Hello there", thinker_sampling=sampling, talker_sampling=family.sampled_talker(sampling), seed=3,
        max_new_tokens=4, max_frames=100)
    assert output.finish_reason == "no_audio" and output.audio.size == 0 and output.codes.shape[-1] == 0
    assert output.talker_finish_reason == "stop"  # the talker itself stopped: codec EOS
