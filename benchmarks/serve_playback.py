"""What listeners hear from a loaded server: every streamed response replayed against a real-time playback clock.

Each response's audio is fed, as it arrives, to a player that starts at its first audio and plays on in real time
(`omnimtp.engine.playback.PlaybackClock`); per stream we record the time to the first audio (from the request),
underruns (the player ran dry; a gap under 5 ms, one read's jitter, is not one) and stalled seconds, and
continuity = audio ÷ (audio + stalled seconds). A request refused with 429 is counted as refused (with its
Retry-After), never as a stream. Each load also reports where first audio went on the server, by its own stage
histograms (`first_audio_stages_ms`: queue, thinker, talker, code2wav, mean milliseconds).

Workloads (`--workloads`):
- `speech`: Qwen3-TTS 0.6B at the released widths (random weights, built once like `tts_realtime.py`'s) in w4a8,
  `/v1/audio/speech` with `response_format: pcm`, read as raw PCM16 bytes as they come;
- `speech_stream`: the same model over the speech stream WebSocket (`/v1/audio/speech/stream`): the text in
  a few deltas, then `input_text.done`;
- `chat`: the shipped demo Qwen3-Omni, `/v1/chat/completions` streamed with audio (SSE); with `--auto`, also a
  server whose thinker speculates (`--thinker-mtp DEMO -k auto`) next to the plain one.

Loads, each on every server in turn (the levels interleave, so a shared machine's drift hits all alike; the
Poisson sweep `--rates` runs on `speech` only, `WORKLOAD_LOADS`, and chat's own, `--chat-rates`, only when given):
- `alone`: one stream at a time (`--alone` of them): first audio of a stream with the server to itself;
- `burst`: `--burst` streams sent at once: the first one's first audio next to its value alone, and whether
  the later ones (queued or refused) slow it;
- `poisson R`: open-loop arrivals at R streams per second for `--duration` seconds (a rate sweep with several R),
  seeded, so every server sees the same arrival times (`--max-queue` 8: arrivals past capacity wait or get 429);
- `closed C`: C clients, each sending its next request when the last ended, for `--duration` seconds; a client
  refused with 429 first waits as the official `openai` client does (`retry_delay_s`: the `retry-after-ms` or
  `Retry-After` header, else an exponential backoff), and with `--ignore-retry-after` sends again at once (a client
  that floods a full server: what it costs the streams the server plays is what that load measures). The clients
  start at once, and replies of one length keep them in step (each round a burst of C) unless `--stagger S` spreads
  their first requests over S seconds. How much in step differs by server (a server whose streams all last alike
  keeps its clients in larger groups), and a group's first audio grows with its size, so each closed load also
  reports first audio by the size of the group a request was sent in (`first_audio_by_group`: sent within 10 ms
  of the one before), and the summary compares servers at equal group sizes.

Servers: this checkout's (`ours`); with `--compare`, also this checkout's with `--admission off` (every stream
joins the batch at once and chunks after the first are 25 frames), so before/after is one run; with
`--previous-tree DIR` (e.g. `git worktree add DIR <commit>`), the server of another checkout too, on the same
model, `--max-queue` and `--serve-arg` flags. `--quick` runs the tiny models on short loads (a check
that the script works: its figures mean nothing).

    python benchmarks/serve_playback.py --compare --out benchmarks/results/serve_playback.json
    python benchmarks/serve_playback.py --quick --workloads speech speech_stream chat
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import percentile, server_process  # noqa: E402
from tts_realtime import build_checkpoint  # noqa: E402

from omnimtp.engine.playback import PlaybackClock  # noqa: E402

SAMPLE_RATE = 24000
TEXTS = [
    "Hello there, this is a stream of speech that has to play without a gap.",
    "Another sentence to speak, a little longer, with a comma and a few more words in it.",
    "A short one, to keep things moving.",
    "The fourth sentence talks about the weather, the trains, and what is for dinner tonight.",
]
WORKLOADS = ("speech", "speech_stream", "chat")
# openai-python's retry delays (`openai._constants`): a server's retry-after honoured up to two minutes, else an
# exponential backoff from half a second up to 8 s, less a random quarter at most.
MAX_RETRY_AFTER_S = 120.0
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
# A gap shorter than this is a player's jitter, not an underrun (one 24 kHz PCM16 TCP read can lag by a few ms).
MIN_STALL_S = 0.005
# Requests sent within this of the one before went together (closed-loop clients in step: `first_audio_by_group`).
GROUP_WINDOW_S = 0.010


class Stream:
    """One response as a listener hears it."""

    def __init__(self, started: float):
        self.started = started
        self.clock = PlaybackClock(min_stall_s=MIN_STALL_S)
        self.status = 200
        self.retry_after: str | None = None
        self.retry_after_ms: str | None = None
        self.error: str | None = None
        self.queue_position: int | None = None

    def refused(self, response: httpx.Response) -> None:
        self.retry_after = response.headers.get("retry-after")
        self.retry_after_ms = response.headers.get("retry-after-ms")

    def audio(self, num_bytes: int) -> None:
        self.clock.push(time.perf_counter(), num_bytes / 2 / SAMPLE_RATE)

    def result(self) -> dict:
        clock = self.clock
        first_audio = None if clock.started_at is None else clock.started_at - self.started
        return {"sent_at": self.started, "status": self.status, "error": self.error,
                "retry_after": self.retry_after, "retry_after_ms": self.retry_after_ms,
                "queue_position": self.queue_position, "first_audio_s": first_audio, "audio_s": clock.audio_s,
                "underruns": clock.num_underruns, "stalled_s": clock.stalled_s, "continuity": clock.continuity,
                "total_s": time.perf_counter() - self.started}


async def speech_request(client: httpx.AsyncClient, index: int, voice: str | None) -> dict:
    body = {"input": TEXTS[index % len(TEXTS)], "response_format": "pcm", "seed": index}
    if voice is not None:
        body["voice"] = voice
    stream = Stream(time.perf_counter())
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        stream.status = response.status_code
        position = response.headers.get("x-queue-position")
        stream.queue_position = None if position is None else int(position)
        if response.status_code != 200:
            stream.refused(response)
            stream.error = json.loads(await response.aread())["error"]["code"]
            return stream.result()
        odd = b""
        async for data in response.aiter_bytes():
            data = odd + data
            odd = data[len(data) // 2 * 2:]
            if len(data) >= 2:
                stream.audio(len(data) - len(odd))
    return stream.result()


async def speech_stream_request(url: str, index: int, voice: str | None) -> dict:
    stream = Stream(time.perf_counter())
    ws_url = "ws" + url[len("http"):] + "/v1/audio/speech/stream"
    try:
        async with websockets.connect(ws_url, max_size=None) as ws:
            config = {"type": "session.config", "seed": index, **({} if voice is None else {"voice": voice})}
            await ws.send(json.dumps(config))
            words = TEXTS[index % len(TEXTS)].split(" ")
            for start in range(0, len(words), 4):  # the text in pieces, as an LLM writes it
                await ws.send(json.dumps({"type": "input_text.delta", "delta": " ".join(words[start:start + 4]) + " "}))
            await ws.send(json.dumps({"type": "input_text.done"}))
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "audio.delta":
                    stream.audio(len(base64.b64decode(event["delta"])))
                elif event["type"] == "queued":
                    stream.queue_position = event["queue_position"]
                elif event["type"] == "error":
                    stream.status, stream.error = 429 if event["error"]["code"] == "queue_full" else 500, \
                        event["error"]["code"]
                    stream.retry_after = event["error"].get("retry_after")
                    break
                elif event["type"] == "done":
                    break
    except websockets.InvalidStatus as exc:
        stream.status, stream.error = exc.response.status_code, "refused"
        stream.retry_after = exc.response.headers.get("Retry-After")
    return stream.result()


async def chat_request(client: httpx.AsyncClient, index: int, voice: str | None, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": f"def parse_{index}(text):"}], "modalities": ["text", "audio"],
            "audio": {"voice": voice or "ethan", "format": "pcm16"}, "stream": True, "seed": index,
            "max_tokens": max_tokens}
    stream = Stream(time.perf_counter())
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        stream.status = response.status_code
        position = response.headers.get("x-queue-position")
        stream.queue_position = None if position is None else int(position)
        if response.status_code != 200:
            stream.refused(response)
            stream.error = json.loads(await response.aread())["error"]["code"]
            return stream.result()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                stream.error = payload["error"]["type"]
                break
            for choice in payload["choices"]:
                audio = choice["delta"].get("audio")
                if audio and audio.get("data"):
                    stream.audio(len(base64.b64decode(audio["data"])))
    return stream.result()


def retry_delay_s(result: dict, num_retries: int, rng: random.Random) -> float:
    """How long the official `openai` client waits before retrying a refused request (`_calculate_retry_timeout`):
    the response's `retry-after-ms` (milliseconds), else its `Retry-After` (seconds, a float allowed) when in
    (0, 120] s; else 0.5 · 2^num_retries s (num_retries: this client's refusals in a row before this one), at most
    8 s, less a random quarter at most."""
    for value, divisor in ((result.get("retry_after_ms"), 1000), (result.get("retry_after"), 1)):
        if value is None:
            continue
        try:
            delay = float(value) / divisor
        except ValueError:
            continue
        if 0 < delay <= MAX_RETRY_AFTER_S:
            return delay
        break
    return min(INITIAL_RETRY_DELAY_S * 2.0 ** min(num_retries, 1000), MAX_RETRY_DELAY_S) * (1 - 0.25 * rng.random())


def request_fn(workload: str, url: str, client: httpx.AsyncClient, voice: str | None, max_tokens: int):
    if workload == "speech":
        return lambda index: speech_request(client, index, voice)
    if workload == "speech_stream":
        return lambda index: speech_stream_request(url, index, voice)
    return lambda index: chat_request(client, index, voice, max_tokens)


async def run_load(url: str, workload: str, load: tuple[str, float], voice: str | None, *, duration_s: float,
                   max_tokens: int, seed: int, honours_retry_after: bool = True, stagger_s: float = 0.0) -> list[dict]:
    """One load on one server → each request's result (arrival order; `sent_s`: when it was sent, from the load's
    start; a closed-loop request's `client`: which client sent it). honours_retry_after: a closed-loop client waits
    `retry_delay_s` after a 429 (else it sends its next request at once); stagger_s: closed-loop client i of C sends
    its first request i·stagger_s/C seconds after the first one's (0: all at once)."""
    started = time.perf_counter()
    results = await _run_load(url, workload, load, voice, duration_s=duration_s, max_tokens=max_tokens, seed=seed,
                              honours_retry_after=honours_retry_after, stagger_s=stagger_s)
    for result in results:
        result["sent_s"] = result.pop("sent_at") - started
    return results


async def _run_load(url: str, workload: str, load: tuple[str, float], voice: str | None, *, duration_s: float,
                    max_tokens: int, seed: int, honours_retry_after: bool, stagger_s: float) -> list[dict]:
    kind, amount = load
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        send = request_fn(workload, url, client, voice, max_tokens)
        if kind == "alone":
            return [await send(seed + i) for i in range(int(amount))]
        if kind == "burst":
            return list(await asyncio.gather(*(send(seed + i) for i in range(int(amount)))))
        if kind == "poisson":
            arrivals, tasks, now = random.Random(seed), [], 0.0
            started = time.perf_counter()
            while True:
                now += arrivals.expovariate(amount)
                if now >= duration_s:
                    break
                await asyncio.sleep(max(0.0, started + now - time.perf_counter()))
                tasks.append(asyncio.ensure_future(send(seed + len(tasks))))
            return list(await asyncio.gather(*tasks))
        deadline = time.perf_counter() + duration_s
        counter = iter(range(seed, seed + 1_000_000))

        async def client_loop(client: int) -> list[dict]:
            results, num_retries, rng = [], 0, random.Random(seed + client)
            await asyncio.sleep(client * stagger_s / amount)
            while time.perf_counter() < deadline:
                result = await send(next(counter))
                results.append({**result, "client": client})
                if result["status"] != 429:
                    num_retries = 0
                elif honours_retry_after:
                    delay = retry_delay_s(result, num_retries, rng)
                    num_retries += 1
                    await asyncio.sleep(max(0.0, min(delay, deadline - time.perf_counter())))
            return results

        return [r for rs in await asyncio.gather(*(client_loop(c) for c in range(int(amount)))) for r in rs]


def summarize(results: list[dict], wall_s: float) -> dict:
    """The load's figures: streams that got audio, refused and failed requests, first audio p50/p95 (and of the
    stream served first: a burst's head), underruns, stalled seconds, continuity (the worst stream's and all
    streams'), audio per wall second."""
    played = [r for r in results if r["first_audio_s"] is not None]
    first = [r["first_audio_s"] for r in played]
    audio, stalled = sum(r["audio_s"] for r in played), sum(r["stalled_s"] for r in played)
    return {
        "requests": len(results), "streams": len(played),
        "refused_429": sum(r["status"] == 429 for r in results),
        "failed": sum(r["status"] not in (200, 429) or (r["status"] == 200 and r["error"] is not None)
                      for r in results),
        "queued": sum((r["queue_position"] or 0) > 0 for r in results),
        "first_audio_p50_s": percentile(first, 50), "first_audio_p95_s": percentile(first, 95),
        "head_first_audio_s": min(first, default=None),  # the stream served first
        "underruns": sum(r["underruns"] for r in played), "stalled_s": stalled,
        "continuity_min": min((r["continuity"] for r in played), default=None),
        "continuity_all": audio / (audio + stalled) if audio else None,
        "streams_below_99": sum(r["continuity"] < 0.99 for r in played),
        "audio_s_per_s": audio / wall_s if wall_s else None, "wall_s": wall_s,
        "load_average_1min": os.getloadavg()[0],
    }


def first_audio_by_group(results: list[dict], window_s: float = GROUP_WINDOW_S) -> dict[int, tuple[int, float]]:
    """Streams by the size of the group of requests they were sent in (each sent within window_s of the one
    before: closed-loop clients in step) → {size: (streams, median first audio s)}."""
    played = sorted((r for r in results if r["first_audio_s"] is not None), key=lambda r: r["sent_s"])
    groups: list[list[dict]] = []
    for result in played:
        if groups and result["sent_s"] - groups[-1][-1]["sent_s"] < window_s:
            groups[-1].append(result)
        else:
            groups.append([result])
    sizes: dict[int, list[float]] = {}
    for group in groups:
        sizes.setdefault(len(group), []).extend(r["first_audio_s"] for r in group)
    return {size: (len(first), percentile(first, 50)) for size, first in sorted(sizes.items())}


def like_for_like(mine: dict, other: dict) -> float | None:
    """other / mine first audio at equal group sizes (`first_audio_by_group`): the ratio of the medians at each size
    both have, weighted by the fewer streams of the two at it; None where they share no size."""
    pairs = [(min(mine[size][0], other[size][0]), other[size][1] / mine[size][1])
             for size in mine.keys() & other.keys() if mine[size][1] and other[size][1]]
    weight = sum(w for w, _ in pairs)
    return sum(w * ratio for w, ratio in pairs) / weight if weight else None


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """The server's own first-audio stage histograms (`omnimtp_first_audio_stage_seconds` in /metrics: queue,
    thinker, talker, code2wav): {stage: (seconds in all, requests)}; {} where it has none."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if family.name != "omnimtp_first_audio_stage_seconds":
            continue
        for sample in family.samples:
            stage = totals.setdefault(sample.labels.get("stage", ""), [0.0, 0.0])
            if sample.name.endswith("_sum"):
                stage[0] = sample.value
            elif sample.name.endswith("_count"):
                stage[1] = sample.value
    return {stage: (seconds, count) for stage, (seconds, count) in totals.items()}


def stage_means_ms(before: dict, after: dict) -> dict[str, float]:
    """Each first-audio stage's mean milliseconds over the requests between two `stage_totals`."""
    means = {}
    for stage, (seconds, count) in after.items():
        seconds_before, count_before = before.get(stage, (0.0, 0.0))
        if count > count_before:
            means[stage] = 1000 * (seconds - seconds_before) / (count - count_before)
    return means


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_level(server: str, workload: str, load: tuple[str, float], level: dict) -> None:
    print(f"{server:10s} {workload:13s} {load[0]:7s} {load[1]:<5g} streams {level['streams']}/{level['requests']} "
          f"429 {level['refused_429']} failed {level['failed']} queued {level['queued']}  first audio p50 "
          f"{fmt(level['first_audio_p50_s'])} p95 {fmt(level['first_audio_p95_s'])} head "
          f"{fmt(level['head_first_audio_s'])} s  underruns {level['underruns']} stalled {level['stalled_s']:.2f} s  "
          f"continuity min {fmt(level['continuity_min'], '.4f')} all {fmt(level['continuity_all'], '.4f')}  "
          f"audio/s {fmt(level['audio_s_per_s'], '.2f')}  load {level['load_average_1min']:.2f}", flush=True)
    if load[0] == "closed" and level.get("first_audio_by_group"):
        print(f"{'':10s} {'':13s} first audio p50 by the group it was sent in, size: streams ms  " + "  ".join(
            f"{size}: {n} {fmt(1000 * p50 if p50 is not None else None, '.1f')}"
            for size, (n, p50) in level["first_audio_by_group"].items()), flush=True)
    if level.get("first_audio_stages_ms"):
        print(f"{'':10s} {'':13s} first audio by stage, mean ms: " + "  ".join(
            f"{stage} {ms:.1f}" for stage, ms in level["first_audio_stages_ms"].items()), flush=True)


# The loads each workload runs by default (the sweep on the HTTP route; the WebSocket and chat: fewer, so that the
# full run fits in about 8 minutes).
WORKLOAD_LOADS = {"speech": ("alone", "burst", "poisson", "closed"), "speech_stream": ("alone", "burst", "closed"),
                  "chat": ("alone", "burst", "poisson", "closed")}
# Workloads that share a model share its servers.
MODELS = {"speech": "tts", "speech_stream": "tts", "chat": "omni"}


def loads(args, workload: str) -> list[tuple[str, float]]:
    rates = args.chat_rates if workload == "chat" else args.rates
    every = ([("alone", args.alone), ("burst", args.burst)] + [("poisson", rate) for rate in rates]
             + [("closed", c) for c in args.closed])
    return [load for load in every if load[0] in WORKLOAD_LOADS[workload]]


def model_args(model: str, args, cache_dir: Path) -> tuple[str, ...]:
    """The `serve` flags of a model ("tts" or "omni")."""
    if model == "omni":
        if args.quick:
            return ()  # the embedded tiny Qwen3-Omni
        from omnimtp.mtp.demo import demo_omni_dir

        return ("--model", str(demo_omni_dir()))
    if args.quick:
        return ("--model", "tiny-tts")
    return ("--model", str(build_checkpoint("0.6b", cache_dir / "qwen3-tts-0.6b")), "--quantize", "w4a8")


def print_summary(workload: str, results: dict, args) -> None:
    """The goals' figures: the head of a burst next to a stream alone, the worst stream's continuity, and each other
    server's audio per second (open and closed loads) and first audio p50 next to ours."""
    for name, levels in results.items():
        by_load = {tuple(level["load"]): level for level in levels}
        alone, burst = by_load.get(("alone", args.alone)), by_load.get(("burst", args.burst))
        if alone and burst and alone["first_audio_p50_s"] and burst["head_first_audio_s"]:
            print(f"{name:10s} {workload:13s} burst of {args.burst}: the head's first audio "
                  f"{burst['head_first_audio_s'] / alone['first_audio_p50_s']:.2f}x its value alone (goal <= 2x)")
        worst = min((level["continuity_min"] for level in levels if level["continuity_min"] is not None), default=None)
        print(f"{name:10s} {workload:13s} worst stream's continuity over every load: {fmt(worst, '.4f')} "
              "(goal >= 0.99)")
    ours = {tuple(level["load"]): level for level in results["ours"]}
    for name, levels in results.items():
        if name == "ours":
            continue
        for level in levels:
            mine, load = ours[tuple(level["load"])], f"{level['load'][0]} {level['load'][1]:g}"
            if level["load"][0] in ("poisson", "closed") and level["audio_s_per_s"] and mine["audio_s_per_s"]:
                print(f"{workload:13s} {load}: ours / {name} audio per second "
                      f"{mine['audio_s_per_s'] / level['audio_s_per_s']:.3f}")
            if level["first_audio_p50_s"] and mine["first_audio_p50_s"]:
                print(f"{workload:13s} {load}: {name} / ours first audio p50 "
                      f"{level['first_audio_p50_s'] / mine['first_audio_p50_s']:.3f}")
            ratio = like_for_like(mine.get("first_audio_by_group") or {}, level.get("first_audio_by_group") or {})
            if level["load"][0] == "closed" and ratio is not None:
                print(f"{workload:13s} {load}: {name} / ours first audio p50 at equal group sizes {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--alone", type=int, default=2, help="streams sent one at a time (first audio alone)")
    parser.add_argument("--burst", type=int, default=12, help="streams sent at once")
    parser.add_argument("--rates", type=float, nargs="*", default=[0.3, 1.0],
                        help="open-loop Poisson arrival rates, streams per second (a sweep; `speech` only)")
    parser.add_argument("--chat-rates", type=float, nargs="*", default=[],
                        help="chat: open-loop Poisson arrival rates, streams per second (default none; every server "
                        "sees the same arrival times, so first audio compares without the closed loop's grouping)")
    parser.add_argument("--closed", type=int, nargs="*", default=[4], help="closed-loop client counts")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per open/closed load")
    parser.add_argument("--max-frames", type=int, default=30, help="audio frames per request (30: 2.4 s)")
    parser.add_argument("--max-tokens", type=int, default=24, help="chat: thinker tokens per reply")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=8, help="the servers' --max-queue (429 past it)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server process")
    parser.add_argument("--ignore-retry-after", action="store_true",
                        help="closed-loop clients send their next request at once after a 429 (a flood of refused "
                        "requests) instead of waiting as the openai client does")
    parser.add_argument("--stagger", type=float, default=0.0, metavar="S",
                        help="closed loads: client i of C sends its first request i*S/C seconds after the first "
                        "(default 0: all at once; replies of one length then keep the clients in step, each round "
                        "a burst of C)")
    parser.add_argument("--compare", action="store_true",
                        help="also this checkout's server with --admission off (before/after in one run)")
    parser.add_argument("--previous-tree", metavar="DIR", help="also the server of this checkout (before/after)")
    parser.add_argument("--auto", action="store_true",
                        help="chat: also a server with `auto` speculative thinker steps (the demo's MTP head), its "
                        "step costs measured at its start")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="another `omnimtp serve` flag for every server (repeatable)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"),
                        help="where the 0.6B checkpoint is kept between runs")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, short loads: a check that the script runs (its figures mean nothing)")
    parser.add_argument("--start-timeout", type=float, default=1800,
                        help="seconds a server may take to be warm (a first start on a fresh machine compiles the "
                             "code predictor with a cold inductor cache: minutes on a slow host)")
    parser.add_argument("--out", default="benchmarks/results/serve_playback.json")
    args = parser.parse_args()
    if args.quick:
        args.alone, args.burst, args.rates, args.chat_rates, args.closed, args.duration = 1, 3, [4.0], [4.0], [2], 1.0
        args.max_frames, args.max_tokens = 6, 4
    if args.alone < 1 or args.burst < 1 or any(r <= 0 for r in args.rates + args.chat_rates) or \
            any(c < 1 for c in args.closed):
        parser.error("--alone and --burst must be >= 1, --rates and --chat-rates > 0, --closed >= 1")
    if args.auto and args.quick:
        parser.error("--auto needs the demo Qwen3-Omni (it ships the MTP head): not with --quick")
    os.environ["OMNIMTP_DRAFT_COST_CACHE"] = "0"  # an `auto` server measures its costs now, under this run's load
    started = time.perf_counter()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": vars(args), "results": {}}
    cache_dir = Path(args.cache_dir)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for model in dict.fromkeys(MODELS[workload] for workload in args.workloads):
        flags = (*model_args(model, args, cache_dir), "--max-queue", str(args.max_queue))
        setups = [("ours", None, (*flags, *args.serve_arg))]
        if args.compare:
            setups.append(("no_admit", None, (*flags, *args.serve_arg, "--admission", "off")))
        if args.auto and model == "omni":
            demo = flags[flags.index("--model") + 1]
            setups.append(("auto", None, (*flags, *args.serve_arg, "--thinker-mtp", demo, "-k", "auto")))
        if args.previous_tree:
            setups.append(("previous", args.previous_tree, (*flags, *args.serve_arg)))
        with contextlib.ExitStack() as stack:
            # (each server measured compiled, as a warm `serve` runs; no server's warm-up shares the CPU with a
            # load, the previous tree's included: its compile ran beside this checkout's loads and stalled them)
            urls = {name: stack.enter_context(server_process(
                args.max_batch_size, args.max_frames, args.threads, tree, extra, args.start_timeout,
                wait_compiled=not args.quick and "--eager" not in extra))
                for name, tree, extra in setups}
            voices = {name: (httpx.get(f"{url}/v1/models").json()["data"][0].get("voices") or [None])[0]
                      for name, url in urls.items()}
            for workload in [w for w in args.workloads if MODELS[w] == model]:
                results = report["results"][workload] = {name: [] for name in urls}
                for name, url in urls.items():  # warm-up: the first request's one-off costs, and measured steps
                    asyncio.run(run_load(url, workload, ("alone", 1), voices[name], duration_s=0,
                                         max_tokens=args.max_tokens, seed=10_000))
                for index, load in enumerate(loads(args, workload)):
                    for name, url in urls.items():  # each load on every server in turn
                        stages_before = stage_totals(url)
                        level_started = time.perf_counter()
                        raw = asyncio.run(run_load(url, workload, load, voices[name], duration_s=args.duration,
                                                   max_tokens=args.max_tokens, seed=1000 * index,
                                                   honours_retry_after=not args.ignore_retry_after,
                                                   stagger_s=args.stagger))
                        level = summarize(raw, time.perf_counter() - level_started)
                        level.update(load=list(load), first_audio_stages_ms=stage_means_ms(stages_before,
                                                                                           stage_totals(url)),
                                     first_audio_by_group=first_audio_by_group(raw), streams_detail=raw)
                        results[name].append(level)
                        print_level(name, workload, load, level)
                        Path(args.out).write_text(json.dumps(report, indent=2))  # an interrupted run keeps them
                print_summary(workload, results, args)
    report["total_s"] = time.perf_counter() - started
    print(f"total {report['total_s']:.0f} s")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
