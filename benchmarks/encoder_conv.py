"""The convolutions of Qwen3-ASR's audio encoder in `int8_compute` on this CPU: the released 0.6B encoder's widths
(random weights; `--aligner`: the forced aligner's), `--seconds` of noise, its three 3 x 3 stride-2 convolutions over
chunks of 100 mel frames (480 channels), run two ways in one process, interleaved, the best of `--rounds` kept:

- "bf16 convolutions": the 480 -> 480 ones in bf16 on oneDNN (`Bf16Conv2d`, as the quantized modes run them);
- "w8a8 convolutions": on oneDNN's int8 GEMM (`W8A8Conv2d`: `omnimtp.runtime.ops.conv2d`, each patch a row
  quantized to int8), what `fast_audio_encoder(tower, "w8a8")` builds.

The first convolution (one input channel) is bf16 in both (its rows channels first, or channels last for the w8a8
ones), the linears w8a8 in both. Timed: each convolution alone on its input (wall, and the process's CPU time
divided by the threads: a shared box's other processes take turns inside the wall time); the conv stack (the three
convolutions, their GELUs and `conv_out`); the whole encoder.
Error against the float tower: the conv stack's rows and the encoder's output rows, relative (‖a − b‖ / ‖b‖ over all
rows) and the lowest row cosine. Writes JSON.

    python benchmarks/encoder_conv.py --threads 2 --rounds 3 [--seconds 60] [--aligner]
    python benchmarks/encoder_conv.py --quick        # the tiny encoder, 3 s, one round: a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy

from omnimtp.models.qwen3_asr import (  # noqa: E402
    QWEN3_ALIGNER_0_6B_AUDIO,
    QWEN3_ASR_0_6B_AUDIO,
    Bf16Conv2d,
    encode_audio,
    fast_audio_encoder,
    tiny_config,
)
from omnimtp.runtime.ops import many_row_mode_reason  # noqa: E402

RATE = 16_000
WIDE = ("conv2d2", "conv2d3")  # the convolutions of 480 input channels


def _tower(aligner: bool, quick: bool) -> torch.nn.Module:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    audio = tiny_config(aligner)["thinker_config"]["audio_config"]
    if not quick:
        audio = {**audio, **(QWEN3_ALIGNER_0_6B_AUDIO if aligner else QWEN3_ASR_0_6B_AUDIO)}
    torch.manual_seed(0)
    config = Qwen3OmniMoeAudioEncoderConfig(**{**audio, "initializer_range": 0.02})
    return Qwen3OmniMoeAudioEncoder(config).eval()


def _features(mel_bins: int, seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(0)
    n = int(seconds * RATE)
    samples = (0.1 * (0.5 + 0.5 * np.sin(np.linspace(0, seconds * np.pi, n))) * rng.standard_normal(n))
    extractor = WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=RATE, return_attention_mask=True)
    out = extractor(samples.astype(np.float32), sampling_rate=RATE, padding=True, truncation=False,
                    return_attention_mask=True, return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def _conv_stack(encoder: torch.nn.Module, chunks: torch.Tensor) -> torch.Tensor:
    """The tower's convolutions, GELUs and conv_out on padded chunks [N, 1, mel, 100], as its forward runs them."""
    rows = F.gelu(encoder.conv2d1(chunks))
    rows = F.gelu(encoder.conv2d2(rows))
    rows = F.gelu(encoder.conv2d3(rows))
    b, c, f, t = rows.size()
    return encoder.conv_out(rows.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))


def _error(rows: torch.Tensor, exact: torch.Tensor) -> dict:
    rows, exact = rows.float().reshape(-1, exact.shape[-1]), exact.reshape(-1, exact.shape[-1])
    return {"relative": ((rows - exact).norm() / exact.norm()).item(),
            "min_row_cosine": F.cosine_similarity(rows, exact, dim=-1).min().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--aligner", action="store_true", help="the forced aligner's encoder widths")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    reason = many_row_mode_reason("cpu")
    if reason is not None:
        raise SystemExit(f"w8a8 does not run here: {reason}")
    torch.set_num_threads(args.threads)
    seconds, rounds = (3.0, 1) if args.quick else (args.seconds, args.rounds)
    tower = _tower(args.aligner, args.quick)
    features, mask = _features(tower.config.num_mel_bins, seconds)
    window = 2 * tower.config.n_window
    frames = features.shape[-1] // window * window
    chunks = features[0, :, :frames].view(features.shape[1], -1, window).permute(1, 0, 2)[:, None]
    encoders = {path: fast_audio_encoder(tower, "w8a8") for path in ("bf16 convolutions", "w8a8 convolutions")}
    for name in ("conv2d1", *WIDE):  # the encoder int8_compute ran before: every convolution bf16, channels first
        setattr(encoders["bf16 convolutions"], name, Bf16Conv2d(getattr(tower, name)))
    with torch.no_grad():
        first = F.gelu(encoders["w8a8 convolutions"].conv2d1(chunks))
        inputs = {"conv2d2": first, "conv2d3": F.gelu(encoders["w8a8 convolutions"].conv2d2(first))}
        jobs = {}
        for path, encoder in encoders.items():
            jobs[f"conv2d1: {path}"] = (lambda conv: lambda: conv(chunks))(encoder.conv2d1)
        inputs = {name: (x.contiguous(), x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2))
                  for name, x in inputs.items()}  # per path: the layout its previous layer hands it
        for path, encoder in encoders.items():
            for name in WIDE:
                jobs[f"{name}: {path}"] = (lambda conv, x: lambda: conv(x))(
                    getattr(encoder, name), inputs[name][path == "w8a8 convolutions"])
            jobs[f"conv stack: {path}"] = (lambda e: lambda: _conv_stack(e, chunks))(encoder)
            jobs[f"encoder: {path}"] = (lambda e: lambda: encode_audio(e, features, mask))(encoder)
        for fn in jobs.values():  # warm-up: oneDNN primitives
            fn()
        wall = dict.fromkeys(jobs, float("inf"))
        cpu = dict.fromkeys(jobs, float("inf"))
        for _ in range(rounds):
            for name, fn in jobs.items():
                started_wall, started_cpu = time.perf_counter(), time.process_time()
                fn()
                wall[name] = min(wall[name], time.perf_counter() - started_wall)
                cpu[name] = min(cpu[name], (time.process_time() - started_cpu) / args.threads)
        exact_stack = _conv_stack(tower, chunks)
        exact_rows = encode_audio(tower, features, mask).last_hidden_state
        errors = {path: {"conv stack": _error(_conv_stack(encoder, chunks), exact_stack),
                         "encoder": _error(encode_audio(encoder, features, mask).last_hidden_state, exact_rows)}
                  for path, encoder in encoders.items()}
    flops = {}
    for name in WIDE:
        conv = getattr(tower, name)
        out = F.conv2d(inputs[name][0][:1].float(), conv.weight, None, conv.stride, conv.padding)
        flops[name] = 2 * out.numel() * chunks.shape[0] * conv.weight[0].numel()
    results = {"threads": args.threads, "seconds": seconds, "chunks": chunks.shape[0],
               "widths": "tiny" if args.quick else ("aligner 0.6B" if args.aligner else "ASR 0.6B"),
               "timings": {name: {"ms": 1e3 * wall[name], "ms_cpu_time": 1e3 * cpu[name]} for name in jobs},
               "errors": errors, "ratios": {}}
    for name in jobs:
        conv = name.split(":")[0]
        if conv in flops:
            results["timings"][name]["gflop_s"] = flops[conv] / wall[name] / 1e9
    for part in ("conv2d1", *WIDE, "conv stack", "encoder"):
        before, after = f"{part}: bf16 convolutions", f"{part}: w8a8 convolutions"
        results["ratios"][part] = {"wall": wall[before] / wall[after],
                                   "cpu_time": cpu[before] / cpu[after] if cpu[after] > 0 else None}
    print(f"{results['widths']} encoder, {seconds:g} s ({chunks.shape[0]} chunks), {args.threads} threads, "
          f"best of {rounds}:")
    for name, figures in results["timings"].items():
        rate = f"  {figures['gflop_s']:6.0f} GFLOP/s" if "gflop_s" in figures else ""
        print(f"  {name:34s} {figures['ms']:9.1f} ms (CPU time / threads {figures['ms_cpu_time']:8.1f}){rate}")
    for part, ratio in results["ratios"].items():
        cpu_ratio = "" if ratio["cpu_time"] is None else f", CPU time {ratio['cpu_time']:.2f}x"
        print(f"  {part}: bf16 / w8a8 convolutions {ratio['wall']:.2f}x wall{cpu_ratio}")
    for path, parts in errors.items():
        print(f"  {path} vs fp32: " + "; ".join(f"{part} {100 * e['relative']:.2f} % (min row cosine "
                                                 f"{e['min_row_cosine']:.5f})" for part, e in parts.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
