"""The HTTP server around the app: uvicorn's h11 server with the timeouts a public endpoint needs.

    headers     a request's headers must arrive within headers_timeout_s of its first byte (or of the
                connection opening): 408 and the connection closes (here, in the protocol)
    body        the body within body_timeout_s of the headers: 408 (the app's `Guard`)
    keep-alive  an idle connection closes after keep_alive_timeout_s (uvicorn)
    shutdown    on SIGTERM/SIGINT new connections are refused and running requests get
                graceful_shutdown_timeout_s to finish; just before that deadline the app ends the ones
                still running with an error (a stream's last event; `ShutdownDeadline`), so uvicorn has
                no task left to cancel
    access log  a full server's 429s are logged one line every few seconds, with how many were left out
                (`RefusalLogThrottle`): clients that ignore Retry-After never make a storm of log lines

`server_config` is the one place these are put together: `omnimtp serve` and the tests use it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from omnimtp.limits import (
    DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
    DEFAULT_HEADERS_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    check_seconds,
)

_LINGER_S = 2.0  # how long a connection closing after an error response keeps reading (and discarding)
_REFUSAL_LOG_INTERVAL_S = 10.0


class RefusalLogThrottle(logging.Filter):
    """uvicorn's access log lines of 429 answers (a full queue's refusals) at most one every interval_s; the line
    that goes out says how many were left out before it. Other lines all go out. The refusals are counted in
    /metrics (`omnimtp_requests_total`) all the same."""

    def __init__(self, interval_s: float = _REFUSAL_LOG_INTERVAL_S):
        super().__init__()
        self.interval_s = interval_s
        self._next_at = 0.0
        self._num_left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and args and args[-1] == 429):
            return True
        now = time.monotonic()
        if now < self._next_at:
            self._num_left_out += 1
            return False
        if self._num_left_out:
            record.msg = f"{record.msg} ({self._num_left_out} more 429s since the last such line)"
        self._next_at, self._num_left_out = now + self.interval_s, 0
        return True


class ShutdownDeadline:
    """What happens just before the graceful shutdown deadline: uvicorn would cancel the tasks of running
    requests (a stream then ends as an incomplete chunked body, with a traceback in the log), so
    `on_deadline` (the app's `state.on_shutdown_deadline`: ending every request with an error event) runs
    first, `margin_s` before it. `start` is called by each connection when shutdown begins; the first starts
    the clock."""

    def __init__(self, graceful_shutdown_timeout_s: float, on_deadline):
        self.delay_s = max(graceful_shutdown_timeout_s - min(1.0, graceful_shutdown_timeout_s / 2), 0.0)
        self.on_deadline = on_deadline
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is None and self.on_deadline is not None:
            self._timer = loop.call_later(self.delay_s, self.on_deadline)


class HeadersTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers. The timer starts when a
    connection opens and when the first byte of a later request arrives (uvicorn's keep-alive timer
    covers the wait before it), and stops once h11 has the whole request head. A client that opened
    a connection and sent nothing is closed silently, one that began a request gets a 408."""

    def __init__(self, *args, headers_timeout_s: float, shutdown_deadline: ShutdownDeadline | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.headers_timeout_s = headers_timeout_s
        self.shutdown_deadline = shutdown_deadline
        self._headers_timer: asyncio.TimerHandle | None = None
        self._is_closing = False  # an error response went out: what the client still sends is discarded

    def connection_made(self, transport) -> None:
        self._raw_transport = transport
        super().connection_made(_LingeringTransport(transport, self))
        self._start_headers_timer()

    def data_received(self, data: bytes) -> None:
        if self._is_closing:
            return
        if self._headers_timer is None and self.conn.their_state is h11.IDLE:
            self._start_headers_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._stop_headers_timer()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """The WebSocket protocol takes the raw transport: h11 still counts the upgrade request's (empty) body as
        unread, so the lingering close would half-close the socket under the WebSocket's own close frames."""
        self._stop_headers_timer()
        self.transport = self._raw_transport
        super().handle_websocket_upgrade(event)

    def shutdown(self) -> None:
        if self.shutdown_deadline is not None:
            self.shutdown_deadline.start(self.loop)
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_headers_timer()
        super().connection_lost(exc)

    def _start_headers_timer(self) -> None:
        self._headers_timer = self.loop.call_later(self.headers_timeout_s, self._on_headers_timeout)

    def _stop_headers_timer(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _on_headers_timeout(self) -> None:
        self._headers_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        received, _ = self.conn.trailing_data
        if received and self.conn.our_state is h11.IDLE:
            message = f"the request headers did not arrive within {self.headers_timeout_s:g} s"
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": "request_timeout"}}).encode()
            headers = [("content-type", "application/json"), ("content-length", str(len(body))),
                       ("connection", "close")]
            output = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            output += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
            self.transport.write(output)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a NUL in a header, ...): 400 with an OpenAI-style body, then a
        lingering close. Closing the socket at once while the client's bytes still arrive makes the
        kernel send a reset, which can destroy the response before the client reads it; so the write
        side shuts down first, further bytes are discarded, and the socket closes when the client does
        (or after `_LINGER_S`)."""
        body = json.dumps({"error": {"message": "invalid HTTP request: " + msg, "type": "invalid_request_error",
                                     "param": None, "code": "invalid_http_request"}}).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(body))), ("connection", "close")]
        output = self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request"))
        output += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        self.transport.write(output)
        self.linger()

    def linger(self) -> None:
        """Close after a response while the client may still be sending (its body, or a request h11 cannot
        parse): the write side shuts down, what still arrives is discarded, and the socket closes when the
        client closes (or after `_LINGER_S`); closing at once would make the kernel reset the connection,
        which can destroy the response before the client reads it."""
        if self._is_closing:
            return
        self._is_closing = True
        self._stop_headers_timer()
        if self._raw_transport.can_write_eof():
            self._raw_transport.write_eof()
        self.loop.call_later(_LINGER_S, self._close_lingering)

    def _close_lingering(self) -> None:
        if not self._raw_transport.is_closing():
            self._raw_transport.close()


class _LingeringTransport:
    """A connection's transport whose `close` lingers (`HeadersTimeoutH11Protocol.linger`) when the client
    has not sent its whole request body: a response that went out early (413 on a declared Content-Length,
    401, 408) reaches the client instead of a reset."""

    def __init__(self, transport, protocol: HeadersTimeoutH11Protocol):
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._protocol.conn.their_state is h11.SEND_BODY and not self._transport.is_closing():
            self._protocol.linger()
        else:
            self._transport.close()


def server_config(
    app,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    headers_timeout_s: float = DEFAULT_HEADERS_TIMEOUT_S,
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    graceful_shutdown_timeout_s: float = DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
    log_level: str = "info",
) -> uvicorn.Config:
    """The uvicorn config that serves `app` (from `create_app`, which holds the body timeout).
    Run it with `uvicorn.Server(config).run()`."""
    graceful_shutdown_timeout_s = check_seconds("graceful_shutdown_timeout_s", graceful_shutdown_timeout_s)
    state = getattr(app, "state", None)
    on_deadline = getattr(state, "on_shutdown_deadline", None)
    websockets = getattr(state, "websockets", None)
    # The protocol drops a WebSocket message far over the app's limit unread (close 1009); one up to twice the
    # limit reaches the app, which answers with an `error` event and keeps the session.
    ws_max_size = 16 << 20 if websockets is None else 2 * websockets.limits.max_message_bytes
    protocol = functools.partial(
        HeadersTimeoutH11Protocol, headers_timeout_s=check_seconds("headers_timeout_s", headers_timeout_s),
        shutdown_deadline=ShutdownDeadline(graceful_shutdown_timeout_s, on_deadline),
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=check_seconds("keep_alive_timeout_s", keep_alive_timeout_s),
        timeout_graceful_shutdown=graceful_shutdown_timeout_s,
        ws_max_size=ws_max_size,
        lifespan="on",
        log_level=log_level,
    )
    access_log = logging.getLogger("uvicorn.access")  # (configured by the Config above)
    if not any(isinstance(f, RefusalLogThrottle) for f in access_log.filters):
        access_log.addFilter(RefusalLogThrottle())
    return config
