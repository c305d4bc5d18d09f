"""The engine's settings (`EngineConfig`): batch and reply caps, chunking of streamed audio, admission and decode
scheduling, the prefix cache, runaway cuts."""

from __future__ import annotations

from dataclasses import dataclass, fields

from omnimtp.limits import DEFAULT_MAX_FRAMES, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_SEGMENT_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, one definition for every driver.

    max_new_tokens, max_frames: a request's default thinker token and audio frame caps (a spoken text's
    frames: per segment). max_segment_tokens: text tokens per segment of a spoken text (the drivers cut longer
    texts with the family's `speech_segments`).
    first_chunk_frames, chunk_frames: streamed audio goes out after first_chunk_frames frames (fast first
    audio), then every chunk_frames frames, then the rest. playout_rtf: a later chunk is instead as long as
    a listener who started at the first chunk can wait for while frames are made at this real-time factor
    (`chunk_frames_after`), so chunks grow from single frames to chunk_frames as the listener's lead builds up;
    the sizes depend on nothing but the frames already decoded, so a request's chunks are the same under any
    load (None: every chunk_frames). max_start_steps: thinker steps a newly
    admitted cohort takes in its first step (its prefill counts as one); a speculative cohort's first
    max_start_steps − 1 steps after its prefill draft nothing, so its first audio comes as fast as a plain
    cohort's (the talker takes one reply row a frame: drafting ahead of it then buys nothing).
    max_decode_frames: frames of later (not first) chunks decoded per step, though always the oldest chunk
    (None: every due chunk).
    max_defer_steps: steps in a row a later chunk may wait for a newcomer or for another listener who would run
    dry during its decoding; only chunks whose listeners are far enough ahead (their lead over the playback
    clock, `Request.playback`) that the others' leads can grow past that decoding meanwhile wait.
    prefill_block: every chat prompt is prefilled in blocks of this many positions from position 0, so a
    prompt's rows are the same whether a prefix of whole blocks was reused or prefilled (`omnimtp.thinker`); so
    is a chat request's talker prefill when longer than a block (`omnimtp.talker.loop`).
    prefix_cache_bytes: the budget of the conversations kept warm (`omnimtp.engine.prefix_cache`; 0: none).
    cuts_runaway: a talker that does not end is also cut at its text's bound and on a repeating code 0 (the
    family's `omnimtp.talker.loop.RunawayLimits`); False: at max_frames only."""

    max_batch_size: int = 8
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_frames: int = DEFAULT_MAX_FRAMES
    max_segment_tokens: int = DEFAULT_MAX_SEGMENT_TOKENS
    first_chunk_frames: int = 1
    chunk_frames: int = 25
    playout_rtf: float | None = None
    max_start_steps: int = 3
    max_decode_frames: int | None = None
    max_defer_steps: int = 0
    prefix_cache_bytes: int = 0
    prefill_block: int = 256
    cuts_runaway: bool = True

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("max_decode_frames", "playout_rtf") and value is None:
                continue
            if f.name == "playout_rtf":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                    raise ValueError(f"playout_rtf must be None or a number in (0, 1], got {value!r}")
                continue
            if f.name == "cuts_runaway":
                if not isinstance(value, bool):
                    raise ValueError(f"cuts_runaway must be a bool, got {value!r}")
                continue
            minimum = 0 if f.name in ("max_defer_steps", "prefix_cache_bytes") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{f.name} must be an integer >= {minimum}, got {value!r}")
