"""The server on a Qwen3-TTS model: a real uvicorn server on the tiny seeded CustomVoice and VoiceDesign models,
spoken to with the official `openai` package (and httpx for the error table). Every PCM byte is compared
with `OmniPipeline.stream_speech` on the same weights (the server streams in every format)."""

from __future__ import annotations

import base64
import io
import json
import threading

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from audio_checks import assert_audible
from server_harness import running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING, Qwen3TTSFamily
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.server.app import create_app
from omnimtp.server.audio import to_pcm16
from omnimtp.server.errors import APIError
from omnimtp.server.requests import EngineRequest
from omnimtp.server.routes.common import ServingContext
from omnimtp.server.routes.voices import speech_voice
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_FRAMES = 6
TEXT = "Hello there, tiny voice."
OTHER_TEXT = "Short one"
INSTRUCTIONS = "A calm, low voice, speaking slowly."
MODELS = {"custom_voice": "tts-custom", "voice_design": "tts-design"}


@pytest.fixture(scope="module")
def pipes():
    return {kind: OmniPipeline.tiny(family="qwen3_tts", tts_model_type=kind, max_frames=MAX_FRAMES) for kind in MODELS}


@pytest.fixture(scope="module")
def servers():
    urls = {}
    with (
        running_server(_app("custom_voice")) as urls["custom_voice"],
        running_server(_app("voice_design")) as urls["voice_design"],
    ):
        yield urls


def _app(kind: str):
    engine = Engine(Qwen3TTSFamily.tiny(0, kind), model_id=MODELS[kind], max_frames=MAX_FRAMES, max_batch_size=4)
    return create_app(engine)


@pytest.fixture(scope="module")
def clients(servers):
    return {kind: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            for kind, url in servers.items()}


def _streamed_pcm(pipe, text, **kwargs) -> bytes:
    """The pipeline's streamed audio of one text as PCM16 bytes (audible asserted)."""
    *chunks, output = list(pipe.stream_speech(text, **kwargs))
    audio = np.concatenate(chunks)
    assert output.codes.shape[-1] >= 2
    assert_audible(audio)
    return to_pcm16(audio).tobytes()


def _speech(client, kind, **kwargs) -> bytes:
    arguments = {"model": MODELS[kind], "input": TEXT, "voice": None, "response_format": "pcm", **kwargs}
    return client.audio.speech.create(**arguments).content


def test_openai_client_speech_equals_the_pipeline(pipes, clients):
    """wav, pcm, streamed raw and streamed SSE: the same bytes as the pipeline, greedy (temperature 0)."""
    client = clients["custom_voice"]
    expected = _streamed_pcm(pipes["custom_voice"], TEXT, voice="aiden", language="english")
    greedy = {"language": "english", "temperature": 0, "task_type": "CustomVoice"}
    assert _speech(client, "custom_voice", voice="Aiden", extra_body=greedy) == expected
    wav = _speech(client, "custom_voice", voice="aiden", response_format="wav", extra_body=greedy)
    samples, sample_rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert sample_rate == 24_000 and samples.tobytes() == expected
    flac = _speech(client, "custom_voice", voice="aiden", response_format="flac", extra_body=greedy)
    assert sf.read(io.BytesIO(flac), dtype="int16")[0].tobytes() == expected
    with client.audio.speech.with_streaming_response.create(
        model=MODELS["custom_voice"], input=TEXT, voice="aiden", response_format="pcm", extra_body=greedy,
    ) as response:
        assert b"".join(response.iter_bytes()) == expected
    with client.audio.speech.with_streaming_response.create(
        model=MODELS["custom_voice"], input=TEXT, voice="aiden", response_format="pcm", stream_format="sse",
        extra_body=greedy,
    ) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta") == expected
    # the language row matters: "auto" speaks differently
    assert _speech(client, "custom_voice", voice="aiden", extra_body={"temperature": 0}) != expected


def test_voice_design_speaks_its_instructions(pipes, clients):
    expected = _streamed_pcm(pipes["voice_design"], TEXT, instructions=INSTRUCTIONS)
    client = clients["voice_design"]
    assert _speech(client, "voice_design", instructions=INSTRUCTIONS,
                   extra_body={"task_type": "VoiceDesign", "temperature": 0}) == expected
    other = _speech(client, "voice_design", instructions="A bright, fast voice.", extra_body={"temperature": 0})
    assert other != expected


def test_seeded_sampled_requests_are_the_same_under_load(pipes, clients):
    """Sampling fields left out are the reference's defaults (QWEN3_TTS_SAMPLING); a seeded request gives the
    pipeline's bytes alone and while other requests share its steps."""
    client, pipe = clients["custom_voice"], pipes["custom_voice"]
    requests = [
        {"voice": "vivian", "extra_body": {"seed": 5}},
        {"voice": "aiden", "input": OTHER_TEXT, "extra_body": {"seed": 6, "temperature": 0.7, "top_k": 20}},
        {"voice": "eric", "extra_body": {"seed": 7, "top_p": 0.9, "language": "chinese"}},
        {"voice": "aiden", "extra_body": {"temperature": 0}},
    ]
    expected = _streamed_pcm(pipe, TEXT, voice="vivian", sampling=QWEN3_TTS_SAMPLING, seed=5)
    alone = [_speech(client, "custom_voice", **request) for request in requests]
    assert alone[0] == expected
    tuned = SamplingParams(temperature=0.7, top_k=20, top_p=1.0, repetition_penalty=1.05)
    assert alone[1] == _streamed_pcm(pipe, OTHER_TEXT, voice="aiden", sampling=tuned, seed=6)
    assert alone[0] != _speech(client, "custom_voice", voice="vivian", extra_body={"temperature": 0})
    loaded = [None] * (2 * len(requests))
    barrier = threading.Barrier(len(loaded))

    def send(i):
        barrier.wait()
        loaded[i] = _speech(client, "custom_voice", **requests[i % len(requests)])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(loaded))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert loaded == alone + alone


BAD_INPUT = [
    ("custom_voice", {"voice": "nobody"}, "voice", ["'nobody'", "aiden", "eric", "vivian"]),
    ("custom_voice", {"voice": "aiden", "language": "klingon"}, "language",
     ["'klingon'", "auto", "chinese", "english"]),
    ("custom_voice", {"voice": "aiden", "instructions": "whisper"}, "instructions", ["ignores instructions"]),
    ("custom_voice", {"voice": "aiden", "task_type": "VoiceDesign"}, "task_type", ["serves CustomVoice"]),
    ("custom_voice", {"voice": "aiden", "task_type": "Base"}, "task_type", ["Base model"]),
    ("custom_voice", {"voice": "aiden", "task_type": "Clone"}, "task_type", ["CustomVoice", "VoiceDesign"]),
    ("custom_voice", {"voice": "aiden", "input": "   "}, "input", ["empty"]),
    ("custom_voice", {"voice": "aiden", "input": ""}, "input", []),
    ("custom_voice", {"voice": "aiden", "language": 3}, "language", []),
    ("voice_design", {}, "instructions", ["needs instructions"]),
    ("voice_design", {"instructions": "  "}, "instructions", ["needs instructions"]),
    ("voice_design", {"instructions": INSTRUCTIONS, "voice": "aiden"}, "voice", ["no named voices"]),
    ("voice_design", {"instructions": INSTRUCTIONS, "task_type": "CustomVoice"}, "task_type", ["serves VoiceDesign"]),
]


@pytest.mark.parametrize("kind, fields, param, words", BAD_INPUT)
def test_bad_input_is_a_400_naming_the_field(servers, kind, fields, param, words):
    body = {"model": MODELS[kind], "input": TEXT, **fields}
    reply = httpx.post(f"{servers[kind]}/v1/audio/speech", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for word in words:
        assert word in error["message"]


def test_omni_model_refuses_the_tts_fields():
    """A model with a thinker takes none of the Qwen3-TTS fields, and needs a voice."""
    context = ServingContext(Engine(Qwen3OmniFamily.tiny(0)), ("omnimtp-tiny",), 1 << 20, 64)
    assert speech_voice(context, "Ethan", None, None, None) == "ethan"
    for name, arguments in (("language", ("ethan", "english", None, None)),
                            ("instructions", ("ethan", None, "calm", None)),
                            ("task_type", ("ethan", None, None, "CustomVoice")), ("voice", (None, None, None, None))):
        with pytest.raises(APIError) as caught:
            speech_voice(context, *arguments)
        assert caught.value.status == 400 and caught.value.param == name


def test_chat_on_a_tts_model_is_a_400(clients):
    with pytest.raises(openai.BadRequestError) as caught:
        clients["custom_voice"].chat.completions.create(model=MODELS["custom_voice"],
                                                        messages=[{"role": "user", "content": "hi"}])
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "model" and "has no chat" in error["message"]


def test_models_say_what_the_model_is(clients):
    (custom,) = clients["custom_voice"].models.list().data
    assert custom.id == "tts-custom" and custom.owned_by == "omnimtp"
    card = custom.model_dump()
    assert card["family"] == "qwen3_tts" and card["tts_model_type"] == "custom_voice"
    assert card["task_type"] == "CustomVoice" and card["endpoints"] == ["/v1/audio/speech", "/v1/audio/speech/batch",
                                                                       "/v1/audio/speech/stream"]
    assert card["voices"] == ["aiden", "eric", "vivian"] and card["languages"] == ["auto", "chinese", "english"]
    assert card["takes_instructions"] is False  # the tiny CustomVoice is a 0.6B, which ignores instructions
    design = clients["voice_design"].models.list().data[0].model_dump()
    assert (design["tts_model_type"], design["task_type"], design["voices"]) == ("voice_design", "VoiceDesign", [])
    assert design["takes_instructions"] is True


@pytest.fixture(scope="module")
def checkpoint(pipes, tmp_path_factory):
    path = tmp_path_factory.mktemp("served") / "tts"
    pipes["custom_voice"].save_pretrained(path)
    return str(path)


def test_serve_builds_a_tts_engine_from_a_checkpoint(checkpoint):
    """`omnimtp serve --model TTS_DIR`'s engine: the checkpoint's family, and its predictor warms up."""
    from omnimtp.server.build import build_engine

    engine = build_engine(checkpoint, max_batch_size=2, max_frames=4)
    assert engine.model_id == "tts" and engine.model_card()["tts_model_type"] == "custom_voice"
    assert engine.speakers == ("aiden", "eric", "vivian") and not engine.has_chat
    engine.family.warm_up(2)


def test_batch_rows_on_a_tts_model(checkpoint, tmp_path):
    """`omnimtp batch`'s prompt file takes a Qwen3-TTS row's language and instructions, and the rows are checked
    against the model before Ray starts: no chat messages on a TTS model, no TTS fields on an Omni one."""
    from omnimtp.batch import BatchInputError, check_model_fields, read_prompts

    lines = [{"id": "a", "prompt": TEXT, "voice": "aiden", "language": "english"},
             {"id": "b", "prompt": OTHER_TEXT, "instructions": "calm", "seed": 3}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = read_prompts(str(path))
    assert rows == lines
    check_model_fields(checkpoint, rows)
    with pytest.raises(ValueError, match="id 'a': language is taken only by a Qwen3-TTS model"):
        check_model_fields(None, rows)
    with pytest.raises(ValueError, match="id 'c': a Qwen3-TTS model has no chat"):
        check_model_fields(checkpoint, [{"id": "c", "messages": [{"role": "user", "content": "hi"}]}])
    path.write_text(json.dumps({"id": "d", "prompt": TEXT, "language": 1}) + "\n")
    with pytest.raises(BatchInputError, match="language must be a string"):
        read_prompts(str(path))


def test_frames_that_leave_the_talker_no_room_for_text_are_a_400_naming_input():
    """A text longer than the talker's positions leave beside the frames is cut into segments that fit
    (`test_long_speech.py` speaks one); when max_frames leaves no room for any text, every text is refused
    before it is queued (400, `input`, context_length_exceeded), as the pipeline refuses it (a ValueError
    naming max_frames)."""
    family = Qwen3TTSFamily.tiny(0)
    text = "a b c d e f g h i j k l m n o p q r s t"
    full = family.max_positions - 16  # 8 rows of structure + 8 template ids: not one text id fits
    pipe = OmniPipeline.tiny(family="qwen3_tts", max_frames=full)
    with pytest.raises(ValueError, match="max_frames"):
        pipe.speech("a b", max_frames=full)
    engine = Engine(family, model_id=MODELS["custom_voice"], max_frames=full, max_batch_size=1)
    with running_server(create_app(engine)) as base:
        body = {"model": MODELS["custom_voice"], "input": "a b", "response_format": "pcm"}
        reply = httpx.post(f"{base}/v1/audio/speech", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
        assert "talker positions" in error["message"] and str(family.max_positions) in error["message"]
    roomy = Engine(family, model_id=MODELS["custom_voice"], max_frames=family.max_positions - 24, max_batch_size=1)
    request = EngineRequest(messages=None, speak_text=text, speaker=family.voice(), sampling=SamplingParams(),
                            seed=None, max_new_tokens=0)
    segments = list(roomy.speech_segments(request))  # 8 text bytes each, cut between words
    assert [family.tokenizer.decode(ids[3:-5]) for ids in segments] == ["a b c d", "e f g h", "i j k l", "m n o p",
                                                                        "q r s t"]
    assert all(family.talker_positions(ids, family.voice(), roomy.config.max_frames) <= family.max_positions
               for ids in segments)
