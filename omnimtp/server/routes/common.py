"""What every API module shares (vLLM's `serving_engine.py`): the one engine handle and the checks
that consult the served model (`ServingContext`), and the request plumbing: the whole result of a request
while watching its client (`collect`), SSE framing, PCM deltas, sampling fields."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner
from omnimtp.limits import MAX_REF_AUDIO_SECONDS, MediaLimits
from omnimtp.media import MediaError, decode_audio, decode_base64, decode_data_url
from omnimtp.sampling import SamplingParams
from omnimtp.server.audio import to_pcm16
from omnimtp.server.errors import CLIENT_CLOSED, APIError, validation_error
from omnimtp.server.guard import read_json
from omnimtp.server.scheduler import (
    TTS_TASK_TYPES,
    Engine,
    EngineRequest,
    PromptTooLongError,
    QueueFullError,
)
from omnimtp.server.schemas import SpeechRequest
from omnimtp.server.voice_store import VoiceStore
from omnimtp.voice import Voice

# A response's header: the requests that had to start before it when it came (0: it started at the next step);
# a stream the server could not yet keep in real time waits behind them (`omnimtp.server.admission`).
QUEUE_POSITION_HEADER = "X-Queue-Position"

Body = TypeVar("Body", bound=BaseModel)

# The speech request fields a Qwen3-TTS model's voice is made of (its ValueErrors start with the field's name).
_VOICE_FIELDS = {name: name for name in ("voice", "language", "instructions")}
# What a cloned voice is made from: the engine's argument names → the HTTP fields (`create_voice`'s ValueErrors
# start with the argument's name).
_CLONE_ARGUMENTS = {"ref_audio": "ref_audio", "ref_text": "ref_text", "x_vector_only": "x_vector_only_mode",
                    "speaker_embedding": "speaker_embedding"}


@dataclass(frozen=True)
class ServingContext:
    """The engine handle every route uses, and the server's limits. model_names: the names `model` may
    take (the engine's model id first), all listed by /v1/models. voices: the saved voices (None: the server
    saves none); max_ref_seconds: the longest voice-clone reference recording; aligner: the forced aligner that
    gives transcripts word timestamps (`serve --aligner-model`; None: word timestamps are refused)."""

    engine: Engine
    model_names: Sequence[str]
    max_body_bytes: int
    max_tokens_limit: int
    voices: VoiceStore | None = None
    max_ref_seconds: float = MAX_REF_AUDIO_SECONDS
    aligner: Qwen3ForcedAligner | None = None

    async def read_body(self, request: Request, schema: type[Body]) -> Body:
        """The request's JSON body validated by `schema` (on a worker thread: the parsed body may still be
        large); APIError 400 naming the field."""
        value = await read_json(request, self.max_body_bytes)
        if isinstance(value, dict) and schema.model_config.get("extra") == "forbid":
            # the first unknown key at once: the schema's errors for 100,000 of them take most of a second to
            # build, in one call that holds the GIL
            unknown = next((key for key in value if key not in schema.model_fields), None)
            if unknown is not None:
                raise APIError(400, f"Unrecognized request argument supplied: {unknown}", param=unknown,
                               code="unknown_parameter")
        try:
            return await run_in_threadpool(schema.model_validate, value)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def check_model(self, model: str | None) -> str:
        """The name the response reports: the requested one, or the engine's model id."""
        if model is None:
            return self.engine.model_id
        if model not in self.model_names:
            served = ", ".join(self.model_names)
            raise APIError(404, f"The model {model!r} does not exist; this server serves: {served}",
                           param="model", code="model_not_found")
        return model

    def check_voice(self, voice: str, param: str) -> str:
        speaker = self.engine.match_speaker(voice)
        if speaker is None:
            names = ", ".join(self.engine.speakers)
            raise APIError(400, f"unknown voice {voice!r}; this model has: {names}", param=param, code="invalid_value")
        return speaker

    def check_chat(self) -> None:
        """APIError 400 unless the model answers chat (a Qwen3-TTS model only speaks text)."""
        if not self.engine.has_chat:
            raise APIError(400, f"the model {self.engine.model_id!r} is a speech-only model (text to speech) and has "
                           "no chat; speak text with /v1/audio/speech", param="model",
                           code="model_not_supported")

    def speech_voice(self, voice, language: str | None, instructions: str | None, task_type: str | None):
        """The `EngineRequest.speaker` of a speech request: a speaker name of a model with a thinker (which
        takes no language, instructions or task_type), or a Qwen3-TTS model's voice object (voice: a speaker
        name, or on a Base model an `omnimtp.voice.Voice`). APIError 400 naming the field: an unknown voice
        (listing the voices) or language (listing them), instructions the model ignores or that a VoiceDesign
        model lacks, a task_type that is not the model's."""
        engine = self.engine
        if not engine.family.speaks:
            raise APIError(400, f"the model {engine.model_id!r} hears and does not speak (speech recognition); "
                           "transcribe audio with /v1/audio/transcriptions", param="model", code="model_not_supported")
        model_type = engine.tts_model_type
        if model_type is None:
            for name, value in (("language", language), ("instructions", instructions), ("task_type", task_type)):
                if value is not None:
                    raise APIError(400, f"{name}: the model {engine.model_id!r} takes no {name} (only Qwen3-TTS "
                                   "models do)", param=name, code="invalid_value")
            if voice is None:
                raise APIError(400, "voice: required", param="voice", code="missing_required_parameter")
            return self.check_voice(voice, "voice")
        served = TTS_TASK_TYPES[model_type]
        if task_type is not None and task_type != served:
            clone = " (voice cloning needs a Base model)" if task_type == "Base" else ""
            raise APIError(400, f"task_type: the model {engine.model_id!r} serves {served}, not {task_type}{clone}",
                           param="task_type", code="invalid_value")
        try:
            return engine.speech_voice(voice, language, instructions)
        except ValueError as exc:
            raise _field_error(exc, _VOICE_FIELDS) from None

    async def speech_speaker(self, body: SpeechRequest):
        """`speech_voice` of a whole speech request, with its voice-cloning fields: on a Base model the voice
        is a saved voice (`voice`), a reference recording (`ref_audio`, optional `ref_text`,
        `x_vector_only_mode`) or a `speaker_embedding`, at most one of them; none speaks without a speaker row,
        as `OmniPipeline.speech` and `omnimtp speak` do without a voice. Any other model refuses those fields
        by name."""
        clone = body.clone_fields
        if self.engine.tts_model_type != "base":
            if clone:
                name = next(iter(clone))
                raise APIError(400, f"{name}: only a Base (voice-clone) model takes {name}; {self._serves()}",
                               param=name, code="invalid_value")
            return self.speech_voice(body.voice, body.language, body.instructions, body.task_type)
        if body.ref_text is not None and body.ref_audio is None:
            raise APIError(400, "ref_text: the transcript of ref_audio, which the request does not give",
                           param="ref_text", code="invalid_value")
        sources = [name for name, value in (("voice", body.voice), ("ref_audio", body.ref_audio),
                                            ("speaker_embedding", body.speaker_embedding)) if value is not None]
        if len(sources) > 1:
            raise APIError(400, f"{sources[-1]}: give one of voice, ref_audio or speaker_embedding, not "
                           f"{' and '.join(sources)}", param=sources[-1], code="invalid_value")
        if not sources:
            if body.x_vector_only_mode:
                raise APIError(400, "x_vector_only_mode: applies to a cloned voice (voice, ref_audio or "
                               "speaker_embedding), which the request does not give", param="x_vector_only_mode",
                               code="invalid_value")
            voice = None
        elif body.voice is not None:
            voice = await self.saved_voice(body.voice)
            if body.x_vector_only_mode:
                voice = voice.x_vector_only()
        else:
            ref_audio = None if body.ref_audio is None else await self.reference_audio(body.ref_audio, "ref_audio")
            voice = await self.clone_voice(ref_audio, body.ref_text, bool(body.x_vector_only_mode),
                                           body.speaker_embedding, audio_param="ref_audio")
        return self.speech_voice(voice, body.language, body.instructions, body.task_type)

    def speech_sampling(self, body) -> SamplingParams:
        """A speech request's sampling (`Engine.speech_sampling`). A model with a thinker samples its talker with
        the family's own settings, as transformers' `generate` does: such a request chooses greedy (temperature 0)
        or those (temperature left out, or 1), and any other temperature, top_p or top_k is a 400 naming it
        rather than a value silently ignored."""
        if self.engine.has_chat:
            for name in ("top_p", "top_k"):
                if getattr(body, name) is not None:
                    raise APIError(400, f"{name}: the model {self.engine.model_id!r} speaks with its talker's own "
                                   f"sampling settings; leave {name} out", param=name, code="invalid_value")
            temperature = body.temperature
            if temperature is not None and temperature != 1.0 and not SamplingParams(temperature=temperature).is_greedy:
                raise APIError(400, f"temperature: the model {self.engine.model_id!r} speaks greedily (temperature "
                               "0) or with its talker's own sampling (1, the default), not at another temperature",
                               param="temperature", code="invalid_value")
        return self.engine.speech_sampling(body.temperature, body.top_p, body.top_k)

    def check_clone(self) -> None:
        """APIError 400 naming `model` unless the model clones voices (a Qwen3-TTS Base model)."""
        if self.engine.tts_model_type != "base":
            raise APIError(400, f"model: voice cloning needs a Qwen3-TTS Base model; {self._serves()}",
                           param="model", code="model_not_supported")

    def _serves(self) -> str:
        model_type = self.engine.tts_model_type
        served = "chat and speech" if model_type is None else TTS_TASK_TYPES[model_type]
        return f"the model {self.engine.model_id!r} serves {served}"

    async def reference_audio(self, data: str | bytes, param: str) -> np.ndarray:
        """A voice-clone reference recording (base64, a data:audio/... URL, or an upload's bytes) as float32 mono
        samples at the model's rate, decoded and resampled in a worker thread; APIError 400 naming `param` for
        audio that cannot be decoded or is longer than `max_ref_seconds` (`Engine.create_voice` refuses one that
        is too short)."""
        try:
            samples = await run_in_threadpool(decode_audio, audio_bytes(data, param), None, self.engine.sample_rate,
                                              MediaLimits(max_audio_seconds=self.max_ref_seconds), param)
        except MediaError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
        return samples

    async def clone_voice(self, ref_audio, ref_text, x_vector_only: bool, speaker_embedding, *, audio_param: str):
        """`Engine.create_voice` in a worker thread (the speaker encoder blocks); its ValueErrors as 400s naming
        the field (the reference recording as `audio_param`)."""
        try:
            return await run_in_threadpool(self.engine.create_voice, ref_audio, ref_text, x_vector_only=x_vector_only,
                                           speaker_embedding=speaker_embedding, max_seconds=self.max_ref_seconds)
        except ValueError as exc:
            raise _field_error(exc, {**_CLONE_ARGUMENTS, "ref_audio": audio_param}) from None

    async def saved_voice(self, name: str):
        """The `Voice` saved as `name`; APIError 400 naming `voice` when there is none (listing the saved ones)."""
        store = self.voices
        data = None if store is None else await run_in_threadpool(store.voice_bytes, name)
        if data is None:
            saved = [] if store is None else [v.name for v in await run_in_threadpool(store.list)]
            known = f"saved voices: {', '.join(saved)}" if saved else "no voices are saved (POST /v1/audio/voices)"
            raise APIError(400, f"voice: unknown voice {name!r}; {known}", param="voice", code="invalid_value")
        return Voice.from_bytes(data)

    async def submit(self, request: EngineRequest):
        """Queue `request` in the engine: its `RequestHandle`. APIError for a prompt over the limit (400), bad
        media (400), a full queue (429) or a stopping server (503)."""
        engine = self.engine
        if not engine.is_running:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        try:
            # Tokenizing and the processor (feature extraction, image resizing) run off the event loop: other
            # requests' streams and /health go on meanwhile. A request whose client leaves meanwhile is not queued.
            if request.messages is None:  # a speech request: its text cut into the segments it is spoken in
                segments = await run_in_threadpool(engine.speech_segments, request)
                return engine.submit(request, loop=asyncio.get_running_loop(), segments=segments)
            prompt = await run_in_threadpool(engine.prompt_ids, request)
            return engine.submit(request, loop=asyncio.get_running_loop(), prompt=prompt)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=exc.param, code="context_length_exceeded") from None
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None


def serving(request: Request) -> ServingContext:
    """The app's `ServingContext` (set by `create_app`)."""
    return request.app.state.serving


def audio_bytes(data: str | bytes, param: str) -> bytes:
    """Encoded audio sent as base64 or a data:audio/... URL (or already bytes: an upload); APIError 400 naming
    `param` for neither."""
    if isinstance(data, bytes):
        return data
    try:
        return decode_data_url(data, param, "audio") if data.startswith("data:") else decode_base64(data, param)
    except MediaError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None


def sampling_params(temperature: float, top_p: float, top_k: int | None) -> SamplingParams:
    return SamplingParams(temperature=float(temperature), top_k=top_k or None, top_p=float(top_p))


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def b64_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")


def stream_error(event) -> dict:
    """The OpenAI error object of an engine error event in a stream."""
    return {"message": event.error, "type": "server_error", "param": None, "code": event.error_code}


def response_error(event) -> APIError:
    """An engine error event as the error of a whole response: 503 when the server ended it (shutting down)."""
    status = 503 if event.error_code == "server_shutting_down" else 500
    return APIError(status, event.error, type="server_error", code=event.error_code)


async def collect(handle, request: Request, events=None):
    """Wait for a whole request: (text, float32 samples, final event), while watching the client (`watched`).
    events: the handle's events still to read (default all of them). Raises APIError on engine errors."""
    return await watched(_gather(handle.events() if events is None else events), handle, request)


async def watched(work, handle, request: Request):
    """The result of the coroutine `work` on `handle`'s events, while watching the client: a disconnect
    cancels the engine request at once (its slot frees up at the next frame boundary) and is an APIError
    499; an error `work` raises cancels the request too, and is raised."""
    result = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((result, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if result.done():
            return result.result()
        raise APIError(CLIENT_CLOSED, "the client closed the connection", code="client_disconnected")
    except BaseException:
        handle.cancel()
        raise
    finally:
        result.cancel()
        disconnect.cancel()


async def first_event(handle, request: Request, events):
    """The first of `events` (an audio chunk, or the end of a request that made no audio), watching the client;
    APIError 500 for an engine error: nothing has been sent yet, so it leaves as an error body."""
    event = await watched(anext(events), handle, request)
    if event.error is not None:
        handle.cancel()
        raise response_error(event)
    return event


async def prepended(event, events):
    """`event`, then the rest of `events`."""
    yield event
    async for later in events:
        yield later


async def _gather(events):
    texts, chunks = [], []
    async for event in events:
        if event.error is not None:
            raise response_error(event)
        texts.append(event.text)
        if event.audio is not None:
            chunks.append(event.audio)
        if event.finish_reason is not None:
            samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
            return "".join(texts), samples, event
    raise APIError(500, "request ended without a result", type="server_error")


async def _wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body has been read: `receive` only reports that now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass



def _field_error(exc: ValueError, fields: dict[str, str]) -> APIError:
    """A ValueError that starts with an argument's name (`"language: unknown language ..."`, or a part of it:
    `"voice.speaker_embedding: ..."`) as a 400 naming its field (`fields`: argument → field)."""
    message = str(exc)
    name = message.partition(":")[0].partition(".")[0]
    param = fields.get(name)
    if param is not None:
        message = param + message[len(name):]  # the field the client sent, not the engine's argument
    return APIError(400, message, param=param, code="invalid_value")
