"""Qwen2.5-Omni token2wav streamed in chunks against the one-shot decode: SNR, time to first audio, total time.

Random seeded weights (redrawn by `scale_token2wav_weights` so the audio is at speech level), random
codes, the same generator seed for the one-shot and every streamed run, so both start from the same noise
and the SNR measures the chunking alone. Cases: the tiny test dims (hidden 32, 1 DiT layer, BigVGAN 64
channels) and Qwen2.5-Omni's real token2wav dims (transformers' `Qwen2_5OmniToken2WavConfig` defaults,
which are the checkpoints' values: DiT hidden 1024, 22 layers, 16 heads × 64, look-ahead layer 10,
look-back layers 0 and 20, block 24 mel frames; BigVGAN 1536 channels, ×240). Random weights do not make
speech, so the SNR at real dims says how far the chunked DiT drifts from the one-shot one on a network of
the real depth and attention reach, not what a trained model sounds like.

Codes are fed in blocks of `--block` (as a talker would hand them over); "first audio" is the compute
time until the first non-empty chunk, with all codes available at once (a live stream also waits for the
chunk + look-ahead codes: `codes_before_first_audio`).

    python benchmarks/token2wav_stream.py                          # tiny and real dims (real: minutes)
    python benchmarks/token2wav_stream.py --cases tiny --chunks 25 50 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2_5OmniToken2WavConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from omnimtp.codec.token2wav import StreamingToken2Wav, scale_token2wav_weights  # noqa: E402
from omnimtp.models.tiny_qwen2_5_omni import tiny_qwen2_5_omni_config  # noqa: E402

SAMPLE_RATE = 24_000


def build(case: str) -> Qwen2_5OmniToken2WavModel:
    if case == "tiny":
        config = tiny_qwen2_5_omni_config().token2wav_config
        config.bigvgan_config.upsample_initial_channel = 64
    else:
        config = Qwen2_5OmniToken2WavConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2_5OmniToken2WavModel(config).eval()
    scale_token2wav_weights(model, generator=torch.Generator().manual_seed(0))
    return model


def snr_db(actual: np.ndarray, expected: np.ndarray) -> float:
    error = actual.astype(np.float64) - expected.astype(np.float64)
    return float(10 * np.log10(np.sum(expected.astype(np.float64) ** 2) / max(np.sum(error**2), 1e-30)))


def run_case(case: str, num_codes: int, chunks: list[int], block: int, seed: int, settings: dict) -> dict:
    model = build(case)
    dit_config = model.code2wav_dit_model.config
    g = torch.Generator().manual_seed(1)
    conditioning = torch.randn(dit_config.enc_emb_dim, generator=g)
    reference_mel = torch.randn(1, 300, dit_config.mel_dim, generator=g)
    codes = torch.randint(0, dit_config.num_embeds, (1, num_codes), generator=g)

    decoder = StreamingToken2Wav(model, **settings)
    start = time.perf_counter()
    one_shot = decoder.one_shot(codes, conditioning, reference_mel, torch.Generator().manual_seed(seed))
    one_shot_s = time.perf_counter() - start
    audio_s = len(one_shot) / SAMPLE_RATE
    rms = float(np.sqrt(np.mean(one_shot.astype(np.float64) ** 2)))
    result = {
        "case": case, "num_codes": num_codes, "audio_s": audio_s, "one_shot_s": one_shot_s,
        "one_shot_rms_dbfs": 20 * np.log10(rms), "one_shot_clipped": float(np.mean(np.abs(one_shot) >= 1.0)),
        "streams": [],
    }
    print(f"[{case}] one-shot: {num_codes} codes = {audio_s:.2f} s audio in {one_shot_s:.2f} s "
          f"({result['one_shot_rms_dbfs']:.1f} dBFS, {100 * result['one_shot_clipped']:.2f}% clipped)", flush=True)
    for chunk_frames in chunks:
        decoder = StreamingToken2Wav(model, chunk_frames=chunk_frames, **settings)
        stream = decoder.new_stream(conditioning, reference_mel, torch.Generator().manual_seed(seed))
        pieces = []
        first_audio_s = None
        start = time.perf_counter()
        for block_start in range(0, num_codes, block):
            is_final = block_start + block >= num_codes
            (piece,) = decoder.decode([stream], [codes[:, block_start : block_start + block]], [is_final])
            if first_audio_s is None and len(piece) > 0:
                first_audio_s = time.perf_counter() - start
            pieces.append(piece)
        total_s = time.perf_counter() - start
        streamed = np.concatenate(pieces)
        assert streamed.shape == one_shot.shape
        row = {
            "chunk_frames": chunk_frames, "look_back_frames": decoder.look_back_frames,
            "look_ahead_frames": decoder.look_ahead_frames, "crossfade_frames": decoder.crossfade_frames,
            "vocoder_context_frames": decoder.vocoder_context_frames,
            "codes_before_first_audio": min(chunk_frames + decoder.look_ahead_frames, num_codes),
            "snr_db": snr_db(streamed, one_shot), "first_audio_s": first_audio_s, "total_s": total_s,
            "total_vs_one_shot": total_s / one_shot_s,
        }
        result["streams"].append(row)
        print(f"[{case}] chunk {chunk_frames:4d}: SNR {row['snr_db']:6.1f} dB, first audio {first_audio_s:.2f} s, "
              f"total {total_s:.2f} s ({row['total_vs_one_shot']:.2f}× one-shot)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["tiny", "real"], choices=["tiny", "real"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[25, 50, 100])
    parser.add_argument("--tiny-codes", type=int, default=500, help="codes of the tiny case (50 per second)")
    parser.add_argument("--real-codes", type=int, default=150, help="codes of the real-dims case")
    parser.add_argument("--block", type=int, default=10, help="codes per decode call")
    parser.add_argument("--look-back", type=int, default=24)
    parser.add_argument("--look-ahead", type=int, default=12)
    parser.add_argument("--crossfade", type=int, default=4)
    parser.add_argument("--vocoder-context", type=int, default=16)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "token2wav_stream.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = dict(
        num_steps=args.num_steps, look_back_frames=args.look_back, look_ahead_frames=args.look_ahead,
        crossfade_frames=args.crossfade, vocoder_context_frames=args.vocoder_context,
    )
    results = []
    for case in args.cases:
        num_codes = args.tiny_codes if case == "tiny" else args.real_codes
        results.append(run_case(case, num_codes, args.chunks, args.block, args.seed, settings))

    print("\n| case | codes | chunk | look-back / ahead | SNR vs one-shot | first audio | total | total / one-shot |")
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        print(f"| {result['case']} | {result['num_codes']} | one-shot | – | – | {result['one_shot_s']:.2f} s | "
              f"{result['one_shot_s']:.2f} s | 1.00 |")
        for row in result["streams"]:
            print(f"| {result['case']} | {result['num_codes']} | {row['chunk_frames']} | {row['look_back_frames']} / "
                  f"{row['look_ahead_frames']} | {row['snr_db']:.1f} dB | {row['first_audio_s']:.2f} s | "
                  f"{row['total_s']:.2f} s | {row['total_vs_one_shot']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads, "torch": torch.__version__, "settings": settings, "block": args.block,
        "seed": args.seed, "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
