"""Prompts over HTTP: special-token strings in message text are text (every special token of both tiny
tokenizers, streamed and not, chat and speech), and a huge prompt is refused by its length before it is
tokenized, while tokenizing runs off the event loop."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_harness import running_server

from omnimtp.families.qwen2_5_omni import Qwen2_5OmniFamily
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.server.app import create_app
from omnimtp.server.scheduler import Engine
from omnimtp.tokenizer import prompt_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["qwen3", "qwen2_5"])
def served(request):
    family = Qwen3OmniFamily.tiny(0) if request.param == "qwen3" else Qwen2_5OmniFamily.tiny(0)
    engine = Engine(family, max_frames=2, max_batch_size=4)
    with running_server(create_app(engine, max_tokens_limit=4)) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield family, http


def _specials(tokenizer) -> list[str]:
    return sorted(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)


def _prompt_tokens(family, messages) -> int:
    """The prompt's length with message text as characters: one byte token per byte of the specials."""
    return len(prompt_tokenizer(family.tokenizer).chat_ids(messages))


def test_every_special_token_in_a_chat_message_is_text(served):
    family, http = served
    specials = _specials(family.tokenizer)
    assert len(specials) >= 12
    for special in specials:
        messages = [{"role": "user", "content": f"say {special} now"}]
        response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert response.status_code == 200, (special, response.text)
        plain = [{"role": "user", "content": f"say {'x' * len(special)} now"}]
        assert response.json()["usage"]["prompt_tokens"] == _prompt_tokens(family, plain), special


def test_special_tokens_in_every_turn_stream_as_text(served):
    family, http = served
    text = "".join(_specials(family.tokenizer))
    messages = [{"role": "system", "content": text}, {"role": "user", "content": text},
                {"role": "assistant", "content": text},
                {"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": "!"}]}]
    body = {"messages": messages, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
            "modalities": ["text", "audio"], "audio": {"voice": family.speakers[0], "format": "pcm16"}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    plain = [{**m, "content": "x" * len(text) if isinstance(m["content"], str) else
              [{"type": "text", "text": "x" * len(text)}, {"type": "text", "text": "!"}]} for m in messages]
    assert usage["prompt_tokens"] == _prompt_tokens(family, plain)


def test_special_tokens_in_the_text_to_speak_are_text(served):
    family, http = served
    text = "".join(_specials(family.tokenizer))
    for stream_format in ("audio", "sse"):
        response = http.post("/v1/audio/speech", json={"input": text, "voice": family.speakers[0], "seed": 1,
                                                       "response_format": "pcm", "stream_format": stream_format})
        assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    usage = events[-1]["usage"]
    # every byte of the text is one text id (a special token's name is not its id); a text longer than a
    # segment is spoken in segments, each prefilled after its own speech header
    num_headers, rest = divmod(usage["input_tokens"] - len(text.encode()), len(family.speech_header_ids))
    assert rest == 0 and 1 <= num_headers <= 2, usage


def test_a_huge_chat_is_refused_by_its_length_before_tokenizing(served):
    family, http = served
    text = "hello world " * 350_000  # 4.2 MB: tokenizing it takes the tiny byte tokenizer many seconds
    started = time.monotonic()
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
    elapsed = time.monotonic() - started
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "at least" in error["message"] and "8192" in error["message"]
    assert elapsed < 5.0, elapsed
    response = http.post("/v1/audio/speech", json={"input": "x" * 4096, "voice": family.speakers[0]})
    assert response.status_code == 200  # under the speech input limit: spoken


def test_tokenizing_runs_off_the_event_loop():
    """A prompt long enough to tokenize for a while (its bound lets it through; its token count does not):
    /health answers all the while."""
    engine = Engine(Qwen3OmniFamily.tiny(0), max_frames=2, max_batch_size=2, max_prompt_tokens=400_000)
    text = "a" * 1_500_000  # 1,500,000 tokens: under the 9 × 400,000 character bound, over the token limit
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        result = {}

        def big():
            started = time.monotonic()
            result["response"] = http.post("/v1/chat/completions",
                                           json={"messages": [{"role": "user", "content": text}]})
            result["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=big)
        thread.start()
        latencies = []
        while thread.is_alive():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
        thread.join()
    assert result["response"].status_code == 400
    assert result["response"].json()["error"]["code"] == "context_length_exceeded"
    assert "150000" in result["response"].json()["error"]["message"]
    assert result["seconds"] > 0.3 and len(latencies) >= 3, (result["seconds"], latencies)
    assert max(latencies) < max(0.25, result["seconds"] / 4), (result["seconds"], latencies)
