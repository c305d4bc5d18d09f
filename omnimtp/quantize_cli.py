"""`omnimtp quantize SRC DST --quantize MODE`: a quantized copy of a checkpoint, which `--model DST` (and
`OmniPipeline.from_pretrained`; `omnimtp spec --model DST` for an MTP checkpoint) then loads memory-mapped
(`omnimtp.quantized_checkpoint`)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from omnimtp.argtypes import QUANTIZE_CHOICES


def add_parser(subparsers) -> None:
    quantize = subparsers.add_parser(
        "quantize", help="write a quantized copy of a Qwen3-Omni, Qwen2.5-Omni, Qwen3-TTS or Qwen3-ASR checkpoint, or "
        "of an MTP checkpoint (glm4_moe with its NextN layer: `omnimtp spec`'s) (read tensor by tensor, never the "
        "whole float model), which --model loads memory-mapped")
    quantize.add_argument("src", metavar="SRC", help="the checkpoint directory (safetensors)")
    quantize.add_argument("dst", metavar="DST", help="a new (or empty) directory for the quantized checkpoint")
    quantize.add_argument("--quantize", choices=QUANTIZE_CHOICES, required=True,
                          help="int8 or int4 weight-only, or w4a8 (int4 weights, int8 activations at run time): "
                          "what --quantize on the other commands does at load, stored")
    quantize.add_argument("--json", action="store_true", help="print what was written as one JSON object")
    quantize.set_defaults(handler=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    from omnimtp.quantized_checkpoint import quantize_checkpoint

    started = time.perf_counter()
    summary = quantize_checkpoint(args.src, args.dst, args.quantize)
    report = {"dst": args.dst, "mode": summary["mode"], "decoders": summary["decoders"],
              "bytes": sum(summary["files"].values()), "seconds": round(time.perf_counter() - started, 2),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    if args.json:
        print(json.dumps(report))
    else:
        layers = ", ".join(f"{prefix} ({count} layers)" for prefix, count in summary["decoders"].items())
        print(f"{os.path.abspath(args.dst)}: {summary['mode']} weights of {layers}, {report['bytes'] / 1e6:.1f} MB "
              f"in {report['seconds']} s (peak RSS {report['peak_rss_mb']} MB); load it with --model {args.dst}")
    return 0
