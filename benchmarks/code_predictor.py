"""Code predictor: ms per frame (G-1 residual codes) of every path on the same weights, side by side.

Paths: transformers `cp.generate` (the reference), re-prefill and DynamicCache loops
(`predict_residual_codes[_kv]`), and `CodePredictorRunner` eager (on its default packed matmuls: fp32
omnimtp's AVX-512 small-batch kernel where it runs, else MKL's packed SGEMM at B >= 4; bf16 oneDNN; at
B >= 4 the unpacked runner, and in fp32 the MKL-packed one, are timed too), step-compiled and
frame-compiled. Dims: tiny (hidden 256, 2 layers, G 16, vocab 2048, the other sizes
`tiny_code_predictor_config`'s defaults) and Qwen3-Omni's real predictor (hidden 1024, 5 layers, 16
heads / 8 KV heads, head_dim 128, intermediate 3072, vocab 2048, G 16); batch 1 and 8; fp32 and bf16.
Paths are timed in interleaved rounds and the median round is kept, so load from other processes hits
every path alike. At real dims the memory-bound floor is printed: bytes of weights read per frame /
memory bandwidth measured in the same run (the best of copy, sum and `torch.mv` probes, before and
after the timings).

    python benchmarks/code_predictor.py            # full run (a few minutes on 2 cores)
    python benchmarks/code_predictor.py --quick    # smoke run
    python benchmarks/code_predictor.py --threads 1 --clock thread --cases real-fp32 --batch-sizes 8
                                                   # one case, CPU time of the timing thread
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy

from omnimtp.models.tiny import tiny_code_predictor_config  # noqa: E402
from omnimtp.runtime.ops import PACKED_GEMM_MIN_ROWS, packed_gemm_kinds  # noqa: E402
from omnimtp.talker.code_predictor import (  # noqa: E402
    CodePredictorRunner,
    predict_residual_codes,
    predict_residual_codes_kv,
)

DIMS = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, vocab_size=2048, num_code_groups=16),
    "real": dict(
        hidden_size=1024, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=2048, num_code_groups=16, initializer_range=0.02,
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_cp(dims: str, dtype: torch.dtype):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cp = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(tiny_code_predictor_config(**DIMS[dims]))
    return cp.eval().to(dtype)


def hf_generate(cp, hidden, cb0):
    inputs_embeds = torch.stack([hidden, cb0], dim=1)
    return cp.generate(inputs_embeds=inputs_embeds, max_new_tokens=cp.config.num_code_groups - 1, do_sample=False)


CLOCKS = {
    # Wall time: what a user sees on a quiet machine.
    "wall": time.perf_counter,
    # CPU time of the calling thread: with one torch thread all the work runs on it, so this stays
    # meaningful when other jobs share the cores (they still compete for caches and memory bandwidth).
    "thread": time.thread_time,
}


def time_paths(
    paths: dict, rounds: int, frames_per_round: int, clock=time.perf_counter, device=None
) -> dict[str, float]:
    """Median over rounds of ms per frame; each round times every path once, in turn (on a GPU, up to
    the end of its queued work)."""
    sync = torch.cuda.synchronize if device is not None and torch.device(device).type == "cuda" else (lambda: None)
    samples = {name: [] for name in paths}
    with torch.inference_mode():
        for fn in paths.values():  # warmup
            fn()
        for _ in range(rounds):
            for name, fn in paths.items():
                sync()
                start = clock()
                for _ in range(frames_per_round):
                    fn()
                sync()
                samples[name].append((clock() - start) / frames_per_round * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def memory_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Best-of bandwidths over buffers well past L3: copy (read + write bytes), read (a sum), and
    matvec (the matrix bytes of `torch.mv`, which reads several rows at once: the most a core's reads
    reach here)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    matrix, vector = src.view(-1, 1024), torch.ones(1024)
    copy_s, read_s, matvec_s = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        read_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.mv(matrix, vector)
        matvec_s.append(time.perf_counter() - start)
    return {
        "copy": 2 * num_bytes / min(copy_s) / 1e9, "read": num_bytes / min(read_s) / 1e9,
        "matvec": num_bytes / min(matvec_s) / 1e9,
    }


def weight_bytes_per_frame(cp) -> int:
    """Every predictor step reads all transformer weights once plus that step's lm_head."""
    layer_bytes = sum(p.numel() * p.element_size() for p in cp.model.layers.parameters())
    layer_bytes += cp.model.norm.weight.numel() * cp.model.norm.weight.element_size()
    head = cp.lm_head[0].weight
    num_steps = cp.config.num_code_groups - 1
    return num_steps * (layer_bytes + head.numel() * head.element_size())


def bench_case(dims: str, dtype_name: str, batch_sizes: list[int], args) -> list[dict]:
    dtype = DTYPES[dtype_name]
    device = torch.device(args.device)
    cp = build_cp(dims, dtype).to(device)
    eager = CodePredictorRunner(cp, max(batch_sizes), dtype=dtype)
    # The same runner without MKL-packed weights, to show what the packing buys at B >= 4.
    unpacked = CodePredictorRunner(cp, max(batch_sizes), dtype=dtype, packed_gemm=False) if eager.packed_gemm else None
    # fp32 with omnimtp's AVX-512 kernel: also MKL's packed SGEMM, the best library kernel, for comparison.
    mkl = None
    if eager.packed_gemm_kind == "row" and "mkl" in packed_gemm_kinds(eager.device, dtype):
        mkl = CodePredictorRunner(cp, max(batch_sizes), dtype=dtype, packed_gemm="mkl")
    use_compile = args.compile == "all" or args.compile == dtype_name
    compiled = CodePredictorRunner(cp, max(batch_sizes), dtype=dtype, compile="step") if use_compile else None
    # The whole frame as one graph: its first compile takes minutes at real dims on a CPU, so tiny only
    # unless asked for.
    use_frame = use_compile and (dims == "tiny" or args.frame_compile_real)
    frame = CodePredictorRunner(cp, max(batch_sizes), dtype=dtype, compile="frame") if use_frame else None
    rows = []
    for batch_size in batch_sizes:
        g = torch.Generator().manual_seed(batch_size)
        hidden = torch.randn(batch_size, cp.config.hidden_size, generator=g).to(device, dtype)
        cb0 = torch.randn(batch_size, cp.config.hidden_size, generator=g).to(device, dtype)
        paths = {
            "hf_generate": lambda hidden=hidden, cb0=cb0: hf_generate(cp, hidden, cb0),
            "re_prefill": lambda hidden=hidden, cb0=cb0: predict_residual_codes(cp, hidden, cb0),
            "dynamic_cache": lambda hidden=hidden, cb0=cb0: predict_residual_codes_kv(cp, hidden, cb0),
            "runner_eager": lambda hidden=hidden, cb0=cb0: eager.run(hidden, cb0),
        }
        if unpacked is not None and batch_size >= PACKED_GEMM_MIN_ROWS:
            paths["runner_eager_unpacked"] = lambda hidden=hidden, cb0=cb0: unpacked.run(hidden, cb0)
        if mkl is not None and batch_size >= PACKED_GEMM_MIN_ROWS:
            paths["runner_eager_mkl"] = lambda hidden=hidden, cb0=cb0: mkl.run(hidden, cb0)
        compile_s = None
        if compiled is not None:
            start = time.perf_counter()
            compiled.run(hidden, cb0)  # compiles this batch size's graphs
            compile_s = time.perf_counter() - start
            paths["runner_compiled"] = lambda hidden=hidden, cb0=cb0: compiled.run(hidden, cb0)
        if frame is not None:
            start = time.perf_counter()
            frame.run(hidden, cb0)
            row_compile_frame_s = time.perf_counter() - start
            paths["runner_frame_compiled"] = lambda hidden=hidden, cb0=cb0: frame.run(hidden, cb0)
        else:
            row_compile_frame_s = None
        with torch.inference_mode():
            reference = hf_generate(cp, hidden, cb0)
            same_codes = {}
            for name, fn in paths.items():
                out = fn()
                codes = out.codes if hasattr(out, "codes") else out
                same_codes[name] = bool(torch.equal(codes, reference))
        frames = args.frames_real if dims == "real" else args.frames_tiny
        ms = time_paths(paths, args.rounds, frames, CLOCKS[args.clock], device)
        row = {
            "dims": dims, "dtype": dtype_name, "batch_size": batch_size, "ms_per_frame": ms,
            "speedup_vs_hf": {name: ms["hf_generate"] / value for name, value in ms.items()},
            "same_codes_as_hf": same_codes, "compile_s": compile_s, "compile_frame_s": row_compile_frame_s,
        }
        if dims == "real":
            row["weight_bytes_per_frame"] = weight_bytes_per_frame(cp)
        rows.append(row)
        print_row(row)
    return rows


def print_row(row: dict) -> None:
    head = f"{row['dims']:>4} {row['dtype']} B={row['batch_size']}:"
    parts = [f"{name} {ms:8.2f} ms ({row['speedup_vs_hf'][name]:.2f}x)" for name, ms in row["ms_per_frame"].items()]
    print(head, " | ".join(parts), flush=True)
    if row.get("compile_s"):
        print(f"     compile (first call of this batch size): {row['compile_s']:.1f} s", flush=True)
    if row.get("compile_frame_s"):
        print(f"     frame compile (first call of this batch size): {row['compile_frame_s']:.1f} s", flush=True)


def add_floor(rows: list[dict], bandwidth_gbs: float) -> None:
    for row in rows:
        if "weight_bytes_per_frame" not in row:
            continue
        floor_ms = row["weight_bytes_per_frame"] / (bandwidth_gbs * 1e9) * 1e3
        row["memory_floor_ms"] = floor_ms
        row["ratio_to_floor"] = {name: ms / floor_ms for name, ms in row["ms_per_frame"].items()}
        best = min(row["ms_per_frame"], key=row["ms_per_frame"].get)
        print(
            f"real {row['dtype']} B={row['batch_size']}: floor {floor_ms:.1f} ms "
            f"({row['weight_bytes_per_frame'] / 1e9:.2f} GB / {bandwidth_gbs:.1f} GB/s); "
            + " | ".join(f"{name} {r:.2f}x floor" for name, r in row["ratio_to_floor"].items())
            + f"; best: {best}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny dims, fp32, few repeats")
    parser.add_argument(
        "--compile", choices=["none", "fp32", "all"], default="fp32",
        help="dtypes that also time the compiled runner (compiling takes tens of seconds per batch size)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument(
        "--cases", nargs="+", default=["tiny-fp32", "tiny-bf16", "real-fp32", "real-bf16"],
        choices=["tiny-fp32", "tiny-bf16", "real-fp32", "real-bf16"], help="dims-dtype cases to run",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--frame-compile-real", action="store_true",
        help="also time the frame-compiled runner at real dims (its first compile takes minutes)",
    )
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="wall time, or the calling thread's CPU time (use with --threads 1 on a shared machine)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the predictor runs (cpu, cuda, cuda:N)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "code_predictor.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.frames_tiny, args.frames_real = 10, 1
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread measures one thread's CPU time: use it with --threads 1")
    cases = [tuple(case.split("-")) for case in args.cases]
    batch_sizes = args.batch_sizes
    if args.quick:
        cases, batch_sizes, args.rounds, args.frames_tiny = [("tiny", "fp32")], [1, 2], 2, 2
    started = time.perf_counter()
    on_cpu = torch.device(args.device).type == "cpu"
    before = memory_bandwidth_gbs() if on_cpu else {}  # the floor is the host's: a CPU run only
    if before:
        print("memory bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in before.items()), flush=True)
    rows = []
    for dims, dtype_name in cases:
        rows += bench_case(dims, dtype_name, batch_sizes, args)
    # Measured again after the timings (the host's bandwidth drifts); the fastest probe of either
    # measurement gives the lowest (strictest) floor.
    bandwidth = {}
    if on_cpu:
        after = memory_bandwidth_gbs() if any(dims == "real" for dims, _ in cases) else before
        bandwidth = {name: max(before[name], after[name]) for name in before}
        print(
            "memory bandwidth (best of before/after): "
            + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items())
        )
        add_floor(rows, max(bandwidth.values()))
    result = {
        "benchmark": "code_predictor", "device": args.device, "threads": args.threads, "clock": args.clock,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
        "memory_bandwidth_gbs": bandwidth, "rows": rows, "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
