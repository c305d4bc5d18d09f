"""Saved voices over HTTP (`/v1/audio/voices`) and voice cloning in `/v1/audio/speech`, on real uvicorn servers
over the tiny seeded Qwen3-TTS Base and CustomVoice models: a voice saved from a reference recording speaks
the same bytes as the Python API with the same voice and seed, before and after a restart; the bad-input
table; the API key; a server SIGKILLed inside a POST leaves the store whole."""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import torch
from audio_checks import assert_audible
from server_harness import free_port, running_server

from omnimtp.families.qwen3_tts import Qwen3TTSFamily
from omnimtp.pipeline import OmniPipeline
from omnimtp.server.app import create_app
from omnimtp.server.audio import to_pcm16
from omnimtp.server.scheduler import Engine
from omnimtp.server.voice_store import VoiceStore
from omnimtp.voice import Voice

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FRAMES = 6
MAX_REF_SECONDS = 4.0
SAMPLE_RATE = 24_000
TEXT = "Hello there, cloned voice."
REF_TEXT = "This is my reference."
CONSENT = "The speaker agreed in writing to have this voice cloned (form 17)."
MODELS = {"base": "tts-base", "custom_voice": "tts-custom"}


def _recording(seconds: float, pitch: float = 120.0, seed: int = 0) -> np.ndarray:
    """A seeded voiced-speech-like test signal: a pitch with harmonics, a syllable-rate envelope, a little noise."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    voiced = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    noise = 0.01 * np.random.default_rng(seed).standard_normal(t.size)
    return (0.2 * voiced * envelope + noise).astype(np.float32)


def _wav(samples: np.ndarray, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, SAMPLE_RATE, format="WAV", subtype=subtype)
    return buffer.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


REFERENCE_WAV = _wav(_recording(2.0))
OTHER_WAV = _wav(_recording(2.0, pitch=320.0, seed=1))


def _samples(wav: bytes) -> tuple[np.ndarray, int]:
    """What the Python API is given for the same recording: the file's samples."""
    samples, sample_rate = sf.read(io.BytesIO(wav), dtype="float32")
    return samples, sample_rate


REFERENCE = _samples(REFERENCE_WAV)


# The tiny Base model's speech-tokenizer encoder takes some of its initial weights (conv biases) from torch's
# global RNG: every tiny model here is built from the same global state, so the server's and the Python API's
# are the same weights.
_TINY_GLOBAL_SEED = 0


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(_TINY_GLOBAL_SEED)
    return OmniPipeline.tiny(family="qwen3_tts", tts_model_type="base", max_frames=MAX_FRAMES)


def _engine(kind: str) -> Engine:
    torch.manual_seed(_TINY_GLOBAL_SEED)
    return Engine(Qwen3TTSFamily.tiny(0, kind), model_id=MODELS[kind], max_frames=MAX_FRAMES, max_batch_size=4)


def _app(kind: str, voices_dir, **options):
    return create_app(_engine(kind), voice_store=VoiceStore(voices_dir, max_voices=options.pop("max_voices", 100)),
                      max_ref_seconds=MAX_REF_SECONDS, **options)


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def servers(voices_dir, tmp_path_factory):
    urls = {}
    with running_server(_app("base", voices_dir)) as urls["base"], \
            running_server(_app("custom_voice", tmp_path_factory.mktemp("custom-voices"))) as urls["custom_voice"]:
        yield urls


def _expected_pcm(pipe, voice: Voice, seed: int | None = None, text: str = TEXT) -> bytes:
    """The Python API's streamed audio of `text` in `voice` as PCM16 bytes (audible asserted)."""
    from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING

    kwargs = {} if seed is None else {"sampling": QWEN3_TTS_SAMPLING, "seed": seed}
    *chunks, output = list(pipe.stream_speech(text, voice=voice, **kwargs))
    audio = np.concatenate(chunks)
    assert output.codes.shape[-1] >= 2
    assert_audible(audio)
    return to_pcm16(audio).tobytes()


def _speak(url: str, **fields) -> httpx.Response:
    body = {"model": MODELS["base"], "input": TEXT, "response_format": "pcm", **fields}
    return httpx.post(f"{url}/v1/audio/speech", json=body, timeout=300)


def _greedy(url: str, **fields) -> bytes:
    reply = _speak(url, temperature=0, **fields)
    assert reply.status_code == 200, reply.text
    return reply.content


def _post_form(url: str, wav: bytes, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/voices", data=fields, files={"audio_sample": ("ref.wav", wav, "audio/wav")},
                      timeout=300)


def test_a_saved_voice_speaks_as_the_python_api_before_and_after_a_restart(pipe, servers, voices_dir):
    url = servers["base"]
    reply = _post_form(url, REFERENCE_WAV, name="alice", consent=CONSENT, ref_text=REF_TEXT, user="user-7")
    assert reply.status_code == 200, reply.text
    created = reply.json()["voice"]
    assert (created["name"], created["mode"], created["seconds"], created["model"]) == ("alice", "icl", 2.0, "tts-base")
    assert created["consent"]["statement"] == CONSENT and created["consent"]["user"] == "user-7"
    assert created["consent"]["client"] == "127.0.0.1" and created["ref_text"] == REF_TEXT
    reply = httpx.post(f"{url}/v1/audio/voices", json={"name": "bob", "consent": CONSENT,
                                                       "audio_sample": _b64(OTHER_WAV), "x_vector_only_mode": True},
                       timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["voice"]["mode"] == "x_vector"

    listed = httpx.get(f"{url}/v1/audio/voices", timeout=60).json()
    assert listed["voices"] == []  # a Base model has no speakers of its own
    assert [(v["name"], v["mode"], v["seconds"]) for v in listed["uploaded_voices"]] == [
        ("alice", "icl", 2.0), ("bob", "x_vector", 2.0)]
    assert httpx.get(f"{url}/v1/audio/voices/alice", timeout=60).json() == created

    alice = pipe.create_voice(ref_audio=REFERENCE, ref_text=REF_TEXT)
    bob = pipe.create_voice(ref_audio=_samples(OTHER_WAV), x_vector_only=True)
    expected = {"alice": _expected_pcm(pipe, alice), "bob": _expected_pcm(pipe, bob),
                "alice-seeded": _expected_pcm(pipe, alice, seed=11)}
    assert len(set(expected.values())) == 3
    spoken = {"alice": _greedy(url, voice="alice", task_type="Base"), "bob": _greedy(url, voice="bob")}
    seeded = _speak(url, voice="alice", seed=11)
    assert seeded.status_code == 200, seeded.text
    spoken["alice-seeded"] = seeded.content
    assert spoken == expected
    # x_vector_only_mode speaks a saved in-context voice from its x-vector alone
    assert _greedy(url, voice="alice", x_vector_only_mode=True) == _expected_pcm(pipe, alice.x_vector_only())

    # a restart: a new server process's app on the same directory speaks the same bytes
    with running_server(_app("base", voices_dir)) as restarted:
        assert _greedy(restarted, voice="alice") == expected["alice"]
        assert _speak(restarted, voice="alice", seed=11).content == expected["alice-seeded"]
        assert httpx.delete(f"{restarted}/v1/audio/voices/bob", timeout=60).json()["success"] is True
    # the first server sees the other's delete: one store
    reply = _speak(url, voice="bob")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "voice"
    assert "'bob'" in reply.json()["error"]["message"] and "alice" in reply.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/audio/voices/bob", timeout=60).status_code == 404
    assert httpx.delete(f"{url}/v1/audio/voices/bob", timeout=60).status_code == 404


def test_inline_clone_fields_speak_as_the_python_api(pipe, servers):
    """ref_audio (base64 or a data: URL) + ref_text, x_vector_only_mode and speaker_embedding, per request."""
    url = servers["base"]
    icl = _expected_pcm(pipe, pipe.create_voice(ref_audio=REFERENCE, ref_text=REF_TEXT))
    x_vector = pipe.create_voice(ref_audio=REFERENCE, x_vector_only=True)
    assert _greedy(url, ref_audio=_b64(REFERENCE_WAV), ref_text=REF_TEXT) == icl
    assert _greedy(url, ref_audio="data:audio/wav;base64," + _b64(REFERENCE_WAV), ref_text=REF_TEXT,
                   task_type="Base") == icl
    flat = _expected_pcm(pipe, x_vector)
    assert flat != icl
    assert _greedy(url, ref_audio=_b64(REFERENCE_WAV), ref_text=REF_TEXT, x_vector_only_mode=True) == flat
    assert _greedy(url, ref_audio=_b64(REFERENCE_WAV)) == flat  # no transcript: the x-vector alone
    assert _greedy(url, speaker_embedding=x_vector.speaker_embedding.tolist()) == flat


def test_a_base_model_speaks_without_a_voice_as_the_python_api(pipe, servers):
    """No voice, recording or embedding: no speaker row, as `OmniPipeline.speech` and `omnimtp speak` speak."""
    assert _greedy(servers["base"]) == _expected_pcm(pipe, None)


def test_the_openai_client_speaks_a_saved_voice(servers):
    url = servers["base"]
    reply = _post_form(url, REFERENCE_WAV, name="carol", consent=CONSENT)
    assert reply.status_code == 200, reply.text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    spoken = client.audio.speech.create(model=MODELS["base"], input=TEXT, voice="carol", response_format="pcm",
                                        extra_body={"temperature": 0}).content
    assert spoken == _greedy(url, voice="carol")
    assert spoken != _greedy(url, ref_audio=_b64(OTHER_WAV))  # another recording, another voice


BAD_VOICE_POSTS = [
    ({"name": "v1", "audio_sample": _b64(REFERENCE_WAV)}, 400, "consent", []),
    ({"name": "v1", "consent": "  ", "audio_sample": _b64(REFERENCE_WAV)}, 400, "consent", ["required"]),
    ({"name": "v1", "consent": CONSENT, "audio_sample": _b64(_wav(_recording(0.5)))}, 400, "audio_sample",
     ["audio_sample:", "shorter"]),  # the field the client sent, not the engine's argument name
    ({"name": "v1", "consent": CONSENT, "audio_sample": _b64(_wav(_recording(2.0) * 1e30, "FLOAT"))}, 400,
     "audio_sample", ["audio_sample:", "beyond ±16"]),
    ({"name": "v1", "consent": CONSENT, "audio_sample": _b64(_wav(_recording(MAX_REF_SECONDS + 1)))}, 400,
     "audio_sample", ["limit"]),
    ({"name": "v1", "consent": CONSENT, "audio_sample": _b64(b"this is not audio at all" * 40)}, 400,
     "audio_sample", ["decoded"]),
    ({"name": "v1", "consent": CONSENT, "audio_sample": "not base64!"}, 400, "audio_sample", ["base64"]),
    ({"name": "a/b", "consent": CONSENT, "audio_sample": _b64(REFERENCE_WAV)}, 400, "name", ["not a voice name"]),
    ({"name": "../etc", "consent": CONSENT, "audio_sample": _b64(REFERENCE_WAV)}, 400, "name", ["not a voice name"]),
    ({"name": "x" * 65, "consent": CONSENT, "audio_sample": _b64(REFERENCE_WAV)}, 400, "name", ["not a voice name"]),
    ({"name": "", "consent": CONSENT, "audio_sample": _b64(REFERENCE_WAV)}, 400, "name", []),
    ({"name": "v1", "consent": CONSENT}, 400, "audio_sample", ["audio_sample", "speaker_embedding"]),
    ({"name": "v1", "consent": CONSENT, "audio_sample": _b64(REFERENCE_WAV), "speaker_embedding": [0.5] * 64},
     400, "speaker_embedding", []),
    ({"name": "v1", "consent": CONSENT, "speaker_embedding": [0.5] * 64, "ref_text": "hi"}, 400, "ref_text", []),
    ({"name": "v1", "consent": CONSENT, "speaker_embedding": [0.5] * 3}, 400, "speaker_embedding", ["64"]),
    ({"name": "v1", "consent": CONSENT, "audio_sample": _b64(REFERENCE_WAV), "colour": "red"}, 400, "colour",
     ["Unrecognized"]),
    ({"name": "v1", "consent": CONSENT, "audio_sample": _b64(REFERENCE_WAV), "model": "nope"}, 404, "model", []),
]


@pytest.mark.parametrize("body, status, param, words", BAD_VOICE_POSTS)
def test_bad_voice_posts_are_4xx_naming_the_field(servers, body, status, param, words):
    reply = httpx.post(f"{servers['base']}/v1/audio/voices", json=body, timeout=300)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    for word in words:
        assert word in error["message"]
    assert "v1" not in [v["name"] for v in httpx.get(f"{servers['base']}/v1/audio/voices").json()["uploaded_voices"]]


def test_duplicates_and_unknowns(servers):
    url = servers["base"]
    body = {"name": "dora", "consent": CONSENT, "speaker_embedding": [0.25] * 64}
    assert httpx.post(f"{url}/v1/audio/voices", json=body, timeout=60).status_code == 200
    reply = httpx.post(f"{url}/v1/audio/voices", json={**body, "speaker_embedding": [0.5] * 64}, timeout=60)
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "voice_exists"
    assert _greedy(url, voice="dora") == _greedy(url, speaker_embedding=[0.25] * 64)  # the first one stayed
    for method in ("GET", "DELETE"):
        reply = httpx.request(method, f"{url}/v1/audio/voices/nobody", timeout=60)
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"
    reply = httpx.get(f"{url}/v1/audio/voices/a%2Fb", timeout=60)
    assert reply.status_code in (400, 404) and "error" in reply.json()


BAD_BASE_SPEECH = [
    ({"voice": "nobody"}, "voice", ["'nobody'"]),
    ({"x_vector_only_mode": True}, "x_vector_only_mode", ["cloned voice"]),
    ({"voice": "dora", "ref_audio": _b64(REFERENCE_WAV)}, "ref_audio", ["one of"]),
    ({"ref_text": REF_TEXT}, "ref_text", []),
    ({"ref_audio": _b64(_wav(_recording(0.3)))}, "ref_audio", ["shorter"]),
    ({"ref_audio": "data:image/png;base64," + _b64(REFERENCE_WAV)}, "ref_audio", ["audio"]),
    ({"ref_audio": "https://example.com/a.wav"}, "ref_audio", []),
    ({"speaker_embedding": [0.5] * 3}, "speaker_embedding", ["64"]),
    ({"speaker_embedding": [0.5] * 64, "task_type": "CustomVoice"}, "task_type", ["serves Base"]),
    ({"speaker_embedding": [0.5] * 64, "instructions": "whisper"}, "instructions", []),
]


@pytest.mark.parametrize("fields, param, words", BAD_BASE_SPEECH)
def test_bad_clone_speech_is_a_400_naming_the_field(servers, fields, param, words):
    reply = _speak(servers["base"], **fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"]


@pytest.mark.parametrize("field, value", [("ref_audio", _b64(REFERENCE_WAV)), ("ref_text", REF_TEXT),
                                          ("x_vector_only_mode", True), ("speaker_embedding", [0.5] * 64)])
def test_base_only_fields_on_a_custom_voice_model_are_a_400(servers, field, value):
    body = {"model": MODELS["custom_voice"], "input": TEXT, "voice": "aiden", field: value}
    reply = httpx.post(f"{servers['custom_voice']}/v1/audio/speech", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and "Base" in error["message"] and "CustomVoice" in error["message"]


def test_cloning_on_a_custom_voice_model_is_a_400_naming_the_model(servers):
    url = servers["custom_voice"]
    reply = _post_form(url, REFERENCE_WAV, name="eve", consent=CONSENT)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"
    assert "Base" in reply.json()["error"]["message"]
    listed = httpx.get(f"{url}/v1/audio/voices", timeout=60).json()
    assert listed == {"voices": ["aiden", "eric", "vivian"], "voice_aliases": {}, "uploaded_voices": []}


def test_content_types_and_the_body_limit(tmp_path, servers):
    """The voices route takes a multipart form or JSON; /v1/audio/speech still takes only JSON; a form is held to
    the body limit like JSON."""
    url = servers["base"]
    reply = httpx.post(f"{url}/v1/audio/speech", data={"input": TEXT}, files={"f": ("a.wav", b"x", "audio/wav")},
                       timeout=60)
    assert reply.status_code == 415
    reply = httpx.post(f"{url}/v1/audio/voices", content=b"name=x", headers={"content-type": "text/plain"}, timeout=60)
    assert reply.status_code == 415 and "multipart/form-data" in reply.json()["error"]["message"]
    reply = _post_form(url, REFERENCE_WAV, name="fay", consent=CONSENT, x_vector_only_mode="maybe")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "x_vector_only_mode"
    reply = httpx.post(f"{url}/v1/audio/voices", data={"name": "fay", "consent": CONSENT},
                       files={"other": ("a.wav", REFERENCE_WAV, "audio/wav")}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "other"
    reply = httpx.post(f"{url}/v1/audio/voices", data={"name": "fay", "consent": CONSENT, "audio_sample": "abc"},
                       files={"f": ("a.wav", b"", "audio/wav")}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "audio_sample"  # a file part, not text
    reply = httpx.post(f"{url}/v1/audio/voices", data={"name": "fay", "consent": CONSENT, "audio_sample": "abc"},
                       timeout=60)
    assert reply.status_code == 415  # a urlencoded form is not a multipart one
    with running_server(create_app(_engine("base"), voice_store=VoiceStore(tmp_path), max_body_bytes=50_000)) as small:
        reply = _post_form(small, _wav(_recording(2.0)), name="fay", consent=CONSENT)  # ~96 kB
        assert reply.status_code == 413
        assert httpx.get(f"{small}/v1/audio/voices").json()["uploaded_voices"] == []


def test_the_api_key_guards_the_voice_routes_and_the_store_is_bounded(tmp_path):
    store = VoiceStore(tmp_path, max_voices=1)
    with running_server(create_app(_engine("base"), api_key="sesame", voice_store=store)) as url:
        body = {"name": "gil", "consent": CONSENT, "speaker_embedding": [0.5] * 64}
        for method, path, payload in (("GET", "/v1/audio/voices", None), ("POST", "/v1/audio/voices", body),
                                      ("GET", "/v1/audio/voices/gil", None), ("DELETE", "/v1/audio/voices/gil", None)):
            reply = httpx.request(method, f"{url}{path}", json=payload, timeout=60)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        assert VoiceStore(tmp_path).list() == []
        key = {"Authorization": "Bearer sesame"}
        assert httpx.post(f"{url}/v1/audio/voices", json=body, headers=key, timeout=60).status_code == 200
        assert httpx.get(f"{url}/v1/audio/voices/gil", headers=key, timeout=60).json()["name"] == "gil"
        reply = httpx.post(f"{url}/v1/audio/voices", json={**body, "name": "hal"}, headers=key, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "too_many_voices"
        assert httpx.delete(f"{url}/v1/audio/voices/gil", headers=key, timeout=60).status_code == 200


def test_without_a_voices_dir_nothing_is_saved_but_inline_cloning_works(pipe):
    with running_server(create_app(_engine("base"))) as url:
        reply = _post_form(url, REFERENCE_WAV, name="hal", consent=CONSENT)
        assert reply.status_code == 400 and "--voices-dir" in reply.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/audio/voices").json() == {"voices": [], "voice_aliases": {}, "uploaded_voices": []}
        assert httpx.get(f"{url}/v1/audio/voices/hal").status_code == 404
        flat = pipe.create_voice(ref_audio=REFERENCE, x_vector_only=True)
        assert _greedy(url, ref_audio=_b64(REFERENCE_WAV)) == _expected_pcm(pipe, flat)


_FAULT_SERVER = textwrap.dedent("""
    import sys, time
    import torch
    import uvicorn
    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.server.app import create_app
    from omnimtp.server.scheduler import Engine
    from omnimtp.server.voice_store import VoiceStore

    directory, port = sys.argv[1], int(sys.argv[2])

    def hold():  # the window: the voice's row is written, the transaction not committed
        print("in transaction", flush=True)
        time.sleep(120)

    store = VoiceStore(directory, in_transaction=hold)
    torch.manual_seed(0)
    app = create_app(Engine(Qwen3TTSFamily.tiny(0, "base"), model_id="tts-base", max_frames=6), voice_store=store)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
""")


def test_a_server_killed_during_a_post_leaves_the_voice_complete_or_absent(pipe, tmp_path):
    """A server process SIGKILLed while a POST /v1/audio/voices holds its transaction open: the store opens
    afterwards, the killed voice is absent (its name free), a voice saved before is complete and speaks."""
    saved = pipe.create_voice(ref_audio=REFERENCE, ref_text=REF_TEXT)
    store = VoiceStore(tmp_path)
    from omnimtp.server.voice_store import NewVoice

    store.add(NewVoice(name="kept", voice=saved.to_bytes(), mode=saved.mode, seconds=2.0, consent=CONSENT,
                       model="tts-base", ref_text=REF_TEXT))
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", _FAULT_SERVER, str(tmp_path), str(port)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert child.poll() is None and time.monotonic() < deadline, "the fault server did not start"
            time.sleep(0.2)
        replies = []
        post = threading.Thread(target=lambda: replies.append(_try_post(url)))
        post.start()
        assert child.stdout.readline() == "in transaction\n"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        post.join(60)
        assert replies == [None]  # the client saw the connection die, no answer
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    reopened = VoiceStore(tmp_path)
    assert [v.name for v in reopened.list()] == ["kept"] and reopened.voice_bytes("killed") is None
    with running_server(create_app(_engine("base"), voice_store=reopened)) as url:
        assert _greedy(url, voice="kept") == _expected_pcm(pipe, saved)
        assert _post_form(url, REFERENCE_WAV, name="killed", consent=CONSENT).status_code == 200
        assert _greedy(url, voice="killed") == _greedy(url, ref_audio=_b64(REFERENCE_WAV))


def _try_post(url: str):
    try:
        return _post_form(url, REFERENCE_WAV, name="killed", consent=CONSENT).status_code
    except httpx.TransportError:
        return None
