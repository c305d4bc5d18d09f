"""A prompt's media placeholders against its media tensors, and a batch's tensors split per prompt.

Shared by the families whose thinker takes transformers' processor tensors (`omnimtp.media.MediaInputs`):
an audio is a `<|audio_start|>` id followed by one `<|audio_pad|>` id per audio encoder row, an image or
video a `<|vision_start|>` id followed by one pad id per merged patch. Only the audio rows of a number of
feature frames differ between families (their audio towers downsample differently): callers pass them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from omnimtp.media import MediaInputs


def check_placeholders(config, prompt_ids: list[int], media: MediaInputs | None,
                       audio_rows: Callable[[torch.Tensor], list[int]]) -> None:
    """ValueError unless every audio / image / video of `media` has its placeholder run in the prompt,
    in order: a start id (`<|audio_start|>`, `<|vision_start|>`) followed by exactly as many pad ids as
    its encoder makes rows (audio: `audio_rows` of its feature frames, the family's audio tower
    downsampling; image, video: t·h·w / merge²), and no pad id outside such a run. config: the thinker's
    config (its `*_token_id`s, `vision_config.spatial_merge_size`)."""
    media = media or MediaInputs()
    merge = config.vision_config.spatial_merge_size
    expected = {
        config.audio_token_id: [] if media.audio_lengths is None else audio_rows(media.audio_lengths),
        config.image_token_id: (
            [] if media.image_grid_thw is None else (media.image_grid_thw.prod(-1) // merge**2).tolist()
        ),
        config.video_token_id: (
            [] if media.video_grid_thw is None else (media.video_grid_thw.prod(-1) // merge**2).tolist()
        ),
    }
    names = {config.audio_token_id: "audio", config.image_token_id: "image", config.video_token_id: "video"}
    starts = {config.audio_start_token_id, config.vision_start_token_id}
    found = {token: [] for token in expected}
    position = 0
    while position < len(prompt_ids):
        token = prompt_ids[position]
        if token in expected:
            if position == 0 or prompt_ids[position - 1] not in starts:
                raise ValueError(f"prompt: a {names[token]} placeholder at position {position} follows no start id")
            end = position
            while end < len(prompt_ids) and prompt_ids[end] == token:
                end += 1
            found[token].append(end - position)
            position = end
        else:
            position += 1
    for token, rows in expected.items():
        if found[token] != [int(n) for n in rows]:
            raise ValueError(
                f"prompt: its {names[token]} placeholder runs have lengths {found[token]}, but the {names[token]} "
                f"inputs give {[int(n) for n in rows]} encoder rows"
            )


def split_media(config, prompts: list[list[int]], media: MediaInputs | None) -> list[MediaInputs | None]:
    """A batch's media tensors, as the processor returns them for a batch (every prompt's audios, images
    and videos in prompt order), split per prompt: prompt i takes as many audios as it has
    `<|audio_start|>` ids and as many images / videos as it has `<|vision_start|>` ids followed by an
    image / video pad (the counting of transformers' `get_rope_index`). ValueError when the counts and
    the tensors disagree. config: the thinker's config."""
    if media is None:
        return [None] * len(prompts)
    counts = []
    for ids in prompts:
        starts = [i for i, token in enumerate(ids[:-1]) if token == config.vision_start_token_id]
        counts.append((
            sum(token == config.audio_start_token_id for token in ids),
            sum(ids[i + 1] == config.image_token_id for i in starts),
            sum(ids[i + 1] == config.video_token_id for i in starts),
        ))
    given = (
        0 if media.input_features is None else media.input_features.shape[0],
        0 if media.image_grid_thw is None else media.image_grid_thw.shape[0],
        0 if media.video_grid_thw is None else media.video_grid_thw.shape[0],
    )
    # strict=False: zip(*counts) is empty for an empty batch, and then nothing is checked
    for kind, name, total, need in zip(
        ("audio", "image", "video"), ("input_features", "image_grid_thw", "video_grid_thw"), given,
        zip(*counts, strict=True), strict=False,
    ):
        if total != sum(need):
            raise ValueError(f"{name}: {total} {kind} inputs for {sum(need)} {kind} placeholders in the prompts")
    split, starts = [], [0, 0, 0]
    for num_audio, num_image, num_video in counts:
        split.append(_media_slice(media, starts, (num_audio, num_image, num_video)))
        starts = [start + n for start, n in zip(starts, (num_audio, num_image, num_video), strict=True)]
    return split


def _media_slice(media: MediaInputs, starts: list[int], counts: tuple[int, int, int]) -> MediaInputs | None:
    """The audios [a, a + n), images and videos of one prompt out of a batch's media tensors."""
    if not any(counts):
        return None
    (audio, image, video), (num_audio, num_image, num_video) = starts, counts
    fields = {}
    if num_audio:
        fields["input_features"] = media.input_features[audio : audio + num_audio]
        fields["feature_attention_mask"] = media.feature_attention_mask[audio : audio + num_audio]
    for values, grid, first, n in (
        ("pixel_values", "image_grid_thw", image, num_image),
        ("pixel_values_videos", "video_grid_thw", video, num_video),
    ):
        if not n:
            continue
        grids = getattr(media, grid)
        patches = grids.prod(-1).tolist()
        begin = sum(patches[:first])
        fields[values] = getattr(media, values)[begin : begin + sum(patches[first : first + n])]
        fields[grid] = grids[first : first + n]
    if num_video and media.video_second_per_grid is not None:
        fields["video_second_per_grid"] = media.video_second_per_grid[video : video + num_video]
    return MediaInputs(**fields)
