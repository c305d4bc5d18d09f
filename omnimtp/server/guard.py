"""What every HTTP request passes through before a route runs: `Guard` (the ASGI middleware: API key,
also on WebSocket upgrades; body deadline, connection close after early answers, the 500 of last resort,
request counts) and `read_json`, the one reader of a JSON body (size limit, UTF-8, then `parse_json`: JSON,
lone surrogates; WebSocket messages go through `parse_json` too), beside `read_form` for the one route that
also takes a multipart upload."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.websockets import WebSocket

from omnimtp.server.errors import CLIENT_CLOSED, APIError, queue_full
from omnimtp.server.metrics import ServerMetrics
from omnimtp.server.requests import QueueFullError

logger = logging.getLogger("omnimtp.server")

# An over-limit body up to this many times the limit is read and dropped before the 413 (see `read_json`).
_DISCARD_FACTOR = 8
# A JSON string escape of a UTF-16 surrogate; only then can the parsed body hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CHARSET = re.compile(r"charset\s*=\s*\"?([^\";\s]+)", re.IGNORECASE)
_UTF8 = ("utf-8", "utf8")

# Structure limits of any JSON body or event. Parsing and validating are C/Rust calls that hold the GIL, so a
# body of millions of tiny values would stall every other request even off the event loop: it is refused from
# a count of its brackets and of its commas (every value after a container's first follows one) before it is
# parsed, and from the parsed shape (depth, array lengths) before any schema validates it. Both counts include
# brackets and commas inside strings, so they are upper bounds. No request of this server comes near them (the
# longest array it takes is a speaker embedding of at most 8,192 numbers, and a text with 200,000 commas is
# far past every model's context); below them json.loads takes tens of milliseconds at most.
MAX_JSON_CONTAINERS = 100_000
MAX_JSON_COMMAS = 200_000
MAX_JSON_DEPTH = 32
MAX_JSON_ARRAY_ITEMS = 8192
# The most digits of a JSON integer (every integer field takes an int64, 19 digits): longer ones are refused as
# they are read, before Python converts them (quadratic in their length, holding the GIL: thousands of
# 4,000-digit integers stalled the server for 0.4 s).
MAX_JSON_INT_DIGITS = 100
# A body or event larger than this is parsed and validated on a worker thread, off the event loop.
THREAD_PARSE_BYTES = 64 << 10


async def read_json(request: Request, max_body_bytes: int) -> object:
    """The request body as JSON: valid UTF-8 (no encoded surrogates), nesting within Python's
    recursion limit, integers within its digit limit, and no string holding a lone surrogate (the
    tokenizer and the JSON encoder of any error message would both fail on it).

    A Content-Type other than application/json (charset utf-8, if one is named) is a 415. The body's size
    limit is `read_body`'s."""
    content_type = request.headers.get("content-type", "")
    if not is_json(content_type):
        # A cross-site form or text/plain POST (which a browser sends without asking) never starts generation.
        raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}",
                       code="unsupported_media_type")
    body = await read_body(request, max_body_bytes)
    if len(body) > THREAD_PARSE_BYTES:
        return await run_in_threadpool(_decode_json, body)
    return _decode_json(body)


def _decode_json(body: bytes) -> object:
    try:
        text = body.decode("utf-8")  # json.loads would let encoded surrogates through ("surrogatepass")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})",
                       code="invalid_json") from None
    return parse_json(text)


def parse_json(text: str, what: str = "request body") -> object:
    """`text` as JSON: nesting within Python's recursion limit, integers within its digit limit, and no
    string holding a lone surrogate, and within the structure limits (`MAX_JSON_*`). APIError 400 otherwise,
    its message starting with `what` or the path of the array or object at fault."""
    num_containers = text.count("{") + text.count("[")  # brackets inside strings count too: an upper bound
    if num_containers > MAX_JSON_CONTAINERS:
        raise APIError(400, f"{what}: more than {MAX_JSON_CONTAINERS} JSON objects and arrays",
                       code="structure_too_large")
    if text.count(",") > MAX_JSON_COMMAS:
        raise APIError(400, f"{what}: more than {MAX_JSON_COMMAS} JSON values (commas)", code="structure_too_large")
    try:
        value = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise APIError(400, f"{what} is not valid JSON: nested too deeply", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{what} is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError:  # an integer with more digits than int() converts
        raise APIError(400, f"{what} is not valid JSON: a number has too many digits",
                       code="invalid_json") from None
    _check_shape(value, what)
    if _SURROGATE_ESCAPE.search(text):
        path = _lone_surrogate_path(value)
        if path is not None:
            raise APIError(400, f"{path or what}: contains a lone UTF-16 surrogate, which is not valid Unicode",
                           param=path or None, code="invalid_value")
    return value


def _parse_int(digits: str) -> int:
    if len(digits) - digits.startswith("-") > MAX_JSON_INT_DIGITS:
        raise ValueError(f"more than {MAX_JSON_INT_DIGITS} digits")
    return int(digits)


def is_json(content_type: str) -> bool:
    """Whether a Content-Type header is application/json (charset utf-8, if one is named)."""
    media_type, _, parameters = content_type.partition(";")
    charset = _CHARSET.search(parameters)
    return media_type.strip().lower() == "application/json" and not (charset and charset.group(1).lower() not in _UTF8)


def is_form(content_type: str) -> bool:
    """Whether a Content-Type header is multipart/form-data."""
    return content_type.partition(";")[0].strip().lower() == "multipart/form-data"


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The request body's bytes. A body declared (Content-Length) over `max_body_bytes` is a 413 at once; a
    chunked body that runs over is read to its end first when it is at most _DISCARD_FACTOR times that: a
    client still sending when the server closes the connection gets a reset instead of the answer (and the
    connection stays usable)."""
    too_large = APIError(413, f"request body is larger than {max_body_bytes} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_body_bytes:
        raise too_large  # at once: the body is not awaited (the connection closes, lingering, see serving.py)
    max_read = _DISCARD_FACTOR * max_body_bytes
    body, num_received = bytearray(), 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise APIError(CLIENT_CLOSED, "the client closed the connection", code="client_disconnected")
        chunk = message.get("body", b"")
        num_received += len(chunk)
        if num_received <= max_body_bytes:
            body += chunk
        if num_received > max_read or not message.get("more_body", False):
            break
    if num_received > max_body_bytes:
        raise too_large
    return bytes(body)


async def read_form(request: Request, max_body_bytes: int, *, max_files: int = 1, max_fields: int = 16) -> FormData:
    """A multipart/form-data body (`read_body`'s size limit), parsed by Starlette's multipart parser (on a worker
    thread past THREAD_PARSE_BYTES, as JSON is): at most `max_files` files and `max_fields` other fields. 415 for
    another Content-Type, 400 for a malformed body."""
    content_type = request.headers.get("content-type", "")
    if not is_form(content_type):
        raise APIError(415, f"Content-Type must be multipart/form-data or application/json, got "
                       f"{content_type or 'none'!r}", code="unsupported_media_type")
    body = await read_body(request, max_body_bytes)

    async def stream():
        yield body

    parser = MultiPartParser(request.headers, stream(), max_files=max_files, max_fields=max_fields,
                             max_part_size=max_body_bytes)
    try:
        if len(body) > THREAD_PARSE_BYTES:  # seconds for 16 MiB of false boundaries: on a worker thread
            return await run_in_threadpool(asyncio.run, parser.parse())
        return await parser.parse()
    except MultiPartException as exc:
        raise APIError(400, f"request body is not a valid multipart form: {exc.message}", code="invalid_form") from None


def _check_shape(value, what: str) -> None:
    """APIError 400 naming the path ("messages", "item.content") of the first array longer than
    MAX_JSON_ARRAY_ITEMS or container deeper than MAX_JSON_DEPTH. Iterative, and it stops there."""
    stack = [("", value, 1)]
    while stack:
        path, item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"{path or what}: nested more than {MAX_JSON_DEPTH} levels deep",
                           param=path or None, code="structure_too_large")
        if isinstance(item, list):
            if len(item) > MAX_JSON_ARRAY_ITEMS:
                raise APIError(400, f"{path or what}: {len(item)} items, over the limit of {MAX_JSON_ARRAY_ITEMS}",
                               param=path or None, code="structure_too_large")
            children = ((f"{path}.{index}" if path else str(index), child) for index, child in enumerate(item))
        else:
            children = ((f"{path}.{key}" if path else key, child) for key, child in item.items())
        stack.extend((child_path, child, depth + 1) for child_path, child in children
                     if isinstance(child, (dict, list)))


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


async def deny(websocket: WebSocket, error: APIError) -> None:
    """Refuse a WebSocket upgrade before it is accepted: `error`'s status and body where the server speaks
    the ASGI denial-response extension (uvicorn does), else a close, which the server turns into HTTP 403."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error.response())
    else:
        await websocket.close(1008, error.message)


_CLOSE = (b"connection", b"close")
# A WebSocket subprotocol `openai-insecure-api-key.KEY` carries the API key where headers cannot (a browser).
KEY_SUBPROTOCOL = "openai-insecure-api-key"


class Guard:
    """Pure ASGI middleware around every HTTP request:

    - the API-key check on /v1/ routes (the header's bytes against the key's; a WebSocket upgrade may carry the
      key as the subprotocol `openai-insecure-api-key.KEY` instead, as OpenAI's Realtime API takes it, since a
      browser cannot set headers on a WebSocket);
    - the request body must arrive within `body_timeout_s` of the headers, else 408;
    - a response sent before the request body was read to its end (a 401, 408, 413) or with a 5xx
      status says `Connection: close`: the connection's state is unknown, so the client opens a new
      one instead of finding this one reset under its next request;
    - an unexpected exception becomes a logged 500 with an OpenAI body (once a response has started,
      the server can only cut the connection);
    - every response carries an `x-request-id` of its own, as OpenAI's do (clients log it: LiveKit warns
      without one);
    - requests counted by route and status.

    (Not `BaseHTTPMiddleware`: it wraps `receive`, which hides a streaming client's disconnect.)"""

    _COUNTED = ("/v1/chat/completions", "/v1/audio/speech", "/v1/audio/transcriptions", "/v1/audio/voices",
                "/v1/models")

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, body_timeout_s: float):
        self.app = app
        self.api_key = None if api_key is None else api_key.encode("ascii")
        self.metrics = metrics
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
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

        request_id = (b"x-request-id", f"req_{uuid.uuid4().hex}".encode("ascii"))

        async def send_guarded(message):
            if message["type"] == "http.response.start":
                exchange["status"] = message["status"]
                headers = [*message.get("headers", []), request_id]
                message = {**message, "headers": headers}
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

    async def _websocket(self, scope, receive, send):
        """A WebSocket upgrade on a /v1/ route without the key is refused before it is accepted: HTTP 401 with
        an OpenAI error body (where the server speaks the denial-response extension, else a 403)."""
        path = route_path(scope)
        if (self.api_key is None or not path.startswith("/v1/") or self._is_authorized(scope)
                or self._has_key_subprotocol(scope)):
            await self.app(scope, receive, send)
            return
        self.metrics.websocket_sessions.labels(route=path, status="unauthorized").inc()
        await deny(WebSocket(scope, receive, send), APIError(401, "Incorrect or missing API key",
                                                              code="invalid_api_key"))

    def _is_authorized(self, scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)


    def _has_key_subprotocol(self, scope) -> bool:
        for protocol in scope.get("subprotocols", ()):
            prefix, _, token = protocol.partition(".")
            if prefix == KEY_SUBPROTOCOL and secrets.compare_digest(token.encode("utf-8"), self.api_key):
                return True
        return False


# A full server answers this many refusals a second at once (after a burst of as many as _REFUSAL_BURST); later ones
# wait their turn. One costs the event loop ~0.1-0.3 ms (benchmarks/refusal_cost.py), so refused traffic takes at
# most a few percent of it, whatever clients that ignore Retry-After send.
_REFUSALS_PER_S = 100.0
_REFUSAL_BURST = 20


class RefusalPace:
    """When each refusal is answered: at once while refusals come at most `rate` a second (after a burst of `burst`),
    else in turn, 1/rate apart (a virtual-clock pacer, GCRA: each refusal books the next turn). A closed-loop client
    that sends again as soon as it is refused is so slowed to the pace, and cannot spend the event loop's time."""

    def __init__(self, rate: float = _REFUSALS_PER_S, burst: int = _REFUSAL_BURST):
        if not rate > 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate!r}, {burst!r}")
        self.rate, self.burst = float(rate), burst
        self._next_turn = 0.0

    def delay_s(self, now: float) -> float:
        """Seconds the refusal made at `now` (monotonic) waits before its answer goes out; books its turn."""
        turn = max(self._next_turn, now)  # this refusal's turn on the virtual clock, 1/rate after the last one's
        self._next_turn = turn + 1 / self.rate
        return max(0.0, turn - now - (self.burst - 1) / self.rate)  # the first `burst` turns ahead go at once

    async def wait(self) -> None:
        delay = self.delay_s(time.monotonic())
        if delay > 0:
            await asyncio.sleep(delay)


class EarlyRefusal:
    """Pure ASGI middleware (inside `Guard`, so the API key is checked first): while the engine's queue is full, a
    POST to a route that would queue on it (`QUEUED_ROUTES`) is answered 429 `queue_full` with its Retry-After
    before any route runs (`Engine.check_room`), at the pace of `serving.refusal_pace`. Its body is read and
    dropped unparsed; nothing is validated, tokenized or built. A flood of refused requests (clients that ignore
    Retry-After) so takes little of the event loop, and of the GIL the engine thread needs to play the admitted
    streams. A request that finds room goes on to its route, which still refuses it if the queue filled meanwhile;
    a request refused here is not read, so a malformed one gets 429 rather than 400."""

    QUEUED_ROUTES = ("/v1/chat/completions", "/v1/audio/speech")

    def __init__(self, app, serving):
        self.app = app
        self.serving = serving  # `omnimtp.server.routes.common.ServingContext`

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in self.QUEUED_ROUTES:
            await self.app(scope, receive, send)
            return
        try:
            self.serving.engine.check_room()
        except QueueFullError as exc:
            await self._drain(receive)  # (a body left unread: `Guard` closes the connection after the answer)
            await self.serving.refusal_pace.wait()
            await queue_full(exc).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _drain(self, receive) -> None:
        """Read the request's body to its end unless it runs past max_body_bytes or the client leaves."""
        num_received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            num_received += len(message.get("body", b""))
            if not message.get("more_body", False) or num_received > self.serving.max_body_bytes:
                return


def route_path(scope) -> str:
    """The request's path as the app's routes match it: below `root_path`, where the app is mounted (a Ray Serve
    route prefix such as "/tts" gives the path "/tts/v1/models" and the root path "/tts": "/v1/models")."""
    path, root_path = scope["path"], scope.get("root_path", "")
    if root_path and (path == root_path or path.startswith(root_path + "/")):
        return path[len(root_path):] or "/"
    return path


def _has_body(headers) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False
