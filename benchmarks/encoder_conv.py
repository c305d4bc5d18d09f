"""Qwen3-ASR's audio encoder in `int8_compute` on this CPU, stage by stage: the released 0.6B encoder's widths (random
weights; `--aligner`: the forced aligner's), `--seconds` of noise, run two ways in one process, interleaved, the best
of `--rounds` kept:

- "unfused": the encoder as transformers' forward runs it with the int8 layers put in (every linear a "w8a8" linear
  whose row scales and bias are torch ops after oneDNN's GEMM, the 480 -> 480 convolutions `W8A8Conv2d`, the first
  one bf16 channels last), its GELUs `F.gelu` passes and its windows' attention fp32 SDPA window by window;
- "fused": what `fast_audio_encoder(tower, "w8a8")` builds (`W8A8AudioEncoder`): the same GEMMs, each one's row
  scales, bias and GELU in one pass over its output (`encoder_epilogue`; fc1's and proj1's rows handed to the next
  GEMM quantized), the first convolution's GELU in oneDNN's output, conv_out reading the last convolution's rows
  as they are (`W8A8ConvOut`), q/k/v one GEMM, the windows as the rows of one call of the bf16 attention kernel.

Timed (wall, and the process's CPU time divided by the threads: a shared box's other processes take turns inside the
wall time): each convolution with its GELU alone on its input, the conv stack (the three convolutions, their GELUs
and `conv_out`), the layers' attention (q/k/v, the windows, out_proj) over every layer, the whole layers, and the
whole encoder. Error against the float tower: the conv stack's rows and the encoder's output rows, relative (‖a − b‖
/ ‖b‖ over all rows) and the lowest row cosine. Writes JSON.

    python benchmarks/encoder_conv.py --threads 2 --rounds 3 [--seconds 60] [--aligner]
    python benchmarks/encoder_conv.py --quick        # the tiny encoder, 3 s, one round: a check that it runs
"""

from __future__ import annotations

import argparse
import copy
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
    W8A8Conv2d,
    encode_audio,
    fast_audio_encoder,
    tiny_config,
)
from omnimtp.runtime.ops import linear, many_row_mode_reason, quantize_weight  # noqa: E402

RATE = 16_000
CONVS = ("conv2d1", "conv2d2", "conv2d3")
PATHS = ("unfused", "fused")


def _tower(aligner: bool, quick: bool) -> torch.nn.Module:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    audio = tiny_config(aligner)["thinker_config"]["audio_config"]
    # the tiny widths with 16-wide heads (the attention kernel's smallest), so --quick runs every path
    audio = {**audio, **(dict(d_model=64, encoder_attention_heads=4, encoder_ffn_dim=128) if quick else
                         QWEN3_ALIGNER_0_6B_AUDIO if aligner else QWEN3_ASR_0_6B_AUDIO)}
    torch.manual_seed(0)
    config = Qwen3OmniMoeAudioEncoderConfig(**{**audio, "initializer_range": 0.02})
    return Qwen3OmniMoeAudioEncoder(config).eval()


class _UnfusedLinear(torch.nn.Module):
    """A "w8a8" linear as the unfused encoder ran it: `ops.linear` (oneDNN's GEMM, then the row scales and the bias
    as torch ops)."""

    def __init__(self, module: torch.nn.Linear):
        super().__init__()
        self.quantized = quantize_weight(module.weight.detach().float(), "w8a8")
        self.bias = module.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.float(), None, self.bias, packed=self.quantized)


def _unfused(tower: torch.nn.Module) -> torch.nn.Module:
    """A copy of the tower (transformers' forward) with the int8 layers put in (see the module's docstring)."""
    encoder = copy.deepcopy(tower, {id(t): t for t in [*tower.parameters(), *tower.buffers()]})
    for name, module in tower.named_modules():
        parent_name, _, child = name.rpartition(".")
        parent = encoder.get_submodule(parent_name) if parent_name else encoder
        if isinstance(module, torch.nn.Linear):
            setattr(parent, child, _UnfusedLinear(module))
        elif isinstance(module, torch.nn.Conv2d):
            setattr(parent, child, W8A8Conv2d(module) if module.in_channels > 1 else
                    Bf16Conv2d(module, channels_last=True))
    return encoder.eval()


def _features(mel_bins: int, seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(0)
    n = int(seconds * RATE)
    samples = (0.1 * (0.5 + 0.5 * np.sin(np.linspace(0, seconds * np.pi, n))) * rng.standard_normal(n))
    extractor = WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=RATE, return_attention_mask=True)
    out = extractor(samples.astype(np.float32), sampling_rate=RATE, padding=True, truncation=False,
                    return_attention_mask=True, return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def _activation(path: str, rows: torch.Tensor) -> torch.Tensor:
    """The GELU after a convolution: its own in the fused path, `F.gelu` in the unfused one (as the tower's forward)."""
    return rows if path == "fused" else F.gelu(rows)


def _convolve(encoder: torch.nn.Module, path: str, name: str, x: torch.Tensor) -> torch.Tensor:
    return _activation(path, getattr(encoder, name)(x))


def _conv_stack(encoder: torch.nn.Module, path: str, chunks: torch.Tensor) -> torch.Tensor:
    """The convolutions, their GELUs and conv_out on padded chunks [N, 1, mel, 100], as the forward runs them."""
    rows = chunks
    for name in CONVS:
        rows = _convolve(encoder, path, name, rows)
    if path == "fused":  # `W8A8ConvOut` reads the channels-last rows as they are
        return encoder.conv_out(rows)
    b, c, f, t = rows.size()
    return encoder.conv_out(rows.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))


def _attention(encoder: torch.nn.Module, rows: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    for layer in encoder.layers:
        layer.self_attn(rows, cu_seqlens)


def _layers(encoder: torch.nn.Module, path: str, rows: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    for layer in encoder.layers:
        rows = layer(rows, cu_seqlens) if path == "fused" else layer(rows, cu_seqlens)[0]
    return rows


def _error(rows: torch.Tensor, exact: torch.Tensor) -> dict:
    rows, exact = rows.float().reshape(-1, exact.shape[-1]), exact.reshape(-1, exact.shape[-1])
    return {"relative": ((rows - exact).norm() / exact.norm()).item(),
            "min_row_cosine": F.cosine_similarity(rows, exact, dim=-1).min().item()}


def main() -> None:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        chunk_and_pad_features,
        get_audio_cu_seqlens,
        get_valid_indices,
    )

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
    length = int(mask.sum())
    padded, chunk_lengths = chunk_and_pad_features(features[0, :, :length], torch.tensor([length]), tower.n_window)
    chunks = padded[:, None]
    cu_seqlens = get_audio_cu_seqlens(chunk_lengths, torch.tensor([length]), tower.n_window_infer, tower.n_window)
    encoders = {"unfused": _unfused(tower), "fused": fast_audio_encoder(tower, "w8a8")}
    with torch.no_grad():
        stack = _conv_stack(encoders["fused"], "fused", chunks)
        layer_rows = torch.index_select(stack.reshape(-1, stack.shape[-1]), 0,
                                        get_valid_indices(chunk_lengths, tower.n_window)).contiguous()
        jobs = {}
        for path, encoder in encoders.items():
            inputs = {"conv2d1": chunks}
            inputs["conv2d2"] = _convolve(encoder, path, "conv2d1", chunks)
            inputs["conv2d3"] = _convolve(encoder, path, "conv2d2", inputs["conv2d2"])
            for name in CONVS:
                jobs[f"{name} + GELU: {path}"] = (lambda e, p, n, x: lambda: _convolve(e, p, n, x))(
                    encoder, path, name, inputs[name])
            jobs[f"conv stack: {path}"] = (lambda e, p: lambda: _conv_stack(e, p, chunks))(encoder, path)
            jobs[f"attention: {path}"] = (lambda e: lambda: _attention(e, layer_rows, cu_seqlens))(encoder)
            jobs[f"layers: {path}"] = (lambda e, p: lambda: _layers(e, p, layer_rows, cu_seqlens))(encoder, path)
            jobs[f"encoder: {path}"] = (lambda e: lambda: encode_audio(e, features, mask))(encoder)
        for fn in jobs.values():  # warm-up: oneDNN primitives
            fn()
        wall = dict.fromkeys(jobs, float("inf"))
        cpu = dict.fromkeys(jobs, float("inf"))
        for _ in range(rounds):
            for part in {name.split(":")[0] for name in jobs}:  # the two paths of a part back to back
                for path in PATHS:
                    name = f"{part}: {path}"
                    started_wall, started_cpu = time.perf_counter(), time.process_time()
                    jobs[name]()
                    wall[name] = min(wall[name], time.perf_counter() - started_wall)
                    cpu[name] = min(cpu[name], (time.process_time() - started_cpu) / args.threads)
        exact_stack = _conv_stack(tower, "unfused", chunks)
        exact_rows = encode_audio(tower, features, mask).last_hidden_state
        errors = {path: {"conv stack": _error(_conv_stack(encoder, path, chunks), exact_stack),
                         "encoder": _error(encode_audio(encoder, features, mask).last_hidden_state, exact_rows)}
                  for path, encoder in encoders.items()}
        fused_rows = encode_audio(encoders["fused"], features, mask).last_hidden_state
        unfused_rows = encode_audio(encoders["unfused"], features, mask).last_hidden_state
    windows = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    results = {"threads": args.threads, "seconds": seconds, "chunks": chunks.shape[0], "windows": windows,
               "attention_on_kernel": encoders["fused"].layers[0].self_attn.on_kernel(),
               "widths": "tiny" if args.quick else ("aligner 0.6B" if args.aligner else "ASR 0.6B"),
               "timings": {name: {"ms": 1e3 * wall[name], "ms_cpu_time": 1e3 * cpu[name]} for name in jobs},
               "errors": errors, "fused_vs_unfused": _error(fused_rows, unfused_rows), "ratios": {}}
    for part in dict.fromkeys(name.split(":")[0] for name in jobs):
        before, after = f"{part}: unfused", f"{part}: fused"
        results["ratios"][part] = {"wall": wall[before] / wall[after],
                                   "cpu_time": cpu[before] / cpu[after] if cpu[after] > 0 else None}
    print(f"{results['widths']} encoder, {seconds:g} s ({chunks.shape[0]} chunks, windows {windows[0]} x "
          f"{len(windows) - 1} + {windows[-1]}), {args.threads} threads, best of {rounds}; attention on the bf16 "
          f"kernel: {results['attention_on_kernel']}")
    for name, figures in results["timings"].items():
        print(f"  {name:30s} {figures['ms']:9.1f} ms (CPU time / threads {figures['ms_cpu_time']:8.1f})")
    for part, ratio in results["ratios"].items():
        cpu_ratio = "" if ratio["cpu_time"] is None else f", CPU time {ratio['cpu_time']:.2f}x"
        print(f"  {part}: unfused / fused {ratio['wall']:.2f}x wall{cpu_ratio}")
    for path, parts in errors.items():
        print(f"  {path} vs fp32: " + "; ".join(f"{part} {100 * e['relative']:.2f} % (min row cosine "
                                                 f"{e['min_row_cosine']:.5f})" for part, e in parts.items()))
    print(f"  fused vs unfused: encoder {100 * results['fused_vs_unfused']['relative']:.2f} %")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
