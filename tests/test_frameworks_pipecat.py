"""pipecat (`pipecat-ai`) against `omnimtp serve`'s app on the tiny Qwen3-Omni, each OpenAI service with the
framework's defaults and only `base_url` changed, in a pipeline with a frame source and a sink:
`OpenAIRealtimeLLMService` (server VAD turns from espeak-ng speech, the reply's audio and transcript, a barge-in
while the reply plays that truncates it), `OpenAITTSService` (OpenAI's voice names), `OpenAISTTService` and
`OpenAIRealtimeSTTService` (transcripts of the speech); no `error` event and no ErrorFrame anywhere."""

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

pytest.importorskip("pipecat")
from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    ErrorFrame,
    InputAudioRawFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSTextFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.runner import PipelineRunner  # noqa: E402
from pipecat.pipeline.task import PipelineTask  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService  # noqa: E402
from pipecat.services.openai.stt import OpenAIRealtimeSTTService, OpenAISTTService  # noqa: E402
from pipecat.services.openai.tts import OpenAITTSService  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATE = 24000
FRAME_SAMPLES = RATE // 50  # 20 ms, as a transport sends microphone audio


@pytest.fixture(scope="module")
def server():
    engine = Engine(Qwen3OmniFamily.tiny(0), max_frames=24, max_batch_size=2)
    with running_server(create_app(engine, openai_aliases=True)) as base:
        yield base


@pytest.fixture(scope="module")
def url(server):
    return server.replace("http://", "ws://") + "/v1/realtime"


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    path = spoken_wav(tmp_path_factory.mktemp("pipecat") / "speech.wav", "hello, how are you today", "-s", "190")
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


class Sink(FrameProcessor):
    """The pipeline's end: what the service pushed downstream (and errors from anywhere)."""

    def __init__(self):
        super().__init__()
        self.audio, self.texts, self.transcripts, self.errors = [], [], [], []
        self.transcribed = asyncio.Event()
        self.first_audio = asyncio.Event()

    async def process_frame(self, frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio.append(frame.audio)
            self.first_audio.set()
        elif isinstance(frame, TTSTextFrame):
            self.texts.append(frame.text)
        elif isinstance(frame, TranscriptionFrame):
            self.transcripts.append(frame.text)
            self.transcribed.set()
        elif isinstance(frame, ErrorFrame):
            self.errors.append(frame.error)
        await self.push_frame(frame, direction)


def _frames(samples: np.ndarray) -> list[InputAudioRawFrame]:
    pcm = to_pcm16(samples).tobytes()
    return [InputAudioRawFrame(audio=pcm[i:i + 2 * FRAME_SAMPLES], sample_rate=RATE, num_channels=1)
            for i in range(0, len(pcm), 2 * FRAME_SAMPLES)]


async def _talk(url: str, speech: np.ndarray, sink: Sink) -> None:
    llm = OpenAIRealtimeLLMService(api_key="unused", base_url=url)
    task = PipelineTask(Pipeline([llm, sink]))
    runner = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
    silence = np.zeros(RATE, dtype=np.float32)
    await task.queue_frames(_frames(np.concatenate([silence[: RATE // 3], speech, silence])))
    await asyncio.wait_for(sink.first_audio.wait(), 30)
    # the user talks over the reply: server VAD cancels it and pipecat truncates what was played
    await task.queue_frames(_frames(np.concatenate([speech, silence])))
    await asyncio.sleep(3.0)
    await task.queue_frame(EndFrame())
    await asyncio.wait_for(runner, 30)


def test_realtime_llm_service_turns_replies_and_barge_in(url, speech, server_events):
    sink = Sink()
    asyncio.run(_talk(url, speech, sink))
    kinds = [event["type"] for event in server_events]
    assert not sink.errors and "error" not in kinds, (sink.errors, [e for e in server_events if e["type"] == "error"])
    pcm = np.frombuffer(b"".join(sink.audio), dtype="<i2")
    assert pcm.size and np.abs(pcm).max() > 100
    assert "".join(sink.texts).strip()
    assert kinds.count("input_audio_buffer.speech_started") == 2 and kinds.count("response.done") >= 2
    assert "conversation.item.truncated" in kinds


async def _run(service, frames: list, sink: Sink, until: asyncio.Event | None = None) -> None:
    """`frames` through a pipeline of `service` and `sink`; ends after `until` is set (or the frames are done)."""
    task = PipelineTask(Pipeline([service, sink]))
    runner = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
    await task.queue_frames(frames)
    if until is not None:
        await asyncio.wait_for(until.wait(), 30)
    await task.queue_frame(EndFrame())
    await asyncio.wait_for(runner, 30)


def test_tts_service_speaks_an_openai_voice(server):
    sink = Sink()
    tts = OpenAITTSService(api_key="unused", base_url=f"{server}/v1")  # voice "alloy", model gpt-4o-mini-tts
    asyncio.run(_run(tts, [TTSSpeakFrame("Good morning, how are you?")], sink))
    assert not sink.errors, sink.errors
    pcm = np.frombuffer(b"".join(sink.audio), dtype="<i2")
    assert pcm.size > RATE // 10 and np.abs(pcm).max() > 100


def test_stt_service_transcribes_a_spoken_turn(server, speech):
    sink = Sink()
    stt = OpenAISTTService(api_key="unused", base_url=f"{server}/v1")  # model gpt-transcribe, language en
    frames = [VADUserStartedSpeakingFrame(), *_frames(speech), VADUserStoppedSpeakingFrame()]
    asyncio.run(_run(stt, frames, sink, sink.transcribed))
    assert not sink.errors, sink.errors
    assert sink.transcripts and sink.transcripts[0].strip()


def test_realtime_stt_service_transcribes_a_spoken_turn(url, speech, server_events):
    sink = Sink()
    stt = OpenAIRealtimeSTTService(api_key="unused", base_url=url)  # ?intent=transcription, its own commits
    frames = [VADUserStartedSpeakingFrame(), *_frames(speech), VADUserStoppedSpeakingFrame()]
    asyncio.run(_run(stt, frames, sink, sink.transcribed))
    kinds = [event["type"] for event in server_events]
    assert not sink.errors and "error" not in kinds, sink.errors
    completed = [e for e in server_events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert sink.transcripts == [completed[0]["transcript"]] and sink.transcripts[0]
    assert not [kind for kind in kinds if kind.startswith("response.")]
