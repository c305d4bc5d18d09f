"""Quantized matmuls of a few rows at the Qwen3-TTS 0.6B talker's widths (hidden 1024, MLP 3072, 16/8 heads
× 128): omnimtp's kernel (weight-only int8 per channel and int4 per channel and group of 128; w4a8, those int4
weights with int8 activations per row and group, on AVX512-VNNI or AVX2) against torch's own
CPU kernels (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`), torchao's weight-only configs
(`quantize_`, where it imports) and fp32 (`F.linear`, omnimtp's fp32 row kernel), in one run.

Each round runs one layer's 4 matrices (qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072)
times 7 copies (past the caches) per path, paths interleaved; the best round is kept. Prints ms per layer
and GB/s of the path's own weight bytes. Writes JSON.

    python benchmarks/quantized_linear.py --threads 2 --rows 1 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy

from omnimtp.runtime.kernels import small_batch_linear as sbl  # noqa: E402
from omnimtp.runtime.ops import linear, quantize_weight  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # [out, in] per talker layer
COPIES = 7
GROUP = 128


def torch_int8(weight):
    scale = weight.abs().amax(1) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)


def torch_int4(weight):
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low).clamp(min=1e-6) / 15
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(out_features, -1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scale_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zeros)


def torchao_path(weight, mode):
    """torchao's weight-only config applied to an nn.Linear (None where torchao or the config is missing)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        module.weight.data.copy_(weight)
        if mode == "int8":
            config = Int8WeightOnlyConfig()
        else:
            config = Int4WeightOnlyConfig(group_size=GROUP, int4_packing_format="opaque")
        quantize_(module, config)
        module(torch.randn(1, weight.shape[1]))
        return module
    except (ImportError, RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        print(f"torchao {mode}: not available ({type(exc).__name__}: {str(exc)[:120]})")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/quantized_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(COPIES) for n, k in SHAPES]
    num_weights = sum(w.numel() for w in weights)
    paths = {"fp32 F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
    if sbl.available():
        packed = [sbl.pack_weight(w) for w in weights]
        paths["fp32 omnimtp"] = [
            lambda x, p=p, n=w.shape[0]: sbl.small_batch_linear(x, p, n) for p, w in zip(packed, weights, strict=True)
        ]
        for mode in ("int8", "int4", "w4a8"):
            quantized = [quantize_weight(w, mode) for w in weights]
            paths[f"{mode} omnimtp"] = [
                lambda x, q=q, w=w: linear(x, w, packed=q) for q, w in zip(quantized, weights, strict=True)
            ]
    paths["int8 torch"] = [torch_int8(w) for w in weights]
    paths["int4 torch"] = [torch_int4(w) for w in weights]
    for mode in ("int8", "int4"):
        modules = [torchao_path(w, mode) for w in weights[: len(SHAPES)]]
        if all(m is not None for m in modules):
            modules = modules + [torchao_path(w, mode) for w in weights[len(SHAPES):]]
            paths[f"{mode} torchao"] = modules
    bytes_per_weight = {"fp32": 4, "int8": 1, "int4": 0.5, "w4a8": 0.5}
    results = []
    for rows in args.rows:
        x = torch.randn(rows, 1024, generator=gen)
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in SHAPES}}
        best = dict.fromkeys(paths, float("inf"))
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, fns in paths.items():
                    start = time.perf_counter()
                    for fn, w in zip(fns, weights, strict=True):
                        fn(inputs[w.shape[1]])
                    best[name] = min(best[name], time.perf_counter() - start)
        for name, seconds in best.items():
            gbs = num_weights * bytes_per_weight[name.split()[0]] / seconds / 1e9
            row = {"rows": rows, "path": name, "ms_per_layer": 1e3 * seconds / COPIES, "weight_gbs": gbs}
            results.append(row)
            print(f"rows {rows:2d}  {name:14s} {row['ms_per_layer']:8.3f} ms/layer  {gbs:6.1f} GB/s of its weights")
        del x
    Path(args.out).write_text(json.dumps({
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
