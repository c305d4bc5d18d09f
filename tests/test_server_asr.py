"""A Qwen3-ASR model served, with a Qwen3-ForcedAligner beside it, through the official `openai` client: the
served transcript is `OmniPipeline.transcribe`'s in every format and streamed, word timestamps are the aligner's
on that transcript, and bad input is a 4xx naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import qwen_asr_reference as reference
from audio_checks import spoken_wav
from server_harness import running_server

from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import Request
from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner
from omnimtp.families.qwen3_asr import Qwen3ASRFamily
from omnimtp.media import MediaLimits, load_audio
from omnimtp.pipeline import OmniPipeline
from omnimtp.server.app import create_app
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 24
LIMITS = MediaLimits(max_audio_seconds=4.0)
MODEL = "tiny-asr"


@pytest.fixture(scope="module")
def speech_path(tmp_path_factory) -> str:
    return str(spoken_wav(tmp_path_factory.mktemp("asr") / "hello.wav", "hello world, this is a test"))


@pytest.fixture(scope="module")
def family():
    return Qwen3ASRFamily.tiny(0)


@pytest.fixture(scope="module")
def aligner():
    return Qwen3ForcedAligner.tiny(0)


@pytest.fixture(scope="module")
def server(family, aligner):
    engine = Engine(family, model_id=MODEL, max_new_tokens=MAX_NEW_TOKENS, max_batch_size=4, media_limits=LIMITS)
    with running_server(create_app(engine, aligner=aligner)) as url:
        yield url


@pytest.fixture(scope="module")
def pipe(family):
    return OmniPipeline(family=family, max_new_tokens=MAX_NEW_TOKENS, media_limits=LIMITS)


def _file(path: str):
    return ("hello.wav", Path(path).read_bytes(), "audio/wav")


@pytest.mark.parametrize("language", [None, "en"])
def test_every_format_and_the_stream_give_the_pipelines_text(client, pipe, speech_path, language):
    expected = pipe.transcribe(speech_path, language=language, prompt="A greeting.")
    assert expected.text_ids
    common = dict(model=MODEL, file=_file(speech_path), prompt="A greeting.", **({"language": language} if language
                                                                                 else {}))
    assert client.audio.transcriptions.create(**common).text == expected.text
    assert client.audio.transcriptions.create(**common, response_format="text").strip() == expected.text
    verbose = client.audio.transcriptions.create(**common, response_format="verbose_json")
    assert verbose.text == expected.text
    assert verbose.language == (None if expected.language is None else expected.language.lower())
    events = list(client.audio.transcriptions.create(**common, stream=True))
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == expected.text
    assert events[-1].type == "transcript.text.done" and events[-1].text == expected.text


@pytest.mark.parametrize("language", [None, "en"])
def test_logprobs_are_the_engines_for_the_transcripts_tokens(client, family, speech_path, language):
    """include=["logprobs"] on a Qwen3-ASR model: the engine's logprobs of the reply's tokens (their bytes join to
    the transcript), the same in the json body, across the stream's deltas and in its done event."""
    samples = load_audio(speech_path, 16_000, LIMITS, "file")
    ids, media = family.transcription_inputs(samples, language, "A greeting.")
    core = EngineCore(family)
    core.add(Request(0, ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=1, media=media, logprobs=0))
    while core.has_work():
        finished = [event.request for event in core.step() if event.is_finished]
    engine_logprobs = finished[0].output_logprobs[:len(finished[0].reply_ids)]
    common = dict(model=MODEL, file=_file(speech_path), prompt="A greeting.", include=["logprobs"],
                  **({"language": language} if language else {}))
    served = client.audio.transcriptions.create(**common)
    assert [lp.logprob for lp in served.logprobs] == pytest.approx([lp.logprob for lp in engine_logprobs], abs=1e-6)
    joined = b"".join(bytes(int(b) for b in lp.bytes) for lp in served.logprobs)
    assert joined.decode("utf-8", "replace").strip() == served.text and served.text
    events = list(client.audio.transcriptions.create(**common, stream=True))
    carried = [lp for e in events if e.type == "transcript.text.delta" for lp in e.logprobs]
    assert [lp.model_dump() for lp in carried] == [lp.model_dump() for lp in events[-1].logprobs] \
        == [lp.model_dump() for lp in served.logprobs]


def test_word_timestamps_are_the_aligners_on_the_transcript(client, pipe, aligner, speech_path):
    """`timestamp_granularities=["word"]` (and with "segment") gives OpenAI's `words` shape: the aligner's words of
    the served transcript on the uploaded audio."""
    expected = pipe.transcribe(speech_path, language="en")
    samples = load_audio(speech_path, 16_000, LIMITS)
    words = aligner.align(samples, expected.text, "English")
    assert words  # the tiny model's transcript holds letters to align
    for granularities in (["word"], ["word", "segment"]):
        verbose = client.audio.transcriptions.create(model=MODEL, file=_file(speech_path), language="en",
                                                     response_format="verbose_json",
                                                     timestamp_granularities=granularities)
        assert verbose.text == expected.text
        assert [(w.word, w.start, w.end) for w in verbose.words] == [(w.word, w.start, w.end) for w in words]
        assert len(verbose.segments) == 1
    reference.need_word_splitters()  # Japanese: the transcript's words as nagisa splits them
    japanese = pipe.transcribe(speech_path, language="ja")
    verbose = client.audio.transcriptions.create(model=MODEL, file=_file(speech_path), language="ja",
                                                 response_format="verbose_json", timestamp_granularities=["word"])
    assert verbose.text == japanese.text
    assert [(w.word, w.start, w.end) for w in verbose.words] == [
        (w.word, w.start, w.end) for w in aligner.align(samples, japanese.text, "ja")]


BAD = [
    ("unknown language", {"language": "klingon"}, "language"),
    ("words outside verbose_json", {"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),
    ("unknown granularity", {"timestamp_granularities[]": "phoneme", "response_format": "verbose_json"},
     "timestamp_granularities[]"),
]


@pytest.mark.parametrize("name, fields, param", BAD, ids=[case[0] for case in BAD])
def test_bad_input_is_a_400_naming_the_field(http, speech_path, name, fields, param):
    response = http.post("/v1/audio/transcriptions", files={"file": _file(speech_path)}, data=fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("body", [b"", b"not audio at all" * 10, np.zeros(16_000 * 5, np.int16).tobytes()])
def test_bad_files_are_a_400_naming_file(http, body):
    import io

    import soundfile

    if len(body) == 16_000 * 5 * 2:  # five seconds of audio: over the server's 4 s
        out = io.BytesIO()
        soundfile.write(out, np.zeros(16_000 * 5, np.float32), 16_000, format="WAV")
        body = out.getvalue()
    response = http.post("/v1/audio/transcriptions", files={"file": ("a.wav", body, "audio/wav")})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file"


def test_the_model_hears_and_does_not_speak(http, family, aligner):
    from omnimtp.server.cli import banner

    engine = Engine(family, model_id=MODEL, max_batch_size=2)
    assert "speech recognition: POST /v1/audio/transcriptions" in banner(engine, "http://x", playground=False)
    (card,) = http.get("/v1/models").json()["data"]
    assert card["family"] == "qwen3_asr" and card["endpoints"] == ["/v1/audio/transcriptions", "/v1/realtime"]
    response = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi", "voice": "alloy"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model", response.text
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                    "content": "Hi"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model", response.text


def test_without_an_aligner_word_timestamps_are_a_400_naming_timestamp_granularities(family, speech_path):
    engine = Engine(family, model_id=MODEL, max_new_tokens=4, max_batch_size=2, media_limits=LIMITS)
    with running_server(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:
            client.audio.transcriptions.create(model=MODEL, file=_file(speech_path), response_format="verbose_json",
                                               timestamp_granularities=["word"])
        assert httpx.get(f"{url}/health").status_code == 200
    assert caught.value.body["param"] == "timestamp_granularities[]"
    assert "--aligner-model" in caught.value.body["message"]


def test_an_omni_model_with_an_aligner_gives_word_timestamps_too(aligner, speech_path):
    """The aligner serves either kind of model: an omni model's transcript (its language the hint) aligned."""
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily

    engine = Engine(Qwen3OmniFamily.tiny(0), max_new_tokens=16, max_frames=4, max_batch_size=2, media_limits=LIMITS)
    pipe = OmniPipeline(family=engine.family, max_new_tokens=16, media_limits=LIMITS)
    expected = pipe.transcribe(speech_path, language="en")
    words = aligner.align(load_audio(speech_path, 16_000, LIMITS), expected.text, "en")
    with running_server(create_app(engine, aligner=aligner)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        verbose = client.audio.transcriptions.create(model="omnimtp-tiny", file=_file(speech_path), language="en",
                                                     response_format="verbose_json", timestamp_granularities=["word"])
    assert verbose.text == expected.text and verbose.language == "english"
    assert [(w.word, w.start, w.end) for w in verbose.words] == [(w.word, w.start, w.end) for w in words]


def test_speech_the_server_made_gets_word_timestamps(aligner):
    """`/v1/audio/speech` with `timestamp_granularities: ["word"]` (SSE): `speech.audio.done` carries the aligner's
    words of the input on the request's audio, the pipeline's audio for the same greedy request."""
    import base64
    import json

    from omnimtp.families.qwen3_tts import Qwen3TTSFamily

    family = Qwen3TTSFamily.tiny(0)
    text = "Hello there, this is a test."
    output = OmniPipeline(family=family, max_frames=12).speech(text, voice="aiden", language="english",
                                                                sampling=None)
    expected = aligner.align((output.audio, family.sample_rate), text, "English")
    assert [w.word for w in expected] == ["Hello", "there", "this", "is", "a", "test"]
    engine = Engine(family, model_id="tiny-tts", max_frames=12, max_batch_size=2)
    body = {"model": "tiny-tts", "input": text, "voice": "aiden", "language": "english", "temperature": 0,
            "response_format": "pcm", "stream_format": "sse", "timestamp_granularities": ["word"]}
    with running_server(create_app(engine, aligner=aligner)) as url, httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert len(pcm) == 2 * len(output.audio)
        assert events[-1]["type"] == "speech.audio.done"
        assert events[-1]["words"] == [{"word": w.word, "start": w.start, "end": w.end} for w in expected]
        for fields, param in (({"stream_format": "audio"}, "timestamp_granularities"),
                              ({"language": "klingon"}, "language"),
                              ({"timestamp_granularities": ["phoneme"]}, "timestamp_granularities.0")):
            response = http.post("/v1/audio/speech", json={**body, **fields})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        batch = http.post("/v1/audio/speech/batch", json={"items": [body]}).json()
        assert batch["data"][0]["error"]["param"] == "items[0].timestamp_granularities"
    with running_server(create_app(engine)) as url:
        response = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "timestamp_granularities"


def test_a_recognizer_served_beside_an_omni_model_hears_for_it(family, pipe, speech_path):
    """`serve --asr-model`: the realtime session's input transcripts and /v1/audio/transcriptions under the
    recognizer's names (its own, OpenAI's transcription models') come from the Qwen3-ASR engine, the omni
    model's own name still from its thinker; /v1/models lists both, /health waits for both."""
    import base64

    import soxr

    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.server.audio import to_pcm16

    omni = Engine(Qwen3OmniFamily.tiny(0), max_new_tokens=4, max_frames=4, max_batch_size=2, media_limits=LIMITS)
    asr = Engine(family, model_id=MODEL, max_new_tokens=MAX_NEW_TOKENS, max_batch_size=2, media_limits=LIMITS)
    expected = pipe.transcribe(speech_path).text
    with running_server(create_app(omni, asr_engine=asr, openai_aliases=True)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", websocket_base_url=url.replace("http://", "ws://") + "/v1",
                               api_key="unused", max_retries=0)
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        cards = {card.id: card for card in client.models.list().data}
        assert cards["omnimtp-tiny"].family == "qwen3_omni_moe" and cards[MODEL].family == "qwen3_asr"
        assert cards["whisper-1"].family == "qwen3_asr" and cards["gpt-realtime"].family == "qwen3_omni_moe"
        for name in (MODEL, "whisper-1"):
            heard = client.audio.transcriptions.create(model=name, file=_file(speech_path))
            assert heard.text == expected.strip(), name
        by_thinker = client.audio.transcriptions.create(model="omnimtp-tiny", file=_file(speech_path))
        samples = load_audio(speech_path, 24_000, LIMITS, "audio")
        with client.realtime.connect(model="omnimtp-tiny") as connection:
            assert connection.recv().type == "session.created"
            connection.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": None, "transcription": {}}}})
            updated = connection.recv()
            assert updated.session.audio.input.transcription.model == MODEL, updated
            pcm = to_pcm16(samples).tobytes()
            connection.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
            connection.input_audio_buffer.commit()
            while (event := connection.recv()).type != "conversation.item.input_audio_transcription.completed":
                assert event.type != "error", event
    heard_16k = soxr.resample(samples, 24_000, 16_000).astype(np.float32)
    assert event.transcript == pipe.transcribe((heard_16k, 16_000)).text.strip()
    assert by_thinker.text != expected.strip()  # (the omni thinker's words, not the recognizer's)


def test_serve_takes_an_asr_model_beside_its_model_and_refuses_another_kind(capsys):
    from omnimtp.cli import build_parser, main
    from omnimtp.server.build import build_app

    engine, app = build_app(build_parser().parse_args(["serve", "--asr-model", "tiny-asr"]))
    assert isinstance(app.state.serving.asr.engine.family, Qwen3ASRFamily) and engine.family.speaks
    assert main(["serve", "--asr-model", "tiny-tts"]) == 2
    assert "--asr-model: 'tiny-tts' is not a Qwen3-ASR checkpoint" in capsys.readouterr().err
