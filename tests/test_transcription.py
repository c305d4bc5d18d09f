"""Transcription with the omni model: the thinker alone answers the family's ASR prompt.

`OmniPipeline.transcribe` equals transformers' `generate` (text only, greedy) on the prompt and audio the
processor makes of the same messages; streamed deltas join into the one-shot text; seeded sampling repeats;
bad arguments are ValueErrors naming them; `omnimtp transcribe` prints what `transcribe` returns."""

import json

import numpy as np
import pytest
import soundfile
import soxr
import torch
from audio_checks import spoken_wav

from omnimtp.cli import main
from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import Request
from omnimtp.pipeline import OmniPipeline, Transcription
from omnimtp.sampling import SamplingParams

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> str:
    """A real spoken sentence (espeak-ng), 22.05 kHz: the pipeline resamples it to the processor's 16 kHz."""
    return str(spoken_wav(tmp_path_factory.mktemp("asr") / "hello.wav", "hello world, this is a test"))


@pytest.fixture(scope="module", params=["qwen3", "qwen2_5"])
def pipe(request) -> OmniPipeline:
    return OmniPipeline.tiny(family=request.param, max_new_tokens=MAX_NEW_TOKENS)


def _reference(pipe: OmniPipeline, path: str, language, prompt) -> tuple[list[int], list[int], str]:
    """(prompt ids, reply ids, prompt text) of the processor and transformers' generate on the family's ASR messages."""
    processor = pipe.processor
    rate = processor.feature_extractor.sampling_rate
    samples, file_rate = soundfile.read(path, dtype="float32")
    samples = soxr.resample(samples, file_rate, rate).astype(np.float32)
    messages = pipe.family.transcription_messages("unused", language, prompt)
    template = [{**m, "content": [{"type": p["type"]} if p["type"] == "audio" else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in messages]
    templater = processor if processor.chat_template is not None else processor.tokenizer  # the tiny one's
    text = templater.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], audio=[samples], return_tensors="pt", add_special_tokens=False)
    ids = inputs["input_ids"]
    media = {k: inputs[k] for k in ("input_features", "feature_attention_mask")}
    # the thinker's generate: what the model's generate runs for a text-only reply (return_audio=False)
    sequences = pipe.model.thinker.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
        eos_token_id=sorted(pipe.eos_token_ids), **media,
    )
    return ids[0].tolist(), sequences[0, ids.shape[1]:].tolist(), text


@pytest.mark.parametrize("language, prompt", [(None, None), ("en", "Names: Ada Lovelace.")])
def test_transcribe_equals_transformers_generate(pipe, speech, language, prompt):
    """Greedy: the same prompt ids as the processor makes of the ASR messages, and the same reply ids as
    transformers' thinker generate; the prompt says the documented instruction."""
    ref_prompt, ref_reply, text = _reference(pipe, speech, language, prompt)
    expected = "Transcribe the English audio into text." if language else "Transcribe the audio into text."
    assert expected in text
    assert (prompt or "") in text
    ours = pipe.transcribe(speech, language=language, prompt=prompt)
    assert isinstance(ours, Transcription)
    assert ours.text_ids == ref_reply
    assert len(ref_reply) > 0
    assert ours.text == pipe.tokenizer.decode(ref_reply, skip_special_tokens=True).strip()
    assert ours.duration == pytest.approx(soundfile.info(speech).duration, abs=1e-3)
    (segment,) = ours.segments
    assert (segment.start, segment.end, segment.text, segment.tokens) == (0.0, ours.duration, ours.text, ref_reply)
    request, _ = pipe._transcription_request(speech, language, prompt, None, None, None, is_streamed=False)
    assert request.prompt_ids == ref_prompt and request.speaker is None  # text only: no talker


def test_greedy_logprobs_are_transformers_log_softmax(pipe, speech):
    """A greedy transcription asked for logprobs: each reply token's logprob (and its 2 alternatives) is the
    log-softmax of transformers' logits at that step, within float32 tolerance; the text events carry the reply's
    tokens in order, and a request that asks none gets none."""
    request, _ = pipe._transcription_request(speech, "en", None, None, None, None, is_streamed=True)
    ids = torch.tensor([request.prompt_ids])
    media = {"input_features": request.media.input_features,
             "feature_attention_mask": request.media.feature_attention_mask}
    out = pipe.model.thinker.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
        eos_token_id=sorted(pipe.eos_token_ids), output_logits=True, return_dict_in_generate=True, **media)
    expected_ids = out.sequences[0, ids.shape[1]:].tolist()
    expected = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    asked = Request("asked", request.prompt_ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=1, media=request.media,
                    logprobs=2)
    unasked = Request("unasked", request.prompt_ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=1,
                      media=request.media)
    core = EngineCore(pipe.family)
    core.add(asked)
    core.add(unasked)
    carried = {"asked": [], "unasked": []}
    while core.has_work():
        for event in core.step():
            carried[event.request.request_id] += event.logprobs
    assert asked.output_ids == unasked.output_ids == expected_ids
    assert [lp.token_id for lp in asked.output_logprobs] == expected_ids and len(set(expected_ids)) > 2
    for lp, row in zip(asked.output_logprobs, expected, strict=True):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-5)
        assert [token for token, _ in lp.top] == torch.topk(row, 2).indices.tolist()
    assert carried["asked"] == asked.output_logprobs[:len(asked.reply_ids)]
    assert unasked.output_logprobs == [] and carried["unasked"] == []


def test_streamed_deltas_join_into_the_one_shot_text(pipe, speech):
    items = list(pipe.stream_transcription(speech, language="en"))
    final = items[-1]
    assert isinstance(final, Transcription) and all(isinstance(item, str) for item in items[:-1])
    assert final == pipe.transcribe(speech, language="en")
    assert "".join(items[:-1]).strip() == final.text


def test_seeded_sampling_repeats(pipe, speech):
    sampling = SamplingParams(temperature=1.0)
    first = pipe.transcribe(speech, sampling=sampling, seed=7)
    assert pipe.transcribe(speech, sampling=sampling, seed=7) == first
    others = {tuple(pipe.transcribe(speech, sampling=sampling, seed=s).text_ids) for s in (8, 9, 10)}
    assert others != {tuple(first.text_ids)}  # the seed matters


def test_bad_arguments_name_the_argument(pipe, speech, tmp_path):
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"not audio at all" * 10)
    long = (np.zeros(16_000 * int(pipe.media_limits.max_audio_seconds + 1), np.float32), 16_000)
    cases = [
        (dict(audio=str(tmp_path / "missing.wav")), "audio"),
        (dict(audio=str(garbage)), "audio"),
        (dict(audio=np.zeros(0, np.float32)), "audio"),
        (dict(audio=long), "audio"),
        (dict(audio=speech, language="klingon"), "language"),
        (dict(audio=speech, prompt=3), "prompt"),
        (dict(audio=speech, sampling="greedy"), "sampling"),
        (dict(audio=speech, max_new_tokens=0), "max_new_tokens"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=name):
            pipe.transcribe(**kwargs)
    tts = OmniPipeline.tiny(family="qwen3_tts")
    with pytest.raises(ValueError, match="model"):
        tts.transcribe(speech)


def test_a_prompt_and_reply_cap_that_exactly_fill_the_positions_are_taken(pipe, speech):
    request, _ = pipe._transcription_request(speech, None, None, None, None, 1, is_streamed=False)
    room = pipe.family.max_positions - len(request.prompt_ids)
    exact, _ = pipe._transcription_request(speech, None, None, None, None, room, is_streamed=False)
    assert exact.max_new_tokens == room
    with pytest.raises(ValueError, match="positions"):
        pipe._transcription_request(speech, None, None, None, None, room + 1, is_streamed=False)


def test_cli_seed_samples_and_repeats(speech, capsys):
    """`omnimtp transcribe --seed N` samples (temperature 1) with that seed: twice the same transcript, the
    pipeline's seeded one, not the greedy one."""
    pipe = OmniPipeline.tiny()
    sampled = pipe.transcribe(speech, sampling=SamplingParams(temperature=1.0), seed=7)
    assert sampled.text_ids != pipe.transcribe(speech).text_ids
    capsys.readouterr()
    for _ in range(2):
        assert main(["transcribe", speech, "--seed", "7", "--json"]) == 0
    assert [json.loads(line)["text_ids"] for line in capsys.readouterr().out.splitlines()] == [sampled.text_ids] * 2


def test_cli_prints_the_transcripts(speech, capsys):
    """`omnimtp transcribe FILE FILE --json`: one object per file, the tiny Qwen3-Omni's `transcribe`; a bad
    language is one error line naming it, exit status 2."""
    expected = OmniPipeline.tiny().transcribe(speech, language="en")
    capsys.readouterr()
    assert main(["transcribe", speech, speech, "--language", "en", "--json"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in out.splitlines()]
    assert err.count("note: tiny is a built-in tiny model with random weights: its transcripts are random") == 1
    assert [line["text_ids"] for line in lines] == [expected.text_ids] * 2
    assert lines[0]["file"] == speech and lines[0]["segments"][0]["end"] == expected.duration
    assert main(["transcribe", speech, "--language", "xx"]) == 2
    assert "language" in capsys.readouterr().err


def test_a_background_transcription_never_delays_first_audio(speech):
    """A background (low-priority) transcription next to a speaking chat, started before the chat arrives or
    with it: it writes no token from the chat's arrival until the chat's first audio has left (which leaves
    as many steps after its arrival as alone); the chat's audio and the transcript are what each gives alone."""
    pipe = OmniPipeline.tiny(max_new_tokens=MAX_NEW_TOKENS)

    def chat() -> Request:
        ids, _ = pipe.family.chat_inputs([{"role": "user", "content": "Hi"}], pipe.media_limits)
        return Request("chat", ids, max_new_tokens=4, max_frames=8, speaker=pipe.family.default_speaker)

    def transcription() -> Request:
        request, _ = pipe._transcription_request(speech, "en", None, None, None, None, is_streamed=True)
        request.request_id, request.is_background = "asr", True
        return request

    def run(first, later=(), steps_before_later=0):
        """(steps from the chat's arrival to its first audio, the asr's tokens then and at the chat's
        arrival, outputs)."""
        core = EngineCore(pipe.family, pipe.config)
        for request in first:
            core.add(request)
        for _ in range(steps_before_later):
            list(core.step())
        requests = [*first, *later]
        for request in later:
            core.add(request)
        arrival_step = core.num_steps
        tokens_at_arrival = {r.request_id: len(r.output_ids) for r in requests}
        first_audio, outputs = None, {}
        while core.has_work():
            for event in core.step():
                if event.audio is not None and event.request.request_id == "chat" and first_audio is None:
                    first_audio = (core.num_steps - arrival_step, {r.request_id: len(r.output_ids) for r in requests})
                if event.is_finished:
                    outputs[event.request.request_id] = core.output(event.request)
        return first_audio, tokens_at_arrival, outputs

    (chat_steps, _), _, chat_alone = run([chat()])
    _, _, asr_alone = run([transcription()])
    assert np.abs(chat_alone["chat"].audio).max() > 0
    for first, later, steps_before in (([transcription(), chat()], [], 0), ([transcription()], [chat()], 1)):
        (steps, tokens), at_arrival, together = run(first, later, steps_before)
        assert steps == chat_steps
        assert tokens["asr"] == at_arrival["asr"] and tokens["chat"] > 0  # the transcript waited
        assert (at_arrival["asr"] > 0) == bool(steps_before)  # (it had started before the chat came)
        np.testing.assert_array_equal(together["chat"].audio, chat_alone["chat"].audio)
        assert together["asr"].text_ids == asr_alone["asr"].text_ids
