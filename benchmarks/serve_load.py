"""Bounded load on the OpenAI-compatible server over loopback: continuous batching vs one-at-a-time.

For each concurrency level (default 1, 4, 16), `concurrency` clients each send `requests_per_client`
streamed chat requests with audio back to back (closed loop) and we record, per request: time to the
first audio delta (TTFA), total time, audio seconds received (`--think-time S`: before each request a client pauses
an exponential time of mean S, as a caller listens and answers, so that arrivals do not fall in step with
the engine's iterations as back-to-back requests do). Every request must complete or fail with
a clean OpenAI-style error; both are counted. Two servers run the same load on the same weights:

- ours: continuous batching (`--max-batch-size`, default 16);
- baseline: `max_batch_size=1`, the same engine serving one request at a time (what a server without
  cross-request batching does: queued requests wait for the one in flight);
- with `--replicas N [N ...]`: `omnimtp serve --replicas N` (Ray Serve on a local Ray instance of its
  own), --threads CPUs split over the N replicas, to see what replicas give and what Ray costs;
- with `--previous-tree DIR`: the server of another checkout (e.g. `git worktree add DIR HEAD~1`) at
  ours' batch size, to measure a change before/after in the same run;
- with `--demo`: every server of this checkout serves the shipped demo Qwen3-Omni (a byte-level thinker
  trained on Python sources, prompted with code) instead of the embedded tiny model; with `--thinker-mtp
  K [K ...]` also one server per K (`auto` or k >= 1) at ours' batch size with speculative thinker steps
  drafted by the demo's MTP head (`serve --thinker-mtp DIR -k K`), to see whether speculation pays under
  load (tokens/s and TTFA next to ours, which runs the plain thinker loop). A `-k auto` server measures
  its step costs at start-up in this run: the on-disk cost cache is off unless --cached-costs.

All servers run at once (idle ones wait on a condition) and the levels interleave — each concurrency
level runs on every server before the next level — so slow drift of a shared machine hits all alike. With
`--rounds R` each level runs R times in turn on every server, and each comparison is the median over rounds
of the ratio within a round (its range next to it): a loaded server's TTFA p50 moves by tens of percent from
run to run, more than the differences between servers.

Target: TTFA p50 at concurrency 16 within 3× of concurrency 1 for ours.

Each level also reads the server's /metrics before and after, and prints where the time to first
audio went (server-side means): queue (submitted → admitted), thinker (→ talker prefill), talker
(→ first frame), code2wav (→ first chunk), and the rest of the client's TTFA (HTTP, SSE, base64,
event loop); plus the engine's mean iteration time by phase. The 1-minute load average is recorded
(the machine may be shared: compare ratios within one run).

    python benchmarks/serve_load.py --out benchmarks/results/serve_load.json
    python benchmarks/serve_load.py --demo --thinker-mtp auto 3 --skip-baseline --max-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

SAMPLE_RATE = 24000


@contextlib.contextmanager
def server_process(max_batch_size: int, max_frames: int, threads: int, tree: str | None = None,
                   extra_args: tuple[str, ...] = (), start_timeout_s: float = 300, wait_compiled: bool = False):
    """`omnimtp serve` (embedded tiny model) in its own process on a free loopback port, so the load
    generator never shares an interpreter (or its GIL) with the server; `tree`: run the omnimtp of that
    checkout instead of the installed one; extra_args: more `serve` flags. Ready once /health is 200, and with
    wait_compiled once its warm-up is over (`/metrics`' omnimtp_warm: its warm-up reply and any compiling of the
    code predictor would otherwise share the CPU with what is measured)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree)
    command = [sys.executable, "-m", "omnimtp.cli", "serve", "--port", str(port), "--max-batch-size",
               str(max_batch_size), "--max-frames", str(max_frames), "--max-queue", "256", "--log-level", "warning",
               *extra_args]
    process = subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200 and (
                        not wait_compiled or "omnimtp_warm 1.0" in httpx.get(f"{url}/metrics").text):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(60)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def one_request(client: httpx.AsyncClient, index: int, max_tokens: int, prompt: str | None = None) -> dict:
    """prompt: the user message ("{index}" filled in), a story request by default."""
    body = {
        "messages": [{"role": "user", "content": (prompt or "Tell me a story, number {index}.").format(index=index)}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
        "stream": True, "stream_options": {"include_usage": True}, "seed": index, "max_tokens": max_tokens,
    }
    started = time.perf_counter()
    first_audio = None
    num_samples = 0
    num_tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            error = json.loads(await response.aread())["error"]
            return {"ok": False, "status": response.status_code, "error": error["type"]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                return {"ok": False, "status": 200, "error": payload["error"]["type"]}
            if payload.get("usage"):
                num_tokens = payload["usage"]["completion_tokens"]
            for choice in payload["choices"]:
                audio = choice["delta"].get("audio")
                if audio and audio.get("data"):
                    if first_audio is None:
                        first_audio = time.perf_counter() - started
                    num_samples += len(base64.b64decode(audio["data"])) // 2
    total = time.perf_counter() - started
    audio_s = num_samples / SAMPLE_RATE
    return {"ok": True, "ttfa_s": first_audio, "total_s": total, "audio_s": audio_s, "tokens": num_tokens}


_STAGES = ("queue", "thinker", "talker", "code2wav")
_PHASES = ("think", "talker_admit", "talk", "code2wav")


async def histogram_sums(client: httpx.AsyncClient) -> dict[str, float]:
    """`name{label}_sum` / `_count` values of the server's histograms, by their Prometheus line prefix."""
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if not line.startswith("#") and ("_sum" in line or "_count" in line):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def mean_ms(before: dict, after: dict, name: str, label: str | None = None) -> float | None:
    labels = "" if label is None else "{" + label + "}"
    count = after.get(f"{name}_count{labels}", 0.0) - before.get(f"{name}_count{labels}", 0.0)
    total = after.get(f"{name}_sum{labels}", 0.0) - before.get(f"{name}_sum{labels}", 0.0)
    return 1000 * total / count if count else None


async def run_level(url: str, concurrency: int, requests_per_client: int, max_tokens: int,
                    prompt: str | None = None, think_time_s: float = 0.0) -> dict:
    """think_time_s: each client pauses before each request for a time drawn from an exponential
    distribution with this mean (seeded by the client, so every server sees the same pauses); 0 sends back
    to back."""
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        async def worker(w: int) -> list[dict]:
            pauses = random.Random(w)
            results = []
            for r in range(requests_per_client):
                if think_time_s > 0:
                    await asyncio.sleep(pauses.expovariate(1 / think_time_s))
                results.append(await one_request(client, w * 1000 + r, max_tokens, prompt))
            return results

        before = await histogram_sums(client)
        started = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(w) for w in range(concurrency))) for r in rs]
        wall = time.perf_counter() - started
        after = await histogram_sums(client)
    done = [r for r in results if r["ok"]]
    ttfa = [r["ttfa_s"] for r in done if r["ttfa_s"] is not None]
    audio = sum(r["audio_s"] for r in done)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(done),
        "clean_errors": len(results) - len(done),
        "requests_per_s": len(done) / wall,
        "tokens_per_s": sum(r["tokens"] for r in done) / wall,  # the thinker's text tokens, all requests
        "ttfa_p50_s": percentile(ttfa, 50),
        "ttfa_p95_s": percentile(ttfa, 95),
        "rtf": wall / audio if audio else None,  # wall seconds per second of audio produced, all requests
        "per_request_rtf_p50": percentile([r["total_s"] / r["audio_s"] for r in done if r["audio_s"]], 50),
        "wall_s": wall,
        "load_average_1min": os.getloadavg()[0],
        "ttfa_mean_ms": 1000 * sum(ttfa) / len(ttfa) if ttfa else None,
        "server_ttfa_mean_ms": mean_ms(before, after, "omnimtp_time_to_first_audio_seconds"),
        "first_audio_stage_mean_ms": {
            stage: mean_ms(before, after, "omnimtp_first_audio_stage_seconds", f'stage="{stage}"') for stage in _STAGES
        },
        "engine_phase_mean_ms": {
            phase: mean_ms(before, after, "omnimtp_engine_phase_seconds", f'phase="{phase}"') for phase in _PHASES
        },
    }


def breakdown(level: dict) -> str:
    """One line: the server-side stages of the mean TTFA, the client-side rest, and the engine phases."""
    stages = level["first_audio_stage_mean_ms"]
    parts = [f"{stage} {stages[stage]:.0f}" for stage in _STAGES if stages[stage] is not None]
    if level["server_ttfa_mean_ms"] is not None and level["ttfa_mean_ms"] is not None:
        parts.append(f"http+sse {level['ttfa_mean_ms'] - level['server_ttfa_mean_ms']:.0f}")
    phases = level["engine_phase_mean_ms"]
    iteration = " + ".join(f"{phase} {phases[phase]:.0f}" for phase in _PHASES if phases[phase] is not None)
    return f"    mean TTFA {level['ttfa_mean_ms']:.0f} ms = " + " + ".join(parts) + f"; iteration ms: {iteration}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--think-time", type=float, default=0.0, metavar="S",
                        help="mean seconds a client pauses before each request (exponential, seeded per client), as "
                        "a caller listens and answers; 0 (default): back to back")
    parser.add_argument("--max-frames", type=int, default=25, help="audio frames per request (2 s)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server process")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each level on every server, in turn (the comparisons: median over rounds)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--previous-tree", metavar="DIR", help="also load the server of this checkout (before/after)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="another `omnimtp serve` flag for this checkout's servers (repeatable), e.g. "
                        "--serve-arg=--eager; the previous tree's server gets none")
    parser.add_argument("--replicas", type=int, nargs="+", default=[], metavar="N",
                        help="also load `serve --replicas N` for each N (Ray Serve; --threads CPUs split over them)")
    parser.add_argument("--demo", action="store_true",
                        help="this checkout's servers serve the shipped demo Qwen3-Omni (prompted with code)")
    parser.add_argument("--thinker-mtp", nargs="+", default=[], metavar="K",
                        help="with --demo: also a server with speculative thinker steps (the demo's MTP head, -k K) "
                        "for each K ('auto' or k >= 1)")
    parser.add_argument("--cached-costs", action="store_true",
                        help="let -k auto servers read step costs an earlier start measured (default: measure now)")
    parser.add_argument("--start-timeout", type=float, default=1800,
                        help="seconds a server may take to report ready (its predictor warm-up included)")
    parser.add_argument("--out", default="benchmarks/results/serve_load.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not args.think_time >= 0:
        parser.error("--think-time must be >= 0")
    if args.thinker_mtp and not args.demo:
        parser.error("--thinker-mtp needs --demo (the demo ships the MTP head)")
    if not args.cached_costs:
        os.environ["OMNIMTP_DRAFT_COST_CACHE"] = "0"  # the servers inherit it
    ours_args = tuple(args.serve_arg)
    prompt = None
    if args.demo:
        from omnimtp.mtp.demo import demo_omni_dir

        demo = str(demo_omni_dir())
        ours_args = ("--model", demo, *ours_args)
        prompt = "def parse_{index}(text):"
    setups = [("ours", args.max_batch_size, None, ours_args)]
    for k in args.thinker_mtp:
        setups.append((f"mtp_k{k}", args.max_batch_size, None, (*ours_args, "--thinker-mtp", demo, "-k", k)))
    if args.previous_tree:
        setups.append(("previous", args.max_batch_size, args.previous_tree, ()))
    for num_replicas in args.replicas:
        cpus = f"{args.threads / num_replicas:g}"
        setups.append((f"ray_x{num_replicas}", args.max_batch_size, None,
                       (*ours_args, "--replicas", str(num_replicas), "--num-cpus-per-replica", cpus)))
    if not args.skip_baseline:
        setups.append(("baseline_batch1", 1, None, ours_args))
    report = {"config": vars(args), "results": {name: [] for name, _, _, _ in setups}}
    with contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                server_process(size, args.max_frames, args.threads, tree, extra, args.start_timeout)
            )
            for name, size, tree, extra in setups
        }
        for url in urls.values():
            asyncio.run(run_level(url, 1, 1, args.max_tokens, prompt))  # warm-up
        for concurrency, round_index, (name, url) in itertools.product(
            args.concurrency, range(args.rounds), urls.items()
        ):
            level = asyncio.run(run_level(url, concurrency, args.requests_per_client, args.max_tokens, prompt,
                                          args.think_time))
            level["round"] = round_index
            report["results"][name].append(level)
            print(f"{name:16s} c={concurrency:3d}  req/s {level['requests_per_s']:.2f}  "
                  f"tokens/s {level['tokens_per_s']:.1f}  TTFA p50 "
                  f"{level['ttfa_p50_s']:.3f}s p95 {level['ttfa_p95_s']:.3f}s  RTF {level['rtf']:.3f}  "
                  f"completed {level['completed']}/{level['requests']} clean errors {level['clean_errors']}  "
                  f"load {level['load_average_1min']:.2f}", flush=True)
            print(breakdown(level), flush=True)

    rounds = range(args.rounds)

    def levels(name: str) -> dict[tuple[int, int], dict]:
        return {(level["concurrency"], level["round"]): level for level in report["results"][name]}

    def ratio(name: str, other: str, key: str, c: int) -> str:
        """name's key ÷ other's, each round on its own: the median over rounds (the range when more than one)."""
        mine, theirs = levels(name), levels(other)
        values = sorted(mine[c, r][key] / theirs[c, r][key] for r in rounds)
        median = statistics.median(values)
        return f"{median:.2f}x" if len(values) == 1 else f"{median:.2f}x ({values[0]:.2f}-{values[-1]:.2f})"

    def p50(name: str, c: int) -> str:
        return f"{statistics.median(levels(name)[c, r]['ttfa_p50_s'] for r in rounds):.3f}"

    concurrencies = sorted(set(args.concurrency))
    lo, hi = concurrencies[0], concurrencies[-1]
    ours = levels("ours")
    report["ttfa_p50_ratio_max_vs_min_concurrency"] = statistics.median(
        ours[hi, r]["ttfa_p50_s"] / ours[lo, r]["ttfa_p50_s"] for r in rounds
    )
    print(f"ours: TTFA p50 at c={hi} / c={lo} = {report['ttfa_p50_ratio_max_vs_min_concurrency']:.2f}x (target <= 3x)")
    others = [("previous", "req/s", "requests_per_s")] if "previous" in report["results"] else []
    others += [(f"mtp_k{k}", "tokens/s", "tokens_per_s") for k in args.thinker_mtp]
    others += [(f"ray_x{n}", "req/s", "requests_per_s") for n in args.replicas]
    for name, label, key in others:
        for c in concurrencies:
            print(f"c={c:3d}: {name}/ours {label} {ratio(name, 'ours', key, c)}, TTFA p50 "
                  f"{ratio(name, 'ours', 'ttfa_p50_s', c)} ({p50(name, c)} vs {p50('ours', c)} s)")
    if "baseline_batch1" in report["results"]:
        for c in concurrencies:
            print(f"c={c:3d}: baseline/ours TTFA p50 {ratio('baseline_batch1', 'ours', 'ttfa_p50_s', c)}, "
                  f"ours/baseline req/s {ratio('ours', 'baseline_batch1', 'requests_per_s', c)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
