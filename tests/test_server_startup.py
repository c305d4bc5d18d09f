"""A server is ready when a user is: `/health` is 200 and chats are served while the compiled code predictor
warms up in the background, warm-up progress is logged, and SIGTERM during warm-up exits within
--timeout-graceful-shutdown leaving no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import EngineSetup, free_port, running_server
from test_signals import _descendants, _start, _stop, _wait_for_line

from omnimtp.server.app import create_app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_CHAT = {"model": "omnimtp-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 4,
         "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}


def test_health_and_chats_are_served_while_the_predictor_warms_up(caplog):
    """The engine serves at once; the warm-up runs beside it (here one held until shutdown), gets the
    engine's stop event and its idle flag, which is clear while the chat is in flight and set again after it,
    and reports each bucket; a reply during warm-up is the eager engine's, byte for byte."""
    setup = EngineSetup.tiny(max_batch_size=4, max_frames=4)
    calls, release, idle_seen = [], threading.Event(), []

    def warm_up(max_batch_size, on_bucket, stop, *, idle, fill_cache_in_child):
        calls.append((max_batch_size, fill_cache_in_child))
        on_bucket(1, 3, 1, 0.5)
        on_bucket(2, 3, 2, 0.5)
        idle_seen.append(idle.is_set())
        while idle.is_set() and not stop.is_set():  # until a request is in flight
            time.sleep(0.001)
        idle_seen.append(idle.is_set())
        idle.wait()
        idle_seen.append(idle.is_set())
        stop.wait()
        release.set()
        return False

    with running_server(create_app(setup.engine())) as base:
        expected = httpx.post(f"{base}/v1/chat/completions", json=_CHAT, timeout=120).json()
    setup.family.warm_up = warm_up
    with caplog.at_level("INFO", logger="omnimtp.server"):
        with running_server(create_app(setup.engine(warm_up=True))) as base:
            assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
            reply = httpx.post(f"{base}/v1/chat/completions", json=_CHAT, timeout=120)
            assert reply.status_code == 200 and calls == [(4, True)] and not release.is_set()
            assert idle_seen[:2] == [True, False]  # idle before the chat, busy while it ran
            time.sleep(0.1)
            assert idle_seen == [True, False, True]  # and idle again once it was answered
            got, want = reply.json()["choices"][0]["message"], expected["choices"][0]["message"]
            assert (got["content"], got["audio"]["data"]) == (want["content"], want["audio"]["data"])
    assert release.wait(30)  # the engine's shutdown stopped the warm-up
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    assert lines[0].startswith("warm-up: compiling the code predictor for batches up to 4 in the background")
    assert lines[1].startswith("warm-up: code predictor compiled for batch size 1 (bucket 1/3) in 0.5 s")
    assert lines[2].startswith("warm-up: code predictor compiled for batch size 2 (bucket 2/3) in 0.5 s")


def _compile_states(pid: int) -> set[str]:
    """The states (R, S, T...) of `pid`'s descendants outside its process group: the compiling child's."""
    states = set()
    for child in _descendants(pid):
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) != os.getpgid(pid):
            states.add(fields[0])
    return states - {"Z"}


def test_default_serve_answers_at_once_and_sigterm_during_warm_up_exits_within_the_deadline(tmp_path):
    """The default (compiled) `omnimtp serve`: /health 200 and a chat while the predictor compiles (minutes
    on a CPU with inductor's cache empty, as here) in a child process, which is stopped while the chat is in
    flight; then SIGTERM ends the server and that child within the graceful deadline."""
    port = free_port()
    process = _start("serve", "--port", str(port), "--max-frames", "4", "--max-batch-size", "2",
                     "--timeout-graceful-shutdown", "2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    try:
        log = _wait_for_line(process, "Uvicorn running on", timeout=240)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        if not any("warm-up: compiling the code predictor" in line for line in log):  # (after the warm-up reply)
            log += _wait_for_line(process, "warm-up: compiling the code predictor", timeout=120)
        deadline = time.monotonic() + 60
        while not _compile_states(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _compile_states(process.pid), "no compiling child process"
        replies, states = [], set()
        chat = threading.Thread(target=lambda: replies.append(
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=_CHAT, timeout=120)))
        chat.start()
        while chat.is_alive():
            states |= _compile_states(process.pid)
            time.sleep(0.01)
        assert replies[0].status_code == 200, replies[0].text
        assert "T" in states  # the compile was stopped while the chat ran
        output, elapsed, left = _stop(process, signal.SIGTERM, within=2 + 10)
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(log) + output
    assert not left, f"processes left behind: {sorted(left)}"
    assert "Traceback" not in output, output[-3000:]
