"""The OpenAI-compatible HTTP app: `create_app` puts the API modules together around one engine.

    errors.py          the error shape: `APIError` → `{"error": {"message", "type", "param", "code"}}`
    guard.py           the middleware every request passes (auth, body deadline, 500 of last resort), the
                       early 429 of a full server, and the one JSON body reader
    websocket.py       what WebSocket routes share: session limits and slots, JSON events, error events
    routes/common.py   `ServingContext`: the engine handle and the checks that consult the served model
    routes/chat.py     /v1/chat/completions
    routes/speech.py   /v1/audio/speech
    routes/realtime/   /v1/realtime (WebSocket: OpenAI's Realtime API)
    routes/voices.py   /v1/audio/voices: saved voice-clone voices (`voice_store.py`, SQLite under --voices-dir),
                       and the voice of every speaking request (speaker names, saved and cloned voices)
    routes/speech_stream.py /v1/audio/speech/stream (WebSocket: text streamed into speech)
    routes/transcriptions.py /v1/audio/transcriptions (the thinker hears an uploaded file)
    routes/models.py   /v1/models, /health, /metrics
    routes/playground.py  / and /playground: the web playground (static files in server/playground/)

The app never touches a model. A route turns a validated request into an `EngineRequest`, submits it to
the `Engine` (scheduler.py) and consumes that request's event stream: text deltas, PCM chunks and a
final event. Every error leaves as an OpenAI-style body — never a traceback: client input gets a 4xx that
names the field, anything unexpected a 500 that also closes the connection. A request whose client
disconnects is cancelled in the engine, streamed or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner
from omnimtp.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS_LIMIT,
    MAX_REF_AUDIO_SECONDS,
    MIN_REF_AUDIO_SECONDS,
    check_api_key,
    check_seconds,
)
from omnimtp.server.aliases import OPENAI_MODELS, speaker_aliases
from omnimtp.server.errors import APIError
from omnimtp.server.guard import EarlyRefusal, Guard
from omnimtp.server.metrics import ServerMetrics
from omnimtp.server.routes import chat, models, realtime, speech, speech_stream, transcriptions, voices
from omnimtp.server.routes import playground as playground_routes
from omnimtp.server.routes.common import ServingContext
from omnimtp.server.scheduler import Engine
from omnimtp.server.voice_store import VoiceStore
from omnimtp.server.websocket import WebSocketLimits, WebSocketSessions

_SHUTDOWN_MESSAGE = "the server is shutting down: the request was ended before it finished"


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    served_model_names: Sequence[str] = (),
    openai_aliases: bool = False,
    voice_aliases: Mapping[str, str] | None = None,
    websocket_limits: WebSocketLimits = WebSocketLimits(),
    voice_store: VoiceStore | None = None,
    max_ref_seconds: float = MAX_REF_AUDIO_SECONDS,
    playground: bool = True,
    aligner: Qwen3ForcedAligner | None = None,
    asr_engine: Engine | None = None,
) -> FastAPI:
    """An app serving `engine`. The engine's loop starts with the app and stops on shutdown.

    body_timeout_s: a request's whole body must arrive within this many seconds of its headers (else
    408 and the connection closes). served_model_names: names `model` may take besides the engine's
    model id, all listed by /v1/models; any other `model` is a 404 `model_not_found`. openai_aliases: OpenAI's
    model names name the served model too, and OpenAI's voice names its default speaker (`aliases.py`);
    voice_aliases: more voice names, each → one of the model's speakers. websocket_limits: the
    WebSocket routes' session limit, idle timeout and message size (`omnimtp.server.websocket`). voice_store:
    where /v1/audio/voices saves voices (None: it saves none); max_ref_seconds: the longest reference
    recording a voice is cloned from (at least MIN_REF_AUDIO_SECONDS). playground: serve the web playground at /
    and /playground (`routes/playground.py`). aligner: a Qwen3-ForcedAligner beside the model, which gives
    `/v1/audio/transcriptions` its word timestamps (`timestamp_granularities[]=word`), and the speech the server
    makes (`/v1/audio/speech`, realtime spoken replies) its words' timestamps. asr_engine: a speech
    recognizer (a Qwen3-ASR model's engine, `serve --asr-model`) beside the model: the realtime sessions' input
    transcripts by default, and `/v1/audio/transcriptions` for its own name (and, with openai_aliases, OpenAI's
    transcription models' names), so the model's slots are not spent on hearing; it starts and stops with the
    app."""
    check_api_key(api_key)
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
    body_timeout_s = check_seconds("body_timeout_s", body_timeout_s)
    max_ref_seconds = check_seconds("max_ref_seconds", max_ref_seconds)
    if max_ref_seconds < MIN_REF_AUDIO_SECONDS:
        raise ValueError(
            f"max_ref_seconds must be >= {MIN_REF_AUDIO_SECONDS:g} (the shortest reference), got {max_ref_seconds}"
        )
    if voice_store is not None and not isinstance(voice_store, VoiceStore):
        raise ValueError(f"voice_store must be a VoiceStore or None, got {type(voice_store).__name__}")
    if aligner is not None and not isinstance(aligner, Qwen3ForcedAligner):
        raise ValueError(f"aligner must be a Qwen3ForcedAligner or None, got {type(aligner).__name__}")
    if asr_engine is not None:
        if asr_engine is engine or asr_engine.family.speaks or asr_engine.audio_sampling_rate is None:
            raise ValueError("asr_engine: must be another engine, of a model that only hears (Qwen3-ASR)")
        if engine.audio_sampling_rate not in (None, asr_engine.audio_sampling_rate):
            raise ValueError(f"asr_engine: hears at {asr_engine.audio_sampling_rate} Hz, the model at "
                             f"{engine.audio_sampling_rate} Hz")
    if isinstance(served_model_names, str):
        raise ValueError(f"served_model_names must be a sequence of names, not the string {served_model_names!r}")
    openai_models = OPENAI_MODELS if openai_aliases else ()
    model_names = tuple(dict.fromkeys([engine.model_id, *served_model_names, *openai_models]))
    if not all(isinstance(name, str) and name for name in model_names):
        raise ValueError(f"served_model_names must be non-empty strings, got {list(served_model_names)!r}")
    if not isinstance(websocket_limits, WebSocketLimits):
        raise ValueError(f"websocket_limits must be a WebSocketLimits, got {type(websocket_limits).__name__}")
    aliases = speaker_aliases(engine.speakers, getattr(engine.family, "default_speaker", None), voice_aliases or {},
                              openai=openai_aliases)
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(metrics=metrics, max_queue=max_queue)
        if asr_engine is not None:
            asr_engine.start(max_queue=max_queue)  # (the metrics are the model's engine's)
        try:
            yield
        finally:
            # The server ends the lifespan once every request task has finished or been cancelled (its
            # shutdown deadline), and a cancelled task cancels its engine request: nothing is left to drain.
            if asr_engine is not None:
                await asyncio.to_thread(asr_engine.shutdown, drain=False)
            await asyncio.to_thread(engine.shutdown, drain=False)

    # No trailing-slash redirects: a redirect would point at the client's own Host header; a 404 instead.
    app = FastAPI(title="omnimtp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.metrics = metrics
    app.state.websockets = WebSocketSessions(websocket_limits, metrics)
    asr = None
    if asr_engine is not None:  # (it answers to its own name and OpenAI's transcription models')
        transcribers = [name for name in openai_models if "transcribe" in name or "whisper" in name]
        asr = ServingContext(engine=asr_engine, model_names=tuple(dict.fromkeys([asr_engine.model_id, *transcribers])),
                             max_body_bytes=max_body_bytes, max_tokens_limit=max_tokens_limit, aligner=aligner)
    app.state.serving = ServingContext(engine=engine, model_names=model_names, max_body_bytes=max_body_bytes,
                                       max_tokens_limit=max_tokens_limit, voices=voice_store,
                                       max_ref_seconds=max_ref_seconds, aligner=aligner, voice_aliases=aliases,
                                       asr=asr)
    # Called just before the graceful shutdown deadline (`serving.ShutdownDeadline`).
    def end_requests() -> None:
        for running in (engine, asr_engine):
            if running is not None:
                running.end_requests(_SHUTDOWN_MESSAGE)

    app.state.on_shutdown_deadline = end_requests
    for api in (chat, speech, speech_stream, transcriptions, voices, realtime, models):
        app.include_router(api.router)
    if playground:
        app.include_router(playground_routes.router)

    app.add_middleware(EarlyRefusal, serving=app.state.serving)  # (inside Guard: added first)
    app.add_middleware(Guard, api_key=api_key, metrics=metrics, body_timeout_s=body_timeout_s)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return APIError(400, "invalid request").response()

    return app
