"""Ray Serve replicas and Ray Data batch jobs on one local Ray instance (started once for the module).

The deployment is what `omnimtp serve --replicas 2` runs (`ray_serve.deploy` of the parsed command
line): 2 replicas of the tiny model at 0.5 CPU each (the instance has 2 logical CPUs, so that the batch
job's 2 actors at 0.5 CPU fit beside them), spoken to with the official `openai` client (its realtime API
for /v1/realtime) and the websockets package. Saved voices and the per-replica session limit run on a second
application on the same proxy, under the route prefix /tts: 2 replicas of the tiny Qwen3-TTS Base model."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import ray
import soundfile as sf
from audio_checks import assert_audible, assert_audio_equal
from media_samples import tone
from ray import serve
from server_harness import free_port, running_server
from websockets.exceptions import InvalidStatus

from omnimtp.cli import build_parser
from omnimtp.server import ray_serve
from omnimtp.server.audio import to_pcm16
from omnimtp.server.build import build_app

# The reference engine in this process runs one torch thread, as each replica does (0.5 CPU): a
# different thread count may round a few samples differently.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"
MAX_FRAMES = 6


def _serve_args(port: int):
    return build_parser().parse_args([
        "serve", "--replicas", "2", "--num-cpus-per-replica", "0.5", "--eager", "--max-batch-size", "4",
        "--max-frames", str(MAX_FRAMES), "--max-tokens-limit", "64", "--max-body-bytes", "32768",
        "--api-key", API_KEY, "--host", "127.0.0.1", "--port", str(port), "--timeout-graceful-shutdown", "10",
    ])


@pytest.fixture(scope="module")
def ray_address():
    # Every worker of the instance (also those of the batch job's driver, a separate process) imports
    # this checkout's omnimtp.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = ROOT
    ray_serve.init_ray(None, num_cpus=2, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        serve.shutdown()
        ray.shutdown()
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous


@pytest.fixture(scope="module")
def url(ray_address):
    port = free_port()
    ray_serve.deploy(_serve_args(port))
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single_process(ray_address):
    """The same command line without Ray: one engine in this process (the reference)."""
    _, app = build_app(_serve_args(0))
    with running_server(app) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _chat(client, seed, **kwargs):
    return client.chat.completions.create(
        model="omnimtp-tiny", messages=[{"role": "user", "content": "Hi there"}], modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"}, seed=seed, max_tokens=5, **kwargs,
    )


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def _replica_samples(url: str, route: str, status: str = "200") -> dict[str, float]:
    """omnimtp_requests_total of `route` by replica, from the deployment's /metrics."""
    counts = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("omnimtp_requests_total{") and f'route="{route}"' in line and f'status="{status}"' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            counts[replica] = float(line.rsplit(" ", 1)[1])
    return counts


def test_health_reports_every_replica(url):
    reply = httpx.get(f"{url}/health")
    assert reply.status_code == 200
    assert reply.json() == {"status": "ok", "replicas": {"running": 2, "total": 2}}


def test_seeded_chat_matches_the_single_process_server(client, single_process):
    ours = _chat(client, seed=7).choices[0].message
    reference = _chat(single_process, seed=7).choices[0].message
    assert ours.content == reference.content
    assert_audio_equal(_pcm(base64.b64decode(ours.audio.data)), _pcm(base64.b64decode(reference.audio.data)))


def _streamed(client, seed) -> tuple[str, np.ndarray]:
    text, pcm = [], []
    for chunk in _chat(client, seed=seed, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.delta.audio is not None and choice.delta.audio.data:
                pcm.append(base64.b64decode(choice.delta.audio.data))
    return "".join(text), _pcm(b"".join(pcm))


def test_streamed_chat_matches_the_single_process_server(client, single_process):
    text, samples = _streamed(client, seed=11)
    reference_text, reference = _streamed(single_process, seed=11)
    assert text == reference_text
    assert_audio_equal(samples, reference)


def test_speech_chunked_and_sse_match_the_single_process_server(client, single_process, url):
    speech = dict(model="omnimtp-tiny", voice="ethan", input="Hello there", response_format="wav",
                  extra_body={"seed": 3})
    samples, rate = sf.read(io.BytesIO(client.audio.speech.create(**speech).content), dtype="int16")
    reference, _ = sf.read(io.BytesIO(single_process.audio.speech.create(**speech).content), dtype="int16")
    assert rate == 24000
    assert_audio_equal(samples, reference)
    body = {"model": "omnimtp-tiny", "voice": "ethan", "input": "Hello there", "seed": 3, "stream_format": "sse",
            "response_format": "pcm"}  # (SSE deltas are the bytes of the asked format)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    events = [json.loads(line[len("data: "):]) for line in httpx.post(
        f"{url}/v1/audio/speech", json=body, headers=headers, timeout=120).text.splitlines()
        if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    streamed = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert_audio_equal(_pcm(streamed), reference)


def test_bad_input_is_an_openai_4xx(client, url):
    with pytest.raises(openai.BadRequestError) as bad_voice:
        client.audio.speech.create(model="omnimtp-tiny", voice="nobody", input="Hi")
    assert bad_voice.value.body["param"] == "voice"
    with pytest.raises(openai.NotFoundError) as bad_model:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert bad_model.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    not_json = httpx.post(f"{url}/v1/chat/completions", content=b"{bad", headers=headers)
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    too_large = httpx.post(f"{url}/v1/chat/completions", content=b" " * 40_000, headers=headers)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"


# -- WebSocket sessions through Serve's proxy ------------------------------------------------------------


def _replica_gauges(url: str, name: str, route: str) -> dict[str, float]:
    """A per-route gauge's value by replica, from the deployment's /metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and f'route="{route}"' in line:
            values[line.split('replica="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return values


def _realtime_turns(client, seed: int, turns: list, on_open=None) -> list[tuple[str, bytes]]:
    """One realtime session (manual turns, seeded): each turn (a text, or samples committed as input audio)
    answered; each reply's transcript and PCM16 bytes. on_open() runs once the session is configured."""
    replies = []
    with client.realtime.connect(model="omnimtp-tiny") as connection:
        assert connection.recv().type == "session.created"
        connection.session.update(session={"type": "realtime", "seed": seed, "max_output_tokens": 5,
                                           "audio": {"input": {"turn_detection": None}}})
        assert connection.recv().type == "session.updated"
        if on_open is not None:
            on_open()
        for turn in turns:
            if isinstance(turn, str):
                connection.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": turn}]})
            else:
                connection.input_audio_buffer.append(audio=base64.b64encode(to_pcm16(turn).tobytes()).decode())
                connection.input_audio_buffer.commit()
                assert connection.recv().type == "input_audio_buffer.committed"
            assert [connection.recv().type for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
            connection.response.create()
            text, pcm = [], []
            while (event := connection.recv()).type != "response.done":
                assert event.type != "error", event.error
                if event.type == "response.output_audio_transcript.delta":
                    text.append(event.delta)
                elif event.type == "response.output_audio.delta":
                    pcm.append(base64.b64decode(event.delta))
            assert event.response.status in ("completed", "incomplete"), event.response.status_details
            replies.append(("".join(text), b"".join(pcm)))
    return replies


def test_concurrent_realtime_sessions_on_two_replicas_match_the_single_process_server(client, single_process, url):
    """Two sessions at once, one on each replica (the second opens once the first is open, and the router sends
    it to the idle replica; opened at the same instant, both may see two idle replicas and pick the same one),
    each holding its conversation on its replica for two turns: each reply is the single-process server's."""
    sessions = {"a": (21, ["Hi there", "And then?"]), "b": (22, [tone(0.5, 24000, hz=300), "Say more"])}
    both_open, counted, first_open = threading.Barrier(3, timeout=120), threading.Event(), threading.Event()
    replies: dict = {}

    def hold_open():  # until the gauges are read: a session may otherwise end before its replica pushes them
        first_open.set()
        both_open.wait()
        counted.wait(60)

    def converse(name):
        seed, turns = sessions[name]
        if name == "b":
            first_open.wait(120)
        replies[name] = _realtime_turns(client, seed, turns, on_open=hold_open)

    threads = [threading.Thread(target=converse, args=(name,)) for name in sessions]
    for thread in threads:
        thread.start()
    both_open.wait()
    deadline = time.monotonic() + 15
    while True:  # each replica pushes its gauges every second
        active = _replica_gauges(url, "omnimtp_websocket_active_sessions", "/v1/realtime")
        if sorted(active.values()) == [1.0, 1.0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    counted.set()
    for thread in threads:
        thread.join(300)
    assert sorted(active.values()) == [1.0, 1.0], f"the sessions did not run on two replicas: {active}"
    for name, (seed, turns) in sessions.items():
        expected = _realtime_turns(single_process, seed, turns)
        assert [text for text, _ in replies[name]] == [text for text, _ in expected]
        for (_, pcm), (_, reference) in zip(replies[name], expected, strict=True):
            assert_audible(_pcm(pcm))
            assert_audio_equal(_pcm(pcm), _pcm(reference))


def _ws_connect(base: str, route: str, **options):
    from websockets.sync.client import connect

    return connect(base.replace("http://", "ws://") + route, open_timeout=60, **options)


def _ws_event(ws) -> dict:
    return json.loads(ws.recv(timeout=120))


def test_streamed_text_and_bad_events_over_websockets_through_the_proxy(url, single_process):
    """/v1/audio/speech/stream through Serve (the key as the browser's subprotocol): bad events get error events
    naming the field and the session goes on; the streamed text's audio is the single-process server's
    /v1/audio/speech of the whole text. /v1/realtime's bad events the same. The upgrade's answer names the
    replica; a wrong key is refused before the upgrade."""
    body = {"model": "omnimtp-tiny", "voice": "ethan", "input": "Hello there, friend", "seed": 4,
            "response_format": "pcm"}
    expected = httpx.post(f"{single_process.base_url}audio/speech", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"}).content
    assert_audible(_pcm(expected))
    with _ws_connect(url, "/v1/audio/speech/stream", subprotocols=[f"openai-insecure-api-key.{API_KEY}"]) as ws:
        assert ws.response.headers[ray_serve.REPLICA_HEADER.decode()]
        for i, (event, param) in enumerate([({"type": "session.config", "seed": "1"}, "seed"),
                                            ({"type": "input_text.delta", "delta": 3}, "delta")]):
            ws.send(json.dumps({**event, "event_id": f"evt_{i}"}))
            error = _ws_event(ws)
            assert error["type"] == "error" and error["error"]["param"] == param, error
            assert error["error"]["event_id"] == f"evt_{i}"
        ws.send(json.dumps({"type": "session.config", "voice": "ethan", "seed": 4}))
        assert _ws_event(ws)["type"] == "session.configured"
        for piece in ("Hello th", "ere, fri", "end"):
            ws.send(json.dumps({"type": "input_text.delta", "delta": piece}))
        ws.send(json.dumps({"type": "input_text.done"}))
        audio = b""
        while (event := _ws_event(ws))["type"] == "audio.delta":
            audio += base64.b64decode(event["delta"])
        assert event["type"] == "done", event
    assert audio == expected

    with _ws_connect(url, "/v1/realtime?model=omnimtp-tiny",
                     additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        assert _ws_event(ws)["type"] == "session.created"
        bad = {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "threshold": 2}}}}}
        ws.send(json.dumps(bad))
        error = _ws_event(ws)
        assert error["type"] == "error" and error["error"]["param"] == "session.audio.input.turn_detection.threshold"
        ws.send("{not json")
        assert _ws_event(ws)["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                                   "max_output_tokens": 3}}))
        assert _ws_event(ws)["type"] == "session.updated"
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}}))
        assert [_ws_event(ws)["type"] for _ in range(2)] == ["conversation.item.added", "conversation.item.done"]
        ws.send(json.dumps({"type": "response.create"}))
        while (event := _ws_event(ws))["type"] != "response.done":
            assert event["type"] != "error", event
        assert event["response"]["status"] in ("completed", "incomplete")

    with pytest.raises(InvalidStatus) as refused:
        _ws_connect(url, "/v1/realtime?model=omnimtp-tiny", additional_headers={"Authorization": "Bearer wrong"})
    assert refused.value.response.status_code == 401


# -- saved voices shared by the replicas ------------------------------------------------------------------

TTS_APP = "omnimtp-tts"


@pytest.fixture(scope="module")
def tts_url(url, tmp_path_factory):
    """A second application on the same proxy under the route prefix /tts: `serve --replicas 2 --max-sessions 1`
    of the tiny Qwen3-TTS Base model, both replicas on one --voices-dir (no CPUs reserved: the instance's two are
    taken)."""
    args = build_parser().parse_args([
        "serve", "--model", "tiny-tts-base", "--replicas", "2", "--num-cpus-per-replica", "0", "--eager",
        "--max-batch-size", "2", "--max-frames", str(MAX_FRAMES), "--max-sessions", "1",
        "--voices-dir", str(tmp_path_factory.mktemp("voices")), "--api-key", API_KEY,
    ])
    serve.run(ray_serve.application(args), name=TTS_APP, route_prefix="/tts", blocking=False)
    try:
        yield f"{url}/tts"
    finally:
        serve.delete(TTS_APP)


def _on_replica(send, replica: str | None = None, avoid: str | None = None, tries: int = 40) -> httpx.Response:
    """`send()` again until a response comes from `replica` (or from any replica but `avoid`): the router picks
    a replica per request."""
    for _ in range(tries):
        reply = send()
        name = reply.headers[ray_serve.REPLICA_HEADER.decode()]
        if (replica is None or name == replica) and name != avoid:
            return reply
    raise AssertionError(f"no response from replica {replica or 'other than ' + str(avoid)} in {tries} tries")


def test_a_voice_saved_through_one_replica_is_listed_spoken_and_deleted_through_the_other(tts_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{tts_url}/v1/audio/voices").status_code == 401  # the key is checked below a route prefix
    assert httpx.get(f"{tts_url}/health").json()["replicas"] == {"running": 2, "total": 2}
    recording = tone(2.0, 24000, hz=150.0, level=0.3) + tone(2.0, 24000, hz=450.0, level=0.1)
    wav = io.BytesIO()
    sf.write(wav, recording, 24000, format="WAV")
    created = httpx.post(f"{tts_url}/v1/audio/voices", headers=headers, timeout=300, json={
        "name": "shared", "consent": "The speaker agreed to be cloned.",
        "audio_sample": base64.b64encode(wav.getvalue()).decode(), "x_vector_only_mode": True})
    assert created.status_code == 200, created.text
    creator = created.headers[ray_serve.REPLICA_HEADER.decode()]

    listed = _on_replica(lambda: httpx.get(f"{tts_url}/v1/audio/voices", headers=headers, timeout=60), avoid=creator)
    other = listed.headers[ray_serve.REPLICA_HEADER.decode()]
    assert [voice["name"] for voice in listed.json()["uploaded_voices"]] == ["shared"]

    def speak():
        return httpx.post(f"{tts_url}/v1/audio/speech", headers=headers, timeout=300,
                          json={"voice": "shared", "input": "Hello there", "seed": 3, "response_format": "pcm"})

    spoken = {replica: _on_replica(speak, replica).content for replica in (creator, other)}
    assert_audible(_pcm(spoken[other]))
    assert spoken[other] == spoken[creator]  # the same voice, read from the one store by each replica

    deleted = _on_replica(lambda: httpx.delete(f"{tts_url}/v1/audio/voices/shared", headers=headers, timeout=60))
    assert deleted.status_code == 200, deleted.text
    gone = _on_replica(speak, avoid=deleted.headers[ray_serve.REPLICA_HEADER.decode()])
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "voice"  # no replica keeps a stale copy


def test_max_sessions_is_per_replica(tts_url):
    """--max-sessions 1 on two replicas: a session on each (the router sends the second upgrade to the replica
    without one), then the third upgrade is refused with 429 by the replica it reaches; a closed session frees
    its replica's slot."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    replica = ray_serve.REPLICA_HEADER.decode()
    with _ws_connect(tts_url, "/v1/audio/speech/stream", additional_headers=headers) as first, \
            _ws_connect(tts_url, "/v1/audio/speech/stream", additional_headers=headers) as second:
        assert first.response.headers[replica] != second.response.headers[replica]
        with pytest.raises(InvalidStatus) as refused:
            _ws_connect(tts_url, "/v1/audio/speech/stream", additional_headers=headers)
        assert refused.value.response.status_code == 429
        assert json.loads(refused.value.response.body)["error"]["code"] == "too_many_sessions"
        first.close()
        deadline = time.monotonic() + 30
        while True:  # the replica frees the slot once the session's handler has returned
            try:
                with _ws_connect(tts_url, "/v1/audio/speech/stream", additional_headers=headers) as again:
                    assert again.response.headers[replica] != second.response.headers[replica]
                    break
            except InvalidStatus as exc:
                assert exc.response.status_code == 429 and time.monotonic() < deadline
                time.sleep(0.2)


def _settled_chat_count(url) -> float:
    """The chat requests /metrics counts once every replica's snapshot has caught up (each replica pushes
    one every `ray_serve._METRICS_PUSH_S`): two reads that far apart agree."""
    count = sum(_replica_samples(url, "/v1/chat/completions").values())
    for _ in range(20):
        time.sleep(1.5 * ray_serve._METRICS_PUSH_S)
        again = sum(_replica_samples(url, "/v1/chat/completions").values())
        if again == count:
            return count
        count = again
    return count


def test_requests_spread_over_replicas_and_metrics_label_each(client, url):
    before = _settled_chat_count(url)  # earlier tests' last requests may not be pushed yet
    threads = [threading.Thread(target=lambda i=i: client.chat.completions.create(
        model="omnimtp-tiny", messages=[{"role": "user", "content": f"Hello {i}"}], max_tokens=3)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 15
    while True:  # the other replica's snapshot arrives within a second
        counts = _replica_samples(url, "/v1/chat/completions")
        if sum(counts.values()) >= before + 12 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(counts.values()) == before + 12
    assert len(counts) == 2, f"every request went to one replica: {counts}"


def test_a_killed_replica_is_replaced_and_later_requests_succeed(client, url):
    replicas = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
                if actor["name"].startswith(f"SERVE_REPLICA::{ray_serve.APP_NAME}#{ray_serve.DEPLOYMENT_NAME}#")]
    assert len(replicas) == 2
    in_flight = _chat(client, seed=5, stream=True)
    next(iter(in_flight))
    in_flight.close()
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
    for seed in range(6):
        message = _chat(client, seed=seed).choices[0].message
        assert_audible(_pcm(base64.b64decode(message.audio.data)))
    deadline = time.monotonic() + 120
    while (health := httpx.get(f"{url}/health")).status_code != 200:
        assert health.json()["status"] == "loading"
        assert time.monotonic() < deadline, f"the replica was not replaced: {health.json()}"
        time.sleep(0.5)
    assert health.json()["replicas"] == {"running": 2, "total": 2}


def test_the_proxy_drops_the_routers_expected_deadline_warning_only(url):
    """Serve's proxy (where the router that probes the replicas' queues runs) started without --verbose has the
    `quiet_ray_worker` filter on its `ray.serve` logger, installed by the job's worker set-up hook and kept
    through Serve's own logging set-up: the expected "within 0.1s" warning is dropped, other warnings pass."""
    def drops_the_routers_deadline_warning(_proxy) -> tuple[bool, bool]:  # run in the proxy's process
        import logging

        def passes(message: str) -> bool:
            return bool(logging.getLogger("ray.serve").filter(logging.makeLogRecord({"msg": message})))

        return (passes("Failed to get queue length from Replica(id='r') within 0.1s. If this happens ..."),
                passes("Failed to fetch queue length for Replica(id='r'). Replica is temporarily unavailable."))

    (proxy,) = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
                if actor["name"].startswith("SERVE_PROXY_ACTOR")]
    handle = ray.get_actor(proxy["name"], namespace=proxy["namespace"])
    assert ray.get(handle.__ray_call__.remote(drops_the_routers_deadline_warning), timeout=60) == (False, True)


# -- omnimtp batch ------------------------------------------------------------------------------------


def _batch(ray_address, prompts, output, *extra):
    command = [sys.executable, "-m", "omnimtp.cli", "batch", "--input", str(prompts), "--output", str(output),
               "--replicas", "2", "--num-cpus-per-replica", "0.5", "--batch-size", "1", "--ray-address", ray_address,
               *extra]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lines(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_batch_interrupted_and_resumed_writes_every_prompt_once(ray_address, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i:02d}", "prompt": f"Tell me about number {i}.", **({"seed": i} if i % 3 == 0 else {}),
             **({"voice": "Chelsie"} if i % 4 == 0 else {})} for i in range(7)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out"
    results = output / "results.jsonl"

    short = ("--max-new-tokens", "8", "--max-frames", "12")  # what is tested is the resume, not long replies
    first = _batch(ray_address, prompts, output, *short)
    deadline = time.monotonic() + 240
    while len(_lines(results)) < 3:
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "no result within 240 s"
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate()
    num_before = len(_lines(results))
    assert num_before < len(rows), "the first run finished before it was interrupted: nothing was resumed"

    second = _batch(ray_address, prompts, output, *short)
    log, _ = second.communicate(timeout=300)
    assert second.returncode == 0, log
    assert f"{num_before} already in" in log
    assert "core_worker" not in log and "Warning" not in log, log  # Ray's own lines stay quiet without --verbose
    written = _lines(results)
    assert sorted(r["id"] for r in written) == [row["id"] for row in rows]  # each once
    assert sorted(os.listdir(output)) == sorted([f"{row['id']}.wav" for row in rows] + ["results.jsonl"])
    for result in written:
        samples, rate = sf.read(output / result["audio"], dtype="int16")
        assert rate == 24000 and len(samples) == round(result["audio_seconds"] * rate)
        assert_audible(samples)
