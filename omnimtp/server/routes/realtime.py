"""`/v1/realtime`: OpenAI's Realtime API over a WebSocket (GA event names), for a model with a thinker
(Qwen3-Omni, Qwen2.5-Omni): speech or text in, speech (with its transcript) or text out.

A session holds its conversation: user turns as text or audio (the committed input audio buffer, heard by
the thinker as audio), assistant turns as text (a reply's transcript), and the session's `instructions` as
the system turn. `response.create` answers the whole conversation as one chat request of the one engine
(continuous batching with every other request; the chat path): its text and audio deltas go out as the
engine makes them, so the first audio leaves while the thinker is still writing. `response.cancel`, or the
client leaving, cancels the request at the next frame boundary and frees its slot. The session's id is the
request's cache key: the engine keeps the thinker's KV of the conversation's last prompt (`serve
--session-cache-mb`), so a turn prefills only what changed since (`omnimtp.engine.prefix_cache`), with the same
reply bit for bit; the session's entry goes when its WebSocket closes.

    client                                   server
    session.update                           session.updated
    input_audio_buffer.append / .commit      input_audio_buffer.committed, conversation.item.created
    conversation.item.create                 conversation.item.created
    response.create                          response.created, response.output_item.added, ...,
                                             response.output_audio.delta | response.output_text.delta,
                                             response.output_audio_transcript.delta, ..., response.done (usage)
    response.cancel                          response.done (status "cancelled")
    conversation.item.truncate               conversation.item.truncated
    output_audio_buffer.clear                output_audio_buffer.cleared

Audio is PCM16 mono, little-endian, base64 in the events. Output is at the model's 24 kHz; input is 24 kHz by
default and any rate `session.audio.input.format.rate` names is resampled (soxr).

Turns are found by server VAD unless the session sets `audio.input.turn_detection` to null (then the client
commits the buffer): Silero VAD (server/vad.py) on the session's own audio as it is appended, with OpenAI's
`server_vad` settings and defaults (threshold 0.5, prefix_padding_ms 300, silence_duration_ms 500,
create_response and interrupt_response true). Speech sends `input_audio_buffer.speech_started`
(`audio_start_ms`: where the committed audio begins, prefix padding included) and, with interrupt_response,
cancels the active response at its next frame (response.done: cancelled, reason "turn_detected"); the
silence after it sends `speech_stopped` (`audio_end_ms`: where it ends, the silence duration included),
`committed`, `conversation.item.created` and, with create_response, a response. `semantic_vad` and an
`idle_timeout_ms` are not built.

`conversation.item.truncate` cuts a spoken assistant item to the audio the user heard (`audio_end_ms`) and its
transcript with it (the talker reads one reply token per frame: the frames heard keep that many tokens), so
the next turns hold only what was heard. `output_audio_buffer.clear` cancels the active response at its next
frame and answers `output_audio_buffer.cleared`. Tools are not served, and asking for them is an `error` event
naming the field.

`session.audio.input.transcription` (`{"model", "language", "prompt"}`, the served model) transcribes each
committed audio item as a low-priority request of the same engine (routes/transcriptions.py's prompt; it
never delays a response's first audio): `conversation.item.input_audio_transcription.delta` events, then
`.completed` with the transcript, which the item keeps, or `.failed`.

Extensions (not in OpenAI's API): `session.seed` (each response of the session is seeded with it: the same
conversation gives the same reply), `session.temperature` / `top_p` / `top_k` (chat's defaults: T 1, top-p 1,
no top-k).

Every bad client event is answered with an `error` event naming the field (`session.audio.output.voice`,
`item.content.0.audio`) and the session goes on.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

import numpy as np
import soxr
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from omnimtp.families.text import transcription_language
from omnimtp.media import MediaError, load_audio
from omnimtp.server.audio import G711_CODECS, G711_RATE, g711_decode, g711_encode, to_pcm16
from omnimtp.server.errors import APIError, validation_error
from omnimtp.server.routes.common import ServingContext, sampling_params
from omnimtp.server.routes.transcriptions import transcription_request
from omnimtp.server.scheduler import EngineRequest
from omnimtp.server.schemas import Seed
from omnimtp.server.vad import VAD_RATE, SpeechDetector, TurnDetection
from omnimtp.server.websocket import EventError, Session, echo, new_id, websocket_sessions

ROUTE = "/v1/realtime"
PCM_RATE = 24000  # OpenAI's audio/pcm rate, and the output rate of both omni families
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
# Input rates a client may name for audio/pcm (resampled to the processor's rate with soxr).
MIN_INPUT_RATE, MAX_INPUT_RATE = 8000, 48000
MAX_TURN_MS = 10_000  # the longest prefix padding or silence duration a session may ask for

router = APIRouter()


# -- client events ---------------------------------------------------------------------------------


class AudioFormat(BaseModel):
    """audio/pcm (PCM16 at `rate`, 24 kHz when not given) or G.711 audio/pcmu / audio/pcma (8 kHz)."""

    model_config = _STRICT
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: Annotated[int, Field(ge=MIN_INPUT_RATE, le=MAX_INPUT_RATE)] | None = None


class ServerVad(BaseModel):
    """`turn_detection`: server_vad (semantic_vad is named so that asking for it is refused by name)."""

    model_config = _STRICT
    type: Literal["server_vad", "semantic_vad"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] = TurnDetection.threshold
    prefix_padding_ms: Annotated[int, Field(ge=0, le=MAX_TURN_MS)] = TurnDetection.prefix_padding_ms
    silence_duration_ms: Annotated[int, Field(ge=0, le=MAX_TURN_MS)] = TurnDetection.silence_duration_ms
    create_response: bool = TurnDetection.create_response
    interrupt_response: bool = TurnDetection.interrupt_response
    idle_timeout_ms: None = None  # an idle timeout is not built
    eagerness: Literal["low", "medium", "high", "auto"] | None = None


class InputTranscription(BaseModel):
    model_config = _STRICT
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class AudioInput(BaseModel):
    model_config = _STRICT
    format: AudioFormat | None = None
    turn_detection: ServerVad | None = None  # given as null: manual turns (the client commits the buffer)
    transcription: InputTranscription | None = None
    noise_reduction: None = None


class AudioOutput(BaseModel):
    model_config = _STRICT
    format: AudioFormat | None = None
    voice: Annotated[str, Field(min_length=1)] | None = None
    speed: Annotated[float, Field(ge=1.0, le=1.0)] = 1.0


class AudioConfig(BaseModel):
    model_config = _STRICT
    input: AudioInput | None = None
    output: AudioOutput | None = None


MaxOutputTokens = Annotated[int, Field(ge=1)] | Literal["inf"]
Modalities = Annotated[list[Literal["text", "audio"]], Field(min_length=1, max_length=1)]


class SessionFields(BaseModel):
    """`session.update`'s session: the fields given change, the others keep their values."""

    model_config = _STRICT
    type: Literal["realtime"] = "realtime"
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxOutputTokens | None = None
    audio: AudioConfig | None = None
    tools: Annotated[list, Field(max_length=0)] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    tracing: None = None
    # omnimtp's extensions
    seed: Seed | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None


class ResponseAudioOutput(BaseModel):
    model_config = _STRICT
    format: AudioFormat | None = None
    voice: Annotated[str, Field(min_length=1)] | None = None


class ResponseAudio(BaseModel):
    model_config = _STRICT
    output: ResponseAudioOutput | None = None


class ResponseFields(BaseModel):
    """`response.create`'s response: what this response does differently from the session."""

    model_config = _STRICT
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxOutputTokens | None = None
    audio: ResponseAudio | None = None
    conversation: Literal["auto"] | None = None
    metadata: dict[str, str] | None = None
    tools: Annotated[list, Field(max_length=0)] | None = None
    tool_choice: Literal["auto", "none"] | None = None


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "input_audio", "output_text", "output_audio", "text"]
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None


class Item(BaseModel):
    model_config = _STRICT
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[ContentPart], Field(min_length=1)]
    id: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class ClientEvent(BaseModel):
    """What every client event has: its type, and the client's optional id (echoed in an `error` event)."""

    model_config = _STRICT
    type: str
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: SessionFields


class AudioAppend(ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferEvent(ClientEvent):
    type: Literal["input_audio_buffer.commit", "input_audio_buffer.clear"]


class ItemCreate(ClientEvent):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: Item


class ResponseCreate(ClientEvent):
    type: Literal["response.create"]
    response: ResponseFields | None = None


class ResponseCancel(ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


class ItemTruncate(ClientEvent):
    type: Literal["conversation.item.truncate"]
    item_id: Annotated[str, Field(min_length=1)]
    content_index: Annotated[int, Field(ge=0, le=0)]  # an assistant item has one content part
    audio_end_ms: Annotated[int, Field(ge=0)]


class OutputAudioClear(ClientEvent):
    type: Literal["output_audio_buffer.clear"]


CLIENT_EVENTS: dict[str, type[ClientEvent]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": AudioAppend,
    "input_audio_buffer.commit": BufferEvent,
    "input_audio_buffer.clear": BufferEvent,
    "conversation.item.create": ItemCreate,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
    "conversation.item.truncate": ItemTruncate,
    "output_audio_buffer.clear": OutputAudioClear,
}


def parse_event(event: dict) -> ClientEvent:
    """A client event as its schema; EventError naming the field (the event type first)."""
    schema = CLIENT_EVENTS.get(event["type"])
    if schema is None:
        raise EventError(f"type: unsupported event type {echo(event['type'])}; this server takes "
                         f"{', '.join(CLIENT_EVENTS)}", param="type", code="invalid_value")
    try:
        return schema.model_validate(event)
    except ValidationError as exc:
        raise _event_error(validation_error(exc)) from None


def _event_error(exc: APIError) -> EventError:
    return EventError(exc.message, param=exc.param, code=exc.code or "invalid_value")


# -- session state ---------------------------------------------------------------------------------


@dataclass
class Settings:
    """A session's effective configuration (what `session.created` / `session.updated` report)."""

    voice: str
    output_modalities: tuple[str, ...] = ("audio",)
    instructions: str = ""
    max_output_tokens: int | str = "inf"
    input_rate: int = PCM_RATE
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    tool_choice: str = "auto"
    seed: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    transcription: dict | None = None  # {"model", "language", "prompt"}: committed audio is transcribed
    turn_detection: TurnDetection | None = TurnDetection()  # None: manual turns


@dataclass
class ConversationItem:
    """One turn. content: the engine's chat content (the text, or parts with the audio decoded at the
    processor's rate); parts: the item's content as events show it."""

    id: str
    role: str
    content: str | tuple[dict, ...]
    parts: list[dict]
    status: str = "completed"
    # a spoken reply: its transcript's text deltas, its audio frames and samples (what a truncation cuts)
    text_deltas: tuple[str, ...] = ()
    num_frames: int = 0
    num_samples: int = 0

    @property
    def num_bytes(self) -> int:
        """The memory its content holds: text as UTF-8, audio as its samples."""
        if isinstance(self.content, str):
            return len(self.content.encode())
        return sum(part["audio"].nbytes if part["type"] == "audio" else len(part["text"].encode())
                   for part in self.content)

    def event_item(self) -> dict:
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": self.parts}


@dataclass
class TurnState:
    """Where the session's input audio stands for server VAD. Sample counts are at the input rate, over all audio
    appended since the detector started (`origin_*`: what was appended before it, in samples and ms)."""

    detector: SpeechDetector | None = None
    num_appended: int = 0  # samples appended since the session began (at the rates they came in)
    appended_ms: float = 0.0
    buffer_start: int = 0  # the sample the input audio buffer's first byte holds
    origin_sample: int = 0
    origin_ms: float = 0.0
    speech_start: int | None = None  # the first sample the turn in progress commits (prefix padding included)
    item_id: str | None = None  # the id the turn in progress's item gets

    def restart(self, detector: SpeechDetector | None) -> None:
        """A new detector from now on (None: manual turns); a turn in progress is forgotten."""
        self.detector = detector
        self.origin_sample, self.origin_ms = self.num_appended, self.appended_ms
        self.speech_start = self.item_id = None

    def sample(self, vad_sample: int, rate: int) -> int:
        return self.origin_sample + round(vad_sample * rate / VAD_RATE)

    def ms(self, sample: int, rate: int) -> int:
        return round(self.origin_ms + (sample - self.origin_sample) * 1000 / rate)


@dataclass
class RealtimeSession:
    context: ServingContext
    session: Session
    settings: Settings
    model_name: str
    id: str = field(default_factory=lambda: new_id("sess"))
    items: list[ConversationItem] = field(default_factory=list)
    audio_buffer: bytearray = field(default_factory=bytearray)
    response: asyncio.Task | None = None
    response_id: str | None = None
    handle: object | None = None
    transcripts: set[asyncio.Task] = field(default_factory=set)
    cancel_reason: str = "client_cancelled"  # what response.done says of a cancelled response
    turns: TurnState = field(default_factory=lambda: TurnState())

    def describe(self) -> dict:
        s = self.settings
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model_name,
            "output_modalities": list(s.output_modalities), "instructions": s.instructions,
            "max_output_tokens": s.max_output_tokens, "tools": [], "tool_choice": s.tool_choice, "tracing": None,
            "audio": {
                "input": {"format": _describe_format(s.input_format, s.input_rate),
                          "turn_detection": s.turn_detection and s.turn_detection.describe(),
                          "transcription": s.transcription, "noise_reduction": None},
                "output": {"format": _describe_format(s.output_format, PCM_RATE), "voice": s.voice,
                           "speed": 1.0},
            },
            "seed": s.seed, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
        }


@router.websocket(ROUTE)
async def realtime(websocket: WebSocket):
    await websocket_sessions(websocket).serve(websocket, ROUTE, _run)


async def _run(session: Session) -> None:
    context: ServingContext = session.websocket.app.state.serving
    engine = context.engine
    model = session.websocket.query_params.get("model")
    try:
        model_name = context.check_model(model)
        context.check_chat()
    except APIError as exc:  # the session opens and says why it cannot serve, then closes
        await session.send_error(_event_error(exc))
        await session.close(1008, exc.message[:120])
        return
    state = RealtimeSession(context, session, Settings(voice=engine.match_speaker(engine.family.default_speaker)),
                            model_name)
    await session.send({"type": "session.created", "session": state.describe()})
    try:
        while (event := await session.receive()) is not None:
            try:
                await _handle(state, parse_event(event))
            except EventError as exc:
                await session.send_error(exc, event)
    finally:
        if state.response is not None:  # the client left mid-response: the engine request is cancelled
            state.response.cancel()
            await asyncio.gather(state.response, return_exceptions=True)
        for task in state.transcripts:  # and so are its input transcripts
            task.cancel()
        await asyncio.gather(*state.transcripts, return_exceptions=True)
        engine.drop_conversation(state.id)


async def _handle(state: RealtimeSession, event: ClientEvent) -> None:
    session = state.session
    if isinstance(event, SessionUpdate):
        _update_settings(state, event.session)
        await session.send({"type": "session.updated", "session": state.describe()})
    elif isinstance(event, AudioAppend):
        await _append_audio(state, event.audio)
    elif isinstance(event, BufferEvent) and event.type == "input_audio_buffer.clear":
        _clear_buffer(state)
        await session.send({"type": "input_audio_buffer.cleared"})
    elif isinstance(event, BufferEvent):
        if not state.audio_buffer:
            raise EventError("input_audio_buffer: nothing to commit: the buffer is empty",
                             code="input_audio_buffer_commit_empty")
        await _commit(state, bytes(state.audio_buffer), new_id("item"))
        _clear_buffer(state)
    elif isinstance(event, ItemCreate):
        item = await _client_item(state, event.item)
        previous = _insert(state, item, event.previous_item_id)
        await session.send({"type": "conversation.item.created", "previous_item_id": previous,
                            "item": item.event_item()})
    elif isinstance(event, ResponseCreate):
        await _start_response(state, event.response or ResponseFields())
    elif isinstance(event, ItemTruncate):
        _truncate(state, event)
        await session.send({"type": "conversation.item.truncated", "item_id": event.item_id,
                            "content_index": event.content_index, "audio_end_ms": event.audio_end_ms})
    elif isinstance(event, OutputAudioClear):
        response_id = state.response_id
        if state.response is not None:
            state.cancel_reason = "client_cancelled"
            state.handle.cancel()
        await session.send({"type": "output_audio_buffer.cleared", "response_id": response_id})
    else:
        await _cancel_response(state, event)


def _truncate(state: RealtimeSession, event: ItemTruncate) -> None:
    """Cut a spoken assistant item to the audio the user heard (`audio_end_ms`), and its transcript with it, so
    that later turns hold only what was heard. The talker reads one reply token per audio frame, so the frames
    heard keep that many of the transcript's deltas (one delta per token)."""
    item = next((item for item in state.items if item.id == event.item_id), None)
    if item is None:
        raise EventError(f"item_id: the conversation has no item {event.item_id!r}", param="item_id",
                         code="item_not_found")
    if item.role != "assistant" or item.parts[0]["type"] != "output_audio" or not item.num_frames:
        raise EventError(f"item_id: {event.item_id!r} is not an assistant item with audio", param="item_id")
    duration_ms = item.num_samples * 1000 // PCM_RATE
    if event.audio_end_ms > duration_ms:
        raise EventError(f"audio_end_ms: the item's audio is {duration_ms} ms long, got {event.audio_end_ms}",
                         param="audio_end_ms")
    heard_samples = event.audio_end_ms * PCM_RATE // 1000
    heard_frames = heard_samples * item.num_frames // item.num_samples
    item.text_deltas = item.text_deltas[:heard_frames]
    item.num_frames, item.num_samples = heard_frames, heard_samples
    item.content = "".join(item.text_deltas)
    item.parts = [{"type": "output_audio", "transcript": item.content}]


def _update_settings(state: RealtimeSession, fields: SessionFields) -> None:
    """Apply a `session.update` (all or nothing: the settings change only when every field is valid)."""
    context = state.context
    given = fields.model_dump(exclude_unset=True)
    settings = state.settings
    if fields.model is not None and fields.model not in context.model_names:
        raise EventError(f"session.model: this server serves {', '.join(context.model_names)}, not "
                         f"{fields.model!r}", param="session.model", code="model_not_found")
    changes: dict = {}
    for name in ("instructions", "tool_choice", "seed", "temperature", "top_p", "top_k"):
        if name in given and given[name] is not None:
            changes[name] = given[name]
    if fields.output_modalities is not None:
        changes["output_modalities"] = tuple(fields.output_modalities)
    if fields.max_output_tokens is not None:
        changes["max_output_tokens"] = _max_output_tokens(context, fields.max_output_tokens,
                                                          "session.max_output_tokens")
    audio = fields.audio
    if audio is not None and audio.input is not None and audio.input.format is not None:
        changes["input_format"], changes["input_rate"] = _input_format(audio.input.format,
                                                                       "session.audio.input.format")
    if audio is not None and audio.input is not None and "turn_detection" in audio.input.model_fields_set:
        changes["turn_detection"] = _turn_detection(audio.input.turn_detection)
    if audio is not None and audio.input is not None and "transcription" in audio.input.model_fields_set:
        changes["transcription"] = _transcription(context, audio.input.transcription)
    if audio is not None and audio.output is not None:
        if audio.output.format is not None:
            changes["output_format"] = _output_format(audio.output.format, "session.audio.output.format")
        if audio.output.voice is not None:
            changes["voice"] = _voice(context, audio.output.voice, "session.audio.output.voice")
    state.settings = replace(settings, **changes)
    if (state.settings.input_format, state.settings.input_rate) != (settings.input_format, settings.input_rate):
        _clear_buffer(state)  # its audio is in the old format: never heard at the new one
    if state.settings.turn_detection != settings.turn_detection or state.settings.input_rate != settings.input_rate:
        state.turns.restart(None)  # the next append starts a detector with the new settings


def _turn_detection(vad: ServerVad | None) -> TurnDetection | None:
    if vad is None:
        return None
    if vad.type == "semantic_vad":
        raise EventError("session.audio.input.turn_detection.type: semantic_vad is not served; use server_vad or "
                         "null (manual turns)", param="session.audio.input.turn_detection.type")
    if vad.eagerness is not None:
        raise EventError("session.audio.input.turn_detection.eagerness: only semantic_vad has an eagerness",
                         param="session.audio.input.turn_detection.eagerness")
    return TurnDetection(threshold=vad.threshold, prefix_padding_ms=vad.prefix_padding_ms,
                         silence_duration_ms=vad.silence_duration_ms, create_response=vad.create_response,
                         interrupt_response=vad.interrupt_response)


def _max_output_tokens(context: ServingContext, value, param: str):
    if value != "inf" and value > context.max_tokens_limit:
        raise EventError(f"{param}: must be at most {context.max_tokens_limit} (or \"inf\"), got {value}",
                         param=param)
    return value


def _input_format(audio_format: AudioFormat, param: str) -> tuple[str, int]:
    """An input format's type and sample rate: audio/pcm at its rate (24 kHz by default), G.711 at 8 kHz."""
    if audio_format.type in G711_CODECS:
        if audio_format.rate not in (None, G711_RATE):
            raise EventError(f"{param}.rate: {audio_format.type} is {G711_RATE} Hz, got {audio_format.rate}",
                             param=f"{param}.rate")
        return audio_format.type, G711_RATE
    return audio_format.type, audio_format.rate or PCM_RATE


def _output_format(audio_format: AudioFormat, param: str) -> str:
    """An output format's type: audio/pcm at the model's 24 kHz, or G.711 (resampled to 8 kHz)."""
    if audio_format.type == "audio/pcm" and audio_format.rate not in (None, PCM_RATE):
        raise EventError(f"{param}.rate: output audio/pcm is {PCM_RATE} Hz, got {audio_format.rate}",
                         param=f"{param}.rate")
    return _input_format(audio_format, param)[0]


def _describe_format(fmt: str, rate: int) -> dict:
    return {"type": fmt} if fmt in G711_CODECS else {"type": fmt, "rate": rate}


def _voice(context: ServingContext, voice: str, param: str) -> str:
    try:
        return context.check_voice(voice, param)
    except APIError as exc:
        raise _event_error(exc) from None


def _pcm_bytes(data: str, fmt: str, param: str) -> bytes:
    """Base64 input audio in `fmt` → PCM16 bytes (G.711 decoded, still at 8 kHz)."""
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise EventError(f"{param}: is not valid base64", param=param) from None
    if fmt in G711_CODECS:
        return g711_decode(pcm, fmt).tobytes()
    if len(pcm) % 2:
        raise EventError(f"{param}: PCM16 audio has an even number of bytes, got {len(pcm)}", param=param)
    return pcm


def _transcription(context: ServingContext, fields: InputTranscription | None) -> dict | None:
    """`session.audio.input.transcription`, checked: the served model (the one that answers) and a language it
    hears."""
    if fields is None:
        return None
    param = "session.audio.input.transcription"
    if fields.model is not None and fields.model not in context.model_names:
        raise EventError(f"{param}.model: transcripts come from the served model ({', '.join(context.model_names)}),"
                         f" not {fields.model!r}", param=f"{param}.model", code="model_not_found")
    if context.engine.audio_sampling_rate is None:
        raise EventError(f"{param}: the model has no processor to hear audio", param=param,
                         code="model_not_supported")
    try:
        transcription_language(fields.language)
        context.engine.family.transcription_messages(None, fields.language, fields.prompt)
    except ValueError as exc:
        name = str(exc).partition(":")[0]
        raise EventError(f"{param}.{exc}", param=f"{param}.{name}", code="invalid_value") from None
    return {"model": fields.model or context.model_names[0], "language": fields.language, "prompt": fields.prompt}


async def _transcribe(state: RealtimeSession, item: ConversationItem, transcription: dict) -> None:
    """A committed audio item's transcript, as a background request of the engine (it never delays a
    response's first audio): `conversation.item.input_audio_transcription.delta` events, then `.completed`
    (the transcript is stored on the item) or `.failed`."""
    session, where = state.session, {"item_id": item.id, "content_index": 0}
    request = transcription_request(state.context, item.content[0]["audio"], transcription["language"],
                                    transcription["prompt"], 0.0, None, is_streamed=True, is_background=True)
    texts, final = [], None
    try:
        handle = await state.context.submit(request)
    except APIError as exc:
        final = exc
    else:
        try:
            async for event in handle.events():
                if event.error is not None or event.finish_reason is not None:
                    final = event
                    break
                if event.text:
                    texts.append(event.text)
                    await session.send({"type": "conversation.item.input_audio_transcription.delta", **where,
                                        "delta": event.text})
        finally:
            handle.cancel()  # a no-op once finished
    if final is None or isinstance(final, APIError) or final.error is not None:
        message = final.message if isinstance(final, APIError) else getattr(final, "error", None) or "no result"
        await session.send({"type": "conversation.item.input_audio_transcription.failed", **where,
                            "error": {"type": "transcription_error", "code": None, "message": message,
                                      "param": None}})
        return
    item.parts[0]["transcript"] = transcript = "".join(texts).strip()
    await session.send({"type": "conversation.item.input_audio_transcription.completed", **where,
                        "transcript": transcript, "usage": {
                            "type": "tokens", "input_tokens": final.prompt_tokens,
                            "output_tokens": final.completion_tokens,
                            "total_tokens": final.prompt_tokens + final.completion_tokens}})


async def _append_audio(state: RealtimeSession, data: str) -> None:
    max_seconds = state.context.engine.media_limits.max_audio_seconds
    rate = state.settings.input_rate
    max_bytes = 2 * int(max_seconds * rate)
    # the PCM16 bytes valid base64 decodes to, from its length: an append over the limit is never decoded
    num_bytes = (len(data) * 3 // 4 - data[-2:].count("=")) * (2 if state.settings.input_format in G711_CODECS else 1)
    if len(state.audio_buffer) + num_bytes > max_bytes:
        raise EventError(f"audio: the input audio buffer would hold more than the limit of {max_seconds:g} s of "
                         "audio per turn; commit or clear it first", param="audio", code="input_audio_buffer_full")
    pcm = _pcm_bytes(data, state.settings.input_format, "audio")
    turns = state.turns
    if state.settings.turn_detection is not None and turns.detector is None:
        turns.restart(SpeechDetector(state.settings.turn_detection, rate))
    state.audio_buffer += pcm
    turns.num_appended += len(pcm) // 2
    turns.appended_ms += len(pcm) // 2 * 1000 / rate
    if turns.detector is not None:
        await _detect_turns(state, pcm)


async def _detect_turns(state: RealtimeSession, pcm: bytes) -> None:
    """Server VAD on newly appended audio (off the event loop): speech_started (barge-in: the active response
    is cancelled), speech_stopped → the turn's audio committed as a user item (→ a response). Between turns the
    buffer keeps only what a turn's prefix padding may need."""
    turns, session, rate = state.turns, state.session, state.settings.input_rate
    config = turns.detector.config
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    for event in await run_in_threadpool(turns.detector.feed, samples):
        if event.kind == "speech_started":
            start = max(turns.buffer_start, turns.sample(event.sample, rate) - config.prefix_padding_ms * rate // 1000)
            turns.speech_start, turns.item_id = start, new_id("item")
            await session.send({"type": "input_audio_buffer.speech_started", "item_id": turns.item_id,
                                "audio_start_ms": turns.ms(start, rate)})
            if config.interrupt_response and state.response is not None:
                state.cancel_reason = "turn_detected"
                state.handle.cancel()
            continue
        end = min(turns.num_appended, turns.sample(event.sample, rate) + config.silence_duration_ms * rate // 1000)
        item_id = turns.item_id
        await session.send({"type": "input_audio_buffer.speech_stopped", "item_id": item_id,
                            "audio_end_ms": turns.ms(end, rate)})
        begin = 2 * (turns.speech_start - turns.buffer_start)
        cut = 2 * (end - turns.buffer_start)
        turn_pcm, rest = bytes(state.audio_buffer[begin:cut]), state.audio_buffer[cut:]
        state.audio_buffer = bytearray(rest)
        turns.buffer_start, turns.speech_start, turns.item_id = end, None, None
        await _commit(state, turn_pcm, item_id)
        if config.create_response and state.response is None:
            await _start_response(state, ResponseFields())
    if not turns.detector.is_speaking:  # keep the prefix padding (and a window of slack) of the silence
        keep = (config.prefix_padding_ms + 100) * rate // 1000
        drop = max(0, turns.num_appended - keep - turns.buffer_start)
        if drop:
            del state.audio_buffer[:2 * drop]
            turns.buffer_start += drop


async def _heard(state: RealtimeSession, pcm: bytes, rate: int, param: str) -> np.ndarray:
    """PCM16 bytes at `rate` → float32 samples at the processor's rate (soxr), off the event loop."""
    sampling_rate = state.context.engine.audio_sampling_rate
    if sampling_rate is None:
        raise EventError(f"{param}: the model {state.model_name!r} has no processor to hear audio",
                         param=param, code="model_not_supported")
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    try:
        return await run_in_threadpool(load_audio, (samples, rate), sampling_rate,
                                       state.context.engine.media_limits, param)
    except MediaError as exc:
        raise EventError(str(exc), param=exc.param) from None


def _clear_buffer(state: RealtimeSession) -> None:
    """Empty the input audio buffer; a turn the server VAD had in progress ends with it."""
    turns = state.turns
    state.audio_buffer.clear()
    turns.buffer_start, turns.speech_start, turns.item_id = turns.num_appended, None, None
    if turns.detector is not None:
        turns.detector.restart()


async def _commit(state: RealtimeSession, pcm: bytes, item_id: str) -> None:
    """The committed audio as a user item at the end of the conversation, and its events."""
    audio = await _heard(state, pcm, state.settings.input_rate, "input_audio_buffer")
    item = ConversationItem(item_id, "user", ({"type": "audio", "audio": audio},),
                            [{"type": "input_audio", "transcript": None}])
    previous = _insert(state, item, None)
    await state.session.send({"type": "input_audio_buffer.committed", "previous_item_id": previous,
                              "item_id": item.id})
    await state.session.send({"type": "conversation.item.created", "previous_item_id": previous,
                              "item": item.event_item()})
    if state.settings.transcription is not None:
        task = asyncio.ensure_future(_transcribe(state, item, state.settings.transcription))
        state.transcripts.add(task)
        task.add_done_callback(state.transcripts.discard)


async def _client_item(state: RealtimeSession, item: Item) -> ConversationItem:
    """A `conversation.item.create` item as a turn. User parts: input_text, input_audio (base64 PCM16 at the
    session's input rate); assistant parts: output_text, output_audio (its transcript is the turn's text);
    system parts: input_text."""
    allowed = {"user": ("input_text", "input_audio"), "assistant": ("output_text", "output_audio", "text"),
               "system": ("input_text",)}[item.role]
    engine_parts, parts = [], []
    for i, part in enumerate(item.content):
        param = f"item.content.{i}"
        if part.type not in allowed:
            raise EventError(f"{param}.type: a {item.role} item takes {', '.join(allowed)} parts, not {part.type}",
                             param=f"{param}.type")
        if part.type == "input_audio":
            if part.audio is None:
                raise EventError(f"{param}.audio: required", param=f"{param}.audio",
                                 code="missing_required_parameter")
            pcm = _pcm_bytes(part.audio, state.settings.input_format, f"{param}.audio")
            audio = await _heard(state, pcm, state.settings.input_rate, f"{param}.audio")
            engine_parts.append({"type": "audio", "audio": audio})
            parts.append({"type": "input_audio", "transcript": part.transcript})
            continue
        text = part.transcript if part.type == "output_audio" else part.text
        name = "transcript" if part.type == "output_audio" else "text"
        if text is None:
            raise EventError(f"{param}.{name}: required", param=f"{param}.{name}", code="missing_required_parameter")
        engine_parts.append({"type": "text", "text": text})
        parts.append({"type": part.type, name: text})
    if any(part["type"] == "audio" for part in engine_parts):
        content: str | tuple = tuple(engine_parts)
    else:
        content = "".join(part["text"] for part in engine_parts)
    if item.id is not None and any(existing.id == item.id for existing in state.items):
        raise EventError(f"item.id: the conversation already has an item {item.id!r}", param="item.id")
    return ConversationItem(item.id or new_id("item"), item.role, content, parts)


def _insert(state: RealtimeSession, item: ConversationItem, previous_item_id: str | None) -> str | None:
    """Put `item` after `previous_item_id` ("root": first; None: last); the id of the item before it."""
    _check_room(state, 1, item.num_bytes)
    items = state.items
    if previous_item_id is None:
        index = len(items)
    elif previous_item_id == "root":
        index = 0
    else:
        ids = [existing.id for existing in items]
        if previous_item_id not in ids:
            raise EventError(f"previous_item_id: the conversation has no item {previous_item_id!r}",
                             param="previous_item_id", code="item_not_found")
        index = ids.index(previous_item_id) + 1
    items.insert(index, item)
    return items[index - 1].id if index > 0 else None


def _check_room(state: RealtimeSession, num_items: int, num_bytes: int) -> None:
    """EventError when the conversation would hold more items or bytes than the session limits allow."""
    limits = state.session.limits
    if len(state.items) + num_items > limits.max_session_items:
        raise EventError(f"the conversation holds the limit of {limits.max_session_items} items "
                         "(--max-session-items); start a new session", param="max_session_items",
                         code="conversation_full")
    held = sum(item.num_bytes for item in state.items)
    if held + num_bytes > limits.max_session_bytes:
        raise EventError(f"the conversation would hold {held + num_bytes} bytes, over the limit of "
                         f"{limits.max_session_bytes} (--max-session-bytes); start a new session",
                         param="max_session_bytes", code="conversation_full")


def _engine_request(state: RealtimeSession, fields: ResponseFields) -> tuple[EngineRequest, dict]:
    """The chat request of a response: the conversation (the instructions as its system turn), and what the
    response reports (voice, modalities, max_output_tokens)."""
    context, settings = state.context, state.settings
    modalities = tuple(fields.output_modalities or settings.output_modalities)
    voice, output_format = settings.voice, settings.output_format
    audio = fields.audio.output if fields.audio is not None else None
    if audio is not None:
        if audio.format is not None:
            output_format = _output_format(audio.format, "response.audio.output.format")
        if audio.voice is not None:
            voice = _voice(context, audio.voice, "response.audio.output.voice")
    max_output_tokens = settings.max_output_tokens
    if fields.max_output_tokens is not None:
        max_output_tokens = _max_output_tokens(context, fields.max_output_tokens, "response.max_output_tokens")
    if not any(item.role == "user" for item in state.items):
        raise EventError("the conversation has no user item to answer: commit the input audio buffer or create a "
                         "user item first", code="conversation_empty")
    instructions = settings.instructions if fields.instructions is None else fields.instructions
    turns = ((("system", instructions),) if instructions else ()) + tuple(
        (item.role, item.content) for item in state.items)
    engine = context.engine
    max_new_tokens = (min(engine.config.max_new_tokens, context.max_tokens_limit) if max_output_tokens == "inf"
                      else max_output_tokens)
    request = EngineRequest(
        messages=turns, speak_text=None, speaker=voice if modalities == ("audio",) else None,
        sampling=sampling_params(settings.temperature, settings.top_p, settings.top_k), seed=settings.seed,
        max_new_tokens=max_new_tokens, cache_key=state.id,
    )
    described = {"output_modalities": list(modalities), "max_output_tokens": max_output_tokens,
                 "audio": {"output": {"format": _describe_format(output_format, PCM_RATE), "voice": voice}},
                 "metadata": fields.metadata}
    return request, described


async def _start_response(state: RealtimeSession, fields: ResponseFields) -> None:
    if state.response is not None:
        raise EventError(f"the conversation already has an active response {state.response_id}; cancel it or wait "
                         "for its response.done", code="conversation_already_has_active_response")
    _check_room(state, 1, 0)  # the reply's item
    request, described = _engine_request(state, fields)
    try:
        handle = await state.context.submit(request)
    except APIError as exc:
        raise EventError(exc.message, param=exc.param, code=exc.code or "invalid_value",
                         type=exc.type) from None
    response_id = new_id("resp")
    state.response_id, state.handle = response_id, handle
    state.response = asyncio.create_task(_respond(state, handle, response_id, described))


async def _cancel_response(state: RealtimeSession, event: ResponseCancel) -> None:
    if state.response is None:
        raise EventError("there is no active response to cancel", code="response_cancel_not_active")
    if event.response_id is not None and event.response_id != state.response_id:
        raise EventError(f"response_id: the active response is {state.response_id}, not {event.response_id!r}",
                         param="response_id", code="response_not_found")
    state.cancel_reason = "client_cancelled"
    state.handle.cancel()  # its event stream ends; `_respond` reports it cancelled


async def _respond(state: RealtimeSession, handle, response_id: str, described: dict) -> None:
    """Stream one response's events, then add the reply to the conversation (its transcript as the assistant
    turn). A cancelled request (response.cancel) ends with status "cancelled"; the client leaving cancels it."""
    session = state.session
    is_audio = described["output_modalities"] == ["audio"]
    item_id = new_id("item")
    part_type = "output_audio" if is_audio else "output_text"
    text_key = "transcript" if is_audio else "text"
    response = {"id": response_id, "object": "realtime.response", "conversation_id": state.id, "output": [],
                "status": "in_progress", "status_details": None, "usage": None, **described}
    where = {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}
    texts: list[str] = []
    encoder = _OutputEncoder(described["audio"]["output"]["format"]["type"])
    num_samples = num_frames = 0
    final = None
    try:
        await session.send({"type": "response.created", "response": response})
        item = {"id": item_id, "object": "realtime.item", "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        await session.send({"type": "response.output_item.added", "response_id": response_id, "output_index": 0,
                            "item": item})
        await session.send({"type": "conversation.item.created", "previous_item_id":
                            state.items[-1].id if state.items else None, "item": item})
        await session.send({"type": "response.content_part.added", **where,
                            "part": {"type": "audio" if is_audio else "text", text_key: ""}})
        delta_type = "response.output_audio_transcript.delta" if is_audio else "response.output_text.delta"
        async for event in handle.events():
            if event.error is not None:
                final = event
                break
            if event.text:
                texts.append(event.text)
                await session.send({"type": delta_type, **where, "delta": event.text})
            if is_audio and event.audio is not None and event.audio.size:
                num_samples, num_frames = num_samples + event.audio.size, event.num_frames
                await session.send({"type": "response.output_audio.delta", **where,
                                    "delta": encoder.encode(event.audio)})
            if event.finish_reason is not None:
                final = event
                break
    finally:
        handle.cancel()
        text = "".join(texts)
        if final is None:
            status, details = "cancelled", {"type": "cancelled", "reason": state.cancel_reason}
        elif final.error is not None:
            status, details = "failed", {"type": "failed", "error": {"type": "server_error", "code": final.error_code,
                                                                      "message": final.error}}
        elif final.finish_reason == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        else:
            status, details = "completed", None
        done_item = ConversationItem(item_id, "assistant", text, [{"type": part_type, text_key: text}],
                                     status="completed" if status == "completed" else "incomplete",
                                     text_deltas=tuple(texts), num_samples=num_samples,
                                     num_frames=num_frames)
        state.items.append(done_item)
    if is_audio:
        if final is not None and final.error is None and (tail := encoder.encode(None)):
            await session.send({"type": "response.output_audio.delta", **where, "delta": tail})
        await session.send({"type": "response.output_audio.done", **where})
        await session.send({"type": "response.output_audio_transcript.done", **where, "transcript": text})
    else:
        await session.send({"type": "response.output_text.done", **where, "text": text})
    await session.send({"type": "response.content_part.done", **where,
                        "part": {"type": "audio" if is_audio else "text", text_key: text}})
    await session.send({"type": "response.output_item.done", "response_id": response_id, "output_index": 0,
                        "item": done_item.event_item()})
    await session.send({"type": "conversation.item.done", "item": done_item.event_item()})
    response.update(status=status, status_details=details, output=[done_item.event_item()],
                    usage=_usage(final, is_audio))
    await session.send({"type": "response.done", "response": response})
    # only now may the next response start: its events never interleave with this one's last ones
    state.response, state.response_id, state.handle = None, None, None


class _OutputEncoder:
    """A response's audio deltas in its output format: PCM16 at 24 kHz, or G.711 at 8 kHz (a soxr stream over
    the response, so chunk edges do not click)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self._resampler = soxr.ResampleStream(PCM_RATE, G711_RATE, 1, dtype="float32") if fmt in G711_CODECS \
            else None

    def encode(self, samples: np.ndarray | None) -> str:
        """A delta's base64 text; None: the resampler's last samples at the response's end ("" when none)."""
        if self._resampler is None:
            return "" if samples is None else base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")
        is_last = samples is None
        samples = np.zeros(0, np.float32) if is_last else np.asarray(samples, dtype=np.float32)
        pcm = to_pcm16(self._resampler.resample_chunk(samples, last=is_last))
        return base64.b64encode(g711_encode(pcm, self.fmt)).decode("ascii")


def _usage(final, is_audio: bool) -> dict | None:
    if final is None or final.error is not None:
        return None
    audio_tokens = final.num_frames if is_audio else 0
    output_tokens = final.completion_tokens + audio_tokens
    return {"input_tokens": final.prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": final.prompt_tokens + output_tokens,
            "output_token_details": {"text_tokens": final.completion_tokens, "audio_tokens": audio_tokens}}

