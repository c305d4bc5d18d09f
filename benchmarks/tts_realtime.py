"""Qwen3-TTS in real time on this CPU: the released widths, each stage next to its floor on this machine.

A checkpoint in the released layout at Qwen3-TTS-12Hz-0.6B's (or 1.7B's) widths, random weights, INCLUDING
the 12 Hz speech tokenizer's decoder at its released widths (latent 1024, hidden 512, 8 layers, decoder_dim
1536, upsample 8·5·4·3 and 2·2; unit-gain init so it is audible), is built once and cached (`--cache-dir`), or
read from `--model DIR`. The text vocabulary shrinks to the byte tokenizer's (a text row is one lookup).

This machine's physics first, in the same run: the streaming read bandwidth (a sum over 512 MB) and a copy's,
and the fp32 matmul peak (2048³ GEMMs), on `--threads` threads. Then per mode (fp32, bf16, int8, int4, w4a8), each
in its own process (so its peak RSS is its own), per batch size (1, 8), greedy, `--frames` frames per request:

- RTF (wall ÷ audio seconds, aggregate over the batch), ms per frame step split into talker, code predictor
  (its 15 steps), decoder (code2wav) and rest (prefill, admission, sampling glue), from the engine's own phase
  timing (`EngineCore(observer=...)`; the code predictor's share is its runner's `run` calls);
- each part's floor: max(bytes it reads ÷ bandwidth, its FLOPs ÷ the matmul peak), where the bytes are the
  packed weights the engine really holds (quantized ones as stored; w4a8's integer multiply-adds are left out
  of the FLOPs: their peak is not measured here) and the decoder's FLOPs are counted by
  torch's FLOP counter on the decoder itself (over the bf16 matmul peak with `--codec-dtypes bfloat16`, whose
  conv stack runs in bf16), and the RTF those floors sum to (every part at its floor and
  nothing else: the best this machine allows);
- time to the first streamed audio chunk (batch 1, the median of 5), the RSS once loaded, the process's peak RSS
  while loading (`load_peak_rss_mb`: before any warm-up or compile) and over the whole run (`peak_rss_mb`).

Then the reference `qwen_tts` (fp32, its generate + its speech tokenizer's decode) on the same checkpoint,
batch 1 and 8, in its own process. `--profile` adds a `torch.profiler` op table of each mode's batch-1 frames (the
top ops by self CPU time, the number of ops per frame, and the time not seen by the profiler: omnimtp's C
kernels are called through ctypes and do not show up as ops).

    python benchmarks/tts_realtime.py [--size 0.6b|1.7b|tiny] [--modes fp32 bf16 int8 int4 w4a8] [--batch-sizes 1 8]
        [--threads 2] [--frames 12] [--profile] [--no-reference] [--model DIR] [--out tts_realtime.json] [--quick]
        [--compile-predictor step|frame] [--codec-dtypes float32 bfloat16] [--prequantized]

`--prequantized` also runs each quantized mode from a pre-quantized copy of the checkpoint (`omnimtp quantize`,
built once beside it, the converter's time and peak RSS reported): what a user who quantized once loads, memory-mapped.

`--compile-predictor` runs the code predictor as compiled graphs, as a server does once its warm-up is done; the
graphs of the measured batch sizes are built before any timing (minutes on a CPU; inductor keeps them on disk),
and the time that took is printed.

`--peer` times qwentts.cpp (the ggml port, PyPI `realtimetts-qwen-native-cpu`) beside omnimtp on the same checkpoint
and threads: the checkpoint is converted to its GGUF files at each of `--peer-quants` (`benchmarks/qwentts_peer.py`,
kept beside the checkpoint in `DIR-qwentts/`), then one process loads omnimtp in `--peer-mode` with the
`--peer-codec-dtype` decoder and, per quantization, starts the peer's timing server and alternates one streamed
greedy request of each, `--peer-repeats` times (text, voice and `--frames` the same): RTF, first audio, peak RSS of
each and the ratio of each pair (with `--prequantized`, omnimtp loads its pre-quantized copy, as the peer loads its
quantized files; `--peer-stream-frames` sets the peer's streamed chunk cadence, its `cpu_stream_frames`). Each runs
its own prompt layout: the peer puts the whole text in the prefill, omnimtp feeds it a row a frame (the reference's
default). `--peer-check` first checks the conversion: the F32 files' greedy codes against omnimtp fp32 in the peer's
layout (`non_streaming_mode`), `--frames` (at most 8) frames. The peer runs in a venv of its own (it must not change
this environment):

    python -m venv qwentts-venv
    qwentts-venv/bin/pip install realtimetts-qwen-native-cpu==0.4.2 gguf safetensors
    python benchmarks/tts_realtime.py --model DIR --peer [--peer-python qwentts-venv/bin/python] --frames 60

Random weights: the speeds are real, the audio is not speech. Run from the repository root (the reference is
imported from tests/qwen_tts_reference.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "Hello there, this is a benchmark of speech in real time.", "Another sentence to speak, a little longer.",
    "Short one.", "A fourth sentence, with a comma and some more words.",
]
VOICES = ["aiden", "vivian"]
MODES = ("fp32", "bf16", "int8", "int4", "w4a8")
QUANTIZED_MODES = ("int8", "int4", "w4a8")
TTFA_RUNS = 5  # streamed first chunks timed per mode; the median is reported
NUM_TEXT_ROWS = 320  # the byte tokenizer's vocabulary: the text embedding shrinks to it

# The released talker widths (the code predictor is QWEN3_TTS_0_6B_PREDICTOR's at both sizes; 1.7B projects
# the talker's 2048 down to it).
QWEN3_TTS_1_7B_TALKER = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, text_hidden_size=2048)
SIZES = ("tiny", "0.6b", "1.7b")


# --- the checkpoint ---------------------------------------------------------------------------------------


def build_checkpoint(size: str, path: Path) -> Path:
    """A checkpoint of `size` in the released layout at `path` (kept: built once, into a temporary sibling
    renamed when complete, so an interrupted build is never read)."""
    if (path / "config.json").is_file() and (path / "speech_tokenizer" / "config.json").is_file():
        return path
    from omnimtp.codec.speech_tokenizer import RELEASED_DECODER_CONFIG, tiny_speech_tokenizer
    from omnimtp.models.qwen3_tts import (
        QWEN3_TTS_0_6B_PREDICTOR,
        QWEN3_TTS_0_6B_TALKER,
        Qwen3TTSModel,
        tiny_config,
        tiny_qwen3_tts,
    )
    from omnimtp.tokenizer import byte_tokenizer

    if size == "tiny":
        model, codec = tiny_qwen3_tts(0), tiny_speech_tokenizer(0)
    else:
        talker = QWEN3_TTS_0_6B_TALKER if size == "0.6b" else QWEN3_TTS_1_7B_TALKER
        config = tiny_config(talker=dict(talker, text_vocab_size=NUM_TEXT_ROWS, vocab_size=3072),
                             predictor=dict(QWEN3_TTS_0_6B_PREDICTOR, vocab_size=2048), initializer_range=0.02)
        torch.manual_seed(0)
        model = Qwen3TTSModel(config).eval()
        codec = tiny_speech_tokenizer(0, **RELEASED_DECODER_CONFIG)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    model.save_pretrained(staging)
    byte_tokenizer().save_pretrained(staging)
    codec.save_pretrained(staging / "speech_tokenizer")
    if path.exists():  # an incomplete earlier build
        import shutil

        shutil.rmtree(path)
    staging.rename(path)
    return path


# --- the machine --------------------------------------------------------------------------------------------


def repeat_times(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def machine_floors(threads: int, quick: bool) -> dict:
    """Streaming read and copy bandwidth (GB/s) and the fp32 and bf16 matmul peaks (GFLOP/s), best of a few
    runs."""
    torch.set_num_threads(threads)
    num = (16 if quick else 128) << 20  # floats: 64 / 512 MB, far beyond any cache
    src, dst = torch.ones(num), torch.empty(num)

    def best(fn, repeats):
        return min(repeat_times(fn, repeats))

    read_s = best(lambda: src.sum(), 10)  # best of 10: one probe of 5 read 24.7 GB/s, another 30.3
    copy_s = best(lambda: dst.copy_(src), 10)
    n = 512 if quick else 2048
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    mm_s = best(lambda: torch.mm(a, b, out=c), 3 if quick else 5)
    a16, b16, c16 = a.bfloat16(), b.bfloat16(), c.bfloat16()
    mm16_s = best(lambda: torch.mm(a16, b16, out=c16), 3 if quick else 5)
    return {"read_gb_s": 4 * num / read_s / 1e9, "copy_gb_s": 2 * 4 * num / copy_s / 1e9,
            "fp32_matmul_gflop_s": 2 * n**3 / mm_s / 1e9, "bf16_matmul_gflop_s": 2 * n**3 / mm16_s / 1e9,
            "threads": threads}


# --- one mode in one process --------------------------------------------------------------------------------


class PhaseClock:
    """The engine's observer: seconds per phase and talker steps (frames of the batch)."""

    def __init__(self):
        self.phases = defaultdict(float)
        self.num_frame_steps = 0

    def stage(self, stage: str, seconds: float) -> None:
        pass

    def phase(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds

    def talker_batch(self, num_rows: int) -> None:
        self.num_frame_steps += 1


@contextlib.contextmanager
def timed_predictor(pipe, clock: PhaseClock):
    """While inside, the family's code predictor runner times each `run` into clock.phases["code_predictor"] (an
    attribute of the runner instance, removed on the way out)."""
    runner = pipe.family.predictor(pipe.config.max_batch_size)
    run = runner.run

    def timed_run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            clock.phases["code_predictor"] += time.perf_counter() - started

    runner.run = timed_run
    try:
        yield
    finally:
        del runner.run


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, its own memory's high-water mark (ru_maxrss would carry the peak of the
    process that forked it across exec), or the current RSS where that has not caught up yet."""
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return max(hwm / 1024, _rss_mb())


def _matrix_bytes(matrix) -> int:
    """Bytes a matmul by this weight reads: a float tensor, or a quantized one as the kernel stores it."""
    if isinstance(matrix, torch.Tensor):
        return matrix.numel() * matrix.element_size()
    return sum(t.numel() * t.element_size() for t in (matrix.packed, matrix.scales))


def _matrix_macs(matrix) -> int:
    """Multiply-adds of one row through this weight ([N, K]; a quantized one's K: int8 packs [., K, 16], int4
    [., K / 8, 16] words with a scale per group of inputs)."""
    if isinstance(matrix, torch.Tensor):
        return matrix.numel()
    if matrix.group_size is None:
        return matrix.out_features * matrix.packed.shape[1]
    return matrix.out_features * matrix.scales.shape[1] * matrix.group_size


def _float_macs(matrix) -> int:
    """Multiply-adds of one row in float: none for a w4a8 matrix, whose integer multiply-adds run at a peak this
    benchmark does not measure (AVX512-VNNI's int8 rate is several times the fp32 one), so they are left out of
    the compute floor (a floor without them is still a floor)."""
    return 0 if getattr(matrix, "int8_activations", False) else _matrix_macs(matrix)


def decoder_read(decoder) -> tuple[int, int]:
    """(bytes, float multiply-adds) of one row through a packed decoder's dense layers' matrices."""
    total_bytes = total_macs = 0
    for i, layer in enumerate(decoder.layers):
        matrices = (layer.qkv, layer.o, layer.gate_up, layer.mlp_down)
        if decoder.quantized_layers is not None:
            matrices = decoder.quantized_layers[i]
        total_bytes += sum(_matrix_bytes(m) for m in matrices)
        total_macs += sum(_float_macs(m) for m in matrices)
    return total_bytes, total_macs


def part_floors(pipe, batch_size: int, machine: dict, decoder_flops_per_frame: float) -> dict:
    """ms per frame step each part needs at least: max(bytes ÷ read bandwidth, FLOPs ÷ matmul peak) (w4a8's
    integer multiply-adds not counted: `_float_macs`)."""
    family = pipe.family
    bandwidth, peak = machine["read_gb_s"] * 1e9, machine["fp32_matmul_gflop_s"] * 1e9
    is_bf16_codec = family.codec.conv_dtype == torch.bfloat16
    decoder_peak = machine["bf16_matmul_gflop_s" if is_bf16_codec else "fp32_matmul_gflop_s"] * 1e9
    talker_bytes, talker_macs = decoder_read(family.talker_decoder)
    head = family.talker.codec_head.weight
    talker_bytes += _matrix_bytes(head)
    talker_macs += head.numel()
    runner = family.predictor(pipe.config.max_batch_size)
    step_bytes, step_macs = decoder_read(runner.weights.decoder)
    heads = runner.weights.quantized_lm_heads
    lm_head = runner.weights.lm_heads[0] if heads is None else heads[0]  # as the runner reads it
    num_steps = runner.num_code_groups - 1
    # one forward a step, reading every matrix once; the first step's forward has 2 positions a row
    predictor_bytes = num_steps * (step_bytes + _matrix_bytes(lm_head))
    predictor_macs = num_steps * (step_macs + _matrix_macs(lm_head)) + step_macs
    projection = getattr(family.talker.code_predictor, "small_to_mtp_projection", None)
    if isinstance(projection, torch.nn.Linear):
        predictor_bytes += (num_steps + 1) * _matrix_bytes(projection.weight)
        predictor_macs += (num_steps + 1) * projection.weight.numel()

    def floor_ms(num_bytes, flops):
        return 1000 * max(num_bytes / bandwidth, flops / peak)

    return {
        "talker_ms": floor_ms(talker_bytes, 2 * talker_macs * batch_size),
        "code_predictor_ms": floor_ms(predictor_bytes, 2 * predictor_macs * batch_size),
        # the decoder's conv stack (nearly all its FLOPs) at the matmul peak of its dtype
        "decoder_ms": 1000 * decoder_flops_per_frame * batch_size / decoder_peak,
        "talker_weight_bytes": talker_bytes, "code_predictor_bytes_per_frame": predictor_bytes,
        "decoder_gflop_per_frame": decoder_flops_per_frame / 1e9,
    }


def decoder_flops(codec, num_frames: int) -> float:
    """FLOPs per frame of the 12 Hz decoder on `num_frames` random frames (torch's FLOP counter, omnimtp's row
    kernels off while it counts: their calls are not torch ops, and it would miss them)."""
    from torch.utils.flop_counter import FlopCounterMode

    from omnimtp.codec import streaming

    codes = torch.randint(0, codec.codebook_size, (1, codec.num_quantizers, num_frames),
                          generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    kept = streaming.ROW_KERNEL_MAX_ROWS, streaming.BF16_ROWS_MAX_STEPS
    streaming.ROW_KERNEL_MAX_ROWS = streaming.BF16_ROWS_MAX_STEPS = 0
    try:
        with counter, torch.no_grad():
            codec.waveform(codes)
    finally:
        streaming.ROW_KERNEL_MAX_ROWS, streaming.BF16_ROWS_MAX_STEPS = kept
    return counter.get_total_flops() / num_frames


def timed_batch(pipe, batch_size: int, frames: int, profile: bool = False) -> dict:
    """One greedy batch through an engine core of its own, the engine's phases timed."""
    from omnimtp.engine.core import EngineCore

    texts = [TEXTS[i % len(TEXTS)] for i in range(batch_size)]
    voices = [VOICES[i % len(VOICES)] for i in range(batch_size)]
    requests, _ = pipe._speech_requests(texts, None, voices, None, None, None, None, frames, is_streamed=False)
    clock = PhaseClock()
    core = EngineCore(pipe.family, pipe.config, observer=clock)
    for request in requests:
        core.add(request)
    outputs = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    with timed_predictor(pipe, clock), profiler or contextlib.nullcontext():
        started = time.perf_counter()
        while core.has_work():
            for event in core.step():
                if event.is_finished:
                    outputs.append(core.output(event.request))
        wall = time.perf_counter() - started
    audio_s = sum(len(o.audio) for o in outputs) / pipe.family.sample_rate
    steps = max(clock.num_frame_steps, 1)
    phases = clock.phases
    talk = phases["talk"]
    result = {
        "batch_size": batch_size, "wall_s": wall, "audio_s": audio_s, "rtf": wall / audio_s if audio_s else None,
        "frames": [int(o.codes.shape[1]) for o in outputs], "frame_steps": clock.num_frame_steps,
        "ms_per_frame": {
            "talker": 1000 * (talk - phases["code_predictor"]) / steps,
            "code_predictor": 1000 * phases["code_predictor"] / steps,
            "decoder": 1000 * phases["code2wav"] / steps,
            "rest": 1000 * (wall - talk - phases["code2wav"]) / steps,
            "total": 1000 * wall / steps,
        },
    }
    if profiler is not None:
        result["profile"] = summarize_profile(profiler, wall, steps)
    return result


def summarize_profile(profiler, wall: float, steps: int, top: int = 20) -> dict:
    """The top ops by self CPU time, ops per frame, and the share of the wall time no op accounts for."""
    events = [e for e in profiler.key_averages() if not e.key.startswith("ProfilerStep")]
    self_total = sum(e.self_cpu_time_total for e in events) / 1e6
    matmul_names = ("aten::mm", "aten::mv", "aten::addmv_", "aten::addmv", "aten::addmm", "aten::bmm",
                    "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution", "aten::conv1d",
                    "aten::conv_transpose1d", "aten::_scaled_dot_product_flash_attention_for_cpu")
    matmul_self = sum(e.self_cpu_time_total for e in events if e.key in matmul_names) / 1e6
    num_calls = sum(e.count for e in events)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "top_ops": [{"op": e.key, "calls_per_frame": e.count / steps, "self_ms_per_frame": e.self_cpu_time_total
                     / 1e3 / steps, "us_per_call": e.self_cpu_time_total / max(e.count, 1)} for e in ranked],
        "ops_per_frame": num_calls / steps,
        "matmul_and_conv_ms_per_frame": 1000 * matmul_self / steps,
        "other_ops_ms_per_frame": 1000 * (self_total - matmul_self) / steps,
        "outside_ops_ms_per_frame": 1000 * (wall - self_total) / steps,  # omnimtp's ctypes kernels, Python
    }


def run_mode(path: str, mode: str, batch_sizes: list[int], frames: int, threads: int, machine: dict,
             decoder_frames: int, profile: bool, compile_predictor: str = "none", codec_dtype: str = "float32") -> dict:
    """Every measurement of one mode (see the module docstring)."""
    from omnimtp.pipeline import OmniPipeline

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    quantize = mode if mode in ("int8", "int4", "w4a8") else None
    compiled = compile_predictor != "none"
    result = {"mode": mode + (f" {compile_predictor}-compiled" if compiled else "")
              + (f" {codec_dtype} codec" if codec_dtype != "float32" else "")}
    started = time.perf_counter()
    try:
        pipe = OmniPipeline.from_pretrained(path, dtype=dtype, quantize=quantize, max_frames=frames,
                                            max_batch_size=max(batch_sizes), torch_threads=threads,
                                            compile_predictor=compile_predictor if compiled else False,
                                            codec_dtype=codec_dtype)
        result["load_s"] = time.perf_counter() - started
        result["load_peak_rss_mb"] = _peak_rss_mb()
        if compiled:  # the greedy graphs of the buckets measured, built before any timing (what a warm server runs)
            started = time.perf_counter()
            runner = pipe.family.predictor(pipe.config.max_batch_size)
            for rows in sorted({runner.bucket_rows(b) for b in batch_sizes}):
                runner.build_graph(rows, None)
            result["compile_s"] = time.perf_counter() - started
        pipe.speech(TEXTS[0], voice=VOICES[0], max_frames=2)  # warm-up
    except (ValueError, RuntimeError, NotImplementedError) as error:
        return {**result, "unsupported": f"{type(error).__name__}: {error}"}
    result["rss_loaded_mb"] = _rss_mb()
    flops = decoder_flops(pipe.family.codec, decoder_frames)
    for batch_size in batch_sizes:
        pipe.speech([TEXTS[0]] * batch_size, voice=VOICES[0], max_frames=2)  # this batch size's warm-up
        entry = timed_batch(pipe, batch_size, frames)
        floor = entry["floor"] = part_floors(pipe, batch_size, machine, flops)
        # the RTF this machine allows at best: every part at its floor, nothing else (audio ms per frame step)
        audio_ms = 1000 * entry["audio_s"] / max(entry["frame_steps"], 1)
        floor["rtf"] = (floor["talker_ms"] + floor["code_predictor_ms"] + floor["decoder_ms"]) / audio_ms
        result[f"batch_{batch_size}"] = entry
    ttfa = []
    for _ in range(TTFA_RUNS):  # the median of a few: one first chunk is a few short steps, so the box's noise shows
        stream = iter(pipe.stream_speech(TEXTS[0], voice=VOICES[0], max_frames=frames))
        started = time.perf_counter()
        next(stream)
        ttfa.append(time.perf_counter() - started)
        stream.close()
    result["ttfa_s"], result["ttfa_runs_s"] = statistics.median(ttfa), ttfa
    if profile:
        result["profile"] = timed_batch(pipe, 1, frames, profile=True)["profile"]
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


def run_reference(path: str, batch_sizes: list[int], frames: int, threads: int) -> dict:
    """The reference's generate + decode, fp32, greedy, per batch size: wall, audio seconds, RTF."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from transformers import AutoTokenizer
    from tts_e2e import Reference

    torch.set_num_threads(threads)
    reference = Reference(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    result = {"mode": "reference fp32", "rss_loaded_mb": _rss_mb()}
    for batch_size in batch_sizes:
        texts = [TEXTS[i % len(TEXTS)] for i in range(batch_size)]
        voices = [VOICES[i % len(VOICES)] for i in range(batch_size)]
        ids_rows = [tokenizer.encode(f"<|im_start|>assistant\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in texts]
        reference.speak(ids_rows, voices, 2)  # warm-up
        started = time.perf_counter()
        codes, audio = reference.speak(ids_rows, voices, frames)
        wall = time.perf_counter() - started
        audio_s = sum(int(c.shape[0]) for c in codes) * 1920 / 24_000  # its decode pads the batch: count frames
        result[f"batch_{batch_size}"] = {"batch_size": batch_size, "wall_s": wall, "audio_s": audio_s,
                                         "rtf": wall / audio_s, "frames": [int(c.shape[0]) for c in codes]}
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


def timed_stream(pipe, text: str, voice: str, frames: int) -> dict:
    """One streamed greedy request: wall, first audio, audio seconds, RTF."""
    first, samples = None, 0
    started = time.perf_counter()
    for item in pipe.stream_speech(text, voice=voice, max_frames=frames):
        if isinstance(item, np.ndarray):
            first = time.perf_counter() - started if first is None else first
            samples += item.shape[-1]
    wall = time.perf_counter() - started
    audio_s = samples / pipe.family.sample_rate
    return {"wall_s": wall, "first_audio_s": first, "audio_s": audio_s, "rtf": wall / audio_s if audio_s else None,
            "frames": round(audio_s * pipe.family.sample_rate / 1920)}


def run_peer(worker: dict) -> dict:
    """omnimtp (`mode`, `codec_dtype`) and qwentts.cpp at each converted quantization, alternating one streamed
    request of each `repeats` times; the peer's timing server is a child process, so this process's peak RSS is
    omnimtp's alone."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from qwentts_peer import PeerServer

    from omnimtp.pipeline import OmniPipeline

    threads, frames = worker["threads"], worker["frames"]
    torch.set_num_threads(threads)
    quantize = worker["mode"] if worker["mode"] in QUANTIZED_MODES else None
    pipe = OmniPipeline.from_pretrained(worker["path"], dtype=torch.bfloat16 if worker["mode"] == "bf16" else
                                        torch.float32, quantize=quantize, max_frames=frames, max_batch_size=1,
                                        torch_threads=threads, codec_dtype=worker["codec_dtype"])
    ours_name = f"omnimtp {worker['mode']}" + (f" {worker['codec_dtype']} codec"
                                                if worker["codec_dtype"] != "float32" else "")
    pipe.speech(TEXTS[0], voice=VOICES[0], max_frames=2)  # warm-up, batched and streamed
    timed_stream(pipe, TEXTS[0], VOICES[0], 2)
    result = {"ours": ours_name, "threads": threads, "frames": frames, "peer_stream_frames": worker["stream_frames"],
              "peers": []}
    for conversion in worker["conversions"]:
        log = f"{conversion['talker'].rsplit('.', 1)[0]}.log"
        peer = PeerServer(worker["peer_python"], conversion["talker"], conversion["codec"], threads, log,
                          worker["stream_frames"])
        try:
            peer.speak(TEXTS[0], VOICES[0], 2)  # warm-up
            pairs = []
            for _ in range(worker["repeats"]):
                pairs.append({"ours": timed_stream(pipe, TEXTS[0], VOICES[0], frames),
                              "peer": peer.speak(TEXTS[0], VOICES[0], frames)})
            peer_peak = pairs[-1]["peer"]["peak_rss_mb"]
        finally:
            peer.close()
        entry = {"quant": conversion["quant"], "peer_load": peer.ready, "pairs": pairs, "peer_peak_rss_mb": peer_peak}
        for key in ("rtf", "first_audio_s"):
            entry[f"ours_{key}"] = statistics.median(p["ours"][key] for p in pairs)
            entry[f"peer_{key}"] = statistics.median(p["peer"][key] for p in pairs)
            # each pair's peer ÷ ours: > 1 where omnimtp is faster
            entry[f"{key}_ratio"] = statistics.median(p["peer"][key] / p["ours"][key] for p in pairs)
        result["peers"].append(entry)
    result["ours_peak_rss_mb"] = _peak_rss_mb()
    return result


def run_peer_check(worker: dict) -> dict:
    """The converted checkpoint speaks what omnimtp speaks: greedy codes of omnimtp fp32 in the peer's prompt
    layout (the whole text in the prefill: `non_streaming_mode`) against the peer's from the F32 conversion, and
    the two waveforms (the peer runs its conv kernels in F16)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from qwentts_peer import PeerServer

    from omnimtp.pipeline import OmniPipeline

    torch.set_num_threads(worker["threads"])
    frames = worker["frames"]
    pipe = OmniPipeline.from_pretrained(worker["path"], dtype=torch.float32, max_frames=frames, max_batch_size=1,
                                        torch_threads=worker["threads"], non_streaming_mode=True)
    ours = pipe.speech(TEXTS[0], voice=VOICES[0], language="english", max_frames=frames)
    conversion = worker["conversion"]
    peer = PeerServer(worker["peer_python"], conversion["talker"], conversion["codec"], worker["threads"],
                      f"{conversion['talker'].rsplit('.', 1)[0]}.log")
    try:
        theirs = peer.speak(TEXTS[0], VOICES[0], frames, codes=True)
    finally:
        peer.close()
    ours_codes = ours.codes.T.tolist()  # [frames][16], as the peer's
    ours_audio, peer_audio = np.asarray(ours.audio, dtype=np.float32), np.asarray(theirs["audio"], dtype=np.float32)
    n = min(len(ours_audio), len(peer_audio))
    return {"frames": [len(ours_codes), len(theirs["codes"])],
            "codes_equal": sum(a == b for row_a, row_b in zip(ours_codes, theirs["codes"], strict=False)
                               for a, b in zip(row_a, row_b, strict=True)),
            "codes_total": 16 * len(ours_codes),
            "audio_max_abs_diff": float(np.abs(ours_audio[:n] - peer_audio[:n]).max()),
            "audio_peak": float(np.abs(ours_audio).max())}


def convert_for_peer(path: str, quant: str, peer_python: str) -> dict:
    """The checkpoint's qwentts.cpp GGUF files at `quant` (`qwentts_peer.py convert` in the peer's venv; kept in
    PATH-qwentts/)."""
    process = subprocess.run([peer_python, str(ROOT / "benchmarks" / "qwentts_peer.py"), "convert", path,
                              f"{path.rstrip(os.sep)}-qwentts", "--quant", quant], cwd=ROOT, capture_output=True,
                             text=True)
    if process.returncode != 0:
        raise SystemExit(f"converting for qwentts.cpp ({quant}) failed:\n{process.stderr.strip()[-2000:]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def print_peer(result: dict) -> None:
    if "failed" in result:
        print(f"peer: {result['failed'].splitlines()[-1]}")
        return
    for e in result["peers"]:
        print(f"qwentts.cpp {e['quant']:7s} RTF {e['peer_rtf']:.2f}, first audio {1000 * e['peer_first_audio_s']:.0f}"
              f" ms, peak RSS {e['peer_peak_rss_mb']:.0f} MB | {result['ours']} RTF {e['ours_rtf']:.2f}, first "
              f"audio {1000 * e['ours_first_audio_s']:.0f} ms, peak RSS {result['ours_peak_rss_mb']:.0f} MB | "
              f"omnimtp {e['rtf_ratio']:.2f}x the RTF, {e['first_audio_s_ratio']:.2f}x the first audio (median of "
              f"{len(e['pairs'])} alternating pairs, {result['threads']} threads, {result['frames']} frames)")


def in_subprocess(worker: dict, threads: int) -> dict:
    """A worker (`--worker JSON`) in a fresh process, so its peak RSS is its own."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        process = subprocess.run([sys.executable, __file__, "--worker", json.dumps(worker), "--out", out.name],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
        if process.returncode != 0:
            return {"mode": worker.get("mode", "reference"), "failed": process.stderr.strip()[-2000:]}
        return json.loads(Path(out.name).read_text())


def run_worker(worker: dict) -> dict:
    if worker["kind"] == "peer":
        return run_peer(worker)
    if worker["kind"] == "peer_check":
        return run_peer_check(worker)
    if worker["kind"] == "reference":
        return run_reference(worker["path"], worker["batch_sizes"], worker["frames"], worker["threads"])
    result = run_mode(worker["path"], worker["mode"], worker["batch_sizes"], worker["frames"], worker["threads"],
                      worker["machine"], worker["decoder_frames"], worker["profile"], worker["compile_predictor"],
                      worker["codec_dtype"])
    return {**result, "mode": result["mode"] + worker.get("label", "")}


def prequantized_copy(path: str, mode: str, threads: int) -> tuple[str, dict | None]:
    """`omnimtp quantize PATH PATH-MODE --quantize MODE` in its own process, unless that copy exists (then None):
    the copy's path and what the command reported (seconds, peak RSS)."""
    copy = f"{path.rstrip(os.sep)}-{mode}"
    if os.path.isfile(os.path.join(copy, "config.json")):
        return copy, None
    staging = tempfile.mkdtemp(prefix=os.path.basename(copy) + ".", dir=os.path.dirname(copy) or ".")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    process = subprocess.run([sys.executable, "-m", "omnimtp.cli", "quantize", path, staging, "--quantize", mode,
                              "--json"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    os.rename(staging, copy)
    return copy, json.loads(process.stdout.strip().splitlines()[-1])


# --- the report ---------------------------------------------------------------------------------------------


def print_mode(entry: dict, batch_sizes: list[int]) -> None:
    name = entry["mode"]
    if "unsupported" in entry or "failed" in entry:
        print(f"{name:15s} {entry.get('unsupported') or entry['failed'].splitlines()[-1]}")
        return
    for batch_size in batch_sizes:
        e = entry[f"batch_{batch_size}"]
        line = f"{name:15s} B={batch_size}: RTF {e['rtf']:.2f} ({e['wall_s']:.1f} s for {e['audio_s']:.2f} s)"
        if "rtf" in e.get("floor", {}):
            line += f", floor RTF {e['floor']['rtf']:.2f}"
        if "ms_per_frame" in e:
            ms, floor = e["ms_per_frame"], e["floor"]
            line += (f"; ms/frame step {ms['total']:.0f}: talker {ms['talker']:.0f} (floor {floor['talker_ms']:.0f}),"
                     f" predictor {ms['code_predictor']:.0f} (floor {floor['code_predictor_ms']:.0f}),"
                     f" decoder {ms['decoder']:.0f} (floor {floor['decoder_ms']:.0f}), rest {ms['rest']:.0f}")
        print(line)
    extra = f", first audio {1000 * entry['ttfa_s']:.0f} ms" if "ttfa_s" in entry else ""
    if "compile_s" in entry:
        extra += f", predictor graphs built in {entry['compile_s']:.0f} s (untimed)"
    load_peak = f", peak while loading {entry['load_peak_rss_mb']:.0f} MB" if "load_peak_rss_mb" in entry else ""
    print(f"{'':15s} RSS loaded {entry['rss_loaded_mb']:.0f} MB{load_peak}, peak {entry['peak_rss_mb']:.0f} MB{extra}")
    if "profile" in entry:
        p = entry["profile"]
        print(f"{'':15s} profile, per frame: {p['ops_per_frame']:.0f} ops; matmul/conv "
              f"{p['matmul_and_conv_ms_per_frame']:.0f} ms, other ops {p['other_ops_ms_per_frame']:.0f} ms, "
              f"outside ops {p['outside_ops_ms_per_frame']:.0f} ms")
        for op in p["top_ops"][:10]:
            print(f"{'':17s}{op['op']:45s} {op['self_ms_per_frame']:7.1f} ms/frame {op['calls_per_frame']:7.0f} calls"
                  f" {op['us_per_call']:8.1f} us/call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.6b", choices=SIZES)
    parser.add_argument("--model", default=None, help="a checkpoint directory in the released layout (not built)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"),
                        help="where built checkpoints are kept between runs")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                        help="the modes timed one by one (none given: only --peer's comparison)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--frames", type=int, default=None, help="frames per request (default 12; --quick 3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="a torch.profiler op table of each mode's batch 1")
    parser.add_argument("--compile-predictor", default="none", choices=("none", "step", "frame"),
                        help="run the code predictor as compiled graphs (`compile_predictor`, what a warm server "
                        "runs); each measured batch size's greedy graph is built before timing, its time reported")
    parser.add_argument("--codec-dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16"),
                        help="the 12 Hz decoder's conv stack (`codec_dtype`): each mode runs once per dtype given")
    parser.add_argument("--prequantized", action="store_true",
                        help="each quantized mode also from a pre-quantized copy of the checkpoint (`omnimtp "
                        "quantize`, built once beside it: its time and peak RSS reported), loaded memory-mapped")
    parser.add_argument("--peer", action="store_true",
                        help="qwentts.cpp on the same checkpoint, alternating with omnimtp (see above)")
    parser.add_argument("--peer-python", default="qwentts-venv/bin/python",
                        help="the python of the venv the peer is installed in")
    parser.add_argument("--peer-quants", nargs="+", default=["Q4_K_M", "Q8_0"], choices=("Q4_K_M", "Q8_0", "F32"))
    parser.add_argument("--peer-mode", default="w4a8", choices=MODES, help="omnimtp's mode beside the peer")
    parser.add_argument("--peer-codec-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--peer-repeats", type=int, default=3, help="alternating pairs of requests per quantization")
    parser.add_argument("--peer-stream-frames", type=int, default=0, choices=(0, 1, 2, 4),
                        help="the peer's streamed chunk cadence in frames (its cpu_stream_frames; 0: its default)")
    parser.add_argument("--peer-check", action="store_true",
                        help="first check the conversion: omnimtp fp32 and the peer's F32 files, greedy codes compared")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--in-process", action="store_true", help="every mode in this process (peak RSS shared)")
    parser.add_argument("--quick", action="store_true", help="3 frames, small machine probes (a check that it runs)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        result = run_worker(json.loads(args.worker))
        Path(args.out).write_text(json.dumps(result))
        return
    if any(b < 1 for b in args.batch_sizes):
        parser.error("--batch-sizes must be >= 1")
    frames = args.frames or (3 if args.quick else 12)
    if (args.peer or args.peer_check) and not os.access(args.peer_python, os.X_OK):
        parser.error(f"--peer-python: {args.peer_python} is not an executable (the peer's venv: see --help)")
    if args.peer_repeats < 1:
        parser.error("--peer-repeats must be >= 1")
    started = time.perf_counter()
    path = args.model or str(build_checkpoint(args.size, Path(args.cache_dir) / f"qwen3-tts-{args.size}"))
    build_s = time.perf_counter() - started
    machine = machine_floors(args.threads, args.quick)
    print(f"machine: read {machine['read_gb_s']:.1f} GB/s, copy {machine['copy_gb_s']:.1f} GB/s, fp32 matmul "
          f"{machine['fp32_matmul_gflop_s']:.0f} GFLOP/s, bf16 matmul {machine['bf16_matmul_gflop_s']:.0f} GFLOP/s on "
          f"{args.threads} threads; checkpoint {path}")
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "size": args.size, "model": path,
               "frames": frames, "threads": args.threads, "torch": torch.__version__,
               "cpu": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
               "machine": machine, "checkpoint_build_s": build_s, "modes": []}
    common = dict(path=path, batch_sizes=args.batch_sizes, frames=frames, threads=args.threads)
    workers = [dict(common, kind="mode", mode=mode, machine=machine, decoder_frames=2 if args.quick else 12,
                    profile=args.profile, compile_predictor=args.compile_predictor, codec_dtype=codec_dtype)
               for mode in args.modes for codec_dtype in args.codec_dtypes]
    if args.prequantized:
        for mode in (m for m in args.modes if m in QUANTIZED_MODES):
            copy, converted = prequantized_copy(path, mode, args.threads)
            results.setdefault("conversions", {})[mode] = converted
            print(f"{mode} copy {copy}: " + (f"converted in {converted['seconds']} s, peak RSS "
                                             f"{converted['peak_rss_mb']} MB" if converted else "built earlier"))
            workers += [dict(common, path=copy, kind="mode", mode=mode, machine=machine, label=" pre-quantized",
                             decoder_frames=2 if args.quick else 12, profile=args.profile,
                             compile_predictor=args.compile_predictor, codec_dtype=codec_dtype)
                        for codec_dtype in args.codec_dtypes]
    if args.peer_check:
        workers.append(dict(common, kind="peer_check", frames=min(frames, 8), peer_python=args.peer_python,
                            conversion=convert_for_peer(path, "F32", args.peer_python)))
    if args.peer:
        conversions = [convert_for_peer(path, quant, args.peer_python) for quant in args.peer_quants]
        results["peer_conversions"] = conversions
        for c in conversions:
            print(f"qwentts.cpp {c['quant']}: {c['talker']} ({c['talker_bytes'] / 2**20:.0f} MB), {c['codec']} "
                  f"({c['codec_bytes'] / 2**20:.0f} MB), converted in {c['seconds']:.0f} s")
        ours_path = path  # with --prequantized, omnimtp loads its pre-quantized copy, as the peer its GGUF files
        if args.prequantized and args.peer_mode in QUANTIZED_MODES:
            ours_path = prequantized_copy(path, args.peer_mode, args.threads)[0]
        workers.append(dict(common, path=ours_path, kind="peer", mode=args.peer_mode, repeats=args.peer_repeats,
                            codec_dtype=args.peer_codec_dtype, conversions=conversions, peer_python=args.peer_python,
                            stream_frames=args.peer_stream_frames))
    if not args.no_reference:
        workers.append(dict(common, kind="reference"))
    for worker in workers:
        entry = run_worker(worker) if args.in_process else in_subprocess(worker, args.threads)
        if worker["kind"] == "peer":
            results["peer"] = entry
            print_peer(entry)
            continue
        if worker["kind"] == "peer_check":
            results["peer_check"] = entry
            print("qwentts.cpp F32 vs omnimtp fp32 (its prompt layout), greedy: " + (entry["failed"].splitlines()[-1]
                  if "failed" in entry else f"{entry['codes_equal']} of {entry['codes_total']} codes equal, audio "
                  f"within {entry['audio_max_abs_diff']:.4f} of a {entry['audio_peak']:.3f} peak"))
            continue
        results["reference" if worker["kind"] == "reference" else "modes"] = (
            entry if worker["kind"] == "reference" else [*results["modes"], entry])
        print_mode(entry, args.batch_sizes)
        if args.out:  # after every worker, so an interrupted run keeps what it measured
            Path(args.out).write_text(json.dumps(results, indent=2))
    reference = results.get("reference")
    if reference and "batch_1" in reference:
        for entry in results["modes"]:
            for batch_size in args.batch_sizes:
                key = f"batch_{batch_size}"
                if key in entry and key in reference:
                    entry[key]["speedup_vs_reference"] = reference[key]["rtf"] / entry[key]["rtf"]
    results["total_s"] = time.perf_counter() - started
    print(f"total {results['total_s']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
