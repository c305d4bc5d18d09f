"""LiveKit Agents' OpenAI plugin (`livekit-plugins-openai`) against `omnimtp serve`'s app on the tiny Qwen3-Omni,
its plugin objects driven without a room, with their defaults and only `base_url` changed:
`openai.realtime.RealtimeModel` (its default session: semantic_vad, a transcription model name, voice "marin",
max_output_tokens "inf"; chat-context sync by item create and delete, `generate_reply`, truncate, server VAD
turns of espeak-ng speech), `openai.TTS` (mp3, its default, and pcm), `openai.STT` (REST, and
`use_realtime=True`: a transcription session with server VAD); no `error` event."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import soundfile as sf
import soxr
from audio_checks import spoken_wav
from server_harness import running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.server.app import create_app
from omnimtp.server.audio import to_pcm16
from omnimtp.server.scheduler import Engine
from omnimtp.server.websocket import Session

pytest.importorskip("livekit.plugins.openai")
from livekit import rtc  # noqa: E402
from livekit.agents import stt as agents_stt  # noqa: E402
from livekit.agents import utils  # noqa: E402
from livekit.plugins import openai as lk_openai  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATE = 24000


@pytest.fixture(scope="module")
def server():
    engine = Engine(Qwen3OmniFamily.tiny(0), max_frames=24, max_batch_size=2)
    with running_server(create_app(engine, openai_aliases=True)) as base:
        yield base


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    path = spoken_wav(tmp_path_factory.mktemp("livekit") / "speech.wav", "hello, how are you today", "-s", "190")
    samples, rate = sf.read(path, dtype="float32")
    return soxr.resample(samples, rate, RATE).astype(np.float32)


@pytest.fixture
def server_events(monkeypatch) -> list[dict]:
    """Every event the server's realtime sessions send during the test."""
    sent, send = [], Session.send

    async def recording_send(self, event: dict) -> bool:
        sent.append(event)
        return await send(self, event)

    monkeypatch.setattr(Session, "send", recording_send)
    return sent


def _frame(samples: np.ndarray) -> rtc.AudioFrame:
    pcm = to_pcm16(samples)
    return rtc.AudioFrame(pcm.tobytes(), RATE, 1, pcm.size)


async def _synthesize(base_url: str, **options) -> np.ndarray:
    async with utils.http_context.open():
        tts = lk_openai.TTS(base_url=f"{base_url}/v1", api_key="unused", **options)
        frames = [event.frame async for event in tts.synthesize("Good morning, how are you?")]
    return np.concatenate([np.frombuffer(frame.data, dtype="<i2") for frame in frames])


@pytest.mark.parametrize("options", [{}, {"response_format": "pcm"}], ids=["mp3", "pcm"])
def test_tts_speaks_with_its_defaults(server, options):
    pcm = asyncio.run(_synthesize(server, **options))  # model gpt-4o-mini-tts, voice ash
    assert pcm.size > RATE // 10 and np.abs(pcm).max() > 100


def test_stt_transcribes_over_rest(server, speech):
    async def recognize():
        async with utils.http_context.open():
            stt = lk_openai.STT(base_url=f"{server}/v1", api_key="unused", use_realtime=False)
            return await stt.recognize(_frame(speech))

    event = asyncio.run(recognize())
    assert event.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT and event.alternatives[0].text.strip()


def test_stt_transcribes_in_a_realtime_transcription_session(server, speech, server_events):
    async def transcribe():
        async with utils.http_context.open():
            stt = lk_openai.STT(base_url=f"{server}/v1", api_key="unused", use_realtime=True)
            stream = stt.stream()
            silence = np.zeros(RATE, dtype=np.float32)
            audio = np.concatenate([silence[: RATE // 3], speech, silence])
            for i in range(0, audio.size, RATE // 50):
                stream.push_frame(_frame(audio[i:i + RATE // 50]))
            async with asyncio.timeout(30):
                async for event in stream:
                    if event.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT:
                        await stream.aclose()
                        return event

    event = asyncio.run(transcribe())
    kinds = [e["type"] for e in server_events]
    assert "error" not in kinds, [e for e in server_events if e["type"] == "error"]
    completed = [e for e in server_events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert event.alternatives[0].text == completed[0]["transcript"] and completed[0]["transcript"]
    assert not [kind for kind in kinds if kind.startswith("response.")]


async def _read(generation) -> tuple[str, np.ndarray, str]:
    """A generation's first message: (its id, its audio as PCM16, its transcript)."""
    async def audio(message):
        return [np.frombuffer(frame.data, dtype="<i2") async for frame in message.audio_stream]

    async def text(message):
        return "".join([piece async for piece in message.text_stream])

    async for message in generation.message_stream:
        frames, transcript = await asyncio.gather(audio(message), text(message))
        return message.message_id, np.concatenate(frames) if frames else np.zeros(0, "<i2"), transcript
    raise AssertionError("a generation without a message")


def test_realtime_model_with_its_default_session(server, speech, server_events):
    async def talk():
        async with utils.http_context.open():
            model = lk_openai.realtime.RealtimeModel(base_url=f"{server}/v1", api_key="unused")
            session = model.session()
            errors, generations, started, heard = [], asyncio.Queue(), asyncio.Event(), asyncio.Event()
            session.on("error", errors.append)
            session.on("input_audio_transcription_completed", lambda event: event.is_final and heard.set())
            session.on("generation_created", generations.put_nowait)
            session.on("input_speech_started", lambda _: started.set())
            try:
                chat_ctx = session.chat_ctx.copy()
                chat_ctx.add_message(role="user", content="Hello there")
                await asyncio.wait_for(session.update_chat_ctx(chat_ctx), 10)  # waits for conversation.item.added
                reply = await asyncio.wait_for(session.generate_reply(), 15)  # waits for the metadata echo
                message_id, audio, transcript = await _read(reply)
                session.truncate(message_id=message_id, modalities=["audio", "text"],
                                 audio_end_ms=audio.size * 1000 // RATE // 2)
                chat_ctx = session.chat_ctx.copy()
                chat_ctx.items = [item for item in chat_ctx.items if getattr(item, "role", None) != "user"]
                await asyncio.wait_for(session.update_chat_ctx(chat_ctx), 10)  # waits for .deleted
                while not generations.empty():
                    generations.get_nowait()
                silence = np.zeros(RATE, dtype=np.float32)
                turn = np.concatenate([silence[: RATE // 3], speech, silence])
                for i in range(0, turn.size, RATE // 50):
                    session.push_audio(_frame(turn[i:i + RATE // 50]))
                await asyncio.wait_for(started.wait(), 15)
                turn_reply = await asyncio.wait_for(generations.get(), 15)
                _, turn_audio, _ = await _read(turn_reply)
                await asyncio.wait_for(heard.wait(), 15)  # the turn's input transcript
            finally:
                await session.aclose()
                await model.aclose()
        return errors, reply, audio, transcript, turn_reply, turn_audio

    errors, reply, audio, transcript, turn_reply, turn_audio = asyncio.run(talk())
    kinds = [event["type"] for event in server_events]
    assert not errors and "error" not in kinds, (errors, [e for e in server_events if e["type"] == "error"])
    assert reply.user_initiated and not turn_reply.user_initiated
    for pcm in (audio, turn_audio):
        assert pcm.size and np.abs(pcm).max() > 100
    assert transcript
    updated = [e for e in server_events if e["type"] == "session.updated"][0]["session"]
    assert updated["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert updated["audio"]["output"]["voice"] == "ethan"  # "marin", an alias of the default speaker
    for kind in ("conversation.item.truncated", "conversation.item.deleted", "input_audio_buffer.speech_started",
                 "conversation.item.input_audio_transcription.completed"):
        assert kind in kinds, kind
