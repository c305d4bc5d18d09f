"""`omnimtp serve`: the OpenAI-compatible speech server under uvicorn."""

from __future__ import annotations

import argparse
import os
import sys

from omnimtp.argtypes import (
    add_int8_compute_argument,
    add_kv_dtype_argument,
    add_quantize_argument,
    add_threads_argument,
    non_negative_float,
    positive_float,
    positive_int,
)
from omnimtp.checkpoint import TINY_MODELS, check_aligner_path, omni_model_type, random_weights_note
from omnimtp.console import stopped_by
from omnimtp.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
    DEFAULT_HEADERS_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_SESSION_BYTES,
    DEFAULT_MAX_SESSION_ITEMS,
    DEFAULT_MAX_TOKENS_LIMIT,
    DEFAULT_MAX_WEBSOCKET_SESSIONS,
    DEFAULT_SESSION_CACHE_MB,
    DEFAULT_TIMEOUT_TEXT_IDLE_S,
    DEFAULT_WEBSOCKET_IDLE_TIMEOUT_S,
    MAX_REF_AUDIO_SECONDS,
    MIN_REF_AUDIO_SECONDS,
    TINY_MAX_FRAMES,
    MediaLimits,
    check_api_key,
)
from omnimtp.server import ray_serve
from omnimtp.server.voice_store import DEFAULT_MAX_VOICES
from omnimtp.speak_cli import add_thinker_mtp_arguments, thinker_mtp_kwargs


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible chat, speech and realtime APIs",
        description="OpenAI-compatible speech server with continuous batching. Routes: POST /v1/chat/completions, "
        "POST /v1/audio/speech, POST /v1/audio/speech/batch, WebSocket /v1/audio/speech/stream, WebSocket "
        "/v1/realtime, POST /v1/audio/transcriptions, GET/POST/DELETE /v1/audio/voices (with --voices-dir), "
        "GET /v1/models, GET /health, GET /metrics, the web playground at /. Without --model it serves the "
        "embedded tiny model (random weights: noise-like speech).",
    )
    _add_arguments(parser)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve`'s flags, on its subcommand parser or on `app_builder`'s own."""
    parser.add_argument("--model", metavar="DIR",
                        help="a Qwen3-Omni, Qwen2.5-Omni or Qwen3-TTS checkpoint directory, or a built-in tiny model "
                        f"({', '.join(TINY_MODELS)}), served by its name (default: embedded tiny)")
    parser.add_argument("--served-model-name", metavar="NAME", action="append", default=[],
                        help="another name clients may give as `model` (repeatable); /v1/models lists them all. "
                        "Any other `model` gets 404 model_not_found")
    parser.add_argument("--openai-aliases", action=argparse.BooleanOptionalAction, default=True,
                        help="OpenAI's model names (gpt-realtime, gpt-4o-mini-transcribe, tts-1, ...) name the served "
                        "model, and OpenAI's voice names (alloy, marin, ...) its default speaker, so that clients "
                        "with OpenAI defaults work unchanged (default: on)")
    parser.add_argument("--voice-alias", metavar="NAME=SPEAKER", action="append", default=[],
                        help="another name of one of the model's speakers (repeatable; over OpenAI's defaults: "
                        "--voice-alias alloy=chelsie); /v1/audio/voices lists them")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--api-key", default=os.environ.get("OMNIMTP_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $OMNIMTP_API_KEY); "
                        "printable ASCII. An empty key is refused: unset the variable to serve without one")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N (default cpu)")
    add_threads_argument(parser)
    parser.add_argument("--max-batch-size", type=positive_int, default=16, metavar="N",
                        help="requests generating at once")
    parser.add_argument("--max-queue", type=positive_int, default=DEFAULT_MAX_QUEUE, metavar="N",
                        help="waiting requests before 429")
    parser.add_argument("--admission", choices=("capacity", "off"), default="capacity",
                        help="capacity (default): a new stream waits in the queue while starting it would push the "
                        "streams playing under real time (the engine's measured step costs); off: every request "
                        "takes a free slot at once")
    parser.add_argument("--max-frames", type=positive_int, default=None, metavar="N",
                        help=f"audio frames per request, per segment of a long text (default {TINY_MAX_FRAMES} tiny, "
                        f"{DEFAULT_MAX_FRAMES} checkpoint: 2 minutes of speech at 12.5 frames/s)")
    parser.add_argument("--eager", action="store_true",
                        help="never compile the code predictor (by default it serves eagerly at once while each "
                        "batch size's graph is compiled in the background, then runs compiled; a w4a8 predictor runs "
                        "omnimtp's native step, as fast, and compiles nothing)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="no warm-up at start: by default the memory-mapped weights every reply reads (a quantized "
                        "checkpoint's) are read in the background and one short spoken reply runs through every "
                        "stage, so the first user's request is as fast as the next (a request that comes meanwhile "
                        "is served at once and ends the warm-up reply)")
    parser.add_argument("--max-tokens-limit", type=positive_int, default=DEFAULT_MAX_TOKENS_LIMIT, metavar="N",
                        help="the largest max_tokens a request may ask")
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                        help="the largest request body (default %(default)d, 16 MiB; base64 media is 4/3 of its "
                        "size: raise it to accept longer audio or larger images)")
    parser.add_argument("--max-audio-seconds", type=positive_float, default=MediaLimits.max_audio_seconds, metavar="S",
                        help="the longest input audio part (default %(default)g)")
    parser.add_argument("--max-image-pixels", type=positive_int, default=MediaLimits.max_image_pixels, metavar="N",
                        help="the largest input image, width × height (default %(default)d)")
    parser.add_argument("--max-media-parts", type=positive_int, default=MediaLimits.max_parts, metavar="N",
                        help="input audio and image parts per request (default %(default)d)")
    parser.add_argument("--max-sessions", type=positive_int, default=DEFAULT_MAX_WEBSOCKET_SESSIONS, metavar="N",
                        help="open WebSocket sessions per route (/v1/realtime) before new ones are refused with 429 "
                        "(default %(default)d); a message may be as large as --max-body-bytes")
    parser.add_argument("--max-session-items", type=positive_int, default=DEFAULT_MAX_SESSION_ITEMS, metavar="N",
                        help="conversation items a /v1/realtime session holds (default %(default)d)")
    parser.add_argument("--max-session-bytes", type=positive_int, default=DEFAULT_MAX_SESSION_BYTES, metavar="N",
                        help="bytes of conversation content a /v1/realtime session holds in memory, audio as float32 "
                        "samples (default %(default)d)")
    parser.add_argument("--session-cache-mb", type=non_negative_float, default=DEFAULT_SESSION_CACHE_MB, metavar="MB",
                        help="memory (per process or replica) for the conversations of /v1/realtime sessions kept "
                        "warm between turns: the "
                        "thinker's KV of each session's last prompt, so a new turn prefills only its new part; the "
                        "least recently used session is evicted when it is full (its next turn prefills all), a "
                        "session's entry goes when it closes; 0 = off (default %(default)g)")
    parser.add_argument("--timeout-session-idle", type=positive_float, default=DEFAULT_WEBSOCKET_IDLE_TIMEOUT_S,
                        metavar="S", help="seconds a WebSocket session may pass without a message either way before "
                        "it is closed (default %(default)g)")
    parser.add_argument("--timeout-text-idle", type=positive_float, default=DEFAULT_TIMEOUT_TEXT_IDLE_S, metavar="S",
                        help="seconds a /v1/audio/speech/stream request may wait for more text (it holds no batch "
                        "slot meanwhile) before it ends with an error event timeout_text_idle (default %(default)g)")
    voices = parser.add_argument_group(
        "saved voices", "voices a Qwen3-TTS Base model clones, saved by POST /v1/audio/voices and spoken with "
        "/v1/audio/speech voice=NAME")
    voices.add_argument("--voices-dir", metavar="DIR",
                        help="keep saved voices in DIR/voices.sqlite3 (created if missing; they survive restarts). "
                        "Every process or Ray replica given the same DIR shares them: a local disk, or a shared "
                        "POSIX volume with working file locks (not NFS without locks). Default: no saved voices")
    voices.add_argument("--keep-voice-audio", action="store_true",
                        help="also keep each voice's reference recording as uploaded (by default only the speaker "
                        "embedding, reference codes and transcript are kept)")
    voices.add_argument("--max-voices", type=positive_int, default=DEFAULT_MAX_VOICES, metavar="N",
                        help="the most saved voices (default %(default)d); a POST beyond it gets 400 too_many_voices")
    voices.add_argument("--max-ref-seconds", type=positive_float, default=MAX_REF_AUDIO_SECONDS, metavar="S",
                        help=f"the longest reference recording a voice is cloned from (default %(default)g; the "
                        f"shortest is {MIN_REF_AUDIO_SECONDS:g})")
    parser.add_argument("--timeout-headers", type=positive_float, default=DEFAULT_HEADERS_TIMEOUT_S, metavar="S",
                        help="seconds a request's headers may take to arrive (default %(default)g)")
    parser.add_argument("--timeout-body", type=positive_float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                        help="seconds a request's body may take to arrive after its headers (default %(default)g)")
    parser.add_argument("--timeout-keep-alive", type=positive_float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S, metavar="S",
                        help="seconds an idle connection stays open (default %(default)g)")
    parser.add_argument("--timeout-graceful-shutdown", type=positive_float, default=DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S,
                        metavar="S", help="on SIGTERM, seconds running requests get to finish before they are "
                        "cancelled (default %(default)g)")
    parser.add_argument("--no-playground", dest="playground", action="store_false",
                        help="do not serve the web playground at / and /playground")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="uvicorn's and omnimtp's log level")
    parser.add_argument("--aligner-model", metavar="DIR", default=None,
                        help="a Qwen3-ForcedAligner checkpoint (or tiny-aligner) loaded beside the model: word "
                        "timestamps for /v1/audio/transcriptions (timestamp_granularities[]=word), /v1/audio/speech "
                        "and realtime spoken replies")
    parser.add_argument("--asr-model", metavar="DIR", default=None,
                        help="a Qwen3-ASR checkpoint (or tiny-asr) served beside the model: the realtime sessions' "
                        "input transcripts, and /v1/audio/transcriptions for its name and OpenAI's transcription "
                        "models' names, so the model's slots are not spent on hearing")
    add_quantize_argument(parser)
    add_int8_compute_argument(parser)
    add_kv_dtype_argument(parser)
    add_thinker_mtp_arguments(parser)
    ray_serve.add_arguments(parser)  # --replicas and the other Ray Serve flags (Ray is imported only to use them)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        thinker_mtp_kwargs(args)  # --demo with --model, -k without --thinker-mtp
        if not (ray_serve.is_requested(args) and args.ray_address is not None):  # (on a Ray cluster: the nodes')
            model_type = None if args.model is None else omni_model_type(args.model, "--model")
            if args.aligner_model is not None:
                check_aligner_path(args.aligner_model, "--aligner-model")
            if args.asr_model is not None and omni_model_type(args.asr_model, "--asr-model") != "qwen3_asr":
                return _refuse(f"--asr-model: {args.asr_model!r} is not a Qwen3-ASR checkpoint (nor tiny-asr)")
            if (getattr(args, "int8_compute", False) and model_type != "qwen3_asr" and args.asr_model is None
                    and args.aligner_model is None):
                return _refuse("--int8-compute: for a Qwen3-ASR model (--model or --asr-model) or an aligner "
                               "(--aligner-model); this server loads neither")
            if getattr(args, "kv_dtype", None) == "bfloat16" and model_type != "qwen3_asr" and args.asr_model is None:
                return _refuse("--kv-dtype: for a Qwen3-ASR model (--model or --asr-model); this server loads none")
    except ValueError as exc:
        return _refuse(str(exc))
    # Refuse before the model loads: an empty $OMNIMTP_API_KEY must not quietly turn auth off, and a
    # key no client can send (non-ASCII) must not quietly lock everyone out.
    if args.api_key == "":
        return _refuse("--api-key is empty (its default is $OMNIMTP_API_KEY): set a key, or unset "
                       "OMNIMTP_API_KEY to serve without one")
    try:
        check_api_key(args.api_key)
    except ValueError as exc:
        return _refuse(f"--api-key: {exc}")

    from omnimtp.runtime.device import resolve_device

    try:
        resolve_device(args.device, "--device")
    except ValueError as exc:
        return _refuse(str(exc))
    if args.max_ref_seconds < MIN_REF_AUDIO_SECONDS:
        return _refuse(
            f"--max-ref-seconds must be at least {MIN_REF_AUDIO_SECONDS:g} (the shortest reference recording)"
        )
    if args.voices_dir is not None and not (ray_serve.is_requested(args) and args.ray_address is not None):
        from omnimtp.server.voice_store import VoiceStore

        try:  # before the model loads (on a Ray cluster, the directory is the nodes')
            VoiceStore(args.voices_dir, max_voices=args.max_voices)
        except ValueError as exc:
            return _refuse(str(exc).replace("voices_dir:", "--voices-dir:", 1))

    if ray_serve.is_requested(args):
        return ray_serve.run(args)  # Ray Serve replicas (imports Ray)

    import uvicorn

    from omnimtp.server.serving import server_config

    _log_to_stderr(args.log_level)
    from omnimtp.runtime.device import build_in_passing_thread
    from omnimtp.server.build import build_app

    engine, app = build_in_passing_thread(lambda: build_app(args))  # the engine thread alone runs the model
    config = server_config(
        app, host=args.host, port=args.port, headers_timeout_s=args.timeout_headers,
        keep_alive_timeout_s=args.timeout_keep_alive, graceful_shutdown_timeout_s=args.timeout_graceful_shutdown,
        log_level=args.log_level,
    )
    print(banner(engine, f"http://{args.host}:{args.port}", playground=args.playground), flush=True)
    note = None if args.demo else random_weights_note(args.model)
    if note is not None:
        print(note, flush=True)
    code = 0
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt as exc:  # uvicorn re-raises the signal it stopped on, once it has stopped
        signum = stopped_by(exc)
        print(f"omnimtp serve: stopped ({signum.name})", file=sys.stderr, flush=True)
        code = 128 + signum
    # The server has stopped and its engine with it: leave at once. Interpreter exit joins worker
    # threads (torch's compile threads while the predictor still compiles, the event loop's executor),
    # which can take longer than the graceful deadline promised.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def banner(engine, url: str, *, playground: bool) -> str:
    """What `serve` prints once the engine is built: the model, its API's URL, how it takes a voice, and the
    playground's URL where it is served."""
    if not engine.family.speaks:
        voices = "speech recognition: POST /v1/audio/transcriptions"
    elif engine.speakers:
        voices = f"voices: {', '.join(engine.speakers)}"
    elif engine.tts_model_type == "base":
        voices = "voices cloned from a recording: POST /v1/audio/voices, or ref_audio in a speech request"
    else:
        voices = "voices described in words: instructions"
    lines = [f"omnimtp: serving {engine.model_id} on {url}/v1 ({voices})"]
    if playground:
        lines.append(f"omnimtp: the playground is on {url}/")
    return "\n".join(lines)


def app_builder(config: dict):
    """The Ray Serve application of a Serve config's `args` (a RayService's `import_path:
    omnimtp.server.cli:app_builder`, as in deploy/rayservice.yaml): each key is a `serve` flag
    without its dashes, `_` for `-`
    (`{"model": "/models/qwen3-omni", "max_batch_size": 16, "eager": true, "served_model_name": ["a"]}`).
    The replica count and resources come from the config's deployment section, which overrides these
    defaults; the API key from $OMNIMTP_API_KEY."""
    argv = []
    for key, value in (config or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="omnimtp serve")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    if not ray_serve.is_requested(args):
        args.replicas = 1
    return ray_serve.application(args)


def _log_to_stderr(level: str) -> None:
    """omnimtp's log lines (warm-up progress, engine errors) on stderr beside uvicorn's, at its level."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("omnimtp")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if level == "trace" else level.upper())


def _refuse(message: str) -> int:
    print(f"omnimtp serve: error: {message}", file=sys.stderr)
    return 2
