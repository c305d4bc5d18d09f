"""Qwen2.5-Omni end to end through the one engine, against transformers'
`Qwen2_5OmniForConditionalGeneration.generate` on the same saved tiny checkpoint (weights + spk_dict.pt +
tokenizer), loaded back through `OmniPipeline.from_pretrained`.

The reference call is `generate(input_ids, speaker=..., thinker_*/talker_* max tokens, greedy, talker EOS =
the config's codec end and pad ids)` without an attention mask, with `torch.manual_seed` set identically
before ours and before it: token2wav's DiT draws its one `torch.randn` from the global RNG, and our greedy
unseeded request draws nothing else from it.
"""

import numpy as np
import pytest
import torch
from audio_checks import assert_audible, assert_audio_equal
from media_samples import b64, encode, tone
from PIL import Image
from transformers import Qwen2_5OmniForConditionalGeneration

from omnimtp.codec.token2wav import StreamingToken2Wav
from omnimtp.engine.request import Request
from omnimtp.media import AUDIO_SAMPLING_RATE, Qwen2_5OmniAudioImageProcessor
from omnimtp.models.tiny_qwen2_5_omni import TINY_QWEN2_5_CODEC, save_tiny_qwen2_5_omni
from omnimtp.pipeline import OmniPipeline
from omnimtp.runtime.ops import Rope
from omnimtp.sampling import SamplingParams, request_seeds
from omnimtp.talker.loop import QWEN2_5_OMNI_TALKER_SAMPLING

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 12
MAX_FRAMES = 40
SAMPLES_PER_CODE = 480  # 2 mel frames per code (DiT repeats) × BigVGAN's 240 samples per mel frame
CONFIG_EOS = [TINY_QWEN2_5_CODEC["eos"], TINY_QWEN2_5_CODEC["pad"]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_omni")
    save_tiny_qwen2_5_omni(path, seed=0)
    return path


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return OmniPipeline.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference_model(checkpoint):
    return Qwen2_5OmniForConditionalGeneration.from_pretrained(checkpoint).eval()


def _prompt(pipe, text):
    return pipe.family.chat_ids([{"role": "user", "content": text}])


def reference_generate(model, pipe, prompt, speaker="Chelsie", max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES,
                       seed=0, **media):
    """transformers' generate: (reply ids, talker codes [1, T] before EOS, audio). media: the processor's
    tensors; pixel_values go in as thinker_pixel_values (generate hands unprefixed pixel_values to the talker
    too, whose generate refuses them)."""
    captured = {}
    talker_generate = model.talker.generate

    def record(**kwargs):
        result = talker_generate(**kwargs)
        captured["codes"] = result[:, kwargs["input_ids"].shape[1]:]
        return result

    model.talker.generate = record
    try:
        torch.manual_seed(seed)
        sequences, audio = model.generate(
            torch.tensor([prompt]), speaker=speaker, thinker_max_new_tokens=max_new_tokens,
            talker_max_new_tokens=max_frames, thinker_do_sample=False, talker_do_sample=False,
            talker_eos_token_id=CONFIG_EOS, thinker_eos_token_id=sorted(pipe.family.eos_token_ids),
            **{("thinker_" + name if name == "pixel_values" else name): value for name, value in media.items()},
        )
    finally:
        del model.talker.generate
    codes = captured["codes"]
    is_eos = torch.isin(codes[0], torch.tensor(CONFIG_EOS))
    length = int(is_eos.nonzero()[0, 0]) if is_eos.any() else codes.shape[1]
    return sequences[0, len(prompt):].tolist(), codes[:, :length], audio.numpy()


@pytest.mark.parametrize("text, speaker", [("Hello there, how are you?", "Chelsie"), ("Hi", "Ethan")])
def test_greedy_equals_transformers_generate(pipe, reference_model, text, speaker):
    prompt = _prompt(pipe, text)
    ref_ids, ref_codes, ref_audio = reference_generate(reference_model, pipe, prompt, speaker, seed=3)
    torch.manual_seed(3)
    ours = pipe.generate(input_ids=prompt, speaker=speaker, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    assert ours.text_ids == ref_ids
    assert ours.text == pipe.tokenizer.decode(ref_ids[:-1] if ours.thinker_finish_reason == "stop" else ref_ids,
                                              skip_special_tokens=True)
    assert ref_codes.shape[1] >= 5  # enough codes for the reply rows and the penalty to matter
    assert ours.codes.shape == (1, ref_codes.shape[1]) and torch.equal(ours.codes, ref_codes)
    assert ours.sample_rate == 24000 and ours.audio.shape == (SAMPLES_PER_CODE * ours.codes.shape[1],)
    assert_audio_equal(ours.audio, ref_audio)


def test_max_frames_caps_the_talker_as_talker_max_new_tokens(pipe, reference_model):
    prompt = _prompt(pipe, "Hello there, how are you?")
    _, ref_codes, ref_audio = reference_generate(reference_model, pipe, prompt, max_frames=3, seed=5)
    torch.manual_seed(5)
    ours = pipe.generate(input_ids=prompt, max_new_tokens=MAX_NEW_TOKENS, max_frames=3)
    assert ours.codes.shape == (1, 3) and ours.talker_finish_reason == "length" and ours.finish_reason == "length"
    assert torch.equal(ours.codes, ref_codes)
    assert_audio_equal(ours.audio, ref_audio)


def test_seeded_batch_rows_equal_alone_and_repeat_whatever_the_global_rng(pipe):
    prompts = [_prompt(pipe, "Hello there, how are you?"), _prompt(pipe, "Hi")]
    sampled = SamplingParams(temperature=0.8, top_k=20)
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, thinker_sampling=sampled,
                  talker_sampling=QWEN2_5_OMNI_TALKER_SAMPLING)
    torch.manual_seed(0)
    batch = pipe.generate(input_ids=prompts, seed=[11, 12], **kwargs)
    torch.manual_seed(1)  # a seeded request's noise (DiT included) is its own
    alone = [pipe.generate(input_ids=p, seed=s, **kwargs) for p, s in zip(prompts, [11, 12], strict=True)]
    for row, single in zip(batch, alone, strict=True):
        assert row.text_ids == single.text_ids and torch.equal(row.codes, single.codes)
        assert_audio_equal(row.audio, single.audio)
    other = pipe.generate(input_ids=prompts[0], seed=13, **kwargs)
    assert_audible(other.audio)
    assert other.audio.shape != alone[0].audio.shape or not np.array_equal(other.audio, alone[0].audio)


def test_the_dit_noise_of_a_seeded_request_is_its_own(pipe):
    """Greedy thinker and talker, so only the DiT noise depends on the seed: the same seed repeats bit for
    bit whatever the global RNG, another seed (or an unseeded request) changes the audio, not the codes."""
    prompt = _prompt(pipe, "Hi")
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    torch.manual_seed(0)
    first = pipe.generate(input_ids=prompt, seed=4, **kwargs)
    torch.manual_seed(99)
    again = pipe.generate(input_ids=prompt, seed=4, **kwargs)
    other = pipe.generate(input_ids=prompt, seed=5, **kwargs)
    assert_audio_equal(again.audio, first.audio)
    assert torch.equal(other.codes, first.codes)
    assert_audible(other.audio)
    assert np.abs(other.audio - first.audio).max() > 0.05 * np.abs(first.audio).max()


def test_sampled_talker_with_a_seed(pipe):
    prompt = _prompt(pipe, "Hello there, how are you?")
    kwargs = dict(max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, talker_sampling=QWEN2_5_OMNI_TALKER_SAMPLING)
    greedy = pipe.generate(input_ids=prompt, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    runs = [pipe.generate(input_ids=prompt, seed=seed, **kwargs) for seed in (21, 21, 22)]
    assert torch.equal(runs[0].codes, runs[1].codes)
    assert_audio_equal(runs[1].audio, runs[0].audio)
    assert runs[0].text_ids == greedy.text_ids  # the thinker stays greedy
    sampled_codes = [r.codes for r in runs]
    assert any(c.shape != greedy.codes.shape or not torch.equal(c, greedy.codes) for c in sampled_codes)
    specials = torch.tensor([TINY_QWEN2_5_CODEC["bos"], *CONFIG_EOS])  # suppressed, or the end of the codes
    assert not any(torch.isin(c, specials).any() for c in sampled_codes)


def test_streamed_audio_is_the_one_shot_audio_up_to_the_chunking(pipe):
    """The DiT is not causal: streamed audio is chunked token2wav (same codes, same noise, same length),
    close to the one-shot decode but not its bits; the first chunk goes out before the talker ends."""
    prompt = _prompt(pipe, "Hello there, how are you?")
    kwargs = dict(seed=7, max_new_tokens=MAX_NEW_TOKENS, max_frames=400)
    whole = pipe.generate(input_ids=prompt, **kwargs)
    codec = pipe.family.codec
    pipe.family.codec = StreamingToken2Wav(pipe.model.token2wav, chunk_frames=16, look_ahead_frames=8)  # short replies
    try:
        events = list(pipe.stream(input_ids=prompt, **kwargs))
    finally:
        pipe.family.codec = codec
    chunks = [e.audio for e in events if e.audio is not None]
    assert all(chunk.size > 0 for chunk in chunks)
    assert "".join(e.text for e in events) == whole.text
    final = events[-1].output
    assert torch.equal(final.codes, whole.codes) and whole.codes.shape[1] > 2 * (16 + 8)
    assert len(chunks) >= 2  # chunked, not one block at the end
    streamed = np.concatenate(chunks)
    assert_audible(whole.audio)
    assert streamed.shape == whole.audio.shape
    assert not np.array_equal(streamed, whole.audio)
    error = streamed.astype(np.float64) - whole.audio
    snr_db = 10 * np.log10(np.mean(whole.audio.astype(np.float64) ** 2) / np.mean(error**2))
    assert snr_db > 20


def test_unknown_speaker_is_refused_naming_the_speakers(pipe):
    with pytest.raises(ValueError, match=r"speaker.*'Nobody'.*Chelsie.*Ethan"):
        pipe.generate("Hi", speaker="Nobody")
    assert pipe.family.speakers == ("Chelsie", "Ethan") and pipe.family.match_speaker("ethan") == "Ethan"


def test_chat_prompt_and_tiny_default(pipe):
    out = pipe.generate([{"role": "user", "content": "Hello"}], max_frames=6)
    assert out.codes.shape[0] == 1 and 1 <= out.codes.shape[1] <= 6
    assert_audible(out.audio)
    tiny = OmniPipeline.tiny(family="qwen2_5")
    assert tiny.family.num_code_groups == 1 and tiny.family.sample_rate == 24000
    assert type(tiny.processor) is Qwen2_5OmniAudioImageProcessor
    with pytest.raises(ValueError, match="family"):
        OmniPipeline.tiny(family="qwen4")


def test_missing_speakers_file_is_refused(tmp_path):
    save_tiny_qwen2_5_omni(tmp_path)
    (tmp_path / "spk_dict.pt").unlink()
    with pytest.raises(ValueError, match="spk_dict.pt"):
        OmniPipeline.from_pretrained(tmp_path)


def test_a_greedy_unseeded_request_draws_nothing_from_the_global_rng():
    state = torch.get_rng_state()
    request = Request(0, [1, 2], max_new_tokens=2, max_frames=2, speaker="Chelsie")
    assert torch.equal(torch.get_rng_state(), state) and request.codec_generator is None
    Request(1, [1, 2], max_new_tokens=2, max_frames=2, talker_sampling=QWEN2_5_OMNI_TALKER_SAMPLING)
    assert not torch.equal(torch.get_rng_state(), state)  # a sampled one draws its seed from it
    seeded = Request(2, [1, 2], max_new_tokens=2, max_frames=2, seed=3)
    assert seeded.codec_generator.initial_seed() == request_seeds(3)[2]


def test_request_seeds_keep_thinker_and_talker_and_add_a_distinct_codec_seed():
    for seed in (0, 1, 7, -1, 2**63 - 1, -(2**63)):
        thinker, talker, codec = request_seeds(seed)
        assert (thinker, talker) == ((2 * seed) % 2**64, (2 * seed + 1) % 2**64)
        assert codec not in (thinker, talker) and 0 <= codec < 2**64
    assert len({request_seeds(seed)[2] for seed in range(1000)}) == 1000


def test_mrope_in_sections_equals_the_qwen2_5_rotary_module(reference_model):
    """Qwen2.5-Omni's M-RoPE takes consecutive channel sections per axis (not Qwen3's interleaving): our
    tables equal the module's cos / sin on 3-D positions that differ per axis."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import apply_rotary_pos_emb

    rotary = reference_model.thinker.model.language_model.rotary_emb
    head_dim = reference_model.config.thinker_config.text_config.hidden_size // 4
    rope = Rope.from_module(rotary, head_dim)
    assert not rope.is_mrope_interleaved
    positions = torch.stack([torch.arange(6), torch.arange(6) * 2 + 1, torch.arange(6) * 3 + 2])[:, None]  # [3, 1, 6]
    x = torch.randn(1, 6, 2, head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary(x, positions)  # [1, 6, D]
    expected, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    ours_cos, ours_sin = rope.tables(positions, torch.float32)  # [1, 6, 1, D]
    rolled = x.roll(head_dim // 2, dims=-1)
    assert torch.allclose((x * ours_cos + rolled * ours_sin).transpose(1, 2), expected, atol=1e-6)


# -- the CLI and the server, through `--model <dir>` ---------------------------------------------------


def test_speak_cli_with_a_qwen2_5_checkpoint(pipe, checkpoint, tmp_path):
    import soundfile

    from omnimtp.cli import main

    torch.manual_seed(0)
    expected = pipe.generate([{"role": "user", "content": "Hello"}], max_new_tokens=6, max_frames=8)
    path = tmp_path / "a.wav"
    torch.manual_seed(0)
    assert main(["speak", "Hello", "-o", str(path), "--model", str(checkpoint), "--max-new-tokens", "6",
                 "--max-frames", "8"]) == 0
    audio, rate = soundfile.read(path, dtype="float32")
    assert rate == 24000 and len(audio) == SAMPLES_PER_CODE * expected.codes.shape[1]
    assert_audible(audio)
    assert np.abs(audio - expected.audio).max() <= 2 / 32768  # through libsndfile's 16-bit wav


def test_served_chat_with_audio_and_an_unknown_voice(pipe, checkpoint):
    import base64

    import openai
    from server_harness import running_server

    from omnimtp.server.app import create_app
    from omnimtp.server.audio import to_pcm16
    from omnimtp.server.build import build_engine

    engine = build_engine(str(checkpoint), max_batch_size=2, max_frames=8)
    assert engine.speakers == pipe.family.speakers
    messages = [{"role": "user", "content": "Tell me something"}]
    with running_server(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        served = client.chat.completions.create(
            model=engine.model_id, messages=messages, modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "pcm16"}, seed=21, temperature=0.0, max_tokens=6,
        )
        speech = np.frombuffer(client.audio.speech.create(
            model=engine.model_id, voice="Chelsie", input="Hello there", response_format="pcm",
        ).content, dtype="<i2")  # a speech request: the text's thinker embeddings as the talker's rows
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model=engine.model_id, messages=messages, modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "pcm16"}, max_tokens=2,
            )
    assert speech.size > 0 and speech.size % SAMPLES_PER_CODE == 0
    assert_audible(speech)
    assert raised.value.status_code == 400 and raised.value.body["param"] == "audio.voice"
    assert "alloy" in raised.value.body["message"] and "Chelsie" in raised.value.body["message"]
    output = pipe.generate(messages, speaker="Ethan", max_new_tokens=6, max_frames=8, seed=21)
    message = served.choices[0].message
    assert message.content == output.text
    assert served.usage.completion_tokens_details.audio_tokens == output.codes.shape[1]
    pcm = np.frombuffer(base64.b64decode(message.audio.data), dtype="<i2")
    assert_audible(pcm)
    assert np.array_equal(pcm, to_pcm16(output.audio))


# -- audio and image input (processor tensors with input_ids) -------------------------------------------


QUESTION = "Tell me more"


def _media_prompt(pipe, kind):
    """A user turn that holds one audio (30 feature frames) or one 2×2-patch image, and its tensors."""
    from omnimtp.models.tiny_qwen2_5_omni import QWEN2_5_THINKER_SPECIAL_TOKENS as S

    generator = torch.Generator().manual_seed(1)
    if kind == "audio":
        frames = 30
        media = dict(input_features=torch.randn(1, 16, frames, generator=generator),
                     feature_attention_mask=torch.ones(1, frames, dtype=torch.long))
        rows = ((frames - 1) // 2 + 1 - 2) // 2 + 1  # the Qwen2.5 audio tower's output length
        run = [S["<|audio_start|>"]] + [S["<|audio_pad|>"]] * rows + [S["<|audio_end|>"]]
    else:
        media = dict(pixel_values=torch.randn(4, 3 * 2 * 16 * 16, generator=generator),
                     image_grid_thw=torch.tensor([[1, 2, 2]]))
        run = [S["<|vision_start|>"]] + [S["<|image_pad|>"]] * 4 + [S["<|vision_end|>"]]
    ids = _prompt(pipe, QUESTION)
    return ids[:3] + run + ids[3:], media


@pytest.mark.parametrize("kind", ["audio", "image"])
def test_media_input_equals_transformers_generate(pipe, reference_model, kind):
    prompt, media = _media_prompt(pipe, kind)
    ref_ids, ref_codes, ref_audio = reference_generate(reference_model, pipe, prompt, seed=2, **media)
    torch.manual_seed(2)
    ours = pipe.generate(input_ids=prompt, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, **media)
    text_only = pipe.generate(input_ids=_prompt(pipe, QUESTION), max_new_tokens=MAX_NEW_TOKENS, max_frames=4)
    assert ours.text_ids == ref_ids != text_only.text_ids
    assert ref_codes.shape[1] >= 3 and torch.equal(ours.codes, ref_codes)
    assert_audio_equal(ours.audio, ref_audio)


# -- audio and image parts of chat messages (the checkpoint's processor) ----------------------------------


def _media_part(kind):
    if kind == "audio":
        return {"type": "audio", "audio": tone(1.2, AUDIO_SAMPLING_RATE, hz=330.0)}  # 120 feature frames
    noise = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)  # 64×48: 3×4 patches
    return {"type": "image", "image": Image.fromarray(noise)}


@pytest.mark.parametrize("kind, num_pads", [("audio", 30), ("image", 12)])
def test_chat_media_parts_equal_transformers_generate_on_the_processor_output(pipe, reference_model, kind, num_pads):
    """The saved-and-loaded processor is transformers' Qwen2.5-Omni processor (video-less); its output for the
    same messages, handed to transformers' generate, gives our tokens, codes and audio."""
    from omnimtp.models.tiny_qwen2_5_omni import QWEN2_5_THINKER_SPECIAL_TOKENS as S

    part = _media_part(kind)
    messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
    processor = pipe.processor
    assert type(processor) is Qwen2_5OmniAudioImageProcessor
    template = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True, tokenize=False,
    )
    inputs = processor(text=[template], return_tensors="pt", add_special_tokens=False,
                       **{"audio" if kind == "audio" else "images": [part[kind]]})
    prompt = inputs["input_ids"][0].tolist()
    media = {name: value for name, value in inputs.items() if name not in ("input_ids", "attention_mask")}
    assert prompt.count(S["<|audio_pad|>" if kind == "audio" else "<|image_pad|>"]) == num_pads
    assert pipe.family.chat_inputs(messages, pipe.media_limits)[0] == prompt
    ref_ids, ref_codes, ref_audio = reference_generate(reference_model, pipe, prompt, seed=4, **media)
    torch.manual_seed(4)
    ours = pipe.generate(messages, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    assert ours.text_ids == ref_ids
    assert ref_codes.shape[1] >= 3 and torch.equal(ours.codes, ref_codes)
    assert_audible(ours.audio)
    assert_audio_equal(ours.audio, ref_audio)


@pytest.mark.parametrize("kind", ["audio", "image"])
def test_served_media_is_the_pipelines_reply(pipe, checkpoint, kind):
    """An `input_audio` / `image_url` part over HTTP gives the text, prompt length and PCM of the pipeline on
    the same decoded media."""
    import base64

    import openai
    from media_samples import image_bytes
    from server_harness import running_server

    from omnimtp.media import decode_audio, decode_image
    from omnimtp.server.app import create_app
    from omnimtp.server.audio import to_pcm16
    from omnimtp.server.build import build_engine

    if kind == "audio":
        data = encode(tone(1.0, AUDIO_SAMPLING_RATE, hz=330.0), AUDIO_SAMPLING_RATE)
        http_part = {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}
        part = {"type": "audio", "audio": decode_audio(data, "wav", AUDIO_SAMPLING_RATE)}
    else:
        data = image_bytes(_media_part("image")["image"])
        http_part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(data)}"}}
        part = {"type": "image", "image": decode_image(data)}
    engine = build_engine(str(checkpoint), max_batch_size=2, max_frames=8)
    with running_server(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        served = client.chat.completions.create(
            model=engine.model_id, modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"},
            messages=[{"role": "user", "content": [http_part, {"type": "text", "text": QUESTION}]}],
            seed=21, temperature=0.0, max_tokens=6,
        )
    messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
    output = pipe.generate(messages, speaker="Chelsie", max_new_tokens=6, max_frames=8, seed=21)
    message = served.choices[0].message
    assert message.content == output.text
    prompt_ids, media = pipe.family.chat_inputs(messages, pipe.media_limits)
    assert media is not None and served.usage.prompt_tokens == len(prompt_ids)
    pcm = np.frombuffer(base64.b64decode(message.audio.data), dtype="<i2")
    assert_audible(pcm)
    assert np.array_equal(pcm, to_pcm16(output.audio))


def test_a_checkpoint_without_a_processor_refuses_media_and_serves_text(pipe, tmp_path):
    import httpx
    from server_harness import running_server

    from omnimtp.families.qwen2_5_omni import Qwen2_5OmniFamily
    from omnimtp.server.app import create_app
    from omnimtp.server.scheduler import Engine

    save_tiny_qwen2_5_omni(tmp_path)
    (tmp_path / "processor_config.json").unlink()
    bare = OmniPipeline.from_pretrained(tmp_path)
    assert bare.processor is None
    messages = [{"role": "user", "content": [_media_part("audio"), {"type": "text", "text": QUESTION}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: this checkpoint has no processor"):
        bare.generate(messages, max_frames=2)
    engine = Engine(Qwen2_5OmniFamily(pipe.model, pipe.tokenizer), max_frames=2, max_batch_size=2)
    audio = {"type": "input_audio", "input_audio": {"data": b64(encode(tone(0.5, AUDIO_SAMPLING_RATE),
                                                                       AUDIO_SAMPLING_RATE)), "format": "wav"}}
    with running_server(create_app(engine, max_tokens_limit=4)) as url, httpx.Client(base_url=url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, audio]}], "max_tokens": 2})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages.0.content.1" and "no processor" in error["message"]
        text = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=text).status_code == 200


def test_media_placeholders_must_match_the_tensors(pipe):
    prompt, media = _media_prompt(pipe, "audio")
    with pytest.raises(ValueError, match="audio"):
        pipe.generate(input_ids=prompt[:5] + prompt[6:], max_frames=2, **media)  # one pad short
    with pytest.raises(ValueError, match="audio"):
        pipe.generate(input_ids=prompt, max_frames=2)  # placeholders without the features
