"""Time to a usable CLI and server: `omnimtp --help`, a bad-argument error, and `omnimtp serve` (default,
compiled predictor warming up in the background; and --eager) to its first /health 200, its first chat
200 and the end of its warm-up, with inductor's cache cold (a fresh directory) and then warm (the same
directory again; warm only if the cold run's warm-up ended within --warm-timeout). Prints a table with the
default serve's times relative to --eager's (`*_vs_eager`) and writes JSON.

    python benchmarks/serve_startup.py --out benchmarks/serve_startup.json [--max-batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHAT = {"model": "omnimtp-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    env.pop("OMNIMTP_API_KEY", None)
    return env


def time_command(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "omnimtp.cli", *argv], cwd=REPO, env=_env(), capture_output=True)
    return time.perf_counter() - started


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(url: str, body: dict | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            reply.read()
            return reply.status
    except OSError:
        return 0


def time_serve(flags: list[str], cache_dir: str, warm_timeout: float) -> dict:
    """Seconds from launch to the first /health 200, the first chat 200, and the "warm-up: done" log line."""
    port = _port()
    base = f"http://127.0.0.1:{port}"
    log = Path(cache_dir) / f"serve-{port}.log"
    started = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "omnimtp.cli", "serve", "--port", str(port), *flags],
                                   cwd=REPO, env=_env(TORCHINDUCTOR_CACHE_DIR=cache_dir), stdout=out,
                                   stderr=subprocess.STDOUT)
    result = {}
    try:
        while _status(f"{base}/health") != 200:
            assert process.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
        result["health_200_s"] = time.perf_counter() - started
        assert _status(f"{base}/v1/chat/completions", CHAT) == 200
        result["first_chat_s"] = time.perf_counter() - started
        if "--eager" not in flags:
            while "warm-up: done" not in log.read_text():
                if time.perf_counter() - started > warm_timeout:
                    result["warm_s"] = None
                    break
                time.sleep(0.5)
            else:
                result["warm_s"] = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=120)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="serve_startup.json", help="JSON file to write")
    parser.add_argument("--max-batch-size", type=int, default=16, help="serve --max-batch-size")
    parser.add_argument("--warm-timeout", type=float, default=1800, help="seconds to wait for the warm-up to end")
    args = parser.parse_args()
    results = {
        "help_s": time_command(["--help"]),
        "speak_help_s": time_command(["speak", "--help"]),
        "bad_model_s": time_command(["speak", "--model", "/nonexistent", "hi", "-o", "x.wav"]),
    }
    flags = ["--max-batch-size", str(args.max_batch_size)]
    with tempfile.TemporaryDirectory() as cache_dir:
        results["serve_eager"] = time_serve(flags + ["--eager"], cache_dir, args.warm_timeout)
        results["serve_cold_cache"] = time_serve(flags, cache_dir, args.warm_timeout)
        results["serve_warm_cache"] = time_serve(flags, cache_dir, args.warm_timeout)
    # Only a cold run whose warm-up ended left every graph in the cache.
    results["serve_warm_cache"]["is_cache_complete"] = results["serve_cold_cache"].get("warm_s") is not None
    eager = results["serve_eager"]
    for name in ("serve_cold_cache", "serve_warm_cache"):  # the default serve against --eager, in this run
        for key in ("health_200_s", "first_chat_s"):
            results[name][f"{key[:-2]}_vs_eager"] = results[name][key] / eager[key]
    for name, value in results.items():
        if isinstance(value, dict):
            print(f"{name:18s} " + "  ".join(f"{k} {v}" if isinstance(v, bool) else f"{k} {v:.2f}" if v is not None
                                             else f"{k} n/a" for k, v in value.items()))
        else:
            print(f"{name:18s} {value:.2f} s")
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
