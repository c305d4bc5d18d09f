"""TalkerBatch as a scheduler drives it: admit mid-run, retire, bubbles; HF's repetition penalty."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from omnimtp.handoff import talker_inputs_from_rows
from omnimtp.models.tiny import tiny_qwen3_omni
from omnimtp.sampling import SamplingParams, apply_repetition_penalty, make_generators
from omnimtp.talker.loop import RepeatDetector, RunawayLimits, TalkerBatch, TalkerRequest
from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder
from omnimtp.thinker import ThinkerRun
from omnimtp.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(3, 50)
    history = torch.tensor([[1, 2, 2], [5, 7, 49], [0, 0, 0]])
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter(1, history, True)
    expected = RepetitionPenaltyLogitsProcessor(1.05)(history, logits.clone())
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.05), expected)


def _requests(model, texts, sampling=None, seeds=None, max_frames=12):
    tok = byte_tokenizer()
    requests = []
    for i, text in enumerate(texts):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=False)
        run = ThinkerRun(model.thinker, [prompt], accept_hidden_layer=1, eos_token_ids={257}, max_new_tokens=6)
        embeds, hidden = [], []
        while not run.is_finished:
            for event in run.step():
                embeds.append(event.embeds)
                hidden.append(event.hidden)
        inputs = talker_inputs_from_rows(
            Qwen3TalkerInputBuilder(model, prompt, "ethan"), torch.cat(embeds), torch.cat(hidden)
        )
        generator = make_generators([seeds[i]])[0] if seeds else None
        requests.append(TalkerRequest(
            f"r{i}", inputs.prefill_embeds, inputs.trailing_text, inputs.tts_pad_embed,
            sampling=sampling, generator=generator, max_frames=max_frames,
        ))
    return requests


def _drain(batch, frames, admit_later=(), admit_at=3):
    step = 0
    while batch.rows or admit_later:
        if step == admit_at and admit_later:
            batch.admit(list(admit_later))
            admit_later = ()
        for frame in batch.step():
            frames.setdefault(frame.request_id, []).append(frame.codes)
            if frame.finish_reason:
                batch.retire([frame.request_id])
        step += 1
    return {rid: torch.stack(codes, 1) for rid, codes in frames.items()}


def test_admit_mid_run_and_retire_do_not_change_any_request():
    model = tiny_qwen3_omni(0)
    sampling = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05)
    for kwargs in [dict(), dict(sampling=sampling, seeds=[11, 12, 13])]:
        texts = ["Hello there", "Hi", "A longer prompt than the others"]
        alone = {}
        for request in _requests(model, texts, **kwargs):
            alone.update(_drain(TalkerBatch(model.talker, 4), {}, admit_later=[request], admit_at=0))
        first, second, third = _requests(model, texts, max_frames=12, **kwargs)
        second.max_frames = 5  # retired early, while the others keep going
        batch = TalkerBatch(model.talker, 4)
        batch.admit([first, second])
        together = _drain(batch, {}, admit_later=[third], admit_at=3)
        assert torch.equal(together["r0"], alone["r0"])
        assert torch.equal(together["r1"], alone["r1"][:, :5])
        assert torch.equal(together["r2"], alone["r2"])


def test_a_request_waiting_for_text_sits_out_without_changing_its_frames():
    model = tiny_qwen3_omni(0)
    (request,) = _requests(model, ["Hello there"])
    full = _drain(TalkerBatch(model.talker, 2), {}, admit_later=[request], admit_at=0)["r0"]
    rows = request.trailing_text
    streamed = TalkerRequest("r0", request.prefill_embeds, rows[:1], request.tts_pad_embed, is_text_finished=False,
                             max_frames=request.max_frames)
    batch = TalkerBatch(model.talker, 2)
    batch.admit([streamed])
    frames = [batch.step()[0].codes]
    assert batch.step() == [] and batch.step() == []  # no text row ready: nothing happens
    batch.push_text("r0", rows[1:], is_finished=True)
    while batch.rows:
        for frame in batch.step():
            frames.append(frame.codes)
            if frame.finish_reason:
                batch.retire([frame.request_id])
    assert torch.equal(torch.stack(frames, 1), full)


def test_next_inputs_equal_next_talker_input_bit_for_bit():
    from omnimtp.talker.code_predictor import next_talker_input

    model = tiny_qwen3_omni(0)
    batch = TalkerBatch(model.talker, max_batch_size=3)
    cp = model.talker.code_predictor
    generator = torch.Generator().manual_seed(1)
    hidden_size, num_groups = cp.config.hidden_size, cp.config.num_code_groups
    cb0_embed = torch.randn(3, hidden_size, generator=generator)
    codes = torch.randint(0, cp.config.vocab_size, (3, num_groups - 1), generator=generator)
    text = torch.randn(3, hidden_size, generator=generator)
    ours = batch.frames.next_inputs(cb0_embed, codes, text)
    assert torch.equal(ours, next_talker_input(cp, cb0_embed, codes, text))
    # a wrong code changes it (the tables are really indexed)
    codes[1, 4] = (codes[1, 4] + 1) % cp.config.vocab_size
    assert not torch.equal(batch.frames.next_inputs(cb0_embed, codes, text)[1], ours[1])


def test_repeat_detector_on_scripted_codes():
    """A pattern of at most max_period codes over the last num_frames codes, and nothing shorter or longer."""
    detector = RepeatDetector(num_frames=6, max_period=2)
    assert [detector.push(c) for c in [5, 7, 3, 7, 3, 7, 3]] == [False] * 6 + [True]
    held = RepeatDetector(num_frames=4, max_period=2)
    assert [held.push(c) for c in [1, 9, 9, 9, 9]] == [False] * 4 + [True]
    wide = RepeatDetector(num_frames=6, max_period=2)  # period 3: longer than max_period
    assert not any(wide.push(c) for c in [1, 2, 3] * 4)
    broken = RepeatDetector(num_frames=6, max_period=2)
    assert not any(broken.push(c) for c in [7, 3, 7, 3, 7, 4, 7, 3, 7, 3])


def test_runaway_limits_are_checked():
    with pytest.raises(ValueError, match="min_frames"):
        RunawayLimits(frames_per_text_row=2, min_frames=0, repeat_frames=8, max_repeat_period=2)
    with pytest.raises(ValueError, match="max_repeat_period"):
        RunawayLimits(frames_per_text_row=2, min_frames=4, repeat_frames=8, max_repeat_period=8)
    assert RunawayLimits(12, 125, 125, 12).max_text_frames(3) == 125
    assert RunawayLimits(12, 125, 125, 12).max_text_frames(100) == 1200


def _never_ending(batch, only_code=None):
    """The batch's talker never samples codec EOS (and, given only_code, samples nothing else)."""
    frames = batch.frames
    frames.eos_ids = frozenset()
    if only_code is not None:
        frames.is_suppressed = torch.ones_like(frames.is_suppressed)
        frames.is_suppressed[only_code] = False
    return batch


def _cut(batch, request):
    batch.admit([request])
    num_frames = 0
    while True:
        for frame in batch.step():
            num_frames += 1
            if frame.finish_reason is not None:
                return num_frames, frame.finish_reason, frame.cut_by


def test_a_talker_that_never_ends_is_cut_at_its_texts_bound_or_on_repetition():
    """Forced never to emit EOS: cut ("length") at max(min_frames, frames_per_text_row × text rows), or when
    code 0 holds one pattern for repeat_frames frames, before max_frames; without limits, at max_frames."""
    model = tiny_qwen3_omni(0)
    (request,) = _requests(model, ["Hello there"], max_frames=200)
    num_rows = request.trailing_text.shape[0]
    assert 2 <= num_rows < 20
    text_bound = RunawayLimits(frames_per_text_row=3, min_frames=4, repeat_frames=150, max_repeat_period=4)
    floor = RunawayLimits(frames_per_text_row=1, min_frames=60, repeat_frames=150, max_repeat_period=4)
    repeats = RunawayLimits(frames_per_text_row=50, min_frames=150, repeat_frames=9, max_repeat_period=2)
    for limits, only_code, expected in [(text_bound, None, (3 * num_rows, "text_length")),
                                        (floor, None, (60, "text_length")),
                                        (repeats, 5, (8, "repetition")),
                                        (None, None, (200, "max_frames"))]:
        request.runaway = limits
        batch = _never_ending(TalkerBatch(model.talker, 2), only_code)
        num_frames, finish_reason, cut_by = _cut(batch, request)
        assert (num_frames, cut_by) == expected and finish_reason == "length"


def test_a_text_still_arriving_is_not_cut_by_its_bound_early():
    """Rows pushed later raise the bound: a request given one row at a time runs past min_frames."""
    model = tiny_qwen3_omni(0)
    (request,) = _requests(model, ["Hello there"], max_frames=200)
    rows = request.trailing_text
    request.trailing_text, request.is_text_finished = rows[:1], False
    request.runaway = RunawayLimits(frames_per_text_row=2, min_frames=2, repeat_frames=150, max_repeat_period=4)
    batch = _never_ending(TalkerBatch(model.talker, 2))
    batch.admit([request])
    frames = []
    for i in range(1, rows.shape[0]):
        frames += batch.step()
        if frames[-1].finish_reason is not None:
            break
        batch.push_text("r0", rows[i : i + 1], is_finished=i == rows.shape[0] - 1)
    for _ in range(100):
        if frames[-1].finish_reason is not None:
            break
        frames += batch.step()
    assert len(frames) == 2 * rows.shape[0] and frames[-1].cut_by == "text_length"


def test_cuts_runaway_is_a_bool():
    from omnimtp.engine.core import EngineConfig

    assert EngineConfig().cuts_runaway is True
    with pytest.raises(ValueError, match="cuts_runaway"):
        EngineConfig(cuts_runaway=1)
