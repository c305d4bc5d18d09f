"""`omnimtp speak` and `omnimtp chat`: text (and for speak audio and images) in, the answer as text and 24 kHz
speech out.

    omnimtp speak "Hello" -o answer.wav
    omnimtp speak --audio question.wav --image photo.png "What do you hear and see?" -o answer.wav
    omnimtp speak --model Qwen3-TTS-12Hz-0.6B-CustomVoice "Hello" --voice aiden --language english -o hello.wav
    omnimtp speak --model Qwen3-TTS-12Hz-1.7B-VoiceDesign "Hello" --instructions "a calm low voice" -o hello.wav
    omnimtp speak --model Qwen3-TTS-12Hz-0.6B-Base "Hello" --voice me.safetensors -o hello.wav  # `omnimtp voice create`
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from omnimtp.argtypes import add_quantize_argument, add_reply_caps, add_threads_argument, draft_tokens
from omnimtp.checkpoint import TINY_MODELS, omni_model_type, random_weights_note
from omnimtp.console import printable


def add_parser(subparsers) -> None:
    speak = subparsers.add_parser("speak", help="answer a prompt with text and speech, write the audio file")
    speak.add_argument("text", nargs="?", default=None, help="what to say to the model (optional with --audio/--image)")
    speak.add_argument("-o", "--output", required=True,
                       help="audio file to write, its format by extension: .wav, .flac, .mp3, .opus or .ogg (Ogg "
                       "Opus), .aac")
    speak.add_argument("--audio", action="append", default=[], metavar="FILE",
                       help="an audio file the model hears before the text (repeatable; wav, flac, mp3, ogg, ...)")
    speak.add_argument("--image", action="append", default=[], metavar="FILE",
                       help="an image the model sees before the text (repeatable; png, jpeg, webp, gif)")
    _add_common(speak)
    speak.add_argument("--stream", action="store_true",
                       help="print the text as it is written; the summary counts the audio chunks as they arrived "
                       "and the time to the first")
    speak.add_argument("--voice", default=None, help="the voice: a speaker of the model (case-insensitive), or for a "
                       "Qwen3-TTS Base model a voice file from `omnimtp voice create` (--speaker is its older name)")
    speak.add_argument("--language", default=None, help="Qwen3-TTS: the language to speak (default: auto)")
    speak.add_argument("--instructions", default=None,
                       help="Qwen3-TTS: the voice described in words (VoiceDesign; CustomVoice 1.7B: the style)")
    speak.set_defaults(handler=run_speak)
    chat = subparsers.add_parser("chat", help="interactive chat; each answer is spoken into a numbered WAV file")
    _add_common(chat)
    chat.add_argument("--out-dir", default=".", help="where answer_N.wav files go (made if missing)")
    chat.set_defaults(handler=run_chat)


def _add_common(parser) -> None:
    parser.add_argument("--model", default=None, help="Qwen3-Omni, Qwen2.5-Omni or Qwen3-TTS checkpoint directory, "
                        f"or a built-in tiny model: {', '.join(TINY_MODELS)} (default: embedded tiny model)")
    parser.add_argument("--speaker", default=None, help="voice name, case-insensitive (default: the model's, "
                        "Ethan where it has one); for speak, the same as --voice (deprecated there: use --voice)")
    parser.add_argument("--seed", type=int, default=None, help="sample with this seed (default: greedy)")
    add_reply_caps(parser)
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N (default cpu)")
    add_threads_argument(parser)
    add_quantize_argument(parser)
    add_thinker_mtp_arguments(parser)


def add_thinker_mtp_arguments(parser) -> None:
    """--thinker-mtp DIR -k K and --demo: speculative thinker steps (speak, chat, serve)."""
    parser.add_argument("--demo", action="store_true",
                        help="the shipped demo Qwen3-Omni instead of --model: a trained byte-level thinker (Python "
                        "code) with its trained MTP head, speculative by default (its head, -k 3); random talker")
    parser.add_argument("--thinker-mtp", default=None, metavar="DIR",
                        help="speculative thinker steps drafted by the MTP head stored in DIR (model-mtp.safetensors, "
                        "e.g. what `omnimtp train-mtp --model <omni dir>` wrote); greedy text stays token for token "
                        "the plain loop's")
    parser.add_argument("-k", "--num-draft-tokens", type=draft_tokens, default=None, metavar="K",
                        help="drafted thinker tokens per step with --thinker-mtp, or 'auto': 0..6 a step, as many as "
                        "the acceptance so far pays for at the current batch size (step costs measured per batch "
                        "size; serve measures them at start-up) (default 3)")


def _check_model_args(args) -> dict:
    """--model, --demo, --thinker-mtp and -k checked before anything heavy loads (ValueErrors name the
    flag) → `thinker_mtp_kwargs`."""
    speculation = thinker_mtp_kwargs(args)
    if args.model is not None and omni_model_type(args.model, "--model") == "qwen3_asr":
        raise ValueError(f"--model: {args.model!r} is a Qwen3-ASR model: it hears and does not speak or chat; "
                         "use omnimtp transcribe")
    return speculation


def _load(args):
    speculation = _check_model_args(args)

    from omnimtp.pipeline import OmniPipeline
    from omnimtp.runtime.device import resolve_device

    resolve_device(args.device, "--device")
    # the thread rule's override and the weights' quantization (`OmniPipeline`)
    options = {"torch_threads": args.threads, "quantize": args.quantize, "codec_dtype": args.codec_dtype}
    if args.demo:
        return OmniPipeline.demo(device=args.device, **options, **speculation)
    if args.model is None:
        return OmniPipeline.tiny(device=args.device, **options, **speculation)
    return OmniPipeline.from_pretrained(args.model, device=args.device, **options, **speculation)


def thinker_mtp_kwargs(args) -> dict:
    """`OmniPipeline`'s thinker_mtp / num_draft_tokens from --thinker-mtp / -k (ValueErrors name the flags)."""
    thinker_mtp, num_draft_tokens = getattr(args, "thinker_mtp", None), getattr(args, "num_draft_tokens", None)
    if getattr(args, "demo", False):
        if getattr(args, "model", None) is not None:
            raise ValueError("--demo: give either --demo or --model")
        from omnimtp.mtp.demo import demo_omni_dir

        thinker_mtp = thinker_mtp or str(demo_omni_dir())
    if thinker_mtp is None and num_draft_tokens is not None:
        raise ValueError("-k/--num-draft-tokens: set only with --thinker-mtp")
    if num_draft_tokens is not None and num_draft_tokens != "auto" and num_draft_tokens < 1:
        raise ValueError(f"-k/--num-draft-tokens must be >= 1 or 'auto', got {num_draft_tokens}")
    return dict(thinker_mtp=thinker_mtp, num_draft_tokens=num_draft_tokens)


def _sampling(pipe, args) -> dict:
    if args.seed is None:
        return {}
    from omnimtp.sampling import QWEN3_OMNI_THINKER_SAMPLING as thinker

    return dict(thinker_sampling=thinker, talker_sampling=pipe.family.sampled_talker(thinker), seed=args.seed)


def _speak(pipe, messages, args, output: str, live: bool):
    import numpy as np
    from tqdm import tqdm

    from omnimtp.server.audio import write_audio

    kwargs = dict(speaker=args.speaker, max_new_tokens=args.max_new_tokens, max_frames=args.max_frames,
                  **_sampling(pipe, args))
    start = time.perf_counter()
    first_audio = None
    chunks, final = [], None
    max_frames = args.max_frames or pipe.default_max_frames
    with tqdm(total=max_frames, unit="frame", desc="speech", disable=live or None, file=sys.stderr, leave=False) as bar:
        for event in pipe.stream(messages, **kwargs):
            if live and event.text:
                print(printable(event.text), end="", flush=True)
            if event.audio is not None:
                if first_audio is None:
                    first_audio = time.perf_counter() - start
                chunks.append(event.audio)
                bar.update(round((len(event.audio) + (555 if len(chunks) == 1 else 0)) / 1920))
            if event.output is not None:
                final = event.output
    elapsed = time.perf_counter() - start
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    write_audio(output, audio, final.sample_rate)
    seconds = len(audio) / final.sample_rate
    print("" if live else printable(final.text))
    first = f"{first_audio:.2f} s" if first_audio is not None else "n/a"
    rtf = f"{elapsed / seconds:.2f}" if seconds else "n/a"
    print(f"[{output}: {seconds:.2f} s of audio in {len(chunks)} chunks, {final.codes.shape[1]} frames, "
          f"finish={final.finish_reason}; time to first audio {first}, total {elapsed:.2f} s, RTF {rtf}]",
          file=sys.stderr)
    if final.spec_stats is not None:
        from omnimtp.spec_decode.adaptive import acceptance_warning

        stats = final.spec_stats
        k = (f"auto (steps per k: {dict(sorted(stats.draft_histogram.items()))})" if stats.is_adaptive
             else stats.num_draft_tokens)
        print(f"[thinker speculation: k={k}, τ {stats.mean_acceptance_length:.2f}, accepted "
              f"{stats.num_accepted}/{stats.num_drafted} drafts]", file=sys.stderr)
        warning = acceptance_warning(stats)
        if warning is not None:
            print(warning, file=sys.stderr)
    return final


def run_speak(args: argparse.Namespace) -> int:
    from omnimtp.server.audio import format_of_path

    try:
        format_of_path(args.output, "--output")
        _check_model_args(args)
        prompt = _speak_prompt(args.text, args.audio, args.image)  # media is read before the model loads
        pipe = _load(args)
        if not pipe.family.has_chat:
            _say(pipe, prompt, args)
        else:
            for flag in ("language", "instructions"):
                if getattr(args, flag) is not None:
                    raise ValueError(f"--{flag}: only a Qwen3-TTS model takes it")
            if args.voice is not None:
                args.speaker = args.speaker or args.voice
            _speak(pipe, prompt, args, args.output, live=args.stream)
    except ValueError as exc:
        return _refuse(str(exc))
    _note_random_weights(args)  # after the output it explains; an error comes alone
    return 0


def _note_random_weights(args) -> None:
    note = None if args.demo else random_weights_note(args.model)
    if note is not None:
        print(note, file=sys.stderr)


def _say(pipe, text, args) -> None:
    """A Qwen3-TTS model speaks the text itself (it has no chat) into args.output."""
    import numpy as np

    from omnimtp.families.qwen3_tts import QWEN3_TTS_SAMPLING
    from omnimtp.server.audio import write_audio

    if not isinstance(text, str):
        raise ValueError("--audio/--image: a Qwen3-TTS model speaks text; it takes no media")
    if args.speaker is not None and args.voice is not None:
        raise ValueError("--speaker: give --voice or --speaker, not both")
    voice = args.voice or args.speaker
    if pipe.family.tts_model_type == "base" and voice is not None:
        from omnimtp.voice import Voice

        try:
            voice = Voice.load(voice)
        except ValueError as exc:
            raise ValueError(f"--voice: {exc}") from None
    start = time.perf_counter()
    first_audio, chunks, final = None, [], None
    for item in pipe.stream_speech(text, voice=voice, language=args.language,
                                   instructions=args.instructions,
                                   sampling=None if args.seed is None else QWEN3_TTS_SAMPLING,
                                   seed=args.seed, max_frames=args.max_frames):
        if isinstance(item, np.ndarray):
            first_audio = first_audio or time.perf_counter() - start
            chunks.append(item)
        else:
            final = item
    elapsed = time.perf_counter() - start
    audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    write_audio(args.output, audio, final.sample_rate)
    seconds = len(audio) / final.sample_rate
    first = f"{first_audio:.2f} s" if first_audio is not None else "n/a"
    print(f"[{args.output}: {seconds:.2f} s of audio, {final.codes.shape[1]} frames, finish={final.finish_reason}; "
          f"time to first audio {first}, total {elapsed:.2f} s]", file=sys.stderr)


def _speak_prompt(text: str | None, audio_files: list[str], image_files: list[str]):
    """The text alone, or one user turn: the audio and image parts (decoded here), then the text."""
    if not text and not audio_files and not image_files:
        raise ValueError("give the text to say, or --audio / --image")
    if not audio_files and not image_files:
        return text
    from omnimtp.media import AUDIO_SAMPLING_RATE, load_audio, load_image

    parts = [{"type": "audio", "audio": (load_audio(path, AUDIO_SAMPLING_RATE, param=f"--audio {path}"),
                                         AUDIO_SAMPLING_RATE)} for path in audio_files]
    parts += [{"type": "image", "image": load_image(path, param=f"--image {path}")} for path in image_files]
    if text:
        parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def _refuse(message: str, command: str = "speak") -> int:
    print(f"omnimtp {command}: error: {message}", file=sys.stderr)
    return 2


def run_chat(args: argparse.Namespace) -> int:
    try:
        os.makedirs(args.out_dir, exist_ok=True)  # before the model loads: a bad path fails at once
    except OSError as exc:
        return _refuse(f"--out-dir: cannot create {args.out_dir!r} ({exc.strerror})", "chat")
    try:
        pipe = _load(args)
    except ValueError as exc:
        return _refuse(str(exc), "chat")
    if not pipe.family.has_chat:
        return _refuse("--model: a Qwen3-TTS model has no chat; use omnimtp speak")
    _note_random_weights(args)
    messages = []
    turn = 0
    print("omnimtp chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        turn += 1
        output = os.path.join(args.out_dir, f"answer_{turn}.wav")
        print("omni> ", end="", flush=True)
        final = _speak(pipe, [list(messages)], args, output, live=True)
        messages.append({"role": "assistant", "content": final.text})
    return 0
