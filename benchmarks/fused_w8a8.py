"""A "w8a8" decoder's forward of many positions with its elementwise work fused into C passes
(`omnimtp.runtime.kernels.w8a8_epilogues`) against the same forward on torch ops (`PackedDecoder(fused_w8a8=False)`),
alternated in one process.

Forwards (Qwen3-ASR-0.6B's / the aligner's decoder at the released widths, random weights; `--quick`: tiny widths):
  - "prefill": Qwen3-ASR's prompt forward into a KV cache, `--prefill-positions` positions (default 812: a 60 s
    transcription's prompt);
  - "aligner": the forced aligner's forward, `--aligner-positions` positions (default 1311: 60 s and 150 words), as
    before (into a KV cache, every position through the last layer) and as `Qwen3ForcedAligner.timestamp_rows` runs
    it now (no cache, the last layer on `--timestamps` positions spread over the prompt's end).
Each variant runs once per round, `--rounds` rounds; reported: the median wall and CPU (`time.process_time`) seconds
of each, and each variant's ratio to the torch ops' (medians of the per-round ratios), and the relative difference of
the outputs. On a shared machine compare the ratios only.

    python benchmarks/fused_w8a8.py [--rounds 5] [--threads 2] [--out results.json]
    python benchmarks/fused_w8a8.py --quick      # tiny widths, a check that it runs (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward  # noqa: E402


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(variants: dict, rounds: int) -> dict:
    """variants: name → a function of no argument, the first the baseline; each run once a round, in turn."""
    times = {name: [] for name in variants}
    outputs = {name: fn() for name, fn in variants.items()}  # warm-up, and the outputs compared
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(_timed(fn))
    base_name = next(iter(variants))
    base = outputs[base_name]
    result = {}
    for name, runs in times.items():
        result[name] = {
            "wall_s": statistics.median(wall for wall, _ in runs),
            "cpu_s": statistics.median(cpu for _, cpu in runs),
            "cpu_ratio": statistics.median(cpu / b for (_, cpu), (_, b) in zip(runs, times[base_name], strict=True)),
            "wall_ratio": statistics.median(w / b for (w, _), (b, _) in zip(runs, times[base_name], strict=True)),
            "rel_difference": float((outputs[name] - base).norm() / base.norm()),
        }
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny widths and positions: a check that it runs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-positions", type=int, default=812)
    parser.add_argument("--aligner-positions", type=int, default=1311)
    parser.add_argument("--timestamps", type=int, default=300)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import asr_speed

    from omnimtp.runtime.decoder import fuses_w8a8
    from omnimtp.runtime.ops import many_row_mode_reason

    reason = many_row_mode_reason("cpu")
    if reason is not None:
        raise SystemExit(f"w8a8 does not run here: {reason}")
    if args.quick:
        args.prefill_positions, args.aligner_positions, args.timestamps = 60, 90, 20
    model = asr_speed._model(True, args.quick)
    fused = PackedDecoder.from_module(model.thinker.model, quantize="w8a8")
    unfused = replace(fused, fused_w8a8=False)
    generator = torch.Generator().manual_seed(0)
    probe = torch.zeros(1, 2, fused.hidden_size)
    results = {"threads": args.threads, "rounds": args.rounds, "hidden": fused.hidden_size, "layers": fused.num_layers,
               "fused_runs": fuses_w8a8(fused, fused.layers[0], probe, fused.quantized_layers[0])}
    with torch.no_grad():
        embeds = torch.randn(1, args.prefill_positions, fused.hidden_size, generator=generator) * 0.05

        def prefill(decoder):  # a new cache each time, as each request has its own slot
            return lambda: decoder_forward(decoder, KVCache(decoder, 1, capacity=args.prefill_positions), embeds,
                                           [0]).last_hidden

        results["prefill"] = compare({"torch_ops": prefill(unfused), "fused": prefill(fused)}, args.rounds)
        positions = args.aligner_positions
        embeds = torch.randn(1, positions, fused.hidden_size, generator=generator) * 0.05
        wanted = torch.linspace(positions // 2, positions - 1, args.timestamps).long()[None]  # [1, K]

        def before(decoder):
            return lambda: decoder_forward(decoder, KVCache(decoder, 1, capacity=positions), embeds, [0],
                                           all_final=True).final[0, wanted[0]]

        def now(decoder):
            return lambda: decoder_forward(decoder, None, embeds, None, all_final=True, output_index=wanted).final[0]

        results["aligner"] = compare({"cache_torch_ops": before(unfused), "no_cache_torch_ops": now(unfused),
                                      "no_cache_fused": now(fused)}, args.rounds)
    for forward in ("prefill", "aligner"):
        for name, entry in results[forward].items():
            print(f"{forward:8s} {name:18s} wall {entry['wall_s']:.3f} s  cpu {entry['cpu_s']:.3f} s  "
                  f"cpu ratio {entry['cpu_ratio']:.2f}  wall ratio {entry['wall_ratio']:.2f}  "
                  f"rel difference {entry['rel_difference']:.2e}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
