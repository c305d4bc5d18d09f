"""Time to first audio over the WebSocket routes, at concurrency 1 and 8 (default), against the same request
streamed over HTTP (/v1/chat/completions, SSE) on the same server in the same run.

Scenarios (`SCENARIOS`: name → one timed request; add a route's scenario there):

- realtime: a `/v1/realtime` session through the official openai client (`client.realtime.connect`): a user
  text item, then `response.create`; first audio = `response.create` sent → first
  `response.output_audio.delta` received. Each request opens its own session (the connect is not timed).
- chat_sse (the reference): the same conversation as a streamed chat request with audio; first audio =
  POST sent → first SSE chunk carrying audio.

Each concurrency level runs every scenario, levels interleaved, on one `omnimtp serve` process (the embedded
tiny model unless `--serve-arg --model --serve-arg DIR`): `concurrency` clients each send
`--requests-per-client` requests back to back. Printed: p50 / p95 first audio per scenario and level, and the
ratio realtime / chat_sse; the JSON has every request. The machine may be shared: compare ratios within a run.

`--warm`: the conversation kept warm between turns instead. `concurrency` realtime sessions at once, each
`--turns` turns long: a user audio turn (`--turn-seconds` of a tone, appended, then committed, turn detection
off) and `response.create`; first audio = `input_audio_buffer.commit` sent (the end of the user's turn) → first
`response.output_audio.delta`. It runs on two servers, one after the other: `--session-cache-mb 0` (cold: every
turn prefills the whole conversation) and the default cache (warm). Printed: p50 first audio at turn 1 and at
the last turn per level and server, and warm / cold at the last turn.

    python benchmarks/realtime_latency.py --out benchmarks/results/realtime_latency.json
    python benchmarks/realtime_latency.py --concurrency 1 2 --requests-per-client 2 --max-frames 12   # small
    python benchmarks/realtime_latency.py --warm --turns 10 --out benchmarks/results/realtime_warm.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import SAMPLE_RATE, one_request, percentile, server_process  # noqa: E402


async def realtime_request(url: str, index: int, max_tokens: int) -> dict:
    """One `/v1/realtime` response (see the module docstring); the keys of `serve_load.one_request`."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", websocket_base_url=url.replace("http://", "ws://") + "/v1",
                                api_key=os.environ.get("OMNIMTP_API_KEY", "unused"), max_retries=0)
    async with client.realtime.connect() as connection:  # the served model
        await connection.session.update(session={"type": "realtime", "seed": index, "max_output_tokens": max_tokens,
                                                 "audio": {"input": {"turn_detection": None}}})
        await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": f"Tell me a story, number {index}."}]})
        started = time.perf_counter()
        await connection.response.create()
        first_audio, num_samples = None, 0
        async for event in connection:
            if event.type == "error":
                return {"ok": False, "status": 200, "error": event.error.code}
            if event.type == "response.output_audio.delta":
                if first_audio is None:
                    first_audio = time.perf_counter() - started
                num_samples += len(base64.b64decode(event.delta)) // 2
            elif event.type == "response.done":
                break
        total = time.perf_counter() - started
    return {"ok": True, "ttfa_s": first_audio, "total_s": total, "audio_s": num_samples / SAMPLE_RATE}


def _tone_pcm16(seconds: float, hz: float) -> bytes:
    """A tone at 24 kHz (the session's default input rate) as PCM16 bytes, at -12 dBFS."""
    t = np.arange(int(24_000 * seconds)) / 24_000
    return (0.25 * 32767 * np.sin(2 * np.pi * hz * t)).astype("<i2").tobytes()


async def conversation(url: str, index: int, max_tokens: int, num_turns: int, turn_seconds: float) -> list[dict]:
    """One realtime session of num_turns audio turns (see `--warm` in the module docstring) → per turn: ok,
    ttfa_s (commit sent → first audio delta), total_s (commit sent → response.done)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", websocket_base_url=url.replace("http://", "ws://") + "/v1",
                                api_key=os.environ.get("OMNIMTP_API_KEY", "unused"), max_retries=0)
    turns = []
    async with client.realtime.connect() as connection:
        await connection.session.update(session={"type": "realtime", "seed": index, "max_output_tokens": max_tokens,
                                                 "audio": {"input": {"turn_detection": None}}})
        for turn in range(num_turns):
            pcm = _tone_pcm16(turn_seconds, 220.0 + 37.0 * ((index + turn) % 11))
            await connection.input_audio_buffer.append(audio=base64.b64encode(pcm).decode("ascii"))
            started = time.perf_counter()  # the end of the user's turn
            await connection.input_audio_buffer.commit()
            await connection.response.create()
            first_audio, result = None, None
            async for event in connection:
                if event.type == "error":
                    result = {"ok": False, "error": event.error.code, "message": event.error.message}
                    break
                if event.type == "response.output_audio.delta" and first_audio is None:
                    first_audio = time.perf_counter() - started
                elif event.type == "response.done":
                    result = {"ok": True, "ttfa_s": first_audio, "total_s": time.perf_counter() - started}
                    break
            turns.append(result or {"ok": False, "error": "closed"})
    return turns


async def run_conversations(url: str, concurrency: int, max_tokens: int, num_turns: int, turn_seconds: float) -> dict:
    started = time.perf_counter()
    sessions = await asyncio.gather(*(conversation(url, w, max_tokens, num_turns, turn_seconds)
                                      for w in range(concurrency)))
    wall = time.perf_counter() - started

    def p50(turn: int) -> float | None:
        return percentile([s[turn]["ttfa_s"] for s in sessions if s[turn]["ok"] and s[turn]["ttfa_s"] is not None],
                          50)

    return {"concurrency": concurrency, "turns": num_turns, "first_turn_ttfa_p50_s": p50(0),
            "last_turn_ttfa_p50_s": p50(num_turns - 1),
            "turn_ttfa_p50_s": [p50(turn) for turn in range(num_turns)], "wall_s": wall,
            "load_average_1min": os.getloadavg()[0], "sessions": sessions}


def run_warm(args) -> list[dict]:
    """The `--warm` comparison: every level on a cold server, then on a warm one."""
    levels = []
    parts = ("--max-media-parts", str(max(args.turns, 8)))  # every audio turn is one part of the last prompt
    for name, cache_args in (("cold", ("--session-cache-mb", "0")), ("warm", ())):
        with server_process(args.max_batch_size, args.max_frames, args.threads,
                            extra_args=(*parts, *args.serve_arg, *cache_args)) as url:
            asyncio.run(run_conversations(url, 1, args.max_tokens, 2, args.turn_seconds))  # warm-up, not recorded
            for concurrency in args.concurrency:
                level = {"server": name, **asyncio.run(run_conversations(
                    url, concurrency, args.max_tokens, args.turns, args.turn_seconds))}
                level["session_cache"] = _session_cache_metrics(url)  # totals so far on this server
                levels.append(level)
                first, last = level["first_turn_ttfa_p50_s"], level["last_turn_ttfa_p50_s"]
                print(f"{name} c{concurrency:<3} first audio p50: turn 1 {_ms(first)}, turn {args.turns} {_ms(last)}"
                      f"  (load {level['load_average_1min']:.1f})", flush=True)
    for concurrency in args.concurrency:
        cold, warm = (next(level for level in levels if level["server"] == name and level["concurrency"] == concurrency)
                      for name in ("cold", "warm"))
        if cold["last_turn_ttfa_p50_s"] and warm["last_turn_ttfa_p50_s"]:
            print(f"c{concurrency:<3} turn {args.turns} first audio p50, warm / cold: "
                  f"{warm['last_turn_ttfa_p50_s'] / cold['last_turn_ttfa_p50_s']:.2f}×")
    return levels


def _session_cache_metrics(url: str) -> dict:
    """The server's omnimtp_session_cache_* samples from /metrics (name → value)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {name: float(value) for name, value in (line.split()[:2] for line in text.splitlines()
                                                   if line.startswith("omnimtp_session_cache_")
                                                   and not line.split()[0].endswith("_created"))}


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.1f} ms"


async def chat_request(url: str, index: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await one_request(client, index, max_tokens)


SCENARIOS = {"realtime": realtime_request, "chat_sse": chat_request}
REFERENCE = "chat_sse"


async def run_level(url: str, scenario: str, concurrency: int, requests_per_client: int, max_tokens: int) -> dict:
    request = SCENARIOS[scenario]

    async def worker(w: int) -> list[dict]:
        return [await request(url, w * 1000 + r, max_tokens) for r in range(requests_per_client)]

    started = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(worker(w) for w in range(concurrency))) for r in rs]
    wall = time.perf_counter() - started
    ttfa = [r["ttfa_s"] for r in results if r["ok"] and r["ttfa_s"] is not None]
    return {"scenario": scenario, "concurrency": concurrency, "requests": len(results),
            "completed": sum(r["ok"] for r in results), "ttfa_p50_s": percentile(ttfa, 50),
            "ttfa_p95_s": percentile(ttfa, 95), "wall_s": wall, "load_average_1min": os.getloadavg()[0],
            "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-frames", type=int, default=25, help="audio frames per request (2 s)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server process")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="another `omnimtp serve` argument (repeatable), e.g. --serve-arg --model --serve-arg DIR")
    parser.add_argument("--out", default="benchmarks/results/realtime_latency.json")
    parser.add_argument("--warm", action="store_true",
                        help="measure the conversation kept warm between turns (see the module docstring)")
    parser.add_argument("--turns", type=int, default=10, help="--warm: turns per session")
    parser.add_argument("--turn-seconds", type=float, default=2.0, help="--warm: seconds of audio per user turn")
    args = parser.parse_args()

    if args.warm:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "levels": run_warm(args)}, indent=2) + "\n")
        print(f"wrote {out}")
        return
    levels = []
    with server_process(args.max_batch_size, args.max_frames, args.threads, extra_args=tuple(args.serve_arg)) as url:
        asyncio.run(run_level(url, args.scenarios[0], 1, 1, args.max_tokens))  # warm-up, not recorded
        for concurrency in args.concurrency:
            for scenario in args.scenarios:
                level = asyncio.run(run_level(url, scenario, concurrency, args.requests_per_client, args.max_tokens))
                levels.append(level)
                p50, p95 = level["ttfa_p50_s"], level["ttfa_p95_s"]
                print(f"c{concurrency:<3} {scenario:<10} first audio p50 {1000 * p50:7.1f} ms  p95 {1000 * p95:7.1f} ms"
                      f"  ({level['completed']}/{level['requests']} completed, load {level['load_average_1min']:.1f})"
                      if p50 is not None else f"c{concurrency:<3} {scenario:<10} no audio", flush=True)
            by_name = {level["scenario"]: level for level in levels if level["concurrency"] == concurrency}
            reference = by_name.get(REFERENCE)
            for scenario, level in by_name.items():
                if scenario != REFERENCE and reference and level["ttfa_p50_s"] and reference["ttfa_p50_s"]:
                    print(f"c{concurrency:<3} {scenario} / {REFERENCE} first audio p50: "
                          f"{level['ttfa_p50_s'] / reference['ttfa_p50_s']:.2f}×")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "levels": levels}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
