"""A full server says so and does not slow everyone down: its 429 comes before the request is read, parsed or
tokenized, at a bounded pace, and a flood of refused requests leaves the admitted streams' steps as they were;
a benchmark's closed-loop client waits out a 429 as the official `openai` client does."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import exchange, pause_with_full_queue, running_server, start_flood
from test_admission import LinearCosts

from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.sampling import SamplingParams
from omnimtp.server.admission import Admission, StepCosts
from omnimtp.server.app import create_app
from omnimtp.server.guard import RefusalPace
from omnimtp.server.requests import EngineRequest
from omnimtp.server.scheduler import Engine
from omnimtp.server.serving import RefusalLogThrottle

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import serve_playback  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"


@pytest.fixture(scope="module")
def family():
    return Qwen3OmniFamily.tiny(0)


def _waiting_chat() -> EngineRequest:
    return EngineRequest(messages=(("user", "Hi"),), speak_text=None, speaker=None,
                         sampling=SamplingParams(temperature=0.0), seed=1, max_new_tokens=4)


# --- the pure pieces ---------------------------------------------------------------------------------------------


def test_refusals_go_out_at_once_up_to_a_burst_then_at_the_pace():
    pace = RefusalPace(rate=100, burst=3)
    assert [round(pace.delay_s(10.0), 6) for _ in range(5)] == [0.0, 0.0, 0.0, 0.01, 0.02]
    assert pace.delay_s(10.005) == pytest.approx(0.025)  # booked behind the ones waiting
    assert pace.delay_s(20.0) == 0.0  # after a quiet while, at once again
    with pytest.raises(ValueError, match="rate"):
        RefusalPace(rate=0)


def test_the_access_log_keeps_one_429_line_in_an_interval_and_counts_the_rest():
    throttle = RefusalLogThrottle(interval_s=60)

    def record(status: int) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:1", "POST", CHAT, "1.1", status), None)

    assert throttle.filter(record(429))
    assert [throttle.filter(record(429)) for _ in range(5)] == [False] * 5
    assert throttle.filter(record(200)) and throttle.filter(record(400))  # other lines all go out
    throttle._next_at = 0.0  # the interval has passed
    later = record(429)
    assert throttle.filter(later) and "5 more 429s since the last such line" in later.getMessage()


def test_a_refusal_says_to_retry_in_milliseconds_when_streams_last_less_than_a_second():
    admission = Admission(LinearCosts(0.0, 0.02), max_streams=8)  # capacity 3: 0.02·3 ≤ 0.9·0.08 < 0.02·4
    assert (admission.retry_after_ms(5), admission.retry_after_s(5)) == (1000, 1)  # before any stream ended
    admission.observe_stream(0.3)
    assert (admission.retry_after_ms(5), admission.retry_after_s(5)) == (600, 1)  # 6 streams, 3 at a time, 0.3 s
    assert (admission.retry_after_ms(11), admission.retry_after_s(11)) == (1200, 2)
    for _ in range(40):
        admission.observe_stream(0.001)
    assert admission.retry_after_ms(0) == 100  # at least


def test_a_closed_loop_client_waits_as_the_openai_client_does():
    rng = random.Random(0)
    assert serve_playback.retry_delay_s({"retry_after_ms": "250", "retry_after": "3"}, 0, rng) == 0.25
    assert serve_playback.retry_delay_s({"retry_after_ms": None, "retry_after": "3"}, 5, rng) == 3.0
    for retry_after, num_retries, top in (("0", 0, 0.5), ("500", 2, 2.0), (None, 9, 8.0), ("soon", 1, 1.0)):
        delay = serve_playback.retry_delay_s({"retry_after": retry_after}, num_retries, rng)
        assert 0.75 * top <= delay <= top, (retry_after, num_retries, delay)


# --- the server ------------------------------------------------------------------------------------------------


def test_a_full_server_refuses_before_it_reads_the_request(family, monkeypatch):
    """A full queue (one waiting request, --max-queue 1, the engine paused): a chat or speech POST, even a malformed
    one, gets 429 `queue_full` with a Retry-After on a connection that stays open, and no prompt is tokenized; a
    realtime response.create gets a `queue_full` error event, likewise; without the API key it is still a 401;
    once the queue has room the malformed body is the 400 it is."""
    engine = Engine(family, model_id="tiny", max_batch_size=1, max_frames=40, admission=True)
    app = create_app(engine, max_queue=1, api_key="sk-test")
    app.state.serving.refusal_pace.rate = float("inf")
    tokenized = []
    for name in ("prompt_ids", "speech_segments"):
        real = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, real=real, name=name: tokenized.append(name) or real(*a))
    key = {"Authorization": "Bearer sk-test"}
    access_lines: list[logging.LogRecord] = []
    access_log = logging.getLogger("uvicorn.access")
    capture = logging.Handler()
    capture.emit = access_lines.append
    with running_server(app) as url:
        throttle = next(f for f in access_log.filters if isinstance(f, RefusalLogThrottle))  # (`server_config`'s)
        throttle._next_at = 0.0  # no 429 line went out in the last interval
        monkeypatch.setattr(access_log, "level", logging.INFO)
        access_log.addHandler(capture)
        pause_with_full_queue(engine, _waiting_chat())
        tokenized.clear()
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
        for path in (CHAT, SPEECH, CHAT):
            reply = exchange(conn, "POST", path, b'{"messages": [nope', key)
            assert reply.status == 429 and reply.error()["code"] == "queue_full", reply
            assert reply.headers["retry-after"] == "1" and reply.headers["retry-after-ms"] == "1000"  # no stream ended
            assert not reply.will_close
        assert exchange(conn, "POST", CHAT, b"{}").status == 401
        with httpx.Client(base_url=url, headers=key, timeout=30) as client:
            body = {"messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
                    "audio": {"voice": "ethan", "format": "pcm16"}}
            assert client.post(CHAT, json=body).status_code == 429
        import openai

        realtime = openai.OpenAI(api_key="sk-test", base_url=f"{url}/v1", websocket_base_url=f"ws{url[4:]}/v1")
        with realtime.realtime.connect(model="tiny") as connection:
            assert connection.recv().type == "session.created"
            connection.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            assert connection.recv().type == "conversation.item.added"
            assert connection.recv().type == "conversation.item.done"
            connection.response.create()
            error = connection.recv()
            assert error.type == "error" and error.error.code == "queue_full", error
        assert tokenized == []
        access_log.removeHandler(capture)
        statuses = [record.args[-1] for record in access_lines]
        assert statuses.count(429) == 1 and 401 in statuses, statuses  # four 429s, one line
        engine._core.abort(engine._core.waiting[0].request_id)  # room again
        reply = exchange(conn, "POST", CHAT, b'{"messages": [nope', key)
        assert reply.status == 400 and reply.error()["code"] == "invalid_json"


@contextlib.contextmanager
def _playing(engine: Engine, app):
    """A server on `engine` (--max-queue 1) playing one long stream with one more waiting, so the queue is full:
    yields (its URL, the engine's steps as (started, seconds)); the streams are cancelled at the end."""
    steps: list[tuple[float, float]] = []
    stop = threading.Event()
    body = {"input": "A long one to speak, on and on.", "voice": "ethan", "response_format": "pcm"}

    def listen(seed: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as client, \
                client.stream("POST", SPEECH, json={**body, "seed": seed}) as response:
            for _ in response.iter_bytes():
                if stop.is_set():
                    return

    with running_server(app) as url:
        core = engine._core
        step = core.step

        def timed_step():
            started = time.perf_counter()
            yield from step()
            steps.append((started, time.perf_counter() - started))

        core.step = timed_step
        listeners = [threading.Thread(target=listen, args=(seed,)) for seed in (1, 2)]
        try:
            listeners[0].start()
            while not steps:
                time.sleep(0.01)
            listeners[1].start()
            while core.num_queued() == 0:
                time.sleep(0.01)
            yield url, steps
        finally:
            stop.set()
            for listener in listeners:
                listener.join(60)


def _long_stream_engine(family) -> Engine:
    engine = Engine(family, model_id="tiny", max_batch_size=1, max_frames=4000, cuts_runaway=False, admission=True)
    engine.admission = Admission(RecordedCosts(), max_streams=1)
    return engine


class RecordedCosts(StepCosts):
    """Step costs that also keep each observation as (when, seconds)."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[float, float]] = []

    def observe(self, num_streams: int, seconds: float) -> None:
        self.log.append((time.perf_counter(), seconds))
        super().observe(num_streams, seconds)


def _median(timed: list[tuple[float, float]], start: float, end: float) -> float:
    return statistics.median(seconds for when, seconds in timed if start <= when < end)


def test_a_flood_of_refused_requests_leaves_the_admitted_streams_steps_as_they_were(family):
    """One stream plays and one waits (--max-queue 1) while two clients that ignore Retry-After send refused
    requests as fast as they are answered: the refusals go out at the server's pace (100 a second after a burst of
    20), and the playing stream's engine steps take about what they took before and after the flood (the median),
    and so do the step costs admission measures (its capacity does not shrink, which would refuse more: a flood
    that fed itself). Refused after being parsed and cut into segments on worker threads, as before, 400-1,400
    refusals made the steps 2.7-3x as long on this 2-core box; refused early but not paced, 5,000 of them in 1.5 s
    left them as they were."""
    engine = _long_stream_engine(family)
    with _playing(engine, create_app(engine, max_queue=1)) as (url, steps):
        body = {"input": "Refused.", "voice": "ethan", "response_format": "pcm"}
        floods = [start_flood(url, SPEECH, body, seconds=1.5) for _ in range(2)]
        marks = [time.perf_counter()]
        time.sleep(1.0)
        marks.append(time.perf_counter())
        for flood in floods:
            flood.stdin.write("go\n")
            flood.stdin.flush()
        num_refused = [int(flood.communicate(timeout=60)[0]) for flood in floods]
        marks.append(time.perf_counter())
        time.sleep(1.0)
        marks.append(time.perf_counter())
    assert all(flood.returncode == 0 for flood in floods), "a flood answer was not 429"
    assert 20 <= sum(num_refused) <= 100 * 1.5 + 20 + 15, num_refused
    for timed in (steps, engine.admission.costs.log):
        before, during, after = (_median(timed, marks[i], marks[i + 1]) for i in range(3))
        assert during <= 1.5 * max(before, after), (before, during, after)


def test_closed_loop_benchmark_clients_wait_out_a_refusal(family):
    """benchmarks/serve_playback.py's closed loop on a server with room for one stream and one in the queue: three
    clients, so some are refused; a refused client sends its next request only after its Retry-After."""
    engine = Engine(family, model_id="tiny", max_batch_size=1, max_frames=30, admission=True)
    engine.admission = Admission(LinearCosts(0.0, 0.048), max_streams=1)
    app = create_app(engine, max_queue=1)
    with running_server(app) as url:
        results = asyncio.run(serve_playback.run_load(url, "speech", ("closed", 3), "ethan", duration_s=2.5,
                                                      max_tokens=4, seed=0))
    refused = [r for r in results if r["status"] == 429]
    assert refused and any(r["status"] == 200 and r["audio_s"] > 0 for r in results)
    for client in range(3):
        mine = sorted((r for r in results if r["client"] == client), key=lambda r: r["sent_s"])
        for earlier, later in zip(mine, mine[1:], strict=False):
            if earlier["status"] == 429:
                waited = later["sent_s"] - earlier["sent_s"] - earlier["total_s"]
                assert waited >= int(earlier["retry_after_ms"]) / 1000 - 0.02, (earlier, later)
    assert json.dumps(results)  # the benchmark writes them as JSON


def test_playback_benchmark_compares_first_audio_at_equal_group_sizes():
    """Closed-loop clients go in groups (sent within 10 ms of each other), and a group's first audio grows with its
    size: a server whose clients went in larger groups has the larger median though it is the quicker at every size.
    The like-for-like ratio compares the sizes both have, weighted by the fewer streams."""
    def streams(groups):  # [(size, first audio s)], each group 1 s after the one before
        return [{"sent_s": i + 0.002 * j, "first_audio_s": first, "status": 200}
                for i, (size, first) in enumerate(groups) for j in range(size)]

    ours = streams([(1, 0.030)] * 10 + [(4, 0.060)])
    other = streams([(1, 0.025)] * 2 + [(4, 0.050)] * 4)
    assert serve_playback.first_audio_by_group(ours) == {1: (10, 0.030), 4: (4, 0.060)}
    assert serve_playback.percentile([r["first_audio_s"] for r in other], 50) > \
        serve_playback.percentile([r["first_audio_s"] for r in ours], 50)
    ratio = serve_playback.like_for_like(serve_playback.first_audio_by_group(ours),
                                         serve_playback.first_audio_by_group(other))
    assert ratio == pytest.approx((2 * 0.025 / 0.030 + 4 * 0.050 / 0.060) / 6)
    assert serve_playback.like_for_like({1: (3, 0.03)}, {2: (2, 0.04)}) is None

