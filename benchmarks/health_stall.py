"""Does one hostile request stall everyone else? `/health` latency while a large body or event of each class
is sent to a running `omnimtp serve`.

For each class a client sends one body (or one WebSocket message) of up to `--max-body-bytes` while another
polls `/health` every 5 ms; we record the slowest `/health` answer during the request and the request's
status and error code. The floor is `/health` on the idle server (the same poll with nothing else sent).
The goal: no class makes `/health` wait more than 100 ms.

    python benchmarks/health_stall.py --out benchmarks/results/health_stall.json

The server is `omnimtp serve --eager` on the embedded tiny model, started as a user would (a subprocess);
the classes are the shapes an outside fuzz found stalling the event loop or the GIL: millions of tiny values
(containers, numbers, keys, nulls), long strings with and without escapes, bodies at the structure limits,
and a 16 MB realtime event and text-stream message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time

import httpx
from websockets.sync.client import connect

BODY_LIMIT = 16 * 1024 * 1024


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bodies() -> dict[str, tuple[str, bytes]]:
    n = BODY_LIMIT - 4096
    row = b"[" + b",".join([b"0.123456789"] * 8000) + b"]"
    nulls = b"[" + b",".join([b"null"] * 8000) + b"]"
    speech = b'{"input": "Hi", "voice": "ethan", '
    return {
        "300,000 chat messages": ("/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "a"}] * 300_000}).encode()),
        "4M nested empty lists": ("/v1/audio/speech", speech + b'"x": [' + b",".join([b"[]"] * 4_000_000) + b"]}"),
        "16 MB of zeros": ("/v1/audio/speech", speech + b'"x": [' + b",".join([b"0"] * (n // 2)) + b"]}"),
        "16 MB of floats": ("/v1/audio/speech", speech + b'"x": [' + b",".join([b"0.123456789"] * (n // 12)) + b"]}"),
        "16 MB of keys": ("/v1/audio/speech", speech + b'"x": {' + b",".join(
            b'"k%d": 0' % i for i in range(n // 14)) + b"}}"),
        "16 MB plain string": ("/v1/audio/speech", b'{"voice": "ethan", "input": "' + b"a" * n + b'"}'),
        "16 MB escaped string": ("/v1/audio/speech", b'{"voice": "ethan", "input": "' + b"\\u00e9" * (n // 6)
                                 + b'"}'),
        "floats at the limits": ("/v1/audio/speech", speech + b'"x": [' + b",".join([row] * 24) + b"]}"),
        "nulls at the limits": ("/v1/audio/speech", speech + b'"x": [' + b",".join([nulls] * 24) + b"]}"),
    }


def _messages() -> dict[str, tuple[str, str]]:
    n = BODY_LIMIT - 4096
    parts = ",".join(['{"type": "input_text", "text": "a"}'] * 400_000)
    item = '{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": ['
    return {
        "realtime item with 400,000 parts": ("/v1/realtime?model=omnimtp-tiny", item + parts + "]}}"),
        "realtime 16 MB of numbers": ("/v1/realtime?model=omnimtp-tiny", '{"type": "session.update", "x": ['
                                      + ",".join(["0"] * (n // 2)) + "]}"),
        "speech stream 16 MB text": ("/v1/audio/speech/stream", '{"type": "input_text.delta", "delta": "'
                                     + "a" * n + '"}'),
    }


def _worst_health(url: str, send) -> tuple[float, object]:
    """The slowest /health answer while `send()` runs in another thread, and what `send` returned."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("reply", send()))
    worst = 0.0
    with httpx.Client(base_url=url, timeout=60) as client:
        client.get("/health")
        thread.start()
        while thread.is_alive():
            start = time.perf_counter()
            client.get("/health")
            worst = max(worst, time.perf_counter() - start)
            time.sleep(0.005)
    thread.join()
    return worst, result.get("reply")


def _post(url: str, path: str, body: bytes):
    def send():
        with httpx.Client(base_url=url, timeout=120) as client:
            reply = client.post(path, content=body, headers={"Content-Type": "application/json"})
        error = reply.json().get("error", {}) if reply.status_code >= 400 else {}
        return reply.status_code, error.get("code")
    return send


def _websocket(url: str, path: str, message: str):
    def send():
        with connect("ws" + url[4:] + path, max_size=None, open_timeout=30) as ws:
            if "realtime" in path:
                ws.recv(timeout=30)  # session.created
            ws.send(message)
            while True:
                event = json.loads(ws.recv(timeout=60))
                if event.get("type") == "error":
                    return "error event", event["error"].get("code")
    return send


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [os.path.join(os.path.dirname(sys.executable), "omnimtp"), "serve", "--eager", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        floor, _ = _worst_health(url, lambda: time.sleep(2.0))
        rows = [{"class": "idle (the floor)", "bytes": 0, "worst_health_ms": floor * 1000, "answer": None}]
        cases = [(name, len(body), _post(url, path, body)) for name, (path, body) in _bodies().items()]
        cases += [(name, len(text), _websocket(url, path, text)) for name, (path, text) in _messages().items()]
        for name, size, send in cases:
            worst, answer = _worst_health(url, send)
            rows.append({"class": name, "bytes": size, "worst_health_ms": worst * 1000, "answer": answer})
            print(f"{name:34s} {size / 1e6:6.1f} MB  worst /health {worst * 1000:7.1f} ms  {answer}", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    worst = max(row["worst_health_ms"] for row in rows[1:])
    print(f"floor (idle /health, worst of 2 s of polls): {rows[0]['worst_health_ms']:.1f} ms; worst under a hostile "
          f"request: {worst:.1f} ms ({worst / max(rows[0]['worst_health_ms'], 1e-3):.0f}× the floor; goal 100 ms)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "machine": platform.machine(), "cpus": os.cpu_count(),
                       "load_average_1m": os.getloadavg()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
