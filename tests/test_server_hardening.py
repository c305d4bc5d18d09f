"""The server's smaller guarantees: JSON routes take only application/json (415), no trailing-slash
redirects (404), booleans are not numbers, a declared over-limit body is a 413 at once, and the embedded
model's default caps are the pipeline's."""

from __future__ import annotations

import http.client
import socket
import time

import httpx
import pytest
from server_harness import exchange, running_server

from omnimtp.pipeline import OmniPipeline
from omnimtp.server.app import create_app
from omnimtp.server.build import build_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_BODY_BYTES = 64 * 1024
CHAT = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'
SPEECH = b'{"input": "Hi", "voice": "ethan"}'


@pytest.fixture(scope="module")
def engine():
    return build_engine(None, max_batch_size=2, max_frames=None)  # what `omnimtp serve` runs without --model


@pytest.fixture(scope="module")
def server(engine):
    with running_server(create_app(engine, max_body_bytes=MAX_BODY_BYTES)) as url:
        yield url


def _connection(url: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/audio/speech", SPEECH)])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                          "application/jsonx"])
def test_json_routes_take_only_json(server, path, body, content_type):
    conn = _connection(server)
    headers = {} if content_type is None else {"Content-Type": content_type}
    conn.putrequest("POST", path)
    for name, value in {**headers, "Content-Length": str(len(body))}.items():
        conn.putheader(name, value)
    conn.endheaders(body)
    response = conn.getresponse()
    error = httpx.Response(response.status, content=response.read()).json()["error"]
    assert response.status == 415 and error["code"] == "unsupported_media_type", content_type
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=UTF-8"])
def test_json_with_or_without_a_utf8_charset_is_read(server, content_type):
    reply = exchange(_connection(server), "POST", "/v1/chat/completions", CHAT, {"Content-Type": content_type})
    assert reply.status == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions/", "/v1/audio/speech/", "/v1/models/", "/health/"])
def test_a_trailing_slash_is_not_found_never_redirected(server, path):
    reply = exchange(_connection(server), "POST" if "audio" in path or "chat" in path else "GET", path, CHAT,
                     {"Host": "evil.example"})
    assert reply.status == 404 and "location" not in reply.headers
    assert reply.error()["type"] == "not_found_error"


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", "n"), ("/v1/audio/speech", "speed"),
                                         ("/v1/chat/completions", "temperature"), ("/v1/audio/speech", "top_k")])
def test_booleans_are_not_numbers(server, path, field):
    body = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"input": "Hi", "voice": "ethan"}
    response = httpx.post(f"{server}{path}", json={**body, field: True}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


@pytest.mark.parametrize("is_chunked", [False, True])
def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(server, is_chunked):
    exact = CHAT + b" " * (MAX_BODY_BYTES - len(CHAT))  # JSON whitespace: still the same request
    for body, status in ((exact, 200), (exact + b" ", 413)):
        conn = _connection(server)
        headers = {"Content-Type": "application/json"}
        if is_chunked:
            conn.request("POST", "/v1/chat/completions", body=iter([body[:1000], body[1000:]]), headers=headers,
                         encode_chunked=True)
        else:
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = conn.getresponse()
        assert response.status == status, (len(body), response.read()[:300])
        response.read()
        conn.close()


def test_a_declared_over_limit_body_is_refused_at_once(server):
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())  # and no body
        started = time.monotonic()
        data = b""
        while b"}}" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 413") and b"request_too_large" in data, data
    assert b"connection: close" in data.lower()
    assert time.monotonic() - started < 2.0  # not the 30 s body timeout


def test_the_embedded_model_has_one_default_cap_for_pipeline_and_server(engine, server):
    pipe = OmniPipeline.tiny()
    assert (engine.config.max_new_tokens, engine.config.max_frames) == (
        pipe.config.max_new_tokens, pipe.config.max_frames) == (32, 100)  # the README's caps
    prompt = "Tell me a long story"
    expected = pipe.generate(prompt, max_frames=2)
    assert expected.thinker_finish_reason == "length"  # the greedy tiny thinker runs to its cap
    response = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": prompt}], "temperature": 0})  # no max_tokens
    reply = response.json()
    assert reply["usage"]["completion_tokens"] == len(expected.text_ids) == 32
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert reply["choices"][0]["finish_reason"] == "length"


def test_streams_cut_at_the_shutdown_deadline_end_with_an_error_event(caplog):
    """A stream still running when the graceful shutdown deadline comes ends with an error event and
    [DONE] (a complete chunked body), one log line says so, and uvicorn has no task left to cancel."""
    import threading

    import uvicorn
    from server_harness import free_port

    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.server.scheduler import Engine
    from omnimtp.server.serving import server_config

    engine = Engine(Qwen3OmniFamily.tiny(0), max_frames=100_000, max_batch_size=2, cuts_runaway=False)  # runs on
    port = free_port()
    server = uvicorn.Server(server_config(create_app(engine), port=port, graceful_shutdown_timeout_s=1.5,
                                          log_level="info"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "seed": 1,
            "temperature": 0}
    with caplog.at_level("INFO"), httpx.Client(timeout=60) as http:
        with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.should_exit = True  # SIGTERM's path: graceful shutdown starts now
            rest = [line for line in lines if line.startswith("data: ")]  # a truncated body would raise here
        thread.join(30)
    assert not thread.is_alive()
    assert rest[-1] == "data: [DONE]"
    error = httpx.Response(200, content=rest[-2][6:]).json()["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    messages = [record.getMessage() for record in caplog.records]
    assert any("ending 1 unfinished request(s)" in message for message in messages)
    assert not any("Cancel" in message and "running task" in message for message in messages)
    assert not any(record.exc_info for record in caplog.records)
