"""`omnimtp transcribe`: the words spoken in audio files, heard by the omni model's thinker (no talker) or by a
Qwen3-ASR model.

    omnimtp transcribe question.wav                        # the text, one line per file
    omnimtp transcribe --model Qwen3-Omni-30B-A3B-Instruct --language en a.wav b.flac --json
    omnimtp transcribe --model Qwen3-ASR-0.6B a.wav        # the language: the one the model names
    omnimtp transcribe --model Qwen3-ASR-0.6B --quantize w4a8 --int8-compute --kv-dtype bfloat16 long.wav  # fastest
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from omnimtp.argtypes import (
    QUANTIZE_CHOICES,
    add_int8_compute_argument,
    add_kv_dtype_argument,
    add_threads_argument,
    positive_int,
)
from omnimtp.checkpoint import omni_model_type, random_weights_note
from omnimtp.console import printable


def add_parser(subparsers) -> None:
    transcribe = subparsers.add_parser("transcribe", help="write down what audio files say (Qwen3-ASR, or "
                                       "a Qwen3-Omni / Qwen2.5-Omni thinker)")
    transcribe.add_argument("files", nargs="+", metavar="FILE", help="audio files (wav, flac, mp3, ogg, ...)")
    transcribe.add_argument("--model", default=None, help="Qwen3-ASR, Qwen3-Omni or Qwen2.5-Omni checkpoint "
                            "directory, or tiny-asr (default: embedded tiny model)")
    transcribe.add_argument("--language", default=None, help="the spoken language: en, zh, de, ... (a hint to an "
                            "omni model, forced on Qwen3-ASR; default: the model finds it)")
    transcribe.add_argument("--prompt", default=None, help="context: earlier words, names and their spelling")
    transcribe.add_argument("--seed", type=int, default=None, help="sample with this seed (default: greedy)")
    transcribe.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                            help="cap on each transcript's tokens (default: the model's reply cap)")
    transcribe.add_argument("--json", action="store_true",
                            help="one JSON object per file (file, text, language, duration, segments)")
    transcribe.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N (default cpu)")
    transcribe.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                            help="quantized linears on the CPU (docs/quantization.md): int8, int4, or w4a8, the "
                            "fastest and the least exact (default: the weights as they are)")
    add_int8_compute_argument(transcribe)
    add_kv_dtype_argument(transcribe)
    add_threads_argument(transcribe)
    transcribe.set_defaults(handler=run_transcribe)


def run_transcribe(args: argparse.Namespace) -> int:
    model_type = None if args.model is None else omni_model_type(args.model, "--model")
    if model_type == "qwen3_tts":
        raise ValueError(f"--model: {args.model!r} is a Qwen3-TTS model; it speaks but does not hear")
    for flag, given in (("--int8-compute", args.int8_compute), ("--kv-dtype", args.kv_dtype == "bfloat16")):
        if given and model_type != "qwen3_asr":
            raise ValueError(f"{flag}: for a Qwen3-ASR model (--model), not an omni model's thinker")
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.sampling import SamplingParams

    options = {"quantize": args.quantize, "torch_threads": args.threads}
    if args.int8_compute:
        options["int8_compute"] = True
    if args.kv_dtype == "bfloat16":
        options["kv_dtype"] = "bfloat16"
    pipe = OmniPipeline.tiny(device=args.device, **options) if args.model is None else OmniPipeline.from_pretrained(
        args.model, device=args.device, **options)
    sampling = None if args.seed is None else SamplingParams(temperature=1.0)
    for path in args.files:
        try:
            result = pipe.transcribe(path, language=args.language, prompt=args.prompt, sampling=sampling,
                                     seed=args.seed, max_new_tokens=args.max_new_tokens)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        if args.json:
            print(json.dumps({"file": path, **dataclasses.asdict(result)}, ensure_ascii=False))
        else:
            print(printable(result.text))
        sys.stdout.flush()
    note = random_weights_note(args.model, transcribes=True)  # after the transcripts it explains
    if note is not None:
        print(note, file=sys.stderr)
    return 0
