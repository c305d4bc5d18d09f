"""Qwen3-Omni talker inputs from the thinker's rows, as transformers' `Qwen3OmniMoeForConditionalGeneration.generate`
builds them, one request at a time.

Layout (transformers `_get_talker_user_parts` / `_get_talker_assistant_parts`), for a prompt
`... <|im_start|>user\\n ... <|im_end|>\\n <|im_start|>assistant\\n` and reply tokens g0, g1, ...:

    prefill = [user rows]                               every position whose turn is "user": text rows through
                                                        text_projection(layer 0), multimodal rows through
                                                        hidden_projection(layer accept_hidden_layer)
            + 9 assistant rows   text side  [im_start, assistant, \\n, tts_pad x4, tts_bos, g0]   (text_projection)
                                 codec side [0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos]
    prefill_ids = user token ids + [tts_pad] * 9
    trailing_text = [g1, g2, ..., last kept token, tts_eos]          (text_projection)
    tts_pad_embed = text_projection(embed(tts_pad))

System turns and earlier assistant turns are dropped. "Last kept token" follows the stop-row trim
(`omnimtp.handoff.trim_thinker_hidden`): transformers never forwards the last generated token, so its
rows end one short of the output and both a stop-finished and a length-finished run speak g0..g_{N-2};
rows from an engine that forwards more (a batch that keeps forwarding a finished request, an engine that
forwards the stop token) are cut to the same target.

Where we deliberately differ from transformers:
- batches: it locates the assistant turn in row 0 and applies that index to every row; we build each
  request from its own prompt (call once per request);
- numerics of `projection="per_row"`: transformers projects the assistant turn and all reply rows in ONE
  `text_projection` call, and a matmul's result for a row depends (in the last bits) on how many rows
  share the call. `projection="reference"` (default) reproduces that call and is bit-identical to
  transformers; a stream cannot know the reply length when it must emit the prefill, so it projects each
  row on its own: `projection="per_row"` is that construction, bit-identical to the streamed chunks and
  within float rounding (~1e-6) of the reference;
- a prompt with no user turn gives an empty user part (transformers' `[:, -0:]` slice would take every
  prompt position);
- with a `prefill_block` B and a prefill longer than B (U + 9 > B), the user rows are projected in blocks of B
  user rows from the first (one call per kind and block), so a block's rows are the same bits in every turn
  that has the same rows there, which is what lets the talker reuse the KV of earlier turns' blocks
  (`omnimtp.talker.loop.TalkerPrefix`); shorter prefills are projected as transformers does.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from omnimtp.handoff import (
    TalkerInputs,
    check_prefill_rows,
    check_rows,
    talker_inputs_from_rows,
    trim_thinker_hidden,
)
from omnimtp.media import MediaInputs

PROJECTIONS = ("reference", "per_row")
NUM_ASSISTANT_ROWS = 9


def prompt_list(prompt_ids) -> list[int]:
    """Prompt token ids (a list or a 1-D tensor) as a list of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids: expected a 1-D tensor or a list, got shape {tuple(prompt_ids.shape)}")
        return [int(token) for token in prompt_ids.tolist()]
    return [int(token) for token in prompt_ids]


def lookup_speaker(speaker_ids: dict, speaker: str):
    """Case-insensitive speaker lookup; an unknown name raises ValueError listing the known speakers."""
    by_name = {name.lower(): value for name, value in speaker_ids.items()}
    if not isinstance(speaker, str) or speaker.lower() not in by_name:
        raise ValueError(f"speaker: unknown speaker {speaker!r}; known speakers: {sorted(speaker_ids)}")
    return by_name[speaker.lower()]


def trimmed_thinker_rows(
    dim: int,
    prompt: list[int],
    output_ids: Sequence[int],
    thinker_embeds: torch.Tensor,  # [R, D]
    thinker_hidden: torch.Tensor,  # [R, D]
    finish_reason: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both thinker row sets checked against each other and cut by the stop-row trim → ([R', D], [R', D])."""
    check_rows("thinker_embeds", thinker_embeds, dim)
    check_rows("thinker_hidden", thinker_hidden, dim)
    if thinker_hidden.shape[0] != thinker_embeds.shape[0]:
        raise ValueError(
            f"thinker_hidden: {thinker_hidden.shape[0]} rows for {thinker_embeds.shape[0]} thinker_embeds rows"
        )
    if thinker_embeds.shape[0] < len(prompt):
        raise ValueError(f"thinker_embeds: {thinker_embeds.shape[0]} rows cannot cover the {len(prompt)} prompt tokens")
    embeds_prefill, embeds_decode, _ = trim_thinker_hidden(thinker_embeds, prompt, output_ids, finish_reason)
    hidden_prefill, hidden_decode, _ = trim_thinker_hidden(thinker_hidden, prompt, output_ids, finish_reason)
    return torch.cat([embeds_prefill, embeds_decode], dim=0), torch.cat([hidden_prefill, hidden_decode], dim=0)


class Qwen3TalkerInputBuilder:
    """Builds one request's Qwen3-Omni talker inputs; see the module docstring for the layout.

    Satisfies `omnimtp.handoff.TalkerInputBuilder`, so `ThinkerToTalkerStream(builder)` streams it:
    `build_prefill` takes thinker rows 0..num_prefill_rows-1 (the prompt up to the assistant turn's 4th row,
    g0 for a prompt ending in "<|im_start|>assistant\\n"); `build_trailing` projects each later row alone."""

    @torch.no_grad()
    def __init__(
        self, model: Qwen3OmniMoeForConditionalGeneration, prompt_ids, speaker: str, media: MediaInputs | None = None,
        prefill_block: int | None = None,
    ):
        config = model.config
        self.prefill_block = prefill_block
        talker_config = config.talker_config
        self.model = model
        self.prompt_ids = prompt_list(prompt_ids)
        self.speaker_id = lookup_speaker(talker_config.speaker_id, speaker)
        num_prompt = len(self.prompt_ids)
        self.num_prompt_rows = num_prompt
        self.thinker_dim = config.thinker_config.text_config.hidden_size
        self.talker_dim = talker_config.text_config.hidden_size

        # the config's ids read once: a transformers config attribute costs microseconds, a prompt has thousands
        im_start, assistant, user = config.im_start_token_id, config.assistant_token_id, config.user_token_id
        prompt = self.prompt_ids
        # the last "<|im_start|>assistant" of the prompt opens the turn the talker speaks
        starts = [i for i in range(num_prompt - 1) if prompt[i] == im_start and prompt[i + 1] == assistant]
        if not starts:
            raise ValueError("prompt_ids: no '<|im_start|>assistant' turn to speak")
        self.assistant_start = starts[-1]
        self.num_prefill_rows = self.assistant_start + 4

        # a position's turn is named by the token after the last <|im_start|> at or before it
        self.user_positions = []
        last_im_start = 0
        for position, token in enumerate(prompt):
            if token == im_start:
                last_im_start = position
            if prompt[min(last_im_start + 1, num_prompt - 1)] == user:
                self.user_positions.append(position)
        thinker_config = config.thinker_config
        multimodal_ids = {thinker_config.audio_token_id, thinker_config.image_token_id, thinker_config.video_token_id}
        self.multimodal_mask = torch.tensor([token in multimodal_ids for token in self.prompt_ids], dtype=torch.bool)

        talker = model.talker
        device = talker.text_projection.linear_fc1.weight.device
        special_ids = torch.tensor(
            [[config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]], device=device
        )
        special_rows = talker.text_projection(model.thinker.get_input_embeddings()(special_ids))[0]  # [3, D_talker]
        self.tts_bos_embed, self.tts_eos_embed, self.tts_pad_embed = special_rows[0], special_rows[1], special_rows[2]
        self.end_rows = special_rows[1:2]  # [1, D_talker]: tts_eos
        codec_ids = torch.tensor(
            [
                talker_config.codec_nothink_id, talker_config.codec_think_bos_id, talker_config.codec_think_eos_id,
                self.speaker_id, talker_config.codec_pad_id, talker_config.codec_bos_id,
            ],
            device=device,
        )
        codec_rows = talker.get_input_embeddings()(codec_ids)  # [6, D_talker]
        zeros = torch.zeros(3, self.talker_dim, dtype=codec_rows.dtype, device=device)
        self.assistant_codec_rows = torch.cat([zeros, codec_rows], dim=0)  # [9, D_talker]
        self.assistant_ids = [config.tts_pad_token_id] * NUM_ASSISTANT_ROWS
        self.prefill_positions = self._prefill_positions(media)

    def _prefill_positions(self, media: MediaInputs | None) -> torch.Tensor | None:
        """[3, U + 9] M-RoPE ids of the talker prefill when the prompt has images or videos, from the
        talker's own `get_rope_index` on its prefill ids as transformers' talker computes them (its user
        turns keep the vision ids); None otherwise (audio and text: 1-D positions)."""
        if media is None or not media.has_vision:
            return None
        talker = self.model.talker
        ids = torch.tensor([[self.prompt_ids[p] for p in self.user_positions] + self.assistant_ids])
        ids = ids.to(talker.device)
        owner = talker
        if media.has_audio and not hasattr(talker.config, "audio_config"):
            # transformers' talker config has no audio_config, so its get_rope_index fails on a prompt with
            # audio and images (transformers' generate raises there); the audio runs' lengths need the
            # audio encoder's n_window, which is the thinker's
            config = copy.copy(talker.config)
            config.audio_config = self.model.config.thinker_config.audio_config
            owner = SimpleNamespace(
                config=config, spatial_merge_size=talker.spatial_merge_size,
                get_llm_pos_ids_for_vision=talker.get_llm_pos_ids_for_vision,
            )
        positions, _ = type(talker).get_rope_index(
            owner, ids, media.image_grid_thw, media.video_grid_thw, torch.ones_like(ids), False, media.audio_lengths,
            media.seconds_per_grid(self.model.config.thinker_config.vision_config.temporal_patch_size),
        )
        return positions[:, 0]  # [3, L]

    def _user_rows(self, prompt_embeds: torch.Tensor, prompt_hidden: torch.Tensor) -> torch.Tensor:
        """[U, D_talker], projected over the whole prompt in one call per kind, as transformers does, or in blocks
        of user rows when the prefill is longer than prefill_block (see the module docstring)."""
        block, num_user = self.prefill_block, len(self.user_positions)
        if block is not None and num_user + NUM_ASSISTANT_ROWS > block:
            return torch.cat([
                self._project(prompt_embeds, prompt_hidden, self.user_positions[start : start + block])
                for start in range(0, num_user, block)
            ])
        talker = self.model.talker
        rows = torch.empty(self.num_prompt_rows, self.talker_dim, dtype=talker.dtype, device=prompt_embeds.device)
        mask = self.multimodal_mask.to(prompt_embeds.device)
        if mask.any():
            rows[mask] = talker.hidden_projection(prompt_hidden[mask])
        rows[~mask] = talker.text_projection(prompt_embeds[~mask])
        return rows[self.user_positions]

    def _project(self, prompt_embeds: torch.Tensor, prompt_hidden: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The user rows at `positions` [n, D_talker], one projection call per kind."""
        talker = self.model.talker
        index = torch.tensor(positions, device=prompt_embeds.device)
        mask = self.multimodal_mask.to(prompt_embeds.device)[index]
        rows = torch.empty(len(positions), self.talker_dim, dtype=talker.dtype, device=prompt_embeds.device)
        if mask.any():
            rows[mask] = talker.hidden_projection(prompt_hidden[index[mask]])
        if not mask.all():
            rows[~mask] = talker.text_projection(prompt_embeds[index[~mask]])
        return rows

    def _project_each(self, embeds: torch.Tensor) -> torch.Tensor:
        """text_projection of each row on its own: [n, D_thinker] -> [n, D_talker]."""
        rows = [self.model.talker.text_projection(embeds[i : i + 1].unsqueeze(0))[0] for i in range(embeds.shape[0])]
        return torch.cat(rows, dim=0) if rows else embeds.new_zeros(0, self.talker_dim)

    def _prefill(self, embeds: torch.Tensor, hidden: torch.Tensor, assistant_text: torch.Tensor):
        """Prefill from the prompt rows and the projected first 4 rows of the assistant turn."""
        text_rows = torch.cat(
            [
                assistant_text[:3],  # im_start, assistant, \n
                self.tts_pad_embed.expand(4, -1),
                self.tts_bos_embed.unsqueeze(0),
                assistant_text[3:4],  # first reply token
            ],
            dim=0,
        )  # [9, D_talker]
        assistant_rows = text_rows + self.assistant_codec_rows
        num_prompt = self.num_prompt_rows
        user_rows = self._user_rows(embeds[:num_prompt], hidden[:num_prompt])
        prefill_embeds = torch.cat([user_rows, assistant_rows], dim=0)  # [U + 9, D_talker]
        user_ids = [self.prompt_ids[position] for position in self.user_positions]
        prefill_ids = torch.tensor(user_ids + self.assistant_ids, dtype=torch.long, device=prefill_embeds.device)
        return prefill_embeds, prefill_ids

    @torch.no_grad()
    def build_prefill(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..num_prefill_rows-1 -> (prefill_embeds [U + 9, D_talker], prefill_ids [U + 9])."""
        assistant_text = self._project_each(embeds[self.assistant_start : self.num_prefill_rows])  # [4, D_talker]
        return self._prefill(embeds, hidden, assistant_text)

    @torch.no_grad()
    def build_trailing(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Reply rows after the first -> trailing text rows [n, D_talker], each projected alone."""
        return self._project_each(embeds)

    @torch.no_grad()
    def build(self, embeds: torch.Tensor, hidden: torch.Tensor, projection: str = "reference") -> TalkerInputs:
        """Full-payload construction on already-trimmed rows [R', D_thinker]."""
        if projection == "per_row":
            return talker_inputs_from_rows(self, embeds, hidden)
        check_prefill_rows(embeds.shape[0], self.num_prefill_rows)
        # transformers: one text_projection call over the assistant turn and every reply row
        assistant_text = self.model.talker.text_projection(embeds[self.assistant_start :].unsqueeze(0))[0]
        prefill_embeds, prefill_ids = self._prefill(embeds, hidden, assistant_text)
        trailing = torch.cat([assistant_text[4:], self.end_rows], dim=0)
        return TalkerInputs(prefill_embeds, prefill_ids, trailing, self.tts_pad_embed)


@torch.no_grad()
def build_qwen3_talker_inputs(
    model: Qwen3OmniMoeForConditionalGeneration,
    prompt_ids: Sequence[int] | torch.Tensor,  # [P]
    output_ids: Sequence[int],  # [N], as sampled, stop token included
    thinker_embeds: torch.Tensor,  # [R, D_thinker], layer 0 (input embeddings), one row per forwarded position
    thinker_hidden: torch.Tensor,  # [R, D_thinker], layer accept_hidden_layer
    finish_reason: str,
    speaker: str,
    projection: str = "reference",
) -> TalkerInputs:
    """One request's Qwen3-Omni talker inputs, with the stop-row trim of `trim_thinker_hidden`.

    With rows captured from transformers' own thinker run (`R = P + N − 1`) and `projection="reference"`, the
    result equals what `Qwen3OmniMoeForConditionalGeneration.generate` passes to `talker.generate` for that
    request, bit for bit. Raises ValueError for bad ranks, a D mismatch, R < P, an unknown finish reason or
    speaker, a prompt without an assistant turn, and a reply left with no row to speak."""
    if projection not in PROJECTIONS:
        raise ValueError(f"projection: expected one of {PROJECTIONS}, got {projection!r}")
    prompt = prompt_list(prompt_ids)
    embeds, hidden = trimmed_thinker_rows(
        model.config.thinker_config.text_config.hidden_size,
        prompt, output_ids, thinker_embeds, thinker_hidden, finish_reason,
    )
    return Qwen3TalkerInputBuilder(model, prompt, speaker).build(embeds, hidden, projection)
