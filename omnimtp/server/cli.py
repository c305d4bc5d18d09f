"""`omnimtp serve`: the OpenAI-compatible speech server under uvicorn."""

from __future__ import annotations

import argparse
import os

TINY_MAX_FRAMES = 100  # the tiny model's random talker rarely emits codec EOS: keep its replies short
CHECKPOINT_MAX_FRAMES = 1500  # 2 minutes of speech at 12.5 frames/s


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve /v1/chat/completions and /v1/audio/speech (OpenAI-compatible)",
        description="OpenAI-compatible speech server with continuous batching. Without --model it serves the "
        "embedded tiny model (random weights: noise-like speech).",
    )
    parser.add_argument("--model", metavar="DIR", help="a Qwen3-Omni checkpoint directory (default: embedded tiny)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("OMNIMTP_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $OMNIMTP_API_KEY)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests generating at once")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    parser.add_argument("--max-frames", type=int, default=None,
                        help=f"audio frames per request (default {TINY_MAX_FRAMES} tiny, {CHECKPOINT_MAX_FRAMES} checkpoint)")
    parser.add_argument("--max-tokens-limit", type=int, default=2048, help="the largest max_tokens a request may ask")
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(handler=run)


def build_engine(model_dir: str | None, *, max_batch_size: int, max_frames: int | None):
    from omnimtp.server.scheduler import Engine, SpeechBackend

    if model_dir is None:
        backend = SpeechBackend.tiny(0, max_frames=max_frames or TINY_MAX_FRAMES)
        return Engine(backend, max_batch_size=max_batch_size, model_id="omnimtp-tiny")
    from omnimtp.pipeline import OmniPipeline

    pipe = OmniPipeline.from_pretrained(model_dir)
    if pipe.tokenizer is None:
        raise ValueError(f"--model: {model_dir!r} has no tokenizer; the server needs one to read chat messages")
    backend = SpeechBackend(pipe.model, pipe.tokenizer, max_frames=max_frames or CHECKPOINT_MAX_FRAMES)
    model_id = os.path.basename(os.path.normpath(model_dir))
    return Engine(backend, max_batch_size=max_batch_size, model_id=model_id)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from omnimtp.server.app import create_app

    engine = build_engine(args.model, max_batch_size=args.max_batch_size, max_frames=args.max_frames)
    app = create_app(engine, api_key=args.api_key or None, max_queue=args.max_queue,
                     max_tokens_limit=args.max_tokens_limit)
    print(f"omnimtp: serving {engine.model_id} on http://{args.host}:{args.port}/v1 "
          f"(voices: {', '.join(engine.speakers)})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
