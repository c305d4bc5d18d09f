"""Qwen2.5-Omni talker inputs from the thinker's rows (the seed's layout, `omnimtp.handoff.build_talker_prefill`).

transformers' `Qwen2_5OmniForConditionalGeneration.generate` sums each thinker row's last hidden layer and its
input embedding (multimodal placeholder embeddings zeroed), then:

    prefill  = [prompt rows] + [speaker bos embed + codec_pad embed] + [g0 row + codec_bos embed]
    ids      = [codec_mask] * P + [codec_pad, codec_bos]
    decode k = codec embedding of the previous code + trailing_text[k]: [g1, ..., last kept token, text_eos],
               then the text_pad embedding for ever (transformers reuses the last row of its reply part)

The attention-mask trap. transformers adds the codec pad / bos embeddings to the last two prefill rows inside
the talker's forward, and only when that forward gets an attention mask (then it also takes its RoPE
positions from the mask). The talker's `generate` infers a mask from `input_ids != pad_token_id` only when the
pad id (codec_pad) is not one of its EOS ids; the real checkpoint's default EOS ids [8292, 8294] are codec pad
and codec end, so with them (or the config's end and pad ids) no mask is inferred, the all-ones default is
dropped, and the talker sees the prefill WITHOUT the two codec embeddings, at 1-D positions 0..P+1. So:

    layout="seed"      the intended prefill (both codec embeddings added), the seed's worked layout
    layout="generate"  what `generate` runs with the config's EOS ids: speaker bos row, g0 row, no codec rows
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Qwen2_5OmniForConditionalGeneration

from omnimtp.handoff import (
    TalkerInputs,
    build_talker_prefill,
    talker_inputs_from_rows,
)
from omnimtp.talker.qwen3_inputs import lookup_speaker, prompt_list, trimmed_thinker_rows

PREFILL_LAYOUTS = ("seed", "generate")


class Qwen2_5TalkerInputBuilder:
    """Builds one request's Qwen2.5-Omni talker inputs; satisfies `omnimtp.handoff.TalkerInputBuilder`.

    Rows are in the thinker's width (the talker applies `thinker_to_talker_proj` itself). `hidden` rows are
    the thinker's last hidden layer. layout: "seed" or "generate" (see the module docstring)."""

    @torch.no_grad()
    def __init__(self, model: Qwen2_5OmniForConditionalGeneration, prompt_ids, speaker: str, layout: str = "seed"):
        if layout not in PREFILL_LAYOUTS:
            raise ValueError(f"layout must be one of {PREFILL_LAYOUTS}, got {layout!r}")
        talker = model.talker
        self.prompt_ids = prompt_list(prompt_ids)
        self.num_prompt_rows = len(self.prompt_ids)
        self.num_prefill_rows = self.num_prompt_rows + 1  # the prompt and g0
        speaker_params = lookup_speaker(model.speaker_map, speaker)
        thinker_config = model.config.thinker_config
        multimodal_ids = (
            thinker_config.audio_token_index, thinker_config.image_token_index, thinker_config.video_token_index
        )
        self.multimodal_mask = torch.tensor([token in multimodal_ids for token in self.prompt_ids], dtype=torch.bool)

        table = model.thinker.get_input_embeddings()
        device = table.weight.device
        text_ids = torch.tensor(
            [speaker_params["bos_token"], talker.text_eos_token, talker.text_pad_token], device=device
        )
        speaker_bos, text_eos, text_pad = table(text_ids)  # 3 x [D]
        self.speaker_embed = speaker_bos
        self.end_rows = text_eos.unsqueeze(0)  # [1, D]
        self.tts_pad_embed = text_pad
        codec = talker.get_input_embeddings()(
            torch.tensor([talker.codec_pad_token, talker.codec_bos_token], device=device)
        )  # [2, D]
        if layout == "generate":
            codec = torch.zeros_like(codec)
        self.codec_pad_embed, self.codec_bos_embed = codec[0], codec[1]
        self.codec_mask_id = talker.codec_mask_token
        self.codec_pad_id = talker.codec_pad_token
        self.codec_bos_id = talker.codec_bos_token
        self.prefill_positions = None  # text prompts: 1-D positions (no media path for Qwen2.5-Omni yet)

    def build_prefill(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0..P (prompt and g0) -> (prefill_embeds [P + 2, D], prefill_ids [P + 2])."""
        num_prompt = self.num_prompt_rows
        prompt_embeds = embeds[:num_prompt].masked_fill(self.multimodal_mask.to(embeds.device).unsqueeze(-1), 0.0)
        prompt_rows = hidden[:num_prompt] + prompt_embeds  # [P, D]
        first_reply = hidden[num_prompt] + embeds[num_prompt]  # [D]
        ids, prefill_embeds = build_talker_prefill(
            prompt_rows, first_reply, self.speaker_embed, self.codec_pad_embed, self.codec_bos_embed,
            self.codec_mask_id, self.codec_pad_id, self.codec_bos_id,
        )
        return prefill_embeds, torch.tensor(ids, dtype=torch.long, device=prefill_embeds.device)

    def build_trailing(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Reply rows after the first -> [n, D]: last hidden layer + input embedding, row by row."""
        return hidden + embeds


@torch.no_grad()
def build_qwen2_5_talker_inputs(
    model: Qwen2_5OmniForConditionalGeneration,
    prompt_ids: Sequence[int] | torch.Tensor,  # [P]
    output_ids: Sequence[int],  # [N], stop token included
    thinker_embeds: torch.Tensor,  # [R, D], layer 0 (input embeddings)
    thinker_hidden: torch.Tensor,  # [R, D], last hidden layer
    finish_reason: str,
    speaker: str,
    layout: str = "seed",
) -> TalkerInputs:
    """One request's Qwen2.5-Omni talker inputs in `layout`, with the stop-row trim."""
    prompt = prompt_list(prompt_ids)
    embeds, hidden = trimmed_thinker_rows(
        model.config.thinker_config.text_config.hidden_size,
        prompt, output_ids, thinker_embeds, thinker_hidden, finish_reason,
    )
    return talker_inputs_from_rows(Qwen2_5TalkerInputBuilder(model, prompt, speaker, layout), embeds, hidden)
