"""Live recognition: a transcription session's turn heard by a Qwen3-ASR model while it is still spoken.

The turn's audio goes, as it is appended, through the streaming recognition of the reference's streaming mode
(`omnimtp.families.asr_stream.StreamingRecognition`): each LIVE_CHUNK_SECONDS of audio, all of the turn so far is
transcribed again, continuing the previous reply less its unstable last tokens, as a background request of the
engine. When the turn is committed, only its tail is left to transcribe: the item's transcript deltas are the part
already fixed, at once, then the last transcription's reply as it is written.

A session makes one `LiveRecognition` per turn (`live_feed`: from the turn's first sample, server VAD's or the
buffer's), hands it to the committed item (`take_live`), and drops it with the buffer
(`RealtimeSession.drop_live`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import soxr
from starlette.concurrency import run_in_threadpool

from omnimtp.families.asr_stream import RecognitionStep, StreamingRecognition
from omnimtp.families.qwen3_asr import Qwen3ASRFamily
from omnimtp.server.errors import APIError
from omnimtp.server.routes.common import ServingContext
from omnimtp.server.routes.realtime.state import RealtimeSession
from omnimtp.server.routes.realtime.transcription import INCLUDE_LOGPROBS, RecognitionError, Recognized
from omnimtp.server.routes.transcriptions import transcription_request

# the audio gathered between a live turn's transcriptions (the reference's streaming demo takes 2.0 s; a turn of
# a voice agent is a few seconds)
LIVE_CHUNK_SECONDS = 1.0


class LiveRecognition:
    """One turn's streaming recognition on `context`'s Qwen3-ASR engine. `next_sample`: the session's next input
    sample (`TurnState.num_appended` counts) it has not heard."""

    def __init__(self, context: ServingContext, transcription: dict, input_rate: int, start_sample: int):
        family = context.engine.family
        self.context, self.language = context, transcription["language"]
        self.stream = StreamingRecognition(family, transcription["language"], transcription["prompt"],
                                           chunk_seconds=LIVE_CHUNK_SECONDS)
        self.resampler = soxr.ResampleStream(input_rate, self.stream.sample_rate, 1, dtype="float32")
        self.next_sample = start_sample
        self.pending: list[np.ndarray] = []  # heard, not yet in the stream (a step may be reading it)
        self.steps: asyncio.Task | None = None
        self.error: str | None = None

    def feed(self, samples: np.ndarray) -> None:
        """More of the turn (float32 at the input rate): the next transcription starts once a chunk has gathered."""
        self.pending.append(self.resampler.resample_chunk(samples))
        if self.steps is None or self.steps.done():
            self.steps = asyncio.ensure_future(self._run_steps())

    async def _run_steps(self) -> None:
        try:
            while True:
                self._take_pending()
                step = await run_in_threadpool(self.stream.next_step)  # (the features of the turn so far)
                if step is None:
                    if self.pending:  # (audio came meanwhile)
                        continue
                    return
                reply = "".join([text async for text in self._reply(step)])
                self.stream.accept(step, reply)
        except (RecognitionError, ValueError) as exc:  # (the turn's audio refused by the model: its `.failed`)
            self.error = str(exc)

    def _take_pending(self) -> None:
        for samples in self.pending:
            self.stream.feed(samples)
        self.pending = []

    async def _reply(self, step: RecognitionStep, usage: list | None = None) -> AsyncIterator[str]:
        """The engine's reply to one transcription, as it is written (greedy, in the background)."""
        context = self.context
        request = transcription_request(context, np.zeros(0, np.float32), self.language, self.stream.prompt, 0.0,
                                        None, is_streamed=True, is_background=True)
        try:
            handle = await context.submit(request, prompt=(step.prompt_ids, step.media))
        except APIError as exc:
            raise RecognitionError(exc.message) from None
        try:
            async for event in handle.events():
                if event.error is not None:
                    raise RecognitionError(event.error)
                if event.text:
                    yield event.text
                if event.finish_reason is not None:
                    if usage is not None:
                        usage[:] = [event.prompt_tokens, event.completion_tokens]
                    return
        finally:
            handle.cancel()  # a no-op once finished
        raise RecognitionError("no result")

    async def finish(self) -> AsyncIterator[str | Recognized]:
        """The committed turn's transcript (`transcription.Recognizer`'s shape): the text the live transcriptions
        fixed, then the last one's reply over the tail, as text deltas; then the usage."""
        if self.steps is not None:
            await self.steps
        await self._run_steps()  # the whole chunks the live steps had not reached: each its own transcription
        if self.error is not None:
            raise RecognitionError(self.error)
        self.pending.append(self.resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        self._take_pending()
        step = await run_in_threadpool(self.stream.finish)
        family = self.context.engine.family
        deltas = family.transcript_deltas(self.language)  # (the reply's language tag held back)
        usage = [0, 0]
        if step is None:  # nothing after the last transcription: its reply is the transcript
            if text := deltas.push(self.stream.reply):
                yield text
        else:
            if step.prefix and (text := deltas.push(step.prefix)):
                yield text  # what the turn's live transcriptions fixed, at once
            async for piece in self._reply(step, usage):
                if text := deltas.push(piece):
                    yield text
        if rest := deltas.finish():
            yield rest
        yield Recognized(*usage)

    def cancel(self) -> None:
        if self.steps is not None:
            self.steps.cancel()


def hears_live(state: RealtimeSession) -> ServingContext | None:
    """The context that hears the session's turns as they come: a transcription session's, when its recognizer is
    a Qwen3-ASR model (served, or beside the served model), no other recognizer is set and the session asks no
    logprobs (a live transcript's fixed words come from earlier transcriptions, as prompt; with logprobs each
    committed turn is transcribed whole, every token written by one request); else None."""
    transcription = state.settings.transcription
    if state.settings.type != "transcription" or transcription is None or state.recognizer is not None \
            or INCLUDE_LOGPROBS in state.settings.include:
        return None
    context = state.context.hearing(transcription["model"])
    return context if isinstance(context.engine.family, Qwen3ASRFamily) else None


def live_feed(state: RealtimeSession, until: int | None = None) -> None:
    """The turn in progress (server VAD's, or the whole buffer with manual turns) heard up to sample `until`
    (default: the last appended one), its `LiveRecognition` started at its first sample."""
    turns = state.turns
    start = turns.buffer_start if turns.detector is None else turns.speech_start
    if start is None or (context := hears_live(state)) is None:
        return
    if state.live is None:
        state.live = LiveRecognition(context, state.settings.transcription, state.settings.input_rate, start)
    live = state.live
    begin, end = max(live.next_sample, start), turns.num_appended if until is None else until
    if begin < end:
        pcm = bytes(state.audio_buffer[2 * (begin - turns.buffer_start):2 * (end - turns.buffer_start)])
        live.feed(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0)
        live.next_sample = end


def take_live(state: RealtimeSession) -> LiveRecognition | None:
    """The turn's live recognition, for the item it is committed as (the next turn starts a new one)."""
    live, state.live = state.live, None
    return live
