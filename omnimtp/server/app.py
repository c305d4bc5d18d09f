"""The OpenAI-compatible HTTP app: routes, validation, errors, auth.

The app never touches a model. It turns a validated request into an `EngineRequest`, submits it to
the `Engine` (scheduler.py) and consumes that request's event stream: text deltas, PCM chunks and a
final event. Every error leaves as an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` — never a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnimtp.sampling import SamplingParams
from omnimtp.server.audio import MEDIA_TYPES, encode_audio, streaming_wav_header, to_pcm16
from omnimtp.server.metrics import ServerMetrics
from omnimtp.server.scheduler import Engine, EngineRequest, QueueFullError
from omnimtp.server.schemas import ChatCompletionRequest, SpeechRequest

logger = logging.getLogger("omnimtp.server")

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_TOKENS_LIMIT = 2048
# How long a returned audio id is said to live (we keep nothing; the field is part of the format).
_AUDIO_TTL_S = 3600


class APIError(Exception):
    """An error that leaves the server as an OpenAI-style body with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    return APIError(400, message, param=param, code=code)


async def _read_json(request: Request, max_body_bytes: int) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise APIError(413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None


def _sampling(temperature: float, top_p: float, top_k: int | None) -> SamplingParams:
    return SamplingParams(temperature=float(temperature), top_k=top_k or None, top_p=float(top_p))


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
) -> FastAPI:
    """An app serving `engine`. The engine's loop starts with the app and drains on shutdown."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string or None")
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(metrics=metrics, max_queue=max_queue)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown, drain=True)

    app = FastAPI(title="omnimtp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics

    app.add_middleware(_Guard, api_key=api_key, metrics=metrics)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception):
        logger.error("unhandled error on %s: %s", request.url.path, type(exc).__name__)
        return APIError(500, "internal server error", type="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return APIError(400, "invalid request").response()

    def check_voice(voice: str, param: str) -> str:
        speaker = engine.match_speaker(voice)
        if speaker is None:
            names = ", ".join(engine.speakers)
            raise APIError(400, f"unknown voice {voice!r}; this model has: {names}", param=param, code="invalid_value")
        return speaker

    def submit(request: EngineRequest):
        try:
            return engine.submit(request, loop=asyncio.get_running_loop())
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_exceeded", code="queue_full") from None

    @app.get("/health")
    async def health():
        return {"status": "ok" if engine.is_running else "stopping"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        model = {"id": engine.model_id, "object": "model", "created": engine.created, "owned_by": "omnimtp"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = ChatCompletionRequest.model_validate(await _read_json(request, max_body_bytes))
        except ValidationError as exc:
            raise _validation_error(exc) from None
        param, max_tokens = "max_tokens", body.max_tokens
        if body.max_completion_tokens is not None:
            param, max_tokens = "max_completion_tokens", body.max_completion_tokens
        if max_tokens is not None and not 1 <= max_tokens <= max_tokens_limit:
            raise APIError(400, f"{param} must be in [1, {max_tokens_limit}], got {max_tokens}", param=param,
                           code="invalid_value")
        if "text" not in body.modalities or len(set(body.modalities)) != len(body.modalities):
            raise APIError(400, 'modalities must be ["text"] or ["text", "audio"]', param="modalities",
                           code="invalid_value")
        speaker, audio_format = None, None
        if body.wants_audio:
            if body.audio is None:
                raise APIError(400, 'audio is required when modalities include "audio"', param="audio",
                               code="missing_required_parameter")
            speaker = check_voice(body.audio.voice, "audio.voice")
            audio_format = body.audio.format
        if not any(message.role == "user" and message.text() for message in body.messages):
            raise APIError(400, "messages must contain a non-empty user message", param="messages",
                           code="invalid_value")
        engine_request = EngineRequest(
            messages=tuple((message.role, message.text()) for message in body.messages),
            speak_text=None,
            speaker=speaker,
            sampling=_sampling(body.temperature, body.top_p, body.top_k),
            seed=body.seed,
            max_new_tokens=max_tokens or max_tokens_limit,
        )
        handle = submit(engine_request)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _chat_stream(handle, completion_id, created, engine.model_id, speaker is not None, include_usage),
                media_type="text/event-stream",
            )
        text, samples, final = await _collect(handle)
        message: dict = {"role": "assistant", "content": text, "refusal": None}
        if speaker is not None:
            audio_bytes = encode_audio(samples, engine.sample_rate, audio_format)
            message["audio"] = {
                "id": f"audio_{uuid.uuid4().hex}",
                "data": base64.b64encode(audio_bytes).decode("ascii"),
                "expires_at": created + _AUDIO_TTL_S,
                "transcript": text,
            }
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": engine.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": final.finish_reason, "logprobs": None}],
            "usage": final.usage(audio=speaker is not None),
        }

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        try:
            body = SpeechRequest.model_validate(await _read_json(request, max_body_bytes))
        except ValidationError as exc:
            raise _validation_error(exc) from None
        speaker = check_voice(body.voice, "voice")
        engine_request = EngineRequest(
            messages=None,
            speak_text=body.input,
            speaker=speaker,
            sampling=_sampling(body.temperature, body.top_p, body.top_k),
            seed=body.seed,
            max_new_tokens=0,
        )
        handle = submit(engine_request)
        fmt = body.response_format
        if body.stream_format == "sse":
            return StreamingResponse(_speech_sse(handle), media_type="text/event-stream")
        if fmt in ("pcm", "wav"):
            return StreamingResponse(_speech_chunks(handle, fmt, engine.sample_rate), media_type=MEDIA_TYPES[fmt])
        # FLAC needs the whole signal for its header: the body is sent once the audio is complete.
        _, samples, _ = await _collect(handle)
        return Response(encode_audio(samples, engine.sample_rate, fmt), media_type=MEDIA_TYPES[fmt])

    return app


class _Guard:
    """Pure ASGI middleware: API-key check on /v1/ routes and request counting by status.

    (Not `BaseHTTPMiddleware`: it wraps `receive`, which hides a streaming client's disconnect.)"""

    _COUNTED = ("/v1/chat/completions", "/v1/audio/speech", "/v1/models")

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = {"code": 500}

        async def send_counting(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and path.startswith("/v1/") and not self._is_authorized(scope):
                error = APIError(401, "Incorrect or missing API key", code="invalid_api_key")
                await error.response()(scope, receive, send_counting)
            else:
                await self.app(scope, receive, send_counting)
        finally:
            if path in self._COUNTED:
                self.metrics.requests.labels(route=path, status=str(status["code"])).inc()

    def _is_authorized(self, scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), self.api_key)


async def _collect(handle):
    """Wait for a whole request: (text, float32 samples, final event). Raises APIError on engine errors."""
    texts, chunks = [], []
    try:
        async for event in handle.events():
            if event.error is not None:
                raise APIError(500, event.error, type="server_error")
            texts.append(event.text)
            if event.audio is not None:
                chunks.append(event.audio)
            if event.finish_reason is not None:
                samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
                return "".join(texts), samples, event
    finally:
        handle.cancel()
    raise APIError(500, "request ended without a result", type="server_error")


def _b64_pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(to_pcm16(samples).tobytes()).decode("ascii")


async def _chat_stream(handle, completion_id, created, model_id, with_audio, include_usage):
    def chunk(delta: dict, finish_reason=None, usage=None) -> bytes:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                   "choices": choices}
        if usage is not None:
            payload["choices"] = []
            payload["usage"] = usage
        return _sse(payload)

    audio_id = f"audio_{uuid.uuid4().hex}"
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in handle.events():
            if event.error is not None:
                error = {"message": event.error, "type": "server_error", "param": None, "code": None}
                yield _sse({"error": error})
                break
            if event.text:
                yield chunk({"content": event.text})
            if with_audio and (event.audio is not None or event.text):
                audio = {"id": audio_id, "transcript": event.text}
                if event.audio is not None:
                    audio["data"] = _b64_pcm16(event.audio)
                yield chunk({"audio": audio})
            if event.finish_reason is not None:
                yield chunk({}, finish_reason=event.finish_reason)
                if include_usage:
                    yield chunk({}, usage=event.usage(audio=with_audio))
                break
        yield _sse("[DONE]")
    finally:
        handle.cancel()


async def _speech_sse(handle):
    try:
        async for event in handle.events():
            if event.error is not None:
                error = {"message": event.error, "type": "server_error", "param": None, "code": None}
                yield _sse({"type": "error", "error": error})
                break
            if event.audio is not None and event.audio.size:
                yield _sse({"type": "speech.audio.delta", "audio": _b64_pcm16(event.audio)})
            if event.finish_reason is not None:
                usage = {"input_tokens": event.prompt_tokens, "output_tokens": event.num_frames,
                         "total_tokens": event.prompt_tokens + event.num_frames}
                yield _sse({"type": "speech.audio.done", "usage": usage})
                break
    finally:
        handle.cancel()


async def _speech_chunks(handle, fmt: str, sample_rate: int):
    try:
        if fmt == "wav":
            yield streaming_wav_header(sample_rate)
        async for event in handle.events():
            if event.error is not None:
                break  # headers are gone; a truncated body is the only signal left (logged by the engine)
            if event.audio is not None and event.audio.size:
                yield to_pcm16(event.audio).tobytes()
            if event.finish_reason is not None:
                break
    finally:
        handle.cancel()
