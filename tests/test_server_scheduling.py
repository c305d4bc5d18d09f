"""The engine's scheduling, without HTTP: when a newcomer's first audio comes, how later chunks share the
code2wav calls, and that neither changes a seeded request's bytes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from audio_checks import assert_audible
from server_harness import EngineSetup

from omnimtp.sampling import SamplingParams
from omnimtp.server.audio import to_pcm16
from omnimtp.server.requests import EngineRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SAMPLES_PER_FRAME, TAIL = 1920, 555


@pytest.fixture(scope="module")
def backend():
    return EngineSetup.tiny(0, max_frames=24, first_chunk_frames=1, chunk_frames=4)


def _speech(text: str, seed: int) -> EngineRequest:
    return EngineRequest(messages=None, speak_text=text, speaker="ethan", sampling=SamplingParams(temperature=1.0),
                         seed=seed, max_new_tokens=0)


def _chat(text: str, seed: int) -> EngineRequest:
    return EngineRequest(messages=(("user", text),), speak_text=None, speaker="aiden",
                         sampling=SamplingParams(temperature=1.0), seed=seed, max_new_tokens=6)


async def _collect(handle) -> dict:
    text, pcm, steps, final = [], [], [], None
    async for event in handle.events():
        assert event.error is None, event.error
        text.append(event.text)
        if event.audio is not None:
            pcm.append(to_pcm16(event.audio).tobytes())
            steps.append(event.step)
        final = event
    return {"text": "".join(text), "pcm": b"".join(pcm), "steps": steps, "admitted": handle.admitted_step,
            "frames": final.num_frames}


def _assert_audible_pcm(pcm: bytes) -> None:
    assert_audible(np.frombuffer(pcm, dtype=np.int16))


def _alone(backend, request: EngineRequest) -> dict:
    engine = backend.engine(max_batch_size=1)

    async def scenario():
        engine.start()
        try:
            return await _collect(engine.submit(request, loop=asyncio.get_running_loop()))
        finally:
            await asyncio.to_thread(engine.shutdown)

    return asyncio.run(scenario())


def _newcomer_during_a_long_request(backend, max_start_steps: int) -> tuple[dict, dict]:
    """A long speech request runs; once its audio flows, a chat request with audio arrives."""
    engine = backend.engine(max_batch_size=4, max_start_steps=max_start_steps)

    async def scenario():
        engine.start()
        try:
            loop = asyncio.get_running_loop()
            long = engine.submit(_speech("A long answer to speak", seed=3), loop=loop)
            events = long.events()
            first = await events.__anext__()
            while first.audio is None:
                first = await events.__anext__()
            newcomer = asyncio.create_task(_collect(engine.submit(_chat("Hi there", seed=5), loop=loop)))
            rest = [first] + [event async for event in events]
            long_result = {
                "pcm": b"".join(to_pcm16(e.audio).tobytes() for e in rest if e.audio is not None),
                "steps": [e.step for e in rest if e.audio is not None], "frames": rest[-1].num_frames,
            }
            return long_result, await newcomer
        finally:
            await asyncio.to_thread(engine.shutdown)

    return asyncio.run(scenario())


def test_engine_checks_its_scheduling_arguments(backend):
    for name, value in (("max_batch_size", 0), ("max_start_steps", 0), ("max_start_steps", True),
                        ("max_decode_frames", 0), ("max_defer_steps", -1)):
        with pytest.raises(ValueError, match=name):
            backend.engine(**{name: value})


def test_a_newcomer_gets_first_audio_in_its_admission_iteration_while_a_long_request_runs(backend):
    """The new chat cohort takes its prefill and two decode steps at once, so its talker starts and
    its first frame is decoded in the iteration that admitted it; with one thinker step per iteration
    (max_start_steps=1) the same audio comes two iterations later. Either way both requests give the
    bytes they give alone."""
    long_alone = _alone(backend, _speech("A long answer to speak", seed=3))
    chat_alone = _alone(backend, _chat("Hi there", seed=5))
    assert long_alone["frames"] == 24 and chat_alone["frames"] > 0 and chat_alone["text"]
    for max_start_steps, delay in ((3, 0), (1, 2)):
        long, chat = _newcomer_during_a_long_request(backend, max_start_steps)
        assert chat["admitted"] > long["steps"][0], "the chat request joined a running batch"
        assert chat["steps"][0] == chat["admitted"] + delay
        assert long["steps"][-1] > chat["steps"][0], "the long request was still speaking"
        _assert_audible_pcm(long_alone["pcm"])
        _assert_audible_pcm(chat_alone["pcm"])
        assert (long["pcm"], long["frames"]) == (long_alone["pcm"], long_alone["frames"])
        assert (chat["text"], chat["pcm"], chat["frames"]) == (
            chat_alone["text"], chat_alone["pcm"], chat_alone["frames"]
        )


@pytest.mark.parametrize("max_decode_frames, spread", [(1, True), (24, False)])
def test_last_chunks_of_requests_finishing_together_share_a_frame_budget(max_decode_frames, spread):
    """Three speech requests admitted together end on the same step, each with a 5-frame last chunk.
    Within a 1-frame budget their last chunks go one per iteration, oldest (then lowest id) first; with
    room for all, in one. Their bytes are the same either way, and the same as alone."""
    backend = EngineSetup.tiny(0, max_frames=6, first_chunk_frames=1, chunk_frames=50)
    requests = [_speech(f"Say number {i}", seed=10 + i) for i in range(3)]
    alone = [_alone(backend, request) for request in requests]
    engine = backend.engine(max_batch_size=4, max_decode_frames=max_decode_frames)

    async def scenario():
        engine.start()
        try:
            loop = asyncio.get_running_loop()
            with engine._cond:  # all three wait for the same admission
                handles = [engine.submit(request, loop=loop) for request in requests]
            return await asyncio.gather(*(_collect(handle) for handle in handles))
        finally:
            await asyncio.to_thread(engine.shutdown)

    together = asyncio.run(scenario())
    assert len({result["admitted"] for result in together}) == 1
    for result, single in zip(together, alone, strict=True):
        assert result["frames"] == 6 and len(result["steps"]) == 2
        assert len(result["pcm"]) == 2 * (SAMPLES_PER_FRAME * 6 - TAIL)
        _assert_audible_pcm(single["pcm"])
        assert result["pcm"] == single["pcm"]
    last_steps = [result["steps"][-1] for result in together]
    if spread:
        assert last_steps == [last_steps[0], last_steps[0] + 1, last_steps[0] + 2]
    else:
        assert len(set(last_steps)) == 1


def test_sixteen_concurrent_seeded_requests_give_the_bytes_they_give_alone(backend):
    """16 seeded requests (chat with audio and speech, different lengths) submitted at once to a 16-slot
    engine: every batched forward and every code2wav call mixes them, yet each request's text and PCM16
    bytes equal the same request run alone, on audio loud enough that one wrong LSB shows."""
    requests = [_chat(f"Question {i}?", seed=100 + i) if i % 2 else _speech(f"Say {i} things", seed=100 + i)
                for i in range(16)]
    alone = [_alone(backend, request) for request in requests]
    engine = backend.engine(max_batch_size=16)

    async def scenario():
        engine.start()
        try:
            loop = asyncio.get_running_loop()
            handles = [engine.submit(request, loop=loop) for request in requests]
            return await asyncio.gather(*(_collect(handle) for handle in handles))
        finally:
            await asyncio.to_thread(engine.shutdown)

    together = asyncio.run(scenario())
    assert max(r["admitted"] for r in together) < min(r["steps"][-1] for r in together), "all 16 ran at once"
    for i, (result, single) in enumerate(zip(together, alone, strict=True)):
        assert single["frames"] > 0, i
        _assert_audible_pcm(single["pcm"])
        assert (result["text"], result["frames"]) == (single["text"], single["frames"]), i
        assert result["pcm"] == single["pcm"], f"request {i}: PCM differs from the same request alone"
