"""The OpenAI-compatible server, end to end: a real uvicorn server on a free loopback port, spoken to
with the official `openai` package (and httpx for raw error cases)."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from audio_checks import assert_audible
from server_harness import running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.models.tiny import tiny_qwen3_omni
from omnimtp.server.app import create_app
from omnimtp.server.scheduler import Engine
from omnimtp.tokenizer import byte_tokenizer

MAX_FRAMES = 6
MAX_TOKENS_LIMIT = 64
MAX_BODY_BYTES = 32 * 1024
SAMPLES_PER_FRAME, TAIL = 1920, 555


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen3_omni(0), byte_tokenizer()


def _engine(tiny, max_frames: int, family: Qwen3OmniFamily | None = None, **config) -> Engine:
    family = family or Qwen3OmniFamily(*tiny)
    return Engine(family, max_frames=max_frames, first_chunk_frames=2, chunk_frames=3, **config)


@pytest.fixture(scope="module")
def server(tiny):
    engine = _engine(tiny, MAX_FRAMES, max_batch_size=8)
    app = create_app(engine, max_tokens_limit=MAX_TOKENS_LIMIT, max_body_bytes=MAX_BODY_BYTES)
    with running_server(app) as url:
        yield url


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def _decode(data: bytes) -> tuple[np.ndarray, int]:
    samples, sample_rate = sf.read(io.BytesIO(data), dtype="int16", always_2d=True)
    assert samples.shape[1] == 1, "mono"
    return samples[:, 0], sample_rate


def _audio_chat(client, seed, fmt="wav", text="Hi there", **kwargs):
    return client.chat.completions.create(
        model="omnimtp-tiny", messages=[{"role": "user", "content": text}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": fmt}, seed=seed, max_tokens=5, **kwargs,
    )


def _metric(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# -- happy paths through the official client --------------------------------------------------------


def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["omnimtp-tiny"]
    assert http.get("/health").json() == {"status": "ok"}


def test_chat_text_only_runs_the_thinker_alone(client):
    result = client.chat.completions.create(
        model="omnimtp-tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, seed=3
    )
    choice = result.choices[0]
    assert choice.message.audio is None
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= result.usage.completion_tokens <= 4
    assert isinstance(choice.message.content, str)


def test_chat_logprobs_are_the_engines_streamed_or_not(tiny, client):
    """logprobs + top_logprobs: each reply token's logprob and alternatives (OpenAI's `choices[].logprobs.content`)
    are the engine's for the same seeded request, sampled or greedy; streamed, the content chunks carry the same
    list in order; their bytes join to the reply; a request that asks none gets `logprobs: null`."""
    from omnimtp.engine.core import EngineCore
    from omnimtp.engine.request import Request
    from omnimtp.sampling import SamplingParams

    family = Qwen3OmniFamily(*tiny)
    messages = [{"role": "user", "content": "Hello"}]
    for temperature in (0.0, 0.9):
        common = dict(model="omnimtp-tiny", messages=messages, max_tokens=6, seed=3, temperature=temperature,
                      logprobs=True, top_logprobs=2)
        whole = client.chat.completions.create(**common).choices[0]
        core = EngineCore(family)
        sampling = None if temperature == 0 else SamplingParams(temperature=temperature)
        request = Request(0, family.chat_ids(messages), max_new_tokens=6, max_frames=1, thinker_sampling=sampling,
                          seed=3, logprobs=2)
        core.add(request)
        while core.has_work():
            list(core.step())
        expected = request.output_logprobs[:len(request.reply_ids)]
        content = whole.logprobs.content
        assert [lp.logprob for lp in content] == pytest.approx([lp.logprob for lp in expected], abs=1e-6)
        assert [top.logprob for lp in content for top in lp.top_logprobs] == pytest.approx(
            [value for lp in expected for _, value in lp.top], abs=1e-6)
        # (the tiny byte tokenizer: id b < 256 is byte b, a piece of a character included)
        assert [[top.bytes for top in lp.top_logprobs] for lp in content] == [
            [[token] if token < 256 else top.bytes for (token, _), top in zip(lp.top, lp_served.top_logprobs,
                                                                               strict=True)]
            for lp, lp_served in zip(expected, content, strict=True)]
        assert any(token < 256 for lp in expected for token, _ in lp.top)
        assert all(len(lp.top_logprobs) == 2 for lp in content) and content
        assert b"".join(bytes(lp.bytes) for lp in content).decode("utf-8", "replace") == whole.message.content
        streamed = [lp.model_dump() for chunk in client.chat.completions.create(**common, stream=True)
                    for choice in chunk.choices if choice.logprobs is not None for lp in choice.logprobs.content]
        assert streamed == [lp.model_dump() for lp in content]
    plain = client.chat.completions.create(model="omnimtp-tiny", messages=messages, max_tokens=3, seed=3)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm16"])
def test_chat_audio_decodes_with_exact_length(client, fmt):
    result = _audio_chat(client, seed=7, fmt=fmt)
    message = result.choices[0].message
    frames = result.usage.completion_tokens_details.audio_tokens
    assert 1 <= frames <= MAX_FRAMES
    data = base64.b64decode(message.audio.data)
    if fmt == "pcm16":
        samples = _pcm(data)
    else:
        samples, sample_rate = _decode(data)
        assert sample_rate == 24000
    assert len(samples) == SAMPLES_PER_FRAME * frames - TAIL
    assert message.audio.transcript == message.content
    assert message.audio.id and message.audio.expires_at > 0
    # every format carries the same 16-bit samples
    reference = _pcm(base64.b64decode(_audio_chat(client, seed=7, fmt="pcm16").choices[0].message.audio.data))
    assert_audible(reference)
    assert np.array_equal(samples, reference)


def test_chat_streamed_equals_non_streamed(client, http):
    whole = _audio_chat(client, seed=11, fmt="pcm16").choices[0].message
    stream = _audio_chat(client, seed=11, fmt="pcm16", stream=True, stream_options={"include_usage": True})
    text, transcript, pcm, finish, usage = [], [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            text.append(delta.content or "")
            if delta.audio is not None:
                transcript.append(delta.audio.transcript or "")
                if delta.audio.data:
                    pcm.append(base64.b64decode(delta.audio.data))
            finish = choice.finish_reason or finish
    assert "".join(text) == whole.content == "".join(transcript)
    # a non-streamed response decodes its audio in one block, as `OmniPipeline.generate` does: the
    # streamed chunks join into it up to float rounding (at most 1 LSB in int16)
    whole_pcm = _pcm(base64.b64decode(whole.audio.data)).astype(np.int32)
    streamed_pcm = _pcm(b"".join(pcm)).astype(np.int32)
    assert_audible(whole_pcm.astype(np.int16))
    assert len(streamed_pcm) == len(whole_pcm) and np.abs(streamed_pcm - whole_pcm).max() <= 1
    assert finish in ("stop", "length")
    assert len(b"".join(pcm)) // 2 == SAMPLES_PER_FRAME * usage.completion_tokens_details.audio_tokens - TAIL
    # the raw SSE framing ends with [DONE]
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 2}
    events = [line for line in http.post("/v1/chat/completions", json=body).text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: ") for event in events)


def test_speech_formats_agree(client):
    speak = dict(model="omnimtp-tiny", voice="chelsie", input="Good morning", extra_body={"seed": 5})
    pcm = _pcm(client.audio.speech.create(response_format="pcm", **speak).content)
    assert (len(pcm) + TAIL) % SAMPLES_PER_FRAME == 0 and 1 <= (len(pcm) + TAIL) // SAMPLES_PER_FRAME <= MAX_FRAMES
    assert_audible(pcm)
    for fmt in ("wav", "flac"):
        samples, sample_rate = _decode(client.audio.speech.create(response_format=fmt, **speak).content)
        assert sample_rate == 24000
        assert np.array_equal(samples, pcm), fmt
    with client.audio.speech.with_streaming_response.create(response_format="wav", **speak) as response:
        streamed = b"".join(response.iter_bytes())
    assert np.array_equal(_decode(streamed)[0], pcm)


def test_speech_sse_matches_the_audio_body(http):
    body = {"input": "Good morning", "voice": "CHELSIE", "response_format": "pcm", "seed": 5}
    pcm = http.post("/v1/audio/speech", json=body).content
    sse = http.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
    assert sse.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in sse.text.split("\n\n") if line]
    deltas = [event for event in events if event["type"] == "speech.audio.delta"]
    assert deltas and events[-1]["type"] == "speech.audio.done"
    assert_audible(_pcm(pcm))
    assert b"".join(base64.b64decode(event["audio"]) for event in deltas) == pcm
    frames = events[-1]["usage"]["output_tokens"]
    assert len(pcm) // 2 == SAMPLES_PER_FRAME * frames - TAIL


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_served_chat_equals_the_pipeline(tiny, http, temperature):
    """A seeded chat request through the real server == `OmniPipeline.generate` with the same seed, greedy
    and sampled: the same text (the whole reply decoded, a trailing incomplete UTF-8 sequence included)
    and the same PCM16 samples, on audible audio. Both run the one engine core."""
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.sampling import SamplingParams
    from omnimtp.server.audio import to_pcm16
    from omnimtp.talker.loop import QWEN3_OMNI_TALKER_SAMPLING

    model, tokenizer = tiny
    messages = [{"role": "user", "content": "Tell me something"}]
    body = {"messages": messages, "modalities": ["text", "audio"], "audio": {"voice": "aiden", "format": "pcm16"},
            "seed": 21, "temperature": temperature, "max_tokens": 6}
    served = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    is_sampled = temperature > 0
    output = OmniPipeline(model, tokenizer).generate(
        messages, speaker="aiden", thinker_sampling=SamplingParams(temperature=temperature) if is_sampled else None,
        talker_sampling=QWEN3_OMNI_TALKER_SAMPLING if is_sampled else None, max_new_tokens=6,
        max_frames=MAX_FRAMES, seed=21,
    )
    assert served["content"] == output.text == tokenizer.decode(output.text_ids, skip_special_tokens=True)
    pcm = _pcm(base64.b64decode(served["audio"]["data"]))
    assert len(pcm) == SAMPLES_PER_FRAME * output.codes.shape[1] - TAIL
    assert_audible(pcm)
    assert np.array_equal(pcm, to_pcm16(output.audio))


# -- batching --------------------------------------------------------------------------------------


def _mixed_requests():
    requests = []
    for i in range(8):
        if i % 2 == 0:
            requests.append(("chat", {
                "messages": [{"role": "user", "content": f"Question {i}"}], "modalities": ["text", "audio"],
                "audio": {"voice": ["Ethan", "Chelsie", "Aiden"][i % 3], "format": "pcm16"}, "seed": 100 + i,
                "max_tokens": 3 + i % 3, "temperature": 0.0 if i == 4 else 0.9,
            }))
        else:
            requests.append(("speech", {
                "input": "Say " + "ab" * i, "voice": "Aiden", "response_format": "pcm", "seed": 200 + i,
                "temperature": 0.0 if i == 5 else 1.0,
            }))
    return requests


def _send(http, kind, body):
    if kind == "chat":
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        return message["content"], base64.b64decode(message["audio"]["data"])
    response = http.post("/v1/audio/speech", json=body)
    assert response.status_code == 200, response.text
    return None, response.content


def test_batch_invariance_concurrent_equals_sequential(http):
    """8 concurrent seeded requests (chat and speech, greedy and sampled, different voices) give
    byte-identical text and audio to the same requests sent one at a time."""
    requests = _mixed_requests()
    alone = [_send(http, kind, body) for kind, body in requests]
    steps_before = _metric(http, "omnimtp_talker_step_batch_size_count")
    rows_before = _metric(http, "omnimtp_talker_step_batch_size_sum")
    together: list = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def worker(i, kind, body):
        barrier.wait()
        together[i] = _send(http, kind, body)

    threads = [threading.Thread(target=worker, args=(i, *r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for _, audio in alone:
        assert_audible(_pcm(audio))
    assert together == alone
    steps = _metric(http, "omnimtp_talker_step_batch_size_count") - steps_before
    rows = _metric(http, "omnimtp_talker_step_batch_size_sum") - rows_before
    assert rows > steps, "the concurrent requests never shared a talker step"


# -- bad input: 4xx with an OpenAI-style body, and the server keeps serving --------------------------

_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
_AUDIO = {**_CHAT, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}
_SPEECH = {"input": "Hi", "voice": "ethan"}

_BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("not an object", "/v1/chat/completions", [1, 2], 400, None),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {**_CHAT, "messages": []}, 400, "messages"),
    ("messages wrong type", "/v1/chat/completions", {**_CHAT, "messages": "Hi"}, 400, "messages"),
    ("empty user turn", "/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": ""}]}, 400,
     "messages"),
    ("unknown role", "/v1/chat/completions", {**_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("stream as string", "/v1/chat/completions", {**_CHAT, "stream": "yes"}, 400, "stream"),
    ("temperature as string", "/v1/chat/completions", {**_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("seed as float", "/v1/chat/completions", {**_CHAT, "seed": 1.5}, 400, "seed"),
    ("top_p zero", "/v1/chat/completions", {**_CHAT, "top_p": 0}, 400, "top_p"),
    ("unknown parameter", "/v1/chat/completions", {**_CHAT, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("max_tokens zero", "/v1/chat/completions", {**_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/chat/completions", {**_CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens over limit", "/v1/chat/completions", {**_CHAT, "max_tokens": MAX_TOKENS_LIMIT + 1}, 400,
     "max_tokens"),
    ("max_completion_tokens zero", "/v1/chat/completions", {**_CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("audio modality without audio", "/v1/chat/completions", {**_CHAT, "modalities": ["text", "audio"]}, 400,
     "audio"),
    ("audio-only modalities", "/v1/chat/completions", {**_AUDIO, "modalities": ["audio"]}, 400, "modalities"),
    ("chat unknown voice", "/v1/chat/completions", {**_AUDIO, "audio": {"voice": "alloy", "format": "wav"}}, 400,
     "audio.voice"),
    ("chat unsupported format", "/v1/chat/completions", {**_AUDIO, "audio": {"voice": "ethan", "format": "ogg"}},
     400, "audio.format"),
    ("n above one", "/v1/chat/completions", {**_CHAT, "n": 2}, 400, "n"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs over 20", "/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("speech missing input", "/v1/audio/speech", {"voice": "ethan"}, 400, "input"),
    ("speech empty input", "/v1/audio/speech", {**_SPEECH, "input": ""}, 400, "input"),
    ("speech unknown voice", "/v1/audio/speech", {**_SPEECH, "voice": "alloy"}, 400, "voice"),
    ("speech unsupported format", "/v1/audio/speech", {**_SPEECH, "response_format": "ogg"}, 400,
     "response_format"),
    ("speech bad stream_format", "/v1/audio/speech", {**_SPEECH, "stream_format": "chunks"}, 400, "stream_format"),
    ("speech speed", "/v1/audio/speech", {**_SPEECH, "speed": 1.5}, 400, "speed"),
    # the talker samples with its own settings: a value that would be ignored is refused instead
    ("speech temperature", "/v1/audio/speech", {**_SPEECH, "temperature": 0.5}, 400, "temperature"),
    ("speech top_p", "/v1/audio/speech", {**_SPEECH, "top_p": 0.9}, 400, "top_p"),
    ("speech top_k", "/v1/audio/speech", {**_SPEECH, "top_k": 5}, 400, "top_k"),
    ("body over the limit", "/v1/chat/completions",
     {**_CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}, 413, None),
]


@pytest.mark.parametrize("name,path,body,status,param", _BAD_REQUESTS, ids=[r[0] for r in _BAD_REQUESTS])
def test_bad_input_gets_an_openai_error(http, name, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    assert "Traceback" not in response.text and 'File "' not in response.text


def test_unknown_voice_names_the_voices_and_the_client_raises(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.audio.speech.create(model="omnimtp-tiny", voice="alloy", input="Hi")
    assert raised.value.body["param"] == "voice"
    assert "alloy" in raised.value.body["message"] and "ethan" in raised.value.body["message"]


def test_every_response_has_a_request_id_of_its_own(http):
    """`x-request-id` on every response, a success or an error, as OpenAI's (LiveKit's TTS logs a warning without
    one)."""
    responses = [http.get("/v1/models"), http.get("/v1/models"), http.post("/v1/chat/completions", json={}),
                 http.get("/nowhere")]
    ids = [response.headers.get("x-request-id") for response in responses]
    assert all(ids) and len(set(ids)) == len(ids), ids


def test_unknown_route_and_method_get_openai_errors(http):
    missing = http.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong_method = http.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_server_keeps_serving_after_bad_input(http, client):
    for _, path, body, _, _ in _BAD_REQUESTS[:5]:  # JSON bodies the server refuses with a 400 (not a 415)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        http.post(path, content=content, headers={"content-type": "application/json"})
    assert http.get("/health").status_code == 200
    assert _audio_chat(client, seed=1).choices[0].message.audio.data
    metrics = http.get("/metrics").text
    assert re.search(r'omnimtp_requests_total\{route="/v1/chat/completions",status="400"\} [1-9]', metrics)
    assert re.search(r'omnimtp_requests_total\{route="/v1/chat/completions",status="200"\} [1-9]', metrics)


# -- auth, cancellation, back-pressure (their own servers, the same model) ---------------------------


def test_api_key_is_required_when_set(tiny):
    engine = _engine(tiny, MAX_FRAMES, max_batch_size=2)
    with running_server(create_app(engine, api_key="sekrit")) as url:
        assert httpx.get(f"{url}/v1/models").status_code == 401
        wrong = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == "omnimtp-tiny"
        speech = good.audio.speech.create(model="omnimtp-tiny", voice="ethan", input="ok", response_format="pcm")
        assert len(speech.content) > 0


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def test_dropped_stream_frees_its_slot_and_others_are_unaffected(tiny):
    engine = _engine(tiny, 150, max_batch_size=2, cuts_runaway=False)  # runs until dropped
    other = {"input": "Another one", "voice": "aiden", "response_format": "pcm", "seed": 9}
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        alone = http.post("/v1/audio/speech", json=other).content
        result = {}
        with http.stream("POST", "/v1/audio/speech", json={"input": "A long one", "voice": "ethan",
                                                           "response_format": "pcm"}) as dropped:
            received = dropped.iter_raw()  # keep the iterator: dropping it would close the stream here
            assert next(received)
            worker = threading.Thread(target=lambda: result.setdefault("r", http.post("/v1/audio/speech", json=other)))
            worker.start()
            _wait_for(lambda: _metric(http, "omnimtp_active_requests") == 2)
        # leaving the block closed the connection mid-stream
        _wait_for(lambda: _metric(http, "omnimtp_cancelled_requests_total") == 1)
        worker.join()
        assert result["r"].status_code == 200 and result["r"].content == alone
        _wait_for(lambda: _metric(http, "omnimtp_active_requests") == 0)
        assert _metric(http, "omnimtp_queue_depth") == 0


def test_full_queue_answers_429(tiny):
    engine = _engine(tiny, 60, max_batch_size=1)
    body = {"input": "Busy", "voice": "ethan", "response_format": "pcm", "stream_format": "sse"}
    with running_server(create_app(engine, max_queue=1)) as url:
        statuses: list = []

        def worker():
            with httpx.Client(base_url=url, timeout=120) as http:
                response = http.post("/v1/audio/speech", json=body)
                statuses.append((response.status_code, response.json() if response.status_code == 429 else None))

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rejected = [body for status, body in statuses if status == 429]
        assert rejected and all(status in (200, 429) for status, _ in statuses)
        assert rejected[0]["error"]["code"] == "queue_full"
        assert len(statuses) - len(rejected) >= 1


def test_a_model_error_fails_its_requests_cleanly_and_the_server_recovers(tiny):
    """An exception inside the engine step becomes a 500 OpenAI-style error for the requests in flight
    (no traceback in the body); the engine rebuilds its talker state and serves the next request."""
    family = Qwen3OmniFamily(*tiny)
    real_decode = family.decode_audio
    calls = {"n": 0}

    def failing_once(streams, blocks, is_final):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_decode(streams, blocks, is_final)

    family.decode_audio = failing_once
    engine = _engine(tiny, MAX_FRAMES, family, max_batch_size=2)
    body = {"input": "Hi", "voice": "ethan", "response_format": "flac", "seed": 1}
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        failed = http.post("/v1/audio/speech", json=body)
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error" and "Traceback" not in failed.text
        ok = http.post("/v1/audio/speech", json=body)
        assert ok.status_code == 200 and _decode(ok.content)[1] == 24000


def test_a_talker_that_never_ends_is_cut_at_its_texts_bound_and_counted(tiny):
    """A talker forced never to emit codec EOS stops at its text's bound (the 10 s floor, 125 frames, for a short
    text), well before --max-frames: finish_reason "length" on speech and chat, each counted by what cut it."""
    family = Qwen3OmniFamily(*tiny)
    new_talker_batch = family.new_talker_batch

    def never_ending(max_batch_size):
        batch = new_talker_batch(max_batch_size)
        batch.frames.eos_ids = frozenset()
        return batch

    family.new_talker_batch = never_ending
    engine = _engine(tiny, 400, family, max_batch_size=2)
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        speech = http.post("/v1/audio/speech", json={"input": "Hi", "voice": "ethan", "response_format": "flac"})
        assert speech.status_code == 200 and speech.headers["x-finish-reason"] == "length"
        assert len(_decode(speech.content)[0]) == 125 * SAMPLES_PER_FRAME - TAIL  # not 400 frames
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "wav"}})
        assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "length"
        metrics = http.get("/metrics").text
    assert 'omnimtp_audio_cut_requests_total{cut_by="text_length"} 2.0' in metrics


def test_whole_speech_files_are_encoded_off_the_event_loop(http, monkeypatch):
    """/v1/audio/speech's whole files and every /v1/audio/speech/batch item are encoded on a worker thread (an
    mp3 of minutes takes seconds), never on the server's event loop thread."""
    import omnimtp.server.routes.speech as speech_route

    threads, encode_audio = [], speech_route.encode_audio

    def spy(*args):
        threads.append(threading.current_thread().name)
        return encode_audio(*args)

    monkeypatch.setattr(speech_route, "encode_audio", spy)
    items = [{"input": "Hi", "voice": "ethan", "response_format": fmt} for fmt in ("wav", "flac")]
    batch = http.post("/v1/audio/speech/batch", json={"items": items})
    whole = http.post("/v1/audio/speech", json={"input": "Hi", "voice": "ethan", "response_format": "flac"})
    assert batch.status_code == 200 and all("audio" in item for item in batch.json()["data"])
    assert whole.status_code == 200
    assert len(threads) == 3 and "uvicorn-test" not in threads, threads
