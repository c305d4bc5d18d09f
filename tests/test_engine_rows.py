"""Rows of one batch that end at different steps, on the tiny Qwen3-Omni: requests of one thinker cohort stop
at their own token budgets (engine and HTTP), and a talker row that retires early (a compacted KV slot)
leaves the rows after it as they are alone, with an image prompt's M-RoPE offset on either side."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from audio_checks import assert_audible, assert_audio_equal
from server_harness import EngineSetup, running_server
from test_media_input import _user_turn, image_case

from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import Request
from omnimtp.media import MediaInputs
from omnimtp.pipeline import OmniPipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pipe():
    return OmniPipeline.tiny(seed=0)


def _run(pipe, requests: list[Request]) -> dict:
    """Every request added before the first step (one thinker cohort) → request_id → OmniOutput."""
    core = EngineCore(pipe.family, pipe.config)
    for request in requests:
        core.add(request)
    outputs = {}
    while core.has_work():
        for event in core.step():
            if event.is_finished:
                outputs[event.request.request_id] = core.output(event.request)
    return outputs


def test_requests_of_one_cohort_stop_at_their_own_token_budgets(pipe):
    """Budgets 3 and 12 in one cohort (its run allows 12): exactly 3 and 12 tokens, each the same request's
    tokens alone (the tiny model stops on no EOS within 12 tokens of these prompts)."""
    prompts = [_user_turn([], b"Hello there"), _user_turn([], b"Tell me more")]
    budgets = [3, 12]
    requests = [Request(i, ids, max_new_tokens=n, max_frames=4, speaker=pipe.family.default_speaker, is_streamed=False)
                for i, (ids, n) in enumerate(zip(prompts, budgets, strict=True))]
    outputs = _run(pipe, requests)
    for i, (ids, n) in enumerate(zip(prompts, budgets, strict=True)):
        assert len(outputs[i].text_ids) == n and outputs[i].thinker_finish_reason == "length", i
        assert outputs[i].text_ids == pipe.generate(input_ids=ids, max_new_tokens=n, max_frames=4).text_ids


def test_http_requests_of_one_cohort_stop_at_their_own_max_tokens():
    """Two chat completions admitted in one engine step (the step waits until both are queued), max_tokens 3
    and 12: usage.completion_tokens 3 and 12, both finish_reason "length"."""
    from omnimtp.server.app import create_app

    engine = EngineSetup.tiny(0).engine()
    gate = threading.Event()
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        core = engine._core
        step = core.step
        core.step = lambda: (gate.wait(60), step())[1]  # the engine thread waits here, outside its lock
        replies: dict[int, dict] = {}

        def send(max_tokens):
            body = {"messages": [{"role": "user", "content": "Tell me more"}], "modalities": ["text"],
                    "max_tokens": max_tokens, "temperature": 0}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            replies[max_tokens] = response.json()

        threads = [threading.Thread(target=send, args=(n,)) for n in (3, 12)]
        for thread in threads:
            thread.start()
        for _ in range(600):
            with engine._cond:
                if len(core.waiting) == 2:
                    break
            threading.Event().wait(0.05)
        with engine._cond:
            assert len(core.waiting) == 2, "both requests queued before the engine's next step"
        gate.set()
        for thread in threads:
            thread.join()
    for n in (3, 12):
        assert replies[n]["usage"]["completion_tokens"] == n
        assert replies[n]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("image_first", [True, False])
def test_a_talker_row_that_ends_early_leaves_the_others_as_they_are_alone(pipe, image_first):
    """An image request and a text request in one talker batch, the first of them capped at 5 frames and the
    other at 20: when the first retires, the batch's KV slots are compacted and the later row moves into
    slot 0 with its own M-RoPE offset (the image's is non-zero, the text's zero). Each row's codes and audio
    equal the same request alone."""
    image_ids, media = image_case()
    text_ids = _user_turn([], b"Hello there")
    cases = [(image_ids, media), (text_ids, None)]
    if not image_first:
        cases.reverse()
    frames = [5, 20]
    speaker = pipe.family.default_speaker

    def request(i, ids, media, max_frames):
        return Request(i, ids, max_new_tokens=6, max_frames=max_frames, speaker=speaker, is_streamed=False,
                       media=None if media is None else MediaInputs(**media))

    batch = _run(pipe, [request(i, ids, m, n) for i, ((ids, m), n) in enumerate(zip(cases, frames, strict=True))])
    assert [batch[i].codes.shape[1] for i in (0, 1)] == frames  # no codec EOS: both run to their caps
    for i, ((ids, m), n) in enumerate(zip(cases, frames, strict=True)):
        alone = _run(pipe, [request(0, ids, m, n)])[0]
        assert batch[i].text_ids == alone.text_ids
        assert torch.equal(batch[i].codes, alone.codes), f"row {i} differs from itself alone"
        assert_audible(alone.audio)
        assert_audio_equal(batch[i].audio, alone.audio)
