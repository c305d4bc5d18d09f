"""Fuzzing the real server (uvicorn on 127.0.0.1) with request bodies drawn from the request schemas,
raw bytes (invalid UTF-8, surrogates, deep nesting, huge numbers, truncated JSON) and odd header bytes:
no answer is a 5xx, and a valid request on the same client connection succeeds afterwards (so no
error leaves the connection broken without saying `Connection: close`).

The server is sized so that a drawn request that happens to be valid is cheap: at most 4 thinker
tokens and 2 audio frames."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_harness import exchange, running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.models.tiny import tiny_qwen3_omni
from omnimtp.server.app import create_app
from omnimtp.server.scheduler import Engine
from omnimtp.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"
VALID_CHAT = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server():
    engine = Engine(Qwen3OmniFamily(tiny_qwen3_omni(0), byte_tokenizer()), max_frames=2, max_prompt_tokens=512,
                    first_chunk_frames=1, chunk_frames=2, max_batch_size=4)
    app = create_app(engine, api_key=API_KEY, max_tokens_limit=4,
                     max_body_bytes=256 * 1024, body_timeout_s=10.0)
    with running_server(app) as url:
        yield url


def _check(url: str, path: str, body: bytes, headers: dict) -> None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        reply = exchange(conn, "POST", path, body, headers)
        event(f"{path} {reply.status}")
        assert reply.status < 500, (reply.status, reply.body[:300])
        if reply.status >= 400 and reply.headers.get("content-type", "").startswith("application/json"):
            assert set(reply.error()) == {"message", "type", "param", "code"}
        after = exchange(conn, "POST", CHAT, VALID_CHAT, AUTH)
        assert after.status == 200, after.body[:300]
    finally:
        conn.close()


# -- bodies from the schemas ---------------------------------------------------------------------

_plain_text = st.text(max_size=12)
# Text with everything JSON can carry, lone surrogates included (the default alphabet leaves them out).
_text = st.text(st.characters(categories=["L", "N", "P", "S", "Z", "Cc", "Cs", "So"]), max_size=12)
_huge = st.sampled_from([2**63, 2**63 - 1, -(2**63), -(2**63) - 1, 2**64, 10**30, -(10**30)])
_leaf = st.one_of(st.none(), st.booleans(), st.integers(), _huge, st.floats(), _text)
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=8)


def _bodies(junk_rate: int):
    """(chat, speech) body strategies: each field mostly valid, sometimes a value it refuses, and with
    `junk_rate` n > 0 about one field in n any JSON value at all."""

    junk = st.one_of(_text, _json)

    def field(valid, invalid=None):
        # weights by repetition in sampled_from (one_of would merge repeated branches)
        kinds = ["valid"] * 8 + ["invalid"] * (invalid is not None) + ["junk"] * (junk_rate and 9 // junk_rate)
        strategies = {"valid": valid, "invalid": invalid, "junk": junk}
        return st.sampled_from(kinds).flatmap(strategies.__getitem__)

    part = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": field(_plain_text)}),
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file", "refusal", ""]),
                               "image_url": _json}),
    )
    content = field(st.one_of(_plain_text.filter(bool), st.lists(part, min_size=1, max_size=3)), st.just(""))
    message = field(st.fixed_dictionaries({
        "role": field(st.sampled_from(["user", "system", "developer", "assistant"]), st.just("tool")),
        "content": content,
    }))
    sampling = {
        "model": field(st.just("omnimtp-tiny"), st.sampled_from(["gpt-4o", "", "../../etc/passwd"])),
        "seed": field(st.integers(-(2**63), 2**63 - 1), _huge),
        "temperature": field(st.floats(0, 2), st.floats().filter(lambda x: not 0 <= x <= 2)),
        "top_p": field(st.floats(0, 1, exclude_min=True), st.sampled_from([0.0, -1.0, 1.5, float("nan")])),
        "top_k": field(st.integers(0, 100), st.integers(max_value=-1)),
        "user": field(_plain_text),
    }
    voice = field(st.sampled_from(["ethan", "Chelsie", "AIDEN"]), st.sampled_from(["alloy", ""]))
    chat = st.fixed_dictionaries(
        {"messages": field(st.lists(message, min_size=1, max_size=3), st.just([]))},
        optional={
            **sampling,
            "modalities": field(st.sampled_from([["text"], ["text", "audio"]]),
                                st.sampled_from([["audio"], [], ["text", "text"]])),
            "audio": field(st.fixed_dictionaries({"voice": voice, "format": field(st.sampled_from(["wav", "pcm16"]),
                                                                                  st.just("mp3"))})),
            "stream": field(st.booleans()),
            "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())})),
            "max_tokens": field(st.integers(1, 4), st.integers(-3, 0) | st.integers(5, 10**6)),
            "max_completion_tokens": field(st.integers(1, 4), st.integers(-3, 0)),
            "n": field(st.just(1), st.integers(2, 3)),
        },
    )
    speech = st.fixed_dictionaries(
        {"input": field(_plain_text.filter(bool), st.just("")), "voice": voice},
        optional={
            **sampling,
            "response_format": field(st.sampled_from(["wav", "pcm", "flac"]), st.just("mp3")),
            "stream_format": field(st.sampled_from(["audio", "sse"]), st.just("chunks")),
            "speed": field(st.sampled_from([1.0, 1]), st.sampled_from([0.5, float("nan")])),
        },
    )
    return chat, speech


_BODIES = {junk_rate: _bodies(junk_rate) for junk_rate in (0, 1, 3)}


@FUZZ
@given(route=st.sampled_from([0, 1]), junk_rate=st.sampled_from(sorted(_BODIES)), data=st.data(),
       ensure_ascii=st.booleans())
def test_schema_fuzz_never_5xx_and_the_connection_survives(server, route, junk_rate, data, ensure_ascii):
    body = data.draw(_BODIES[junk_rate][route])
    # ensure_ascii=False writes a lone surrogate as its (invalid) UTF-8 bytes; True as a \u escape
    raw = json.dumps(body, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    _check(server, (CHAT, SPEECH)[route], raw, AUTH)


# -- raw bytes -------------------------------------------------------------------------------------

def _nested(depth: int, kind: str) -> bytes:
    opener, closer = (b"[", b"]") if kind == "list" else (b'{"a":', b"}")
    return b'{"messages": ' + opener * depth + b"1" + closer * depth + b"}"


_raw_body = st.one_of(
    st.binary(max_size=64),
    st.builds(_nested, st.sampled_from([10, 900, 1100, 20_000, 100_000]), st.sampled_from(["list", "dict"])),
    st.builds(lambda digits: b'{"messages": [{"role": "user", "content": "Hi"}], "seed": ' + b"7" * digits + b"}",
              st.sampled_from([19, 20, 400, 4300, 4301, 10_000])),
    st.builds(lambda field, number: b'{"messages": [{"role": "user", "content": "Hi"}], "%s": %s}' % (field, number),
              st.sampled_from([b"temperature", b"top_p", b"top_k", b"max_tokens", b"seed"]),
              st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1e-999", b"1.5e308"])),
    st.builds(lambda junk: b'{"messages": [{"role": "user", "content": "' + junk + b'"}]}',
              st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc3", b"\\ud800", b"\\udfff\\ud800", b"\\u0000",
                               b"\\ud83d\\ude00", b"\x00", b"\\", b"\\x41"])),
    st.builds(lambda cut: VALID_CHAT[:cut], st.integers(0, len(VALID_CHAT) - 1)),
)


@FUZZ
@given(path=st.sampled_from([CHAT, SPEECH]), body=_raw_body)
def test_raw_body_fuzz_never_5xx_and_the_connection_survives(server, path, body):
    _check(server, path, body, AUTH)


# -- header bytes ------------------------------------------------------------------------------------

# Header bytes http.client lets through (it refuses bare CR and LF); h11 refuses more.
_header_value = st.binary(max_size=40).filter(lambda value: b"\r" not in value and b"\n" not in value)


@settings(FUZZ, max_examples=50)
@given(
    authorization=st.one_of(_header_value, st.builds(lambda v: b"Bearer " + v, _header_value),
                            st.just(b"Bearer " + "fuzz-k\u00e9y".encode()), st.just(b"bearer fuzz-key")),
    content_type=st.one_of(_header_value, st.just(b"application/json")),
)
def test_header_fuzz_never_5xx_and_the_connection_survives(server, authorization, content_type):
    _check(server, CHAT, VALID_CHAT, {"Authorization": authorization, "Content-Type": content_type})
