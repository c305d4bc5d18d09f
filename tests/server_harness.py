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
