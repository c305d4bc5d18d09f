"""The Realtime API's client events as strict schemas (OpenAI's GA names and fields): `parse_event` turns a
client event into its schema or an `EventError` naming the field."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnimtp.server.errors import APIError, validation_error
from omnimtp.server.schemas import Seed
from omnimtp.server.vad import TurnDetection
from omnimtp.server.websocket import EventError, echo

PCM_RATE = 24000  # OpenAI's audio/pcm rate, and the output rate of both omni families
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
# Input rates a client may name for audio/pcm (resampled to the processor's rate with soxr).
MIN_INPUT_RATE, MAX_INPUT_RATE = 8000, 48000
MAX_TURN_MS = 10_000  # the longest prefix padding or silence duration a session may ask for
# idle_timeout_ms's range (OpenAI's is 5-30 s; a shorter one is allowed)
MIN_IDLE_TIMEOUT_MS, MAX_IDLE_TIMEOUT_MS = 100, 30_000


class AudioFormat(BaseModel):
    """audio/pcm (PCM16 at `rate`, 24 kHz when not given) or G.711 audio/pcmu / audio/pcma (8 kHz)."""

    model_config = _STRICT
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: Annotated[int, Field(ge=MIN_INPUT_RATE, le=MAX_INPUT_RATE)] | None = None


class ServerVad(BaseModel):
    """`turn_detection`: server_vad, or semantic_vad (its eagerness: how long a silence ends the turn)."""

    model_config = _STRICT
    type: Literal["server_vad", "semantic_vad"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] = TurnDetection.threshold
    prefix_padding_ms: Annotated[int, Field(ge=0, le=MAX_TURN_MS)] = TurnDetection.prefix_padding_ms
    silence_duration_ms: Annotated[int, Field(ge=0, le=MAX_TURN_MS)] = TurnDetection.silence_duration_ms
    create_response: bool = TurnDetection.create_response
    interrupt_response: bool = TurnDetection.interrupt_response
    idle_timeout_ms: Annotated[int, Field(ge=MIN_IDLE_TIMEOUT_MS, le=MAX_IDLE_TIMEOUT_MS)] | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None


class InputTranscription(BaseModel):
    model_config = _STRICT
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class NoiseReduction(BaseModel):
    model_config = _STRICT
    type: Literal["near_field", "far_field"]


class AudioInput(BaseModel):
    model_config = _STRICT
    format: AudioFormat | None = None
    turn_detection: ServerVad | None = None  # given as null: manual turns (the client commits the buffer)
    transcription: InputTranscription | None = None
    noise_reduction: NoiseReduction | None = None  # taken and echoed; the audio is heard as it comes (no filter)


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
    type: Literal["realtime", "transcription"] = "realtime"
    model: str | None = None
    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxOutputTokens | None = None
    audio: AudioConfig | None = None
    tools: Annotated[list, Field(max_length=0)] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    tracing: None = None
    include: list[Literal["item.input_audio_transcription.logprobs"]] | None = None
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


class ItemDelete(ClientEvent):
    type: Literal["conversation.item.delete"]
    item_id: Annotated[str, Field(min_length=1)]


class ItemRetrieve(ClientEvent):
    type: Literal["conversation.item.retrieve"]
    item_id: Annotated[str, Field(min_length=1)]


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
    "conversation.item.delete": ItemDelete,
    "conversation.item.retrieve": ItemRetrieve,
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
        raise event_error(validation_error(exc)) from None


def event_error(exc: APIError) -> EventError:
    return EventError(exc.message, param=exc.param, code=exc.code or "invalid_value")
