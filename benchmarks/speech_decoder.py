"""Qwen3-TTS's 12 Hz decoder at the released widths, streamed in chunks of a fixed size: ms per frame by chunk
size, next to the decoder's FLOP floor; with `--previous-tree DIR`, another checkout's decoder timed alternately
with this one's (before/after a change).

The decoder of `tts_realtime.py`'s checkpoint (built there first, or `--model DIR`): for each of `--streams`
counts, that many streams of `--frames` random frames decoded together chunk by chunk (`decode_streams`, every
chunk `--chunks` frames, the last one what is left), `--repeats` times per process, the best kept. Each tree runs
in its own process (the previous tree's `omnimtp` imported from DIR), `--rounds` rounds alternating the trees, the
best round kept. Prints, per stream count and chunk size and tree, ms per frame and per decode call, wall and
process CPU, the transformer's share of a call (the codec's `_advance_transformer`, CPU), and (load-independent)
the GFLOP a frame the streamed decode runs; the first stream's audio's max |Δ| against the tree's one-shot `decode`
and against the other tree's streamed audio (relative to the peak), and the decoder's floor on this machine (its
FLOPs per frame, by torch's FLOP counter on a 25-frame one-shot decode, ÷ the measured fp32 matmul peak). Writes
JSON.

    git archive <commit> | tar -x -C /tmp/before      # a copy of the previous tree
    python benchmarks/speech_decoder.py [--chunks 1 2 4 25] [--streams 1 2 4] [--frames 50]
        [--codec-dtype bfloat16] [--previous-tree /tmp/before] [--quick]
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


def worker(args) -> None:
    """One tree's timings, as JSON on stdout; the streamed audio per chunk size into args.audio_out (npz)."""
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import numpy as np
    import torch

    from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder

    torch.set_num_threads(args.threads)
    decoder = SpeechTokenizerDecoder.from_pretrained(Path(args.model) / "speech_tokenizer")
    if args.codec_dtype != "float32":
        from omnimtp.codec.streaming import codec_dtype_of

        decoder.to_conv_dtype(codec_dtype_of(args.codec_dtype))
    generator = torch.Generator().manual_seed(0)
    all_codes = [torch.randint(0, decoder.codebook_size, (decoder.num_quantizers, args.frames), generator=generator)
                 for _ in range(max(args.streams))]
    one_shot = decoder.decode(all_codes[0])
    peak = float(np.abs(one_shot).max())
    transformer_cpu = [0.0]  # CPU seconds in the codec's transformer part (whatever its signature in this tree)
    codec = type(decoder._streaming)
    advance = codec._advance_transformer

    def timed_advance(self, *arguments):
        started = time.process_time()
        out = advance(self, *arguments)
        transformer_cpu[0] += time.process_time() - started
        return out

    codec._advance_transformer = timed_advance

    def streamed(chunk: int, num_streams: int) -> tuple[float, float, float, int, np.ndarray]:
        """(wall seconds, process CPU seconds, the transformer's CPU seconds, decode calls, the first stream's
        audio)"""
        codes = all_codes[:num_streams]
        bounds = [*range(0, args.frames, chunk), args.frames]
        streams = [decoder.new_stream() for _ in codes]
        pieces = []
        transformer_cpu[0] = 0.0
        started, cpu_started = time.perf_counter(), time.process_time()
        for a, b in zip(bounds, bounds[1:], strict=False):
            pieces.append(decoder.decode_streams(streams, [c[:, a:b] for c in codes])[0])
        return (time.perf_counter() - started, time.process_time() - cpu_started, transformer_cpu[0],
                len(bounds) - 1, np.concatenate(pieces))

    def counted_flops(chunk: int, num_streams: int) -> float:
        """FLOPs a frame of the streamed decode, the row kernel off (torch's FLOP counter does not see its op;
        the same sums run as MKL matmuls and convolutions instead; the attention kernel's are not counted)."""
        from torch.utils.flop_counter import FlopCounterMode

        from omnimtp.codec import streaming

        kept, streaming.ROW_KERNEL_MAX_ROWS = streaming.ROW_KERNEL_MAX_ROWS, 0
        try:
            # a one-row linear runs as torch.mv (`runtime.ops.linear`), which the counter does not count itself
            counter = FlopCounterMode(display=False, custom_mapping={
                torch.ops.aten.mv: lambda matrix, vector, *_, **__: 2 * matrix[0] * matrix[1]})
            with counter:
                streamed(chunk, num_streams)
        finally:
            streaming.ROW_KERNEL_MAX_ROWS = kept
        return counter.get_total_flops() / (args.frames * num_streams)

    with torch.no_grad():
        streamed(args.frames, max(args.streams))  # warm-up: weights packed, caches filled
        results, audio = {}, {}
        for num_streams in args.streams:
            for chunk in args.chunks:
                key = f"{num_streams}x{chunk}"
                runs = [streamed(chunk, num_streams) for _ in range(args.repeats)]
                seconds, _, _, calls, audio[key] = min(runs, key=lambda r: r[0])
                cpu_seconds, transformer_seconds = min(r[1] for r in runs), min(r[2] for r in runs)
                frames = args.frames * num_streams
                results[key] = {
                    "streams": num_streams, "chunk_frames": chunk,
                    "ms_per_frame": 1000 * seconds / frames, "cpu_ms_per_frame": 1000 * cpu_seconds / frames,
                    "ms_per_call": 1000 * seconds / calls, "cpu_ms_per_call": 1000 * cpu_seconds / calls,
                    "transformer_cpu_ms_per_call": 1000 * transformer_seconds / calls,
                    "max_rel_diff_vs_one_shot": float(np.abs(audio[key] - one_shot).max()) / peak,
                    "gflop_per_frame": counted_flops(chunk, num_streams) / 1e9 if args.count_flops else None,
                }
    if args.audio_out:
        np.savez(args.audio_out, peak=peak, **audio)
    print(json.dumps(results))


def run_worker(args, tree: str, audio_out: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--tree", tree, "--model", str(args.model),
               "--frames", str(args.frames), "--streams", *map(str, args.streams), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--codec-dtype", args.codec_dtype,
               "--audio-out", audio_out, "--chunks", *map(str, args.chunks),
               *([] if args.count_flops else ["--no-flops"])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the worker for {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Qwen3-TTS checkpoint directory (default: built at 0.6B)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"))
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 25])
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--streams", type=int, nargs="+", default=[1],
                        help="stream counts, each decoded together in one call a chunk")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--codec-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the conv stack's dtype (`codec_dtype`; bfloat16: how a server runs it under load)")
    parser.add_argument("--previous-tree", metavar="DIR", help="also time this checkout's decoder (before/after)")
    parser.add_argument("--quick", action="store_true", help="26 frames, one round, one repeat (a smoke run)")
    parser.add_argument("--no-flops", dest="count_flops", action="store_false",
                        help="skip counting each chunk size's FLOPs a frame (one more streamed pass each)")
    parser.add_argument("--out", default="benchmarks/results/speech_decoder.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--audio-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if any(chunk < 1 for chunk in args.chunks) or args.frames < 1 or any(n < 1 for n in args.streams):
        parser.error("--chunks, --streams and --frames must be positive")
    if args.quick:
        args.frames, args.rounds, args.repeats = 26, 1, 1

    sys.path.insert(0, str(HERE.parent))  # this checkout, not an installed copy
    sys.path.insert(0, str(HERE))
    import numpy as np
    import torch
    from tts_realtime import build_checkpoint, decoder_flops, machine_floors

    from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder

    args.model = Path(args.model) if args.model else build_checkpoint("0.6b", Path(args.cache_dir) / "qwen3-tts-0.6b")
    machine = machine_floors(args.threads, quick=args.quick)
    flops = decoder_flops(SpeechTokenizerDecoder.from_pretrained(args.model / "speech_tokenizer"), 25)
    floor_ms = 1000 * flops / (machine["fp32_matmul_gflop_s"] * 1e9)
    print(f"machine: fp32 matmul {machine['fp32_matmul_gflop_s']:.0f} GFLOP/s on {args.threads} threads; decoder "
          f"{flops / 1e9:.2f} GFLOP a frame, floor {floor_ms:.1f} ms a frame (its FLOPs ÷ that peak)")
    torch.set_num_threads(args.threads)
    trees = {"current": str(HERE.parent)}
    if args.previous_tree:
        trees["previous"] = args.previous_tree
    best: dict[str, dict[str, dict]] = {name: {} for name in trees}
    minimised = ("cpu_ms_per_frame", "cpu_ms_per_call", "transformer_cpu_ms_per_call")  # each its best round
    with tempfile.TemporaryDirectory() as scratch:
        audio_paths = {name: os.path.join(scratch, f"{name}.npz") for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                for key, entry in run_worker(args, tree, audio_paths[name]).items():
                    kept = best[name].get(key)
                    cpu = {field: min(entry[field], (kept or entry)[field]) for field in minimised}
                    if kept is None or entry["ms_per_frame"] < kept["ms_per_frame"]:
                        kept = entry
                    best[name][key] = dict(kept, **cpu)
        if args.previous_tree:
            current, previous = np.load(audio_paths["current"]), np.load(audio_paths["previous"])
            for key in best["current"]:
                diff = float(np.abs(current[key] - previous[key]).max()) / float(previous["peak"])
                best["current"][key]["max_rel_diff_vs_previous"] = diff
    rows = []
    for key, current in best["current"].items():
        row = {"streams": current["streams"], "chunk_frames": current["chunk_frames"], "floor_ms_per_frame": floor_ms,
               **{name: best[name][key] for name in trees}}
        rows.append(row)
        line = f"{current['streams']} streams, chunks of {current['chunk_frames']:>2}: " + ", ".join(
            f"{name} {best[name][key]['ms_per_frame']:.1f} ms a frame ({best[name][key]['cpu_ms_per_frame']:.1f} CPU), "
            f"a call {best[name][key]['cpu_ms_per_call']:.1f} CPU, transformer "
            f"{best[name][key]['transformer_cpu_ms_per_call']:.2f}"
            + (f" ({best[name][key]['gflop_per_frame']:.2f} GFLOP)" if args.count_flops else "") for name in trees)
        if args.previous_tree:
            ratio = best["previous"][key]["ms_per_frame"] / current["ms_per_frame"]
            cpu_ratio = best["previous"][key]["cpu_ms_per_frame"] / current["cpu_ms_per_frame"]
            transformer_ratio = (best["previous"][key]["transformer_cpu_ms_per_call"]
                                 / current["transformer_cpu_ms_per_call"])
            line += (f" ({ratio:.2f}x wall, {cpu_ratio:.2f}x CPU, transformer {transformer_ratio:.2f}x CPU); "
                     f"max |Δ| vs previous {current['max_rel_diff_vs_previous']:.1e}")
        line += f"; vs one-shot {current['max_rel_diff_vs_one_shot']:.1e} of the peak; floor {floor_ms:.1f}"
        print(line)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    with open(args.out, "w") as f:
        json.dump({"config": config, "machine": machine, "decoder_gflop_per_frame": flops / 1e9,
                   "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
