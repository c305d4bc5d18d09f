"""Media inputs of one request: reading audio and images, and the processor's tensors under transformers' names.

    media = MediaInputs(input_features=feats, feature_attention_mask=mask)      # [N, mel, F], [N, F]
    media = MediaInputs(pixel_values=patches, image_grid_thw=grid)              # [P, C·T·p·p], [N, 3]

The prompt holds one `<|audio_pad|>` / `<|image_pad|>` / `<|video_pad|>` id per encoder output row (the
processor expands them); the thinker's encoders turn these tensors into those rows.

Reading media: `decode_audio` / `decode_image` (request bytes, e.g. base64 from `decode_base64` /
`decode_image_url`) and `load_audio` / `load_image` (the Python API's chat parts) check `MediaLimits`
and raise `MediaError` (a ValueError naming the part). `chat_media_inputs` turns chat messages with
audio and image parts into prompt ids and `MediaInputs` through the checkpoint's processor
(`load_processor`, or `tiny_processor` for the embedded tiny model).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
from dataclasses import dataclass, fields

import numpy as np
import soundfile
import soxr
import torch
from PIL import Image
from transformers import Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from omnimtp.limits import MAX_AUDIO_MAGNITUDE, MAX_AUDIO_SAMPLE_RATE, MediaLimits
from omnimtp.tokenizer import message_texts, prompt_tokenizer


@dataclass(frozen=True)
class MediaInputs:
    """One request's media tensors, as `Qwen3OmniMoeProcessor` or `Qwen2_5OmniProcessor` returns them for a prompt.

    input_features [N_audio, mel, F] + feature_attention_mask [N_audio, F]; pixel_values [patches, C·T·p·p]
    + image_grid_thw [N_image, 3]; pixel_values_videos + video_grid_thw [N_video, 3] (+ video_second_per_grid
    [N_video], seconds per temporal grid step; default, as the processor at its 1 fps: the vision encoder's
    temporal_patch_size frames = 2.0)."""

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
                    f"{values} must have {values_rank} dims and {grid} {grid_rank}, "
                    f"got {tuple(a.shape)} and {tuple(b.shape)}"
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
                raise ValueError(
                    f"{values}: {a.shape[0]} patches for {grid} {b.tolist()} ({int(b.prod(-1).sum())} patches)"
                )
        if self.video_second_per_grid is not None:
            if self.video_grid_thw is None or self.video_second_per_grid.shape != (self.video_grid_thw.shape[0],):
                raise ValueError("video_second_per_grid must be [N_video], one per video_grid_thw row")

    @classmethod
    def from_dict(cls, values: dict) -> MediaInputs | None:
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

    def seconds_per_grid(self, temporal_patch_size: int) -> torch.Tensor | None:
        """video_second_per_grid, or its default when videos come without it (the processor at 1 fps:
        temporal_patch_size seconds per grid step); None without videos."""
        if self.video_grid_thw is None or self.video_second_per_grid is not None:
            return self.video_second_per_grid
        return torch.full((self.video_grid_thw.shape[0],), float(temporal_patch_size))

    @property
    def audio_lengths(self) -> torch.Tensor | None:
        """Frames of each audio [N_audio] (what transformers calls audio_feature_lengths)."""
        return None if self.feature_attention_mask is None else self.feature_attention_mask.sum(-1)


# --- decoding -------------------------------------------------------------------------------------

# Audio formats a request may name (OpenAI's input_audio.format, plus FLAC) → libsndfile's names for them.
AUDIO_FORMATS = ("wav", "mp3", "flac")
_LIBSNDFILE_FORMATS = {"wav": ("WAV", "WAVEX"), "mp3": ("MP3",), "flac": ("FLAC",)}
# Image formats decoded (OpenAI's list); other PIL decoders are never reached by request bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# What Qwen3-Omni's feature extractor (WhisperFeatureExtractor) reads.
AUDIO_SAMPLING_RATE = 16_000
# Shorter audio gives the feature extractor no analysis window (Whisper's 400-sample FFT at 16 kHz).
MIN_AUDIO_SECONDS = 0.025
# Qwen2-VL's image processor refuses a longer side over 200 times the shorter one.
MAX_IMAGE_ASPECT_RATIO = 200
# Audio is decoded, downmixed and resampled this many frames at a time, so memory follows the output.
_AUDIO_BLOCK_FRAMES = 1 << 16


class MediaError(ValueError):
    """Media that cannot be read; `param` names the part that holds it
    (`messages[0].content[1].audio`, or over HTTP `messages.0.content.1.input_audio.data`)."""

    def __init__(self, param: str, reason: str):
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


def decode_base64(text: str, param: str) -> bytes:
    """Standard base64 (RFC 4648 alphabet, padded, no whitespace) → non-empty bytes."""
    if not isinstance(text, str):
        raise MediaError(param, f"must be a base64 string, got {type(text).__name__}")
    if not text:
        raise MediaError(param, "is empty")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(param, "is not valid base64") from None
    if not data:
        raise MediaError(param, "is empty")
    return data


def decode_image_url(url: str, param: str) -> bytes:
    """The bytes of `data:image/<subtype>;base64,<data>`. Remote URLs are refused, never fetched."""
    return decode_data_url(url, param, "image")


def decode_data_url(url: str, param: str, kind: str) -> bytes:
    """The bytes of `data:<kind>/<subtype>;base64,<data>` (kind "image" or "audio"). Remote URLs are refused,
    never fetched."""
    example = f"data:{kind}/{'png' if kind == 'image' else 'wav'};base64,..."
    if not isinstance(url, str):
        raise MediaError(param, f"must be a string, got {type(url).__name__}")
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise MediaError(param, f"remote URLs are not fetched; send a data: URL ({example})")
    if scheme != "data":
        raise MediaError(param, f"must be a data: URL ({example})")
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise MediaError(param, "data: URL has no ',' before its data")
    media_type, *options = header.split(";")
    if not media_type.lower().startswith(f"{kind}/"):
        raise MediaError(param, f"data: URL must hold {'an image' if kind == 'image' else 'audio'} ({kind}/...), "
                         f"got {media_type or 'no media type'!r}")
    if not options or options[-1].lower() != "base64":
        raise MediaError(param, f"data: URL must be base64-encoded ({example})")
    return decode_base64(payload, param)


def decode_audio(data: bytes, format: str | None, sampling_rate: int, limits: MediaLimits = MediaLimits(),
                 param: str = "audio") -> np.ndarray:
    """Encoded audio → float32 mono samples at `sampling_rate` (channels averaged, resampled with soxr).

    format: one of AUDIO_FORMATS, which the bytes must be; None reads any format libsndfile knows (files
    on the Python API). The length is checked against limits.max_audio_seconds before the audio is
    resampled, and while it is decoded (a header may understate it)."""
    _check_sampling_rate(sampling_rate)
    if format is not None and format not in AUDIO_FORMATS:
        raise MediaError(param, f"audio format {format!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}")
    if not data:
        raise MediaError(param, "is empty")
    return _read_audio(io.BytesIO(data), format, sampling_rate, limits, param)


def _read_audio(file, format: str | None, sampling_rate: int, limits: MediaLimits, param: str) -> np.ndarray:
    try:
        sound = soundfile.SoundFile(file)
    except (soundfile.SoundFileError, RuntimeError, TypeError):
        raise MediaError(param, "is not audio that can be decoded") from None
    with sound:
        if format is not None and sound.format not in _LIBSNDFILE_FORMATS[format]:
            raise MediaError(param, f"format is {format!r} but the data is {sound.format.lower()} audio")
        rate = sound.samplerate
        if rate > MAX_AUDIO_SAMPLE_RATE:
            raise MediaError(param, f"sample rate {rate} Hz is over the limit of {MAX_AUDIO_SAMPLE_RATE} Hz")
        max_frames = math.floor(limits.max_audio_seconds * rate)
        if sound.frames > max_frames:
            raise MediaError(param, f"{sound.frames / rate:.1f} s of audio is over the limit of "
                             f"{limits.max_audio_seconds:g} s")
        resampler = None if rate == sampling_rate else soxr.ResampleStream(rate, sampling_rate, 1, dtype="float32")
        pieces, num_frames = [], 0
        try:
            # read block by block, as far as the data goes: some codecs (GSM 6.10, G.721, XI) are not seekable,
            # so their length is not known up front
            while len(block := sound.read(_AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True)):
                num_frames += len(block)
                if num_frames > max_frames:
                    raise MediaError(param, f"audio is longer than the limit of {limits.max_audio_seconds:g} s")
                mono = block.mean(axis=1, dtype=np.float32)  # [frames]
                pieces.append(mono if resampler is None else resampler.resample_chunk(mono))
        except (soundfile.SoundFileError, RuntimeError, ValueError):
            raise MediaError(param, "is not audio that can be decoded") from None
        if resampler is not None:
            pieces.append(resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
    if num_frames == 0:
        raise MediaError(param, "audio has no samples")
    return _checked_samples(np.concatenate(pieces), sampling_rate, param)


def decode_image(data: bytes, limits: MediaLimits = MediaLimits(), param: str = "image") -> Image.Image:
    """Encoded PNG, JPEG, WebP or GIF → an RGB image. The size is read from the header and checked
    against limits.max_image_pixels (and the aspect ratio against Qwen's processor's bound) before any
    pixel is decoded. Animated images are refused, as OpenAI does: which frame the model should see is
    the client's choice."""
    if not data:
        raise MediaError(param, "is empty")
    return _read_image(io.BytesIO(data), limits, param)


def _read_image(file, limits: MediaLimits, param: str) -> Image.Image:
    try:
        image = Image.open(file, formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise MediaError(param, f"image is over the limit of {limits.max_image_pixels} pixels") from None
    except (OSError, ValueError, SyntaxError):
        raise MediaError(param, f"is not an image that can be decoded ({', '.join(IMAGE_FORMATS)})") from None
    return _checked_image(image, limits, param)


def load_audio(audio, sampling_rate: int, limits: MediaLimits = MediaLimits(), param: str = "audio") -> np.ndarray:
    """A chat audio part's value → float32 mono samples at `sampling_rate`.

    audio: a file path (any format libsndfile reads), a (samples, sample_rate) pair, or samples already
    at `sampling_rate`; samples are a 1-D float array (mono: downmix before)."""
    _check_sampling_rate(sampling_rate)
    if isinstance(audio, (str, os.PathLike)):
        with _open_file(audio, param) as file:
            return _read_audio(file, None, sampling_rate, limits, param)
    rate = sampling_rate
    if isinstance(audio, tuple):
        if len(audio) != 2:
            raise MediaError(param, "must be a path, samples, or a (samples, sample_rate) pair")
        audio, rate = audio
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate < 1:
            raise MediaError(param, f"sample rate must be an integer >= 1, got {rate!r}")
        rate = int(rate)
    if not isinstance(audio, np.ndarray):
        raise MediaError(param, f"must be a path, a numpy array or a (numpy array, sample_rate) pair, "
                         f"got {type(audio).__name__}")
    if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
        raise MediaError(param, f"samples must be a 1-D float array (mono), got {audio.dtype} {audio.shape}")
    if audio.size == 0:
        raise MediaError(param, "audio has no samples")
    if audio.size > limits.max_audio_seconds * rate:
        raise MediaError(param, f"{audio.size / rate:.1f} s of audio is over the limit of "
                         f"{limits.max_audio_seconds:g} s")
    samples = audio.astype(np.float32)
    if rate != sampling_rate:
        samples = soxr.resample(samples, rate, sampling_rate).astype(np.float32)
    return _checked_samples(samples, sampling_rate, param)


def load_image(image, limits: MediaLimits = MediaLimits(), param: str = "image") -> Image.Image:
    """A chat image part's value (a file path or a PIL image) → an RGB image, as `decode_image`."""
    if isinstance(image, (str, os.PathLike)):
        with _open_file(image, param) as file:
            return _read_image(file, limits, param)
    if not isinstance(image, Image.Image):
        raise MediaError(param, f"must be a path or a PIL image, got {type(image).__name__}")
    return _checked_image(image, limits, param)


def _open_file(path, param: str):
    try:
        return open(path, "rb")
    except OSError as exc:
        raise MediaError(param, f"cannot read {os.fspath(path)!r}: {exc.strerror}") from None


def _check_sampling_rate(sampling_rate) -> None:
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, int) or sampling_rate < 1:
        raise ValueError(f"sampling_rate must be an integer >= 1, got {sampling_rate!r}")


def _checked_samples(samples: np.ndarray, sampling_rate: int, param: str) -> np.ndarray:
    if len(samples) < round(MIN_AUDIO_SECONDS * sampling_rate):
        raise MediaError(param, f"audio is shorter than {1000 * MIN_AUDIO_SECONDS:g} ms")
    if not np.isfinite(samples).all():
        raise MediaError(param, "audio has NaN or infinite samples")
    if np.abs(samples).max() > MAX_AUDIO_MAGNITUDE:
        raise MediaError(param, f"audio has samples beyond ±{MAX_AUDIO_MAGNITUDE:g} (full scale is 1)")
    return samples


def _checked_image(image: Image.Image, limits: MediaLimits, param: str) -> Image.Image:
    width, height = image.size
    if width < 1 or height < 1:
        raise MediaError(param, f"image is empty ({width}×{height})")
    if width * height > limits.max_image_pixels:
        raise MediaError(param, f"{width}×{height} image is over the limit of {limits.max_image_pixels} pixels")
    if max(width, height) > MAX_IMAGE_ASPECT_RATIO * min(width, height):
        raise MediaError(param, f"{width}×{height} image has a longer side over {MAX_IMAGE_ASPECT_RATIO} times "
                         "its shorter side")
    # A camera's multi-picture JPEG (MPO) opens on its primary picture; its others are previews or depth.
    if getattr(image, "n_frames", 1) > 1 and image.format != "MPO":
        raise MediaError(param, f"animated image ({image.n_frames} frames) is not supported; send one frame")
    try:
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError):
        raise MediaError(param, "image data is truncated or corrupt") from None


# --- chat messages → prompt ids and media tensors --------------------------------------------------

_MEDIA_PART_TYPES = ("audio", "image")


def has_media(messages: list[dict]) -> bool:
    """Whether any message's content holds a part other than text (such messages go through the processor)."""
    return any(
        isinstance(part, dict) and part.get("type") != "text"
        for message in messages if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def chat_media_inputs(processor, messages: list[dict],
                      limits: MediaLimits = MediaLimits()) -> tuple[list[int], MediaInputs | None]:
    """The templated prompt of chat messages with media, and the media's tensors.

    messages: transformers' chat format; a content is a string or a list of parts
    `{"type": "text", "text": str}`, `{"type": "audio", "audio": path | (samples, sample_rate) | samples at
    the feature extractor's rate}`, `{"type": "image", "image": path | PIL image}`; media only in user turns.
    The processor expands each media part's one pad into one pad per encoder row:

        [{"role": "user", "content": [{"type": "audio", "audio": one_second}, {"type": "text", "text": "Hi"}]}]
        → ids    <|im_start|>user\\n<|audio_start|> <|audio_pad|>×13 <|audio_end|>Hi<|im_end|>\\n
                 <|im_start|>assistant\\n
          media  MediaInputs(input_features [1, mel, 100], feature_attention_mask [1, 100])

    Without media the ids are the tokenizer's `apply_chat_template` ids and media is None. Message text stays
    text: a special-token string in it is tokenized as characters (`omnimtp.tokenizer.PromptTokenizer`)."""
    audios, images = [], []
    template_messages = []
    for i, message in enumerate(_checked_messages(messages)):
        content = message["content"]
        if isinstance(content, str):
            template_messages.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{param}.text must be a string")
                parts.append(part)
                continue
            if kind not in _MEDIA_PART_TYPES:
                raise ValueError(f"{param}.type: {kind!r} is not a part type; use 'text', 'audio' or 'image'")
            if message["role"] != "user":
                raise ValueError(f"{param}: {kind} parts are only read in user messages, not {message['role']!r}")
            if kind not in part:
                raise ValueError(f"{param}.{kind} is missing")
            if processor is None:
                raise ValueError(f"{param}: this checkpoint has no processor (preprocessor_config.json) to read "
                                 f"{kind} input")
            if len(audios) + len(images) == limits.max_parts:
                raise MediaError("messages", f"more than {limits.max_parts} media parts")
            if kind == "audio":
                sampling_rate = processor.feature_extractor.sampling_rate
                audios.append(load_audio(part["audio"], sampling_rate, limits, f"{param}.audio"))
            else:
                images.append(load_image(part["image"], limits, f"{param}.image"))
            parts.append({"type": kind})  # what the template reads: the part's type, not its data
        template_messages.append({**message, "content": parts})
    if processor is None:
        raise ValueError("processor: None; text-only messages take the tokenizer's apply_chat_template")
    text = prompt_tokenizer(processor.tokenizer)
    if not audios and not images:
        return text.chat_ids(messages), None
    templater = processor if processor.chat_template is not None else processor.tokenizer
    if text.has_special_text(message_texts(template_messages)):
        prompt, restore = text.rendered(template_messages, renderer=templater)
    else:
        prompt, restore = templater.apply_chat_template(template_messages, add_generation_prompt=True,
                                                        tokenize=False), None
    output = processor(text=[prompt], audio=audios or None, images=images or None, return_tensors="pt",
                       add_special_tokens=False)
    ids = output["input_ids"][0].tolist()
    if restore is not None:  # special-token strings in the text: their placeholders' ids become the text's
        pad_ids = {processor.audio_token_id, processor.image_token_id, processor.video_token_id}
        ids = text.processed_ids(prompt, restore, ids, pad_ids)
    return ids, MediaInputs.from_dict(output)


def _checked_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of chat messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a 'role' string")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise ValueError(f"messages[{i}].content[{j}] must be a dict with a 'type'")
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
    return messages


# --- the processor ---------------------------------------------------------------------------------


class AudioImageProcessor:
    """transformers' Qwen-Omni processor (the class this is mixed into) without its video processor.

    transformers' video processors need torchvision, and `Qwen3OmniMoeProcessor` / `Qwen2_5OmniProcessor`
    can neither be built nor loaded without one (the constructor checks the class of every sub-processor;
    `from_pretrained` loads one through `AutoVideoProcessor`; `AutoProcessor` quietly returns only the
    tokenizer). A subclass has its processor's tokens, audio and image processing (placeholder expansion,
    audio token counts) and files, and refuses videos: those reach the engine as tensors
    (`MediaInputs.pixel_values_videos`, `video_grid_thw`)."""

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
        ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        for name in ("image_token", "audio_token", "video_token", "image_token_id", "audio_token_id", "video_token_id",
                     "vision_bos_token", "vision_eos_token", "audio_bos_token", "audio_eos_token"):
            setattr(self, name, getattr(tokenizer, name))

    def __call__(self, text=None, images=None, videos=None, audio=None, **kwargs):
        if videos is not None:
            raise ValueError("videos: this processor reads audio and images; pass a video as MediaInputs "
                             "(pixel_values_videos, video_grid_thw)")
        return super().__call__(text=text, images=images, audio=audio, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        names = self.tokenizer.model_input_names + self.feature_extractor.model_input_names
        return list(dict.fromkeys(names + self.image_processor.model_input_names + ["feature_attention_mask"]))


class Qwen3OmniAudioImageProcessor(AudioImageProcessor, Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` for audio and images (`AudioImageProcessor`)."""


class Qwen2_5OmniAudioImageProcessor(AudioImageProcessor, Qwen2_5OmniProcessor):
    """`Qwen2_5OmniProcessor` for audio and images (`AudioImageProcessor`): its feature extractor pads every
    audio to the extractor's full chunk_length (the mask marks the frames), and an audio's token count is the
    Qwen2.5 audio tower's output length."""


# config.json's model_type → the audio and image processor of that model
PROCESSOR_CLASSES = {
    "qwen3_omni_moe": Qwen3OmniAudioImageProcessor,
    "qwen2_5_omni": Qwen2_5OmniAudioImageProcessor,
}
# processor_class in a processor's files (transformers' own, or ours as save_pretrained writes it) → model_type
_PROCESSOR_MODEL_TYPES = {
    "Qwen3OmniMoeProcessor": "qwen3_omni_moe",
    "Qwen3OmniAudioImageProcessor": "qwen3_omni_moe",
    "Qwen2_5OmniProcessor": "qwen2_5_omni",
    "Qwen2_5OmniAudioImageProcessor": "qwen2_5_omni",
}


def tiny_processor(tokenizer, thinker_config, model_type: str = "qwen3_omni_moe") -> AudioImageProcessor:
    """A tiny model's processor: a WhisperFeatureExtractor with its 16 mel bins at 16 kHz (up to the 300 s of
    the real extractor) and Qwen2-VL's PIL image processor with its vision encoder's patch sizes; images are
    resized to 1024..4096 pixels, so a 64×64 image gives 16 tokens. tokenizer: the byte tokenizer
    (`omnimtp.tokenizer.byte_tokenizer`, or `omnimtp.models.tiny_qwen2_5_omni.qwen2_5_byte_tokenizer`);
    thinker_config: the tiny model's thinker config (its encoders' mel bins and patch sizes);
    model_type: "qwen3_omni_moe" (the tiny Qwen3-Omni) or "qwen2_5_omni" (the tiny Qwen2.5-Omni)."""
    if model_type not in PROCESSOR_CLASSES:
        raise ValueError(f"model_type must be one of {sorted(PROCESSOR_CLASSES)}, got {model_type!r}")
    audio, vision = thinker_config.audio_config, thinker_config.vision_config
    feature_extractor = WhisperFeatureExtractor(
        feature_size=audio.num_mel_bins, sampling_rate=AUDIO_SAMPLING_RATE, chunk_length=300,
        return_attention_mask=True,
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size, min_pixels=32 * 32, max_pixels=64 * 64,
    )
    return PROCESSOR_CLASSES[model_type](image_processor=image_processor, feature_extractor=feature_extractor,
                                         tokenizer=tokenizer)


def load_processor(path) -> AudioImageProcessor | None:
    """The audio and image processor of a checkpoint directory (`AudioImageProcessor`), or None when it has
    none (no preprocessor_config.json or processor_config.json). Its class follows the files' processor_class
    (a real Qwen3-Omni or Qwen2.5-Omni checkpoint's, or what `save_pretrained` of these processors writes),
    else config.json's model_type."""
    path = os.fspath(path)
    names = ("processor_config.json", "preprocessor_config.json", "config.json")
    found = {}
    for name in names:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                found[name] = json.load(f)
    if not any(name in found for name in names[:2]):
        return None
    processor_classes = [found[name].get("processor_class") for name in names[:2] if name in found]
    model_types = [_PROCESSOR_MODEL_TYPES[c] for c in processor_classes if c in _PROCESSOR_MODEL_TYPES]
    model_type = model_types[0] if model_types else found.get("config.json", {}).get("model_type")
    if model_type not in PROCESSOR_CLASSES:
        raise ValueError(f"path: {path!r} holds a processor of {processor_classes or model_type!r}; supported: "
                         f"{sorted(_PROCESSOR_MODEL_TYPES)}")
    return PROCESSOR_CLASSES[model_type].from_pretrained(path)
