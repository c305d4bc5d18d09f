"""Request bodies of the OpenAI-compatible routes, validated strictly.

Strict mode: a string is never coerced to a number or a boolean, a float must be finite (NaN and
infinity are refused by name, not as "out of range"), and unknown top-level fields are rejected (an
ignored parameter would be a silent fallback). Checks that need the served model (model names, voice
names, the max_tokens limit) live in `app.py`, next to the model they consult.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from omnimtp.sampling import MAX_TOP_LOGPROBS

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
_STRICT_OPEN = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

# OpenAI takes any int64 seed; the engine derives its generator seeds from it without overflow.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

# Output formats we encode (audio.py); anything else is rejected, never replaced by a default.
CHAT_AUDIO_FORMATS = ("wav", "pcm16", "flac")
SPEECH_FORMATS = ("wav", "pcm", "flac")

NonEmptyStr = Annotated[str, Field(min_length=1)]


class TextPart(BaseModel):
    model_config = _STRICT_OPEN
    type: Literal["text"]
    text: str


class InputAudio(BaseModel):
    model_config = _STRICT_OPEN
    data: str  # base64 of the encoded audio
    format: Literal["wav", "mp3", "flac"]  # omnimtp.media.AUDIO_FORMATS


class InputAudioPart(BaseModel):
    model_config = _STRICT_OPEN
    type: Literal["input_audio"]
    input_audio: InputAudio


class ImageUrl(BaseModel):
    """url: a data: URL (remote URLs are never fetched). detail: only "auto": the processor's own
    resizing applies, and another value would be ignored."""

    model_config = _STRICT_OPEN
    url: str
    detail: Literal["auto"] = "auto"


class ImageUrlPart(BaseModel):
    model_config = _STRICT_OPEN
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | InputAudioPart | ImageUrlPart, Field(discriminator="type")]
MediaPart = InputAudioPart | ImageUrlPart


class ChatMessage(BaseModel):
    """One chat turn. `content` is a string or a list of content parts; a string is read as one text part.
    Parts are text, input_audio and image_url (media in user turns only, checked in `app.py`); any other
    type (file, ...) is refused by its type."""

    model_config = _STRICT_OPEN
    role: Literal["system", "developer", "user", "assistant"]
    content: list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise PydanticCustomError("content_type", "content must be a string or a list of content parts")
        return content

    def text(self) -> str:
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def has_media(self) -> bool:
        return any(not isinstance(part, TextPart) for part in self.content)


class AudioOutput(BaseModel):
    model_config = _STRICT
    voice: NonEmptyStr
    format: Literal["wav", "pcm16", "flac", "mp3", "opus", "aac"] = "wav"  # omnimtp.server.audio.FORMATS


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    modalities: list[Literal["text", "audio"]] = Field(default_factory=lambda: ["text"])
    audio: AudioOutput | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # an int, never a bool (a Literal would take True == 1)
    user: str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities


# What a Qwen3-TTS speech request asks for (vllm-omni's `task_type`): a named speaker, a voice described in
# `instructions`, or a cloned voice (a Base model).
TASK_TYPES = ("CustomVoice", "VoiceDesign", "Base")


# A speaker embedding (x-vector) sent as numbers: the released Base models' are 1024 or 2048 wide.
MAX_SPEAKER_EMBEDDING = 8192
SpeakerEmbedding = Annotated[list[float], Field(min_length=1, max_length=MAX_SPEAKER_EMBEDDING)]
RefText = Annotated[str, Field(min_length=1, max_length=4096)]
MAX_SPEECH_INPUT_CHARS = 4096  # the text one speech request speaks


class SpeechVoice(BaseModel):
    """The fields of a speech request that say how to speak (`SpeechRequest`, and `/v1/audio/speech/stream`'s
    `session.config`).

    Voice cloning (a Base model, vllm-omni's fields): `voice` names a saved voice (`/v1/audio/voices`), or the
    request carries its own: `ref_audio` (base64 or a data: URL of the reference recording) with an optional
    `ref_text` (its transcript: in-context cloning) and `x_vector_only_mode` (the speaker embedding alone), or
    a precomputed `speaker_embedding`."""

    model_config = _STRICT
    model: str | None = None
    voice: NonEmptyStr | None = None
    language: NonEmptyStr | None = None
    instructions: Annotated[str, Field(max_length=4096)] | None = None
    task_type: Literal[TASK_TYPES] | None = None
    speed: Annotated[float, Field(ge=1.0, le=1.0)] = 1.0  # a number, never a bool
    seed: Seed | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    user: str | None = None
    ref_audio: NonEmptyStr | None = None
    ref_text: RefText | None = None
    x_vector_only_mode: bool | None = None
    speaker_embedding: SpeakerEmbedding | None = None

    @property
    def clone_fields(self) -> dict:
        """The voice-cloning fields the request gives (a Base model's), by name."""
        return {name: getattr(self, name) for name in CLONE_FIELDS if getattr(self, name) is not None}


CLONE_FIELDS = ("ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding")


class VoiceCreateRequest(BaseModel):
    """`POST /v1/audio/voices` (vllm-omni's fields): `name`, `consent` (required: a statement that the speaker
    agreed, or the id of a consent record), and either `audio_sample` (the reference recording: base64 or a
    data: URL in a JSON body, a file part in a multipart form) with an optional `ref_text` (its transcript, for
    in-context cloning; `x_vector_only_mode` keeps the embedding alone), or a precomputed `speaker_embedding`.
    `user`: who asks (recorded with the consent)."""

    model_config = _STRICT
    model: str | None = None
    name: Annotated[str, Field(min_length=1, max_length=256)]
    consent: Annotated[str, Field(max_length=4096)]
    audio_sample: NonEmptyStr | None = None
    ref_text: RefText | None = None
    x_vector_only_mode: bool = False
    speaker_embedding: SpeakerEmbedding | None = None
    user: Annotated[str, Field(max_length=256)] | None = None


class SpeechStreamConfig(SpeechVoice):
    """`/v1/audio/speech/stream`'s `session.config` event: the speech request's fields but `input` (the text comes
    in `input_text.delta` events) and `stream_format`; `audio.delta` events carry PCM16."""

    type: Literal["session.config"]
    event_id: str | None = None
    response_format: Literal["pcm"] = "pcm"


class SpeechRequest(SpeechVoice):
    """OpenAI's speech request, with vllm-omni's Qwen3-TTS fields `language` and `task_type` and OpenAI's own
    `instructions`. `voice` may be left out only where the model has a default (a Qwen3-TTS CustomVoice model)
    or no named voices (VoiceDesign). temperature / top_p / top_k left out: the model's own defaults (checked
    against the model in `routes/speech.py`)."""

    input: Annotated[str, Field(min_length=1, max_length=MAX_SPEECH_INPUT_CHARS)]
    # wav, not OpenAI's mp3, by default: lossless, so it holds exactly the samples a `pcm` response does (as
    # vllm-omni's default); mp3, opus and aac are there for the asking
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus", "aac"] = "wav"
    stream_format: Literal["audio", "sse"] = "audio"
    # an extension: ["word"] puts the spoken words' timestamps (a forced aligner beside the model, on the audio
    # the request made) into the SSE `speech.audio.done` event (`routes/speech.py`)
    timestamp_granularities: Annotated[list[Literal["word"]], Field(min_length=1, max_length=1)] | None = None


MAX_SPEECH_BATCH_ITEMS = 32


class SpeechBatchRequest(BaseModel):
    """`/v1/audio/speech/batch`: up to MAX_SPEECH_BATCH_ITEMS speech requests, spoken as one batch."""

    model_config = _STRICT
    items: Annotated[list[SpeechRequest], Field(min_length=1, max_length=MAX_SPEECH_BATCH_ITEMS)]
