"""Media input: decoding audio and images, the limits, the tiny processor and chat messages → prompt ids
and media tensors, checked against transformers' own processor and encoders."""

from __future__ import annotations

import base64
import itertools

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from media_samples import animated_gif, encode, image_bytes, png_header, tone
from PIL import Image
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

from omnimtp.media import (
    AUDIO_SAMPLING_RATE,
    PROCESSOR_CLASSES,
    MediaError,
    MediaInputs,
    MediaLimits,
    Qwen3OmniAudioImageProcessor,
    chat_media_inputs,
    decode_audio,
    decode_base64,
    decode_image,
    decode_image_url,
    has_media,
    load_audio,
    load_image,
    load_processor,
    tiny_processor,
)
from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS, tiny_qwen3_omni, tiny_qwen3_omni_config
from omnimtp.models.tiny_qwen2_5_omni import tiny_qwen2_5_omni_config
from omnimtp.tokenizer import byte_tokenizer

AUDIO_PAD, IMAGE_PAD = THINKER_SPECIAL_TOKENS["<|audio_pad|>"], THINKER_SPECIAL_TOKENS["<|image_pad|>"]
AUDIO_START, AUDIO_END = THINKER_SPECIAL_TOKENS["<|audio_start|>"], THINKER_SPECIAL_TOKENS["<|audio_end|>"]
VISION_START, VISION_END = THINKER_SPECIAL_TOKENS["<|vision_start|>"], THINKER_SPECIAL_TOKENS["<|vision_end|>"]


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def processor(tokenizer):
    return tiny_processor(tokenizer, tiny_qwen3_omni_config().thinker_config)


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


def refused(call, param: str, words: str) -> MediaError:
    with pytest.raises(MediaError) as raised:
        call()
    assert isinstance(raised.value, ValueError) and raised.value.param == param
    assert str(raised.value).startswith(f"{param}: ") and words in str(raised.value), str(raised.value)
    return raised.value


# --- limits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("max_audio_seconds", 0), ("max_audio_seconds", -1.0), ("max_audio_seconds", float("inf")),
    ("max_audio_seconds", float("nan")), ("max_audio_seconds", True), ("max_audio_seconds", "300"),
    ("max_image_pixels", 0), ("max_image_pixels", 1.5), ("max_parts", 0), ("max_parts", False),
])
def test_limits_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        MediaLimits(**{field: value})


# --- audio ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,name", [("WAV", "wav"), ("FLAC", "flac"), ("MP3", "mp3")])
def test_audio_decodes_to_mono_at_the_rate_asked_and_the_tone_survives(fmt, name):
    left = tone(1.0, 44_100, hz=440.0)
    data = encode(np.stack([left, 0.5 * left], axis=1), 44_100, fmt)
    samples = decode_audio(data, name, AUDIO_SAMPLING_RATE)
    assert samples.dtype == np.float32 and samples.ndim == 1
    # MP3 frames pad the start and the end (decoder delay); the others keep the length exactly
    slack = 0.06 * AUDIO_SAMPLING_RATE if name == "mp3" else 2
    assert abs(len(samples) - AUDIO_SAMPLING_RATE) <= slack
    assert abs(peak_hz(samples, AUDIO_SAMPLING_RATE) - 440.0) < 2.0
    middle = samples[len(samples) // 4: 3 * len(samples) // 4]
    rms = float(np.sqrt(np.mean(middle ** 2)))
    assert abs(rms - 0.75 * 0.5 / np.sqrt(2)) < 0.02  # the channels' mean: 0.75 of the left tone


@pytest.mark.parametrize("fmt,subtype,name", [("WAV", "GSM610", "wav"), ("WAV", "G721_32", "wav"),
                                              ("XI", "DPCM_16", None), ("AU", "G721_32", None)])
def test_codecs_libsndfile_cannot_seek_in_are_decoded(fmt, subtype, name):
    """GSM 6.10, G.721 and XI files are not seekable to libsndfile (their length is unknown up front): read block
    by block to their end, not refused and not an exception."""
    samples = decode_audio(encode(tone(1.0, 8_000, hz=440.0), 8_000, fmt, subtype), name, AUDIO_SAMPLING_RATE)
    assert samples.dtype == np.float32 and len(samples) > AUDIO_SAMPLING_RATE // 10  # XI keeps its own rate
    assert np.sqrt(np.mean(samples ** 2)) > 0.05


def test_stereo_is_the_mean_of_its_channels_and_an_equal_rate_is_not_resampled():
    left, right = tone(0.5, AUDIO_SAMPLING_RATE, hz=300.0), tone(0.5, AUDIO_SAMPLING_RATE, hz=1234.0, level=0.2)
    samples = decode_audio(encode(np.stack([left, right], axis=1), AUDIO_SAMPLING_RATE), "wav", AUDIO_SAMPLING_RATE)
    np.testing.assert_array_equal(samples, (left + right) / 2)


@settings(max_examples=15, deadline=None)
@given(rate=st.sampled_from([8_000, 11_025, 22_050, 24_000, 44_100, 48_000]),
       num_frames=st.integers(min_value=1_500, max_value=3 * 48_000), channels=st.integers(min_value=1, max_value=3))
def test_resampled_length_follows_the_rate_ratio(rate, num_frames, channels):
    samples = np.random.default_rng(num_frames).uniform(-0.5, 0.5, (num_frames, channels)).astype(np.float32)
    decoded = decode_audio(encode(samples, rate), "wav", AUDIO_SAMPLING_RATE)
    assert abs(len(decoded) - num_frames * AUDIO_SAMPLING_RATE / rate) <= 1
    assert np.isfinite(decoded).all()


def test_audio_at_the_limit_is_read_and_past_it_refused():
    limits = MediaLimits(max_audio_seconds=1.0)
    assert len(decode_audio(encode(tone(1.0, 8_000), 8_000), "wav", AUDIO_SAMPLING_RATE, limits)) == 16_000
    refused(lambda: decode_audio(encode(tone(1.01, 8_000), 8_000), "wav", AUDIO_SAMPLING_RATE, limits, "a"),
            "a", "over the limit of 1 s")
    # the limit is on the audio as sent, before resampling
    refused(lambda: decode_audio(encode(tone(1.5, 48_000), 48_000, "FLAC"), "flac", 8_000, limits, "a"), "a", "1.5 s")


_ZERO_FRAMES = encode(np.zeros((0, 1), np.float32), AUDIO_SAMPLING_RATE)
_NAN = encode(np.full((1_000, 1), np.nan, np.float32), AUDIO_SAMPLING_RATE)


# Named by their first field: a WAV's bytes may hold a timestamp (libsndfile's PEAK chunk), and pytest-xdist
# needs every worker to collect the same test ids.
BAD_AUDIO = [
    ("empty", b"", "wav", "is empty"),
    ("not audio", b"this is not audio" * 20, "wav", "can be decoded"),
    ("truncated header", encode(tone(0.1, 8_000), 8_000)[:30], "wav", "can be decoded"),
    ("a png", image_bytes(Image.new("RGB", (4, 4))), "wav", "can be decoded"),
    ("zero frames", _ZERO_FRAMES, "wav", "no samples"),
    ("20 ms", encode(tone(0.02, 44_100), 44_100), "wav", "shorter than 25 ms"),
    ("NaN samples", _NAN, "wav", "NaN"),
    ("flac sent as wav", encode(tone(0.1, 8_000), 8_000, "FLAC"), "wav", "format is 'wav' but the data is flac"),
    ("wav sent as mp3", encode(tone(0.1, 8_000), 8_000), "mp3", "format is 'mp3' but the data is wav"),
    ("ogg", encode(tone(0.1, 8_000), 8_000, "OGG"), "ogg", "'ogg' is not supported"),
    ("m4a", b"\x00\x00\x00\x20ftypM4A ", "m4a", "'m4a' is not supported"),
    ("loud float samples", encode(tone(0.1, 8_000) * 1e20, 8_000, "WAV", "FLOAT"), "wav", "beyond ±16"),
    ("2^31 - 1 Hz", encode(tone(0.01, 8_000), 2**31 - 1), "wav", "over the limit of 384000 Hz"),
]


@pytest.mark.parametrize("name,data,fmt,words", BAD_AUDIO, ids=[case[0] for case in BAD_AUDIO])
def test_bad_audio_is_refused_naming_the_part(name, data, fmt, words):
    refused(lambda: decode_audio(data, fmt, AUDIO_SAMPLING_RATE, param="messages[0].content[1].audio"),
            "messages[0].content[1].audio", words)


def test_load_audio_reads_paths_pairs_and_arrays(tmp_path):
    signal = tone(0.5, 48_000, hz=1000.0)
    path = tmp_path / "q.ogg"  # any format libsndfile reads, on the Python API
    soundfile.write(path, signal, 48_000, format="OGG", subtype="VORBIS")
    from_file = load_audio(path, AUDIO_SAMPLING_RATE)
    from_pair = load_audio((signal, 48_000), AUDIO_SAMPLING_RATE)
    assert abs(len(from_file) - 8_000) <= 1 and len(from_pair) == 8_000
    for samples in (from_file, from_pair):
        assert abs(peak_hz(samples, AUDIO_SAMPLING_RATE) - 1000.0) < 4
    at_rate = tone(0.25, AUDIO_SAMPLING_RATE)
    np.testing.assert_array_equal(load_audio(at_rate, AUDIO_SAMPLING_RATE), at_rate)
    np.testing.assert_array_equal(load_audio(at_rate.astype(np.float64), AUDIO_SAMPLING_RATE), at_rate)


@pytest.mark.parametrize("name,audio,words", [
    ("missing file", "/nonexistent/q.wav", "cannot read"),
    ("stereo array", np.zeros((100, 2), np.float32), "1-D float array"),
    ("int samples", np.zeros(100, np.int16), "1-D float array"),
    ("empty array", np.zeros(0, np.float32), "no samples"),
    ("NaN array", np.full(1_000, np.nan, np.float32), "NaN"),
    ("shorter than a window", np.zeros(399, np.float32), "shorter than 25 ms"),
    ("too long", np.zeros(3 * AUDIO_SAMPLING_RATE, np.float32), "over the limit of 2 s"),
    ("too long at its own rate", (np.zeros(3 * 8_000, np.float32), 8_000), "over the limit of 2 s"),
    ("zero rate", (np.zeros(10, np.float32), 0), "sample rate"),
    ("float rate", (np.zeros(10, np.float32), 16000.0), "sample rate"),
    ("triple", (np.zeros(10, np.float32), 16_000, 1), "pair"),
    ("a list", [0.0, 0.1], "got list"),
    ("a tensor", torch.zeros(10), "got Tensor"),
])
def test_bad_audio_values_are_refused(name, audio, words):
    refused(lambda: load_audio(audio, AUDIO_SAMPLING_RATE, MediaLimits(max_audio_seconds=2), "audio"), "audio", words)


def test_sampling_rate_must_be_a_positive_int():
    for rate in (0, 16_000.0, True):
        with pytest.raises(ValueError, match="sampling_rate"):
            decode_audio(encode(tone(0.1, 8_000), 8_000), "wav", rate)


# --- base64 and data URLs -------------------------------------------------------------------------


def test_base64_and_data_urls_give_their_bytes():
    data = bytes(range(256))
    text = base64.b64encode(data).decode()
    assert decode_base64(text, "p") == data
    assert decode_image_url(f"data:image/png;base64,{text}", "p") == data
    assert decode_image_url(f"DATA:image/jpeg;charset=x;BASE64,{text}", "p") == data


@pytest.mark.parametrize("name,url,words", [
    ("http", "http://example.com/cat.png", "remote URLs are not fetched; send a data: URL"),
    ("https", "HTTPS://example.com/cat.png", "remote URLs are not fetched"),
    ("file scheme", "file:///etc/passwd", "must be a data: URL"),
    ("no scheme", "cat.png", "must be a data: URL"),
    ("no comma", "data:image/png;base64", "no ','"),
    ("not base64-encoded", "data:image/png,%89PNG", "must be base64-encoded"),
    ("not an image", "data:audio/wav;base64,AAAA", "must hold an image"),
    ("no media type", "data:;base64,AAAA", "must hold an image"),
    ("bad base64", "data:image/png;base64,AAA", "not valid base64"),
    ("url-safe alphabet", "data:image/png;base64,__--", "not valid base64"),
    ("empty data", "data:image/png;base64,", "is empty"),
])
def test_bad_image_urls_are_refused(name, url, words):
    refused(lambda: decode_image_url(url, "url"), "url", words)


@pytest.mark.parametrize("text,words", [("", "is empty"), ("a b=", "not valid base64"), ("QUJD\n", "not valid base64"),
                                        ("=", "not valid base64"), ("QQ", "not valid base64")])
def test_bad_base64_is_refused(text, words):
    refused(lambda: decode_base64(text, "data"), "data", words)


# --- images ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_images_decode_to_rgb(fmt):
    source = Image.new("RGBA" if fmt in ("PNG", "WEBP") else "RGB", (40, 30), (200, 10, 60, 255))
    image = decode_image(image_bytes(source, fmt))
    assert image.mode == "RGB" and image.size == (40, 30)
    assert np.abs(np.asarray(image, dtype=np.int32) - [200, 10, 60]).max() <= 12  # lossy formats


def test_a_cameras_multi_picture_jpeg_reads_its_primary_picture():
    primary, preview = Image.new("RGB", (32, 24), (10, 200, 30)), Image.new("RGB", (16, 12))
    image = decode_image(image_bytes(primary, "MPO", save_all=True, append_images=[preview]))
    assert image.size == (32, 24) and np.abs(np.asarray(image, dtype=np.int32) - [10, 200, 30]).max() <= 12


def test_image_size_is_checked_from_the_header_before_decoding():
    limits = MediaLimits(max_image_pixels=64 * 64)
    assert decode_image(image_bytes(Image.new("RGB", (64, 64))), limits).size == (64, 64)
    refused(lambda: decode_image(image_bytes(Image.new("RGB", (65, 64))), limits, "i"), "i",
            "65×64 image is over the limit of 4096 pixels")
    # 16 M pixels said by a header over ten bytes of data: refused for its size, not for being truncated
    refused(lambda: decode_image(png_header(4000, 4000), param="i"), "i", "over the limit of 12845056 pixels")
    # past PIL's own decompression-bomb bound PIL refuses to open it: still the size limit
    refused(lambda: decode_image(png_header(100_000, 100_000), param="i"), "i", "over the limit")


@pytest.mark.parametrize("name,data,words", [
    ("empty", b"", "is empty"),
    ("not an image", b"GIF89a but not really" * 4, "can be decoded"),
    ("zero width", png_header(0, 10), "can be decoded"),
    ("truncated", image_bytes(Image.effect_noise((64, 64), 50))[:200], "truncated or corrupt"),
    ("bmp", image_bytes(Image.new("RGB", (4, 4)), "BMP"), "can be decoded (PNG, JPEG, WEBP, GIF)"),
    ("wav bytes", encode(tone(0.1, 8_000), 8_000), "can be decoded"),
    ("animated", animated_gif(), "animated image (3 frames)"),
])
def test_bad_images_are_refused(name, data, words):
    refused(lambda: decode_image(data, param="messages[0].content[0].image"), "messages[0].content[0].image", words)


def test_load_image_reads_paths_and_pil_images(tmp_path):
    path = tmp_path / "photo.png"
    Image.new("L", (20, 10), 128).save(path)
    assert load_image(path).mode == "RGB" and load_image(str(path)).size == (20, 10)
    assert load_image(Image.new("P", (5, 6))).mode == "RGB"
    refused(lambda: load_image(tmp_path / "missing.png", param="i"), "i", "cannot read")
    refused(lambda: load_image(Image.new("RGB", (0, 6)), param="i"), "i", "image is empty (0×6)")
    refused(lambda: load_image(np.zeros((4, 4, 3)), param="i"), "i", "got ndarray")
    refused(lambda: load_image(Image.new("RGB", (100, 100)), MediaLimits(max_image_pixels=99), "i"), "i",
            "over the limit")
    assert load_image(Image.new("RGB", (200, 1))).size == (200, 1)
    refused(lambda: load_image(Image.new("RGB", (2, 401)), param="i"), "i",
            "2×401 image has a longer side over 200 times")


# --- the processor --------------------------------------------------------------------------------


def test_tiny_processor_matches_the_tiny_encoders(processor):
    config = tiny_qwen3_omni_config().thinker_config
    assert isinstance(processor, Qwen3OmniAudioImageProcessor)
    assert processor.feature_extractor.feature_size == config.audio_config.num_mel_bins
    assert processor.feature_extractor.sampling_rate == AUDIO_SAMPLING_RATE
    vision = config.vision_config
    assert (processor.image_processor.patch_size, processor.image_processor.merge_size,
            processor.image_processor.temporal_patch_size) == (vision.patch_size, vision.spatial_merge_size,
                                                              vision.temporal_patch_size)
    assert (processor.audio_token_id, processor.image_token_id, processor.video_token_id) == (
        config.audio_token_id, config.image_token_id, config.video_token_id)


def _media_messages(audio, image, text="What is this?"):
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "audio", "audio": audio}, {"type": "image", "image": image},
                                     {"type": "text", "text": text}]},
    ]


def test_processor_saves_and_loads_back(processor, tmp_path):
    messages = _media_messages(tone(1.3, AUDIO_SAMPLING_RATE), Image.effect_noise((64, 48), 40).convert("RGB"))
    ids, media = chat_media_inputs(processor, messages)
    processor.save_pretrained(tmp_path)
    loaded = load_processor(tmp_path)
    assert type(loaded) is Qwen3OmniAudioImageProcessor
    loaded_ids, loaded_media = chat_media_inputs(loaded, messages)
    assert loaded_ids == ids
    for name in ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw"):
        assert torch.equal(getattr(loaded_media, name), getattr(media, name)), name
    assert load_processor(tmp_path / "nothing") is None


@pytest.mark.parametrize("processor_class, model_type", [
    ("Qwen3OmniMoeProcessor", "qwen3_omni_moe"), ("Qwen2_5OmniProcessor", "qwen2_5_omni")])
def test_processor_reads_a_checkpoints_merged_preprocessor_config(processor_class, model_type, tmp_path):
    """A real Qwen3-Omni / Qwen2.5-Omni directory has one preprocessor_config.json (feature extractor and
    image processor together, its processor_class naming the model's processor), chat_template.json and the
    tokenizer files, no processor_config.json."""
    import json

    from omnimtp.models.tiny_qwen2_5_omni import qwen2_5_byte_tokenizer

    tokenizer = byte_tokenizer() if model_type == "qwen3_omni_moe" else qwen2_5_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "processor_class": processor_class, "feature_extractor_type": "WhisperFeatureExtractor",
        "chunk_length": 300, "feature_size": 16, "hop_length": 160, "n_fft": 400, "n_samples": 4_800_000,
        "nb_max_frames": 30_000,
        "sampling_rate": 16_000, "return_attention_mask": True, "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 1, "min_pixels": 1024, "max_pixels": 4096,
    }))
    loaded = load_processor(tmp_path)
    assert type(loaded) is PROCESSOR_CLASSES[model_type]
    messages = _media_messages(tone(0.7, AUDIO_SAMPLING_RATE), Image.new("RGB", (64, 64), (9, 9, 9)))
    ids, media = chat_media_inputs(loaded, messages)
    config = {"qwen3_omni_moe": tiny_qwen3_omni_config, "qwen2_5_omni": tiny_qwen2_5_omni_config}[model_type]()
    expected_ids, expected = chat_media_inputs(tiny_processor(tokenizer, config.thinker_config, model_type), messages)
    assert ids == expected_ids
    assert torch.allclose(media.input_features, expected.input_features)
    assert torch.equal(media.pixel_values, expected.pixel_values)


def test_processor_refuses_videos(processor):
    with pytest.raises(ValueError, match="videos: .*MediaInputs"):
        processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[np.zeros((2, 32, 32, 3), np.uint8)])


# --- chat messages → prompt ids and media ---------------------------------------------------------


@pytest.fixture(scope="module")
def thinker():
    return tiny_qwen3_omni(0).thinker


def test_pads_are_one_per_encoder_row_and_the_thinker_takes_them(processor, tokenizer, thinker):
    audio = (tone(2.3, 22_050), 22_050)
    image = Image.effect_noise((96, 64), 60).convert("RGB")
    messages = _media_messages(audio, image)
    ids, media = chat_media_inputs(processor, messages)
    assert isinstance(media, MediaInputs) and media.has_audio and media.has_vision
    with torch.no_grad():
        audio_rows = thinker.get_audio_features(media.input_features, media.feature_attention_mask).last_hidden_state
        image_rows = torch.cat(thinker.get_image_features(media.pixel_values, media.image_grid_thw).pooler_output)
    assert ids.count(AUDIO_PAD) == audio_rows.shape[0] == int(_get_feat_extract_output_lengths(media.audio_lengths)[0])
    merge = thinker.config.vision_config.spatial_merge_size
    assert ids.count(IMAGE_PAD) == image_rows.shape[0] == int(media.image_grid_thw.prod()) // merge**2
    # each run of pads sits between its start and end ids; collapsed, the prompt is the template's
    start = ids.index(AUDIO_PAD)
    assert ids[start - 1] == AUDIO_START and ids[start + ids.count(AUDIO_PAD)] == AUDIO_END
    start = ids.index(IMAGE_PAD)
    assert ids[start - 1] == VISION_START and ids[start + ids.count(IMAGE_PAD)] == VISION_END
    collapsed = [t for k, t in enumerate(ids) if t not in (AUDIO_PAD, IMAGE_PAD) or ids[k - 1] != t]
    assert collapsed == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    # transformers' thinker runs on them (it checks the pad counts against its encoders' rows)
    with torch.no_grad():
        out = thinker(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      input_features=media.input_features, feature_attention_mask=media.feature_attention_mask,
                      pixel_values=media.pixel_values, image_grid_thw=media.image_grid_thw)
    assert out.logits.shape[:2] == (1, len(ids))


@settings(max_examples=12, deadline=None)
@given(num_samples=st.integers(min_value=400, max_value=4 * AUDIO_SAMPLING_RATE),
       width=st.integers(min_value=1, max_value=300), height=st.integers(min_value=1, max_value=300))
def test_pad_counts_follow_the_processors_formulas(processor, num_samples, width, height):
    """Audio: frames = samples // hop, pads = `_get_feat_extract_output_lengths(frames)`; image: t·h·w / merge².
    Every audio and image the limits let through gets through the processor."""
    assume(max(width, height) <= 200 * min(width, height))
    messages = [{"role": "user", "content": [{"type": "audio", "audio": np.full(num_samples, 0.1, np.float32)},
                                             {"type": "image", "image": Image.new("RGB", (width, height))}]}]
    ids, media = chat_media_inputs(processor, messages)
    frames = num_samples // processor.feature_extractor.hop_length
    assert media.audio_lengths.tolist() == [frames]
    assert ids.count(AUDIO_PAD) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))
    assert ids.count(IMAGE_PAD) == int(media.image_grid_thw.prod()) // processor.image_processor.merge_size**2


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi ✓"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                              {"type": "text", "text": "b"}]},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
])
def test_text_only_messages_give_the_tokenizers_ids(processor, tokenizer, messages):
    ids, media = chat_media_inputs(processor, messages)
    assert media is None and not has_media(messages)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def test_two_audios_and_two_images_keep_their_order(processor):
    short, long = np.full(3_200, 0.1, np.float32), np.full(24_000, 0.1, np.float32)
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": long}, {"type": "image", "image": Image.new("RGB", (32, 32))},
        {"type": "audio", "audio": short}, {"type": "image", "image": Image.new("RGB", (64, 64))}]}]
    ids, media = chat_media_inputs(processor, messages)
    assert media.audio_lengths.tolist() == [150, 20]
    assert media.image_grid_thw.tolist() == [[1, 2, 2], [1, 4, 4]]
    pads = [t for t in ids if t in (AUDIO_PAD, IMAGE_PAD)]
    runs = [(t, len(list(g))) for t, g in itertools.groupby(pads)]
    assert runs == [(AUDIO_PAD, 20), (IMAGE_PAD, 4), (AUDIO_PAD, 3), (IMAGE_PAD, 16)]


_AUDIO_PART = {"type": "audio", "audio": np.full(1_600, 0.1, np.float32)}


@pytest.mark.parametrize("name,messages,words", [
    ("unknown part type", [{"role": "user", "content": [{"type": "file", "file": "x"}]}],
     "messages[0].content[0].type: 'file' is not a part type"),
    ("video part", [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}], "'video' is not a part type"),
    ("audio in a system turn", [{"role": "system", "content": [_AUDIO_PART]}, {"role": "user", "content": "Hi"}],
     "messages[0].content[0]: audio parts are only read in user messages"),
    ("audio value missing", [{"role": "user", "content": [{"type": "audio"}]}],
     "messages[0].content[0].audio is missing"),
    ("text not a string", [{"role": "user", "content": [{"type": "text", "text": 3}, _AUDIO_PART]}],
     "messages[0].content[0].text must be a string"),
    ("part not a dict", [{"role": "user", "content": ["Hi"]}], "messages[0].content[0] must be a dict"),
    ("content not a list", [{"role": "user", "content": 3}], "messages[0].content must be"),
    ("no role", [{"content": "Hi"}], "messages[0] must be a dict with a 'role'"),
    ("no messages", [], "non-empty list"),
    ("too many parts", [{"role": "user", "content": [_AUDIO_PART] * 3}], "messages: more than 2 media parts"),
    ("bad audio", [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "audio", "audio": b"RIFF"}]}],
     "messages[0].content[1].audio: must be a path"),
    ("bad image", [{"role": "user", "content": [{"type": "image", "image": "/nonexistent.png"}]}],
     "messages[0].content[0].image: cannot read"),
])
def test_bad_chat_messages_name_the_part(processor, name, messages, words):
    with pytest.raises(ValueError) as raised:
        chat_media_inputs(processor, messages, MediaLimits(max_parts=2))
    assert words in str(raised.value), str(raised.value)


def test_a_checkpoint_without_a_processor_refuses_media():
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: this checkpoint has no processor "
                                         r"\(preprocessor_config.json\)"):
        chat_media_inputs(None, [{"role": "user", "content": [_AUDIO_PART]}])
