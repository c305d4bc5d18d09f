"""Server pieces without HTTP: audio encoding, request schemas, engine request checks, drain on shutdown."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from server_harness import EngineSetup

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.sampling import SamplingParams
from omnimtp.server.audio import encode_audio, streaming_wav_header, to_pcm16
from omnimtp.server.requests import EngineRequest, QueueFullError
from omnimtp.server.scheduler import Engine
from omnimtp.server.schemas import ChatCompletionRequest, SpeechRequest


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(min_value=-2.0, max_value=2.0, allow_nan=False, width=32), min_size=1, max_size=400))
def test_every_format_carries_the_same_pcm16(values):
    samples = np.array(values, dtype=np.float32)
    pcm = to_pcm16(samples)
    assert pcm.dtype == np.dtype("<i2")
    exact = np.clip(samples.astype(np.float64), -1, 1) * 32767
    expected = np.rint(exact).astype(np.int64)
    # to_pcm16 scales in float32, whose rounding can turn a product within float32 precision of a
    # half-integer into the tie (or off it): only there may it differ, by one step
    near_tie = np.abs(exact - np.floor(exact) - 0.5) < 1e-2
    difference = np.abs(pcm.astype(np.int64) - expected)
    assert difference.max() <= 1 and (difference[~near_tie] == 0).all()
    assert encode_audio(samples, 24000, "pcm") == encode_audio(samples, 24000, "pcm16") == pcm.tobytes()
    for fmt in ("wav", "flac"):
        decoded, sample_rate = sf.read(io.BytesIO(encode_audio(samples, 24000, fmt)), dtype="int16")
        assert sample_rate == 24000 and decoded.ndim == 1
        assert np.array_equal(decoded, pcm)
    streamed, _ = sf.read(io.BytesIO(streaming_wav_header(24000) + pcm.tobytes()), dtype="int16")
    assert np.array_equal(streamed, pcm)


def test_encode_audio_rejects_bad_arguments():
    with pytest.raises(ValueError, match="fmt"):
        encode_audio(np.zeros(4, dtype=np.float32), 24000, "ogg")
    with pytest.raises(ValueError, match="samples"):
        to_pcm16(np.zeros((2, 4), dtype=np.float32))


def test_schemas_are_strict():
    ok = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    )
    assert ok.messages[0].text() == "a" and ok.modalities == ["text"] and not ok.wants_audio
    bad = [
        {"messages": [{"role": "user", "content": "a"}], "temperature": "1"},
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": "5"},
        {"messages": [{"role": "user", "content": "a"}], "stream": 1},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": "a"}], "audio": {"voice": "", "format": "wav"}},
    ]
    for body in bad:
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(body)
    assert SpeechRequest.model_validate({"input": "hi", "voice": "x"}).response_format == "wav"
    with pytest.raises(ValidationError):
        SpeechRequest.model_validate({"input": "hi", "voice": "x", "response_format": "ogg"})


def test_engine_request_checks_its_arguments():
    sampling = SamplingParams.greedy()
    with pytest.raises(ValueError, match="exactly one"):
        EngineRequest(messages=None, speak_text=None, speaker=None, sampling=sampling, seed=None, max_new_tokens=1)
    with pytest.raises(ValueError, match="speaker"):
        EngineRequest(messages=None, speak_text="hi", speaker=None, sampling=sampling, seed=None, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        EngineRequest(messages=(("user", "hi"),), speak_text=None, speaker=None, sampling=sampling, seed=None,
                      max_new_tokens=0)


@pytest.fixture(scope="module")
def backend():
    return EngineSetup.tiny(0, max_frames=5, max_prompt_tokens=40, first_chunk_frames=2, chunk_frames=2)


def test_engine_checks_arguments_and_prompt_length(backend):
    family = backend.family
    with pytest.raises(ValueError, match="max_frames"):
        Engine(family, max_frames=0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        Engine(family, max_prompt_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(Qwen3OmniFamily(family.model, None))
    engine = backend.engine()
    long = EngineRequest(messages=(("user", "x" * 100),), speak_text=None, speaker=None,
                         sampling=SamplingParams.greedy(), seed=None, max_new_tokens=1)
    with pytest.raises(ValueError, match="messages"):
        engine.prompt_ids(long)
    speech = EngineRequest(messages=None, speak_text="hi", speaker="ethan", sampling=SamplingParams.greedy(),
                           seed=None, max_new_tokens=0)
    assert engine.prompt_ids(speech) == (family.speech_header_ids + list(b"hi"), None)
    assert engine.match_speaker("ETHAN") == "ethan"
    assert engine.match_speaker("alloy") is None


def test_speech_inputs_speak_the_text_as_the_reply(backend):
    """The speech path builds exactly what the chat path would build for a thinker that replied with the
    text: the talker prefill ends with the first text token, the trailing rows are the rest + tts_eos."""
    from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder

    family = backend.family
    ids = family.speech_header_ids + list(b"abc")
    inputs = family.speech_talker_inputs(ids, "ethan")
    builder = Qwen3TalkerInputBuilder(family.model, family.speech_header_ids, "ethan")
    embeds = family.model.thinker.get_input_embeddings()(torch.tensor(ids)).detach()
    projected = [builder.build_trailing(embeds[i : i + 1], embeds[i : i + 1]) for i in range(len(ids))]
    assert inputs.prefill_embeds.shape[0] == 9  # no user turn: the 9 assistant rows
    assert inputs.trailing_text.shape[0] == 3  # "b", "c", tts_eos
    assert (inputs.trailing_text[0] == projected[-2][0]).all() and (inputs.trailing_text[1] == projected[-1][0]).all()
    assert (inputs.trailing_text[2] == builder.tts_eos_embed).all()


def test_shutdown_drains_queued_and_running_requests(backend):
    """Requests still waiting or running when shutdown starts all finish with their complete audio."""
    engine = backend.engine(max_batch_size=2)

    async def scenario():
        engine.start(max_queue=8)
        loop = asyncio.get_running_loop()
        handles = []
        for i in range(4):
            request = EngineRequest(messages=None, speak_text=f"say {i}", speaker="ethan",
                                    sampling=SamplingParams(temperature=1.0), seed=i, max_new_tokens=0)
            handles.append(engine.submit(request, loop=loop))
        stopper = threading.Thread(target=engine.shutdown, kwargs={"drain": True})
        stopper.start()
        results = []
        for handle in handles:
            samples, final = [], None
            async for event in handle.events():
                if event.audio is not None:
                    samples.append(event.audio)
                final = event
            results.append((sum(len(s) for s in samples), final))
        await asyncio.to_thread(stopper.join)
        with pytest.raises(QueueFullError):
            engine.submit(request, loop=loop)  # a stopped engine takes nothing new
        return results

    for num_samples, final in asyncio.run(scenario()):
        assert final.finish_reason in ("stop", "length") and final.error is None
        assert num_samples == 1920 * final.num_frames - 555


def _warm_up_frames(family, monkeypatch, max_batch_size: int) -> tuple[bool, list]:
    """family.warm_up with its predictor's frames recorded (rows, sampling) instead of compiled."""
    predictor = family.predictor(max_batch_size)
    calls = []
    monkeypatch.setattr(predictor, "_run_frame", lambda hidden, embed, sampling, noise, kv, is_warm_up=False:
                        calls.append((hidden.shape[0], sampling)))
    return family.warm_up(max_batch_size), calls


def test_family_warm_up_builds_every_bucket_greedy_and_with_the_family_sampling(backend, monkeypatch):
    """An eager predictor has nothing to warm; a compiled one runs one greedy and one sampled frame per batch
    bucket, sampled as the family's predictor samples (Qwen3-Omni's predictor defaults; Qwen3-TTS: its
    talker defaults without the repetition penalty)."""
    from dataclasses import replace

    from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING, Qwen3TTSFamily
    from omnimtp.sampling import QWEN3_OMNI_CODE_PREDICTOR_SAMPLING

    eager = Qwen3OmniFamily(backend.family.model, backend.family.tokenizer)
    assert _warm_up_frames(eager, monkeypatch, 3) == (False, [])
    for family, sampling in [
        (Qwen3OmniFamily(backend.family.model, backend.family.tokenizer), QWEN3_OMNI_CODE_PREDICTOR_SAMPLING),
        (Qwen3TTSFamily.tiny(0), replace(QWEN3_TTS_SAMPLING, repetition_penalty=1.0)),
    ]:
        family.predictor(5).compile_mode = "frame"
        is_warm, calls = _warm_up_frames(family, monkeypatch, 5)
        buckets = sorted({family.predictor(5).bucket_rows(b) for b in range(1, 6)})
        assert is_warm and len(buckets) > 1
        assert calls == [call for rows in buckets for call in ((rows, None), (rows, sampling))]


def test_the_server_packs_each_decoder_once(monkeypatch, tmp_path):
    """`omnimtp serve` builds one family: the thinker and the talker are packed once each, for the tiny
    default and for a checkpoint directory, and the engine serves on those packed weights."""
    from omnimtp.packed_decoder import PackedDecoder
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.server.build import build_engine

    OmniPipeline.tiny().save_pretrained(tmp_path)
    real_from_module = PackedDecoder.from_module.__func__
    packed = []

    def counting(cls, module, *args, **kwargs):
        packed.append(type(module).__name__)
        return real_from_module(cls, module, *args, **kwargs)

    monkeypatch.setattr(PackedDecoder, "from_module", classmethod(counting))
    for model_dir in (None, str(tmp_path)):
        packed.clear()
        engine = build_engine(model_dir, max_batch_size=2, max_frames=3)
        engine.start()
        engine.shutdown()
        decoders = sorted(name for name in packed if "CodePredictor" not in name)
        assert decoders == ["Qwen3OmniMoeTalkerModel", "Qwen3OmniMoeThinkerTextModel"]


def test_the_banner_names_the_voices_each_kind_of_model_takes_and_the_playground():
    from types import SimpleNamespace

    from omnimtp.server.cli import banner

    url = "http://127.0.0.1:8000"
    speaks = SimpleNamespace(speaks=True)
    omni = SimpleNamespace(model_id="omnimtp-tiny", speakers=("chelsie", "ethan"), tts_model_type=None, family=speaks)
    assert banner(omni, url, playground=True).splitlines() == [
        "omnimtp: serving omnimtp-tiny on http://127.0.0.1:8000/v1 (voices: chelsie, ethan)",
        "omnimtp: the playground is on http://127.0.0.1:8000/"]
    base = SimpleNamespace(model_id="tiny-tts-base", speakers=(), tts_model_type="base", family=speaks)
    assert banner(base, url, playground=False) == (
        "omnimtp: serving tiny-tts-base on http://127.0.0.1:8000/v1 (voices cloned from a recording: "
        "POST /v1/audio/voices, or ref_audio in a speech request)")
    design = SimpleNamespace(model_id="tiny-tts-design", speakers=(), tts_model_type="voice_design", family=speaks)
    assert "(voices described in words: instructions)" in banner(design, url, playground=False)
