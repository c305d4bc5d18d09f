"""Realtime transcription sessions (`?intent=transcription`, `session.type: "transcription"`): server VAD turns of
real speech (espeak-ng) each transcribed (`conversation.item.input_audio_transcription.delta` / `.completed`),
never answered; the recognizer is a plug-in (`transcription.Recognizer`), the thinker today."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import soundfile as sf
import soxr
from audio_checks import spoken_wav
from server_harness import running_server

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
        yield openai.OpenAI(base_url=f"{url}/v1", websocket_base_url=url.replace("http://", "ws://") + "/v1",
                            api_key="unused", max_retries=0)


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
    async def recognizer(context, audio, language, prompt):
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
