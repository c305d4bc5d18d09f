"""The engine and app that `omnimtp serve` runs, from its arguments: one server process, or one Ray Serve
replica (`ray_serve.OmniReplica`)."""

from __future__ import annotations

import argparse
import os

from omnimtp.checkpoint import omni_model_type
from omnimtp.limits import DEFAULT_TIMEOUT_TEXT_IDLE_S, TINY_MAX_FRAMES, TINY_MAX_NEW_TOKENS, MediaLimits
from omnimtp.speak_cli import thinker_mtp_kwargs


def build_engine(model_dir: str | None, *, max_batch_size: int, max_frames: int | None, compile_predictor=False,
                 media_limits: MediaLimits = MediaLimits(), device="cpu", thinker_mtp: str | None = None,
                 num_draft_tokens: int | None = None, torch_threads: int | None = None,
                 quantize: str | None = None, timeout_text_idle: float = DEFAULT_TIMEOUT_TEXT_IDLE_S,
                 prefix_cache_bytes: int = 0, codec_dtype: str | None = None, admission: bool = False,
                 warm_up: bool = False, int8_compute: bool = False, kv_dtype: str | None = None):
    """The server's engine on the embedded tiny model, a built-in one by name or a checkpoint directory. The
    weights are loaded, moved to `device` and packed once; compile_predictor ("auto", "frame", "step" or False): the
    predictor's graphs are built in the background while the engine serves eagerly (`Engine`'s warm_up); "auto"
    compiles nothing where the eager predictor runs the native w4a8 step (`CodePredictorRunner`).
    media_limits: what a request's audio and images may hold.
    thinker_mtp, num_draft_tokens: speculative thinker steps, torch_threads: the thread rule's override,
    quantize: quantized linears, codec_dtype: the audio decoder's conv stack (`OmniPipeline`'s).
    timeout_text_idle: how long a streamed-text speech request may wait for more text (`Engine`'s).
    prefix_cache_bytes: the budget of the realtime conversations kept warm (`EngineConfig`'s).
    admission: admit streams by measured real-time capacity (`Engine`'s). warm_up: read the memory-mapped weights
    every reply reads in the background (`OmniPipeline`'s prefetch) and run a warm-up reply at start (`Engine`'s
    warm_up_reply). int8_compute: a Qwen3-ASR model's layers of many rows on int8 GEMMs (`Qwen3ASRFamily`'s; the
    option is for that family alone); kv_dtype: its KV cache's dtype ("bfloat16", or None: fp32; the same)."""
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.runtime.device import apply_thread_rule
    from omnimtp.server.scheduler import Engine
    from omnimtp.spec_decode.thinker_spec import thinker_speculation

    if model_dir is None:
        family = Qwen3OmniFamily.tiny(0, device=device, compile_predictor=compile_predictor, quantize=quantize,
                                      codec_dtype=codec_dtype)
        family.thinker_speculation = thinker_speculation(family.model.thinker, thinker_mtp, num_draft_tokens)
        apply_thread_rule(family.model, torch_threads)
        return Engine(family, model_id="omnimtp-tiny", warm_up=_compiles_predictor(family, max_batch_size),
                      warm_up_reply=warm_up,
                      max_batch_size=max_batch_size,
                      max_frames=max_frames or TINY_MAX_FRAMES, max_new_tokens=TINY_MAX_NEW_TOKENS,
                      media_limits=media_limits, timeout_text_idle=timeout_text_idle,
                      prefix_cache_bytes=prefix_cache_bytes, admission=admission)
    from omnimtp.checkpoint import tiny_model
    from omnimtp.pipeline import OmniPipeline

    pipe = OmniPipeline.from_pretrained(model_dir, device=device, compile_predictor=compile_predictor,
                                        thinker_mtp=thinker_mtp, num_draft_tokens=num_draft_tokens,
                                        torch_threads=torch_threads, quantize=quantize, codec_dtype=codec_dtype,
                                        prefetch=warm_up, **({"int8_compute": True} if int8_compute else {}),
                                        **({"kv_dtype": kv_dtype} if kv_dtype is not None else {}))
    if pipe.tokenizer is None:
        raise ValueError(f"--model: {model_dir!r} has no tokenizer; the server needs one to read chat messages")
    # a built-in model is served by its name, a directory by its last component
    model_id = model_dir if tiny_model(model_dir) is not None else os.path.basename(os.path.normpath(model_dir))
    return Engine(pipe.family, model_id=model_id, warm_up=_compiles_predictor(pipe.family, max_batch_size),
                  warm_up_reply=warm_up,
                  max_batch_size=max_batch_size,
                  max_frames=max_frames or pipe.config.max_frames, max_new_tokens=pipe.config.max_new_tokens,
                  media_limits=media_limits, timeout_text_idle=timeout_text_idle,
                  prefix_cache_bytes=prefix_cache_bytes, admission=admission)


def _compiles_predictor(family, max_batch_size: int) -> bool:
    """Whether the family's code predictor for batches up to max_batch_size has graphs to build (a model that only
    hears, or an eager predictor, has none)."""
    predictor = getattr(family, "predictor", None)
    return bool(family.speaks) and predictor is not None and predictor(max_batch_size).compile_mode is not None


def build_app(args: argparse.Namespace):
    """(engine, app) of `serve`'s arguments: what one server process, or one Ray Serve replica, runs."""
    from omnimtp.server.app import create_app
    from omnimtp.server.websocket import WebSocketLimits

    media_limits = MediaLimits(max_audio_seconds=args.max_audio_seconds, max_image_pixels=args.max_image_pixels,
                               max_parts=args.max_media_parts)
    speculation = thinker_mtp_kwargs(args)  # ValueError for --demo with --model
    model = args.model
    int8_compute = getattr(args, "int8_compute", False)  # for the Qwen3-ASR models and the aligner it loads
    kv_dtype = "bfloat16" if getattr(args, "kv_dtype", None) == "bfloat16" else None  # for its Qwen3-ASR models
    hears = bool(int8_compute or kv_dtype) and model is not None and omni_model_type(model) == "qwen3_asr"
    if getattr(args, "demo", False):
        from omnimtp.mtp.demo import demo_omni_dir

        model = str(demo_omni_dir())
    engine = build_engine(model, max_batch_size=args.max_batch_size, max_frames=args.max_frames,
                          compile_predictor=False if args.eager else "auto", media_limits=media_limits,
                          device=args.device, torch_threads=getattr(args, "threads", None), quantize=args.quantize,
                          codec_dtype=args.codec_dtype, timeout_text_idle=args.timeout_text_idle,
                          prefix_cache_bytes=int(args.session_cache_mb * (1 << 20)),
                          admission=getattr(args, "admission", "capacity") == "capacity",
                          warm_up=getattr(args, "warm_up", True),
                          int8_compute=int8_compute and hears, kv_dtype=kv_dtype if hears else None,
                          **speculation)
    asr_engine = None
    if getattr(args, "asr_model", None) is not None:  # a speech recognizer beside the model, on the same CPU
        asr_engine = build_engine(args.asr_model, max_batch_size=args.max_batch_size, max_frames=None,
                                  media_limits=media_limits, device=args.device,
                                  torch_threads=getattr(args, "threads", None), quantize=args.quantize,
                                  int8_compute=int8_compute, kv_dtype=kv_dtype)
        if asr_engine.family.speaks:
            raise ValueError(f"--asr-model: {args.asr_model!r} speaks; a Qwen3-ASR model is what hears beside "
                             "the model")
    aligner = None
    if getattr(args, "aligner_model", None) is not None:
        from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner

        aligner = Qwen3ForcedAligner.from_pretrained(args.aligner_model, device=args.device, quantize=args.quantize,
                                                     int8_compute=int8_compute)
    voice_store = None
    if args.voices_dir is not None:
        from omnimtp.server.voice_store import VoiceStore

        voice_store = VoiceStore(args.voices_dir, max_voices=args.max_voices, keep_audio=args.keep_voice_audio)
    app = create_app(engine, api_key=args.api_key, max_queue=args.max_queue, max_tokens_limit=args.max_tokens_limit,
                     max_body_bytes=args.max_body_bytes, body_timeout_s=args.timeout_body,
                     served_model_names=args.served_model_name, voice_store=voice_store,
                     openai_aliases=getattr(args, "openai_aliases", True),
                     voice_aliases=_voice_aliases(getattr(args, "voice_alias", [])),
                     max_ref_seconds=args.max_ref_seconds, playground=getattr(args, "playground", True),
                     aligner=aligner, asr_engine=asr_engine,
                     websocket_limits=WebSocketLimits(
                         max_sessions=args.max_sessions, idle_timeout_s=args.timeout_session_idle,
                         max_message_bytes=args.max_body_bytes, max_session_items=args.max_session_items,
                         max_session_bytes=args.max_session_bytes))
    return engine, app


def _voice_aliases(given: list[str]) -> dict[str, str]:
    """`--voice-alias NAME=SPEAKER` flags as a dict; ValueError naming the flag for one without "="."""
    aliases = {}
    for value in given:
        name, sep, speaker = value.partition("=")
        if not sep or not name or not speaker:
            raise ValueError(f"--voice-alias: expected NAME=SPEAKER, got {value!r}")
        aliases[name] = speaker
    return aliases
