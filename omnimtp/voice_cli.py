"""`omnimtp voice create`: a cloned voice of a Qwen3-TTS Base model from a reference recording, saved to a file
that `omnimtp speak --voice FILE` (and `Voice.load`) reads.

    omnimtp voice create --model Qwen3-TTS-12Hz-0.6B-Base --audio ref.wav --text "What it says." -o me.safetensors
    omnimtp speak --model Qwen3-TTS-12Hz-0.6B-Base --voice me.safetensors "Hello there" -o hello.wav
"""

from __future__ import annotations

import argparse
import sys

from omnimtp.checkpoint import omni_model_type


def add_parser(subparsers) -> None:
    voice = subparsers.add_parser("voice", help="cloned voices of a Qwen3-TTS Base model")
    actions = voice.add_subparsers(dest="voice_command", required=True, help="what to do with voices",
                                   parser_class=type(voice))
    create = actions.add_parser("create", help="clone the voice of a reference recording into a voice file")
    create.add_argument("--model", required=True, help="the Qwen3-TTS Base checkpoint directory (or tiny-tts-base)")
    create.add_argument("--audio", required=True, metavar="FILE",
                        help="the reference recording (wav, flac, mp3, ...; 1 to 60 s, one speaker)")
    create.add_argument("--text", default=None,
                        help="what the recording says: with it the voice is cloned in context (its codes and "
                        "transcript lead each request); without it, from the speaker embedding alone")
    create.add_argument("--x-vector-only", action="store_true",
                        help="clone from the speaker embedding alone, even with --text")
    create.add_argument("-o", "--output", required=True, help="the voice file to write (.safetensors)")
    create.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N (default cpu)")
    create.set_defaults(handler=run_create)


def run_create(args: argparse.Namespace) -> int:
    if not args.output.endswith(".safetensors"):
        raise ValueError(f"--output must end in .safetensors, got {args.output!r}")
    omni_model_type(args.model, "--model")
    from omnimtp.pipeline import OmniPipeline

    pipe = OmniPipeline.from_pretrained(args.model, device=args.device)
    if getattr(pipe.family, "tts_model_type", None) != "base":
        raise ValueError(f"--model: {args.model!r} is not a Qwen3-TTS Base model; only a Base model clones voices")
    try:
        voice = pipe.create_voice(args.audio, args.text, x_vector_only=args.x_vector_only)
    except ValueError as exc:
        raise ValueError(f"--audio {args.audio}: {exc}" if str(exc).startswith("ref_audio") else str(exc)) from None
    voice.save(args.output)
    frames = "" if voice.ref_codes is None else f", {voice.ref_codes.shape[1]} reference frames"
    kind = {"icl": "an in-context (icl)", "x_vector": "an x-vector"}[voice.mode]
    print(f"[{args.output}: {kind} voice from {voice.seconds:.2f} s of audio{frames}]", file=sys.stderr)
    return 0
