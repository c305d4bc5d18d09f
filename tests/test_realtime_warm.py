"""A `/v1/realtime` conversation kept warm between turns, through the official `openai` client: turn 5 of a seeded
session that reuses its cached thinker and talker prefixes is, bit for bit (text and PCM), the reply to the same
conversation sent as one request (a fresh session given the earlier turns as items); `/metrics` counts the hits
and reused thinker and talker rows, and a closed session's entry is dropped."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
from audio_checks import assert_audible
from media_samples import tone
from test_server_realtime import _client, _configured, _item_added, _response, _serve, _user_audio, _user_text

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.server.audio import to_pcm16

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16


@pytest.fixture(scope="module")
def warm_server():
    engine, _, server = _serve(Qwen3OmniFamily.tiny(0), max_frames=8, prefill_block=BLOCK,
                               prefix_cache_bytes=64 << 20)
    with server as url:
        yield engine, _client(url)


def _turns() -> list[tuple[str, object]]:
    """Five user turns: text, audio, text, audio, text (audio as float samples at 24 kHz)."""
    return [("text", "Hello there, how are you today?"), ("audio", tone(0.4, 24000, hz=330.0)),
            ("text", "Tell me more about that."), ("audio", tone(0.3, 24000, hz=520.0)), ("text", "And then?")]


def _metric(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


def _wait_for_metric(engine, name: str, value: float, timeout: float = 30.0) -> float:
    """The metric once it equals value (a closed session's entry goes when the server sees the close)."""
    deadline = time.monotonic() + timeout
    while _metric(engine, name) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return _metric(engine, name)


def test_turn_5_of_a_warm_session_is_the_conversation_sent_as_one_request(warm_server):
    engine, client = warm_server
    hits, reused = _metric(engine, "omnimtp_session_cache_hits_total"), \
        _metric(engine, "omnimtp_session_cache_reused_rows_total")
    talker_reused = _metric(engine, "omnimtp_session_cache_talker_reused_rows_total")
    turns, replies = _turns(), []
    with client.realtime.connect(model="omnimtp-tiny") as connection:
        _configured(connection)
        for kind, value in turns:
            if kind == "text":
                _user_text(connection, value)
            else:
                _user_audio(connection, value)
            replies.append(_response(connection))
        assert _metric(engine, "omnimtp_session_cache_sessions") >= 1
    assert all(reply["pcm"] for reply in replies)
    assert _metric(engine, "omnimtp_session_cache_hits_total") - hits == 4
    assert _metric(engine, "omnimtp_session_cache_reused_rows_total") - reused >= 4 * BLOCK
    assert _metric(engine, "omnimtp_session_cache_talker_reused_rows_total") - talker_reused >= 4 * BLOCK
    with client.realtime.connect(model="omnimtp-tiny") as connection:  # the same conversation, one request
        _configured(connection)
        for (kind, value), reply in zip(turns[:-1], replies, strict=False):
            if kind == "text":
                _user_text(connection, value)
            else:
                audio = base64.b64encode(to_pcm16(value).tobytes()).decode("ascii")
                connection.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_audio", "audio": audio}]})
                _item_added(connection)
            connection.conversation.item.create(item={"type": "message", "role": "assistant",
                                                      "content": [{"type": "output_text", "text": reply["text"]}]})
            _item_added(connection)
        _user_text(connection, turns[-1][1])
        cold = _response(connection)
    assert _metric(engine, "omnimtp_session_cache_hits_total") - hits == 4  # the fresh session missed
    assert_audible(np.frombuffer(cold["pcm"], dtype="<i2"))
    assert cold["text"] == replies[-1]["text"]
    assert cold["pcm"] == replies[-1]["pcm"]
    # both sessions closed: their entries dropped
    assert _wait_for_metric(engine, "omnimtp_session_cache_sessions", 0) == 0
