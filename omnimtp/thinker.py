"""An explicit thinker decode loop over an omni thinker (Qwen3-Omni, Qwen2.5-Omni) on packed weights
(`PackedDecoder`).

Each request has its own KV slot: the prefill runs per request (no padding), then one forward per
step over the requests still writing. Every forward's rows of the layer-0 input embeddings and of
the hidden state at `accept_hidden_layer` (Qwen3-Omni: a middle layer; Qwen2.5-Omni: the number of
layers, the last layer after the final norm) are handed out with the token, which is what the talker
needs. As in `generate`, there is no forward after a request's last token, so a request with P
prompt and N output tokens leaves P + N − 1 captured rows.

    run = ThinkerRun(model.thinker, [[256, 262, 10, 72, 257, 10, 256, 263, 10]], accept_hidden_layer=1,
                     eos_token_ids={257}, max_new_tokens=64)
    while not run.is_finished:
        for event in run.step():   # ThinkerEvent(index, token_id, embeds [n, D], hidden [n, D], finish_reason)
            ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnimtp.media import MediaInputs
from omnimtp.packed_decoder import KVCache, PackedDecoder, decoder_forward
from omnimtp.sampling import SamplingParams, sample


@dataclass
class ThinkerEvent:
    """What one thinker forward produced for one request.

    token_id: the token it sampled, or None when the request was already finished.
    embeds, hidden: the rows of that forward ([P, D] at prefill, [1, D] after, [0, D] when finished).
    finish_reason: "stop" or "length" on the step that finished the request, else None."""

    index: int
    token_id: int | None
    embeds: torch.Tensor
    hidden: torch.Tensor
    finish_reason: str | None


class ThinkerRun:
    """A batch of requests decoded in lockstep; finished requests are no longer forwarded.

    thinker: transformers' `Qwen3OmniMoeThinkerForConditionalGeneration` or
    `Qwen2_5OmniThinkerForConditionalGeneration` (the same layout: `model.language_model`, `lm_head`,
    `get_audio_features`, `get_image_features`, `get_rope_index`). decoder: the packed weights
    of its text model (`PackedDecoder.from_module(thinker.model.language_model)`), made here when
    None; pass one to share it between runs."""

    def __init__(
        self,
        thinker,
        prompts: list[list[int]],
        *,
        accept_hidden_layer: int,
        eos_token_ids: set[int],
        max_new_tokens: int,
        sampling: list[SamplingParams | None] | None = None,
        generators: list[torch.Generator | None] | None = None,
        decoder: PackedDecoder | None = None,
        media: list[MediaInputs | None] | None = None,
    ):
        batch_size = len(prompts)
        if batch_size == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one non-empty prompt")
        self.media = list(media) if media is not None else [None] * batch_size
        if len(self.media) != batch_size or any(m is not None and not isinstance(m, MediaInputs) for m in self.media):
            raise ValueError(f"media must be a list of {batch_size} MediaInputs or None")
        if decoder is not None and not isinstance(decoder, PackedDecoder):
            raise ValueError(f"decoder must be None or a PackedDecoder, got {type(decoder).__name__}")
        num_layers = thinker.config.text_config.num_hidden_layers
        if not 0 <= accept_hidden_layer <= num_layers:
            raise ValueError(f"accept_hidden_layer must be in [0, {num_layers}], got {accept_hidden_layer!r}")
        self.thinker = thinker
        self.decoder = decoder or PackedDecoder.from_module(thinker.model.language_model)
        self.accept_hidden_layer = accept_hidden_layer
        self.eos_token_ids = set(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.sampling = list(sampling) if sampling is not None else [None] * batch_size
        self.generators = list(generators) if generators is not None else [None] * batch_size
        self.output_ids: list[list[int]] = [[] for _ in prompts]
        self.finish_reasons: list[str | None] = [None] * batch_size
        self.prompts = [list(p) for p in prompts]
        capacity = max(len(p) for p in prompts) + max_new_tokens
        self.kv = KVCache(self.decoder, batch_size, capacity=capacity)  # slot i = request i
        self._is_prefill = True

    @property
    def is_finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def step(self) -> list[ThinkerEvent]:
        """One forward for every unfinished request (the first step: each request's prefill) → one
        event per request."""
        active = [i for i, reason in enumerate(self.finish_reasons) if reason is None]
        device = self.decoder.device
        embed_tokens = self.thinker.get_input_embeddings()
        rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # i → embeds, hidden, logits
        with torch.no_grad():
            if self._is_prefill:
                for i in active:
                    prefill = multimodal_prefill(self.thinker, self.prompts[i], self.media[i], device)
                    hidden, logits = self._forward(prefill.embeds, [i], prefill.rope_positions, prefill.layer_adds)
                    rows[i] = (prefill.embeds[0], hidden[0], logits[0])
            elif active:
                ids = torch.tensor([self.output_ids[i][-1] for i in active], device=device)[:, None]  # [R, 1]
                embeds = embed_tokens(ids)  # [R, 1, D]
                hidden, logits = self._forward(embeds, active)
                for r, i in enumerate(active):
                    rows[i] = (embeds[r], hidden[r], logits[r])
        self._is_prefill = False
        sampled = []  # each row with its own sampling and generator, on the device; read back at once
        for i in rows:
            generator = [self.generators[i]] if self.generators[i] is not None else None
            sampled.append(sample(rows[i][2][None].float(), self.sampling[i], generator))
        token_ids = dict(zip(rows, torch.cat(sampled).tolist())) if sampled else {}
        events = []
        for i in range(len(self.output_ids)):
            if i not in rows:
                empty = torch.zeros((0, self.decoder.hidden_size), dtype=self.decoder.dtype, device=device)
                events.append(ThinkerEvent(i, None, empty, empty, None))
                continue
            row_embeds, row_hidden, _ = rows[i]
            token_id = token_ids[i]
            self.output_ids[i].append(token_id)
            if token_id in self.eos_token_ids:
                self.finish_reasons[i] = "stop"
            elif len(self.output_ids[i]) >= self.max_new_tokens:
                self.finish_reasons[i] = "length"
            events.append(ThinkerEvent(i, token_id, row_embeds, row_hidden, self.finish_reasons[i]))
        return events

    def _forward(self, embeds: torch.Tensor, slots: list[int], rope_positions=None, layer_adds=()):
        """embeds [R, T, D] → hidden at accept_hidden_layer [R, T, D] and last-position logits [R, V]."""
        out = decoder_forward(
            self.decoder, self.kv, embeds, slots, capture_layer=self.accept_hidden_layer,
            rope_positions=rope_positions, layer_adds=layer_adds,
        )
        logits = torch.nn.functional.linear(out.last_hidden, self.thinker.lm_head.weight)  # [R, V]
        return out.captured, logits


@dataclass
class Prefill:
    """A prompt's thinker prefill inputs: embeds [1, P, D] (encoder rows scattered in), rope_positions
    [3, 1, P] M-RoPE ids (None: the cache positions, text and audio), layer_adds: deepstack visual
    features [1, P, D] added after layers 0, 1, ... (zero off the visual rows)."""

    embeds: torch.Tensor
    rope_positions: torch.Tensor | None = None
    layer_adds: tuple[torch.Tensor, ...] = ()


@torch.no_grad()
def multimodal_prefill(thinker, prompt: list[int], media: MediaInputs | None, device) -> Prefill:
    """The prefill of one prompt as transformers' thinker model's forward builds it (Qwen3-Omni's and
    Qwen2.5-Omni's alike; Qwen2.5 has no deepstack features): the token
    embeddings; transformers' own audio and vision encoders on the media tensors, their rows in place of
    the `<|audio_pad|>` / `<|image_pad|>` / `<|video_pad|>` ids (one row per id, else ValueError); the
    deepstack features of images and videos; M-RoPE positions from `get_rope_index` when there are images
    or videos (audio and text advance all three axes together: the 1-D cache positions)."""
    config = thinker.config
    ids = torch.tensor([prompt], device=device)  # [1, P]
    embeds = thinker.get_input_embeddings()(ids)  # [1, P, D]
    media = media or MediaInputs()
    tokens = set(prompt)
    for name, token_id, values in (
        ("audio", config.audio_token_id, media.input_features),
        ("image", config.image_token_id, media.pixel_values),
        ("video", config.video_token_id, media.pixel_values_videos),
    ):
        if values is None and token_id in tokens:
            raise ValueError(f"prompt: it holds {name} placeholder ids but no {name} inputs were given")
    if not media.has_audio and not media.has_vision:
        return Prefill(embeds)
    if media.has_audio:
        audio = thinker.get_audio_features(
            media.input_features.to(device, thinker.model.audio_tower.dtype), media.feature_attention_mask.to(device),
            return_dict=True,
        ).last_hidden_state
        embeds = _scatter(embeds, ids == config.audio_token_id, audio, "audio")
    visual_masks, visual_levels = [], []
    for values, grid, token_id, name in (
        (media.pixel_values, media.image_grid_thw, config.image_token_id, "image"),
        (media.pixel_values_videos, media.video_grid_thw, config.video_token_id, "video"),
    ):
        if grid is None:
            continue
        encode = thinker.get_image_features if name == "image" else thinker.get_video_features
        out = encode(values.to(device), grid.to(device), return_dict=True)
        mask = ids == token_id
        embeds = _scatter(embeds, mask, torch.cat(out.pooler_output), name)
        visual_masks.append(mask)
        visual_levels.append([torch.cat(level) for level in getattr(out, "deepstack_features", None) or ()])
    layer_adds = []
    for levels in zip(*visual_levels):  # one deepstack level: its image rows and its video rows
        add = torch.zeros_like(embeds)
        for mask, rows in zip(visual_masks, levels):
            add[mask] = rows.to(embeds.dtype)
        layer_adds.append(add)
    rope_positions = None
    if media.has_vision:
        rope_positions, _ = thinker.get_rope_index(
            ids, media.image_grid_thw, media.video_grid_thw, torch.ones_like(ids), False,
            media.audio_lengths, media.seconds_per_grid(config.vision_config.temporal_patch_size),
        )  # [3, 1, P]
    return Prefill(embeds, rope_positions, tuple(layer_adds))


def _scatter(embeds: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, name: str) -> torch.Tensor:
    """embeds [1, P, D] with rows [n, D] at the n positions of mask [1, P] (transformers' masked_scatter)."""
    num_ids = int(mask.sum())
    if num_ids != rows.shape[0]:
        raise ValueError(f"prompt: {num_ids} {name} pad ids for {rows.shape[0]} {name} encoder rows")
    return embeds.masked_scatter(mask[..., None], rows.to(embeds.dtype))
