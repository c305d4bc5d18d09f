"""Qwen3-TTS's 12 Hz decoder in its bf16 conv-stack mode (`codec_dtype="bfloat16"`) at the released widths, with
and without the bf16 rows kernel (`omnimtp.codec.streaming.BF16_ROWS_MAX_STEPS`: 0 turns it off, and the stack
runs as it did before the kernel), alternated in one process: per-call CPU and wall ms of each top-level block
and of the whole decode, for S streams decoded together in chunks of n frames; and each mode's SNR against the
fp32 decoder (the same weights, streamed in one-frame chunks). With `--layers`, instead: the matmuls of a few of
the decoder's own layers, for S streams of R rows each, as one kernel call against torch's bf16 `F.linear` once a
stream (what the stack ran before), alternated (CPU ms a call).

    python benchmarks/codec_rows.py [--streams 1 2 4] [--chunks 1 2 4] [--calls 6] [--rounds 3]
        [--model /work/bench/qwen3-tts-0.6b-w4a8] [--layers --rows 4 8 17 32]

CPU time is the process's (all threads); on a shared box the wall times are not the code's figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Qwen3-TTS checkpoint directory (default: built at 0.6B)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--calls", type=int, default=6, help="decoder calls timed per mode, round and case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--snr-frames", type=int, default=24)
    parser.add_argument("--layers", action="store_true", help="time single layers' matmuls (see above)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 17, 32], help="rows a stream (--layers)")
    parser.add_argument("--out", default="benchmarks/results/codec_rows.json")
    args = parser.parse_args()
    if min(args.streams + args.chunks) < 1 or args.calls < 1 or args.rounds < 1:
        parser.error("--streams, --chunks, --calls and --rounds must be positive")

    sys.path.insert(0, str(HERE.parent))  # this checkout, not an installed copy
    sys.path.insert(0, str(HERE))
    import numpy as np
    import torch
    from tts_realtime import build_checkpoint

    from omnimtp.codec import streaming
    from omnimtp.codec.speech_tokenizer import SpeechTokenizerDecoder
    from omnimtp.runtime.kernels import bf16_rows_linear

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else build_checkpoint("0.6b", Path(args.cache_dir) / "qwen3-tts-0.6b")
    decoder = SpeechTokenizerDecoder.from_pretrained(model / "speech_tokenizer")
    generator = torch.Generator().manual_seed(0)
    snr_codes = torch.randint(0, decoder.codebook_size, (decoder.num_quantizers, args.snr_frames), generator=generator)

    def one_frame_chunks(codes):
        stream = decoder.new_stream()
        return np.concatenate([decoder.decode_streams([stream], [codes[:, i : i + 1]])[0]
                               for i in range(codes.shape[1])])

    if args.layers:
        decoder.to_conv_dtype(torch.bfloat16)
        with torch.no_grad():
            time_layers(decoder, args)
        return
    reference = one_frame_chunks(snr_codes)  # fp32
    decoder.to_conv_dtype(torch.bfloat16)
    kernel_steps = streaming.BF16_ROWS_MAX_STEPS
    modes = {"without": 0, "with": kernel_steps}

    def snr_db(audio):
        return float(10 * np.log10((reference.astype(np.float64) ** 2).sum()
                                   / ((audio.astype(np.float64) - reference) ** 2).sum()))

    snr = {}
    for name, steps in modes.items():
        streaming.BF16_ROWS_MAX_STEPS = steps
        snr[name] = snr_db(one_frame_chunks(snr_codes))
    print(f"kernel available: {bf16_rows_linear.available()}; SNR vs fp32 (one-frame chunks, {args.snr_frames} "
          f"frames): without {snr['without']:.2f} dB, with {snr['with']:.2f} dB")

    top = [m for blocks in decoder.upsample for m in blocks] + list(decoder.decoder)
    names = {m: f"{i}:{type(m).__name__}" for i, m in enumerate(top)}
    acc = collections.defaultdict(lambda: [0.0, 0.0])  # block → [cpu s, wall s]
    layer = streaming.StreamingCode2Wav._layer

    def timed_layer(self, module, x, streams, is_start):
        if module not in names:
            return layer(self, module, x, streams, is_start)
        cpu, wall = time.process_time(), time.perf_counter()
        out = layer(self, module, x, streams, is_start)
        acc[names[module]][0] += time.process_time() - cpu
        acc[names[module]][1] += time.perf_counter() - wall
        return out

    streaming.StreamingCode2Wav._layer = timed_layer
    results = []
    for num_streams in args.streams:
        for chunk in args.chunks:
            per_mode = {name: collections.defaultdict(list) for name in modes}
            for _ in range(args.rounds):
                for name, steps in modes.items():
                    streaming.BF16_ROWS_MAX_STEPS = steps
                    streams = [decoder.new_stream() for _ in range(num_streams)]
                    blocks = [torch.randint(0, decoder.codebook_size, (decoder.num_quantizers, chunk),
                                            generator=generator) for _ in range(num_streams)]
                    for _ in range(2):  # past the first chunk; caches warm
                        decoder.decode_streams(streams, blocks)
                    acc.clear()
                    cpu, wall = time.process_time(), time.perf_counter()
                    for _ in range(args.calls):
                        decoder.decode_streams(streams, blocks)
                    per_mode[name]["total"].append(((time.process_time() - cpu) / args.calls,
                                                    (time.perf_counter() - wall) / args.calls))
                    for block, (c, w) in acc.items():
                        per_mode[name][block].append((c / args.calls, w / args.calls))
            row = {"streams": num_streams, "chunk_frames": chunk}
            for name in modes:  # the median round
                row[name] = {block: {"cpu_ms": 1000 * float(np.median([c for c, _ in v])),
                                     "wall_ms": 1000 * float(np.median([w for _, w in v]))}
                             for block, v in per_mode[name].items()}
            results.append(row)
            print(f"{num_streams} streams, chunks of {chunk}: CPU ms a call (wall), without → with the kernel")
            for block in row["with"]:
                a, b = row["without"][block], row["with"][block]
                print(f"   {block:34s} {a['cpu_ms']:7.2f} ({a['wall_ms']:6.2f}) → {b['cpu_ms']:7.2f} "
                      f"({b['wall_ms']:6.2f})  {a['cpu_ms'] / max(b['cpu_ms'], 1e-9):.2f}x CPU", flush=True)
    streaming.BF16_ROWS_MAX_STEPS = kernel_steps
    streaming.StreamingCode2Wav._layer = layer
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    with open(args.out, "w") as f:
        json.dump({"config": config, "snr_vs_fp32_db": snr, "load_average": os.getloadavg(), "results": results},
                  f, indent=2)
    print(f"wrote {args.out}")


def time_layers(decoder, args) -> None:
    """The kernel against torch's bf16 matmul once a stream on a few of the decoder's layers' weights."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from omnimtp.runtime.kernels.bf16_rows_linear import bf16_rows_linear

    upsample_conv, upsample_next = decoder.upsample[0][0].conv, decoder.upsample[0][1]
    block5, block6 = decoder.decoder[1].block, decoder.decoder[2].block
    layers = {  # [N, K] views of the layers' own weights
        "upsampling 1024 -> 1024 transposed (taps)": upsample_conv.weight.flatten(1).t(),
        "upsampling ConvNeXt 1024 -> 4096 linear": upsample_next.pwconv1.weight,
        "1024 -> 1536 kernel-7 conv": decoder.decoder[0].conv.weight.flatten(1),
        "block 5 1536 -> 768 transposed (taps)": block5[1].conv.weight.flatten(1).t(),
        "block 5 768-channel kernel-7 conv": block5[2].conv1.conv.weight.flatten(1),
        "block 6 768 -> 384 transposed (taps)": block6[1].conv.weight.flatten(1).t(),
    }
    generator = torch.Generator().manual_seed(1)

    def cpu_ms(fn, calls):
        started = time.process_time()
        for _ in range(calls):
            fn()
        return 1000 * (time.process_time() - started) / calls

    print(f"CPU ms a call, {args.threads} threads: torch's bf16 F.linear once a stream → the kernel, one call")
    for name, weight in layers.items():
        cells = []
        for rows in args.rows:
            for streams in args.streams:
                inputs = [torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
                          for _ in range(streams)]
                joined = torch.cat(inputs)

                def per_stream(inputs=inputs, weight=weight):
                    return [F.linear(x, weight) for x in inputs]

                def kernel(joined=joined, weight=weight):
                    return bf16_rows_linear(joined, weight)

                started = time.perf_counter()
                kernel()
                per_stream()
                calls = max(3, int(0.05 / (time.perf_counter() - started + 1e-9)))
                before, after = [], []
                for _ in range(args.rounds):
                    before.append(cpu_ms(per_stream, calls))
                    after.append(cpu_ms(kernel, calls))
                cells.append(f"{streams}x{rows}: {np.median(before):.2f} → {np.median(after):.2f}")
        print(f"  {name} [{weight.shape[0]}, {weight.shape[1]}]: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
