"""The OpenAI-compatible HTTP app: routes, validation, errors, auth.

The app never touches a model. It turns a validated request into an `EngineRequest`, submits it to
the `Engine` (scheduler.py) and consumes that request's event stream: text deltas, PCM chunks and a
final event. Every error leaves as an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` — never a traceback: client input gets a 4xx that
names the field, anything unexpected a 500 that also closes the connection. A request whose client
disconnects is cancelled in the engine, streamed or not.

Chat media (input_audio and image_url parts of user turns) is decoded here, off the event loop, and
the processor runs before the request is queued: bad media is a 400 naming the part
(`messages.0.content.1.input_audio.data`), never a failed generation.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnimtp.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, DEFAULT_MAX_TOKENS_LIMIT
from omnimtp.media import MediaError, MediaLimits, decode_audio, decode_base64, decode_image, decode_image_url
from omnimtp.sampling import SamplingParams
from omnimtp.server.audio import MEDIA_TYPES, encode_audio, streaming_wav_header, to_pcm16
from omnimtp.server.metrics import ServerMetrics
from omnimtp.server.scheduler import Engine, EngineRequest, PromptTooLongError, QueueFullError
from omnimtp.server.schemas import ChatCompletionRequest, ChatMessage, InputAudioPart, SpeechRequest, TextPart
from omnimtp.server.serving import check_seconds

logger = logging.getLogger("omnimtp.server")

# How long a returned audio id is said to live (we keep nothing; the field is part of the format).
_AUDIO_TTL_S = 3600
# A client told "queue full" may retry after this many seconds (a slot frees up every few frames).
_RETRY_AFTER_S = 1
# Not an HTTP status a client sees: the client is gone. It labels such requests in the metrics
# (nginx's "client closed request").
_CLIENT_CLOSED = 499
# An over-limit body up to this many times the limit is read and dropped before the 413 (see `_read_json`).
_DISCARD_FACTOR = 8
# Clients send the key in an HTTP header, which they encode as ASCII: any other key locks everyone out.
_API_KEY = re.compile(r"[\x21-\x7e]+")
# A JSON string escape of a UTF-16 surrogate; only then can the parsed body hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An error that leaves the server as an OpenAI-style body with `status` (and `headers`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def check_api_key(api_key: str | None) -> None:
    """Raise ValueError unless `api_key` is None (no auth) or a key every client can send: printable
    ASCII without spaces (clients encode headers as ASCII; any other key would lock everyone out).
    The message never shows the key."""
    if api_key is None:
        return
    if not isinstance(api_key, str):
        raise ValueError(f"api_key must be a string or None, got {type(api_key).__name__}")
    if not api_key:
        raise ValueError("api_key must not be empty (None serves without a key)")
    if not _API_KEY.fullmatch(api_key):
        raise ValueError("api_key must be printable ASCII without spaces: clients send it in an ASCII HTTP header")


# The types of chat content parts: pydantic puts a part's type into the error location of its fields.
_PART_TYPES = ("text", "input_audio", "image_url")


def _validation_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    loc = first["loc"]
    # ("messages", 0, "content", 1, "input_audio", "input_audio", "data") → messages.0.content.1.input_audio.data
    loc = [part for k, part in enumerate(loc)
           if not (k >= 2 and loc[k - 2] == "content" and isinstance(loc[k - 1], int) and part in _PART_TYPES)]
    param = ".".join(str(part) for part in loc) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    return APIError(400, message, param=param, code=code)


async def _read_json(request: Request, max_body_bytes: int) -> object:
    """The request body as JSON: valid UTF-8 (no encoded surrogates), nesting within Python's
    recursion limit, integers within its digit limit, and no string holding a lone surrogate (the
    tokenizer and the JSON encoder of any error message would both fail on it).

    A body over `max_body_bytes` is a 413, but read to its end first when it is at most
    _DISCARD_FACTOR times that: a client still sending when the server closes the connection gets a
    reset instead of the answer (and the connection stays usable)."""
    too_large = APIError(413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large")
    max_read = _DISCARD_FACTOR * max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_read:
        raise too_large
    body, num_received = bytearray(), 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise APIError(_CLIENT_CLOSED, "the client closed the connection", code="client_disconnected")
        chunk = message.get("body", b"")
        num_received += len(chunk)
        if num_received <= max_body_bytes:
            body += chunk
        if num_received > max_read or not message.get("more_body", False):
            break
    if num_received > max_body_bytes:
        raise too_large
    try:
        text = body.decode("utf-8")  # json.loads would let encoded surrogates through ("surrogatepass")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})",
                       code="invalid_json") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError:  # an integer with more digits than int() converts
        raise APIError(400, "request body is not valid JSON: a number has too many digits",
                       code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):
        path = _lone_surrogate_path(value)
        if path is not None:
            raise APIError(400, f"{path or 'body'}: contains a lone UTF-16 surrogate, which is not valid Unicode",
                           param=path or None, code="invalid_value")
    return value


def _lone_surrogate_path(value) -> str | None:
    """The dotted path ("messages.0.content") of a string holding a lone surrogate, "" for
    the top level, or None. Iterative: the parsed body may be nested hundreds of levels deep. An
    object key that holds one is reported as its object's path (the key itself cannot be echoed)."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    return path
                stack.append((f"{path}.{key}" if path else key, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{index}" if path else str(index), child) for index, child in enumerate(item))
    return None


def _check_media(messages: list[ChatMessage], limits: MediaLimits, has_processor: bool) -> None:
    """Refuse media a request cannot have before any of it is decoded: media outside user turns (the
    model reads media in user turns), media for a model without a processor, too many parts."""
    num_parts = 0
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                continue
            param = f"messages.{i}.content.{j}"
            if message.role != "user":
                raise APIError(400, f"{param}: {part.type} parts are only read in user messages, not in "
                               f"{message.role} messages", param=param, code="invalid_value")
            if not has_processor:
                raise APIError(400, f"{param}: this model has no processor (preprocessor_config.json) to read "
                               f"{part.type} parts", param=param, code="invalid_value")
            num_parts += 1
    if num_parts > limits.max_parts:
        raise APIError(400, f"messages: {num_parts} media parts is over the limit of {limits.max_parts}",
                       param="messages", code="invalid_value")


def _decoded_messages(messages: list[ChatMessage], limits: MediaLimits, sampling_rate: int | None) -> tuple:
    """The engine's chat turns: (role, text) for a text turn, (role, parts) with the media decoded
    (`EngineRequest.messages`). Raises MediaError naming the part."""
    turns = []
    for i, message in enumerate(messages):
        if not message.has_media:
            turns.append((message.role, message.text()))
            continue
        parts = []
        for j, part in enumerate(message.content):
            param = f"messages.{i}.content.{j}"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, InputAudioPart):
                param += ".input_audio.data"
                data = decode_base64(part.input_audio.data, param)
                parts.append({"type": "audio", "audio": decode_audio(data, part.input_audio.format, sampling_rate,
                                                                     limits, param)})
            else:
                param += ".image_url.url"
                parts.append({"type": "image", "image": decode_image(decode_image_url(part.image_url.url, param),
                                                                     limits, param)})
        turns.append((message.role, tuple(parts)))
    return tuple(turns)


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
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    served_model_names: Sequence[str] = (),
) -> FastAPI:
    """An app serving `engine`. The engine's loop starts with the app and stops on shutdown.

    body_timeout_s: a request's whole body must arrive within this many seconds of its headers (else
    408 and the connection closes). served_model_names: names `model` may take besides the engine's
    model id, all listed by /v1/models; any other `model` is a 404 `model_not_found`."""
    check_api_key(api_key)
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be >= 1, got {max_tokens_limit}")
    body_timeout_s = check_seconds("body_timeout_s", body_timeout_s)
    if isinstance(served_model_names, str):
        raise ValueError(f"served_model_names must be a sequence of names, not the string {served_model_names!r}")
    model_names = tuple(dict.fromkeys([engine.model_id, *served_model_names]))
    if not all(isinstance(name, str) and name for name in model_names):
        raise ValueError(f"served_model_names must be non-empty strings, got {list(served_model_names)!r}")
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(metrics=metrics, max_queue=max_queue)
        try:
            yield
        finally:
            # The server ends the lifespan once every request task has finished or been cancelled (its
            # shutdown deadline), and a cancelled task cancels its engine request: nothing is left to drain.
            await asyncio.to_thread(engine.shutdown, drain=False)

    app = FastAPI(title="omnimtp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics

    app.add_middleware(_Guard, api_key=api_key, metrics=metrics, body_timeout_s=body_timeout_s)

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

    def check_model(model: str | None) -> str:
        """The name the response reports: the requested one, or the engine's model id."""
        if model is None:
            return engine.model_id
        if model not in model_names:
            served = ", ".join(model_names)
            raise APIError(404, f"The model {model!r} does not exist; this server serves: {served}",
                           param="model", code="model_not_found")
        return model

    def check_voice(voice: str, param: str) -> str:
        speaker = engine.match_speaker(voice)
        if speaker is None:
            names = ", ".join(engine.speakers)
            raise APIError(400, f"unknown voice {voice!r}; this model has: {names}", param=param, code="invalid_value")
        return speaker

    async def submit(request: EngineRequest):
        if not engine.is_running:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        try:
            # The processor (feature extraction, image resizing) runs off the event loop; a request whose
            # client leaves meanwhile is not queued.
            prompt = await run_in_threadpool(engine.prompt_ids, request) if request.has_media else None
            return engine.submit(request, loop=asyncio.get_running_loop(), prompt=prompt)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), param=exc.param, code="context_length_exceeded") from None
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        except QueueFullError as exc:
            raise APIError(429, str(exc), type="rate_limit_exceeded", code="queue_full",
                           headers={"Retry-After": str(_RETRY_AFTER_S)}) from None

    @app.get("/health")
    async def health():
        """200 {"status": "ok"} once the engine serves; 503 while it warms up ("loading") or stops."""
        if not engine.is_running:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if not engine.is_ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models():
        models = [{"id": name, "object": "model", "created": engine.created, "owned_by": "omnimtp"}
                  for name in model_names]
        return {"object": "list", "data": models}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = ChatCompletionRequest.model_validate(await _read_json(request, max_body_bytes))
        except ValidationError as exc:
            raise _validation_error(exc) from None
        model_name = check_model(body.model)
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
        elif body.audio is not None:
            raise APIError(400, 'audio is given but modalities do not include "audio": add it, or drop audio',
                           param="audio", code="invalid_value")
        if not any(message.role == "user" and (message.text() or message.has_media) for message in body.messages):
            raise APIError(400, "messages must contain a non-empty user message", param="messages",
                           code="invalid_value")
        limits = engine.media_limits
        if any(message.has_media for message in body.messages):
            _check_media(body.messages, limits, has_processor=engine.audio_sampling_rate is not None)
            try:
                messages = await run_in_threadpool(_decoded_messages, body.messages, limits, engine.audio_sampling_rate)
            except MediaError as exc:
                raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        else:
            messages = _decoded_messages(body.messages, limits, None)
        engine_request = EngineRequest(
            messages=messages,
            speak_text=None,
            speaker=speaker,
            sampling=_sampling(body.temperature, body.top_p, body.top_k),
            seed=body.seed,
            max_new_tokens=max_tokens or max_tokens_limit,
            is_streamed=bool(body.stream),
        )
        handle = await submit(engine_request)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _chat_stream(handle, completion_id, created, model_name, speaker is not None, include_usage),
                media_type="text/event-stream",
            )
        text, samples, final = await _collect(handle, request)
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
            "model": model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": final.finish_reason, "logprobs": None}],
            "usage": final.usage(audio=speaker is not None),
        }

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        try:
            body = SpeechRequest.model_validate(await _read_json(request, max_body_bytes))
        except ValidationError as exc:
            raise _validation_error(exc) from None
        check_model(body.model)
        speaker = check_voice(body.voice, "voice")
        engine_request = EngineRequest(
            messages=None,
            speak_text=body.input,
            speaker=speaker,
            sampling=_sampling(body.temperature, body.top_p, body.top_k),
            seed=body.seed,
            max_new_tokens=0,
        )  # streamed in every format, so that every format carries the same samples
        handle = await submit(engine_request)
        fmt = body.response_format
        if body.stream_format == "sse":
            return StreamingResponse(_speech_sse(handle), media_type="text/event-stream")
        if fmt in ("pcm", "wav"):
            return StreamingResponse(_speech_chunks(handle, fmt, engine.sample_rate), media_type=MEDIA_TYPES[fmt])
        # FLAC needs the whole signal for its header: the body is sent once the audio is complete.
        _, samples, _ = await _collect(handle, request)
        return Response(encode_audio(samples, engine.sample_rate, fmt), media_type=MEDIA_TYPES[fmt])

    return app


_CLOSE = (b"connection", b"close")


class _Guard:
    """Pure ASGI middleware around every HTTP request:

    - the API-key check on /v1/ routes (the header's bytes against the key's);
    - the request body must arrive within `body_timeout_s` of the headers, else 408;
    - a response sent before the request body was read to its end (a 401, 408, 413) or with a 5xx
      status says `Connection: close`: the connection's state is unknown, so the client opens a new
      one instead of finding this one reset under its next request;
    - an unexpected exception becomes a logged 500 with an OpenAI body (once a response has started,
      the server can only cut the connection);
    - requests counted by route and status.

    (Not `BaseHTTPMiddleware`: it wraps `receive`, which hides a streaming client's disconnect.)"""

    _COUNTED = ("/v1/chat/completions", "/v1/audio/speech", "/v1/models")

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, body_timeout_s: float):
        self.app = app
        self.api_key = None if api_key is None else api_key.encode("ascii")
        self.metrics = metrics
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        exchange = {"status": None, "body_complete": not _has_body(scope["headers"])}

        async def receive_in_time():
            if exchange["body_complete"]:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               code="request_timeout") from None
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                exchange["body_complete"] = True
            return message

        async def send_guarded(message):
            if message["type"] == "http.response.start":
                exchange["status"] = message["status"]
                headers = list(message.get("headers", []))
                if (message["status"] >= 500 or not exchange["body_complete"]) and _CLOSE not in headers:
                    message = {**message, "headers": [*headers, _CLOSE]}
            await send(message)

        try:
            if self.api_key is not None and path.startswith("/v1/") and not self._is_authorized(scope):
                error = APIError(401, "Incorrect or missing API key", code="invalid_api_key")
                await error.response()(scope, receive_in_time, send_guarded)
            else:
                await self.app(scope, receive_in_time, send_guarded)
        except Exception:
            if exchange["status"] is not None:
                raise  # the response has started: the server cuts the connection, a truncated body
            logger.exception("unhandled error on %s", path)
            error = APIError(500, "internal server error", type="server_error")
            await error.response()(scope, receive_in_time, send_guarded)
        finally:
            if path in self._COUNTED:
                status = 500 if exchange["status"] is None else exchange["status"]
                self.metrics.requests.labels(route=path, status=str(status)).inc()

    def _is_authorized(self, scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)


def _has_body(headers) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


async def _collect(handle, request: Request):
    """Wait for a whole request: (text, float32 samples, final event), while watching the client: a
    disconnect cancels the engine request at once (its slot frees up at the next frame boundary).
    Raises APIError on engine errors."""
    result = asyncio.ensure_future(_gather(handle))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((result, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if result.done():
            return result.result()
        raise APIError(_CLIENT_CLOSED, "the client closed the connection", code="client_disconnected")
    finally:
        result.cancel()
        disconnect.cancel()
        handle.cancel()


async def _gather(handle):
    texts, chunks = [], []
    async for event in handle.events():
        if event.error is not None:
            raise APIError(500, event.error, type="server_error")
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
