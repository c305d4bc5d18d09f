"""What a model family gives the engine core: the small interface `EngineCore` calls.

A family (`omnimtp.families.qwen3_omni.Qwen3OmniFamily`) owns a model's weights (packed once) and
everything model-specific: prompt ids, the thinker run, the talker-input builder, the talker batch,
the codec. A second family (`omnimtp.families.qwen2_5_omni.Qwen2_5OmniFamily`) is one module implementing this,
not a fork of the loop. A family without a thinker (`omnimtp.families.qwen3_tts.Qwen3TTSFamily`, `has_chat`
False) takes speech requests only: they go straight to `speech_talker_inputs`, and its chat methods refuse.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from omnimtp.media import MediaInputs
from omnimtp.sampling import SamplingParams


class Family(Protocol):
    model_type: str  # the checkpoint's config.json model_type (a key of `omnimtp.families.FAMILIES`)
    sample_rate: int
    num_code_groups: int
    codec_looks_ahead: bool  # the codec holds a chunk's samples back until later frames (or is_final) come
    device: torch.device  # where the weights are: requests' generators and sampling live there

    def check_speaker(self, speaker: str) -> None:
        """ValueError naming `speaker` unless the model has that speaker."""

    def check_media(self, prompt_ids: list[int], media: MediaInputs | None) -> None:
        """ValueError unless the prompt's media placeholders match `media` (before anything runs)."""

    def decode_text(self, ids: list[int]) -> str:
        """Reply ids → text (special tokens skipped)."""

    def new_thinker(self, prompts: list[list[int]], sampling: list[SamplingParams | None],
                    generators: list[torch.Generator], max_new_tokens: int, media: list[MediaInputs | None],
                    prefill_block: int | None = None, prefixes: list | None = None,
                    keeps_prefix: list[bool] | None = None, plain_start_steps: int = 0,
                    logprobs: list[int | None] | None = None):
        """A thinker run over the prompts and their media (`omnimtp.thinker.ThinkerRun`: `step()` → events
        with token_id, embeds [n, D], hidden [n, D], finish_reason; `is_finished`). A speculative run emits
        several events per request and step, in order, and has `spec_stats` (one `SpecStats` per prompt).
        prefill_block, prefixes, keeps_prefix: blocked prefills and prefix reuse (`ThinkerRun`: `reused_rows`,
        `kept_prefixes`); plain_start_steps: a speculative run's first steps after the prefill draft nothing;
        logprobs: per prompt, None or the alternatives its events' `TokenLogprob`s list (`ThinkerRun`)."""

    def talker_builder(self, prompt_ids: list[int], speaker: str, media: MediaInputs | None,
                       prefill_block: int | None = None):
        """The request's `omnimtp.handoff.TalkerInputBuilder` (streamed handoff and reply inputs); its
        `prefill_positions` ([3, L] or None) are the talker prefill's RoPE positions. prefill_block: the talker
        prefill runs in blocks of it when longer (`omnimtp.talker.loop.TalkerRequest`), so its rows must be the
        same bits per block whatever follows them."""

    def reply_talker_inputs(self, builder, prompt_ids: list[int], output_ids: list[int], embeds: torch.Tensor,
                            hidden: torch.Tensor, finish_reason: str):
        """The talker inputs (`omnimtp.handoff.TalkerInputs`) of a finished reply from all its rows."""

    def speech_talker_inputs(self, ids: list[int], speaker):
        """The talker inputs that speak a speech request's text in `speaker` (a name, or the family's voice
        object: Qwen3-TTS's `TTSVoice`)."""

    def speech_stream(self, speaker):
        """A speech request's talker inputs as its ids arrive (`omnimtp.handoff.SpeechTextStream`): joined, they are
        `speech_talker_inputs` of all the ids, bit for bit."""

    def new_talker_batch(self, max_batch_size: int):
        """The batched talker state (`omnimtp.talker.loop.TalkerBatch`: admit / push_text / step / retire), admitting
        `omnimtp.talker.loop.TalkerRequest`s."""

    def new_codec_stream(self, speaker: str, generator: torch.Generator | None):
        """A request's codec state (its decoded history) for `speaker`; generator: the request's codec noise
        (`Request.codec_generator`; None: torch's global RNG when the audio is decoded)."""

    def decode_audio(self, streams: list, blocks: list[torch.Tensor], is_final: list[bool]) -> list[np.ndarray]:
        """The next audio of several requests: blocks[i] [G, n_i] continues streams[i]; is_final[i]: the
        block ends the request's frames (a codec that looks ahead may hold samples back until then)."""
