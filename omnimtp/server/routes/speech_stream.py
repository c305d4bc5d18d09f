"""`/v1/audio/speech/stream`: text streamed into speech over a WebSocket (an LLM's reply spoken as it is written).

    client → server   {"type": "session.config", "voice", "language", "instructions", "seed", "temperature", ...}
                          the `/v1/audio/speech` fields but `input` (validated the same way; response_format "pcm")
                      {"type": "input_text.delta", "delta": "Hello, "}      ... any number
                      {"type": "input_text.done"}
    server → client   {"type": "session.configured", "session": {...}}     the config as it will be used
                      {"type": "queued", "queue_position": n}   the request waits: n − 1 start before it
                      {"type": "audio.delta", "delta": base64 PCM16 24 kHz mono}    as soon as the talker speaks
                      {"type": "done", "finish_reason", "usage": {"input_tokens", "output_tokens", "total_tokens"}}
                      {"type": "error", "error": {"type", "code", "message", "param", "event_id"}}

One request runs from the first `input_text.delta` to `done`, in the same engine step loop as every other
request; after its `input_text.done` the next delta starts another with the same config (a `session.config`
between requests changes it). A long text is cut into segments as it comes, by the rule of a whole text
(`omnimtp.families.text.StreamedSpeechSegments`); a segment whose talker ends before its text does (codec EOS,
the frame cap) skips the rest of that segment, as on `/v1/audio/speech`, and `done` follows the last segment.
While a request waits for more text it holds no batch slot, for at most the server's `--timeout-text-idle`
seconds at a time: then it ends with an `error` event `timeout_text_idle`, and the next delta starts another
request. The text is tokenized as it comes and only ids no later text can change go to the engine
(`omnimtp.tokenizer.StreamedTextIds`); the talker waits for each text row it has not got, so the audio is that of
the whole text sent to `/v1/audio/speech` with the same seed, byte for byte, however it was split and whenever it
came (a long one included: the talker's positions hold each segment). Deltas that arrive together (a burst) are
tokenized together, once, when no next event is waiting. A bad event gets an `error` event and the session goes
on; a request's text is at most 4096 characters (as `input`). Closing the session (or the idle timeout) cancels
its request and frees the slot. Session limits, the API key on the upgrade and the message size:
`omnimtp.server.websocket`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import APIRouter
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket

from omnimtp.server.errors import APIError, validation_error
from omnimtp.server.requests import PromptTooLongError, QueueFullError
from omnimtp.server.routes.common import b64_pcm16
from omnimtp.server.routes.voices import speech_speaker
from omnimtp.server.schemas import MAX_SPEECH_INPUT_CHARS, SpeechStreamConfig
from omnimtp.server.websocket import EventError, Session, echo, websocket_sessions

ROUTE = "/v1/audio/speech/stream"
# How long the session waits for a next event already on its way before it tokenizes the deltas read so far.
BURST_WAIT_S = 0.005

router = APIRouter()


@router.websocket(ROUTE)
async def speech_stream(websocket: WebSocket):
    await websocket_sessions(websocket).serve(websocket, ROUTE, _run)


@dataclass
class _Config:
    speaker: object
    sampling: object
    seed: int | None
    session: dict  # what session.configured reports


@dataclass
class _Speech:
    """The request in progress: its engine handle, its text's ids and the task sending its audio."""

    handle: object
    text_ids: object
    sender: asyncio.Task | None = None
    is_text_done: bool = False
    num_chars: int = 0
    is_ended: bool = False  # an error event ended it (the text timeout, a failure): the next delta starts another

    @property
    def is_over(self) -> bool:
        """Its last event went out and no more of its text is expected."""
        return (self.is_text_done or self.is_ended) and self.sender.done()


async def _run(session: Session) -> None:
    context = session.websocket.app.state.serving
    config: _Config | None = None
    speech: _Speech | None = None
    taken: list[tuple[dict, str]] = []  # deltas read but not tokenized yet (a burst's, in order), with their events
    receiving: asyncio.Future | None = None
    try:
        while True:
            receiving = asyncio.ensure_future(session.receive())
            if taken:  # more of a burst may be buffered: read it all, then tokenize its text once
                done, _ = await asyncio.wait({receiving}, timeout=BURST_WAIT_S)
                if not done:
                    await _take_deltas(context, session, speech, taken)
            event = await receiving
            if event is None:
                break
            if taken and (event["type"] != "input_text.delta" or speech.is_over):
                await _take_deltas(context, session, speech, taken)  # in order: the burst first
            if speech is not None and speech.is_over:
                speech = None
            try:
                kind = event["type"]
                if kind == "session.config":
                    if speech is not None:
                        raise EventError("session.config: a request is in progress; send it between requests",
                                         param="type", code="request_in_progress")
                    config = await _configure(context, event)
                    await session.send({"type": "session.configured", "session": config.session})
                elif kind == "input_text.delta":
                    delta = event.get("delta")
                    if not isinstance(delta, str):
                        raise EventError("delta: required, a string", param="delta",
                                         code="missing_required_parameter" if delta is None else "invalid_value")
                    if speech is not None and speech.is_text_done:
                        raise EventError("input_text.delta: the request's text is done; wait for its done event",
                                         param="type", code="request_in_progress")
                    if speech is None:
                        config = config or await _configure(context, {"type": "session.config"})
                        speech = _start(context, session, config)
                    taken.append((event, delta))
                elif kind == "input_text.done":
                    if speech is None or speech.is_text_done:
                        raise EventError("input_text.done: no text to speak", param="type", code="invalid_value")
                    if not speech.text_ids.text.strip():  # nothing will ever be spoken: free its slot now
                        speech.sender.cancel()
                        speech.handle.cancel()
                        speech = None
                        raise EventError("input_text.done: the request's text is only whitespace; nothing to speak",
                                         param="type", code="invalid_value")
                    speech.is_text_done = True
                    context.engine.push_speech_text(speech.handle, speech.text_ids.finish(), is_finished=True)
                else:
                    raise EventError(f"type: unknown event type {echo(kind)}", param="type", code="invalid_event")
            except EventError as exc:
                await session.send_error(exc, event)
    finally:
        if receiving is not None:
            receiving.cancel()
        if speech is not None:
            speech.handle.cancel()  # a client gone mid-request frees its slot at the next frame boundary
            if speech.sender is not None:
                speech.sender.cancel()


async def _take_deltas(context, session: Session, speech: _Speech, taken: list[tuple[dict, str]]) -> None:
    """Tokenize the deltas read since the last call (emptying `taken`), on a worker thread (cutting a long text
    into segments takes a while): their text at once when it keeps within the limits, as it nearly always does,
    else delta by delta, each refused one with its own error event. A burst of one-character deltas so costs one
    tokenization of the text, not one per delta."""
    deltas = list(taken)
    taken.clear()
    if len(deltas) > 1:
        try:
            await run_in_threadpool(_push, context, speech, "".join(delta for _, delta in deltas))
            return
        except EventError:  # over a limit, and nothing taken (`_push` checks first): delta by delta, below
            pass
    for event, delta in deltas:
        try:
            await run_in_threadpool(_push, context, speech, delta)
        except EventError as exc:
            await session.send_error(exc, event)


async def _configure(context, event: dict) -> _Config:
    """The validated config of a session.config event (EventError naming the field); on a Base model its voice
    may be a saved voice or a clone's fields, as on /v1/audio/speech."""
    try:
        body = SpeechStreamConfig.model_validate(event)
    except ValidationError as exc:
        error = validation_error(exc)
        raise EventError(error.message, param=error.param, code=error.code) from None
    try:
        context.check_model(body.model)
        sampling = context.speech_sampling(body)
        speaker = await speech_speaker(context, body)
    except APIError as exc:
        raise EventError(exc.message, param=exc.param, code=exc.code or "invalid_value") from None
    report = body.model_dump(exclude={"type", "event_id", "ref_audio", "speaker_embedding"}, exclude_none=True)
    return _Config(speaker, sampling, body.seed, report)


def _start(context, session: Session, config: _Config) -> _Speech:
    engine = context.engine
    if not engine.is_running:
        raise EventError("the server is shutting down", code="server_shutting_down", type="server_error")
    try:
        text = engine.streamed_speech_segments(config.speaker)
    except PromptTooLongError as exc:
        raise EventError(str(exc), param="delta", code="string_above_max_length") from None
    try:
        handle = engine.submit_speech_stream(config.speaker, config.sampling, config.seed,
                                             loop=asyncio.get_running_loop())
    except QueueFullError as exc:
        raise EventError(str(exc), code="queue_full", type="rate_limit_exceeded") from None
    speech = _Speech(handle, text)
    speech.sender = asyncio.ensure_future(_send_audio(session, speech))
    return speech


def _push(context, speech: _Speech, delta: str) -> None:
    if speech.num_chars + len(delta) > MAX_SPEECH_INPUT_CHARS:
        raise EventError(f"delta: the request's text would be over {MAX_SPEECH_INPUT_CHARS} characters; this delta "
                         "was not taken", param="delta", code="string_above_max_length")
    text = speech.text_ids.text + delta
    try:  # the limits of /v1/audio/speech's input, as the text grows (whitespace alone has no ids yet)
        if text.strip():
            context.engine.check_speech_text(text, "delta")
    except PromptTooLongError as exc:
        raise EventError(f"{exc}; this delta was not taken", param="delta", code="string_above_max_length") from None
    speech.num_chars += len(delta)
    # even with no settled ids yet: the text came, so the request's wait for text (--timeout-text-idle) restarts
    context.engine.push_speech_text(speech.handle, speech.text_ids.push(delta), is_finished=False)


async def _send_audio(session: Session, speech: _Speech) -> None:
    """The request's audio deltas as the engine makes them, then its done event (or an error event)."""
    handle = speech.handle
    try:
        if handle.queue_position > 0:
            await session.send({"type": "queued", "queue_position": handle.queue_position})
        async for event in handle.events():
            if event.error is not None:
                speech.is_ended = True
                is_timeout = event.error_code == "timeout_text_idle"  # the client's pause, not the server's fault
                await session.send_error(EventError(event.error, code=event.error_code or "server_error",
                                                    type="invalid_request_error" if is_timeout else "server_error"))
                return
            if event.audio is not None and event.audio.size:
                await session.send({"type": "audio.delta", "delta": b64_pcm16(event.audio)})
            if event.finish_reason is not None:
                usage = {"input_tokens": event.prompt_tokens, "output_tokens": event.num_frames,
                         "total_tokens": event.prompt_tokens + event.num_frames}
                await session.send({"type": "done", "finish_reason": event.finish_reason, "usage": usage})
                return
    finally:
        handle.cancel()
