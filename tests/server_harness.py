"""A real server on 127.0.0.1 (free port) in a background thread, for the server tests: the same
uvicorn config `omnimtp serve` runs (`server_config`), with its timeouts as keyword arguments."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time

import uvicorn

from omnimtp.server.serving import server_config


class EngineSetup:
    """A model family and the engine settings a test runs it with; `engine(**overrides)` makes an Engine."""

    def __init__(self, family, **config):
        self.family = family
        self.config = config

    @classmethod
    def tiny(cls, seed: int = 0, **config) -> EngineSetup:
        from omnimtp.families.qwen3_omni import Qwen3OmniFamily

        return cls(Qwen3OmniFamily.tiny(seed), **config)

    def engine(self, **overrides):
        from omnimtp.server.scheduler import Engine

        return Engine(self.family, **{**self.config, **overrides})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(app, timeout: float = 60.0, **timeouts):
    """Serve `app` until the block ends; yields the base URL (http://127.0.0.1:PORT). `timeouts`:
    `server_config`'s headers_timeout_s, keep_alive_timeout_s, graceful_shutdown_timeout_s."""
    port = free_port()
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port, log_level="warning", **timeouts))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lowercase names
    body: bytes
    will_close: bool  # the server said `Connection: close` (or spoke HTTP/1.0)

    def error(self) -> dict:
        """The OpenAI error object of the body."""
        return json.loads(self.body)["error"]


def exchange(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None) -> Reply:
    """One request on `conn` with exactly these body bytes (http.client sends header values given as
    bytes unchanged), its whole response read. The connection stays open unless the server said it
    closes, so a following request on `conn` fails if the server dropped it without saying so."""
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=body, headers=all_headers)
    response = conn.getresponse()
    data = response.read()
    return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, data, response.will_close)


def pause_with_full_queue(engine, request) -> None:
    """A started engine (--max-queue 1) paused with `request` (an `EngineRequest`) waiting: its queue is full and it
    takes no step, so whatever the server does next runs alone (a refusal's cost, what a full server answers)."""
    import asyncio

    engine._core.has_ready_work = lambda: False  # the engine thread sleeps until told of work, and finds none
    engine.submit(request, loop=asyncio.new_event_loop())  # (its handle is never pushed to)


# A client that floods a server: requests sent one after another on one keep-alive connection (raw HTTP/1.1, so the
# client's own cost stays small), each answer read and its status checked, until `n` were sent or `seconds` went by.
# It prints "ready", waits for a line on stdin, then floods and prints how many it sent.
# argv: url path body (JSON; "null": a GET without a body) n seconds expected-status
FLOOD_CLIENT = r"""
import socket, sys, time
from urllib.parse import urlparse
url, path, body, n, seconds, expected = sys.argv[1:7]
host, body, n = urlparse(url), body.encode(), int(n)
request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body if body != b"null" else (
           f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").encode()
sock = socket.create_connection((host.hostname, host.port))
reader = sock.makefile("rb")
sys.stdout.write("ready\n"); sys.stdout.flush(); sys.stdin.readline()
sent, end = 0, time.perf_counter() + float(seconds)
while sent < n and time.perf_counter() < end:
    sock.sendall(request)
    status, length = reader.readline().split()[1].decode(), 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        length = int(value) if name.lower() == "content-length" else length
    reader.read(length)
    sent += 1
    assert status == expected, f"answered {status}, not {expected}"
print(sent)
"""


def start_flood(url: str, path: str, body, *, n: int = 10**9, seconds: float = 1e9, expected: str = "429"):
    """A `FLOOD_CLIENT` process, ready: write a line to its stdin to start it; its stdout then says how many it
    sent."""
    import json
    import subprocess
    import sys

    client = subprocess.Popen([sys.executable, "-c", FLOOD_CLIENT, url, path, json.dumps(body), str(n), str(seconds),
                               expected], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if client.stdout.readline().strip() != "ready":
        raise RuntimeError("the flood client did not start")
    return client
