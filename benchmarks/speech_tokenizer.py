"""Qwen3-TTS's 12 Hz speech tokenizer decoder: ours against the `qwen_tts` reference on the same weights.

Cases: the tiny test decoder (`tiny_speech_tokenizer`) and the released decoder's dims (codebook_dim 512,
hidden 512, 16 heads × 64, intermediate 1024, latent 1024, decoder_dim 1536, 8 layers, 72-frame window,
1920 samples per frame) with random weights drawn as the tiny one's (audible). Each case is saved with
`save_pretrained` and loaded by the reference's `Qwen3TTSTokenizerV2Model.from_pretrained` (through
`tests/qwen_tts_reference.py`: the reference is a test dependency), so both decode the same weights.

Per case, on the same random codes:
- one-shot: our `decode` vs the reference's `decode` (time, ratio, max |Δ| / peak);
- streamed, a `--first-chunk`-frame first chunk then `--chunk`-frame chunks: ours (`decode_streams`: KV-cached
  transformer, exact left context) vs the reference's decoder re-run on each chunk with `--left-context`
  frames of codes before it (vLLM-Omni's scheme with the reference's own `chunked_decode` arithmetic):
  time to first audio (compute for the first chunk, all codes available), total time, max |Δ| / peak of the
  joined chunks against the one-shot decode.

    python benchmarks/speech_tokenizer.py                               # tiny and real dims
    python benchmarks/speech_tokenizer.py --cases tiny --tiny-frames 60 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import qwen_tts_reference  # noqa: E402

from omnimtp.codec.speech_tokenizer import RELEASED_DECODER_CONFIG, tiny_speech_tokenizer  # noqa: E402


def best_time(fn, repeats: int):
    """(min seconds over repeats, last result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual.astype(np.float64) - expected).max() / np.abs(expected).max())


def chunk_bounds(num_frames: int, first: int, chunk: int) -> list[int]:
    bounds = [0, min(first, num_frames)]
    while bounds[-1] < num_frames:
        bounds.append(min(bounds[-1] + chunk, num_frames))
    return bounds


def ours_streamed(decoder, codes, bounds):
    stream = decoder.new_stream()
    chunks, first_s = [], None
    start = time.perf_counter()
    for a, b in zip(bounds, bounds[1:], strict=False):
        chunks.append(decoder.decode_streams([stream], [codes[:, a:b]], [b == bounds[-1]])[0])
        first_s = first_s if first_s is not None else time.perf_counter() - start
    return first_s, time.perf_counter() - start, np.concatenate(chunks)


@torch.no_grad()
def reference_streamed(reference, codes, bounds, left_context):
    decoder, upsample = reference.decoder, int(reference.decoder.total_upsample)
    chunks, first_s = [], None
    start = time.perf_counter()
    for a, b in zip(bounds, bounds[1:], strict=False):
        context = min(left_context, a)
        wav = decoder(codes[None, :, a - context : b])[0, 0]
        chunks.append(wav[context * upsample :].numpy())
        first_s = first_s if first_s is not None else time.perf_counter() - start
    return first_s, time.perf_counter() - start, np.concatenate(chunks)


def run_case(case: str, num_frames: int, args) -> dict:
    overrides = {} if case == "tiny" else RELEASED_DECODER_CONFIG
    decoder = tiny_speech_tokenizer(seed=0, **overrides)
    with tempfile.TemporaryDirectory() as path:
        decoder.save_pretrained(path)
        reference = qwen_tts_reference.load_speech_tokenizer(path)
    num_params = sum(p.numel() for p in decoder.parameters())
    codes = torch.randint(0, decoder.codebook_size, (16, num_frames), generator=torch.Generator().manual_seed(1))
    audio_s = num_frames * decoder.samples_per_frame / decoder.sample_rate

    ours_s, ours = best_time(lambda: decoder.decode(codes), args.repeats)
    with torch.no_grad():
        ref_s, ref = best_time(lambda: reference.decode(codes.T[None]).audio_values[0].numpy(), args.repeats)
    result = {
        "case": case, "params": num_params, "frames": num_frames, "audio_s": audio_s,
        "one_shot": {"ours_s": ours_s, "reference_s": ref_s, "speedup": ref_s / ours_s,
                     "max_rel_diff": rel_error(ours, ref)},
    }
    print(f"[{case}] {num_params / 1e6:.1f} M params, {num_frames} frames = {audio_s:.1f} s audio; one-shot: ours "
          f"{ours_s:.3f} s, reference {ref_s:.3f} s ({ref_s / ours_s:.2f}×), max |Δ|/peak {rel_error(ours, ref):.1e}",
          flush=True)

    bounds = chunk_bounds(num_frames, args.first_chunk, args.chunk)
    ours_first, ours_total, ours_joined = min(
        (ours_streamed(decoder, codes, bounds) for _ in range(args.repeats)), key=lambda r: r[1])
    ref_first, ref_total, ref_joined = min(
        (reference_streamed(reference, codes, bounds, args.left_context) for _ in range(args.repeats)),
        key=lambda r: r[1])
    result["streamed"] = {
        "first_chunk": args.first_chunk, "chunk": args.chunk, "reference_left_context": args.left_context,
        "ours_first_audio_s": ours_first, "reference_first_audio_s": ref_first,
        "ours_total_s": ours_total, "reference_total_s": ref_total, "total_speedup": ref_total / ours_total,
        "ours_max_rel_diff_vs_one_shot": rel_error(ours_joined, ours),
        "reference_max_rel_diff_vs_one_shot": rel_error(ref_joined, ref),
    }
    s = result["streamed"]
    print(f"[{case}] streamed {args.first_chunk} + {args.chunk}s: first audio ours {ours_first * 1e3:.0f} ms, "
          f"reference {ref_first * 1e3:.0f} ms; total ours {ours_total:.3f} s, reference ({args.left_context} frames "
          f"of left context) {ref_total:.3f} s ({s['total_speedup']:.2f}×); joined vs one-shot max |Δ|/peak: ours "
          f"{s['ours_max_rel_diff_vs_one_shot']:.1e}, reference {s['reference_max_rel_diff_vs_one_shot']:.1e}",
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["tiny", "real"], choices=["tiny", "real"])
    parser.add_argument("--tiny-frames", type=int, default=250, help="frames of the tiny case (12.5 per second)")
    parser.add_argument("--real-frames", type=int, default=100, help="frames of the real-dims case")
    parser.add_argument("--first-chunk", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=25)
    parser.add_argument("--left-context", type=int, default=72, help="the reference re-run's frames of left context")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (the fastest is kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speech_tokenizer.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [run_case(case, args.tiny_frames if case == "tiny" else args.real_frames, args) for case in args.cases]

    print("\n| case | frames | one-shot ours / ref | × | first audio ours / ref | streamed total ours / ref | × |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        o, s = r["one_shot"], r["streamed"]
        print(f"| {r['case']} | {r['frames']} | {o['ours_s']:.3f} / {o['reference_s']:.3f} s | {o['speedup']:.2f} | "
              f"{s['ours_first_audio_s'] * 1e3:.0f} / {s['reference_first_audio_s'] * 1e3:.0f} ms | "
              f"{s['ours_total_s']:.3f} / {s['reference_total_s']:.3f} s | {s['total_speedup']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads, "torch": torch.__version__, "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
