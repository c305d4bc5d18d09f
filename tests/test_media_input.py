"""Audio, image and video input against transformers' Qwen3-Omni `generate(return_audio=True)` on the same
weights: the processor's tensors through transformers' own encoders, deepstack, M-RoPE, the talker rows."""

import numpy as np
import pytest
import soxr
import torch
from audio_checks import assert_audible, assert_audio_close, assert_audio_equal
from media_samples import tone
from PIL import Image
from reference_omni import reference_generate
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

import omnimtp.thinker as thinker_module
from omnimtp.media import MediaInputs
from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS as T
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder
from omnimtp.thinker import ThinkerRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 10
MAX_FRAMES = 30
PATCH = 3 * 2 * 16 * 16  # C · temporal_patch · patch² of the tiny vision encoder


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_omni_media")
    OmniPipeline.tiny(seed=0).save_pretrained(path)
    return OmniPipeline.from_pretrained(path)


def _user_turn(middle: list[int], text: bytes = b"Hi") -> list[int]:
    return [T["<|im_start|>"], T["user"], 10, *middle, *text, T["<|im_end|>"], 10,
            T["<|im_start|>"], T["assistant"], 10]


def audio_case(seed: int = 1, frames: int = 230):
    features = torch.randn(1, 16, frames, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(1, frames, dtype=torch.long)
    rows = int(_get_feat_extract_output_lengths(torch.tensor(frames), 50))
    ids = _user_turn([T["<|audio_start|>"], *[T["<|audio_pad|>"]] * rows, T["<|audio_end|>"]])
    return ids, dict(input_features=features, feature_attention_mask=mask)


def image_case(seed: int = 2, grid=(1, 4, 6)):
    num_patches = int(np.prod(grid))
    pixels = torch.randn(num_patches, PATCH, generator=torch.Generator().manual_seed(seed))
    ids = _user_turn([T["<|vision_start|>"], *[T["<|image_pad|>"]] * num_patches, T["<|vision_end|>"]])
    return ids, dict(pixel_values=pixels, image_grid_thw=torch.tensor([grid]))


def video_case(seed: int = 3, grid=(2, 4, 4)):
    num_patches = int(np.prod(grid))
    pixels = torch.randn(num_patches, PATCH, generator=torch.Generator().manual_seed(seed))
    ids = _user_turn([T["<|vision_start|>"], *[T["<|video_pad|>"]] * num_patches, T["<|vision_end|>"]])
    media = dict(pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]),
                 video_second_per_grid=torch.tensor([2.0]))
    return ids, media


CASES = {"audio": audio_case, "image": image_case, "video": video_case}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_greedy_equals_reference(pipe, kind, monkeypatch):
    ids, media = CASES[kind]()
    ref_ids, ref_codes, ref_audio = reference_generate(
        pipe.model, ids, MAX_NEW_TOKENS, MAX_FRAMES, monkeypatch, **media
    )
    ours = pipe.generate(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, **media)
    assert ours.text_ids == ref_ids
    assert ref_codes.shape[1] >= 10
    assert torch.equal(ours.codes, ref_codes)
    assert_audible(ours.audio)
    assert_audio_close(ours.audio, ref_audio, rel=1e-5)
    # streamed: the talker starts on the handoff's chunks, the audio joins into the one-shot decode
    events = list(pipe.stream(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, **media))
    chunks = [event.audio for event in events if event.audio is not None]
    assert len(chunks) >= 2
    assert torch.equal(events[-1].output.codes, ref_codes)
    assert_audio_close(np.concatenate(chunks), ours.audio, rel=1e-5)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_thinker_rows_equal_the_reference_hidden_states(kind):
    """Every row handed to the talker (layer-0 embeddings with the encoder rows, the accept layer) is
    transformers' own: the embeddings and the prefill rows bit for bit, the decode rows up to float rounding
    (a one-row decode step runs its linears on the row kernel, the one a speculative verify uses, so plain and
    speculative rows agree bit for bit; transformers' runs `mv`); and a vision prompt's decode positions
    continue from its 3-D maximum."""
    ids, media = CASES[kind]()
    pipe = OmniPipeline.tiny(seed=0)
    thinker = pipe.model.thinker
    ref = thinker.generate(
        input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=sorted(pipe.eos_token_ids),
        output_hidden_states=True, return_dict_in_generate=True, **media,
    )
    num_layers = thinker.config.text_config.num_hidden_layers
    for layer in (pipe.accept_hidden_layer, num_layers):  # the talker's layer; the last, after the deepstack adds
        embeds, hidden, run = _thinker_rows(pipe, ids, media, layer)
        assert run.output_ids[0] == ref.sequences[0, len(ids):].tolist()
        assert torch.equal(embeds, torch.cat([h[0] for h in ref.hidden_states], dim=1)[0])
        expected = torch.cat([h[layer] for h in ref.hidden_states], dim=1)[0]
        assert torch.equal(hidden[: len(ids)], expected[: len(ids)])
        scale = expected[len(ids):].abs().max()
        assert scale > 0 and (hidden[len(ids):] - expected[len(ids):]).abs().max() <= 1e-5 * scale
    offset = run.kv.rope_offsets[0]
    assert (offset != 0) == (kind != "audio")  # audio advances all three axes: plain 1-D positions


def _thinker_rows(pipe, ids, media, layer):
    """A greedy ThinkerRun's rows: (embeds [R, D], hidden state `layer` [R, D], the run)."""
    run = ThinkerRun(pipe.model.thinker, [ids], accept_hidden_layer=layer, eos_token_ids=pipe.eos_token_ids,
                     max_new_tokens=MAX_NEW_TOKENS, media=[MediaInputs(**media)], decoder=pipe.thinker_decoder)
    embeds, hidden = [], []
    while not run.is_finished:
        for event in run.step():
            embeds.append(event.embeds)
            hidden.append(event.hidden)
    return torch.cat(embeds), torch.cat(hidden), run


def test_media_alone_equals_media_in_a_mixed_batch(pipe):
    """One call, prompts with and without media; each row equals the same request alone, greedy and
    seeded sampling (its own KV slot, positions and generators)."""
    (audio_ids, audio), (image_ids, image) = audio_case(), image_case()
    text_ids = _user_turn([], b"Hello there")
    batch_media = {**audio, **image}
    sampled = dict(thinker_sampling=SamplingParams(temperature=0.9, top_k=20),
                   talker_sampling=SamplingParams(temperature=0.9, top_k=20))
    for options in ({}, sampled):
        common = dict(max_new_tokens=MAX_NEW_TOKENS, max_frames=12, **options)
        batch = pipe.generate(input_ids=[image_ids, text_ids, audio_ids], seed=[5, 6, 7], **common, **batch_media)
        alone = [
            pipe.generate(input_ids=image_ids, seed=5, **common, **image),
            pipe.generate(input_ids=text_ids, seed=6, **common),
            pipe.generate(input_ids=audio_ids, seed=7, **common, **audio),
        ]
        for ours, single in zip(batch, alone, strict=True):
            assert ours.text_ids == single.text_ids
            assert torch.equal(ours.codes, single.codes)
            assert_audible(single.audio)
            assert_audio_equal(ours.audio, single.audio)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_changing_the_media_changes_the_output(pipe, kind):
    ids, media = CASES[kind]()
    _, other = CASES[kind](seed=11)
    common = dict(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=8)
    a, b = pipe.generate(**common, **media), pipe.generate(**common, **other)
    assert a.text_ids != b.text_ids or not torch.equal(a.codes, b.codes)


def test_deepstack_and_talker_positions_are_used(pipe, monkeypatch):
    """Dropping the deepstack features (all of them, or every level after the first) changes the thinker's
    last hidden rows, dropping the talker's 3-D positions changes an image reply's codes: none is a no-op
    on the tiny model (two deepstack levels), so the equalities with the reference above cover them."""
    ids, media = image_case()
    last_layer = pipe.model.config.thinker_config.text_config.num_hidden_layers
    _, full_rows, _ = _thinker_rows(pipe, ids, media, last_layer)
    prefill = thinker_module.multimodal_prefill
    for num_levels in (0, 1):

        def fewer_levels(*args, num_levels=num_levels):
            full_prefill = prefill(*args)
            assert len(full_prefill.layer_adds) == 2
            return thinker_module.Prefill(
                full_prefill.embeds, full_prefill.rope_positions, full_prefill.layer_adds[:num_levels]
            )

        with monkeypatch.context() as patch:
            patch.setattr(thinker_module, "multimodal_prefill", fewer_levels)
            _, rows, _ = _thinker_rows(pipe, ids, media, last_layer)
        assert rows.shape == full_rows.shape and (rows - full_rows).abs().max() > 1e-3, num_levels
    common = dict(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=12, **media)
    full = pipe.generate(**common)
    with monkeypatch.context() as patch:
        patch.setattr(Qwen3TalkerInputBuilder, "_prefill_positions", lambda self, media: None)
        flat = pipe.generate(**common)
    assert flat.text_ids == full.text_ids and not torch.equal(flat.codes, full.codes)


def test_a_video_without_seconds_per_grid_is_one_at_the_temporal_patch_size(pipe):
    """A video without video_second_per_grid is the processor's default (1 fps: temporal_patch_size seconds
    per grid step): the same reply and M-RoPE offset as the same video with the field given; another value
    moves the offset, so the comparison can fail."""
    ids, media = video_case()
    del media["video_second_per_grid"]
    temporal_patch = pipe.model.config.thinker_config.vision_config.temporal_patch_size
    common = dict(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=12)

    def offset(**seconds):
        return _thinker_rows(pipe, ids, {**media, **seconds}, pipe.accept_hidden_layer)[2].kv.rope_offsets[0]

    given = torch.tensor([float(temporal_patch)])
    assert offset() == offset(video_second_per_grid=given)
    assert offset(video_second_per_grid=torch.tensor([1.0])) != offset()
    default, explicit = pipe.generate(**common, **media), pipe.generate(**common, **media, video_second_per_grid=given)
    assert default.text_ids == explicit.text_ids and torch.equal(default.codes, explicit.codes)
    assert_audio_equal(default.audio, explicit.audio)


def test_bad_media_is_a_clear_error(pipe):
    audio_ids, audio = audio_case()
    image_ids, image = image_case()
    pad = T["<|image_pad|>"]
    short = [token for i, token in enumerate(image_ids) if not (token == pad and i == image_ids.index(pad))]
    cases = [
        (dict(input_ids=image_ids), "image inputs give \\[\\] encoder rows"),  # placeholders without media
        (dict(input_ids=_user_turn([]), **image), "image_grid_thw"),  # media without placeholders
        (dict(input_ids=short, **image), "encoder rows"),  # one placeholder short
        (dict(input_ids=audio_ids, **audio, **image), "image_grid_thw"),
        (dict(input_ids=image_ids, pixel_values=image["pixel_values"]), "given together"),
        (dict(input_ids=image_ids, pixel_values=image["pixel_values"][:-1], image_grid_thw=image["image_grid_thw"]),
         "patches"),
        (dict(input_ids=audio_ids, input_features=audio["input_features"],
              feature_attention_mask=audio["feature_attention_mask"][:, :10]),
         "feature_attention_mask"),
        (dict(input_ids=[T["<|image_pad|>"], *image_ids]), "follows no start id"),
        (dict(prompt="Hello", **image), "input_ids"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            pipe.generate(max_new_tokens=2, max_frames=2, **kwargs)


def test_audio_and_image_in_one_prompt(pipe):
    """transformers' generate(return_audio=True) raises on such a prompt (its talker config has no
    audio_config for get_rope_index); the thinker still equals transformers' thinker, and the talker speaks."""
    (audio_ids, audio), (image_ids, image) = audio_case(), image_case()
    audio_run = audio_ids[3 : audio_ids.index(T["<|audio_end|>"]) + 1]
    image_run = image_ids[3 : image_ids.index(T["<|vision_end|>"]) + 1]
    ids, media = _user_turn(audio_run + image_run), {**audio, **image}
    ours = pipe.generate(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, **media)
    ref = pipe.model.thinker.generate(
        input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=sorted(pipe.eos_token_ids), **media,
    )
    assert ours.text_ids == ref[0, len(ids):].tolist()
    assert ours.codes.shape[1] > 0
    assert_audible(ours.audio)
    batch = pipe.generate(input_ids=[_user_turn([]), ids], max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES,
                          **media)
    assert torch.equal(batch[1].codes, ours.codes)


def test_chat_parts_go_through_the_checkpoints_processor(pipe, tmp_path):
    """A saved checkpoint keeps its processor; chat parts (an audio array, an image file) give exactly
    what the processor's own tensors give through input_ids, and a checkpoint without a processor refuses
    such a part by name."""
    assert pipe.processor is not None
    image_path = tmp_path / "photo.png"
    Image.fromarray((np.arange(64 * 48 * 3) % 251).astype(np.uint8).reshape(48, 64, 3)).save(image_path)
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": (tone(1.5, 22050, hz=330.0), 22050)},
        {"type": "image", "image": str(image_path)},
        {"type": "text", "text": "What is this?"},
    ]}]
    common = dict(max_new_tokens=MAX_NEW_TOKENS, max_frames=12)
    ours = pipe.generate(messages, **common)
    prompt = pipe.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    audio = soxr.resample(tone(1.5, 22050, hz=330.0), 22050, 16000)  # to the feature extractor's rate
    inputs = pipe.processor(text=[prompt], audio=[audio], images=[Image.open(image_path).convert("RGB")],
                            return_tensors="pt")
    media = {
        name: inputs[name] for name in ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw")
    }
    direct = pipe.generate(input_ids=inputs["input_ids"][0].tolist(), **common, **media)
    assert ours.text_ids == direct.text_ids and torch.equal(ours.codes, direct.codes)
    assert_audible(ours.audio)

    bare = tmp_path / "no_processor"
    pipe.model.save_pretrained(bare)
    pipe.tokenizer.save_pretrained(bare)
    without = OmniPipeline.from_pretrained(bare)
    assert without.processor is None
    assert without.generate("Hello", max_new_tokens=2, max_frames=2).text_ids  # text still works
    with pytest.raises(ValueError, match="processor"):
        without.generate(messages, **common)
