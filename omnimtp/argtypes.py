"""What the subcommands' parsers share: `type=` converters (a bad value is argparse's own usage error, exit
code 2, naming the flag, never a traceback) and the help formatter that shows each flag's default.

Parsers import only this, argparse and other light modules: `omnimtp --help` and a usage error never
load torch or transformers."""

from __future__ import annotations

import argparse
import math

from omnimtp.limits import DEFAULT_MAX_FRAMES, DEFAULT_MAX_NEW_TOKENS, TINY_MAX_FRAMES, TINY_MAX_NEW_TOKENS


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def draft_tokens(text: str) -> int | str:
    """-k: a number of drafted tokens >= 1, or "auto" (adaptive drafting)."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}") from None


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, for the defaults worth showing: a flag whose help already speaks of
    its default, or whose default is None (unset: its help says what that means) or False (a switch), is
    left as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or action.default == []:
            return text
        return super()._get_help_string(action)


def add_reply_caps(parser: argparse.ArgumentParser) -> None:
    """--max-new-tokens and --max-frames: a reply's caps, defaulting to the model's (speak, chat, batch)."""
    parser.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                        help=f"cap on the thinker's reply tokens (default {TINY_MAX_NEW_TOKENS} tiny, "
                        f"{DEFAULT_MAX_NEW_TOKENS} checkpoint)")
    parser.add_argument("--max-frames", type=positive_int, default=None, metavar="N",
                        help=f"cap on audio frames, 12.5 per second, per segment of a long text (default "
                        f"{TINY_MAX_FRAMES} tiny, {DEFAULT_MAX_FRAMES} checkpoint)")


def add_threads_argument(parser) -> None:
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="torch's CPU threads (default: one for a small model such as the built-in tiny ones, "
                        "the cores for a real one)")


QUANTIZE_CHOICES = ("int8", "int4", "w4a8")  # `omnimtp.runtime.ops.QUANTIZE_MODES`, without importing torch to parse


def add_quantize_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="quantized linears on the CPU: int8 (per output channel) or int4 (per channel and "
                        "group of 128 inputs), weight-only, activations in float; or w4a8: int4 weights with the "
                        "activations rounded to int8 per row and group at run time, the fastest and the least "
                        "exact (default: the weights as they are)")
    parser.add_argument("--codec-dtype", choices=("float32", "bfloat16"), default=None,
                        help="the audio decoder of a Qwen3-Omni model (code2wav) or a Qwen3-TTS model (12 Hz "
                        "decoder): bfloat16 runs its conv stack in bf16, faster on a CPU with bf16 instructions "
                        "(AVX512_BF16) and less exact (docs/speech.md and docs/tts.md state by how much); not for "
                        "Qwen2.5-Omni (default: float32; a Qwen3-Omni checkpoint's own dtype)")


def add_int8_compute_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--int8-compute", action="store_true",
                        help="Qwen3-ASR and Qwen3-ForcedAligner: the layers that run many rows at a time (the audio "
                        "encoder, each prompt's prefill, the aligner's forward) on int8 GEMMs, about twice the bf16 "
                        "rate on a CPU with AVX512-VNNI (refused without it) and less exact (docs/quantization.md "
                        "states by how much); the decode steps keep --quantize's weights. Not with a checkpoint "
                        "`omnimtp quantize` wrote")


def add_kv_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", choices=("float32", "bfloat16"), default=None,
                        help="Qwen3-ASR with --quantize w4a8: the decoder's keys and values kept in bf16, so a decode "
                        "step reads half the cache's bytes (less exact: docs/asr.md states by how much; default "
                        "float32)")


def add_verbose_argument(parser) -> None:
    """--verbose: Ray's own INFO logs (serve --replicas, batch)."""
    parser.add_argument("--verbose", action="store_true",
                        help="Ray's own INFO logs too: its start-up, Serve's controller and proxy, every request a "
                        "replica serves (default: Ray's warnings and errors only)")
