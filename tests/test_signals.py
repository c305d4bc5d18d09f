"""Ctrl-C and SIGTERM stop every long-running command promptly, with one line and no process left behind:
`serve` (one process), `serve --replicas 2` while its replicas deploy (its own local Ray instance), and
`batch` (its resume promise intact)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_harness import free_port

from omnimtp.batch import finished_ids

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("OMNIMTP_API_KEY", "RAY_ADDRESS"):
        env.pop(name, None)
    return env


def _start(*argv: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "omnimtp.cli", *argv], cwd=REPO, env={**_env(), **env},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _children() -> dict[int, list[int]]:
    """ppid → pids of every live process (from /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _stop(process: subprocess.Popen, signum: int, *, within: float) -> tuple[str, float, set[int]]:
    """Send `signum`; (its output, seconds to exit, the descendants it had that are still alive a moment
    after). The descendants are collected until it exits (Ray starts workers late)."""
    seen = _descendants(process.pid)
    started = time.monotonic()
    process.send_signal(signum)
    while process.poll() is None and time.monotonic() - started < within:
        seen |= _descendants(process.pid)
        time.sleep(0.1)
    elapsed = time.monotonic() - started
    if process.poll() is None:
        process.kill()
    output = process.communicate(timeout=60)[0]
    assert elapsed < within, f"still running {within:.0f} s after {signal.Signals(signum).name}:\n{output[-3000:]}"
    deadline = time.monotonic() + 10
    while _alive(seen) and time.monotonic() < deadline:  # killed ones may take a moment to go
        time.sleep(0.2)
    return output, elapsed, _alive(seen)


def _wait_for_line(process: subprocess.Popen, text: str, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    process.kill()
    raise AssertionError(f"no {text!r} within {timeout:.0f} s:\n{''.join(lines)[-3000:]}{process.communicate()[0]}")


def test_sigint_stops_an_eager_server_leaving_no_process():
    port = free_port()
    process = _start("serve", "--eager", "--port", str(port), "--max-frames", "4", "--timeout-graceful-shutdown", "2")
    try:
        _wait_for_line(process, "omnimtp: serving", timeout=240)
        _wait_for_line(process, "Uvicorn running on", timeout=120)  # the socket is bound (a busy machine takes a while)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        output, elapsed, left = _stop(process, signal.SIGINT, within=2 + 10)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGINT and not left, output[-3000:]
    assert "omnimtp serve: stopped (SIGINT)" in output
    assert "Traceback" not in output


def test_sigterm_while_replicas_deploy_stops_the_deploy_and_ray():
    port = free_port()
    process = _start("serve", "--replicas", "2", "--num-cpus-per-replica", "0.5", "--eager", "--port", str(port),
                     "--max-frames", "4", "--timeout-graceful-shutdown", "2")
    try:
        _wait_for_line(process, "omnimtp: deploying", timeout=240)
        time.sleep(1.0)  # the replicas are starting
        output, elapsed, left = _stop(process, signal.SIGTERM, within=60)
    finally:
        if process.poll() is None:
            process.kill()
    # (the line names SIGINT now and then: a signal Ray's own handlers forward while a deploy starts)
    assert "omnimtp: stopping (SIGTERM)" in output or "omnimtp: stopping (SIGINT)" in output, output[-3000:]
    assert "omnimtp: serving" not in output  # stopped while deploying, not after
    assert not left, f"processes left behind: {sorted(left)}"
    assert "*** SIGTERM received" not in output and "Traceback" not in output, output[-3000:]


def _results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_ctrl_c_stops_batch_with_one_line_and_a_rerun_would_skip_what_is_done(tmp_path):
    """Ctrl-C of a batch that started its own Ray: one line, no process left, and an output a rerun resumes
    from (every finished prompt readable, with its audio). The rerun itself, after a harder stop (SIGKILL),
    is tests/test_ray.py's resume test."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"Number {i}."} for i in range(6)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out"
    argv = ("batch", "--input", str(prompts), "--output", str(output), "--replicas", "1", "--batch-size", "1",
            "--num-cpus-per-replica", "0.5", "--max-frames", "3", "--max-new-tokens", "4")
    process = _start(*argv)
    try:
        deadline = time.monotonic() + 300
        while not _results(output / "results.jsonl"):
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no result within 300 s"
            time.sleep(0.05)
        log, elapsed, left = _stop(process, signal.SIGINT, within=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGINT, log[-3000:]
    done = _results(output / "results.jsonl")
    assert f"omnimtp batch: stopped (SIGINT) with {len(done)} of {len(rows)} prompts done" in log, log[-3000:]
    assert "Traceback" not in log and "*** SIG" not in log, log[-3000:]
    assert not left, f"processes left behind: {sorted(left)}"
    if len(done) == len(rows):
        pytest.skip("the job finished before it was interrupted")
    assert finished_ids(str(output)) == {row["id"] for row in done} and len(done) == len({r["id"] for r in done})
    for result in done:
        assert (output / result["audio"]).is_file()
