"""Chat media over HTTP: input_audio and image_url parts, spoken to with the official `openai` client and
httpx. Bad media is a 400 with an OpenAI-style body naming the part, before anything is queued."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
from audio_checks import assert_audible
from media_samples import animated_gif, b64, encode, image_bytes, png_header, tone
from PIL import Image
from server_harness import running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.media import AUDIO_SAMPLING_RATE, MediaInputs, MediaLimits, chat_media_inputs, decode_audio
from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS
from omnimtp.sampling import SamplingParams
from omnimtp.server.app import create_app
from omnimtp.server.requests import EngineRequest
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = MediaLimits(max_audio_seconds=2.0, max_image_pixels=128 * 128, max_parts=3)
MAX_PROMPT_TOKENS = 80
AUDIO_PAD, IMAGE_PAD = THINKER_SPECIAL_TOKENS["<|audio_pad|>"], THINKER_SPECIAL_TOKENS["<|image_pad|>"]


@pytest.fixture(scope="module")
def family():
    return Qwen3OmniFamily.tiny(0)


@pytest.fixture(scope="module")
def engine(family):
    engine = Engine(family, max_frames=4, first_chunk_frames=2, chunk_frames=2, max_batch_size=4,
                    max_prompt_tokens=MAX_PROMPT_TOKENS, media_limits=LIMITS)
    submitted = []
    submit = engine.submit

    def recording_submit(request, **kwargs):
        submitted.append(request)
        return submit(request, **kwargs)

    engine.submit = recording_submit
    engine.submitted = submitted
    return engine


@pytest.fixture(scope="module")
def server(engine):
    with running_server(create_app(engine, max_tokens_limit=8)) as url:
        yield url


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def image_part(data: bytes, media_type: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{b64(data)}"}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


QUESTION = encode(tone(1.0, 24_000, hz=330.0), 24_000)  # 1 s: 13 audio pads
PHOTO = image_bytes(Image.effect_noise((64, 64), 50).convert("RGB"))  # 16 image pads
TEXT = {"type": "text", "text": "What is it?"}


# -- bad media: 400, an OpenAI body, param naming the part --------------------------------------------

_P = "messages.0.content.0"
_BAD_MEDIA = [
    ("wrong base64", user({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}),
     f"{_P}.input_audio.data", "invalid_value", "not valid base64"),
    ("empty audio data", user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
     f"{_P}.input_audio.data", "invalid_value", "is empty"),
    ("undecodable audio", user(audio_part(b"definitely not audio" * 8)), f"{_P}.input_audio.data", "invalid_value",
     "not audio that can be decoded"),
    ("ogg format", user(audio_part(encode(tone(0.5, 8_000), 8_000, "OGG"), "ogg")), f"{_P}.input_audio.format",
     "invalid_value", "'wav', 'mp3' or 'flac'"),
    ("m4a format", user(audio_part(b"\x00\x00\x00\x20ftypM4A ", "m4a")), f"{_P}.input_audio.format", "invalid_value",
     "'wav', 'mp3' or 'flac'"),
    ("flac bytes sent as wav", user(audio_part(encode(tone(0.5, 8_000), 8_000, "FLAC"), "wav")),
     f"{_P}.input_audio.data", "invalid_value", "format is 'wav' but the data is flac"),
    ("audio too long", user(audio_part(encode(tone(2.5, 8_000), 8_000))), f"{_P}.input_audio.data", "invalid_value",
     "over the limit of 2 s"),
    ("loud float audio", user(audio_part(encode(tone(0.5, 8_000) * 1e20, 8_000, "WAV", "FLOAT"))),
     f"{_P}.input_audio.data", "invalid_value", "beyond ±16"),
    ("zero-length audio", user(audio_part(encode(np.zeros((0, 1), np.float32), 16_000))), f"{_P}.input_audio.data",
     "invalid_value", "no samples"),
    ("10 ms of audio", user(audio_part(encode(tone(0.01, 16_000), 16_000))), f"{_P}.input_audio.data",
     "invalid_value", "shorter than 25 ms"),
    ("NaN audio", user(audio_part(encode(np.full((4_000, 1), np.nan, np.float32), 16_000))),
     f"{_P}.input_audio.data", "invalid_value", "NaN"),
    ("image_url http", user({"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}),
     f"{_P}.image_url.url", "invalid_value", "remote URLs are not fetched; send a data: URL"),
    ("image_url https", user({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
     f"{_P}.image_url.url", "invalid_value", "remote URLs are not fetched"),
    ("image_url file scheme", user({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}),
     f"{_P}.image_url.url", "invalid_value", "must be a data: URL"),
    ("data URL without base64", user({"type": "image_url", "image_url": {"url": "data:image/png,abc"}}),
     f"{_P}.image_url.url", "invalid_value", "must be base64-encoded"),
    ("data URL of audio", user(image_part(QUESTION, "audio/wav")), f"{_P}.image_url.url", "invalid_value",
     "must hold an image"),
    ("data URL with bad base64", user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}),
     f"{_P}.image_url.url", "invalid_value", "not valid base64"),
    ("undecodable image", user(image_part(b"\x89PNG not really")), f"{_P}.image_url.url", "invalid_value",
     "not an image that can be decoded"),
    ("image too large", user(image_part(image_bytes(Image.new("RGB", (200, 100))))), f"{_P}.image_url.url",
     "invalid_value", "200×100 image is over the limit of 16384 pixels"),
    ("decompression bomb", user(image_part(png_header(50_000, 50_000))), f"{_P}.image_url.url", "invalid_value",
     "over the limit"),
    ("animated image", user(image_part(animated_gif(), "image/gif")), f"{_P}.image_url.url", "invalid_value",
     "animated image"),
    ("image of extreme aspect", user(image_part(image_bytes(Image.new("RGB", (300, 1))))), f"{_P}.image_url.url",
     "invalid_value", "longer side over 200 times"),
    ("image_url detail high", user({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                                       "detail": "high"}}),
     f"{_P}.image_url.detail", "invalid_value", "'auto'"),
    ("too many parts", user(*[image_part(PHOTO)] * 4), "messages", "invalid_value",
     "4 media parts is over the limit of 3"),
    ("audio in a system message", [{"role": "system", "content": [audio_part(QUESTION)]}, *user(TEXT)], _P,
     "invalid_value", "input_audio parts are only read in user messages, not in system messages"),
    ("image in an assistant message", [*user(TEXT), {"role": "assistant", "content": [image_part(PHOTO)]},
                                       *user(TEXT)],
     "messages.1.content.0", "invalid_value", "image_url parts are only read in user messages"),
    ("unknown part type", user(TEXT, {"type": "file", "file": {"file_id": "f"}}), "messages.0.content.1",
     "invalid_value", "'file'"),
    ("part without a type", user({"input_audio": {"data": b64(QUESTION), "format": "wav"}}), _P, "invalid_value",
     "discriminator 'type'"),
    ("input_audio without data", user({"type": "input_audio", "input_audio": {"format": "wav"}}),
     f"{_P}.input_audio.data", "missing_required_parameter", "Field required"),
    ("input_audio without format", user({"type": "input_audio", "input_audio": {"data": b64(QUESTION)}}),
     f"{_P}.input_audio.format", "missing_required_parameter", "Field required"),
    ("input_audio missing", user({"type": "input_audio"}), f"{_P}.input_audio", "missing_required_parameter",
     "Field required"),
    ("image_url without url", user({"type": "image_url", "image_url": {}}), f"{_P}.image_url.url",
     "missing_required_parameter", "Field required"),
    ("image_url as a string", user({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}),
     f"{_P}.image_url", "invalid_value", "valid dictionary"),
    ("audio data as a number", user({"type": "input_audio", "input_audio": {"data": 7, "format": "wav"}}),
     f"{_P}.input_audio.data", "invalid_value", "valid string"),
    ("media pads over the prompt limit", user(*[audio_part(encode(tone(2.0, 16_000), 16_000))] * 3, TEXT),
     "messages", "context_length_exceeded", f"over the limit of {MAX_PROMPT_TOKENS}"),
]


@pytest.mark.parametrize("name,messages,param,code,words", _BAD_MEDIA, ids=[case[0] for case in _BAD_MEDIA])
def test_bad_media_gets_a_400_naming_the_part(engine, http, name, messages, param, code, words):
    num_submitted = len(engine.submitted)
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert words in error["message"], error["message"]
    assert "Traceback" not in response.text
    assert len(engine.submitted) == num_submitted, "bad media reached the engine"


def test_the_openai_client_raises_a_bad_request_error_for_bad_media(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="omnimtp-tiny", messages=user(audio_part(b"junk" * 10)), max_tokens=2)
    assert raised.value.body["param"] == "messages.0.content.0.input_audio.data"


def test_a_model_without_a_processor_refuses_media_and_serves_text(family):
    bare = Qwen3OmniFamily(family.model, family.tokenizer)  # a checkpoint without preprocessor_config.json
    engine = Engine(bare, max_frames=2, max_batch_size=2)
    with running_server(create_app(engine, max_tokens_limit=4)) as url, httpx.Client(base_url=url, timeout=60) as http:
        body = {"messages": user(TEXT, audio_part(QUESTION)), "max_tokens": 2}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages.0.content.1"
        assert "no processor (preprocessor_config.json)" in error["message"]
        assert http.post("/v1/chat/completions", json={"messages": user(TEXT), "max_tokens": 2}).status_code == 200


# -- media that reads: 200, text and audio back -------------------------------------------------------


def _chat(client, messages, *, stream=False, seed=7, max_tokens=4, fmt="wav"):
    options = {"stream_options": {"include_usage": True}} if stream else {}
    return client.chat.completions.create(
        model="omnimtp-tiny", messages=messages, modalities=["text", "audio"], audio={"voice": "ethan", "format": fmt},
        seed=seed, max_tokens=max_tokens, stream=stream, **options,
    )


def _streamed(chunks) -> tuple[str, np.ndarray, dict]:
    text, pcm, usage = "", [], None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.delta.audio is not None and choice.delta.audio.data:
                pcm.append(np.frombuffer(base64.b64decode(choice.delta.audio.data), dtype="<i2"))
    return text, np.concatenate(pcm), usage


def _expected_prompt_tokens(family, audio: bytes, fmt: str, image: bytes | None) -> int:
    parts = [{"type": "audio", "audio": decode_audio(audio, fmt, AUDIO_SAMPLING_RATE)}]
    if image is not None:
        parts.append({"type": "image", "image": Image.open(io.BytesIO(image)).convert("RGB")})
    ids, _ = chat_media_inputs(family.processor, [{"role": "user", "content": [*parts, TEXT]}])
    return len(ids)


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac"])
def test_input_audio_gets_text_and_speech(client, family, fmt):
    data = encode(tone(1.0, 24_000, hz=330.0), 24_000, fmt.upper())
    completion = _chat(client, user(audio_part(data, fmt), TEXT))
    message = completion.choices[0].message
    assert isinstance(message.content, str) and message.audio.transcript == message.content
    samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="int16")
    assert rate == 24_000
    assert_audible(samples)
    # the prompt counts one token per audio encoder row
    assert completion.usage.prompt_tokens == _expected_prompt_tokens(family, data, fmt, None)


def test_audio_and_image_streamed_equal_not_streamed(client, family):
    messages = user(audio_part(QUESTION), image_part(PHOTO), TEXT)
    whole = _chat(client, messages)
    text, pcm, usage = _streamed(_chat(client, messages, stream=True, fmt="pcm16"))
    assert text == whole.choices[0].message.content
    whole_pcm, _ = sf.read(io.BytesIO(base64.b64decode(whole.choices[0].message.audio.data)), dtype="int16")
    assert_audible(pcm)
    # one-block decode vs streamed chunks: equal up to float rounding (1 LSB), as for text prompts
    assert len(pcm) == len(whole_pcm) and np.abs(pcm.astype(np.int32) - whole_pcm).max() <= 1
    assert usage.prompt_tokens == whole.usage.prompt_tokens == _expected_prompt_tokens(family, QUESTION, "wav", PHOTO)


def test_concurrent_media_and_text_requests_are_all_served(client):
    """The processor runs in worker threads while the event loop tokenizes text requests."""
    from concurrent.futures import ThreadPoolExecutor

    requests = [user(audio_part(QUESTION), TEXT), user(image_part(PHOTO), TEXT), user(TEXT)] * 3

    def ask(messages):
        return client.chat.completions.create(model="omnimtp-tiny", messages=messages, max_tokens=2, seed=1)

    with ThreadPoolExecutor(len(requests)) as pool:
        completions = list(pool.map(ask, requests))
    prompt_tokens = [completion.usage.prompt_tokens for completion in completions]
    assert prompt_tokens == prompt_tokens[:3] * 3
    assert [completion.choices[0].message.content for completion in completions[:3]] * 3 == [
        completion.choices[0].message.content for completion in completions]


def test_engine_hands_the_processors_tensors_to_the_request(engine, family):
    samples = tone(1.0, AUDIO_SAMPLING_RATE)
    request = EngineRequest(messages=(("user", ({"type": "audio", "audio": samples}, TEXT)),), speak_text=None,
                            speaker=None, sampling=SamplingParams.greedy(), seed=0, max_new_tokens=2)
    ids, media = engine.prompt_ids(request)
    assert isinstance(media, MediaInputs) and media.has_audio and not media.has_vision
    assert ids.count(AUDIO_PAD) == 13 and media.audio_lengths.tolist() == [100]
    assert engine.prompt_ids(EngineRequest(messages=(("user", "Hi"),), speak_text=None, speaker=None,
                                           sampling=SamplingParams.greedy(), seed=0, max_new_tokens=2))[1] is None
    standalone = Engine(family, max_frames=2, max_batch_size=2, media_limits=LIMITS)
    loop = asyncio.new_event_loop()
    standalone.start()
    try:
        handle = standalone.submit(request, loop=loop)
        assert handle.request.prompt_ids == ids
        assert torch.equal(handle.request.media.input_features, media.input_features)
    finally:
        standalone.shutdown(drain=False)
        loop.close()


# -- the model reads the media (the thinker's encoders) -----------------------------------------------


@pytest.mark.parametrize("kind", ["audio", "image"])
def test_changing_the_media_changes_the_answer(client, kind):
    """Greedy, same text, same media size: only the media's content differs."""
    if kind == "audio":
        first, second = audio_part(QUESTION), audio_part(encode(tone(1.0, 24_000, hz=2_000.0, level=0.05), 24_000))
    else:
        first = image_part(PHOTO)
        second = image_part(image_bytes(Image.linear_gradient("L").resize((64, 64)).convert("RGB")))
    completions = [client.chat.completions.create(model="omnimtp-tiny", messages=user(part, TEXT), max_tokens=8,
                                                  temperature=0, seed=0) for part in (first, second)]
    assert completions[0].usage.prompt_tokens == completions[1].usage.prompt_tokens
    answers = [completion.choices[0].message.content for completion in completions]
    assert answers[0] != answers[1], answers


def test_media_survives_a_body_through_the_schema_unchanged(http):
    """The raw JSON the OpenAI format sends (no client library): a detail of "auto" is read."""
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PHOTO)}", "detail": "auto"}},
        {"type": "input_audio", "input_audio": {"data": b64(QUESTION), "format": "wav"}}]}], "max_tokens": 2}
    response = http.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 13 + 16


def test_serve_flags_set_the_media_limits():
    from omnimtp.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-audio-seconds", "12.5", "--max-image-pixels", "4096",
                                      "--max-media-parts", "2", "--max-body-bytes", "33554432"])
    assert (args.max_audio_seconds, args.max_image_pixels, args.max_media_parts, args.max_body_bytes) == (
        12.5, 4096, 2, 1 << 25)
    defaults = build_parser().parse_args(["serve"])
    assert MediaLimits(defaults.max_audio_seconds, defaults.max_image_pixels, defaults.max_media_parts) == MediaLimits()
    for flag, value in [("--max-audio-seconds", "0"), ("--max-audio-seconds", "nan"), ("--max-image-pixels", "0"),
                        ("--max-media-parts", "1.5"), ("--max-body-bytes", "-1")]:
        with pytest.raises(SystemExit) as raised:
            build_parser().parse_args(["serve", flag, value])
        assert raised.value.code == 2
