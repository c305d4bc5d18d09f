"""Qwen3-Omni's code2wav at the released widths, streamed as the engine streams it: ours in fp32 and with the
conv stack in bf16 (`codec_dtype="bfloat16"`) against transformers' own decode, in one process.

The model: `Qwen3OmniMoeCode2Wav` with transformers' default code2wav config, which is the released one (16
codebooks of 2048, hidden 1024, 8 layers, 72-frame window, decoder_dim 1536, 1920 samples per frame), seeded
random weights scaled to speech level (`scale_code2wav_to_speech_level`); `--tiny`: the embedded tiny model's
code2wav instead (a quick check that the script runs).

Per batch size (`--batch-sizes`), on `--frames` seeded random frames per stream, the best of `--rounds`:
- reference: transformers' `chunked_decode` (what its `generate` runs) over each stream's frames, one stream at
  a time, fp32;
- ours fp32 and ours bf16: `StreamingCode2Wav.decode` in the engine's chunks (`EngineConfig`: a first chunk of
  `first_chunk_frames`, then `chunk_frames`), all streams in each call.
Printed: ms per frame of audio (80 ms of audio a frame), each against the reference, and the floor of each
(the decode's FLOPs by torch's FLOP counter ÷ the measured matmul peak: the conv stack's over the bf16 peak
for bf16, the rest over the fp32 peak); the SNR of bf16's audio against fp32's, streamed. Writes JSON.

    python benchmarks/omni_codec.py [--batch-sizes 1 8] [--frames 51] [--rounds 3] [--threads 2] [--out c.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from tts_realtime import machine_floors  # noqa: E402

from omnimtp.codec.streaming import StreamingCode2Wav  # noqa: E402
from omnimtp.engine.core import EngineConfig  # noqa: E402

MS_OF_AUDIO_PER_FRAME = 80.0


def build_code2wav(tiny: bool):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from omnimtp.models.tiny import scale_code2wav_to_speech_level, tiny_qwen3_omni_config

    config = tiny_qwen3_omni_config().code2wav_config if tiny else Qwen3OmniMoeCode2WavConfig()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        code2wav = Qwen3OmniMoeCode2Wav(config).eval()
    with torch.no_grad():
        scale_code2wav_to_speech_level(code2wav)
    return code2wav


def flops_per_frame(code2wav, num_frames: int) -> tuple[float, float]:
    """(all, conv stack) FLOPs per frame of transformers' one-shot fp32 forward of num_frames frames."""
    from torch.utils.flop_counter import FlopCounterMode

    config = code2wav.config
    codes = torch.randint(0, config.codebook_size, (1, config.num_quantizers, num_frames),
                          generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        code2wav(codes)
    total = counter.get_total_flops()
    counter = FlopCounterMode(display=False)
    with torch.no_grad():  # the forward's steps, the conv stack's under the counter
        hidden = code2wav.code_embedding(codes + code2wav.code_offset).mean(1)
        hidden = code2wav.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        with counter:
            for module in [*(block for blocks in code2wav.upsample for block in blocks), *code2wav.decoder]:
                hidden = module(hidden)
    return total / num_frames, counter.get_total_flops() / num_frames


def streamed(decoder: StreamingCode2Wav, codes: list[torch.Tensor], bounds: list[int]) -> tuple[float, list]:
    streams = [decoder.new_stream() for _ in codes]
    chunks = [[] for _ in codes]
    started = time.perf_counter()
    for a, b in zip(bounds, bounds[1:], strict=False):
        for i, audio in enumerate(decoder.decode(streams, [c[:, a:b] for c in codes])):
            chunks[i].append(audio)
    return time.perf_counter() - started, [np.concatenate(c) for c in chunks]


def reference(code2wav, codes: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        for block in codes:
            code2wav.chunked_decode(block[None])
    return time.perf_counter() - started


def snr_db(actual, expected) -> float:
    expected = np.asarray(expected, dtype=np.float64)
    return float(10 * np.log10((expected**2).sum() / ((np.asarray(actual, dtype=np.float64) - expected) ** 2).sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--frames", type=int, default=51, help="frames per stream (default 51: 1 + 2 × 25)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model's code2wav (a quick check)")
    parser.add_argument("--out", default="benchmarks/results/omni_codec.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_floors(args.threads, quick=args.tiny)
    code2wav = build_code2wav(args.tiny)
    config = EngineConfig()
    bounds = [0, *range(config.first_chunk_frames, args.frames, config.chunk_frames), args.frames]
    total_flops, stack_flops = flops_per_frame(code2wav, args.frames)
    ours = copy.deepcopy(code2wav)  # StreamingCode2Wav swaps some module classes; the reference keeps transformers'
    decoders = {"fp32": StreamingCode2Wav(ours), "bf16": StreamingCode2Wav(ours, conv_dtype=torch.bfloat16)}
    floors_ms = {
        "fp32": 1e3 * total_flops / (machine["fp32_matmul_gflop_s"] * 1e9),
        "bf16": 1e3 * ((total_flops - stack_flops) / (machine["fp32_matmul_gflop_s"] * 1e9)
                       + stack_flops / (machine["bf16_matmul_gflop_s"] * 1e9)),
    }
    print(f"machine: fp32 matmul {machine['fp32_matmul_gflop_s']:.0f} GFLOP/s, "
          f"bf16 {machine['bf16_matmul_gflop_s']:.0f}, {args.threads} threads; code2wav {total_flops / 1e9:.2f} "
          f"GFLOP a frame ({stack_flops / total_flops:.0%} in the conv stack); chunks {bounds}")
    results = {"machine": machine, "platform": platform.processor() or platform.machine(), "tiny": args.tiny,
               "frames": args.frames, "bounds": bounds, "gflop_per_frame": total_flops / 1e9,
               "conv_stack_share": stack_flops / total_flops, "floor_ms_per_frame": floors_ms, "batches": {}}
    for batch_size in args.batch_sizes:
        generator = torch.Generator().manual_seed(batch_size)
        codes = [torch.randint(0, code2wav.config.codebook_size, (code2wav.config.num_quantizers, args.frames),
                               generator=generator) for _ in range(batch_size)]
        best, audio = {}, {}
        for _ in range(args.rounds):
            best["reference"] = min(best.get("reference", float("inf")), reference(code2wav, codes))
            for name, decoder in decoders.items():
                seconds, audio[name] = streamed(decoder, codes, bounds)
                best[name] = min(best.get(name, float("inf")), seconds)
        ms = {name: 1e3 * seconds / (args.frames * batch_size) for name, seconds in best.items()}
        entry = {"ms_per_frame": ms, "rtf": {name: value / MS_OF_AUDIO_PER_FRAME for name, value in ms.items()},
                 "vs_reference": {name: ms["reference"] / ms[name] for name in decoders},
                 "vs_floor": {name: ms[name] / floors_ms[name] for name in decoders},
                 "bf16_snr_db": snr_db(np.concatenate(audio["bf16"]), np.concatenate(audio["fp32"])),
                 "fp32_rms": float(np.sqrt(np.mean(np.concatenate(audio["fp32"]).astype(np.float64) ** 2)))}
        results["batches"][str(batch_size)] = entry
        print(f"batch {batch_size}: ms per frame (80 ms of audio): reference {ms['reference']:.1f}, "
              f"ours fp32 {ms['fp32']:.1f} ({entry['vs_reference']['fp32']:.2f}x, floor {floors_ms['fp32']:.1f}), "
              f"ours bf16 {ms['bf16']:.1f} ({entry['vs_reference']['bf16']:.2f}x, floor {floors_ms['bf16']:.1f}); "
              f"bf16 SNR {entry['bf16_snr_db']:.1f} dB, fp32 RMS {entry['fp32_rms']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
