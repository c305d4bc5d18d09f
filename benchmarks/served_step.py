"""A Qwen3-TTS engine step by chunk schedule: what streaming costs a step beyond decoding the audio in one piece.

One process loads the model once and runs `--streams` streams of `--frames` frames (started together) through an
`EngineCore` of its own under each schedule, the schedules alternated `--rounds` times:
- "one-shot": not streamed, every frame decoded when the talker ends (what `tts_realtime.py` times a step as);
- "served": streamed in the chunks a server with admission sends (`playout_rtf` 0.9: one frame at a time until
  the listener holds more, `omnimtp.engine.playback.chunk_frames_after`);
- "chunks": streamed in `chunk_frames` chunks (`playout_rtf` None).
The server's other settings (max_decode_frames 4·max_batch_size, max_defer_steps 8) hold for all three. Per schedule
and stream count: the decoder calls (fixed by the schedule, whatever the load), the mean, p50, p90 and max wall ms
and the mean process CPU ms of the steps that made a frame for every stream, and the core's phases a step (talk:
talker and code predictor; code2wav: the decoder), the best round by mean step kept. Writes JSON.

    python benchmarks/served_step.py [--model DIR] [--codec-dtype bfloat16] [--streams 1 2] [--frames 40] \\
        [--rounds 2] [--threads 2] [--quick]

Without --model the 0.6B checkpoint of `tts_realtime.py` is built (random weights) and quantized to w4a8 on load,
as `serve_playback.py` serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEDULES = {"one-shot": (False, None), "served": (True, 0.9), "chunks": (True, None)}  # (is_streamed, playout_rtf)
TEXT = "Hello there, this is a benchmark of speech in real time, and a little more text to say."


class PhaseClock:
    """The core's observer: seconds by phase, and the rows of the step in flight."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self.num_rows = 0

    def stage(self, stage: str, seconds: float) -> None:
        pass

    def phase(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def talker_batch(self, num_rows: int) -> None:
        self.num_rows = num_rows


def run_schedule(pipe, config, num_streams: int, frames: int, is_streamed: bool) -> dict:
    from omnimtp.engine.core import EngineCore

    family = pipe.family
    voice = family.speakers[0]
    requests, _ = pipe._speech_requests([TEXT] * num_streams, None, [voice] * num_streams, None, None, None, 0,
                                        frames, is_streamed=is_streamed)  # seeded: the same frames every schedule
    clock = PhaseClock()
    core = EngineCore(family, config, observer=clock)
    for request in requests:
        core.add(request)
    decode, num_calls = family.decode_audio, 0

    def counted(*args, **kwargs):
        nonlocal num_calls
        num_calls += 1
        return decode(*args, **kwargs)

    family.decode_audio = counted
    steps = []  # (rows, wall s, process CPU s)
    try:
        while core.has_work():
            clock.num_rows = 0
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in core.step():
                pass
            steps.append((clock.num_rows, time.perf_counter() - wall, time.process_time() - cpu))
    finally:
        del family.decode_audio  # the instance attribute goes; the family's method is back
    full = [step for step in steps if step[0] == num_streams] or steps
    walls = sorted(1000 * wall for _, wall, _ in full)
    return {"decode_calls": num_calls, "frames": [len(request.frames) for request in requests], "steps": len(full),
            "mean_ms": statistics.fmean(walls),
            "p50_ms": statistics.median(walls), "p90_ms": walls[int(0.9 * (len(walls) - 1))], "max_ms": walls[-1],
            "cpu_mean_ms": statistics.fmean(1000 * cpu for _, _, cpu in full),
            "phase_ms_per_step": {phase: 1000 * seconds / len(full) for phase, seconds in clock.phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Qwen3-TTS checkpoint directory or tiny-tts (default: 0.6B)")
    parser.add_argument("--quantize", default=None, help="quantized linears (default: w4a8 for the built 0.6B)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"))
    parser.add_argument("--codec-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--chunk-frames", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny-tts, 8 frames, one round (a smoke run)")
    parser.add_argument("--out", default="benchmarks/results/served_step.json")
    args = parser.parse_args()
    if min(args.streams) < 1 or args.frames < 2 or args.rounds < 1:
        parser.error("--streams, --frames (>= 2) and --rounds must be positive")
    if args.quick:
        args.model, args.frames, args.rounds = args.model or "tiny-tts", 8, 1
    sys.path.insert(0, str(HERE.parent))  # this checkout's omnimtp, not an installed copy
    import torch

    from omnimtp.pipeline import OmniPipeline

    if args.model is None:
        sys.path.insert(0, str(HERE))
        from tts_realtime import build_checkpoint

        args.model = str(build_checkpoint("0.6b", Path(args.cache_dir) / "qwen3-tts-0.6b"))
        args.quantize = args.quantize or "w4a8"
    torch.set_num_threads(args.threads)
    pipe = OmniPipeline.from_pretrained(args.model, quantize=args.quantize, torch_threads=args.threads,
                                        codec_dtype=None if args.codec_dtype == "float32" else args.codec_dtype)
    batch = max(args.streams)
    base = replace(pipe.config, max_batch_size=batch, max_decode_frames=4 * batch, max_defer_steps=8,
                   chunk_frames=args.chunk_frames, max_frames=max(pipe.config.max_frames, args.frames))
    run_schedule(pipe, base, 1, 2, True)  # warm-up: weights paged in and packed
    results = {}
    for num_streams in args.streams:
        for round_index in range(args.rounds):
            order = list(SCHEDULES) if round_index % 2 == 0 else list(SCHEDULES)[::-1]
            for name in order:
                is_streamed, playout_rtf = SCHEDULES[name]
                entry = run_schedule(pipe, replace(base, playout_rtf=playout_rtf), num_streams, args.frames,
                                     is_streamed)
                key = f"{name} x{num_streams}"
                if key not in results or entry["mean_ms"] < results[key]["mean_ms"]:
                    results[key] = entry
        for name in SCHEDULES:
            entry = results[f"{name} x{num_streams}"]
            phases = ", ".join(f"{phase} {ms:.1f}" for phase, ms in entry["phase_ms_per_step"].items()
                               if phase in ("talk", "code2wav"))
            print(f"{num_streams} stream(s), {name:8s}: {entry['decode_calls']:3d} decoder calls; a step mean "
                  f"{entry['mean_ms']:.1f} ms, p50 {entry['p50_ms']:.1f}, p90 {entry['p90_ms']:.1f}, max "
                  f"{entry['max_ms']:.1f}; CPU {entry['cpu_mean_ms']:.1f} ms; {phases} ms a step", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "quantize": args.quantize, "codec_dtype": args.codec_dtype,
                   "frames": args.frames, "threads": args.threads, "rounds": args.rounds, "results": results}, f,
                  indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
