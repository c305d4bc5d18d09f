"""One request's state, the events a step produces and the finished output.

A `Request` is the only place a request's state lives, from `EngineCore.add` to its last event:
what to generate (prompt, speaker, sampling, limits, whether audio streams) and how far it got
(thinker tokens, talker frames, decoded audio, finish reasons, timestamps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from omnimtp.engine.playback import PlaybackClock
from omnimtp.media import MediaInputs
from omnimtp.sampling import SamplingParams, TokenLogprob, check_num_logprobs, make_generators, request_seeds

FINISH_REASONS = ("stop", "length")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """What to generate and how far it got.

    prompt_ids: the thinker's prompt (chat), or for a speech request (`is_chat=False`) an opened
    assistant turn followed by the text to speak, which the talker speaks without a thinker run (Qwen3-TTS:
    the assistant-text template around the text). speaker: a speaker of the model, or None for a text-only
    reply; for a family with richer voices, the family's voice object (Qwen3-TTS: a `TTSVoice` with the
    speaker, language and instructions), which the core hands back to the family untouched. thinker_sampling and
    talker_sampling: None = greedy (the talker's greedy keeps transformers' repetition penalty).
    is_streamed: the talker starts on the streamed handoff and audio goes out in chunks as they are
    due; False does what transformers' `generate` does: the talker inputs are built from all of the
    thinker's rows once it has finished (one text projection over the reply) and the audio is
    decoded in one block when the talker ends. seed: the request's generators are seeded by
    `request_seeds(seed)` (thinker, talker, codec); None: a request that samples its thinker or talker
    draws a seed from torch's global RNG for those two, so `torch.manual_seed` repeats an unseeded request
    too, and it never draws from an RNG other requests share; a greedy unseeded request draws nothing (its
    generators are unused). codec_generator: a seeded request's codec noise (Qwen2.5-Omni's DiT), so
    `seed=s` repeats bit for bit whatever else ran; None for an unseeded request, whose codec noise comes
    from torch's global RNG when its audio is decoded, as transformers draws it. media: the
    prompt's audio / image / video tensors (`omnimtp.media.MediaInputs`), one encoder row per media pad
    id of prompt_ids; None for a text prompt. is_text_finished: False for a speech request whose text is still
    arriving: prompt_ids holds its ids so far (possibly none) and `EngineCore.push_speech_ids` adds the rest;
    its talker waits for each text row it has not got (its codes are those of the whole text); a long one comes as
    segments (`push_speech_ids(..., ends_segment=True)` marks where each ends), spoken as `segments` are.
    is_background: a
    low-priority request (a realtime input transcript): it is admitted only in a step that admits no other, and
    its thinker steps only while no other speaking request waits for its first audio (`EngineCore.step`); what
    it writes is the same as at normal priority, only later. segments: a speech request's later segments of a
    long text (an iterable such as `ChatText.speech_segments` gives, cut as it is read: each the template ids of
    its piece, none empty; prompt_ids is the first, and each segment's ids join it as the segment starts),
    spoken in order as one request: each segment is a talker run of its own (a fresh prefill, up to max_frames
    frames) that continues the request's talker generator, and every segment's frames join one codec stream, so
    the decoder sees one continuous code sequence and the audio has no seams of its own. cache_key: a chat
    request of a conversation kept warm (a realtime session's id): its thinker starts from the prefill blocks of
    the key's last prompt that its prompt shares, and its talker from the blocks of the key's last talker prefill
    that its own shares (`omnimtp.engine.prefix_cache`); the reply is the same bit for
    bit as the same prompt without a key."""

    request_id: Hashable
    prompt_ids: list[int]
    max_new_tokens: int
    max_frames: int
    speaker: str | None = None
    thinker_sampling: SamplingParams | None = None
    talker_sampling: SamplingParams | None = None
    seed: int | None = None
    is_chat: bool = True
    is_streamed: bool = True
    media: MediaInputs | None = field(default=None, repr=False)
    is_text_finished: bool = True
    is_background: bool = False
    segments: Iterable[list[int]] | None = field(default=None, repr=False)
    cache_key: Hashable | None = None
    logprobs: int | None = None
    # --- state ---
    status: Status = Status.WAITING
    thinker_generator: torch.Generator | None = field(default=None, repr=False)
    talker_generator: torch.Generator | None = field(default=None, repr=False)
    codec_generator: torch.Generator | None = field(default=None, repr=False)
    output_ids: list[int] = field(default_factory=list)  # thinker tokens, stop token included
    text: str = ""  # the text handed out so far
    output_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)  # one per output id (logprobs)
    num_logprobs_sent: int = 0  # output_logprobs handed out on text events
    thinker_finish_reason: str | None = None
    talker_finish_reason: str | None = None
    talker_builder: object = field(default=None, repr=False)  # the family's TalkerInputBuilder (chat with speech)
    handoff: object = field(default=None, repr=False)  # omnimtp.handoff.ThinkerToTalkerStream (streamed)
    thinker_rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)  # not streamed
    talker_inputs: object = field(default=None, repr=False)  # the talker prefill waiting for admission
    speech_stream: object = field(default=None, repr=False)  # omnimtp.handoff.SpeechTextStream (speech requests)
    num_fed_ids: int = 0  # prompt_ids handed to speech_stream, or skipped (a segment its talker ended early)
    segment_ends: list[int] = field(default_factory=list)  # where each segment's ids end in prompt_ids, once known
    is_in_talker: bool = False
    is_parked: bool = False  # running, but waiting for text without a slot (`EngineCore` parks it)
    parked_talker: object = field(default=None, repr=False)  # its talker state while parked (a `ParkedTalker`)
    waits_for_text_since: float | None = None  # when it last had nothing to do but wait for text (None: it has)
    frames: list[torch.Tensor] = field(default_factory=list, repr=False)  # [G] each
    segment_frames: list[int] = field(default_factory=list)  # frames of each finished segment
    segment_finish_reasons: list[str] = field(default_factory=list)
    audio_cut_by: str | None = None  # what cut its audio ("length"): `omnimtp.talker.loop.TalkerFrame.cut_by`
    num_decoded: int = 0  # frames already turned into audio
    audio: list[np.ndarray] = field(default_factory=list, repr=False)
    codec_stream: object = field(default=None, repr=False)
    spec_stats: object = field(default=None, repr=False)  # its thinker run's SpecStats (speculative runs)
    num_reused_rows: int = 0  # prompt rows its thinker took from the prefix cache
    num_talker_reused_rows: int = 0  # talker prefill rows taken from the prefix cache
    chunk_ready_step: int | None = None  # the step its next later chunk became due
    num_deferred: int = 0  # steps in a row its due later chunk has waited (`EngineConfig.max_defer_steps`)
    deferred_step: int | None = None  # the last step its chunk waited in
    playback: PlaybackClock = field(default_factory=PlaybackClock)  # its listener's, its audio pushed as decoded
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    admitted_step: int | None = None
    talker_admitted_at: float | None = None
    first_frame_at: float | None = None
    first_audio_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self):
        self.prompt_ids = [int(token) for token in self.prompt_ids]
        if not self.is_text_finished and self.is_chat:
            raise ValueError("is_text_finished: only a speech request's text arrives in pieces")
        if self.cache_key is not None and not self.is_chat:
            raise ValueError("cache_key: only a chat request's prefixes are kept")
        check_num_logprobs(self.logprobs)
        if self.logprobs is not None and not self.is_chat:
            raise ValueError("logprobs: only a chat request's thinker tokens have logprobs")
        if self.segments is not None:
            if self.is_chat or not self.is_text_finished:
                raise ValueError("segments: only a speech request whose text is whole is spoken in segments")
            self.segments = iter(self.segments)  # taken one at a time, as each segment starts
        if not self.prompt_ids and self.is_text_finished:
            raise ValueError("prompt_ids: empty prompt")
        for name in ("max_new_tokens", "max_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("thinker_sampling", "talker_sampling"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, SamplingParams):
                raise ValueError(f"{name} must be None or a SamplingParams, got {type(value).__name__}")
        if self.media is not None and (not isinstance(self.media, MediaInputs) or not self.is_chat):
            raise ValueError("media must be None or a MediaInputs, and only a chat request takes media")
        if not self.is_chat and self.speaker is None:
            raise ValueError("speaker is required to speak a speech request's text")
        seed = self.seed
        is_sampled = any(s is not None and not s.is_greedy for s in (self.thinker_sampling, self.talker_sampling))
        if seed is None and is_sampled:
            seed = int(torch.randint(0, 2**63 - 1, ()))
        thinker_seed, talker_seed, codec_seed = request_seeds(seed)
        self.generator_seeds = (thinker_seed, talker_seed)
        self.codec_seed = codec_seed if self.seed is not None else None
        self._make_generators("cpu")

    def _make_generators(self, device: torch.device | str) -> None:
        self.thinker_generator, self.talker_generator = make_generators(list(self.generator_seeds), device)
        self.codec_generator = None if self.codec_seed is None else make_generators([self.codec_seed], device)[0]

    def place_generators(self, device: torch.device | str) -> None:
        """Remake the request's generators on `device` (the model's), from the same seeds, so sampling draws
        its noise where the logits are; a no-op when they are there already."""
        device = torch.device(device)
        if self.thinker_generator.device != device:
            self._make_generators(device)

    # --- what the drivers read ---

    @property
    def has_speech(self) -> bool:
        return self.speaker is not None

    @property
    def reply_ids(self) -> list[int]:
        """The reply's tokens: the thinker's, without the stop token."""
        if self.thinker_finish_reason == "stop":
            return self.output_ids[:-1]
        return list(self.output_ids)

    @property
    def finish_reason(self) -> str | None:
        """None until finished; then "no_audio" if speech was asked and the talker ended before its first frame
        (an immediate codec EOS, or a reply with no row to speak), else "length" if the thinker or the talker
        hit its cap, else "stop"."""
        if self.status is not Status.FINISHED:
            return None
        if self.has_speech and not self.frames:
            return "no_audio"
        reasons = (self.thinker_finish_reason, self.talker_finish_reason)
        return "length" if "length" in reasons else "stop"

    @property
    def is_thinking(self) -> bool:
        return self.is_chat and self.thinker_finish_reason is None and self.status is Status.RUNNING

    @property
    def is_complete(self) -> bool:
        if self.is_chat and self.thinker_finish_reason is None:
            return False
        if not self.has_speech:
            return True
        return self.talker_finish_reason is not None and self.num_decoded == len(self.frames)

    # --- a speech request's text, segment by segment (a streamed text's comes in pieces) ---

    @property
    def has_text(self) -> bool:
        """Whether it has anything to start on: a speech request whose text is still arriving needs an id."""
        return self.is_text_finished or bool(self.prompt_ids)

    @property
    def can_resume(self) -> bool:
        """Whether a parked request's text came since it was parked."""
        return self.is_parked and self.has_unfed_text

    def unfed_ids(self) -> tuple[int, list[int], bool] | None:
        """A speech request's current segment's ids not fed yet: (where they start in prompt_ids, the ids, whether
        they end the segment), or None while the segment's start is unknown (the talker of the one before ended
        early, and where that segment's ids end has not come yet). Segment i ends at segment_ends[i], or at the
        end of a finished text."""
        index = len(self.segment_frames)
        start = 0 if index == 0 else self.segment_end(index - 1)
        if start is None:
            return None
        start = max(start, self.num_fed_ids)  # the rest of a segment whose talker ended early is skipped
        end = self.segment_end(index)
        return start, self.prompt_ids[start:end], end is not None

    def segment_end(self, index: int) -> int | None:
        """Where segment `index`'s ids end in prompt_ids: at the end its driver marked, or at the end of a finished
        text; None while it is not known."""
        if index < len(self.segment_ends):
            return self.segment_ends[index]
        return len(self.prompt_ids) if self.is_text_finished else None

    @property
    def has_unfed_text(self) -> bool:
        unfed = self.unfed_ids()
        return unfed is not None and (bool(unfed[1]) or unfed[2])

    @property
    def may_have_next_segment(self) -> bool:
        """Whether a streamed text may have a segment after the one whose talker just ended."""
        if self.segments is not None:
            return False
        end = self.segment_end(len(self.segment_frames) - 1)
        return end is None or end < len(self.prompt_ids) or not self.is_text_finished

    def text_delta(self, decode: Callable[[list[int]], str], is_final: bool = False) -> str:
        """New text since the last delta. A trailing incomplete UTF-8 sequence (decoded as U+FFFD) waits
        for its next bytes; the final delta hands out the rest, so the deltas join into exactly
        `decode(reply_ids)`, the whole reply decoded at once."""
        text = decode(self.reply_ids)
        if not is_final and text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta

    def logprobs_delta(self) -> list[TokenLogprob]:
        """The reply tokens' logprobs not handed out yet (the stop token has none in the reply): what goes with a
        text delta, the tokens whose text it hands out."""
        new = self.output_logprobs[self.num_logprobs_sent:len(self.reply_ids)]
        self.num_logprobs_sent += len(new)
        return new


@dataclass
class OmniOutput:
    """One finished request. codes: [G, T] long (on the CPU); audio: float32 mono at `sample_rate`.
    finish_reason: "no_audio" when speech was asked and the talker ended before its first frame (audio and
    codes are then empty), else "length" when the thinker or the talker hit its cap, else "stop". spec_stats: the
    thinker's speculative steps (`omnimtp.spec_decode.generate.SpecStats`: τ, per-position acceptance,
    drafted / accepted counts), None without speculation. segment_frames: a speech request's frames per segment
    of its text (one entry for a text spoken whole; frame i is the audio samples [i·spf, (i+1)·spf) at the
    codec's samples per frame); empty for chat."""

    text: str
    text_ids: list[int]
    codes: torch.Tensor
    audio: np.ndarray
    sample_rate: int
    finish_reason: str
    thinker_finish_reason: str | None
    talker_finish_reason: str | None
    spec_stats: object = None
    segment_frames: list[int] = field(default_factory=list)


@dataclass
class StepEvent:
    """What one step produced for one request: a text delta (possibly ""), an audio chunk, or its end
    (`is_finished`; `request` then holds the whole result). step: the engine step that made it. logprobs: with a
    text delta of a request that asked for them, the logprobs of the tokens whose text it hands out (a token whose
    text waits for more bytes goes with the next delta; the last delta's event has the rest)."""

    request: Request
    step: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    audio: np.ndarray | None = None
    is_finished: bool = False
