"""Voice agents on `/v1/realtime`: server VAD (Silero on the session's own audio), barge-in and truncation.
Real speech made with espeak-ng; silence and a sine never start a turn; the detector's boundaries are
`silero_vad.get_speech_timestamps`'s; a session with default settings that streams speech and silence in 20 ms
appends, never committing, gets the reply a manual commit of the same audio gets (seeded); speech during a
response cancels it (barge-in); a truncated reply reaches the next turn's engine request cut to what was
heard."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import time
import warnings

import numpy as np
import openai
import pytest
import soundfile as sf
import soxr
import torch
from audio_checks import spoken_wav
from server_harness import running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.media import MediaLimits
from omnimtp.server.app import create_app
from omnimtp.server.audio import G711_RATE, g711_decode, g711_encode, to_pcm16
from omnimtp.server.scheduler import Engine
from omnimtp.server.vad import VAD_RATE, WINDOW_SAMPLES, SpeechDetector, TurnDetection, silero_model
from omnimtp.server.websocket import WebSocketLimits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "sk-vad"
RATE = 24000
APPEND_SAMPLES = RATE // 50  # 20 ms
SEED = 5
MAX_TOKENS = 6
MAX_SESSION_ITEMS = 8
MAX_SESSION_BYTES = 512 << 10  # two 4 s audio items (16 kHz float32) and some text


@pytest.fixture(scope="session")
def speech(tmp_path_factory) -> np.ndarray:
    """About 1.2 s of English from espeak-ng, at 24 kHz."""
    path = spoken_wav(tmp_path_factory.mktemp("vad") / "speech.wav", "hello, how are you today", "-s", "190")
    samples, rate = sf.read(path, dtype="float32")
    return soxr.resample(samples, rate, RATE).astype(np.float32)


def _silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def _feed(detector: SpeechDetector, samples: np.ndarray) -> list:
    events = []
    for i in range(0, len(samples), APPEND_SAMPLES):
        events += detector.feed(samples[i:i + APPEND_SAMPLES])
    return events


def test_boundaries_are_silero_get_speech_timestamps(speech):
    import silero_vad

    audio = np.concatenate([_silence(0.4), speech, _silence(0.8), speech, _silence(0.7)])
    config = TurnDetection(silence_duration_ms=400)
    events = _feed(SpeechDetector(config, RATE), audio)
    expected = silero_vad.get_speech_timestamps(torch.from_numpy(soxr.resample(audio, RATE, VAD_RATE)),
                                                silero_model(), threshold=config.threshold,
                                                min_silence_duration_ms=config.silence_duration_ms,
                                                speech_pad_ms=0, min_speech_duration_ms=0)
    assert len(expected) == 2
    assert [event.kind for event in events] == ["speech_started", "speech_stopped"] * 2
    boundaries = [sample for speech_ in expected for sample in (speech_["start"], speech_["end"])]
    for event, sample in zip(events, boundaries, strict=True):
        assert abs(event.sample - sample) <= WINDOW_SAMPLES


def _scripted(config: TurnDetection, scores: list[float]) -> list[tuple[int, int]]:
    """The (start, stop) samples of the turns a detector finds in windows that score `scores`."""
    detector = SpeechDetector(config, VAD_RATE)
    script = iter(scores)
    detector._score = lambda window: next(script)
    events = detector.feed(np.zeros(len(scores) * WINDOW_SAMPLES, dtype=np.float32))
    assert [event.kind for event in events] == ["speech_started", "speech_stopped"] * (len(events) // 2) + [
        "speech_started"] * (len(events) % 2)  # the last speech may go on
    return [(start.sample, stop.sample) for start, stop in zip(events[::2], events[1::2], strict=False)]


@pytest.mark.parametrize("threshold", [0.5, 0.1])
def test_the_exit_rule_is_silero_s_on_scripted_scores(threshold):
    """Inside speech a window scoring under threshold - 0.15 (at least 0.01) starts a possible end, one scoring
    between that and the threshold neither ends the speech nor takes a possible end back: the turns are
    `get_speech_timestamps_from_probs`'s on the same scores (its last, unfinished speech aside)."""
    from silero_vad.utils_vad import get_speech_timestamps_from_probs

    exit_threshold = max(threshold - 0.15, 0.01)
    above, below, high = exit_threshold + 0.01, exit_threshold - 0.005, threshold + 0.3
    windows = 5  # silence_duration_ms 160: five windows
    scores = ([0.0] * 3 + [high] * 4 + [above] * 12 + [high] + [below] * 3 + [above] * 3 + [below] * (windows + 2)
              + [high] * 2 + [below] * 2 + [high] + [below] * (windows + 1) + [high] * 3)
    config = TurnDetection(threshold=threshold, silence_duration_ms=windows * WINDOW_SAMPLES * 1000 // VAD_RATE)
    expected = get_speech_timestamps_from_probs(scores, threshold=threshold,
                                                min_silence_duration_ms=config.silence_duration_ms,
                                                speech_pad_ms=0, min_speech_duration_ms=0)
    turns = _scripted(config, scores)
    assert len(turns) == 2
    assert turns == [(speech_["start"], speech_["end"]) for speech_ in expected[: len(turns)]]
    # the first turn ends where the windows first fell under the exit threshold, not at the scores just above it
    assert turns[0][1] == (3 + 4 + 12 + 1) * WINDOW_SAMPLES


def test_silence_and_a_sine_never_start_a_turn():
    t = np.arange(2 * RATE) / RATE
    sine = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
    for audio in (_silence(2.0), sine):
        detector = SpeechDetector(TurnDetection(), RATE)
        assert _feed(detector, audio) == [] and not detector.is_speaking


# -- through the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return Engine(Qwen3OmniFamily.tiny(0), media_limits=MediaLimits(max_audio_seconds=4.0), max_frames=24,
                  max_batch_size=4)


@pytest.fixture(scope="module")
def client(engine):
    limits = WebSocketLimits(max_session_items=MAX_SESSION_ITEMS, max_session_bytes=MAX_SESSION_BYTES)
    with running_server(create_app(engine, api_key=KEY, websocket_limits=limits)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", websocket_base_url=url.replace("http://", "ws://") + "/v1",
                            api_key=KEY, max_retries=0)


@contextlib.contextmanager
def _connect(client, **session):
    with client.realtime.connect(model="omnimtp-tiny") as connection:
        assert connection.recv().type == "session.created"
        connection.session.update(session={"type": "realtime", "seed": SEED, "max_output_tokens": MAX_TOKENS,
                                           **session})
        updated = _next(connection)
        assert updated.type == "session.updated"
        yield connection, updated.session


def _next(connection):
    event = connection.recv()
    assert event.type != "error", event.error
    return event


def _append(connection, samples: np.ndarray, num_samples: int = APPEND_SAMPLES) -> None:
    pcm = to_pcm16(samples).tobytes()
    for i in range(0, len(pcm), 2 * num_samples):
        connection.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 2 * num_samples]).decode())


def _until_done(connection, first=None) -> tuple[list, dict]:
    events = [first] if first is not None else []
    while (event := _next(connection)).type != "response.done":
        events.append(event)
    events.append(event)
    pcm = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    return events, {"pcm": pcm, "text": text, "status": event.response.status}


def test_a_default_session_answers_when_the_speaker_stops(client, speech):
    audio = np.concatenate([_silence(0.5), speech, _silence(1.0)])
    with _connect(client) as (connection, described):
        vad = described.audio.input.turn_detection
        assert vad.type == "server_vad" and vad.silence_duration_ms == 500 and vad.prefix_padding_ms == 300
        _append(connection, audio)
        started, stopped, committed, created, done = (_next(connection) for _ in range(5))
        assert [started.type, stopped.type, committed.type, created.type, done.type] == [
            "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
            "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
        assert started.item_id == stopped.item_id == committed.item_id == created.item.id
        # speech begins about 0.5 s in; the turn holds 300 ms before it and 500 ms of silence after it
        assert 150 <= started.audio_start_ms <= 300
        assert stopped.audio_end_ms - started.audio_start_ms >= 300 + 500 + 800
        events, auto = _until_done(connection)
    assert events[0].type == "response.created" and auto["status"] in ("completed", "incomplete")
    assert np.abs(np.frombuffer(auto["pcm"], dtype="<i2")).max() > 100
    heard = audio[started.audio_start_ms * RATE // 1000:stopped.audio_end_ms * RATE // 1000]
    with _connect(client, audio={"input": {"turn_detection": None}}) as (connection, described):
        assert described.audio.input.turn_detection is None
        _append(connection, heard)
        connection.input_audio_buffer.commit()
        assert _next(connection).type == "input_audio_buffer.committed"
        assert [_next(connection).type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
        connection.response.create()
        _, manual = _until_done(connection)
    assert auto == manual


def test_speech_during_a_response_cancels_it(client, speech):
    with _connect(client, max_output_tokens="inf") as (connection, _):
        connection.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Talk for a while"}]})
        assert [_next(connection).type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
        connection.response.create()
        assert _next(connection).type == "response.created"
        _append(connection, speech[: RATE // 2])
        events, reply = _until_done(connection)
        assert "input_audio_buffer.speech_started" in [event.type for event in events]
        assert reply["status"] == "cancelled"
        assert events[-1].response.status_details.reason == "turn_detected"


def _turn_events(connection) -> list:
    """The five events of a turn the server VAD found and committed."""
    events = [_next(connection) for _ in range(5)]
    assert [event.type for event in events] == [
        "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"], events
    return events


def test_create_response_false_commits_the_turn_and_starts_no_response(client, speech):
    vad = {"type": "server_vad", "create_response": False}
    with _connect(client, audio={"input": {"turn_detection": vad}}) as (connection, described):
        assert described.audio.input.turn_detection.create_response is False
        _append(connection, np.concatenate([_silence(0.3), speech, _silence(0.8)]))
        _turn_events(connection)
        connection.response.create()  # an error event if the turn had started a response
        events, _ = _until_done(connection)
    assert [event.type for event in events].count("response.created") == 1


def test_interrupt_response_false_leaves_the_response_running(client, speech):
    vad = {"type": "server_vad", "interrupt_response": False, "create_response": False}
    with _connect(client, audio={"input": {"turn_detection": vad}}, max_output_tokens="inf") as (connection, _):
        _user_text(connection, "Talk for a while")
        connection.response.create()
        assert _next(connection).type == "response.created"
        _append(connection, speech[: RATE // 2])
        events, reply = _until_done(connection)
    assert "input_audio_buffer.speech_started" in [event.type for event in events]
    assert reply["status"] in ("completed", "incomplete")


def test_long_silence_under_vad_never_fills_the_buffer(client, engine):
    """Between turns the buffer keeps only the prefix padding's worth of audio: silence for longer than a turn's
    limit of audio is no error."""
    seconds = engine.media_limits.max_audio_seconds + 2
    with _connect(client) as (connection, _):
        _append(connection, _silence(seconds), RATE // 10)
        connection.session.update(session={"type": "realtime", "instructions": "Go on."})
        assert _next(connection).type == "session.updated"


def test_clearing_the_buffer_mid_speech_resets_the_detector(client, speech):
    """`input_audio_buffer.clear` while the speaker talks: the turn in progress is forgotten, and the next speech
    is a whole turn of its own (started, stopped, committed, answered)."""
    with _connect(client) as (connection, _):
        _append(connection, np.concatenate([_silence(0.3), speech[: len(speech) // 2]]))
        assert _next(connection).type == "input_audio_buffer.speech_started"
        connection.input_audio_buffer.clear()
        assert _next(connection).type == "input_audio_buffer.cleared"
        _append(connection, np.concatenate([_silence(0.6), speech, _silence(0.8)]))
        started, stopped, _, created, _ = _turn_events(connection)
        assert started.item_id == stopped.item_id == created.item.id
        # after the clear, and the whole speech (over a second), its prefix padding and its silence: no turn made
        # of the cleared speech's tail
        assert started.audio_start_ms >= 1000 * (0.3 + len(speech) // 2 / RATE)
        assert stopped.audio_end_ms - started.audio_start_ms >= 300 + 1000 + 500
        events, reply = _until_done(connection)
    assert events[0].type == "response.created" and reply["status"] in ("completed", "incomplete")


def _expected_end_ms(config: TurnDetection, samples: np.ndarray, rate: int, num_samples: int) -> float:
    """Where a fresh detector on `samples` (appended as PCM16, num_samples at a time) says the speech ends, plus
    silence_duration_ms: the speech_stopped's audio_end_ms, in ms from the first of these samples."""
    heard = to_pcm16(samples).astype(np.float32) / 32768.0
    detector = SpeechDetector(config, rate)
    events = []
    for i in range(0, len(heard), num_samples):
        events += detector.feed(heard[i:i + num_samples])
    stopped = [event for event in events if event.kind == "speech_stopped"]
    assert len(stopped) == 1
    return stopped[0].sample * 1000 / VAD_RATE + config.silence_duration_ms


SILENCE_MS = 400  # not the prefix padding's 300: the end is the silence's duration after the speech


@pytest.mark.parametrize("change", ["turn_detection", "rate"])
def test_a_session_update_between_turns_takes_effect_and_the_end_is_the_silence_after_the_speech(
        client, speech, change):
    """Half a second appended, then `session.update` of turn_detection (the silence duration) or of the input
    rate: the next turn's speech_stopped comes where a fresh detector with the new settings ends the speech,
    `silence_duration_ms` after it (audio_end_ms counts from the session's first sample)."""
    before = {"type": "server_vad", "create_response": False,
              "silence_duration_ms": 900 if change == "turn_detection" else SILENCE_MS}
    after = TurnDetection(silence_duration_ms=SILENCE_MS, create_response=False)
    rate = RATE if change == "turn_detection" else VAD_RATE
    with _connect(client, audio={"input": {"turn_detection": before}}) as (connection, _):
        _append(connection, _silence(0.5))
        new_vad = {"type": "server_vad", "silence_duration_ms": SILENCE_MS, "create_response": False}
        update = ({"turn_detection": new_vad} if change == "turn_detection"
                  else {"format": {"type": "audio/pcm", "rate": VAD_RATE}})
        connection.session.update(session={"type": "realtime", "audio": {"input": update}})
        assert _next(connection).type == "session.updated"
        turn = np.concatenate([soxr.resample(speech, RATE, rate).astype(np.float32), np.zeros(rate, np.float32)])
        _append(connection, turn, rate // 50)
        _, stopped, _, _, _ = _turn_events(connection)
        connection.session.update(session={"type": "realtime", "instructions": "Go on."})
        assert _next(connection).type == "session.updated"  # no response was started
    expected = 500 + _expected_end_ms(after, turn, rate, rate // 50)
    assert abs(stopped.audio_end_ms - expected) <= 1, (stopped.audio_end_ms, expected)


def test_semantic_vad_eagerness_is_the_silence_that_ends_a_turn(client, speech):
    """LiveKit's default turn detection: 0.7 s of silence after the speech ends a turn at eagerness "high"
    (250 ms) and not at "low" (1000 ms)."""
    audio = np.concatenate([_silence(0.3), speech, _silence(0.7)])
    for eagerness, ends in (("high", True), ("low", False)):
        turn_detection = {"type": "semantic_vad", "eagerness": eagerness, "create_response": False}
        with _connect(client, audio={"input": {"turn_detection": turn_detection}}) as (connection, described):
            vad = described.audio.input.turn_detection
            assert (vad.type, vad.eagerness, vad.create_response) == ("semantic_vad", eagerness, False)
            _append(connection, audio)
            assert _next(connection).type == "input_audio_buffer.speech_started"
            connection.session.update(session={"type": "realtime", "instructions": "Go on."})
            kinds = []
            while (kind := _next(connection).type) != "session.updated":
                kinds.append(kind)
            assert ("input_audio_buffer.speech_stopped" in kinds) == ends, (eagerness, kinds)


def test_idle_timeout_answers_the_users_silence_after_the_reply_has_played(client, speech):
    """idle_timeout_ms (either VAD type): the reply's audio played and that long more without speech, the session
    commits the buffered silence as a turn (`input_audio_buffer.timeout_triggered`) and answers it; speech
    before the timeout starts a turn as usual."""
    for turn_detection in ({"type": "server_vad", "idle_timeout_ms": 300},
                           {"type": "semantic_vad", "eagerness": "high", "idle_timeout_ms": 300}):
        with _connect(client, audio={"input": {"turn_detection": turn_detection}}) as (connection, described):
            assert described.audio.input.turn_detection.idle_timeout_ms == 300
            _user_text(connection, "Hello")
            connection.response.create()
            _, reply = _until_done(connection)
            played = len(reply["pcm"]) // 2 / RATE
            _append(connection, _silence(played + 0.2))  # the client streams silence while the reply plays
            time.sleep(played + 1.0)
            connection.session.update(session={"type": "realtime"})  # a marker: its session.updated
            events = []
            while True:
                events.append(_next(connection))
                kinds = [event.type for event in events]
                if "session.updated" in kinds and ("input_audio_buffer.timeout_triggered" not in kinds
                                                   or "response.done" in kinds):
                    break
            assert "input_audio_buffer.timeout_triggered" in kinds, kinds
            timeout = events[kinds.index("input_audio_buffer.timeout_triggered")]
            assert timeout.audio_end_ms > timeout.audio_start_ms
            turn = [kind for kind in kinds if kind != "session.updated"]
            assert turn[1:4] == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
            committed = events[kinds.index("input_audio_buffer.committed")]
            assert committed.item_id == timeout.item_id and events[-1].type in ("response.done", "session.updated")
            _append(connection, np.concatenate([speech, _silence(0.3)]))  # the user speaks before the timeout
            assert _next(connection).type == "input_audio_buffer.speech_started"


def test_bad_turn_detection_is_an_error_naming_the_field(client):
    with _connect(client) as (connection, _):
        for turn_detection, param in (({"type": "semantic_vad", "threshold": 0.5},
                                       "session.audio.input.turn_detection.threshold"),
                                      ({"type": "server_vad", "eagerness": "low"},
                                       "session.audio.input.turn_detection.eagerness"),
                                      ({"type": "server_vad", "threshold": 1.5},
                                       "session.audio.input.turn_detection.threshold"),
                                      ({"type": "server_vad", "silence_duration_ms": "x"},
                                       "session.audio.input.turn_detection.silence_duration_ms"),
                                      ({"type": "server_vad", "idle_timeout_ms": 50},
                                       "session.audio.input.turn_detection.idle_timeout_ms")):
            connection.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": turn_detection}}})
            event = connection.recv()
            assert event.type == "error" and event.error.param == param, (turn_detection, event)
        connection.session.update(session={"type": "realtime", "instructions": "Go on."})
        assert _next(connection).type == "session.updated"


def _user_text(connection, text: str) -> None:
    connection.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    assert [_next(connection).type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]


def test_truncate_cuts_the_reply_to_what_was_heard(client, engine, monkeypatch):
    submitted = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request, **kwargs: submitted.append(request) or submit(request,
                                                                                                      **kwargs))
    with _connect(client, audio={"input": {"turn_detection": None}}, max_output_tokens=16) as (connection, _):
        _user_text(connection, "Tell me a story")
        connection.response.create()
        events, reply = _until_done(connection)
        deltas = [e.delta for e in events if e.type == "response.output_audio_transcript.delta"]
        done = events[-1].response
        item_id, num_frames = done.output[0].id, done.usage.output_token_details.audio_tokens
        num_samples = len(reply["pcm"]) // 2
        assert num_frames >= 4 and len(deltas) >= 4
        audio_end_ms = num_samples * 1000 // RATE // 3
        for bad, param in (({"item_id": "item_nope"}, "item_id"), ({"content_index": 1}, "content_index"),
                           ({"audio_end_ms": 10**6}, "audio_end_ms"), ({"audio_end_ms": -1}, "audio_end_ms")):
            connection.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                             "audio_end_ms": audio_end_ms, **bad})
            event = connection.recv()
            assert event.type == "error" and event.error.param == param, (bad, event)
        connection.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=audio_end_ms)
        truncated = _next(connection)
        assert (truncated.type, truncated.item_id, truncated.audio_end_ms) == (
            "conversation.item.truncated", item_id, audio_end_ms)
        _user_text(connection, "Go on")
        connection.response.create()
        events, reply = _until_done(connection)
        duration_ms = len(reply["pcm"]) // 2 * 1000 // RATE  # a truncation at exactly the whole reply is heard
        connection.conversation.item.truncate(item_id=events[-1].response.output[0].id, content_index=0,
                                              audio_end_ms=duration_ms)
        assert _next(connection).audio_end_ms == duration_ms > 0
    heard_frames = audio_end_ms * RATE // 1000 * num_frames // num_samples
    heard = "".join(deltas[:heard_frames])
    assert heard != "".join(deltas)
    request = submitted[-1]
    assert request.messages[-2] == ("assistant", heard)
    unheard = dataclasses.replace(request, messages=(*request.messages[:-2], ("assistant", "".join(deltas)),
                                                     request.messages[-1]))
    assert engine.prompt_ids(request) != engine.prompt_ids(unheard)


def test_output_audio_buffer_clear_cancels_the_response(client):
    with _connect(client, audio={"input": {"turn_detection": None}}, max_output_tokens="inf") as (connection, _):
        _user_text(connection, "Talk for a while")
        connection.response.create()
        created = _next(connection)
        assert created.type == "response.created"
        connection.send({"type": "output_audio_buffer.clear"})
        events, reply = _until_done(connection)
        cleared = [event for event in events if event.type == "output_audio_buffer.cleared"]
        assert len(cleared) == 1 and cleared[0].response_id == created.response.id
        assert reply["status"] == "cancelled"


# -- G.711 ------------------------------------------------------------------------------------------


def _g711_error_bound(pcm: np.ndarray) -> np.ndarray:
    """G.711's quantisation error: under 1/32 of the level (a 4-bit mantissa), at least its smallest step."""
    return np.abs(pcm.astype(np.int64)) / 32 + 16


def _mu_law_sample(code: int) -> int:
    """ITU-T G.711 μ-law: a code word (as sent: all bits inverted) → its 16-bit reconstruction value."""
    u = ~code & 0xFF
    magnitude = ((((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)) - 0x84
    return -magnitude if u & 0x80 else magnitude


def _a_law_sample(code: int) -> int:
    """ITU-T G.711 A-law: a code word (as sent: even bits inverted) → its 16-bit reconstruction value."""
    a = code ^ 0x55
    segment, step = (a & 0x70) >> 4, (a & 0x0F) << 4
    magnitude = step + 8 if segment == 0 else (step + 0x108) << (segment - 1)
    return magnitude if a & 0x80 else -magnitude


# Samples and their code words from G.711's definition: zero, the smallest step either side, full scale either
# side, and both sides of the boundaries of the first and the last segment (reconstruction values: both ways).
MU_LAW = {0: 0xFF, 8: 0xFE, -8: 0x7E, 32124: 0x80, -32124: 0x00, 120: 0xF0, 132: 0xEF, 15996: 0x90, 16764: 0x8F,
          -16764: 0x0F}
A_LAW = {8: 0xD5, -8: 0x55, 32256: 0xAA, -32256: 0x2A, 248: 0xDA, 264: 0xC5, 16128: 0xBA, 16896: 0xA5,
         -16896: 0x25}
# Samples near the top of a segment, nearer the segment's last reconstruction value than the next segment's
# first, but past the decision level between them (μ-law 16252, A-law 16384): the next segment's code word.
MU_LAW_DECIDED = {16376: 0x8F, -16377: 0x0F}
A_LAW_DECIDED = {16510: 0xA5, -16511: 0x25}


def _audioop():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("audioop")


@pytest.mark.parametrize("fmt, table, decided, sample_of", [("audio/pcmu", MU_LAW, MU_LAW_DECIDED, _mu_law_sample),
                                                              ("audio/pcma", A_LAW, A_LAW_DECIDED, _a_law_sample)])
def test_g711_code_words_are_the_standard_s(fmt, table, decided, sample_of):
    """Known samples ↔ code words both ways; every code word decoded as G.711 defines it (and as Python's
    audioop, an independent implementation, decodes it); every 16-bit sample encoded as audioop encodes it,
    except that a negative sample is encoded by its one's complement as ITU-T G.191's reference encoder does
    (audioop negates it: μ-law code words of negative samples then differ at the decision levels)."""
    samples = np.array([*table, *decided], dtype=np.int16)
    assert g711_encode(samples, fmt) == bytes([*table.values(), *decided.values()])
    assert g711_decode(bytes(table.values()), fmt).tolist() == list(table)
    codes = bytes(range(256))
    decoded = g711_decode(codes, fmt)
    assert decoded.tolist() == [sample_of(code) for code in codes]
    audioop = _audioop()
    reference = audioop.ulaw2lin(codes, 2) if fmt == "audio/pcmu" else audioop.alaw2lin(codes, 2)
    assert decoded.tolist() == np.frombuffer(reference, dtype="<i2").tolist()
    every = np.arange(-32768, 32768, dtype=np.int64)
    encoded = np.frombuffer(g711_encode(every.astype(np.int16), fmt), dtype=np.uint8)
    lin2law = audioop.lin2ulaw if fmt == "audio/pcmu" else audioop.lin2alaw
    expected = np.frombuffer(lin2law(every.astype("<i2").tobytes(), 2), dtype=np.uint8)
    non_negative = every >= 0
    np.testing.assert_array_equal(encoded[non_negative], expected[non_negative])
    np.testing.assert_array_equal(encoded[~every[non_negative] + 32768], encoded[non_negative] ^ 0x80)
    if fmt == "audio/pcma":  # A-law cuts 3 bits more: audioop's negation lands in the same code word
        np.testing.assert_array_equal(encoded, expected)
    assert g711_encode(decoded, fmt) == bytes(0xFF if code == 0x7F and fmt == "audio/pcmu" else code
                                              for code in codes)  # μ-law's two zeros: 0 encodes as 0xFF


@pytest.mark.parametrize("fmt", ["audio/pcmu", "audio/pcma"])
def test_g711_round_trip_within_its_error(speech, fmt):
    pcm = to_pcm16(soxr.resample(speech, RATE, G711_RATE))
    data = g711_encode(pcm, fmt)
    assert len(data) == len(pcm)
    decoded = g711_decode(data, fmt)
    assert np.abs(pcm).max() > 3000
    assert np.all(np.abs(decoded.astype(np.int64) - pcm) <= _g711_error_bound(pcm))
    negative_zero = b"\x7f" if fmt == "audio/pcmu" else b""  # μ-law's -0 decodes to 0, which encodes as +0
    assert g711_encode(decoded, fmt) == (data.replace(negative_zero, b"\xff") if negative_zero else data)
    assert g711_decode(data, "audio/pcma" if fmt == "audio/pcmu" else "audio/pcmu").tolist() != decoded.tolist()


def test_a_phone_turn_in_mu_law_and_out_in_a_law(client, speech):
    """μ-law in, A-law out: the reply is the PCM path's on the same decoded audio, its audio the PCM path's
    within G.711's error."""
    pcm8k = to_pcm16(soxr.resample(speech[: RATE * 3 // 2], RATE, G711_RATE))
    mu_law = g711_encode(pcm8k, "audio/pcmu")
    formats = {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
               "output": {"format": {"type": "audio/pcma"}}}
    with _connect(client, audio=formats) as (connection, described):
        assert described.audio.input.format.type == "audio/pcmu"
        assert described.audio.output.format.type == "audio/pcma"
        connection.input_audio_buffer.append(audio=base64.b64encode(mu_law).decode())
        connection.input_audio_buffer.commit()
        assert _next(connection).type == "input_audio_buffer.committed"
        assert [_next(connection).type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
        connection.response.create()
        _, phone = _until_done(connection)
    heard = g711_decode(mu_law, "audio/pcmu").astype(np.float32) / 32768.0
    pcm_formats = {"input": {"format": {"type": "audio/pcm", "rate": G711_RATE}, "turn_detection": None}}
    with _connect(client, audio=pcm_formats) as (connection, _):
        _append(connection, heard)  # exactly the samples the μ-law turn decoded to
        connection.input_audio_buffer.commit()
        assert _next(connection).type == "input_audio_buffer.committed"
        assert [_next(connection).type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
        connection.response.create()
        _, plain = _until_done(connection)
    assert phone["text"] == plain["text"]
    reference = to_pcm16(soxr.resample(np.frombuffer(plain["pcm"], dtype="<i2").astype(np.float32) / 32768.0,
                                        RATE, G711_RATE)).astype(np.float64)
    served = g711_decode(phone["pcm"], "audio/pcma").astype(np.float64)
    assert np.abs(served).max() > 100 and len(served) == len(reference)
    assert np.sqrt(np.mean((served - reference) ** 2)) < 0.05 * np.sqrt(np.mean(reference**2))


# -- bounded sessions -------------------------------------------------------------------------------


def test_a_conversation_is_bounded_in_items_and_bytes(client):
    with _connect(client, audio={"input": {"turn_detection": None}}) as (connection, _):
        four_seconds = base64.b64encode(bytes(2 * 4 * RATE)).decode()
        audio_item = {"type": "message", "role": "user", "content": [{"type": "input_audio",
                                                                      "audio": four_seconds}]}
        for _ in range(2):
            connection.conversation.item.create(item=audio_item)
            assert [_next(connection).type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
        connection.conversation.item.create(item=audio_item)
        event = connection.recv()
        assert event.type == "error" and event.error.param == "max_session_bytes", event
        for _ in range(MAX_SESSION_ITEMS - 2):
            _user_text(connection, "x")
        for send in (lambda: connection.conversation.item.create(item={"type": "message", "role": "user",
                                                                       "content": [{"type": "input_text",
                                                                                    "text": "x"}]}),
                     connection.response.create):
            send()
            event = connection.recv()
            assert event.type == "error" and event.error.param == "max_session_items", event
            assert "--max-session-items" in event.error.message
