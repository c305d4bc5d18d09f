"""The server against hostile or broken clients, on a real uvicorn server on 127.0.0.1: every bad
input is a 4xx naming its field (never a 5xx), an unexpected error is a 500 that closes its
connection, slow clients are cut off by the timeouts, SIGTERM ends within its deadline, and a client
that leaves cancels its request (streamed or not, queued or running), counted in the metrics."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_harness import exchange, free_port, running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.models.tiny import tiny_qwen3_omni
from omnimtp.server.app import check_api_key, create_app
from omnimtp.server.scheduler import Engine
from omnimtp.server.serving import server_config
from omnimtp.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

API_KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ALIAS = "my-speech-model"
CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen3_omni(0), byte_tokenizer()


def _engine(tiny, *, max_frames=4, max_batch_size=4, **engine_kwargs) -> Engine:
    return Engine(Qwen3OmniFamily(*tiny), max_frames=max_frames, first_chunk_frames=2, chunk_frames=3,
                  max_batch_size=max_batch_size, **engine_kwargs)


@pytest.fixture(scope="module")
def server(tiny):
    app = create_app(_engine(tiny), api_key=API_KEY, max_tokens_limit=8, served_model_names=[ALIAS],
                     max_body_bytes=1 << 20)
    with running_server(app) as url:
        yield url


def _connection(url: str, timeout: float = 60.0) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def _json(body) -> bytes:
    return json.dumps(body).encode()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def _chat(content="Hi", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, **fields}


_OK_CHAT = _json(_chat())
_EMOJI = "\U0001F600"  # 4 UTF-8 bytes, 4 byte-tokenizer tokens, 1 character

# (name, path, raw body, extra headers, status, param, code)
_CASES = [
    ("prompt over the token limit (chat)", CHAT, _json(_chat(_EMOJI * 2100)), {}, 400, "messages",
     "context_length_exceeded"),
    ("prompt over the token limit (speech, 4096 characters)", SPEECH, _json({"input": _EMOJI * 4096, "voice": "ethan"}),
     {}, 400, "input", "context_length_exceeded"),
    ("seed 2**63", CHAT, _json(_chat(seed=2**63)), {}, 400, "seed", "invalid_value"),
    ("seed -2**63 - 1", CHAT, _json(_chat(seed=-(2**63) - 1)), {}, 400, "seed", "invalid_value"),
    ("seed 10**30 (speech)", SPEECH, _json({"input": "Hi", "voice": "ethan", "seed": 10**30}), {}, 400, "seed",
     "invalid_value"),
    ("lone surrogate in content", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', {}, 400,
     "messages.0.content", "invalid_value"),
    ("lone low surrogate in a text part", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', {}, 400,
     "messages.0.content.0.text", "invalid_value"),
    ("lone surrogate in speech input", SPEECH, b'{"input": "\\udbff", "voice": "ethan"}', {}, 400, "input",
     "invalid_value"),
    ("lone surrogate in a key", CHAT, b'{"\\ud800": 1, "messages": []}', {}, 400, None, "invalid_value"),
    ("UTF-8-encoded surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', {}, 400, None,
     "invalid_json"),
    ("invalid UTF-8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', {}, 400, None, "invalid_json"),
    ("nesting 100000 deep", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, 400, None,
     "structure_too_large"),
    ("body over the 1 MiB limit", CHAT, _json(_chat("x" * (1 << 20))), {}, 413, None, "request_too_large"),
    ("a 5000-digit integer", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": ' + b"9" * 5000
     + b"}", {}, 400, None, "invalid_json"),
    ("NaN temperature", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', {}, 400,
     "temperature", "invalid_value"),
    ("1e999 temperature", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}', {}, 400,
     "temperature", "invalid_value"),
    ("Infinity top_p (speech)", SPEECH, b'{"input": "Hi", "voice": "ethan", "top_p": Infinity}', {}, 400, "top_p",
     "invalid_value"),
    ("non-ASCII bearer token", CHAT, _OK_CHAT, {"Authorization": "Bearer sekrit-k\u00e9y".encode()}, 401, None,
     "invalid_api_key"),
    ("invalid UTF-8 bearer token", CHAT, _OK_CHAT, {"Authorization": b"Bearer \xff\xfe"}, 401, None,
     "invalid_api_key"),
    ("no bearer token", CHAT, _OK_CHAT, {"Authorization": b""}, 401, None, "invalid_api_key"),
    ("unknown model", CHAT, _json(_chat(model="gpt-4o")), {}, 404, "model", "model_not_found"),
    ("path-like model", CHAT, _json(_chat(model="../../etc/passwd")), {}, 404, "model", "model_not_found"),
    ("unknown model (speech)", SPEECH, _json({"model": "tts-1", "input": "Hi", "voice": "ethan"}), {}, 404, "model",
     "model_not_found"),
    ("audio without the audio modality", CHAT, _json(_chat(audio={"voice": "ethan", "format": "wav"})), {}, 400,
     "audio", "invalid_value"),
    ("file content part", CHAT,
     _json(_chat([{"type": "text", "text": "What is this?"}, {"type": "file", "file": {"file_id": "x"}}])), {},
     400, "messages.0.content.1", "invalid_value"),
    ("video_url content part", CHAT,
     _json(_chat([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}])), {}, 400,
     "messages.0.content.0", "invalid_value"),
]
# What the messages must say, beyond naming the field.
_MESSAGES = {
    "NaN temperature": "finite", "1e999 temperature": "finite", "Infinity top_p (speech)": "finite",
    "file content part": "'file' found using 'type'", "unknown model": "gpt-4o",
    "video_url content part": "'video_url' found using 'type'", "nesting 100000 deep": "JSON objects and arrays",
}


@pytest.mark.parametrize("name,path,body,headers,status,param,code", _CASES, ids=[case[0] for case in _CASES])
def test_client_input_gets_a_4xx_naming_the_field(server, name, path, body, headers, status, param, code):
    conn = _connection(server)
    try:
        reply = exchange(conn, "POST", path, body, {**AUTH, **headers})
        assert reply.status == status, reply.body[:500]
        error = reply.error()
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
        assert _MESSAGES.get(name, "") in error["message"]
        # the same connection (or, where the server said it closes, a new one) serves the next request
        assert exchange(conn, "POST", CHAT, _OK_CHAT, AUTH).status == 200
    finally:
        conn.close()


@pytest.mark.parametrize("name,path,body", [
    ("seed 2**63 - 1", CHAT, _chat(seed=2**63 - 1)),
    ("seed -2**63", CHAT, _chat(seed=-(2**63))),
    ("seed -2**63 (speech)", SPEECH, {"input": "Hi", "voice": "ethan", "seed": -(2**63), "response_format": "pcm"}),
    ("the model's id", CHAT, _chat(model="omnimtp-tiny")),
    ("an alias", SPEECH, {"model": ALIAS, "input": "Hi", "voice": "ethan", "response_format": "pcm"}),
])
def test_edge_values_that_are_valid_succeed(server, name, path, body):
    conn = _connection(server)
    try:
        reply = exchange(conn, "POST", path, _json(body), AUTH)
        assert reply.status == 200, reply.body[:500]
        if path == CHAT:
            assert json.loads(reply.body)["model"] == body.get("model", "omnimtp-tiny")
        else:
            assert len(reply.body) > 0
    finally:
        conn.close()


def test_models_lists_the_aliases(server):
    listed = httpx.get(f"{server}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert [model["id"] for model in listed] == ["omnimtp-tiny", ALIAS]


def test_api_key_checks():
    for bad in ("", "sekrit-k\u00e9y", "two words", "tab\tkey"):
        with pytest.raises(ValueError, match="api_key"):
            check_api_key(bad)
    check_api_key(None)
    check_api_key("sk-" + "A" * 40)


def test_create_app_checks_its_arguments(tiny):
    engine = _engine(tiny)
    with pytest.raises(ValueError, match="api_key"):
        create_app(engine, api_key="sekrit-k\u00e9y")
    with pytest.raises(ValueError, match="body_timeout_s"):
        create_app(engine, body_timeout_s=float("nan"))
    with pytest.raises(ValueError, match="served_model_names"):
        create_app(engine, served_model_names="alias")
    with pytest.raises(ValueError, match="served_model_names"):
        create_app(engine, served_model_names=[""])
    with pytest.raises(ValueError, match="headers_timeout_s"):
        server_config(create_app(engine), headers_timeout_s=0)


def test_unexpected_error_is_a_500_that_closes_its_connection(tiny):
    engine = _engine(tiny)
    real_request_ids = engine.prompt_ids

    def failing_on_boom(request):
        if request.messages is not None and request.messages[-1][1] == "boom":
            raise RuntimeError("a bug")
        return real_request_ids(request)

    engine.prompt_ids = failing_on_boom
    with running_server(create_app(engine)) as url:
        conn = _connection(url)
        try:
            failed = exchange(conn, "POST", CHAT, _json(_chat("boom")))
            assert failed.status == 500 and failed.will_close and failed.headers["connection"] == "close"
            assert failed.error()["type"] == "server_error" and "a bug" not in failed.body.decode()
            assert exchange(conn, "POST", CHAT, _OK_CHAT).status == 200
        finally:
            conn.close()
        assert _metric(url, 'omnimtp_requests_total{route="/v1/chat/completions",status="500"}') == 1


# -- timeouts ----------------------------------------------------------------------------------------


def _trickle(url: str, head: bytes, drip: bytes, *, interval=0.05, limit_s=10.0) -> tuple[bytes, float]:
    """Send `head`, then one byte of `drip` per interval until the server answers or closes; read
    to EOF. Returns (everything the server sent, seconds from the first byte to EOF)."""
    parts = urlsplit(url)
    started = time.monotonic()
    with socket.create_connection((parts.hostname, parts.port), timeout=limit_s) as sock:
        sock.sendall(head)
        for byte in drip:
            if time.monotonic() - started > limit_s:
                raise AssertionError(f"the server kept a trickling client for over {limit_s} s")
            readable, _, _ = select.select([sock], [], [], interval)
            if readable:
                break
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
        received = _recv_all(sock)
    return received, time.monotonic() - started


def _recv(sock) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


@pytest.fixture(scope="module")
def impatient_server(tiny):
    app = create_app(_engine(tiny), body_timeout_s=0.5)
    with running_server(app, headers_timeout_s=0.5, keep_alive_timeout_s=0.5) as url:
        yield url


def test_slow_headers_are_cut_off_with_408(impatient_server):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    received, elapsed = _trickle(impatient_server, head, b"X-Slow: " + b"a" * 1000)
    assert received.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in received.lower() and b'"request_timeout"' in received
    assert 0.4 < elapsed < 3.0


def test_an_idle_connection_is_closed(impatient_server):
    parts = urlsplit(impatient_server)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        started = time.monotonic()
        assert _recv(sock) == b""  # nothing sent: closed without a response
        assert 0.4 < time.monotonic() - started < 3.0


def test_slow_body_is_cut_off_with_408(impatient_server):
    body = _OK_CHAT
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    received, elapsed = _trickle(impatient_server, head, body)
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert 0.4 < elapsed < 3.0


def test_keep_alive_timeout_closes_an_idle_connection_and_fast_clients_are_served(impatient_server):
    conn = _connection(impatient_server)
    try:
        reply = exchange(conn, "POST", CHAT, _OK_CHAT)
        assert reply.status == 200 and not reply.will_close
        started = time.monotonic()
        assert _recv(conn.sock) == b""  # the server closed the idle connection
        assert 0.3 < time.monotonic() - started < 3.0
    finally:
        conn.close()


def test_sigterm_with_a_half_sent_body_exits_within_the_deadline():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    env.pop("OMNIMTP_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "omnimtp.cli", "serve", "--eager", "--port", str(port), "--max-frames", "4",
         "--timeout-graceful-shutdown", "1", "--timeout-body", "300", "--timeout-headers", "300",
         "--log-level", "warning"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        _wait_for(lambda: _is_up(port) or process.poll() is not None, timeout=180, what="the server starting")
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"messages\": [")
            time.sleep(0.3)  # the request task is waiting for the rest of the body
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
            elapsed = time.monotonic() - started
        assert elapsed < 1 + 8, f"took {elapsed:.1f} s to exit after SIGTERM (graceful deadline 1 s)"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        process.stderr.close()


def _is_up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _recv_all(sock) -> bytes:
    received = b""
    while chunk := _recv(sock):
        received += chunk
    return received


# (An API key nobody can use is refused before anything loads: tests/test_cli.py.)


# -- disconnect = cancel ---------------------------------------------------------------------------


def _send_and_hold(url: str, path: str, body: dict) -> socket.socket:
    """A non-streaming request whose client then waits (and, when the socket closes, leaves)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = _json(body)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return sock


def test_non_streaming_disconnects_cancel_running_and_queued_requests(tiny):
    """One slot, a queue of one: a running FLAC speech request and a queued non-streaming audio chat
    are cancelled when their clients leave (slot and queue place freed long before the 3000 frames
    they asked for), each counted; the full queue's 429 says when to retry."""
    engine = _engine(tiny, max_frames=3000, max_batch_size=1, cuts_runaway=False)  # runs until cancelled
    long_speech = {"input": "A long one", "voice": "ethan", "response_format": "flac"}
    long_chat = _chat("Talk", max_tokens=2, modalities=["text", "audio"], audio={"voice": "aiden", "format": "wav"})
    with running_server(create_app(engine, max_queue=1)) as url:
        running = _send_and_hold(url, SPEECH, long_speech)
        _wait_for(lambda: _metric(url, "omnimtp_active_requests") == 1, what="the speech request running")
        queued = _send_and_hold(url, CHAT, long_chat)
        _wait_for(lambda: _metric(url, "omnimtp_queue_depth") == 1, what="the chat request queued")
        full = httpx.post(f"{url}{SPEECH}", json={"input": "Hi", "voice": "ethan"}, timeout=30)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert int(full.headers["retry-after"]) >= 1

        queued.close()
        _wait_for(lambda: _metric(url, "omnimtp_cancelled_requests_total") == 1, timeout=20,
                  what="the queued request counted as cancelled")
        assert _metric(url, "omnimtp_queue_depth") == 0 and _metric(url, "omnimtp_active_requests") == 1

        running.close()
        _wait_for(lambda: _metric(url, "omnimtp_cancelled_requests_total") == 2, timeout=20,
                  what="the running request counted as cancelled")
        _wait_for(lambda: _metric(url, "omnimtp_active_requests") == 0, timeout=20, what="the slot freed")
        assert _metric(url, "omnimtp_frames_per_second_count") == 0, "a cancelled request ran to its end"
        served = httpx.post(f"{url}{CHAT}", json=_chat(), timeout=60)
        assert served.status_code == 200


def test_an_unparsable_request_gets_its_400_without_a_connection_reset(tiny):
    """A header h11 refuses (a NUL byte) gets a 400 with an OpenAI-style body, and the connection closes
    only after the client has read it: a close with the client's bytes still arriving would reset it."""
    with running_server(create_app(_engine(tiny))) as url:
        for _ in range(40):
            conn = _connection(url)
            try:
                reply = exchange(conn, "POST", CHAT, _json(_chat()), {"Authorization": b"\x00bad"})
            finally:
                conn.close()
            assert reply.status == 400 and reply.will_close
            assert reply.error()["code"] == "invalid_http_request"
