"""The warm-up reply (`omnimtp.engine.warm_up`): `OmniPipeline.warm_up` and the server's engine at start run one
short spoken reply through every stage; it changes no later reply, a user's request that comes meanwhile is served
at once and ends it, and `serve --no-warm-up` turns it off."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_harness import EngineSetup, running_server

from omnimtp import OmniPipeline
from omnimtp.engine.config import EngineConfig
from omnimtp.engine.warm_up import WARM_UP_REQUEST_ID, warm_up_request
from omnimtp.server.app import create_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_CHAT = {"model": "omnimtp-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 4,
         "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_warm_up_request_speaks_the_first_chunk_and_a_later_one():
    pipe = OmniPipeline.tiny()
    config = EngineConfig(max_frames=100, first_chunk_frames=2, chunk_frames=5)
    request = warm_up_request(pipe.family, config)
    assert request.request_id == WARM_UP_REQUEST_ID and request.is_chat and request.max_frames == 7
    assert request.speaker == pipe.family.default_speaker and request.thinker_sampling is None
    assert warm_up_request(pipe.family, EngineConfig(max_frames=3)).max_frames == 3  # within the caps
    given = warm_up_request(pipe.family, config, [1, 2, 3])
    assert given.prompt_ids == [1, 2, 3]
    asr = OmniPipeline.tiny(family="qwen3_asr")
    assert warm_up_request(asr.family, config) is None  # a model that only hears has no reply to speak


@pytest.mark.parametrize("tts_model_type", ["custom_voice", "voice_design", "base"])
def test_a_tts_models_warm_up_speaks_a_short_text_in_its_default_voice_and_changes_no_reply(tts_model_type):
    """Qwen3-TTS (no thinker): the warm-up reply is a speech request of the warm-up text in the voice a request
    without one gets, up to the codec's first chunk and a later one; a seeded reply after it is the same."""
    config = EngineConfig(max_frames=100, first_chunk_frames=2, chunk_frames=5)
    cold = OmniPipeline.tiny(family="qwen3_tts", tts_model_type=tts_model_type, max_frames=8)
    request = warm_up_request(cold.family, config)
    assert request.request_id == WARM_UP_REQUEST_ID and not request.is_chat and request.max_frames == 7
    described = {"instructions": "A calm, clear voice."} if tts_model_type == "voice_design" else {}
    assert request.speaker == cold.family.voice(**described)
    assert warm_up_request(cold.family, config, [1, 2, 3]) is None  # (a prompt of ids is a thinker's)
    expected = cold.speech("Hi there.", seed=3, **described)
    warm = OmniPipeline.tiny(family="qwen3_tts", tts_model_type=tts_model_type, max_frames=8)
    frames = []
    decode = warm.family.decode_audio

    def counted(streams, blocks, is_final):
        frames.extend(block.shape[-1] for block in blocks)
        return decode(streams, blocks, is_final)

    warm.family.decode_audio = counted
    assert warm.warm_up()["reply_s"] > 0
    assert sum(frames) == min(warm.config.first_chunk_frames + warm.config.chunk_frames, 8)
    got = warm.speech("Hi there.", seed=3, **described)
    assert (got.codes == expected.codes).all() and (got.audio == expected.audio).all()


def test_the_pipelines_warm_up_runs_every_stage_and_changes_no_reply():
    cold = OmniPipeline.tiny()
    expected = cold.generate("Hello", max_new_tokens=4, max_frames=6)
    warm = OmniPipeline.tiny()
    frames = []
    decode = warm.family.decode_audio

    def counted(streams, blocks, is_final):
        frames.extend(block.shape[-1] for block in blocks)
        return decode(streams, blocks, is_final)

    warm.family.decode_audio = counted
    summary = warm.warm_up()
    assert summary["reply_s"] > 0 and summary["prefetch"]["bytes"] == 0  # (the tiny model is not mapped)
    assert sum(frames) == min(warm.config.first_chunk_frames + warm.config.chunk_frames, warm.config.max_frames)
    got = warm.generate("Hello", max_new_tokens=4, max_frames=6)
    assert got.text_ids == expected.text_ids and (got.codes == expected.codes).all()
    assert (got.audio == expected.audio).all()


def test_the_server_runs_the_warm_up_reply_at_start_and_replies_as_without_it(caplog):
    """/metrics' omnimtp_warm: 1 at once on a server with no warm-up, and once the warm-up reply is over on one
    with it (what a benchmark waits for before it measures)."""
    setup = EngineSetup.tiny(max_batch_size=2, max_frames=6)
    with running_server(create_app(setup.engine())) as base:
        assert "omnimtp_warm 1.0" in httpx.get(f"{base}/metrics").text
        expected = httpx.post(f"{base}/v1/chat/completions", json=_CHAT, timeout=120).json()
    engine = setup.engine(warm_up_reply=True)
    with caplog.at_level("INFO", logger="omnimtp.server"), running_server(create_app(engine)) as base:
        _wait_for(lambda: "omnimtp_warm 1.0" in httpx.get(f"{base}/metrics").text)
        assert engine.warm_up_reply_result["ended"] == "finished" and engine.warm_up_reply_result["frames"] == 6
        reply = httpx.post(f"{base}/v1/chat/completions", json=_CHAT, timeout=120).json()
    got, want = reply["choices"][0]["message"], expected["choices"][0]["message"]
    assert (got["content"], got["audio"]["data"]) == (want["content"], want["audio"]["data"])
    assert any(r.getMessage().startswith("warm-up: a spoken reply through every stage finished after 6 frames")
               for r in caplog.records)


def test_a_request_during_the_warm_up_reply_is_served_at_once_and_ends_it():
    """The warm-up reply held inside its first codec call: a chat that comes then is answered (byte for byte as
    without a warm-up), and the warm-up reply is ended, not finished."""
    setup = EngineSetup.tiny(max_batch_size=2, max_frames=6)
    with running_server(create_app(setup.engine())) as base:
        expected = httpx.post(f"{base}/v1/chat/completions", json=_CHAT, timeout=120).json()
    engine = setup.engine(warm_up_reply=True)
    decode, entered, release = setup.family.decode_audio, threading.Event(), threading.Event()

    def held(streams, blocks, is_final):
        if not release.is_set():
            entered.set()
            release.wait(30)
        return decode(streams, blocks, is_final)

    setup.family.decode_audio = held
    with running_server(create_app(engine)) as base:
        assert entered.wait(60)  # the warm-up reply is in its first codec call
        timer = threading.Timer(0.5, release.set)  # the call ends after the chat has come
        timer.start()
        reply = httpx.post(f"{base}/v1/chat/completions", json=_CHAT, timeout=120)
        timer.join()
        _wait_for(lambda: engine.warm_up_reply_result is not None)
    assert reply.status_code == 200
    assert engine.warm_up_reply_result["ended"] == "aborted" and engine.warm_up_reply_result["frames"] < 6
    got, want = reply.json()["choices"][0]["message"], expected["choices"][0]["message"]
    assert (got["content"], got["audio"]["data"]) == (want["content"], want["audio"]["data"])


def test_serve_warms_up_unless_told_not_to():
    from omnimtp.cli import build_parser
    from omnimtp.server.build import build_app

    parser = build_parser()
    engine, _ = build_app(parser.parse_args(["serve", "--eager", "--max-frames", "2"]))
    assert engine.warm_up_reply is True
    engine, _ = build_app(parser.parse_args(["serve", "--eager", "--max-frames", "2", "--no-warm-up"]))
    assert engine.warm_up_reply is False
    with pytest.raises(ValueError, match="warm_up_reply"):
        EngineSetup.tiny().engine(warm_up_reply="yes")
