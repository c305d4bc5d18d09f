"""OpenAI's model and voice names on a server with `openai_aliases` (`serve`'s default): a client whose defaults
name OpenAI's works unchanged (`/v1/models` and `/v1/audio/voices` list the aliases; "alloy" speaks as the
default speaker; a realtime session with LiveKit's `gpt-realtime` / voice `marin` / `gpt-4o-mini-transcribe` is
served); configured aliases and their refusals; speech SSE deltas in the asked response_format."""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import openai
import pytest
from server_harness import running_server

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.server.aliases import OPENAI_MODELS, OPENAI_VOICES, speaker_aliases
from omnimtp.server.app import create_app
from omnimtp.server.build import _voice_aliases
from omnimtp.server.scheduler import Engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server():
    engine = Engine(Qwen3OmniFamily.tiny(0), max_frames=12, max_batch_size=2)
    app = create_app(engine, openai_aliases=True, voice_aliases={"Narrator": "CHELSIE"})
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", websocket_base_url=server.replace("http://", "ws://") + "/v1",
                         api_key="unused", max_retries=0)


def test_models_and_voices_list_the_aliases(client, server):
    assert {model.id for model in client.models.list()} == {"omnimtp-tiny", *OPENAI_MODELS}
    voices = client.get("/audio/voices", cast_to=object)
    assert voices["voice_aliases"] == {**dict.fromkeys(OPENAI_VOICES, "ethan"), "narrator": "chelsie"}


def test_a_chat_model_name_frameworks_default_to_answers_as_the_served_model(client):
    """pipecat's OpenAILLMService and LiveKit's openai.LLM send model "gpt-4.1": the served model answers it."""
    def reply(model: str) -> str:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, seed=3).choices[0].message.content

    assert reply("gpt-4.1") == reply("gpt-4o-mini") == reply("omnimtp-tiny")


def test_an_openai_voice_speaks_as_the_speaker_it_names(client):
    def speak(voice: str, model: str = "tts-1") -> bytes:
        return client.audio.speech.create(model=model, voice=voice, input="Good morning", response_format="pcm",
                                          extra_body={"seed": 3}).content

    ethan = speak("ethan", "omnimtp-tiny")
    assert np.abs(np.frombuffer(ethan, "<i2")).max() > 100
    assert speak("alloy") == speak("Marin", "gpt-4o-mini-tts") == ethan
    assert speak("narrator") == speak("chelsie") != ethan
    with pytest.raises(openai.BadRequestError) as raised:
        speak("nobody")
    assert raised.value.body["param"] == "voice" and "alloy" in raised.value.body["message"]


def test_a_realtime_session_with_livekits_defaults_is_served(client):
    with client.realtime.connect(model="gpt-realtime") as connection:
        assert connection.recv().type == "session.created"
        connection.session.update(session={"type": "realtime", "max_output_tokens": 4, "audio": {
            "input": {"turn_detection": None, "transcription": {"model": "gpt-4o-mini-transcribe"}},
            "output": {"voice": "marin"}}})
        updated = connection.recv()
        assert updated.type == "session.updated", updated
        assert updated.session.audio.output.voice == "ethan"


def test_speech_sse_deltas_are_the_asked_format(client, server):
    import httpx

    body = {"model": "tts-1", "input": "Good morning", "voice": "alloy", "seed": 3}
    with httpx.Client(base_url=server, timeout=60) as http:
        whole = http.post("/v1/audio/speech", json={**body, "response_format": "mp3"}).content
        sse = http.post("/v1/audio/speech", json={**body, "response_format": "mp3", "stream_format": "sse"})
        refused = http.post("/v1/audio/speech", json={**body, "response_format": "flac", "stream_format": "sse"})
    events = [json.loads(line[len("data: "):]) for line in sse.text.split("\n\n") if line]
    assert events[-1]["type"] == "speech.audio.done"
    joined = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    assert joined == whole and joined[:3] != b"RIF"
    with av.open(io.BytesIO(joined)) as container:
        assert container.format.name == "mp3" and container.streams.audio[0].codec_context.name.startswith("mp3")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


def test_aliases_are_checked():
    speakers = ("Ethan", "Chelsie")
    assert speaker_aliases(speakers, "Ethan", {"Host": "chelsie"}, openai=False) == {"host": "Chelsie"}
    assert speaker_aliases(speakers, None, {}, openai=True) == {}  # a model with no default speaker
    for given, words in (({"x": "nobody"}, "not one of the model's speakers"), ({"ethan": "Chelsie"}, "not a new")):
        with pytest.raises(ValueError, match=words):
            speaker_aliases(speakers, "Ethan", given, openai=True)
    assert _voice_aliases(["alloy=chelsie"]) == {"alloy": "chelsie"}
    with pytest.raises(ValueError, match="--voice-alias"):
        _voice_aliases(["alloy"])
