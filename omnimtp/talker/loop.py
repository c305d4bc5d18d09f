"""Our explicit talker loop: a batch of requests that is stepped one audio frame at a time.

One step, for every active request:

    code 0 (sampled last step) → the frame's codes and the next talker input (the family's `FrameMaker`)
      → one talker forward → code 0 of the next frame (repetition penalty, suppressed ids, codec EOS)

The loop is the same for every family; what differs lives in a small `FrameMaker`:
- Qwen3-Omni (`Qwen3FrameMaker`): residual codes 1..G-1 from the code predictor (`CodePredictorRunner`),
  next input = Σ of the frame's G codec embeddings + the next reply text row (tts_pad once they run out);
  the top 1024 ids are suppressed except codec EOS; Qwen3-TTS is the same frame with its own sampling
  defaults and codec EOS banned for the first `min_new_tokens` (2) talker tokens, as its `generate` has it;
- Qwen2.5-Omni (`Qwen2_5FrameMaker`): one codebook, so the frame is code 0; next input =
  `thinker_to_talker_proj`(codec embedding of code 0 + the next reply row), the prefill goes through the
  same projection; codec_bos is suppressed; EOS = codec end or pad; the repetition penalty counts the
  prefill ids `[codec_mask] * P + [codec_pad, codec_bos]` as seen, as transformers' `generate` does.

`TalkerBatch` is the state a scheduler drives: `admit` prefills new requests and merges them into
the batch, `step` makes one frame for every ready request (`take_frames`, whose codes are final, then
`advance`, the talker forward toward the next frame: a scheduler decodes a first audio chunk in between),
`retire` drops requests at a frame boundary, `park` takes a request's whole state out of the batch (its KV
slot is free for another) and `resume` puts it back, so it goes on exactly as if it had stayed.

Prefix reuse (`TalkerRequest.prefill_block`, `prefix`, `keeps_prefix`), as the thinker's (`omnimtp.thinker`): a
prefill longer than its block runs in blocks of that many positions from position 0, one forward each, so its
KV is the same whether a prefix of whole blocks was loaded or computed; a request that keeps its prefix leaves
its prefill's whole blocks as a `TalkerPrefix` (`kept_prefix` after `admit`), and a later request given it
loads the KV of the whole blocks whose input rows equal its own (`reused_rows`) and prefills the rest.

The talker runs on packed weights
(`PackedDecoder`) with one KV slot per request: a request's positions and cache never mix with another's,
so its frames do not depend on who else is in the batch. A request whose next reply row has not arrived
yet (streamed thinker) sits the step out: it is not forwarded and its state is untouched.

Greedy defaults reproduce transformers' `generate(talker_do_sample=False)`, whose repetition penalty
1.05 still applies; the last talker token (normally EOS) makes no frame.

A talker that never samples codec EOS (codec repetition, most often with quantized weights) is cut, "length",
at the first of: max_frames; its text's bound (`RunawayLimits`: frames per text row it was given, with a
floor); code 0 repeating one short pattern for `repeat_frames` frames. The defaults leave real speech alone:
`RUNAWAY_LIMITS_12_5_HZ` allows 12 frames (0.96 s) per text token, about three times a typical token's
speech and twice slow, expressive Chinese, and never less than 10 s.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F

from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.runtime.kv_cache import SavedSlot
from omnimtp.sampling import (
    QWEN3_OMNI_CODE_PREDICTOR_SAMPLING,
    SamplingParams,
    apply_repetition_penalty,
    sample,
)
from omnimtp.talker.code_predictor import CodePredictorRunner

# What transformers' Qwen3-Omni `generate` uses for the talker (its defaults), greedy and sampled.
QWEN3_OMNI_TALKER_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.05)
QWEN3_OMNI_TALKER_SAMPLING = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
# ... and Qwen2.5-Omni's `generate` (talker_top_k 40, talker_top_p 0.8, talker_temperature 0.9).
QWEN2_5_OMNI_TALKER_GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.05)
QWEN2_5_OMNI_TALKER_SAMPLING = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05)
# Positions per slot the talker's KV buffer starts with; it doubles as a longer request needs it. A zeroed buffer
# of 256 at Qwen3-TTS 0.6B's widths and 8 slots is 470 MB, and zeroing it took about 70 ms of the first audio
# of every `stream_speech` call (each call runs its own engine).
KV_START_CAPACITY = 64


@dataclass(frozen=True)
class RunawayLimits:
    """Where a talker that does not end is cut ("length"), besides its max_frames.

    frames_per_text_row, min_frames: a request makes at most max(min_frames, frames_per_text_row × the text
    rows it was given) frames (a text still arriving bounds nothing early: a frame takes a row until it ends).
    repeat_frames, max_repeat_period: code 0 of its last repeat_frames sampled frames repeating one pattern of
    at most max_repeat_period frames (one code held, or a short cycle) ends it too.

    Worked example at 12.5 frames/s (`RUNAWAY_LIMITS_12_5_HZ`): "Hi" (a few rows) may make 125 frames (10 s); a
    text of 100 rows 1,200 frames (96 s); codes 7, 3, 7, 3, ... for 125 frames end it at once."""

    frames_per_text_row: int
    min_frames: int
    repeat_frames: int
    max_repeat_period: int

    def __post_init__(self):
        for name in ("frames_per_text_row", "min_frames", "repeat_frames", "max_repeat_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_repeat_period >= self.repeat_frames:
            raise ValueError(f"max_repeat_period must be < repeat_frames ({self.repeat_frames}), "
                             f"got {self.max_repeat_period}")

    def max_text_frames(self, num_text_rows: int) -> int:
        return max(self.min_frames, self.frames_per_text_row * num_text_rows)


# Qwen3-Omni and Qwen3-TTS (12.5 frames/s): 0.96 s per text token, at least 10 s; a pattern of up to 1 s held 10 s.
RUNAWAY_LIMITS_12_5_HZ = RunawayLimits(frames_per_text_row=12, min_frames=125, repeat_frames=125,
                                       max_repeat_period=12)
# Qwen2.5-Omni (50 frames/s): the same seconds.
RUNAWAY_LIMITS_50_HZ = RunawayLimits(frames_per_text_row=48, min_frames=500, repeat_frames=500,
                                     max_repeat_period=48)


class RepeatDetector:
    """Whether a code sequence ends in one pattern of at most max_period codes repeated over its last
    num_frames codes. `push` is O(max_period): runs[p] counts the latest codes equal to the code p before.

        detector = RepeatDetector(num_frames=6, max_period=2)
        [detector.push(c) for c in [5, 7, 3, 7, 3, 7, 3]]  # → six False, then True (7 3 7 3 7 3)"""

    def __init__(self, num_frames: int, max_period: int):
        self.num_frames = num_frames
        self.max_period = max_period
        self.recent: list[int] = []  # the last max_period codes
        self.runs = [0] * (max_period + 1)

    def push(self, code: int) -> bool:
        for period in range(1, min(self.max_period, len(self.recent)) + 1):
            self.runs[period] = self.runs[period] + 1 if self.recent[-period] == code else 0
        self.recent = [*self.recent[1 - self.max_period:], code] if self.max_period > 1 else [code]
        return any(self.runs[p] + p >= self.num_frames for p in range(1, self.max_period + 1))


@dataclass
class TalkerRequest:
    """One request's talker inputs and settings.

    prefill_embeds: [L, H] talker prefill rows; trailing_text: [T, H] reply rows known so far (more
    can follow through `TalkerBatch.push_text` until `is_text_finished`); tts_pad_embed: [H] (H: the
    width the family's `FrameMaker` projects from). sampling: None = the family's talker greedy
    (`FrameMaker.greedy`). Qwen3's code predictor is greedy when the talker is and samples with
    QWEN3_OMNI_CODE_PREDICTOR_SAMPLING otherwise, as transformers does. prefill_positions:
    [3, L] M-RoPE ids of the prefill (a prompt with images or videos), None for 1-D positions.
    prefill_block: a prefill longer than this runs in blocks of it (None: one forward); prefix: a `TalkerPrefix`
    of that block to start from; keeps_prefix: leave the prefill's whole blocks in `kept_prefix` (1-D positions
    only). `admit` sets reused_rows (rows taken from prefix) and kept_prefix. runaway: where a request that does
    not end is cut besides max_frames (None: max_frames only; the family's are its `FrameMaker.runaway`)."""

    request_id: Hashable
    prefill_embeds: torch.Tensor
    trailing_text: torch.Tensor
    tts_pad_embed: torch.Tensor
    is_text_finished: bool = True
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None
    max_frames: int = 4096
    prefill_positions: torch.Tensor | None = None
    prefill_block: int | None = None
    prefix: TalkerPrefix | None = None
    keeps_prefix: bool = False
    runaway: RunawayLimits | None = None
    reused_rows: int = field(default=0, init=False)
    kept_prefix: TalkerPrefix | None = field(default=None, init=False)

    def __post_init__(self):
        if self.prefill_embeds.dim() != 2 or self.prefill_embeds.shape[0] == 0:
            raise ValueError(f"prefill_embeds must be [L, H] with L >= 1, got {tuple(self.prefill_embeds.shape)}")
        positions = self.prefill_positions
        if positions is not None and tuple(positions.shape) != (3, self.prefill_embeds.shape[0]):
            raise ValueError(
                f"prefill_positions must be [3, {self.prefill_embeds.shape[0]}], got {tuple(positions.shape)}"
            )
        hidden_size = self.prefill_embeds.shape[1]
        if self.trailing_text.dim() != 2 or self.trailing_text.shape[1] != hidden_size:
            raise ValueError(f"trailing_text must be [T, {hidden_size}], got {tuple(self.trailing_text.shape)}")
        if tuple(self.tts_pad_embed.shape) != (hidden_size,):
            raise ValueError(f"tts_pad_embed must be [{hidden_size}], got {tuple(self.tts_pad_embed.shape)}")
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be None or a SamplingParams, got {type(self.sampling).__name__}")
        if isinstance(self.max_frames, bool) or not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise ValueError(f"max_frames must be an integer >= 1, got {self.max_frames!r}")
        block = self.prefill_block
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"prefill_block must be None or an integer >= 1, got {block!r}")
        if self.prefix is not None and (not isinstance(self.prefix, TalkerPrefix) or self.prefix.block != block):
            raise ValueError(f"prefix must be None or a TalkerPrefix of block {block}")
        if self.keeps_prefix and block is None:
            raise ValueError("keeps_prefix needs a prefill_block")
        if self.runaway is not None and not isinstance(self.runaway, RunawayLimits):
            raise ValueError(f"runaway must be None or a RunawayLimits, got {type(self.runaway).__name__}")


@dataclass(frozen=True)
class TalkerPrefix:
    """A talker prefill's whole blocks of `block` positions: its input rows embeds [N, D] (before the family's
    projection) and their KV (`SavedSlot`, length N), for a later prefill that starts with the same rows."""

    embeds: torch.Tensor
    kv: SavedSlot
    block: int

    @property
    def num_rows(self) -> int:
        return self.embeds.shape[0]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, self.kv.kv))

    def matching_rows(self, embeds: torch.Tensor, max_rows: int) -> int:
        """How many of its rows a prefill with input rows embeds [L, D] reuses: the whole blocks, up to max_rows,
        before the first row that differs."""
        num_rows = min(self.num_rows, embeds.shape[0], max_rows)
        if num_rows < self.block or self.embeds.shape[1:] != embeds.shape[1:]:
            return 0
        same = (self.embeds[:num_rows] == embeds[:num_rows]).all(dim=-1).cpu()  # [n]
        differing = (~same).nonzero()
        common = int(differing[0]) if len(differing) else num_rows
        return common // self.block * self.block


@dataclass
class TalkerFrame:
    """One request's output of a step: its frame's codes [G] (None when it ended without a frame)
    and, on its last frame, the finish reason ("stop": codec EOS; "length": cut) and, when cut, by what
    (cut_by: "max_frames", "text_length" or "repetition", `RunawayLimits`)."""

    request_id: Hashable
    codes: torch.Tensor | None
    finish_reason: str | None = None
    cut_by: str | None = None


@dataclass
class _Row:
    request: TalkerRequest
    text_rows: list[torch.Tensor] = field(default_factory=list)  # reply rows not consumed yet, each [H]
    is_text_finished: bool = True
    num_frames: int = 0
    finish_reason: str | None = None
    cut_by: str | None = None
    num_text_rows: int = 0  # the reply rows it was given
    repeats: RepeatDetector | None = None  # code 0 so far (None: no runaway limits)

    @property
    def is_ready(self) -> bool:
        return self.finish_reason is None and (bool(self.text_rows) or self.is_text_finished)


@dataclass
class TakenFrames:
    """A step's frames between `TalkerBatch.take_frames` and `advance`: the requests, their rows in the batch,
    their codes [R, G] and the talker inputs of their next frames [R, H]."""

    request_ids: list[Hashable]
    rows: list[int]
    codes: torch.Tensor
    next_inputs: torch.Tensor


@dataclass
class ParkedTalker:
    """A request's talker state out of the batch (`TalkerBatch.park`): its row, its KV slot's sequence, and its
    last hidden [H], sampled code 0 [] and seen ids [V]."""

    row: _Row
    kv: SavedSlot
    last_hidden: torch.Tensor
    code0: torch.Tensor
    seen: torch.Tensor

    @property
    def request_id(self) -> Hashable:
        return self.row.request.request_id


class FrameMaker(Protocol):
    """A family's part of a talker step (see the module docstring)."""

    eos_ids: frozenset[int]  # code 0 ids that end a request (no frame)
    is_suppressed: torch.Tensor  # [V] bool: ids never sampled
    greedy: SamplingParams  # the talker's sampling when a request gives none
    min_new_tokens: int  # EOS is not sampled while a request has generated fewer talker tokens
    runaway: RunawayLimits  # the family's limits for a talker that does not end (at its frame rate)

    def project(self, embeds: torch.Tensor) -> torch.Tensor:
        """Talker inputs [R, T, D] → the decoder's input embeddings [R, T, H]."""

    def prompt_codes(self, request: TalkerRequest) -> list[int]:
        """Ids the repetition penalty counts as already generated when the request is admitted."""

    def make_frames(self, code0: torch.Tensor, last_hidden: torch.Tensor, text: torch.Tensor,
                    requests: list[TalkerRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """code0 [R], talker hidden at the last position [R, H], the next text rows [R, D] → the frames'
        codes [R, G] and the next talker inputs [R, H] (already projected)."""


class Qwen3FrameMaker:
    """Qwen3-Omni: residual codes from the code predictor; next input = Σ of the G codec embeddings + text.

    talker: transformers' `Qwen3OmniMoeTalkerForConditionalGeneration` (or Qwen3-TTS's talker,
    `omnimtp.models.qwen3_tts`, with the keywords below); predictor: its code predictor's runner for the
    batch size (made here when None). vocab_size: the talker's codec vocab (default its text config's);
    greedy: the talker's sampling when a request gives none; predictor_sampling: the code predictor's when
    the talker samples (None: the talker's own without its repetition penalty, as Qwen3-TTS's `generate`
    defaults them); min_new_tokens: talker tokens before EOS may be sampled."""

    def __init__(
        self, talker, max_batch_size: int, predictor: CodePredictorRunner | None = None, *,
        vocab_size: int | None = None, greedy: SamplingParams = QWEN3_OMNI_TALKER_GREEDY,
        predictor_sampling: SamplingParams | None = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, min_new_tokens: int = 0,
    ):
        config = talker.config
        self.talker = talker
        self.predictor = predictor or CodePredictorRunner(talker.code_predictor, max_batch_size)
        if self.predictor.max_batch_size < max_batch_size:
            raise ValueError(f"predictor.max_batch_size must be >= {max_batch_size}")
        # the code predictor's residual tables [V, H], one per residual codebook (the module's own tensors)
        self.codec_tables = [table.weight.detach() for table in talker.code_predictor.model.codec_embedding]
        self.eos_ids = frozenset([config.codec_eos_token_id])
        vocab_size = config.text_config.vocab_size if vocab_size is None else vocab_size
        self.is_suppressed = torch.zeros(vocab_size, dtype=torch.bool, device=talker.device)  # [V]
        self.is_suppressed[vocab_size - 1024 :] = True
        self.is_suppressed[config.codec_eos_token_id] = False
        self.greedy = greedy
        self.predictor_sampling = predictor_sampling
        self.min_new_tokens = min_new_tokens
        self.runaway = RUNAWAY_LIMITS_12_5_HZ

    def project(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds  # the talker inputs are built in the talker's width

    def prompt_codes(self, request: TalkerRequest) -> list[int]:
        return []  # transformers' talker generate gets embeddings only: nothing seen at first

    def make_frames(self, code0, last_hidden, text, requests):
        with torch.no_grad():
            cb0_embed = self.talker.get_input_embeddings()(code0)  # [R, H]
        residual = torch.empty(
            (len(requests), self.predictor.num_code_groups - 1), dtype=torch.long, device=code0.device
        )
        for sampling, members in self._group_by_predictor_sampling(requests).items():
            sub = torch.tensor(members, device=code0.device)
            generators = [requests[m].generator for m in members]
            has_generators = sampling is not None and all(g is not None for g in generators)
            result = self.predictor.run(
                last_hidden[sub], cb0_embed[sub], sampling, generators if has_generators else None
            )
            residual[sub] = result.codes
        return torch.cat([code0[:, None], residual], dim=1), self.next_inputs(cb0_embed, residual, text)

    def next_inputs(self, cb0_embed: torch.Tensor, residual: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """`next_talker_input` without its per-call checks and module calls: the frame's G codec
        embeddings stacked [R, G, H] and summed over G (the same reduction, so the same bits) + text."""
        with torch.no_grad():
            embeds = [cb0_embed] + [
                F.embedding(codes, table) for codes, table in zip(residual.unbind(1), self.codec_tables, strict=True)
            ]
            return torch.stack(embeds, dim=1).sum(dim=1) + text  # [R, H]

    def _group_by_predictor_sampling(self, requests: list[TalkerRequest]) -> dict[SamplingParams | None, list[int]]:
        groups: dict[SamplingParams | None, list[int]] = {}
        for i, request in enumerate(requests):
            talker_sampling = request.sampling or self.greedy
            if talker_sampling.is_greedy:
                sampling = None
            elif self.predictor_sampling is None:
                sampling = replace(talker_sampling, repetition_penalty=1.0)
            else:
                sampling = self.predictor_sampling
            groups.setdefault(sampling, []).append(i)
        return groups


class Qwen2_5FrameMaker:
    """Qwen2.5-Omni: one codebook; inputs built in the thinker's width D and projected to the talker's H by
    `thinker_to_talker_proj` (the prefill and every next input), as its talker's forward does.

    talker: transformers' `Qwen2_5OmniTalkerForConditionalGeneration`. EOS: the config's codec end and pad
    ids (what transformers' hard-coded default [8292, 8294] is for the real checkpoint)."""

    def __init__(self, talker):
        config = talker.config
        self.talker = talker
        self.eos_ids = frozenset([config.tts_codec_end_token_id, config.tts_codec_pad_token_id])
        self.is_suppressed = torch.zeros(config.vocab_size, dtype=torch.bool, device=talker.device)  # [V]
        self.is_suppressed[config.tts_codec_start_token_id] = True
        self.greedy = QWEN2_5_OMNI_TALKER_GREEDY
        self.min_new_tokens = 0
        self.runaway = RUNAWAY_LIMITS_50_HZ
        self.codec_mask_id = config.tts_codec_mask_token_id
        self.codec_pad_id = config.tts_codec_pad_token_id
        self.codec_bos_id = config.tts_codec_start_token_id

    def project(self, embeds: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.talker.thinker_to_talker_proj(embeds)

    def prompt_codes(self, request: TalkerRequest) -> list[int]:
        """The prefill's ids `[codec_mask] * P + [codec_pad, codec_bos]` (L = P + 2 rows)."""
        num_prompt = request.prefill_embeds.shape[0] - 2
        return [self.codec_mask_id] * num_prompt + [self.codec_pad_id, self.codec_bos_id]

    def make_frames(self, code0, last_hidden, text, requests):
        with torch.no_grad():
            codec_embed = self.talker.get_input_embeddings()(code0)  # [R, D]
        return code0[:, None], self.project(codec_embed + text)  # [R, 1], [R, H]


class TalkerBatch:
    """The talker state over the active requests (see the module docstring).

    talker: transformers' talker (`Qwen3OmniMoeTalkerForConditionalGeneration` or
    `Qwen2_5OmniTalkerForConditionalGeneration`). frames: the family's `FrameMaker`; None makes Qwen3's
    (`Qwen3FrameMaker(talker, max_batch_size, predictor)`). decoder: its decoder's packed weights
    (`PackedDecoder.from_module(talker.model)`), made here when None; pass one to share it between batches.
    Row i of the batch is KV slot i."""

    def __init__(
        self, talker, max_batch_size: int = 8, predictor: CodePredictorRunner | None = None,
        decoder: PackedDecoder | None = None, frames: FrameMaker | None = None,
    ):
        self.talker = talker
        self.max_batch_size = max_batch_size
        if frames is not None and predictor is not None:
            raise ValueError("predictor: give it to the FrameMaker (frames), not to both")
        self.frames = frames or Qwen3FrameMaker(talker, max_batch_size, predictor)
        if decoder is not None and not isinstance(decoder, PackedDecoder):
            raise ValueError(f"decoder must be None or a PackedDecoder, got {type(decoder).__name__}")
        self.decoder = decoder or PackedDecoder.from_module(talker.model)
        self.kv = KVCache(self.decoder, max_batch_size, capacity=KV_START_CAPACITY)
        self.rows: list[_Row] = []
        self.last_hidden: torch.Tensor | None = None  # [B, H] talker output at the last position
        self.code0: torch.Tensor | None = None  # [B] sampled, its frame not made yet
        self.seen: torch.Tensor | None = None  # [B, V] talker tokens each row has seen (repetition penalty)

    @property
    def request_ids(self) -> list[Hashable]:
        return [row.request.request_id for row in self.rows]

    def admit(self, requests: list[TalkerRequest]) -> list[TalkerFrame]:
        """Prefill `requests` and merge them into the batch. Returns the frames of requests that ended
        before their first frame (codec EOS straight after the prefill); those stay until retired."""
        if len(self.rows) + len(requests) > self.max_batch_size:
            raise ValueError(f"requests: {len(requests)} more would exceed max_batch_size={self.max_batch_size}")
        known = set(self.request_ids)
        for request in requests:
            if request.request_id in known:
                raise ValueError(f"requests: request_id {request.request_id!r} is already in the batch")
            known.add(request.request_id)
        if not requests:
            return []
        hidden = torch.cat([
            self._prefill(slot, request) for slot, request in enumerate(requests, start=len(self.rows))
        ])  # [N, H]: one prefill per request, in its slot
        new_rows = [
            _Row(r, list(r.trailing_text.unbind(0)), r.is_text_finished, num_text_rows=r.trailing_text.shape[0],
                 repeats=None if r.runaway is None else RepeatDetector(r.runaway.repeat_frames,
                                                                       r.runaway.max_repeat_period))
            for r in requests
        ]
        seen = torch.zeros((len(requests), self.frames.is_suppressed.shape[0]), dtype=torch.bool, device=hidden.device)
        for i, request in enumerate(requests):
            seen[i, self.frames.prompt_codes(request)] = True
        code0 = self._sample_code0(hidden, seen, new_rows, [0] * len(new_rows))  # [N]
        self._merge(new_rows, hidden, code0, seen)
        finished = []
        for row, code in zip(new_rows, code0.tolist(), strict=True):
            if code in self.frames.eos_ids:
                row.finish_reason = "stop"
                finished.append(TalkerFrame(row.request.request_id, None, "stop"))
            elif row.repeats is not None:
                row.repeats.push(code)
        return finished

    def push_text(self, request_id: Hashable, rows: torch.Tensor, is_finished: bool) -> None:
        """More reply rows [n, H] for a request admitted with is_text_finished=False."""
        row = self.rows[self.request_ids.index(request_id)]
        if row.is_text_finished:
            raise ValueError(f"request_id {request_id!r}: its text is already finished")
        row.text_rows.extend(rows.unbind(0))
        row.num_text_rows += rows.shape[0]
        row.is_text_finished = is_finished

    def park(self, request_id: Hashable) -> ParkedTalker:
        """Take a request out of the batch with everything `resume` needs to go on where it stopped."""
        i = self.request_ids.index(request_id)
        parked = ParkedTalker(self.rows[i], self.kv.save(i), self.last_hidden[i].clone(), self.code0[i].clone(),
                              self.seen[i].clone())
        self.retire([request_id])
        return parked

    def resume(self, parked: ParkedTalker) -> None:
        """Put a parked request back into the batch, in the next free slot."""
        if len(self.rows) >= self.max_batch_size:
            raise ValueError(f"parked: the batch is full (max_batch_size={self.max_batch_size})")
        if parked.request_id in self.request_ids:
            raise ValueError(f"parked: request_id {parked.request_id!r} is already in the batch")
        self.kv.load(len(self.rows), parked.kv)
        self._merge([parked.row], parked.last_hidden[None], parked.code0[None], parked.seen[None])

    def is_ready(self, request_id: Hashable) -> bool:
        """Whether the next step makes a frame for the request (it has its next text row, or needs none)."""
        return self.rows[self.request_ids.index(request_id)].is_ready

    def num_text_rows(self, request_id: Hashable) -> int:
        """The reply rows a request has that its frames have not consumed yet."""
        return len(self.rows[self.request_ids.index(request_id)].text_rows)

    def step(self) -> list[TalkerFrame]:
        """One frame for every ready request: `take_frames`, then `advance`."""
        taken = self.take_frames()
        return [] if taken is None else self.advance(taken)

    def take_frames(self) -> TakenFrames | None:
        """The first half of a step: this step's frame of every ready request (its codes are final), and the
        talker inputs `advance` forwards (None when no request is ready). A caller may use the codes (decode
        a first audio chunk) before `advance`; nothing may be admitted, retired or parked in between."""
        ready = [i for i, row in enumerate(self.rows) if row.is_ready]
        if not ready:
            return None
        index = torch.tensor(ready, device=self.code0.device)
        rows = [self.rows[i] for i in ready]
        text = torch.stack([_pop_text_row(row) for row in rows])  # [R, D]
        codes, next_inputs = self.frames.make_frames(
            self.code0[index], self.last_hidden[index], text, [row.request for row in rows]
        )  # [R, G], [R, H]
        return TakenFrames([row.request.request_id for row in rows], ready, codes, next_inputs)

    def advance(self, taken: TakenFrames) -> list[TalkerFrame]:
        """The second half of a step: the talker forward of `taken`'s next inputs and code 0 of each request's
        next frame → the step's frames, with their finish reasons (codec EOS next, or max_frames)."""
        ready = taken.rows
        if any(i >= len(self.rows) or self.rows[i].request.request_id != request_id
               for i, request_id in zip(ready, taken.request_ids, strict=True)):
            raise RuntimeError("taken: the batch changed between take_frames and advance")
        index = torch.tensor(ready, device=self.code0.device)
        rows = [self.rows[i] for i in ready]
        hidden = self._forward(taken.next_inputs[:, None], ready)  # [R, H]
        self.seen[index, self.code0[index]] = True
        next_code0 = self._sample_code0(hidden, self.seen[index], rows, [row.num_frames + 1 for row in rows])
        self.last_hidden = self.last_hidden.index_copy(0, index, hidden)
        self.code0 = self.code0.index_copy(0, index, next_code0)
        return [
            self._finish_frame(i, frame_codes, code)
            for i, frame_codes, code in zip(ready, taken.codes, next_code0.tolist(), strict=True)
        ]

    def retire(self, request_ids: list[Hashable]) -> None:
        """Drop requests (finished or cancelled) from the batch; call between steps."""
        dropped = set(request_ids)
        unknown = dropped - set(self.request_ids)
        if unknown:
            raise ValueError(f"request_ids: not in the batch: {sorted(map(repr, unknown))}")
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in dropped]
        self.rows = [self.rows[i] for i in keep]
        self.kv.keep(keep)
        if not keep:
            self.last_hidden = self.code0 = self.seen = None
            return
        index = torch.tensor(keep, device=self.code0.device)
        self.last_hidden = self.last_hidden[index]
        self.code0, self.seen = self.code0[index], self.seen[index]

    # --- pieces of a step -------------------------------------------------------------------

    def _prefill(self, slot: int, request: TalkerRequest) -> torch.Tensor:
        """The request's prefill into its slot → post-norm hidden at its last position [1, H]: in one forward, or
        (longer than its prefill_block) the reused prefix's KV loaded, then the rest in blocks from position 0."""
        self.kv.reset(slot)
        embeds, block = request.prefill_embeds, request.prefill_block
        if request.prefill_positions is not None or block is None or embeds.shape[0] <= block:
            positions = None if request.prefill_positions is None else request.prefill_positions[:, None]
            return self._forward(self.frames.project(embeds[None]), [slot], positions)
        num_rows = embeds.shape[0]
        # at least one row is forwarded: code 0 comes from the last row's hidden state
        num_reused = 0 if request.prefix is None else request.prefix.matching_rows(embeds, num_rows - 1)
        if num_reused:
            self.kv.load(slot, request.prefix.kv.head(num_reused))
        request.reused_rows = num_reused
        for start in range(num_reused, num_rows, block):
            hidden = self._forward(self.frames.project(embeds[None, start : start + block]), [slot])
        num_kept = num_rows // block * block
        if request.keeps_prefix:
            request.kept_prefix = TalkerPrefix(embeds[:num_kept].clone(), self.kv.save(slot, num_kept), block)
        return hidden

    def _forward(self, embeds: torch.Tensor, slots: list[int], rope_positions=None) -> torch.Tensor:
        """Talker forward of embeds [R, T, H] appended to KV slots `slots` (RoPE at rope_positions
        [3, R, T], else the slots' positions) → post-norm hidden at the last position [R, H]."""
        with torch.no_grad():
            return decoder_forward(self.decoder, self.kv, embeds, slots, rope_positions=rope_positions).last_hidden

    def _sample_code0(
        self, hidden: torch.Tensor, seen: torch.Tensor, rows: list[_Row], num_generated: list[int]
    ) -> torch.Tensor:
        """Codebook 0 for each row: [R, H] → [R], as transformers' talker `generate` picks it (repetition
        penalty, then the suppressed ids and, while a row has generated fewer than `min_new_tokens` talker
        tokens (num_generated), EOS, then the sampler)."""
        with torch.no_grad():
            logits = self.talker.codec_head(hidden).float()  # [R, V]
        codes = []
        for i, row in enumerate(rows):
            sampling = row.request.sampling or self.frames.greedy
            scores = apply_repetition_penalty(logits[i : i + 1], seen[i : i + 1], sampling.repetition_penalty)
            scores = scores.masked_fill(self.frames.is_suppressed, float("-inf"))  # [1, V]
            if num_generated[i] < self.frames.min_new_tokens:
                scores[:, sorted(self.frames.eos_ids)] = float("-inf")
            generators = [row.request.generator] if row.request.generator is not None else None
            codes.append(sample(scores, sampling, generators))
        return torch.cat(codes)

    def _finish_frame(self, i: int, codes: torch.Tensor, next_code0: int) -> TalkerFrame:
        row = self.rows[i]
        row.num_frames += 1
        runaway = row.request.runaway
        if next_code0 in self.frames.eos_ids:
            row.finish_reason = "stop"
        elif row.num_frames >= row.request.max_frames:
            row.cut_by = "max_frames"
        elif runaway is not None and row.num_frames >= runaway.max_text_frames(row.num_text_rows):
            row.cut_by = "text_length"
        elif row.repeats is not None and row.repeats.push(next_code0):
            row.cut_by = "repetition"
        if row.cut_by is not None:
            row.finish_reason = "length"
        return TalkerFrame(row.request.request_id, codes, row.finish_reason, row.cut_by)

    def _merge(self, new_rows, hidden, code0, seen) -> None:
        if not self.rows:
            self.rows, self.last_hidden, self.code0, self.seen = new_rows, hidden, code0, seen
            return
        self.rows = self.rows + new_rows
        self.last_hidden = torch.cat([self.last_hidden, hidden])
        self.code0 = torch.cat([self.code0, code0])
        self.seen = torch.cat([self.seen, seen])


def _pop_text_row(row: _Row) -> torch.Tensor:
    return row.text_rows.pop(0) if row.text_rows else row.request.tts_pad_embed
