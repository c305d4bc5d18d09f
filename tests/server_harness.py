"""A real server on 127.0.0.1 (free port) in a background thread, for the server tests: the same
uvicorn config `omnimtp serve` runs (`server_config`), with its timeouts as keyword arguments."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from omnimtp.server.serving import server_config


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
