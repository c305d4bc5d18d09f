"""One MoE layer's routed experts at Qwen3-Omni-30B-A3B's released widths: float against omnimtp's quantized experts.

Shapes (the released config, random weights): the thinker's layer (128 experts of [gate; up] 2 × 768 × 2048 and down
2048 × 768, top-8) and the talker's (128 experts, 2 × 384 × 1024 and 1024 × 384, top-6). Per step, `--tokens` tokens
are routed to experts drawn at random (a new draw each step, so a step reads its experts from memory as a model's
step does: the layer's bank is far larger than the caches), and the layer's routed-expert output is computed by:

- `bf16` / `fp32`: transformers' fused expert tensors through `moe.expert_outputs` (what a float checkpoint runs);
- `int8`, `int4`, `w4a8`: `ops.quantize_experts` through `moe.quantized_expert_outputs` (each of the two matmuls one
  kernel call for every picked expert, the rows grouped by expert);
- `w4a8-loop`: the same w4a8 weights, one single-matrix kernel call per picked expert and matmul (what the grouped
  call replaces).

Per shape, token count and variant: median ms a step, the ratio to `bf16`, and the floor: the picked experts' weight
bytes (with scales) ÷ the read bandwidth measured in the same run. Writes JSON.

    python benchmarks/moe_experts.py [--shapes thinker talker] [--tokens 1 4 16] [--threads 2] [--out m.json]
    python benchmarks/moe_experts.py --quick        # small experts, a check that it runs
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

from omnimtp.runtime import moe  # noqa: E402
from omnimtp.runtime.ops import linear, quantize_experts  # noqa: E402

# (experts, hidden, moe intermediate, top-k) of Qwen3-Omni-30B-A3B-Instruct's config.json
SHAPES = {"thinker": (128, 2048, 768, 8), "talker": (128, 1024, 384, 6), "quick": (16, 256, 128, 4)}
VARIANTS = ("bf16", "fp32", "int8", "int4", "w4a8", "w4a8-loop")


def looped_outputs(x: torch.Tensor, top_experts: torch.Tensor, gate_up, down) -> torch.Tensor:
    """`quantized_expert_outputs` as a loop of single-matrix calls, one per (token, expert) row."""
    rows = []
    for token, picks in zip(x, top_experts, strict=True):
        for expert in picks.tolist():
            gate, up = linear(token[None], None, packed=gate_up.expert(expert)).chunk(2, dim=-1)
            rows.append(linear(F.silu(gate) * up, None, packed=down.expert(expert)))
    return torch.cat(rows)


def step_bytes(weights: dict, variant: str, experts: torch.Tensor) -> int:
    """Bytes of the distinct picked experts' weights (and scales) a step reads."""
    distinct = experts.unique().numel()
    if variant in ("bf16", "fp32"):
        gate_up, down = weights[variant]
        per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    else:
        key = "w4a8" if variant == "w4a8-loop" else variant
        per_expert = sum(t[0].numel() * t.element_size() for q in weights[key] for t in (q.packed, q.scales))
    return distinct * per_expert


def bench_shape(name: str, tokens_list, rounds: int, read_gb_s: float) -> list[dict]:
    num_experts, hidden, inter, top_k = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    started = time.perf_counter()
    weights = {mode: (quantize_experts(gate_up, mode), quantize_experts(down, mode))
               for mode in ("int8", "int4", "w4a8")}
    print(f"{name}: quantized {num_experts} experts in 3 modes in {time.perf_counter() - started:.1f} s", flush=True)
    weights["fp32"] = (gate_up, down)
    weights["bf16"] = (gate_up.bfloat16(), down.bfloat16())
    results = []
    for num_tokens in tokens_list:
        x = torch.randn(num_tokens, hidden, generator=g)
        draws = [torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
                 for _ in range(rounds + 2)]
        row = {"shape": name, "experts": num_experts, "hidden": hidden, "moe_intermediate": inter, "top_k": top_k,
               "tokens": num_tokens, "ms": {}, "floor_ms": {}}
        for variant in VARIANTS:
            key = "w4a8" if variant == "w4a8-loop" else variant
            inputs = x.bfloat16() if variant == "bf16" else x

            def run(top, variant=variant, key=key, inputs=inputs):
                if variant in ("bf16", "fp32"):
                    return moe.expert_outputs(inputs, top, *weights[key])
                if variant == "w4a8-loop":
                    return looped_outputs(inputs, top, *weights[key])
                return moe.quantized_expert_outputs(inputs, top, *weights[key])

            times, floors = [], []
            for i, top in enumerate(draws):
                began = time.perf_counter()
                run(top)
                if i >= 2:  # two warm-up steps
                    times.append(time.perf_counter() - began)
                    floors.append(step_bytes(weights, variant, top) / (read_gb_s * 1e9))
            row["ms"][variant] = 1e3 * sorted(times)[len(times) // 2]
            row["floor_ms"][variant] = 1e3 * sorted(floors)[len(floors) // 2]
        base = row["ms"]["bf16"]
        print(f"  {num_tokens:>2} tokens: " + "; ".join(
            f"{v} {row['ms'][v]:.2f} ms ({base / row['ms'][v]:.2f}x bf16, floor {row['floor_ms'][v]:.2f})"
            for v in VARIANTS), flush=True)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["thinker", "talker"], choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the small 'quick' shape, 1 and 3 tokens, 3 rounds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.tokens, args.rounds = ["quick"], [1, 3], 3
    torch.set_num_threads(args.threads)
    floors = machine_floors(args.threads, args.quick)
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}: read {floors['read_gb_s']:.1f} GB/s", flush=True)
    rows = []
    with torch.inference_mode():
        for name in args.shapes:
            rows += bench_shape(name, args.tokens, args.rounds, floors["read_gb_s"])
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": args.threads,
              "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability(), "floors": floors,
              "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
