"""The WebSocket plumbing every WebSocket route shares (`omnimtp.server.websocket`), on a route of its own
that answers each client event with its type: the API key on the upgrade, the session limit and its slot
freed on close, bad messages answered with `error` events on a session that goes on, the idle timeout."""

from __future__ import annotations

import json
import time

import pytest
from server_harness import EngineSetup, running_server
from starlette.websockets import WebSocket
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from omnimtp.server.app import create_app
from omnimtp.server.websocket import IDLE_CLOSE_REASON, WebSocketLimits, websocket_sessions

KEY = "sk-test"
ROUTE = "/v1/echo"
MAX_MESSAGE_BYTES = 1024


async def _echo(session):
    while (event := await session.receive()) is not None:
        await session.send({"type": "echo", "of": event["type"]})


@pytest.fixture(scope="module")
def server():
    app = create_app(EngineSetup.tiny().engine(), api_key=KEY, websocket_limits=WebSocketLimits(
        max_sessions=2, idle_timeout_s=1.5, max_message_bytes=MAX_MESSAGE_BYTES))

    async def echo(websocket: WebSocket):
        await websocket_sessions(websocket).serve(websocket, ROUTE, _echo)

    app.add_api_websocket_route(ROUTE, echo)
    with running_server(app) as url:
        yield url.replace("http://", "ws://"), app


def _connect(server, key=KEY):
    url, _ = server
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return connect(url + ROUTE, additional_headers=headers, open_timeout=30)


def _recv(ws) -> dict:
    return json.loads(ws.recv(timeout=30))


def _wait_open(app, num: int) -> None:
    deadline = time.monotonic() + 10
    while app.state.websockets.num_open(ROUTE) != num:
        assert time.monotonic() < deadline, "the session slot was not freed"
        time.sleep(0.02)


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_the_api_key_is_checked_on_the_upgrade(server, key):
    with pytest.raises(InvalidStatus) as refused:
        _connect(server, key)
    response = refused.value.response
    assert response.status_code == 401
    assert json.loads(response.body)["error"]["code"] == "invalid_api_key"


def test_bad_messages_get_error_events_naming_the_field_and_the_session_goes_on(server):
    with _connect(server) as ws:
        cases = [
            ("{not json", None, "invalid_json"),
            ("[1, 2]", None, "invalid_event"),
            ('{"event_id": "evt_1"}', "type", "missing_required_parameter"),
            ('{"type": 3}', "type", "invalid_value"),
            ('{"type": "x", "text": "\\ud800"}', "text", "invalid_value"),
            (json.dumps({"type": "x", "pad": "a" * MAX_MESSAGE_BYTES}), None, "message_too_large"),
        ]
        for message, param, code in cases:
            ws.send(message)
            event = _recv(ws)
            assert event["type"] == "error" and event["event_id"], message
            assert (event["error"]["param"], event["error"]["code"]) == (param, code), message
        ws.send(b"\x00binary")
        assert _recv(ws)["error"]["code"] == "invalid_event"
        ws.send(json.dumps({"type": "ping"}))
        echoed = _recv(ws)
        assert (echoed["type"], echoed["of"]) == ("echo", "ping")


def test_a_session_over_the_limit_is_refused_and_a_closed_one_frees_its_slot(server):
    _, app = server
    _wait_open(app, 0)
    with _connect(server) as second:
        with _connect(server), pytest.raises(InvalidStatus) as refused:
            _connect(server)
        assert refused.value.response.status_code == 429
        assert json.loads(refused.value.response.body)["error"]["code"] == "too_many_sessions"
        _wait_open(app, 1)
        with _connect(server) as third:
            third.send(json.dumps({"type": "ping"}))
            assert _recv(third)["of"] == "ping"
        second.send(json.dumps({"type": "ping"}))
        assert _recv(second)["of"] == "ping"
    _wait_open(app, 0)


def test_an_idle_session_is_closed(server):
    _, app = server
    with _connect(server) as ws:
        time.sleep(0.8)
        ws.send(json.dumps({"type": "ping"}))  # activity restarts the clock
        assert _recv(ws)["of"] == "ping"
        started = time.monotonic()
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert 1.0 < time.monotonic() - started < 10
        assert closed.value.rcvd.code == 1000 and closed.value.rcvd.reason == IDLE_CLOSE_REASON
    _wait_open(app, 0)


def test_receive_yields_before_each_message():
    """Buffered messages are read without suspending (a burst already in the socket's queue): `receive` yields
    once per message anyway, so other requests run between the events of a burst."""
    import asyncio

    from omnimtp.server.metrics import ServerMetrics
    from omnimtp.server.websocket import Session

    class Buffered:  # every message already there: its receive never suspends
        async def receive(self):
            return {"type": "websocket.receive", "text": '{"type": "x"}'}

    async def main() -> int:
        session = Session(Buffered(), "/r", WebSocketLimits(), ServerMetrics())
        ticks = 0

        async def other_request():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(other_request())
        for _ in range(100):
            assert (await session.receive())["type"] == "x"
        other.cancel()
        return ticks

    assert asyncio.run(main()) >= 99
