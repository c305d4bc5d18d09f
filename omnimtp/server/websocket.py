"""The WebSocket plumbing every WebSocket route shares: limits, session slots, per-route metrics and the
JSON event framing. The API key is checked on the upgrade request by the `Guard` middleware (guard.py),
before any route runs.

A route hands its session handler to `WebSocketSessions.serve`, and the handler talks JSON events:

    @router.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket):
        await websocket_sessions(websocket).serve(websocket, "/v1/realtime", _run)

    async def _run(session: Session):
        await session.send({"type": "session.created", ...})
        while (event := await session.receive()) is not None:   # None: the client left, or idle
            try:
                ...                                              # handle event["type"]
            except EventError as exc:
                await session.send_error(exc, event)             # the session goes on

    refusal     over `max_sessions` open sessions on the route, the upgrade is answered with HTTP 429 and
                an OpenAI error body (code "too_many_sessions"), before the WebSocket is accepted
    slot        a session holds its route's slot until its handler returns, however it ends (client close,
                idle close, an exception: logged, then a `server_error` event and close code 1011)
    messages    a text message must be a JSON object with a string "type", of at most `max_message_bytes`
                (UTF-8); anything else is answered with an `error` event naming the field, and the session
                goes on (`receive` reads the next message); `receive` yields to the event loop before each
                message, so a burst of buffered events never holds up other requests
    idle        no message either way for `idle_timeout_s`: the server closes the session (code 1000,
                reason "idle timeout"), and `receive` returns None
    metrics     omnimtp_websocket_sessions{route, status} (accepted | too_many_sessions; refused keys count
                as unauthorized), omnimtp_websocket_active_sessions{route},
                omnimtp_websocket_error_events{route, code}

Error events have OpenAI's Realtime shape: `{"type": "error", "event_id", "error": {"type", "code",
"message", "param", "event_id"}}`, the last `event_id` being that of the client event that caused it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnimtp.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_SESSION_BYTES,
    DEFAULT_MAX_SESSION_ITEMS,
    DEFAULT_MAX_WEBSOCKET_SESSIONS,
    DEFAULT_WEBSOCKET_IDLE_TIMEOUT_S,
)
from omnimtp.server.errors import APIError
from omnimtp.server.guard import KEY_SUBPROTOCOL, THREAD_PARSE_BYTES, deny, parse_json
from omnimtp.server.metrics import ServerMetrics

logger = logging.getLogger("omnimtp.server")

# The close code and reason of a session that was idle too long (1000: a normal closure, the server's choice).
IDLE_CLOSE_CODE = 1000
IDLE_CLOSE_REASON = "idle timeout"


@dataclass(frozen=True)
class WebSocketLimits:
    """What a WebSocket route allows. max_sessions: open sessions per route (more are refused with HTTP 429
    on the upgrade). idle_timeout_s: a session with no message either way this long is closed.
    max_message_bytes: the largest client message (UTF-8 bytes of its text); larger ones get an `error` event.
    max_session_items / max_session_bytes: the most conversation items a realtime session holds, and the bytes
    of their content in memory."""

    max_sessions: int = DEFAULT_MAX_WEBSOCKET_SESSIONS
    idle_timeout_s: float = DEFAULT_WEBSOCKET_IDLE_TIMEOUT_S
    max_message_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_session_items: int = DEFAULT_MAX_SESSION_ITEMS
    max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES

    def __post_init__(self):
        for name in ("max_sessions", "max_message_bytes", "max_session_items", "max_session_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        seconds = self.idle_timeout_s
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds <= 0:
            raise ValueError(f"idle_timeout_s must be a finite number of seconds > 0, got {seconds!r}")


# The most characters of a client's value an error event repeats (an unknown event type may be megabytes).
MAX_ECHO_CHARS = 128


def echo(value: str) -> str:
    """`value` quoted for an error message, cut to MAX_ECHO_CHARS characters."""
    if len(value) <= MAX_ECHO_CHARS:
        return repr(value)
    return f"{value[:MAX_ECHO_CHARS]!r}... ({len(value)} characters)"


class EventError(Exception):
    """A client event the server cannot act on: it leaves as an `error` event (`Session.send_error`) and the
    session goes on. param: the field at fault ("session.voice", "item.content.0.audio"), or None."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value",
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.type = type


def new_id(prefix: str) -> str:
    """A fresh server-side id: "event_1f3c...", "sess_...", "item_..." (OpenAI's prefixes)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Session:
    """One accepted WebSocket session: JSON events in (`receive`) and out (`send`, `send_error`). `send` may
    be called from several tasks (a response streaming while the receive loop answers errors): each event
    goes out whole."""

    def __init__(self, websocket: WebSocket, route: str, limits: WebSocketLimits, metrics: ServerMetrics):
        self.websocket = websocket
        self.route = route
        self.limits = limits
        self.metrics = metrics
        self.is_closed = False
        self._send_lock = asyncio.Lock()
        self._last_active = asyncio.get_running_loop().time()

    async def receive(self) -> dict | None:
        """The next client event: a JSON object whose "type" is a string. None once the client has closed the
        session, or the server has closed it after `idle_timeout_s` without a message either way. A message
        that is not such an object is answered with an `error` event and skipped."""
        loop = asyncio.get_running_loop()
        while not self.is_closed:
            # a burst of buffered messages is read without suspending: yield once per message, so other requests
            # (`/health`, other sessions) run between them
            await asyncio.sleep(0)
            try:
                async with asyncio.timeout_at(self._last_active + self.limits.idle_timeout_s):
                    message = await self.websocket.receive()
            except TimeoutError:
                if loop.time() < self._last_active + self.limits.idle_timeout_s:
                    continue  # an event went out meanwhile
                await self.close(IDLE_CLOSE_CODE, IDLE_CLOSE_REASON)
                return None
            self._last_active = loop.time()
            if message["type"] == "websocket.disconnect":
                self.is_closed = True
                return None
            try:
                return await self._parse(message)
            except EventError as exc:
                await self.send_error(exc)
        return None

    async def _parse(self, message) -> dict:
        text = message.get("text")
        if text is None:
            raise EventError("events are JSON text messages, not binary ones", code="invalid_event")
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > self.limits.max_message_bytes:
            raise EventError(f"the message is {num_bytes} bytes, over the limit of {self.limits.max_message_bytes}",
                             code="message_too_large")
        try:
            if num_bytes > THREAD_PARSE_BYTES:
                event = await run_in_threadpool(parse_json, text, "the event")
            else:
                event = parse_json(text, "the event")
        except APIError as exc:
            raise EventError(exc.message, param=exc.param, code=exc.code or "invalid_json") from None
        if not isinstance(event, dict):
            raise EventError(f"an event is a JSON object, got {type(event).__name__}", code="invalid_event")
        if not isinstance(event.get("type"), str):
            message = "type: required" if "type" not in event else "type: must be a string"
            raise EventError(message, param="type", code="missing_required_parameter" if "type" not in event
                             else "invalid_value")
        return event

    async def send(self, event: dict) -> bool:
        """Send one server event (an "event_id" is added when it has none). False when the session is closed
        (the event is dropped): a response still streaming after the client left ends quietly."""
        if self.is_closed:
            return False
        event = event if "event_id" in event else {"event_id": new_id("event"), **event}
        text = json.dumps(event, separators=(",", ":"))
        async with self._send_lock:
            try:
                await self.websocket.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):  # the client went away under the send
                self.is_closed = True
                return False
        self._last_active = asyncio.get_running_loop().time()
        return True

    async def send_error(self, error: EventError, client_event: dict | None = None) -> bool:
        """The `error` event for `error`, caused by `client_event` (its "event_id" is echoed when it has one)."""
        event_id = client_event.get("event_id") if isinstance(client_event, dict) else None
        if isinstance(event_id, str) and len(event_id) > MAX_ECHO_CHARS:
            event_id = None  # not the client's id any more once cut; an error event stays small
        self.metrics.websocket_error_events.labels(route=self.route, code=error.code).inc()
        return await self.send({"type": "error", "error": {
            "type": error.type, "code": error.code, "message": error.message, "param": error.param,
            "event_id": event_id if isinstance(event_id, str) else None}})

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close the session (idempotent)."""
        if self.is_closed:
            return
        self.is_closed = True
        if self.websocket.application_state is WebSocketState.CONNECTED:
            try:
                await self.websocket.close(code, reason)
            except (RuntimeError, OSError):
                pass


class WebSocketSessions:
    """The server's WebSocket sessions (`app.state.websockets`): the limits, each route's open-session count,
    and the metrics."""

    def __init__(self, limits: WebSocketLimits, metrics: ServerMetrics):
        self.limits = limits
        self.metrics = metrics
        self._num_open: dict[str, int] = {}

    def num_open(self, route: str) -> int:
        return self._num_open.get(route, 0)

    async def serve(self, websocket: WebSocket, route: str, handler: Callable[[Session], Awaitable[None]]) -> None:
        """Run `handler(session)` on `websocket` accepted as a session of `route`, holding the route's slot until
        it returns, however it ends; then the session is closed if the handler left it open. Over the route's
        `max_sessions` the upgrade is refused with HTTP 429 (an OpenAI error body, code "too_many_sessions") and
        the handler does not run. An exception the handler raises is logged and ends the session with a
        `server_error` event and close code 1011."""
        if self.num_open(route) >= self.limits.max_sessions:
            self.metrics.websocket_sessions.labels(route=route, status="too_many_sessions").inc()
            await deny(websocket, APIError(
                429, f"too many open sessions on {route} ({self.limits.max_sessions}); retry later",
                type="rate_limit_exceeded", code="too_many_sessions"))
            return
        self._num_open[route] = self.num_open(route) + 1
        self.metrics.websocket_active_sessions.labels(route=route).set(self._num_open[route])
        session = Session(websocket, route, self.limits, self.metrics)
        try:
            await websocket.accept(subprotocol=chosen_subprotocol(websocket.scope.get("subprotocols", ())))
            self.metrics.websocket_sessions.labels(route=route, status="accepted").inc()
            try:
                await handler(session)
            except Exception:
                logger.exception("unhandled error in a %s session", route)
                await session.send_error(EventError("internal server error", code="server_error", type="server_error"))
                await session.close(1011, "internal server error")
        finally:
            self._num_open[route] -= 1
            self.metrics.websocket_active_sessions.labels(route=route).set(self._num_open[route])
            await session.close()


def chosen_subprotocol(offered) -> str | None:
    """The subprotocol the server answers with: the first one the client offered that is not the API key (a
    browser drops a connection whose answer names none of those it offered, so "realtime" is echoed)."""
    for protocol in offered:
        if protocol.partition(".")[0] != KEY_SUBPROTOCOL:
            return protocol
    return None


def websocket_sessions(websocket: WebSocket) -> WebSocketSessions:
    """The app's `WebSocketSessions` (set by `create_app`)."""
    return websocket.app.state.websockets
