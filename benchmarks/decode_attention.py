"""One query position's attention (a batch-1 decode step): omnimtp's kernel against torch's SDPA, in one process.

A decoder's step reads every layer's keys and values once, between its weights: here `--layers` layers of KV
cache views (each [1, Nkv, capacity, D], as `omnimtp.runtime.kv_cache` holds them), one query per layer, and a
64 MB copy before each step so that the keys and values come from memory as they do in a model's step ("cold";
"warm": without the copy). Heads: `--heads Nq Nkv D` (default the Qwen3-TTS 0.6B talker's 16 / 8 / 128; the
Qwen3-Omni-30B-A3B thinker's are 32 / 4 / 128). `--rows R`: a batched step, R rows a few keys apart (row r at
the length less 3r), each row's visible keys given by a bool mask as the engine gives them. `--dtype bfloat16`:
the cache, queries and outputs in bf16 (a bf16 decoder's, the thinker's), the error then against fp32 SDPA on the
same values. Per `--lengths` key count: µs a layer for each, the ratio, and the floor (the layer's visible key and
value bytes ÷ the measured read bandwidth). Writes JSON.

    python benchmarks/decode_attention.py [--lengths 64 256 1024 4096] [--layers 28] [--rows 1] [--dtype bfloat16] \\
        [--out a.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from tts_realtime import machine_floors  # noqa: E402

from omnimtp.runtime.kernels import small_batch_linear  # noqa: E402


def timed_steps(fn, layers: int, rounds: int, evict) -> float:
    """Median seconds a layer over `rounds` steps of `layers` calls, `evict` before each step."""
    times = []
    for _ in range(rounds):
        evict()
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) / layers)
    return sorted(times)[len(times) // 2]


def sdpa_step(query: torch.Tensor, views: list, scale: float, mask):
    """query [R, Nq, D]; mask None or bool [R, S]."""
    attn_mask = None if mask is None else mask[:, None, None]
    return lambda: [F.scaled_dot_product_attention(query[:, :, None], k, v, attn_mask=attn_mask, scale=scale,
                                                   enable_gqa=True) for k, v in views]


def kernel_step(query: torch.Tensor, views: list, scale: float, mask):
    return lambda: [small_batch_linear.decode_attention(query, k, v, scale, mask) for k, v in views]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128], metavar=("NQ", "NKV", "D"))
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rows", type=int, default=1, help="rows of a batched step (default 1: a batch-1 step)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quick", action="store_true", help="a small probe of the machine (a test's run)")
    parser.add_argument("--out", default="benchmarks/results/decode_attention.json")
    args = parser.parse_args()
    if not small_batch_linear.available():
        sys.exit(f"the kernel is not available here: {small_batch_linear.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    machine = machine_floors(args.threads, quick=args.quick)
    num_heads, num_kv_heads, head_dim = args.heads
    dtype = getattr(torch, args.dtype)
    scale = head_dim**-0.5
    junk = torch.randn(16 << 20)
    sink = torch.empty_like(junk)
    results = {"machine": machine, "platform": platform.processor() or platform.machine(), "heads": args.heads,
               "layers": args.layers, "rows": args.rows, "threads": args.threads, "dtype": args.dtype, "lengths": {}}
    print(f"machine: read {machine['read_gb_s']:.1f} GB/s, {args.threads} threads; heads {num_heads} / "
          f"{num_kv_heads} / {head_dim}, {args.layers} layers, {args.rows} row(s), {args.dtype}")
    for length in args.lengths:
        generator = torch.Generator().manual_seed(length)
        capacity = length + 64
        caches = [torch.randn(2, args.rows, num_kv_heads, capacity, head_dim, generator=generator).to(dtype)
                  for _ in range(args.layers)]
        views = [(cache[0][:, :, :length], cache[1][:, :, :length]) for cache in caches]
        query = torch.randn(args.rows, num_heads, head_dim, generator=generator).to(dtype)
        lengths = torch.tensor([max(length - 3 * r, 1) for r in range(args.rows)])
        mask = None if args.rows == 1 else torch.arange(length)[None] < lengths[:, None]  # [R, S]
        ours = small_batch_linear.decode_attention(query, *views[0], scale, mask).float()
        exact_views = [tuple(t.float() for t in views[0])]
        sdpa = sdpa_step(query.float(), exact_views, scale, mask)()[0].reshape(args.rows, -1)
        error = float((ours - sdpa).abs().max() / sdpa.abs().max())
        runs = {"sdpa": sdpa_step(query, views, scale, mask), "ours": kernel_step(query, views, scale, mask)}
        entry = {"max_rel_error": error,
                 "kv_bytes_per_layer": 2 * num_kv_heads * int(lengths.sum()) * head_dim * dtype.itemsize}
        entry["floor_us"] = 1e6 * entry["kv_bytes_per_layer"] / (machine["read_gb_s"] * 1e9)
        for state, evict in (("cold", lambda: sink.copy_(junk)), ("warm", lambda: None)):
            for name, fn in runs.items():
                fn()
                entry[f"{name}_{state}_us"] = 1e6 * timed_steps(fn, args.layers, args.rounds, evict)
            entry[f"{state}_ratio"] = entry[f"sdpa_{state}_us"] / entry[f"ours_{state}_us"]
        results["lengths"][str(length)] = entry
        print(f"{length:5d} keys: µs a layer cold: SDPA {entry['sdpa_cold_us']:.1f}, ours {entry['ours_cold_us']:.1f} "
              f"({entry['cold_ratio']:.2f}x), floor {entry['floor_us']:.1f}; warm: SDPA {entry['sdpa_warm_us']:.1f}, "
              f"ours {entry['ours_warm_us']:.1f} ({entry['warm_ratio']:.2f}x); max |Δ| / peak {error:.1e}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
