"""Qwen3-TTS's 12 Hz decoder at the released widths, streamed: its large transposed convolutions as matmuls
(the default, `CausalTransConv.MATMUL_MIN_WEIGHTS`) against torch's transposed convolution, in one process.

The decoder of `tts_realtime.py`'s checkpoint (built there first, or `--model DIR`): streamed requests of
`--frames` frames (a 1-frame first chunk, then 25-frame chunks), alone and 8 at once, each form in turn for
`--rounds` rounds, the best round kept. Prints ms per frame for each form, their ratio, and the decoder's floor
on this machine (its FLOPs per frame, by torch's FLOP counter, ÷ the measured fp32 matmul peak). Writes JSON.

    python benchmarks/speech_decoder.py [--frames 12 51] [--batch-sizes 1 8] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from tts_realtime import build_checkpoint, decoder_flops, machine_floors  # noqa: E402

from omnimtp.codec.speech_tokenizer import CausalTransConv, SpeechTokenizerDecoder  # noqa: E402

FORMS = {"matmul": CausalTransConv.MATMUL_MIN_WEIGHTS, "convolution": 1 << 62}


def streamed(decoder, batch_size: int, num_frames: int, generator: torch.Generator) -> float:
    """Seconds to decode `batch_size` streams of `num_frames` random frames chunk by chunk."""
    bounds = [0, 1, *range(26, num_frames, 25), num_frames]
    codes = [torch.randint(0, decoder.codebook_size, (decoder.num_quantizers, num_frames), generator=generator)
             for _ in range(batch_size)]
    streams = [decoder.new_stream() for _ in range(batch_size)]
    started = time.perf_counter()
    for a, b in zip(bounds, bounds[1:], strict=False):
        decoder.decode_streams(streams, [c[:, a:b] for c in codes], [b == num_frames] * batch_size)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Qwen3-TTS checkpoint directory (default: built at 0.6B)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"))
    parser.add_argument("--frames", type=int, nargs="+", default=[12, 51])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/speech_decoder.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else build_checkpoint("0.6b", Path(args.cache_dir) / "qwen3-tts-0.6b")
    machine = machine_floors(args.threads, quick=False)
    decoder = SpeechTokenizerDecoder.from_pretrained(path / "speech_tokenizer")
    peak = machine["fp32_matmul_gflop_s"]
    floor_ms = 1000 * decoder_flops(decoder, 25) / (peak * 1e9)
    print(f"machine: fp32 matmul {peak:.0f} GFLOP/s on {args.threads} threads; decoder floor {floor_ms:.1f} ms "
          "a frame (its FLOPs ÷ that peak)")
    best: dict[tuple[str, int, int], float] = {}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        streamed(decoder, 1, 2, generator)  # warm-up
        for _ in range(args.rounds):
            for form, threshold in FORMS.items():
                CausalTransConv.MATMUL_MIN_WEIGHTS = threshold
                for batch_size in args.batch_sizes:
                    for frames in args.frames:
                        seconds = streamed(decoder, batch_size, frames, generator)
                        key = (form, batch_size, frames)
                        best[key] = min(best.get(key, float("inf")), seconds)
    CausalTransConv.MATMUL_MIN_WEIGHTS = FORMS["matmul"]
    rows = []
    for batch_size in args.batch_sizes:
        for frames in args.frames:
            per_frame = {form: 1000 * best[form, batch_size, frames] / (batch_size * frames) for form in FORMS}
            ratio = per_frame["convolution"] / per_frame["matmul"]
            rows.append({"batch_size": batch_size, "frames": frames, "ms_per_frame": per_frame, "speedup": ratio,
                         "floor_ms_per_frame": floor_ms})
            print(f"batch {batch_size}, {frames} frames: matmul {per_frame['matmul']:.1f} ms a frame, convolution "
                  f"{per_frame['convolution']:.1f} ({ratio:.2f}x); floor {floor_ms:.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "machine": machine, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
