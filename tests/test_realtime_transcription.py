"""Realtime transcription sessions (`?intent=transcription`, `session.type: "transcription"`): server VAD turns of
real speech (espeak-ng) each transcribed (`conversation.item.input_audio_transcription.delta` / `.completed`),
never answered; the recognizer is a plug-in (`transcription.Recognizer`), the thinker today."""

from __future__ import annotations

import base64
import signal

import numpy as np
import pytest
import soundfile as sf
import soxr
from audio_checks import spoken_wav
from server_harness import running_server
from test_server_realtime import _client

import omnimtp.server.routes.realtime.transcription as transcription
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.media import MediaLimits
from omnimtp.server.app import create_app
from omnimtp.server.audio import to_pcm16
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATE = 24000


@pytest.fixture(scope="module")
def client():
    engine = Engine(Qwen3OmniFamily.tiny(0), max_new_tokens=8, max_frames=4, max_batch_size=4,
                    media_limits=MediaLimits(max_audio_seconds=4.0))
    with running_server(create_app(engine, max_tokens_limit=8)) as url:
        yield _client(url)


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    path = spoken_wav(tmp_path_factory.mktemp("stt") / "speech.wav", "hello, how are you today", "-s", "190")
    samples, rate = sf.read(path, dtype="float32")
    return soxr.resample(samples, rate, RATE).astype(np.float32)


def _append(connection, samples: np.ndarray) -> None:
    pcm = to_pcm16(samples).tobytes()
    for i in range(0, len(pcm), RATE // 25):  # 20 ms appends
        connection.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + RATE // 25]).decode())


def _until_completed(connection) -> list:
    events = []
    while (event := connection.recv()).type != "conversation.item.input_audio_transcription.completed":
        assert event.type != "error", event
        events.append(event)
    return [*events, event]


def test_an_intent_transcription_session_transcribes_each_turn_and_never_answers(client, speech):
    silence = np.zeros(RATE, dtype=np.float32)
    with client.realtime.connect(model="omnimtp-tiny", extra_query={"intent": "transcription"}) as connection:
        created = connection.recv()
        assert created.type == "session.created" and created.session.type == "transcription"
        assert created.session.audio.input.transcription.model == "omnimtp-tiny"
        assert created.session.audio.input.turn_detection.type == "server_vad"
        _append(connection, np.concatenate([silence[: RATE // 3], speech, silence]))
        events = _until_completed(connection)
        kinds = [event.type for event in events]
        assert kinds[:5] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
        assert not [kind for kind in kinds if kind.startswith("response.")]
        deltas = [event.delta for event in events if event.type.endswith(".delta")]
        assert deltas and events[-1].transcript == "".join(deltas).strip() and events[-1].transcript
        assert events[-1].item_id == events[2].item_id
        connection.response.create()
        error = connection.recv()
        assert error.type == "error" and error.error.param == "type", error


def test_a_session_update_makes_a_transcription_session_with_another_recognizer(client, speech, monkeypatch):
    async def recognizer(context, audio, language, prompt, logprobs=False):
        assert audio.ndim == 1 and audio.size > 16000 // 2 and language == "en"
        yield "hello"
        yield " there"
        yield transcription.Recognized(input_tokens=3, output_tokens=2)

    monkeypatch.setattr(transcription, "thinker_recognizer", recognizer)
    with client.realtime.connect(model="omnimtp-tiny") as connection:
        assert connection.recv().type == "session.created"
        connection.session.update(session={"type": "transcription", "audio": {"input": {
            "turn_detection": None, "transcription": {"model": "omnimtp-tiny", "language": "en"}}}})
        updated = connection.recv()
        assert updated.type == "session.updated" and updated.session.type == "transcription", updated
        _append(connection, speech)
        connection.input_audio_buffer.commit()
        events = _until_completed(connection)
    assert [event.delta for event in events if event.type.endswith(".delta")] == ["hello", " there"]
    assert events[-1].transcript == "hello there" and events[-1].usage.total_tokens == 5


def test_a_qwen3_asr_model_serves_transcription_sessions_and_nothing_else(speech, monkeypatch):
    """A model that only hears (Qwen3-ASR): a transcription session hears each turn while it is appended (live
    recognition, the reference's streaming mode: a transcription each LIVE_CHUNK_SECONDS continuing the last one
    less its unstable tokens), so the committed turn's transcript is `stream_recognition`'s of the same audio, not
    one transcription of the whole; its reply's language tag held back; a conversation is refused by name."""
    import omnimtp.server.routes.realtime.live as live
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.pipeline import OmniPipeline

    monkeypatch.setattr(live, "LIVE_CHUNK_SECONDS", 0.5)  # three live transcriptions of the ~2 s turn, then its tail

    family = Qwen3ASRFamily.tiny(0)
    engine = Engine(family, max_new_tokens=12, max_batch_size=2)
    with running_server(create_app(engine, max_tokens_limit=12)) as url:
        client = _client(url)
        with client.realtime.connect(model=engine.model_id, extra_query={"intent": "transcription"}) as connection:
            assert connection.recv().session.type == "transcription"
            connection.session.update(session={"type": "transcription", "audio": {"input": {"turn_detection": None}}})
            assert connection.recv().type == "session.updated"
            _append(connection, speech)
            connection.input_audio_buffer.commit()
            events = _until_completed(connection)
            committed = next(e for e in events if e.type == "conversation.item.done").item.content[0]
            connection.session.update(session={"type": "realtime"})
            error = connection.recv()
            assert error.type == "error" and error.error.param == "session.type", error
        with client.realtime.connect(model=engine.model_id) as connection:  # a conversation: refused, then closed
            error = connection.recv()
            assert error.type == "error" and error.error.param == "model", error
    deltas = "".join(event.delta for event in events if event.type.endswith(".delta"))
    assert "<asr_text>" not in deltas and events[-1].transcript == deltas.strip()
    assert committed.type == "input_audio"
    heard = soxr.resample(speech, RATE, 16000).astype(np.float32)  # what the session hears: its audio at 16 kHz
    pipe = OmniPipeline(family=family, max_new_tokens=12)
    partials = list(pipe.stream_recognition([heard], chunk_seconds=0.5))
    assert len(partials) == 4 and events[-1].transcript == partials[-1].text.strip()
    assert events[-1].transcript != pipe.transcribe((heard, 16000)).text.strip()  # (heard live, not at the end)


def test_logprobs_come_with_each_delta_and_the_completed_transcript(client, speech):
    """include: ["item.input_audio_transcription.logprobs"]: each `.delta` carries its tokens' logprobs and
    `.completed` all of them, whose bytes join to the transcript (the GA event models check their shape); they are
    `/v1/audio/transcriptions`' of the same audio; a session that asks none gets none."""
    import io

    events_by_include = {}
    for include in (["item.input_audio_transcription.logprobs"], None):
        with client.realtime.connect(model="omnimtp-tiny", extra_query={"intent": "transcription"}) as connection:
            assert connection.recv().type == "session.created"
            session = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}
            connection.session.update(session={**session, **({"include": include} if include else {})})
            updated = connection.recv()
            assert updated.type == "session.updated" and updated.session.include == include, updated
            _append(connection, speech)
            connection.input_audio_buffer.commit()
            events_by_include[bool(include)] = _until_completed(connection)
    events = events_by_include[True]
    deltas = [event for event in events if event.type.endswith(".delta")]
    carried = [lp.model_dump() for event in deltas for lp in event.logprobs]
    completed = events[-1]
    assert carried == [lp.model_dump() for lp in completed.logprobs] and carried
    joined = b"".join(bytes(lp.bytes) for lp in completed.logprobs).decode("utf-8", "replace")
    assert joined.strip() == completed.transcript
    buffer = io.BytesIO()
    sf.write(buffer, speech, RATE, format="WAV", subtype="PCM_16")
    served = client.audio.transcriptions.create(model="omnimtp-tiny", file=("turn.wav", buffer.getvalue()),
                                                include=["logprobs"])
    assert served.text == completed.transcript
    assert [lp.bytes for lp in served.logprobs] == [lp.bytes for lp in completed.logprobs]
    # (near, not equal: the session resamples its 24 kHz stream as it comes, the route the whole file)
    assert [lp.logprob for lp in served.logprobs] == pytest.approx([lp.logprob for lp in completed.logprobs],
                                                                   abs=5e-3)
    without = events_by_include[False]
    assert without[-1].logprobs is None and all(e.logprobs is None for e in without if e.type.endswith(".delta"))
    assert without[-1].transcript == completed.transcript


def test_a_qwen3_asr_session_asking_logprobs_transcribes_each_turn_whole_with_them(speech):
    """A Qwen3-ASR transcription session with include logprobs: each committed turn is one transcription of its
    audio (`transcribe`'s text, every token written by that request), its logprobs on the deltas and the
    completed event."""
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.pipeline import OmniPipeline

    family = Qwen3ASRFamily.tiny(0)
    engine = Engine(family, max_new_tokens=12, max_batch_size=2)
    with running_server(create_app(engine, max_tokens_limit=12)) as url:
        client = _client(url)
        with client.realtime.connect(model=engine.model_id, extra_query={"intent": "transcription"}) as connection:
            assert connection.recv().type == "session.created"
            connection.session.update(session={"type": "transcription", "audio": {"input": {"turn_detection": None}},
                                               "include": ["item.input_audio_transcription.logprobs"]})
            assert connection.recv().type == "session.updated"
            _append(connection, speech)
            connection.input_audio_buffer.commit()
            events = _until_completed(connection)
    heard = soxr.resample(speech, RATE, 16000).astype(np.float32)
    expected = OmniPipeline(family=family, max_new_tokens=12).transcribe((heard, 16000))
    completed = events[-1]
    assert completed.transcript == expected.text and completed.logprobs
    carried = [lp.model_dump() for e in events if e.type.endswith(".delta") for lp in e.logprobs]
    assert carried == [lp.model_dump() for lp in completed.logprobs]
    joined = b"".join(bytes(lp.bytes) for lp in completed.logprobs).decode("utf-8", "replace")
    assert joined.strip() == completed.transcript


def test_a_qwen3_asr_replys_language_tag_is_held_back_from_the_deltas(monkeypatch):
    """The thinker recognizer passes a Qwen3-ASR reply ("language English<asr_text>Hello there.") through the
    family's `transcript_deltas`: the deltas are the text alone."""
    import asyncio
    from types import SimpleNamespace

    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.sampling import TokenLogprob

    pieces = ["language", " English", "<asr_text>", "Hello", " there."]
    family = Qwen3ASRFamily.tiny(0)
    ids = [family.tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]

    class Handle:
        async def events(self):
            for i, text in enumerate(pieces):
                last = i == len(pieces) - 1
                yield SimpleNamespace(error=None, text=text, finish_reason="stop" if last else None,
                                      prompt_tokens=7, completion_tokens=len(pieces),
                                      logprobs=[TokenLogprob(t, -0.5 - i) for t in ids[i]])

        def cancel(self):
            pass

    async def submit(request):
        return Handle()

    context = SimpleNamespace(engine=SimpleNamespace(family=family), submit=submit)
    monkeypatch.setattr(transcription, "transcription_request", lambda *args, **kwargs: None)

    async def run():
        return [piece async for piece in transcription.thinker_recognizer(context, np.zeros(16000), None, None,
                                                                          logprobs=True)]

    out = asyncio.run(run())
    deltas = [p for p in out if isinstance(p, transcription.TranscriptDelta)]
    assert "".join(p.text for p in deltas) == "Hello there."
    assert out[-1] == transcription.Recognized(7, 5)
    # the logprobs are the transcript's tokens': those after the tag, each with its delta
    logprobs = [lp for delta in deltas for lp in delta.logprobs]
    assert b"".join(bytes(lp["bytes"]) for lp in logprobs) == b"Hello there."
    assert [lp["logprob"] for lp in logprobs] == [-3.5] * len(ids[3]) + [-4.5] * len(ids[4])


def test_server_vad_turns_are_heard_live_from_their_first_sample_to_their_last(speech, monkeypatch):
    """With server VAD a turn is heard live from its first sample (prefix padding included) to the sample it is
    committed at: its transcript is `stream_recognition`'s of exactly the committed item's audio."""
    import omnimtp.server.routes.realtime.conversation as conversation
    import omnimtp.server.routes.realtime.live as live
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.pipeline import OmniPipeline

    monkeypatch.setattr(live, "LIVE_CHUNK_SECONDS", 0.5)
    committed, transcribe_item = [], conversation.transcribe_item

    def capture(state, item, settings, live_recognition=None):
        assert live_recognition is not None  # heard as it came
        committed.append(item.content[0]["audio"])
        return transcribe_item(state, item, settings, live_recognition)

    monkeypatch.setattr(conversation, "transcribe_item", capture)
    family = Qwen3ASRFamily.tiny(0)
    engine = Engine(family, max_new_tokens=12, max_batch_size=2)
    silence = np.zeros(RATE, dtype=np.float32)
    with running_server(create_app(engine, max_tokens_limit=12)) as url:
        client = _client(url)
        with client.realtime.connect(model=engine.model_id, extra_query={"intent": "transcription"}) as connection:
            assert connection.recv().session.audio.input.turn_detection.type == "server_vad"
            _append(connection, np.concatenate([silence[: RATE // 3], speech, silence]))
            events = _until_completed(connection)
    (audio,) = committed
    partials = list(OmniPipeline(family=family, max_new_tokens=12).stream_recognition([audio], chunk_seconds=0.5))
    assert len(partials) >= 3 and events[-1].transcript == partials[-1].text.strip()


def test_a_live_recognition_that_fails_says_so_in_the_item_and_the_session_goes_on(speech, monkeypatch):
    import omnimtp.server.routes.realtime.live as live
    from omnimtp.families.asr_stream import StreamingRecognition

    def refuse(self):
        raise ValueError("audio: refused by the model")

    def hung(signum, frame):
        raise TimeoutError("no transcription event within 60 s: the failure was swallowed")

    monkeypatch.setattr(live, "LIVE_CHUNK_SECONDS", 0.5)
    monkeypatch.setattr(StreamingRecognition, "next_step", refuse)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        _session_with_a_refused_turn(speech)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _session_with_a_refused_turn(speech) -> None:
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily

    engine = Engine(Qwen3ASRFamily.tiny(0), max_new_tokens=12, max_batch_size=2)
    with running_server(create_app(engine, max_tokens_limit=12)) as url:
        client = _client(url)
        with client.realtime.connect(model=engine.model_id, extra_query={"intent": "transcription"}) as connection:
            connection.recv()
            connection.session.update(session={"type": "transcription", "audio": {"input": {"turn_detection": None}}})
            connection.recv()
            _append(connection, speech)
            connection.input_audio_buffer.commit()
            while (event := connection.recv()).type != "conversation.item.input_audio_transcription.failed":
                assert event.type != "error", event
            assert "refused by the model" in event.error.message
            connection.input_audio_buffer.clear()  # the session still answers
            assert connection.recv().type == "input_audio_buffer.cleared"
