"""Qwen3-Omni-30B-A3B and Qwen2.5-Omni 7B / 3B at their released sizes, quantized, speaking on this CPU: load,
memory, thinker and speech speed, each next to its floor.

No released weights can be downloaded here, so this builds a seeded random-weight checkpoint of `--config` (the
released config.json's fields, `configs/`) straight in omnimtp's quantized format (`omnimtp.quantized_checkpoint.
random_quantized_checkpoint`: one layer and one expert at a time, the float model never exists; encoders and codec
in bf16 as released, Qwen2.5-Omni's token2wav in float32, the only dtype it computes in), kept in `--cache-dir` for
later runs, then loads it with `OmniPipeline.from_pretrained` in a fresh process and measures there:

- load time and peak RSS (the whole process: Linux's VmHWM, file-backed pages of the mapped weights included), and
  the warm-up a server runs before its first request (`OmniPipeline.warm_up`: the prefetch of the mapped weights
  every reply reads, then a warm-up reply to another prompt of 8 tokens), with the page faults and bytes read from
  storage of each; `--no-warm-up` loads without either, as a cold first request finds the process;
- the thinker's prefill of a `--prompt`-token prompt, its decode rate at batch 1 and 4 (the packed decoder's step
  and the LM head, in int8, as the engine runs them), and a speculative verify of k + 1 = 2, 3, 4 positions
  against the plain step (a MoE verify reads the union of its rows' experts);
- speech: a chat request of that prompt through the engine (`--think-tokens` thinker tokens, then the talker up to
  `--frames` frames, by default `--seconds` of audio: random weights never end on their own), time to first audio,
  the real-time factor, and per frame the talker's, code predictor's (Qwen3-Omni) and codec's (code2wav; Qwen2.5-
  Omni's token2wav) shares; per stage of the reply (thinker prefill and steps, talker prefill and steps, code
  predictor, codec), to its first audio and after it, the seconds, page faults (major: read from storage; minor:
  mapped from the page cache) and bytes read from storage (/proc/self/io). It runs first, as a server's first
  request after loading, and again (`speech_again`) after the thinker's figures.

Floors: the bytes a one-row thinker step reads (each layer's attention, router, top-k experts with their scales and
KV rows, and the int8 LM head) ÷ the read bandwidth measured in the same process. Experts are picked by random routers.
Writes JSON.

configs/: the released config.json files' architecture fields (the Qwen2.5-Omni ones give the released 10.7 B and
5.5 B parameters).

    python benchmarks/omni_realsize.py [--config configs/qwen3-omni-30b-a3b-instruct.json] [--quantize w4a8] \\
        [--codec-dtype bfloat16] [--threads 2] [--out r.json]
    python benchmarks/omni_realsize.py --config configs/qwen2.5-omni-3b.json
    python benchmarks/omni_realsize.py --no-warm-up            # the first reply of a cold process
    python benchmarks/omni_realsize.py --build-only DIR        # only write the quantized checkpoint into DIR
    python benchmarks/omni_realsize.py --quick [--config C]    # the tiny model of C's family: a check that it runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # this checkout, not an installed copy
sys.path.insert(0, os.path.dirname(__file__))

from tts_realtime import PhaseClock, machine_floors, repeat_times  # noqa: E402

from omnimtp.runtime.ops import QUANTIZE_MODES  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "configs" / "qwen3-omni-30b-a3b-instruct.json"
NEWLINE = 198  # "\n" in the Qwen tokenizers (the chat template's line ends)
# the chat template's ids in Qwen's tokenizers (Qwen3-Omni's config names them; Qwen2.5-Omni's does not)
QWEN_CHAT_IDS = {"im_start": 151644, "im_end": 151645, "user": 872, "assistant": 77091}


def peak_rss_gb() -> float:
    with open("/proc/self/status") as f:
        peak_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return max(peak_kb / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


def quick_config(model_type: str) -> dict:
    """The tiny model's config of `model_type`'s family."""
    from omnimtp.models.tiny import tiny_qwen3_omni_config
    from omnimtp.models.tiny_qwen2_5_omni import tiny_qwen2_5_omni_config

    configs = {"qwen3_omni_moe": tiny_qwen3_omni_config, "qwen2_5_omni": tiny_qwen2_5_omni_config}
    if model_type not in configs:
        raise ValueError(f"config: model_type {model_type!r}; omni_realsize.py runs {sorted(configs)}")
    return configs[model_type]().to_dict()


def build(config: dict, path: Path, mode: str, seed: int) -> dict:
    from omnimtp.quantized_checkpoint import random_quantized_checkpoint

    started = time.perf_counter()
    summary = random_quantized_checkpoint(config, path, mode, seed=seed)
    return {"build_s": time.perf_counter() - started, "bytes": sum(summary["files"].values()),
            "build_peak_rss_gb": peak_rss_gb()}


# --- measured in a fresh process ----------------------------------------------------------------------------------


def chat_token_ids(config) -> dict[str, int]:
    """<|im_start|>, <|im_end|>, user and assistant: Qwen3-Omni's config's, Qwen's tokenizers' (QWEN_CHAT_IDS) for a
    Qwen2.5-Omni, the tiny byte vocabulary's for the tiny Qwen2.5-Omni."""
    from omnimtp.models.tiny_qwen2_5_omni import QWEN2_5_THINKER_SPECIAL_TOKENS as tiny

    if hasattr(config, "im_start_token_id"):
        return {"im_start": config.im_start_token_id, "im_end": config.im_end_token_id,
                "user": config.user_token_id, "assistant": config.assistant_token_id}
    if config.thinker_config.text_config.vocab_size > max(QWEN_CHAT_IDS.values()):
        return QWEN_CHAT_IDS
    return {"im_start": tiny["<|im_start|>"], "im_end": tiny["<|im_end|>"], "user": tiny["user"],
            "assistant": tiny["assistant"]}


def chat_ids(config, body: list[int]) -> list[int]:
    """A one-turn chat prompt around `body`: <|im_start|>user \\n body <|im_end|> \\n <|im_start|>assistant \\n."""
    ids = chat_token_ids(config)
    return [ids["im_start"], ids["user"], NEWLINE, *body, ids["im_end"], NEWLINE, ids["im_start"], ids["assistant"],
            NEWLINE]


def frame_rate(config, sample_rate: int) -> float:
    """Codec frames a second: Qwen3-Omni's code2wav (its total upsampling a frame), Qwen2.5-Omni's token2wav (the
    DiT's mel frames a code × BigVGAN's upsampling a mel frame)."""
    import math

    if hasattr(config, "code2wav_config"):
        code2wav = config.code2wav_config
        return sample_rate / (math.prod(code2wav.upsample_rates) * math.prod(code2wav.upsampling_ratios))
    token2wav = config.token2wav_config
    return sample_rate / (token2wav.dit_config.repeats * math.prod(token2wav.bigvgan_config.upsample_rates))


def median_s(fn, repeats: int) -> float:
    times = sorted(repeat_times(fn, repeats))
    return times[len(times) // 2]


def logits(decoder, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """The thinker's logits as the engine computes them: its int8 head where the decoder has one."""
    from omnimtp.runtime.ops import linear

    if decoder.quantized_lm_head is not None:
        return linear(hidden, None, packed=decoder.quantized_lm_head)
    return torch.nn.functional.linear(hidden, lm_head)


def step_bytes(decoder, lm_head: torch.Tensor, kv_length: int) -> int:
    """Bytes a one-row step of the quantized thinker reads (see the module docstring)."""
    head = decoder.quantized_lm_head
    total = (lm_head.numel() * lm_head.element_size() if head is None
             else head.packed.numel() + head.scales.numel() * 4)
    for layer, quantized in zip(decoder.layers, decoder.quantized_layers, strict=True):
        total += sum(t.numel() * t.element_size() for q in quantized if q is not None for t in (q.packed, q.scales))
        if layer.router is not None:
            total += layer.router_row_kernel.numel() * 4
            gate_up, down = layer.quantized_experts
            total += layer.router.top_k * sum(t[0].numel() * t.element_size() for q in (gate_up, down)
                                              for t in (q.packed, q.scales))
        total += 2 * decoder.num_kv_heads * decoder.head_dim * kv_length * decoder.dtype.itemsize
    return total


def thinker_figures(pipe, args, read_gb_s: float) -> dict:
    from omnimtp.packed_decoder import KVCache, decoder_forward

    decoder = pipe.family.thinker_decoder
    thinker = pipe.model.thinker
    embed = pipe.model.get_submodule(pipe.family.decoder_paths[0]).embed_tokens.weight
    lm_head = thinker.lm_head.weight
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, embed.shape[0], (args.prompt,), generator=generator)
    embeds = embed[prompt].to(decoder.dtype)[None]  # [1, P, H]
    cache = KVCache(decoder, 4, args.prompt + 16)
    empty = cache.snapshot()

    def prefill():
        cache.restore(empty)
        return logits(decoder, decoder_forward(decoder, cache, embeds, [0]).last_hidden, lm_head)

    figures = {"prefill_ms": 1e3 * median_s(prefill, 3)}
    cache.restore(empty)
    decoder_forward(decoder, cache, embeds.expand(4, -1, -1).contiguous(), [0, 1, 2, 3])
    prompt_done = cache.snapshot()
    tokens = [embed[torch.randint(0, embed.shape[0], (4, k), generator=generator)].to(decoder.dtype)
              for k in (1, 2, 3, 4)]

    def step(rows: int, positions: int):
        def run():
            hidden = decoder_forward(decoder, cache, tokens[positions - 1][:rows], list(range(rows)),
                                     all_final=positions > 1)
            cache.restore(prompt_done)
            return logits(decoder, hidden.final if positions > 1 else hidden.last_hidden[:, None], lm_head)
        return run

    one = median_s(step(1, 1), args.repeats)
    four = median_s(step(4, 1), args.repeats)
    figures.update(step_ms_batch_1=1e3 * one, step_ms_batch_4=1e3 * four, tokens_per_s_batch_1=1 / one,
                   tokens_per_s_batch_4=4 / four)
    for k in (1, 2, 3):
        figures[f"verify_k{k}_ms"] = 1e3 * median_s(step(1, k + 1), args.repeats)
        figures[f"verify_k{k}_vs_step"] = figures[f"verify_k{k}_ms"] / figures["step_ms_batch_1"]
    floor_s = step_bytes(decoder, lm_head, args.prompt) / (read_gb_s * 1e9)
    figures.update(floor_step_ms=1e3 * floor_s, floor_tokens_per_s=1 / floor_s,
                   step_bytes_gb=step_bytes(decoder, lm_head, args.prompt) / 1e9)
    return figures


def io_counters() -> dict:
    """The process's page faults (all threads: major ones read from storage, minor ones map a page already in
    memory) and bytes it made the kernel read from storage (/proc/self/io read_bytes: page-ins of mapped weights
    count), with a clock."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/io") as f:
        read_bytes = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    return {"s": time.perf_counter(), "major_faults": usage.ru_majflt, "minor_faults": usage.ru_minflt,
            "read_bytes": read_bytes}


def counted(since: dict) -> dict:
    now = io_counters()
    return {name: now[name] - since[name] for name in now}


SPEECH_STAGES = ("thinker_prefill", "thinker_decode", "talker_prefill", "talker", "code_predictor", "code2wav")
COUNTS = ("s", "major_faults", "minor_faults", "read_bytes")


class StageCounters(PhaseClock):
    """PhaseClock that also adds up, per stage of one reply, its seconds, page faults and bytes read, split at the
    step that gives the first audio ("to_first_audio" holds that step): the engine's phases (the first step's
    "think" is the thinker's prefill, "talker_admit" the talker's prefill, "talk" the talker's steps), with the code
    predictor's runs and code2wav's calls counted apart wherever they run (`counted_calls`)."""

    def __init__(self):
        super().__init__()
        self.stages = {part: {stage: dict.fromkeys(COUNTS, 0) for stage in SPEECH_STAGES}
                       for part in ("to_first_audio", "after_first_audio")}
        self.part = "to_first_audio"
        self.num_think_phases = 0
        self._since = io_counters()
        self._inner = {stage: dict.fromkeys(COUNTS, 0) for stage in ("code_predictor", "code2wav")}

    def phase(self, phase: str, seconds: float) -> None:
        super().phase(phase, seconds)
        delta = counted(self._since)
        self._since = io_counters()
        if phase == "think":
            self.num_think_phases += 1
            stage = "thinker_prefill" if self.num_think_phases == 1 else "thinker_decode"
        else:
            stage = {"talker_admit": "talker_prefill", "talk": "talker", "code2wav": "code2wav"}[phase]
        for inner, counts in self._inner.items():  # counted apart: out of this phase's residual
            self._add(inner, counts)
            delta = {name: value - counts[name] for name, value in delta.items()}
            self._inner[inner] = dict.fromkeys(COUNTS, 0)
        self._add(stage, delta)

    def inner_call(self, stage: str, since: dict) -> None:
        for name, value in counted(since).items():
            self._inner[stage][name] += value

    def first_audio_step_done(self) -> None:
        self.part = "after_first_audio"

    def _add(self, stage: str, delta: dict) -> None:
        for name, value in delta.items():
            self.stages[self.part][stage][name] += value


@contextlib.contextmanager
def counted_calls(pipe, clock: StageCounters):
    """While inside, the family's code predictor runs (where it has one) and its codec's decodes are counted into
    `clock` (instance attributes, removed on the way out)."""
    wrapped = [(pipe.family, "decode_audio", "code2wav")]
    if hasattr(pipe.family, "predictor"):
        wrapped.append((pipe.family.predictor(pipe.config.max_batch_size), "run", "code_predictor"))

    def counting(call, stage):
        def counted_call(*args, **kwargs):
            since = io_counters()
            try:
                return call(*args, **kwargs)
            finally:
                clock.inner_call(stage, since)
        return counted_call

    for owner, name, stage in wrapped:
        setattr(owner, name, counting(getattr(owner, name), stage))
    try:
        yield
    finally:
        for owner, name, _ in wrapped:
            delattr(owner, name)


def warm_up_ids(pipe) -> list[int]:
    """The warm-up reply's prompt: a chat turn of 8 random tokens, other than the measured prompt's (what the
    server's warm-up greeting is in the tokenizer's chat template; these checkpoints have no tokenizer)."""
    config = pipe.model.config
    vocab = config.thinker_config.text_config.vocab_size
    generator = torch.Generator().manual_seed(3)
    body = torch.randint(min(1000, vocab // 4), min(100_000, vocab), (8,), generator=generator)
    return chat_ids(config, body.tolist())


def speech_figures(pipe, args) -> dict:
    from omnimtp.engine.core import EngineCore
    from omnimtp.engine.request import Request

    config = pipe.model.config
    generator = torch.Generator().manual_seed(2)
    vocab = config.thinker_config.text_config.vocab_size
    body = torch.randint(min(1000, vocab // 4), min(100_000, vocab), (args.prompt,), generator=generator).tolist()
    frames = args.frames or round(args.seconds * frame_rate(config, pipe.family.sample_rate))
    request = Request(0, chat_ids(config, body), max_new_tokens=args.think_tokens, max_frames=frames,
                      speaker=pipe.family.default_speaker)
    clock = StageCounters()
    core = EngineCore(pipe.family, pipe.config, observer=clock)
    core.add(request)
    first_audio = None
    started = time.perf_counter()
    with counted_calls(pipe, clock):
        while core.has_work():
            for event in core.step():
                if event.audio is not None and len(event.audio):
                    first_audio = first_audio or time.perf_counter() - started
                if event.is_finished:
                    output = core.output(event.request)
            if first_audio is not None:
                clock.first_audio_step_done()
    wall = time.perf_counter() - started
    audio_s = len(output.audio) / pipe.family.sample_rate
    steps = max(clock.num_frame_steps, 1)
    stages = clock.stages

    def frame_ms(stage: str) -> float:
        return 1e3 * sum(stages[part][stage]["s"] for part in stages) / steps

    has_predictor = hasattr(pipe.family, "predictor")  # Qwen3-Omni's code predictor; Qwen2.5-Omni has none
    ms_per_frame = {"talker": frame_ms("talker")}
    if has_predictor:
        ms_per_frame["code_predictor"] = frame_ms("code_predictor")
    ms_per_frame["code2wav" if has_predictor else "token2wav"] = frame_ms("code2wav")
    if not has_predictor:
        for part in stages.values():
            del part["code_predictor"]
    return {
        "first_audio_s": first_audio, "wall_s": wall, "audio_s": audio_s, "rtf": wall / audio_s,
        "frames": int(output.codes.shape[-1]), "think_tokens": len(output.text_ids),
        "frame_ms_of_audio": 1e3 / frame_rate(config, pipe.family.sample_rate), "ms_per_frame": ms_per_frame,
        "thinker_s": clock.phases["think"], "stages": stages,
    }


def measure(path: str, args) -> dict:
    from omnimtp import OmniPipeline

    torch.set_num_threads(args.threads)
    floors = machine_floors(args.threads, args.quick)
    since = io_counters()
    pipe = OmniPipeline.from_pretrained(path, codec_dtype=args.codec_dtype, max_batch_size=4,
                                        torch_threads=args.threads, prefetch=not args.no_warm_up)
    load = counted(since)
    result = {"load_s": load.pop("s"), "load_counts": load, "rss_after_load_gb": peak_rss_gb(), "floors": floors}
    if not args.no_warm_up:
        since = io_counters()
        result["warm_up"] = pipe.warm_up(warm_up_ids(pipe))
        counts = counted(since)
        result.update(warm_up_s=counts.pop("s"), warm_up_counts=counts)
    with torch.inference_mode():
        # the first reply after loading, as a server's first request (after its warm-up, unless --no-warm-up)
        result["speech"] = speech_figures(pipe, args)
        result["thinker"] = thinker_figures(pipe, args, floors["read_gb_s"])
        result["speech_again"] = speech_figures(pipe, args)  # the same reply once more
    result["peak_rss_gb"] = peak_rss_gb()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Qwen3-Omni or Qwen2.5-Omni config.json")
    parser.add_argument("--quantize", default="w4a8", choices=QUANTIZE_MODES)
    parser.add_argument("--codec-dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--think-tokens", type=int, default=24, help="thinker tokens of the spoken reply")
    parser.add_argument("--frames", type=int, default=None, help="frames spoken (default: --seconds of audio)")
    parser.add_argument("--seconds", type=float, default=6.0, help="audio spoken when --frames is not given")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "omnimtp-bench"))
    parser.add_argument("--build-only", default=None, metavar="DIR", help="write the checkpoint into DIR and stop")
    parser.add_argument("--quick", action="store_true", help="the tiny model of --config's family, short runs")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="no prefetch of the mapped weights and no warm-up reply before the first reply")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the fresh process's side
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.prompt, args.think_tokens, args.frames, args.repeats = 16, 4, args.frames or 8, 3
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args)))
        return
    torch.set_num_threads(args.threads)
    config = json.loads(Path(args.config).read_text())
    name = Path(args.config).stem
    if args.quick:
        config, name = quick_config(config.get("model_type")), f"quick-{config.get('model_type')}"
    path = Path(args.build_only) if args.build_only else Path(args.cache_dir) / f"{name}-{args.quantize}-{args.seed}"
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": name, "quantize": args.quantize,
               "codec_dtype": args.codec_dtype, "threads": args.threads, "torch": torch.__version__,
               "machine": platform.processor() or platform.machine(), "isa": torch.backends.cpu.get_cpu_capability(),
               "checkpoint": str(path)}
    if not (path / "config.json").is_file():
        with contextlib.suppress(FileNotFoundError):
            path.rmdir()  # an empty leftover of an interrupted build
        results["build"] = build(config, path, args.quantize, args.seed)
        print(f"built {path}: {results['build']['bytes'] / 1e9:.2f} GB in {results['build']['build_s']:.0f} s, "
              f"peak RSS {results['build']['build_peak_rss_gb']:.2f} GB", flush=True)
    if args.build_only:
        return
    command = [sys.executable, __file__, "--measure", str(path), "--threads", str(args.threads), "--prompt",
               str(args.prompt), "--think-tokens", str(args.think_tokens), "--seconds", str(args.seconds),
               "--repeats", str(args.repeats)] + (["--quick"] if args.quick else []) \
        + (["--no-warm-up"] if args.no_warm_up else [])
    if args.frames:
        command += ["--frames", str(args.frames)]
    if args.codec_dtype:
        command += ["--codec-dtype", args.codec_dtype]
    process = subprocess.run(command, capture_output=True, text=True)
    if process.returncode != 0:
        sys.exit(f"the measuring process failed:\n{process.stderr[-3000:]}")
    results.update(json.loads(process.stdout.strip().splitlines()[-1]))
    t, s = results["thinker"], results["speech"]
    print(f"load {results['load_s']:.1f} s, RSS after load {results['rss_after_load_gb']:.2f} GB, peak "
          f"{results['peak_rss_gb']:.2f} GB; read {results['floors']['read_gb_s']:.1f} GB/s")
    if "warm_up" in results:
        w, prefetched = results["warm_up"], results["warm_up"]["prefetch"]
        print(f"warm-up {results['warm_up_s']:.1f} s after loading ("
              + ("no prefetch" if prefetched is None else
                 f"prefetch of {prefetched['bytes'] / 1e9:.2f} GB mapped, then "
                 + (f"{prefetched['if_room_bytes'] / 1e9:.2f} GB of routed experts into the page cache"
                    if prefetched["if_room_read"] else "no routed experts (no room)")
                 + f" in {prefetched['s']:.1f} s")
              + f", warm-up reply {w['reply_s']:.1f} s; {results['warm_up_counts']['read_bytes'] / 1e9:.2f} GB read "
              "from storage meanwhile)")
    print(f"thinker: prefill {args.prompt} tokens {t['prefill_ms']:.0f} ms; {t['tokens_per_s_batch_1']:.1f} tokens/s "
          f"at batch 1 (floor {t['floor_tokens_per_s']:.1f}: {t['step_bytes_gb']:.2f} GB a step), "
          f"{t['tokens_per_s_batch_4']:.1f} at batch 4; verify k = 1, 2, 3: "
          + ", ".join(f"{t[f'verify_k{k}_vs_step']:.2f}x" for k in (1, 2, 3)) + " a plain step")
    for label, s in (("speech", results["speech"]), ("speech again", results["speech_again"])):
        print(f"{label}: first audio {s['first_audio_s']:.2f} s, RTF {s['rtf']:.2f} ({s['audio_s']:.1f} s of audio, "
              f"{s['frames']} frames); per frame " + ", ".join(f"{k} {v:.1f} ms" for k, v in s["ms_per_frame"].items()))
    print_stages(results["speech"], results["speech_again"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def print_stages(first: dict, again: dict) -> None:
    """The first reply's stages next to the same reply's again: ms, major / minor page faults, MB read."""
    print("stage (to first audio | after it): first reply vs again - ms, major/minor page faults, MB read")
    for stage in first["stages"]["to_first_audio"]:
        cells = []
        for reply in (first, again):
            for part in ("to_first_audio", "after_first_audio"):
                c = reply["stages"][part][stage]
                cells.append(f"{1e3 * c['s']:7.0f} ms {c['major_faults']:6d}/{c['minor_faults']:7d} "
                             f"{c['read_bytes'] / 1e6:6.0f} MB")
        print(f"  {stage:15s} first {cells[0]} | {cells[1]}\n  {'':15s} again {cells[2]} | {cells[3]}")


if __name__ == "__main__":
    main()
