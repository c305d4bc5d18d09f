"""A w4a8 decoder's decode step in parts, each against its own floor (its bytes ÷ the measured read bandwidth).

Random weights at a decoder's widths (default Qwen3-ASR-0.6B's thinker: 28 layers, hidden 1024, 16 / 8 heads of
128, intermediate 3072, vocabulary 151936) quantized as the runtime quantizes them ("w4a8" layers in groups of
128, the "int8" per-channel head), one row, `--keys` cached positions (fp32 cache rows of a `KVCache` of
`--capacity` columns). Timed, each over every layer so that it reads from memory as a step does: the four w4a8
matvecs (`w4a8_linear`), the decode attention (`decode_attention`), the whole native step
(`w4a8_decode_step`: the layers in one call), the head (`quantized_linear`) with its argmax, and the screened
head's greedy token (`ScreenedHead.greedy`: the int4 screen, its 64 best rows in int8) with how often it is the
int8 head's argmax on `--agreement-rows` random rows. `--baseline
FILE.c`: another build of the kernel source (e.g. `git show HEAD~1:omnimtp/runtime/kernels/small_batch_linear.c`)
whose native step is timed alternately with this checkout's in the same process (the same-run ratio).
`--cpu-time --threads 1`: CPU seconds instead of wall time, for a box busy with other jobs (where a thread waits
its turn for a core; two threads spin at each other's barriers). Writes JSON.

    python benchmarks/decode_step_parts.py [--keys 870] [--rounds 20] [--baseline old.c] [--cpu-time --threads 1] \\
        [--out parts.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from tts_realtime import machine_floors  # noqa: E402

from omnimtp.runtime.kernels import small_batch_linear as sbl  # noqa: E402
from omnimtp.runtime.ops import linear  # noqa: E402
from omnimtp.runtime.screened_head import ScreenedHead  # noqa: E402

GROUP = 128


CLOCK = time.perf_counter  # `--cpu-time`: time.process_time


def median_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = CLOCK()
        fn()
        times.append(CLOCK() - started)
    return sorted(times)[len(times) // 2] * 1e3


def w4a8(out_features: int, in_features: int, seed: int):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.02
    packed, scales = sbl.quantize_int4(weight, GROUP)
    return packed, scales


def build_layers(args):
    H, Nq, Nkv, D, inter = args.hidden, args.heads, args.kv_heads, args.head_dim, args.intermediate
    shapes = {"qkv": ((Nq + 2 * Nkv) * D, H), "o": (H, Nq * D), "gate_up": (2 * inter, H), "down": (H, inter)}
    layers = []
    for layer in range(args.layers):
        mats = {name: w4a8(*shape, seed=100 * layer + i) for i, (name, shape) in enumerate(shapes.items())}
        layers.append(mats)
    return shapes, layers


def step_table(args, layers):
    """The native step's weights table (`omnimtp.runtime.w4a8_step`'s layout) and the vectors it points into."""
    H, Nq, Nkv, D = args.hidden, args.heads, args.kv_heads, args.head_dim
    keep = []
    addresses = []
    for mats in layers:
        norm, post, qk = torch.ones(H), torch.ones(H), torch.ones(Nq + Nkv, D)
        keep += [norm, post, qk]
        addresses += [norm.data_ptr(), mats["qkv"][0].data_ptr(), mats["qkv"][1].data_ptr(), 0, qk.data_ptr(),
                      mats["o"][0].data_ptr(), mats["o"][1].data_ptr(), 0, post.data_ptr(),
                      mats["gate_up"][0].data_ptr(), mats["gate_up"][1].data_ptr(), mats["down"][0].data_ptr(),
                      mats["down"][1].data_ptr()]
    return (ctypes.c_int64 * len(addresses))(*addresses), keep


def load_other(source: str) -> ctypes.CDLL:
    """`source` compiled with this checkout's flags (its native step's signature must be this one's)."""
    out = Path(tempfile.mkdtemp()) / "baseline.so"
    subprocess.run(["cc", *sbl._flags(), "-o", str(out), source], check=True)
    lib = ctypes.CDLL(str(out))
    lib.omnimtp_w4a8_decode_step.restype = ctypes.c_int
    lib.omnimtp_w4a8_decode_step.argtypes = sbl._library().omnimtp_w4a8_decode_step.argtypes
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--keys", type=int, default=870)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--agreement-rows", type=int, default=1000,
                        help="random rows on which the screened head's token is compared with the int8 head's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", help="another kernel source whose native step is timed alternately")
    parser.add_argument("--cpu-time", action="store_true",
                        help="the process's CPU time, not wall time (on a box shared with other jobs; one thread)")
    parser.add_argument("--quick", action="store_true", help="a 64 MB read probe instead of 512 MB")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if not sbl.available():
        raise SystemExit(f"the kernel is not available: {sbl.unavailable_reason()}")
    floors = machine_floors(args.threads, quick=args.quick)
    torch.set_num_threads(args.threads)
    bandwidth = floors["read_gb_s"] * 1e9
    H, Nq, Nkv, D, L = args.hidden, args.heads, args.kv_heads, args.head_dim, args.layers
    shapes, layers = build_layers(args)
    caches = [(torch.randn(1, Nkv, args.capacity, D), torch.randn(1, Nkv, args.capacity, D)) for _ in range(L)]
    head_weight = torch.randn(args.vocab, H) * 0.02
    screened = ScreenedHead.from_weight(head_weight)  # the int8 head and its int4 screen
    head = (screened.exact.packed, screened.exact.scales)
    del head_weight
    x = torch.randn(1, H)
    parts = {}

    def record(name: str, ms: float, nbytes: int) -> None:
        floor = nbytes / bandwidth * 1e3
        parts[name] = {"ms": ms, "mb": nbytes / 1e6, "floor_ms": floor, "gb_s": nbytes / ms / 1e6}
        print(f"{name:>22}: {ms:7.3f} ms  floor {floor:6.3f} ({nbytes / 1e6:6.1f} MB)  {nbytes / ms / 1e6:5.1f} GB/s")

    for name, (out_features, in_features) in shapes.items():
        inputs = torch.randn(1, in_features)

        def matvecs(name=name, out_features=out_features, inputs=inputs):
            for mats in layers:
                sbl.w4a8_linear(inputs, *mats[name], out_features, GROUP)

        nbytes = L * sum(t.numel() * t.element_size() for t in layers[0][name])
        record(f"w4a8 {name} x{L}", median_ms(matvecs, args.rounds), nbytes)
    query = torch.randn(1, Nq, D)
    views = [(k[:, :, : args.keys], v[:, :, : args.keys]) for k, v in caches]
    record(f"attention x{L}", median_ms(lambda: [sbl.decode_attention(query, k, v, D**-0.5) for k, v in views],
                                         args.rounds), L * 2 * Nkv * args.keys * D * 4)
    table, keep = step_table(args, layers)
    kv = (ctypes.c_int64 * (2 * L))(*[t.data_ptr() for pair in caches for t in pair])
    cos, sin = torch.randn(1, D), torch.randn(1, D)
    one = (ctypes.c_int64 * 1)(0)
    column = (ctypes.c_int64 * 1)(args.keys - 1)
    strides = caches[0][0].stride()[:3]
    layer_bytes = sum(t.numel() * t.element_size() for mats in layers for pair in mats.values() for t in pair)

    def native(lib):
        rows = x.clone()
        status = lib.omnimtp_w4a8_decode_step(
            rows.data_ptr(), 1, H, L, table, kv, Nq, Nkv, D, args.intermediate, GROUP, GROUP, GROUP, 1e-6,
            cos.data_ptr(), sin.data_ptr(), one, column, args.keys, None, *strides, None, 0, D**-0.5,
            args.threads, -1, 0)  # fp32 cache (a baseline built before that last argument ignores it: C's ABI)
        assert status == 0, status
        return rows

    step_bytes = layer_bytes + L * 2 * Nkv * args.keys * D * 4
    record("native step", median_ms(lambda: native(sbl._library()), args.rounds), step_bytes)
    hidden = torch.randn(1, H)
    record("head (int8)", median_ms(lambda: sbl.quantized_linear(hidden, *head, args.vocab, None), args.rounds),
           sum(t.numel() * t.element_size() for t in head))
    logits = torch.randn(1, args.vocab)
    record("argmax", median_ms(lambda: logits.argmax(-1), args.rounds), args.vocab * 4)
    screen_bytes = sum(t.numel() * t.element_size() for t in (screened.screen.packed, screened.screen.scales))
    record("head (screened)", median_ms(lambda: screened.greedy(hidden), args.rounds), screen_bytes)
    # the screened token against the int8 head's argmax on final-norm-like rows (random weights: flat logits)
    rows = torch.nn.functional.rms_norm(torch.randn(args.agreement_rows, H), (H,))
    agree = screen_alone = 0
    for block in rows.split(64):
        expected = sbl.quantized_linear(block, *head, args.vocab, None).argmax(-1)
        agree += int((screened.greedy(block) == expected).sum())
        screen_alone += int((linear(block, None, packed=screened.screen).argmax(-1) == expected).sum())
    parts["head (screened)"].update(rows=len(rows), equal_to_int8=agree, screen_argmax_equal_to_int8=screen_alone)
    print(f"{'':>22}  token = the int8 head's on {agree} of {len(rows)} rows (the int4 screen's own argmax: "
          f"{screen_alone})")
    result = {"machine": platform.processor() or platform.machine(), "build": sbl.build_id(), "floors": floors,
              "clock": CLOCK.__name__,
              "args": vars(args), "parts": parts}
    if args.baseline:
        other = load_other(args.baseline)
        old, new = [], []
        for _ in range(args.rounds):  # alternated: the same conditions for both
            old.append(median_ms(lambda: native(other), 3))
            new.append(median_ms(lambda: native(sbl._library()), 3))
        old_ms, new_ms = sorted(old)[len(old) // 2], sorted(new)[len(new) // 2]
        difference = float((native(other) - native(sbl._library())).abs().max())  # the same cache: the same inputs
        result["native_step_alternated"] = {"baseline_ms": old_ms, "this_ms": new_ms, "ratio": old_ms / new_ms,
                                            "max_abs_difference": difference}
        print(f"native step alternated: baseline {old_ms:.3f} ms, this {new_ms:.3f} ms, ratio {old_ms / new_ms:.3f}; "
              f"outputs differ by at most {difference:.3g}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
