"""How much speech a second this machine can deliver while every listener keeps real time, and how much admission
by capacity delivers: the Qwen3-TTS 0.6B w4a8 (bf16 codec) costs measured here, then closed-loop clients on the
engine core over a machine of those costs (`omnimtp.server.simulated`).

Measured on this machine, in this run:
- a talker step (the talker and the code predictor, with the rest of a step) by batch size, from
  `benchmarks/tts_realtime.py` (its own process; the 0.6B checkpoint in the released layout, random weights), fitted
  as step_s + step_stream_s a stream;
- a codec call of the 12 Hz decoder (its bf16 conv stack, the server's `--codec-dtype bfloat16`), S streams of n-frame
  chunks, fitted as decode_fixed_s + decode_chunk_s a chunk + decode_frame_s a frame;
- the bf16 matmul peak (the host's compute, which these costs scale with).

Then the same clients (`--clients`, each sending its next `--max-frames`-frame request when its last has finished)
on the engine core over a simulated machine of those costs, for `--duration` simulated seconds, under:
- `off`: `--admission off` (every slot open, chunks of 25 frames after the first);
- `admission`: admission by capacity as served (calibrated at start, learning as it serves; chunks sized for a
  listener who plays from the first one, `playout_rtf` 0.9);
- `cap N`: N streams at a time, chunks as admission's: the bound is the most audio a second of a cap whose listeners
  all keep continuity >= 0.99.
Each: audio seconds a second, stalled seconds, underruns, the worst stream's continuity, first audio p50/p95 (from
sending, queueing included). The talker and codec run on the tiny seeded model, so the figures are the schedule's
on this machine's costs, not a served run's (`benchmarks/serve_playback.py` measures that, with its noise).

    python benchmarks/admission_bound.py [--model /work/bench/qwen3-tts-0.6b] [--clients 4] [--max-frames 60]
        [--max-batch-size 4]
        [--duration 40] [--costs STEP STEP_STREAM FIXED CHUNK FRAME] [--out benchmarks/results/admission_bound.json]

`--costs` (seconds) skips the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTINUOUS = 0.99  # the continuity a cap's every listener keeps to count toward the bound


def fit(rows: list[tuple[list[float], float]]) -> list[float]:
    """Least-squares coefficients of y = Σ c_i x_i, clamped at 0."""
    import numpy as np

    x = np.array([r[0] for r in rows], dtype=np.float64)
    y = np.array([r[1] for r in rows], dtype=np.float64)
    return [max(float(c), 0.0) for c in np.linalg.lstsq(x, y, rcond=None)[0]]


def measure_steps(model: Path, size: str, threads: int, batch_sizes: list[int], tmp: Path,
                  quick: bool = False) -> tuple[dict, dict]:
    """tts_realtime's w4a8 run with the bf16 codec: ({batch: ms a step without the decoder}, its machine)."""
    out = tmp / "tts_realtime.json"
    command = [sys.executable, str(HERE / "tts_realtime.py"), "--model", str(model), "--size", size,
               "--modes", "w4a8", "--codec-dtypes", "bfloat16", "--batch-sizes", *map(str, batch_sizes),
               "--frames", "3" if quick else "24", "--no-reference", "--threads", str(threads), "--out", str(out),
               *(["--quick", "--in-process"] if quick else [])]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    mode = report["modes"][0]
    steps = {}
    for batch in batch_sizes:
        ms = mode[f"batch_{batch}"]["ms_per_frame"]
        steps[batch] = ms["total"] - ms["decoder"]
    return steps, report["machine"]


def measure_codec(model: Path, threads: int, calls: int) -> dict:
    """{(streams, chunk frames): seconds a call} of the 12 Hz decoder's bf16 stack, past each stream's first chunk."""
    import torch

    from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder

    torch.set_num_threads(threads)
    decoder = SpeechTokenizerDecoder.from_pretrained(model / "speech_tokenizer")
    decoder.to_conv_dtype(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    seconds = {}
    with torch.no_grad():
        for streams in (1, 2, 4):
            for frames in (1, 2, 4, 8):
                states = [decoder.new_stream() for _ in range(streams)]
                blocks = [torch.randint(0, decoder.codebook_size, (decoder.num_quantizers, frames),
                                        generator=generator) for _ in range(streams)]
                decoder.decode_streams(states, blocks)  # the first chunk, then the timed ones
                times = []
                for _ in range(calls):
                    started = time.perf_counter()
                    decoder.decode_streams(states, blocks)
                    times.append(time.perf_counter() - started)
                seconds[(streams, frames)] = sorted(times)[len(times) // 2]
    return seconds


def run_policies(costs, args) -> dict:
    import torch

    from omnimtp.engine.config import EngineConfig
    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.server.simulated import calibrated_admission, simulate, speech_request

    torch.set_num_threads(1)
    family = Qwen3TTSFamily.tiny(0)
    batch = args.max_batch_size
    common = dict(max_batch_size=batch, max_frames=args.max_frames, chunk_frames=25, max_defer_steps=8,
                  max_decode_frames=4 * batch)  # the server's (`Engine`)
    listener_sized = EngineConfig(playout_rtf=0.9, **common)
    policies = {"off": (EngineConfig(**common), {"max_speaking": batch}),
                "admission": (listener_sized, {"admission": calibrated_admission(costs, max_streams=batch)})}
    for cap in range(1, batch + 1):
        policies[f"cap {cap}"] = (listener_sized, {"max_speaking": cap})
    rows = {}
    for name, (config, kwargs) in policies.items():
        started = time.perf_counter()
        result = simulate(family, config, costs,
                          lambda index: speech_request(family, index, f"Request number {index} says a few words.",
                                                       args.max_frames),
                          clients=args.clients, duration_s=args.duration, **kwargs)
        first = result.first_audio_s or [float("nan")]
        rows[name] = {"audio_s_per_s": result.audio_per_s, "stalled_s": result.stalled_s,
                      "underruns": result.num_underruns, "min_continuity": result.min_continuity,
                      "most_streams": result.most_streams, "requests": len(result.requests),
                      "first_audio_p50_ms": 1000 * first[len(first) // 2],
                      "first_audio_p95_ms": 1000 * first[int(0.95 * (len(first) - 1))],
                      "wall_s": time.perf_counter() - started}
        row = rows[name]
        print(f"  {name:10s} audio/s {row['audio_s_per_s']:.3f}  stalled {row['stalled_s']:6.2f} s  underruns "
              f"{row['underruns']:4d}  worst continuity {row['min_continuity']:.3f}  most streams "
              f"{row['most_streams']}  first audio p50 {row['first_audio_p50_ms']:.0f} ms p95 "
              f"{row['first_audio_p95_ms']:.0f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Qwen3-TTS checkpoint directory (default: built at --size)")
    parser.add_argument("--size", default="0.6b", choices=["0.6b", "tiny"], help="the checkpoint built (tiny: tests)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"))
    parser.add_argument("--costs", type=float, nargs=5, metavar=("STEP", "STEP_STREAM", "FIXED", "CHUNK", "FRAME"),
                        help="the machine's costs in seconds (skips measuring them)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-frames", type=int, default=60, help="frames a request (60: 4.8 s)")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--duration", type=float, default=40.0, help="simulated seconds of each policy's run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the measurements")
    parser.add_argument("--calls", type=int, default=5, help="codec calls timed a cell (the median counts)")
    parser.add_argument("--quick", action="store_true", help="a short measurement (tests: the script runs)")
    parser.add_argument("--out", default="benchmarks/results/admission_bound.json")
    args = parser.parse_args()
    if min(args.clients, args.max_frames, args.max_batch_size, args.calls, args.threads) < 1 or args.duration <= 0:
        parser.error("--clients, --max-frames, --max-batch-size, --calls, --threads and --duration must be positive")

    sys.path.insert(0, str(HERE.parent))  # this checkout, not an installed copy
    sys.path.insert(0, str(HERE))
    from omnimtp.server.simulated import MachineCosts

    report = {"config": vars(args), "load_average_before": os.getloadavg()}
    if args.costs:
        costs = MachineCosts(*args.costs)
    else:
        from tts_realtime import build_checkpoint

        model = Path(args.model or build_checkpoint(args.size, Path(args.cache_dir) / f"qwen3-tts-{args.size}"))
        batch_sizes = list(range(1, args.max_batch_size + 1))
        with tempfile.TemporaryDirectory() as tmp:
            steps, machine = measure_steps(model, args.size, args.threads, batch_sizes, Path(tmp), args.quick)
        codec = measure_codec(model, args.threads, args.calls)
        step_s, step_stream_s = fit([([1.0, float(b)], ms / 1000) for b, ms in steps.items()])
        fixed, chunk, frame = fit([([1.0, float(s), float(s * n)], t) for (s, n), t in codec.items()])
        costs = MachineCosts(step_s, step_stream_s, fixed, chunk, frame)
        report["machine"] = machine
        report["measured"] = {"step_ms_by_batch": steps,
                              "codec_ms": {f"{s}x{n}": 1000 * t for (s, n), t in codec.items()}}
        print(f"machine: bf16 matmul {machine['bf16_matmul_gflop_s']:.0f} GFLOP/s, fp32 "
              f"{machine['fp32_matmul_gflop_s']:.0f}, read {machine['read_gb_s']:.1f} GB/s on {args.threads} threads")
        print("  talker + code predictor step, ms by batch: "
              + ", ".join(f"{b}: {ms:.1f}" for b, ms in steps.items()))
        print("  codec call, ms (streams x chunk frames): "
              + ", ".join(f"{s}x{n}: {1000 * t:.1f}" for (s, n), t in codec.items()))
    report["costs_s"] = vars(costs)
    print(f"costs: a step {1000 * costs.step_s:.1f} ms + {1000 * costs.step_stream_s:.1f} a stream; a codec call "
          f"{1000 * costs.decode_fixed_s:.1f} ms + {1000 * costs.decode_chunk_s:.1f} a chunk + "
          f"{1000 * costs.decode_frame_s:.1f} a frame")
    print(f"{args.clients} closed-loop clients, {args.max_frames}-frame requests, {args.duration:g} simulated s each:")
    rows = run_policies(costs, args)
    continuous = {name: row for name, row in rows.items()
                  if name.startswith("cap ") and row["min_continuity"] >= CONTINUOUS}
    bound_name = max(continuous, key=lambda name: continuous[name]["audio_s_per_s"], default=None)
    admission, off = rows["admission"]["audio_s_per_s"], rows["off"]["audio_s_per_s"]
    summary = {"bound": bound_name, "admission_over_off": admission / off if off else None,
               "admission_over_bound": admission / continuous[bound_name]["audio_s_per_s"] if bound_name else None}
    if bound_name is None:
        print(f"bound: no cap keeps every listener at continuity >= {CONTINUOUS} on this machine (not even one "
              f"stream); admission / off {summary['admission_over_off']:.2f}")
    else:
        print(f"bound: {bound_name} ({continuous[bound_name]['audio_s_per_s']:.3f} audio s/s, the most audio a second "
              f"of a cap whose listeners keep continuity >= {CONTINUOUS}); admission / bound "
              f"{summary['admission_over_bound']:.3f}, admission / off {summary['admission_over_off']:.3f}")
    report.update(policies=rows, summary=summary, load_average_after=os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
