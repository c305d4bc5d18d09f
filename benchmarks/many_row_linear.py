"""Linears of many rows (an audio encoder, a prefill, the forced aligner's forward) on this CPU: the GEMM rates of
fp32 (`F.linear`), bf16 on oneDNN-packed weights (the runtime's "onednn" kind: the quantized ASR modes' encoder),
w4a8 (omnimtp's kernel: int4 weights, int8 rows per group), w8a8 (`ops.MANY_ROW_MODES`: oneDNN's int8 GEMM with
each row quantized to int8 first; its quantization alone too) and torch's raw int8 GEMM (`torch._int_mm`, int8 in,
int32 out: no quantization, no scales), at the released Qwen3-ASR / aligner shapes, in one run.

Each round runs every path once on every shape, paths interleaved; the best of `--rounds` is kept. Prints GFLOP/s
(2·M·K·N over the wall time) and, beside it, over the process's CPU time divided by the threads (what the rate would
be on cores of its own: on a shared box the wall time counts other processes' turns too). Writes JSON.

    python benchmarks/many_row_linear.py --threads 2 --rounds 3
    python benchmarks/many_row_linear.py --quick        # small shapes, one round: a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy

from omnimtp.runtime.kernels import small_batch_linear as sbl  # noqa: E402
from omnimtp.runtime.ops import PackedGemm, linear, many_row_mode_reason, quantize_weight  # noqa: E402

# (rows, in, out): the aligner encoder's fc1 and fc2 on 60 s (780 rows), the ASR encoder's fc1 (d_model 896), the
# aligner's forward over 1311 positions (gate_up and down of the 0.6B decoder)
SHAPES = [(780, 1024, 4096), (780, 4096, 1024), (780, 896, 3584), (1311, 1024, 6144), (1311, 3072, 1024)]
QUICK_SHAPES = [(64, 128, 256)]


def paths(rows: int, in_features: int, out_features: int) -> dict:
    """name → a function running that path once on seeded inputs of the shape."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g) * 0.02
    x16, w16 = x.bfloat16(), weight.bfloat16()
    gemm = PackedGemm("onednn", None)
    packed16 = gemm.pack(w16, rows)
    w4a8 = quantize_weight(weight, "w4a8")
    out = {"fp32": lambda: F.linear(x, weight),
           "bf16 (oneDNN, packed)": lambda: linear(x16, w16, packed=packed16, gemm=gemm),
           "w4a8 (omnimtp)": lambda: linear(x, None, packed=w4a8)}
    if many_row_mode_reason("cpu") is None:
        w8a8 = quantize_weight(weight, "w8a8")
        xq = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8, generator=g)
        wq = torch.randint(-127, 128, (in_features, out_features), dtype=torch.int8, generator=g)
        out["w8a8 (oneDNN int8)"] = lambda: linear(x, None, packed=w8a8)
        out["w8a8: its row quantization alone"] = lambda: sbl.quantize_rows_u8(x)
        out["torch._int_mm (int8 → int32)"] = lambda: torch._int_mm(xq, wq)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds = 1 if args.quick else args.rounds
    results = {"threads": args.threads, "w8a8": many_row_mode_reason("cpu") or "runs", "shapes": []}
    for rows, in_features, out_features in shapes:
        fns = paths(rows, in_features, out_features)
        for fn in fns.values():  # warm-up: packed layouts, oneDNN primitives
            fn()
        wall = dict.fromkeys(fns, float("inf"))
        cpu = dict.fromkeys(fns, float("inf"))
        for _ in range(rounds):
            for name, fn in fns.items():
                started_wall, started_cpu = time.perf_counter(), time.process_time()
                fn()
                wall[name] = min(wall[name], time.perf_counter() - started_wall)
                cpu[name] = min(cpu[name], (time.process_time() - started_cpu) / args.threads)
        flops = 2 * rows * in_features * out_features
        entry = {"rows": rows, "in": in_features, "out": out_features,
                 "paths": {name: {"ms": 1e3 * wall[name], "gflop_s": flops / wall[name] / 1e9,
                                  "gflop_s_cpu_time": flops / cpu[name] / 1e9 if cpu[name] > 0 else None}
                           for name in fns}}
        results["shapes"].append(entry)
        print(f"{rows} x {in_features} -> {out_features}:")
        for name, figures in entry["paths"].items():
            on_cores = figures["gflop_s_cpu_time"]
            print(f"  {name:36s} {figures['ms']:8.2f} ms  {figures['gflop_s']:6.0f} GFLOP/s"
                  + ("" if on_cores is None else f"  ({on_cores:.0f} on its own cores)"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
