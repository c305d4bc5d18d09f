"""A body or event of any size or shape never stalls the others: large ones are parsed and validated off the
event loop, and structure limits (brackets counted before parsing, array lengths and depth after) refuse
millions of tiny values with a 400 naming the field. `/health` keeps answering meanwhile."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_harness import running_server

from omnimtp.server.app import create_app
from omnimtp.server.build import build_engine
from omnimtp.server.errors import APIError
from omnimtp.server.guard import MAX_JSON_ARRAY_ITEMS, MAX_JSON_COMMAS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, parse_json

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Far above the ~1 ms /health takes, far below the seconds these bodies stalled it for when parsed on the loop.
MAX_HEALTH_S = 1.0


@pytest.fixture(scope="module")
def server():
    engine = build_engine(None, max_batch_size=2, max_frames=None)
    with running_server(create_app(engine)) as url:  # the default --max-body-bytes (16 MiB)
        yield url


def _worst_health_latency(url: str, send) -> tuple[float, object]:
    """The slowest /health answer while `send()` runs in another thread, and what `send` returned."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("reply", send()))
    worst = 0.0
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/health")
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            worst = max(worst, time.perf_counter() - start)
            time.sleep(0.01)
    thread.join()
    return worst, result["reply"]


MANY_MESSAGES = json.dumps({"messages": [{"role": "user", "content": "a"}] * 300_000}).encode()
NESTED_LISTS = b'{"input": "Hi", "speaker_embedding": [' + b",".join([b"[]"] * 4_000_000) + b"]}"
# no container to count, but three million numbers: json.loads alone held the GIL for over half a second
FLAT_NUMBERS = b'{"input": "Hi", "speaker_embedding": [' + b",".join([b"0.5"] * 3_000_000) + b"]}"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", MANY_MESSAGES, None),
    ("/v1/audio/speech", NESTED_LISTS, None),
    ("/v1/audio/speech", FLAT_NUMBERS, None),
])
def test_a_body_of_millions_of_tiny_values_is_refused_without_stalling_health(server, path, body, param):
    def send():
        with httpx.Client(base_url=server, timeout=120) as client:
            return client.post(path, content=body, headers={"Content-Type": "application/json"})

    worst, reply = _worst_health_latency(server, send)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "structure_too_large" and error["param"] == param
    assert worst < MAX_HEALTH_S, f"/health took {worst:.3f} s during the request"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                            * (MAX_JSON_ARRAY_ITEMS + 1)}]}, "messages.0.content"),
    ("/v1/audio/speech", {"input": "Hi", "voice": "ethan", "x": [0] * (MAX_JSON_ARRAY_ITEMS + 1)}, "x"),
    ("/v1/audio/speech", {"input": "Hi", "voice": "ethan", "x": json.loads("[" * (MAX_JSON_DEPTH + 1)
                                                                          + "]" * (MAX_JSON_DEPTH + 1))},
     "x" + ".0" * (MAX_JSON_DEPTH - 1)),
])
def test_structure_limits_name_the_field(server, path, body, param):
    reply = httpx.post(server + path, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_body_at_the_structure_limits_is_read(server):
    content = [{"type": "text", "text": "a"}] * MAX_JSON_ARRAY_ITEMS
    reply = httpx.post(server + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert reply.status_code != 400 or reply.json()["error"]["code"] != "structure_too_large", reply.text


def test_arrays_count_as_containers():
    """More than MAX_JSON_CONTAINERS short arrays, in arrays short and shallow enough for the shape checks and
    with fewer commas than MAX_JSON_COMMAS, are refused by their bracket count before they are parsed."""
    group = "[" + ",".join(["[]"] * MAX_JSON_ARRAY_ITEMS) + "]"
    text = "[" + ",".join([group] * (MAX_JSON_CONTAINERS // MAX_JSON_ARRAY_ITEMS + 1)) + "]"
    assert text.count(",") < MAX_JSON_COMMAS and "{" not in text
    with pytest.raises(APIError) as caught:
        parse_json(text)
    assert caught.value.code == "structure_too_large" and "objects and arrays" in caught.value.message


UNKNOWN_KEYS = json.dumps({"messages": [{"role": "user", "content": "a"}], **{f"k{i}": 0 for i in range(99_000)}})


def test_a_body_of_many_unknown_keys_is_refused_without_stalling_health(server, monkeypatch):
    """99,000 unknown keys, just under the structure limits: the first one is named at once, and the schema never
    sees the body (its error for every one of them took up to a second to build, holding the event loop)."""
    from omnimtp.server.schemas import ChatCompletionRequest

    validated, model_validate = [], ChatCompletionRequest.model_validate
    monkeypatch.setattr(ChatCompletionRequest, "model_validate",
                        lambda value: validated.append(1) or model_validate(value))

    def send():
        with httpx.Client(base_url=server, timeout=120) as client:
            return client.post("/v1/chat/completions", content=UNKNOWN_KEYS,
                               headers={"Content-Type": "application/json"})

    worst, reply = _worst_health_latency(server, send)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "unknown_parameter" and error["param"] == "k0", error
    assert not validated
    print(f"/health worst {worst * 1e3:.0f} ms")
    assert worst < MAX_HEALTH_S / 2, f"/health took {worst:.3f} s during the request"


def test_an_integer_of_more_than_100_digits_is_refused_as_it_is_read():
    """Thousands of 4,000-digit integers held the GIL in their conversion for 0.4 s; every integer field takes an
    int64, so one over MAX_JSON_INT_DIGITS digits is refused before it is converted."""
    from omnimtp.server.guard import MAX_JSON_INT_DIGITS

    digits = "9" * MAX_JSON_INT_DIGITS
    assert parse_json(f'{{"seed": -{digits}, "x": [{digits}]}}') == {"seed": -int(digits), "x": [int(digits)]}
    with pytest.raises(APIError) as caught:
        parse_json(f'{{"x": [1, 2, {digits}9]}}')
    assert caught.value.code == "invalid_json" and "too many digits" in caught.value.message
