"""Text streamed into speech: how soon audio follows the text, over loopback, at concurrency c (default 1 and 8).

Each of `c` clients at once opens `/v1/audio/speech/stream`, sends the text in `--delta-chars` pieces every
`--delta-interval-s` (an LLM writing its reply), then `input_text.done`, and records:

- last_delta_to_audio_s: from sending the last `input_text.delta` to the first `audio.delta` (negative when the
  audio started while the text was still coming: the talker speaks the rows it has);
- first_delta_to_audio_s: from the first delta to the first audio.

Beside it, on the same server and at the same concurrency, the same text sent whole to `/v1/audio/speech`
(streamed PCM) once the text is complete, which is what a client without text streaming does: its time to the
first audio byte (whole_ttfa_s). The ratio last_delta_to_audio / whole_ttfa (p50) is what streaming the text in
saves. Rounds alternate between the two so that drift of a shared machine hits both alike.

    python benchmarks/speech_stream_latency.py --out benchmarks/results/speech_stream_latency.json
    python benchmarks/speech_stream_latency.py --model /path/to/Qwen3-TTS-12Hz-0.6B-CustomVoice --device cuda

Without --model the embedded tiny Qwen3-TTS is saved to a temporary checkpoint and served (`--eager`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import httpx
from websockets.asyncio.client import connect

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this tree's omnimtp (it saves the tiny model)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import server_process  # noqa: E402

TEXT = ("Streaming text into speech lets a voice agent start talking while its reply is still being written, "
        "one word at a time.")


async def streamed(url: str, text: str, args, seed: int) -> dict:
    ws_url = url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    async with connect(ws_url, open_timeout=60, max_size=None) as ws:
        await ws.send(
            json.dumps({"type": "session.config", "seed": seed, **({"voice": args.voice} if args.voice else {})})
        )
        configured = json.loads(await ws.recv())
        if configured["type"] != "session.configured":
            raise RuntimeError(f"session.config refused: {configured}")
        first_audio = None

        async def receive():
            nonlocal first_audio
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "audio.delta" and first_audio is None:
                    first_audio = time.perf_counter()
                if event["type"] in ("done", "error"):
                    return event

        receiver = asyncio.ensure_future(receive())
        pieces = [text[i : i + args.delta_chars] for i in range(0, len(text), args.delta_chars)]
        first_sent = time.perf_counter()
        for piece in pieces:
            await ws.send(json.dumps({"type": "input_text.delta", "delta": piece}))
            last_sent = time.perf_counter()
            await asyncio.sleep(args.delta_interval_s)
        await ws.send(json.dumps({"type": "input_text.done"}))
        done = await receiver
        if done["type"] != "done" or first_audio is None:
            raise RuntimeError(f"the stream ended without audio: {done}")
        return {"last_delta_to_audio_s": first_audio - last_sent, "first_delta_to_audio_s": first_audio - first_sent,
                "frames": done["usage"]["output_tokens"]}


async def whole(client: httpx.AsyncClient, url: str, text: str, args, seed: int) -> dict:
    body = {"input": text, "response_format": "pcm", "seed": seed, **({"voice": args.voice} if args.voice else {})}
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/v1/audio/speech: {response.status_code} {(await response.aread())[:200]!r}")
        first = None
        async for chunk in response.aiter_bytes():
            if chunk and first is None:
                first = time.perf_counter()
    return {"whole_ttfa_s": first - started}


def p50(values: list[float]) -> float:
    return statistics.median(values)


async def run_level(url: str, concurrency: int, args) -> dict:
    rows_streamed, rows_whole = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for round_index in range(args.rounds):
            seeds = [round_index * concurrency + i for i in range(concurrency)]
            rows_streamed += await asyncio.gather(*(streamed(url, args.text, args, s) for s in seeds))
            rows_whole += await asyncio.gather(*(whole(client, url, args.text, args, s) for s in seeds))
    level = {
        "concurrency": concurrency,
        "last_delta_to_audio_s_p50": p50([r["last_delta_to_audio_s"] for r in rows_streamed]),
        "first_delta_to_audio_s_p50": p50([r["first_delta_to_audio_s"] for r in rows_streamed]),
        "whole_ttfa_s_p50": p50([r["whole_ttfa_s"] for r in rows_whole]),
        "frames_mean": statistics.mean(r["frames"] for r in rows_streamed),
        "num_requests": len(rows_streamed),
    }
    level["ratio_last_delta_to_audio_vs_whole_ttfa"] = level["last_delta_to_audio_s_p50"] / level["whole_ttfa_s_p50"]
    return level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", help="a Qwen3-TTS (or Qwen3-Omni) checkpoint directory (default: the tiny Qwen3-TTS)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--voice", default=None, help="the voice (required on an omni model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--delta-chars", type=int, default=4)
    parser.add_argument("--delta-interval-s", type=float, default=0.02)
    parser.add_argument("--max-frames", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            from omnimtp.pipeline import OmniPipeline

            model = os.path.join(scratch, "tiny-qwen3-tts")
            OmniPipeline.tiny(family="qwen3_tts").save_pretrained(model)
        extra = ("--model", model, "--device", args.device, "--eager")
        with server_process(max(args.concurrency), args.max_frames, args.threads, extra_args=extra) as url:
            levels = [asyncio.run(run_level(url, c, args)) for c in args.concurrency]
    result = {"benchmark": "speech_stream_latency", "model": args.model or "tiny qwen3_tts",
              "delta_chars": args.delta_chars, "delta_interval_s": args.delta_interval_s,
              "max_frames": args.max_frames, "load_average_1m": os.getloadavg()[0], "levels": levels}
    for level in levels:
        print(f"c={level['concurrency']:>2}  "
              f"last delta → audio p50 {level['last_delta_to_audio_s_p50'] * 1e3:8.1f} ms   "
              f"whole text TTFA p50 {level['whole_ttfa_s_p50'] * 1e3:8.1f} ms   ratio "
              f"{level['ratio_last_delta_to_audio_vs_whole_ttfa']:.2f}   first delta → audio "
              f"{level['first_delta_to_audio_s_p50'] * 1e3:.1f} ms")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
