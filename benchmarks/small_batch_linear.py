"""fp32 matmuls of a few rows at Qwen3-Omni code-predictor dims: omnimtp's small-batch kernel (AVX-512 or
AVX2, with this CPU's row tiling and with one tile of up to 16 rows, the kernel's earlier scheme) against
MKL's packed SGEMM, `F.linear` and (one row) `torch.mv`, side by side in one run.

Each round runs the 20 matrices of the predictor's 5 layers (qkv 4096x1024, o 1024x2048, gate_up
6144x1024, down 1024x3072; 308 MB, well past the caches) once per path, paths interleaved; the best
round is kept. Prints GB/s of weights streamed and each path's ratio to MKL's packed SGEMM, plus the
machine's read bandwidth measured in the same run (a plain sum over 1 GiB). Writes JSON.

    python benchmarks/small_batch_linear.py --threads 1
    python benchmarks/small_batch_linear.py --threads 2 --rows 8 16 --tilings 6x64 8x16 4x16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy

from omnimtp.runtime.kernels import small_batch_linear as sbl  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # [out, in] per layer
NUM_LAYERS = 5


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    src = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 9, 16, 17])
    parser.add_argument("--tilings", nargs="+", default=["16x16"], metavar="TILExPASS",
                        help="more kernel tilings to time besides this CPU's (tile rows x pass rows)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "small_batch_linear.json")
    args = parser.parse_args(argv)
    if not sbl.available():
        print(f"the kernel is not available here: {sbl.unavailable_reason()}")
        return 1
    tilings = {"omnimtp": sbl.tiling()}
    for spec in args.tilings:
        tile_rows, _, pass_rows = spec.partition("x")
        tilings[f"omnimtp_{spec}"] = (int(tile_rows), int(pass_rows))
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=g) * 0.02 for _ in range(NUM_LAYERS) for out, inp in SHAPES]
    total_bytes = sum(w.numel() * 4 for w in weights)
    ours = [sbl.pack_weight(w) for w in weights]
    bandwidth = read_bandwidth_gbs()
    print(f"threads {args.threads}; weights {total_bytes / 1e6:.0f} MB; read bandwidth {bandwidth:.1f} GB/s")
    rows_out = []
    for rows in args.rows:
        xs = {inp: torch.randn(rows, inp, generator=g) for _, inp in SHAPES}
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        for w, packed in zip(weights, ours, strict=True):  # same values up to rounding before timing anything
            y = sbl.small_batch_linear(xs[w.shape[1]], packed, w.shape[0])
            torch.testing.assert_close(y, F.linear(xs[w.shape[1]], w), rtol=1e-4, atol=1e-4)
            for tiling in tilings.values():  # and the tiling changes no bit
                assert torch.equal(sbl.small_batch_linear(xs[w.shape[1]], packed, w.shape[0], tiling=tiling), y)
        paths = {
            name: lambda xs=xs, tiling=tiling: [
                sbl.small_batch_linear(xs[w.shape[1]], p, w.shape[0], tiling=tiling)
                for w, p in zip(weights, ours, strict=True)
            ]
            for name, tiling in tilings.items()
        }
        paths |= {
            "mkl_packed": lambda xs=xs, rows=rows, mkl=mkl: [
                torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, rows) for w, p in zip(weights, mkl, strict=True)
            ],
            "f_linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
        }
        if rows == 1:
            paths["torch_mv"] = lambda xs=xs: [torch.mv(w, xs[w.shape[1]][0]) for w in weights]
        best = {name: float("inf") for name in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                fn()  # warm the code paths; the weights do not fit in cache anyway
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
        gbs = {name: total_bytes / seconds / 1e9 for name, seconds in best.items()}
        ratio = {name: best["mkl_packed"] / seconds for name, seconds in best.items()}
        print(f"rows {rows:2d}: " + " | ".join(f"{n} {gbs[n]:5.1f} GB/s ({ratio[n]:.2f}x mkl)" for n in paths))
        rows_out.append(
            {"rows": rows, "ms": {n: s * 1e3 for n, s in best.items()}, "gb_per_s": gbs, "speedup_vs_mkl_packed": ratio}
        )
    result = {
        "threads": args.threads, "isa": sbl.isa(), "tilings": tilings, "weight_bytes": total_bytes,
        "read_bandwidth_gbs": bandwidth, "rows": rows_out,
        "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
        "torch": torch.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
