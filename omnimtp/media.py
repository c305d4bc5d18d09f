"""Media inputs of one request: the processor's audio, image and video tensors under transformers' names.

    media = MediaInputs(input_features=feats, feature_attention_mask=mask)      # [N, mel, F], [N, F]
    media = MediaInputs(pixel_values=patches, image_grid_thw=grid)              # [P, C·T·p·p], [N, 3]

The prompt holds one `<|audio_pad|>` / `<|image_pad|>` / `<|video_pad|>` id per encoder output row (the
processor expands them); the thinker's encoders turn these tensors into those rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class MediaInputs:
    """One request's media tensors, as `Qwen3OmniMoeProcessor` returns them for one prompt.

    input_features [N_audio, mel, F] + feature_attention_mask [N_audio, F]; pixel_values [patches, C·T·p·p]
    + image_grid_thw [N_image, 3]; pixel_values_videos + video_grid_thw [N_video, 3] (+ video_second_per_grid
    [N_video], seconds per temporal grid step, default the processor's 2 frames at 1 fps = 1.0)."""

    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise ValueError(f"{f.name} must be a torch.Tensor or None, got {type(value).__name__}")
        pairs = (
            ("input_features", "feature_attention_mask", 3, 2),
            ("pixel_values", "image_grid_thw", 2, 2),
            ("pixel_values_videos", "video_grid_thw", 2, 2),
        )
        for values, grid, values_rank, grid_rank in pairs:
            a, b = getattr(self, values), getattr(self, grid)
            if (a is None) != (b is None):
                raise ValueError(f"{values} and {grid} must be given together")
            if a is None:
                continue
            if a.dim() != values_rank or b.dim() != grid_rank:
                raise ValueError(
                    f"{values} must have {values_rank} dims and {grid} {grid_rank}, got {tuple(a.shape)} and {tuple(b.shape)}"
                )
            if not a.is_floating_point():
                raise ValueError(f"{values} must be floating point, got {a.dtype}")
        if self.input_features is not None:
            if self.feature_attention_mask.shape != (self.input_features.shape[0], self.input_features.shape[2]):
                raise ValueError(
                    f"feature_attention_mask must be [{self.input_features.shape[0]}, {self.input_features.shape[2]}], "
                    f"got {tuple(self.feature_attention_mask.shape)}"
                )
            if bool((self.feature_attention_mask.sum(-1) == 0).any()):
                raise ValueError("feature_attention_mask: an audio has no frames")
        for values, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            a, b = getattr(self, values), getattr(self, grid)
            if b is None:
                continue
            if b.shape[-1] != 3 or bool((b < 1).any()):
                raise ValueError(f"{grid} must be [N, 3] positive (t, h, w), got {b.tolist()}")
            if int(b.prod(-1).sum()) != a.shape[0]:
                raise ValueError(f"{values}: {a.shape[0]} patches for {grid} {b.tolist()} ({int(b.prod(-1).sum())} patches)")
        if self.video_second_per_grid is not None:
            if self.video_grid_thw is None or self.video_second_per_grid.shape != (self.video_grid_thw.shape[0],):
                raise ValueError("video_second_per_grid must be [N_video], one per video_grid_thw row")

    @classmethod
    def from_dict(cls, values: dict) -> "MediaInputs | None":
        """The media fields of a processor's output (a dict or `BatchFeature`); None when it has none."""
        names = [f.name for f in fields(cls)]
        found = {name: values[name] for name in names if values.get(name) is not None}
        return cls(**found) if found else None

    @property
    def has_audio(self) -> bool:
        return self.input_features is not None

    @property
    def has_vision(self) -> bool:
        return self.image_grid_thw is not None or self.video_grid_thw is not None

    @property
    def audio_lengths(self) -> torch.Tensor | None:
        """Frames of each audio [N_audio] (what transformers calls audio_feature_lengths)."""
        return None if self.feature_attention_mask is None else self.feature_attention_mask.sum(-1)
