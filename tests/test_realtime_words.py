"""Word timestamps of the speech a realtime response makes, where the server loads a forced aligner: the
`words` of `response.output_audio_transcript.done` are the aligner's on the reply's transcript and audio (the
seeded pipeline's), a truncation cuts the transcript after the last word heard whole, a stopped response does
not wait for its words (the item still gets them), and a server without an aligner sends none."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time

import numpy as np
import pytest
from server_harness import running_server
from test_server_realtime import _client, _next

from omnimtp.families.aligner_words import split_words
from omnimtp.families.qwen3_aligner import AlignedWord, Qwen3ForcedAligner
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.server.app import create_app
from omnimtp.server.routes.realtime.conversation import heard_words
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATE = 24000
SEED = 0
MAX_TOKENS = 12
MAX_FRAMES = 24


@pytest.fixture(scope="module")
def family():
    return Qwen3OmniFamily.tiny(0)


@pytest.fixture(scope="module")
def aligner():
    return Qwen3ForcedAligner.tiny(0)


@pytest.fixture(scope="module")
def engine(family):
    return Engine(family, max_frames=MAX_FRAMES, max_batch_size=2)


@pytest.fixture(scope="module")
def client(engine, aligner):
    with running_server(create_app(engine, aligner=aligner)) as url:
        yield _client(url)


@pytest.fixture(scope="module")
def expected(family, aligner):
    """The seeded pipeline's reply to "Tell me a story": its transcript, and the aligner's words on it."""
    pipe = OmniPipeline(family=family, max_frames=MAX_FRAMES)
    sampling = SamplingParams(temperature=1.0)
    texts, chunks = [], []
    for event in pipe.stream([{"role": "user", "content": "Tell me a story"}], speaker=family.default_speaker,
                             thinker_sampling=sampling, talker_sampling=family.sampled_talker(sampling),
                             max_new_tokens=MAX_TOKENS, seed=SEED):
        texts.append(event.text)
        if event.audio is not None:
            chunks.append(event.audio)
    text = "".join(texts)
    return text, aligner.align((np.concatenate(chunks), RATE), text, None)


@contextlib.contextmanager
def _connect(client):
    with client.realtime.connect(model="omnimtp-tiny") as connection:
        assert connection.recv().type == "session.created"
        connection.session.update(session={"type": "realtime", "seed": SEED, "max_output_tokens": MAX_TOKENS,
                                           "audio": {"input": {"turn_detection": None}}})
        assert _next(connection).type == "session.updated"
        yield connection


def _user_text(connection, text: str) -> None:
    connection.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    assert [_next(connection).type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]


def _reply(connection) -> tuple[dict, str]:
    """response.create, then its events until response.done: the transcript's done event (as a dict) and the
    reply's item id."""
    connection.response.create()
    done = None
    while (event := _next(connection)).type != "response.done":
        if event.type == "response.output_audio_transcript.done":
            done = event.to_dict()
    return done, event.response.output[0].id


def _as_dicts(words) -> list[dict]:
    return [{"word": w.word, "start": w.start, "end": w.end} for w in words]


def test_heard_words_cuts_after_the_last_word_heard_whole():
    words = (AlignedWord("Hi", 0.0, 0.2), AlignedWord("you", 0.3, 0.5), AlignedWord("there", 0.6, 0.9))
    assert heard_words("Hi, you there.", words, 700) == ("Hi, you", words[:2])
    assert heard_words("Hi, you there.", words, 500) == ("Hi, you", words[:2])
    assert heard_words("Hi, you there.", words, 499) == ("Hi", words[:1])
    assert heard_words("Hi, you there.", words, 900) == ("Hi, you there.", words)  # all heard: the whole text
    assert heard_words("Hi, you there.", words, 100) == ("", ())
    cjk = (AlignedWord("你", 0.0, 0.2), AlignedWord("好", 0.2, 0.4), AlignedWord("abc", 0.4, 0.8))
    assert heard_words("你好, abc!", cjk, 450) == ("你好", cjk[:2])


def _spread(text: str, duration: float) -> list[AlignedWord]:
    """An aligner with known times: each letter or digit of the transcript a unit (as each CJK character is),
    the units spread evenly over the audio (the tiny aligner's random bins fall anywhere in its reach)."""
    units = [char for word in split_words(text) for char in word]
    step = duration / len(units)
    return [AlignedWord(unit, round(i * step, 3), round((i + 1) * step, 3)) for i, unit in enumerate(units)]


def _spread_aligner(aligner, monkeypatch, hold: threading.Event | None = None) -> threading.Event:
    """`aligner.align` as `_spread` (after `hold` is set, where given); the event set once it has aligned."""
    aligned = threading.Event()

    def align(audio, text, language, limits=None):
        if hold is not None:
            hold.wait(20)
        samples, rate = audio
        aligned.set()
        return _spread(text, len(samples) / rate)

    monkeypatch.setattr(aligner, "align", align)
    return aligned


def test_a_spoken_reply_gets_the_aligners_words(client, expected):
    """The words are the aligner's; the event with them is still what pipecat's realtime service parses (its
    models ignore the extra field; LiveKit's reads the `openai` package's, which the suite checks every event
    against)."""
    from pipecat.services.openai.realtime.events import ResponseAudioTranscriptDone, parse_server_event

    text, words = expected
    assert words  # the tiny model's reply holds letters to align
    with _connect(client) as connection:
        _user_text(connection, "Tell me a story")
        done, _ = _reply(connection)
    assert done["transcript"] == text
    assert done["words"] == _as_dicts(words)
    parsed = parse_server_event(json.dumps(done))
    assert isinstance(parsed, ResponseAudioTranscriptDone) and parsed.transcript == text


def test_a_truncation_cuts_the_transcript_after_the_last_word_heard(client, engine, aligner, expected,
                                                                     monkeypatch):
    text, _ = expected
    _spread_aligner(aligner, monkeypatch)
    submitted = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request, **kw: submitted.append(request) or submit(request, **kw))
    with _connect(client) as connection:
        _user_text(connection, "Tell me a story")
        done, item_id = _reply(connection)
        words = done["words"]
        assert len(words) >= 4
        k = len(words) // 2
        audio_end_ms = round(words[k]["end"] * 1000) + 10  # heard a little into the next word
        assert round(words[k + 1]["end"] * 1000) > audio_end_ms
        connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=audio_end_ms)
        assert _next(connection).type == "conversation.item.truncated"
        connection.conversation.item.retrieve(item_id=item_id)
        heard = _next(connection).item.content[0].transcript
        _user_text(connection, "Go on")
        _reply(connection)
    assert "".join(split_words(heard)) == "".join(w["word"] for w in words[: k + 1])
    assert text.startswith(heard) and heard.endswith(words[k]["word"])
    assert submitted[-1].messages[-2] == ("assistant", heard)


def test_a_stopped_response_does_not_wait_for_its_words_and_its_item_gets_them(client, aligner, expected,
                                                                               monkeypatch):
    """response.cancel while the reply is being aligned: response.done comes at once (the transcript's done
    event without words), and a truncation once the words came cuts at a heard word."""
    text, _ = expected
    release = threading.Event()
    aligned = _spread_aligner(aligner, monkeypatch, hold=release)
    with _connect(client) as connection:
        _user_text(connection, "Tell me a story")
        connection.response.create()
        num_bytes = 0
        while (event := _next(connection)).type != "response.output_audio.done":
            if event.type == "response.output_audio.delta":
                num_bytes += len(base64.b64decode(event.delta))
        connection.response.cancel()
        while (event := _next(connection)).type != "response.done":
            if event.type == "response.output_audio_transcript.done":
                done = event.to_dict()
        item_id = event.response.output[0].id
        assert done["transcript"] == text and "words" not in done
        release.set()
        assert aligned.wait(20)
        time.sleep(0.5)  # (the words reach the item from the event loop's thread just after)
        words = _spread(text, num_bytes / 2 / RATE)
        connection.conversation.item.truncate(item_id=item_id, content_index=0,
                                              audio_end_ms=round(words[1].end * 1000))
        assert _next(connection).type == "conversation.item.truncated"
        connection.conversation.item.retrieve(item_id=item_id)
        heard = _next(connection).item.content[0].transcript
    assert "".join(split_words(heard)) == words[0].word + words[1].word


def test_without_an_aligner_a_reply_has_no_words(family):
    engine = Engine(family, max_frames=MAX_FRAMES, max_batch_size=1)
    with running_server(create_app(engine)) as url, _connect(_client(url)) as connection:
        _user_text(connection, "Tell me a story")
        done, _ = _reply(connection)
    assert done["transcript"] and "words" not in done
