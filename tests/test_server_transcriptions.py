"""`/v1/audio/transcriptions` through the official `openai` client: the served text is `OmniPipeline.transcribe`'s
(itself transformers' on the same prompt, tests/test_transcription.py) in every format and streamed; seeded
sampling repeats; transcriptions next to speaking chats are each what they are alone; bad input is a 4xx
naming the field."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import soundfile
import soxr
from audio_checks import spoken_wav
from server_harness import running_server

from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import Request
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.families.qwen3_tts import Qwen3TTSFamily
from omnimtp.media import MediaLimits, load_audio
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.server.app import create_app
from omnimtp.server.routes.transcriptions import transcription_request
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 8
LIMITS = MediaLimits(max_audio_seconds=3.0)


@pytest.fixture(scope="module")
def speech_path(tmp_path_factory) -> str:
    """A real spoken sentence (espeak-ng, 22.05 kHz WAV)."""
    return str(spoken_wav(tmp_path_factory.mktemp("asr") / "hello.wav", "hello world, this is a test"))


@pytest.fixture(scope="module")
def speech(speech_path) -> bytes:
    return Path(speech_path).read_bytes()


@pytest.fixture(scope="module")
def pipe() -> OmniPipeline:
    return OmniPipeline.tiny(seed=0, max_new_tokens=MAX_NEW_TOKENS, media_limits=LIMITS)


@pytest.fixture(scope="module")
def engine():
    return Engine(Qwen3OmniFamily.tiny(0), max_new_tokens=MAX_NEW_TOKENS, max_frames=4, first_chunk_frames=2,
                  chunk_frames=2, max_batch_size=16, media_limits=LIMITS)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(create_app(engine, max_tokens_limit=MAX_NEW_TOKENS)) as url:
        yield url


def _file(data: bytes, name: str = "hello.wav"):
    return (name, data, "audio/wav")


def test_every_format_and_the_stream_give_the_pipelines_text(client, pipe, speech, speech_path):
    expected = pipe.transcribe(speech_path, language="en", prompt="A greeting.")
    assert expected.text_ids
    common = dict(model="omnimtp-tiny", file=_file(speech), language="en", prompt="A greeting.")
    served = client.audio.transcriptions.create(**common)
    assert served.text == expected.text
    usage = served.usage
    assert usage.output_tokens == len(expected.text_ids) and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert client.audio.transcriptions.create(**common, response_format="text").strip() == expected.text
    verbose = client.audio.transcriptions.create(**common, response_format="verbose_json",
                                                 timestamp_granularities=["segment"])
    assert (verbose.text, verbose.language) == (expected.text, "english")
    assert verbose.duration == pytest.approx(expected.duration)
    (segment,) = verbose.segments
    assert (segment.start, segment.end, segment.text) == (0.0, pytest.approx(expected.duration), expected.text)
    events = list(client.audio.transcriptions.create(**common, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert [e.type for e in events[len(deltas):]] == ["transcript.text.done"]
    assert events[-1].text == expected.text and "".join(deltas).strip() == expected.text
    assert events[-1].usage.output_tokens == len(expected.text_ids)
    assert events[-1].usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_logprobs_are_the_engines_for_the_transcripts_tokens(client, pipe, speech, speech_path):
    """include=["logprobs"]: the json body's logprobs are the engine's for the reply's tokens (their bytes join to
    the reply's text), and streamed, the deltas carry them in order and the done event all of them."""
    expected = pipe.transcribe(speech_path, language="en")
    request, _ = pipe._transcription_request(speech_path, "en", None, None, None, None, is_streamed=False)
    core = EngineCore(pipe.family)
    core.add(Request(0, request.prompt_ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=1, media=request.media,
                     logprobs=0))
    while core.has_work():
        finished = [event.request for event in core.step() if event.is_finished]
    engine_logprobs = finished[0].output_logprobs[:len(finished[0].reply_ids)]
    assert finished[0].reply_ids == expected.text_ids[:len(finished[0].reply_ids)] and engine_logprobs
    common = dict(model="omnimtp-tiny", file=_file(speech), language="en", include=["logprobs"])
    served = client.audio.transcriptions.create(**common)
    assert served.text == expected.text
    assert [lp.logprob for lp in served.logprobs] == pytest.approx([lp.logprob for lp in engine_logprobs], abs=1e-6)
    joined = b"".join(bytes(int(b) for b in lp.bytes) for lp in served.logprobs)
    assert joined.decode("utf-8", "replace").strip() == expected.text  # (the tiny model writes byte salad)
    assert all(lp.token == bytes(int(b) for b in lp.bytes).decode("utf-8", "replace") for lp in served.logprobs)
    events = list(client.audio.transcriptions.create(**common, stream=True))
    carried = [lp for e in events if e.type == "transcript.text.delta" for lp in e.logprobs]
    assert [lp.model_dump() for lp in carried] == [lp.model_dump() for lp in events[-1].logprobs] \
        == [lp.model_dump() for lp in served.logprobs]
    assert client.audio.transcriptions.create(model="omnimtp-tiny", file=_file(speech)).logprobs is None


def test_seeded_sampling_repeats_and_equals_the_pipeline(client, pipe, speech, speech_path):
    def sampled(seed):
        return client.audio.transcriptions.create(model="omnimtp-tiny", file=_file(speech), temperature=1.0,
                                                  extra_body={"seed": seed}).text

    expected = pipe.transcribe(speech_path, sampling=SamplingParams(temperature=1.0), seed=5).text
    assert sampled(5) == sampled(5) == expected
    assert {sampled(s) for s in (6, 7, 8)} != {expected}


def test_transcriptions_next_to_speaking_chats_are_what_they_are_alone(http, speech):
    """8 seeded transcriptions and 8 seeded speaking chats at once: each text (and each chat's audio) is byte for
    byte what the request gives alone."""
    def transcribe(seed):
        response = http.post("/v1/audio/transcriptions", files={"file": _file(speech)},
                             data={"temperature": "1.0", "seed": str(seed), "response_format": "text"})
        assert response.status_code == 200, response.text
        return response.text

    def chat(seed):
        response = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Say {seed}"}], "max_tokens": 3, "temperature": 1.0,
            "seed": seed, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}})
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        return message["content"], message["audio"]["data"]

    jobs = [(transcribe, s) for s in range(8)] + [(chat, s) for s in range(8)]
    alone = [job(seed) for job, seed in jobs]
    together: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def worker(i, job, seed):
        barrier.wait()
        together[i] = job(seed)

    threads = [threading.Thread(target=worker, args=(i, *job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone
    assert len(set(alone[:8])) > 1  # the seeds matter


def _tone(seconds: float, level: float = 0.3, subtype: str | None = None) -> bytes:
    out = io.BytesIO()
    t = np.arange(int(16_000 * seconds)) / 16_000
    soundfile.write(out, (level * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16_000, format="WAV",
                    subtype=subtype)
    return out.getvalue()


def test_a_gsm_wav_is_transcribed(http):
    """A WAV of GSM 6.10 (a codec libsndfile cannot seek in) is heard, not a 500."""
    out = io.BytesIO()
    t = np.arange(8_000) / 8_000
    soundfile.write(out, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 8_000, format="WAV",
                    subtype="GSM610")
    response = http.post("/v1/audio/transcriptions", files={"file": _file(out.getvalue())})
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["text"], str)


BAD = [
    ("no file", None, {}, 400, "file"),
    ("empty file", b"", {}, 400, "file"),
    ("garbage", b"this is not audio" * 20, {}, 400, "file"),
    ("loud float samples", "loud", {}, 400, "file"),  # ±1e20: a transcript of NUL characters otherwise
    ("too long", "long", {}, 400, "file"),
    ("unknown format", "speech", {"response_format": "srt"}, 400, "response_format"),
    ("unknown language", "speech", {"language": "klingon"}, 400, "language"),
    ("bad temperature", "speech", {"temperature": "hot"}, 400, "temperature"),
    ("bad stream", "speech", {"stream": "maybe"}, 400, "stream"),
    ("word timestamps", "speech", {"timestamp_granularities[]": "word"}, 400, "timestamp_granularities[]"),
    ("unknown field", "speech", {"colour": "blue"}, 400, "colour"),
    ("unknown model", "speech", {"model": "whisper-1"}, 404, "model"),
    ("seed below int64", "speech", {"seed": str(-(1 << 63) - 1)}, 400, "seed"),
    ("prompt over the token limit", "speech", {"prompt": "x" * 9000}, 400, "prompt"),  # 8192 tokens
    ("logprobs in text", "speech", {"include[]": "logprobs", "response_format": "text"}, 400, "include"),
    ("logprobs in verbose_json", "speech", {"include[]": "logprobs", "response_format": "verbose_json"}, 400,
     "include"),
    ("unknown include", "speech", {"include[]": "scores"}, 400, "include"),
    ("unknown include without brackets", "speech", {"include": "words"}, 400, "include"),
]


def test_a_negative_seed_is_taken_as_on_every_route(http, speech):
    """Any int64 seed, as chat and speech take it: a negative one samples like any other."""
    response = http.post("/v1/audio/transcriptions", files={"file": _file(speech)},
                         data={"seed": "-5", "temperature": "1"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("name, data, fields, status, param", BAD, ids=[case[0] for case in BAD])
def test_bad_input_is_a_4xx_naming_the_field(http, speech, name, data, fields, status, param):
    data = {"speech": speech, "long": _tone(LIMITS.max_audio_seconds + 1), "loud": _tone(1.0, 1e20, "FLOAT")}.get(
        data, data)
    if data is None:  # a form with no file part
        response = http.post("/v1/audio/transcriptions", headers={"content-type": "multipart/form-data; boundary=x"},
                             content=b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nomnimtp-tiny\r\n'
                                     b"--x--\r\n")
    else:
        response = http.post("/v1/audio/transcriptions", files={"file": _file(data)}, data=fields)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert http.get("/health").status_code == 200


def test_an_upload_over_the_prompt_limit_names_file(http, engine, speech, monkeypatch):
    """The prompt is the ASR instruction around the uploaded audio's rows: too long is the file's fault."""
    monkeypatch.setattr(engine, "max_prompt_tokens", 20)
    response = http.post("/v1/audio/transcriptions", files={"file": _file(speech)})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file" and "20" in response.json()["error"]["message"]


def test_the_server_token_limit_caps_transcripts_and_realtime_input_transcripts(pipe):
    """`--max-tokens-limit` under the model's reply cap caps a transcript, the route's and a realtime session's
    input transcript (a background request) alike; over it, the model's cap holds."""
    samples = np.zeros(16_000, dtype=np.float32)
    for limit, expected in ((3, 3), (1000, pipe.config.max_new_tokens)):
        context = SimpleNamespace(engine=SimpleNamespace(family=pipe.family, config=pipe.config),
                                  max_tokens_limit=limit)
        for is_background in (False, True):
            request = transcription_request(context, samples, None, None, 0.0, None, is_streamed=True,
                                            is_background=is_background)
            assert request.max_new_tokens == expected and request.is_background == is_background


def test_a_json_body_is_415_and_a_tts_model_is_400_naming_model(http, speech):
    response = http.post("/v1/audio/transcriptions", json={"file": "x", "model": "omnimtp-tiny"})
    assert response.status_code == 415
    engine = Engine(Qwen3TTSFamily.tiny(0), max_frames=4)
    with running_server(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:
            client.audio.transcriptions.create(model="omnimtp-tiny", file=_file(speech))
    assert caught.value.body["param"] == "model"


def test_realtime_input_transcripts_equal_the_routes(server, http, speech_path):
    """`session.audio.input.transcription`: a committed audio item gets delta events and a completed transcript
    equal to the route's for the same samples, while a response to it is spoken; a bad language is an error
    event naming the field."""
    samples, rate = soundfile.read(speech_path, dtype="float32")
    pcm16 = np.round(soxr.resample(samples, rate, 24_000) * 32767).clip(-32768, 32767).astype("<i2")
    heard = load_audio((pcm16.astype(np.float32) / 32768.0, 24_000), 16_000, LIMITS)  # what the session hears
    wav = io.BytesIO()
    soundfile.write(wav, heard, 16_000, format="WAV", subtype="FLOAT")
    expected = http.post("/v1/audio/transcriptions", files={"file": _file(wav.getvalue())},
                         data={"language": "en", "response_format": "text"}).text
    client = openai.OpenAI(base_url=f"{server}/v1", websocket_base_url=server.replace("http://", "ws://") + "/v1",
                           api_key="unused", max_retries=0)
    with client.realtime.connect(model="omnimtp-tiny") as connection:
        assert connection.recv().type == "session.created"
        connection.session.update(session={"type": "realtime", "audio": {"input": {
            "transcription": {"model": "omnimtp-tiny", "language": "klingon"}}}})
        error = connection.recv()
        assert error.type == "error" and error.error.param == "session.audio.input.transcription.language"
        connection.session.update(session={"type": "realtime", "max_output_tokens": 4, "audio": {"input": {
            "turn_detection": None, "transcription": {"model": "omnimtp-tiny", "language": "en"}}}})
        updated = connection.recv()
        assert updated.type == "session.updated" and updated.session.audio.input.transcription.language == "en"
        connection.input_audio_buffer.append(audio=base64.b64encode(pcm16.tobytes()).decode("ascii"))
        connection.input_audio_buffer.commit()
        connection.response.create()
        deltas, completed, is_done, item_id = [], None, False, None
        while completed is None or not is_done:
            event = connection.recv()
            assert event.type != "error", event
            if event.type == "input_audio_buffer.committed":
                item_id = event.item_id
            elif event.type == "conversation.item.input_audio_transcription.delta":
                deltas.append(event.delta)
            elif event.type == "conversation.item.input_audio_transcription.completed":
                completed = event
            is_done = is_done or event.type == "response.done"
    assert completed.item_id == item_id and completed.transcript == expected
    usage = completed.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert "".join(deltas).strip() == expected and expected


def test_a_large_malformed_upload_is_parsed_off_the_event_loop(server):
    """A 16 MiB multipart body of false boundaries (the parser's slowest input): `/health` answers while it is
    parsed (on a worker thread), and the upload gets its 400."""
    import time

    import httpx

    body = b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n"
    body += b"\r\n--Bx" * ((16 << 20) // 6 - 32)  # each a boundary, then not the end of one
    latencies, stop = [], threading.Event()

    def poll():
        with httpx.Client(base_url=server, timeout=60) as http:
            while not stop.is_set():
                started = time.perf_counter()
                http.get("/health")
                latencies.append(time.perf_counter() - started)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    try:
        response = httpx.post(server + "/v1/audio/transcriptions", content=body, timeout=120,
                              headers={"Content-Type": "multipart/form-data; boundary=B"})
    finally:
        stop.set()
        poller.join(60)
    assert response.status_code == 400, response.text
    print(f"/health max {max(latencies) * 1e3:.0f} ms over {len(latencies)} polls")
    assert max(latencies) < 1.0, max(latencies)


def test_models_lists_transcriptions_for_a_model_that_hears(http):
    (card,) = http.get("/v1/models").json()["data"]
    assert card["endpoints"] == ["/v1/chat/completions", "/v1/audio/speech", "/v1/audio/speech/batch",
                                 "/v1/audio/speech/stream", "/v1/audio/transcriptions", "/v1/realtime"]
