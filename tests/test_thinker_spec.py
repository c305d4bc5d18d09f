"""Speculative thinker steps (`OmniPipeline(thinker_mtp=..., num_draft_tokens=k)`) on a tiny seeded Qwen3-Omni
checkpoint (saved and loaded, its thinker's MTP head saved next to it): greedy text, codec frames and audio
equal plain decoding's, with text and with an audio input; sampled thinker tokens follow the thinker's exact
law; seeded requests repeat and give the same alone as in a batch (pipeline and server); spec_stats add up.

Two drafters: `RecomputingDraft` (the thinker drafting for itself from the token history, with 30% of its
drafts replaced by random tokens, so rows accept different numbers of drafts and every acceptance path runs)
and the MTP head itself (random weights: its drafts are mostly rejected)."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest
import torch
from audio_checks import assert_audible, assert_audio_equal
from distribution_checks import empirical_law, total_variation, tv_bound
from server_harness import running_server
from spec_drafters import RecomputingDraft, RowDroppingRecomputingDraft
from test_media_input import audio_case, image_case

from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS as T
from omnimtp.mtp.head import MTP_WEIGHTS_NAME, MTPHead
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams, make_generators
from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
from omnimtp.thinker import ThinkerRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 12
MAX_FRAMES = 30
PROMPTS = ["Hello there, how are you?", "Hi"]
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-Omni checkpoint with its thinker's MTP head (seeded, random) saved next to it."""
    path = tmp_path_factory.mktemp("tiny_omni_spec")
    pipe = OmniPipeline.tiny(seed=0)
    pipe.save_pretrained(path)
    torch.manual_seed(7)
    MTPHead.from_config(pipe.model.thinker).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain(checkpoint):
    return OmniPipeline.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference(plain):
    return plain.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)


def _drafter(name: str, plain, checkpoint):
    if name == "target":
        return RecomputingDraft(plain.model.thinker, corrupt_rate=0.3, seed=3)
    return MTPHead.from_pretrained(checkpoint, plain.model.thinker)


def _spec_pipe(plain, drafter, k: int) -> OmniPipeline:
    return OmniPipeline(plain.model, plain.tokenizer, processor=plain.processor, thinker_mtp=drafter,
                        num_draft_tokens=k)


def _assert_same_speech(ours, expected) -> None:
    assert ours.text_ids == expected.text_ids
    assert expected.codes.shape[1] >= 10
    assert torch.equal(ours.codes, expected.codes)
    assert_audio_equal(ours.audio, expected.audio)


# -- the head -------------------------------------------------------------------------------------------


def test_head_for_the_omni_thinker_round_trips_next_to_the_checkpoint(checkpoint, plain):
    thinker = plain.model.thinker
    head = MTPHead.from_pretrained(checkpoint, thinker)
    assert type(head.block) is type(thinker.model.language_model.layers[0])
    assert head.layer_idx == thinker.config.text_config.num_hidden_layers and head.supports_draft_step
    from safetensors import safe_open

    with safe_open(checkpoint / MTP_WEIGHTS_NAME, "pt") as f:
        keys = set(f.keys())
    assert keys and all(key.startswith(f"thinker.model.language_model.layers.{head.layer_idx}.") for key in keys)
    assert not (checkpoint / "model.safetensors.index.json").exists()  # the omni checkpoint is left as it was
    torch.manual_seed(7)
    fresh = MTPHead.from_config(thinker)
    for name, value in fresh.state_dict().items():
        assert torch.equal(head.state_dict()[name], value), name
    # the packed draft step is the module's math up to rounding, also on a thinker prefill's 3-D positions
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = thinker.get_decoder()(input_ids=ids).last_hidden_state
        reference = head(ids, hidden).logits[:, -1]
        positions = torch.arange(1, 7)[None].expand(2, -1)
        _, ours = head.draft_step(ids, hidden, positions, head.make_draft_cache(2, 8))
        _, ours_3d = head.draft_step(ids, hidden, positions.expand(3, -1, -1), head.make_draft_cache(2, 8))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_3d, reference, atol=1e-5, rtol=0)


def test_bad_thinker_mtp_or_k_is_a_value_error_naming_it(checkpoint, plain, tmp_path):
    with pytest.raises(ValueError, match="thinker_mtp"):
        OmniPipeline.from_pretrained(checkpoint, thinker_mtp=tmp_path)  # a directory without a head
    with pytest.raises(ValueError, match="thinker_mtp"):
        _spec_pipe(plain, object(), 2)
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            _spec_pipe(plain, MTPHead.from_pretrained(checkpoint, plain.model.thinker), k)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        _spec_pipe(plain, None, 2)


# -- greedy exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["target", "mtp"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_speculative_equals_plain(plain, checkpoint, reference, drafter, k):
    """Text ids, codec frames and audio of a ragged batch of 2 are plain decoding's."""
    pipe = _spec_pipe(plain, _drafter(drafter, plain, checkpoint), k)
    outputs = pipe.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    for ours, expected in zip(outputs, reference, strict=True):
        _assert_same_speech(ours, expected)
        stats = ours.spec_stats
        plain_steps = stats.draft_histogram.get(0, 0)  # the engine's start steps draft nothing
        assert plain_steps <= pipe.config.max_start_steps - 1 and set(stats.draft_histogram) <= {0, k}
        assert stats.num_draft_tokens == k and stats.num_drafted == k * (stats.num_row_steps - plain_steps)
        assert stats.num_generated_tokens == len(ours.text_ids) - 1  # the prefill's token is not drafted
        assert 1.0 <= stats.mean_acceptance_length <= k + 1
        rates = stats.acceptance_per_position
        assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # position i+1 needs position i
        if drafter == "target":
            assert 0 < stats.num_accepted < stats.num_drafted  # accepted runs and rejections both happened


def test_a_cohort_drafts_only_for_its_unfinished_requests(plain, reference):
    """A drafter that can drop rows (`keep_rows`) drafts for the requests still generating only: once the
    first request ends, the next drafts are for one row; text, frames and audio stay plain decoding's."""
    rows_drafted_for = []

    class Recording(RowDroppingRecomputingDraft):
        def propose(self, block, num_draft_tokens, sampling, generators):
            rows_drafted_for.append(block.input_ids.shape[0])
            return super().propose(block, num_draft_tokens, sampling, generators)

    pipe = _spec_pipe(plain, Recording(plain.model.thinker, corrupt_rate=0.5, seed=4), 3)
    outputs = pipe.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES)
    for ours, expected in zip(outputs, reference, strict=True):
        _assert_same_speech(ours, expected)
    steps = [output.spec_stats.num_steps for output in outputs]
    assert min(steps) < max(steps)  # one request ended first
    assert rows_drafted_for[0] == 2 and rows_drafted_for[-1] == 1
    assert rows_drafted_for == sorted(rows_drafted_for, reverse=True)


def test_head_loaded_from_the_checkpoint_dir_streams_what_plain_generates(checkpoint, reference):
    """`from_pretrained(dir, thinker_mtp=dir)`: the head next to the checkpoint; streamed == plain generate."""
    pipe = OmniPipeline.from_pretrained(checkpoint, thinker_mtp=checkpoint, num_draft_tokens=2)
    events = list(pipe.stream(PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES))
    output = events[-1].output
    assert output.text_ids == reference[0].text_ids and torch.equal(output.codes, reference[0].codes)
    assert_audible(np.concatenate([e.audio for e in events if e.audio is not None]))


def test_handed_over_rows_are_one_token_rows_up_to_rounding(plain):
    """Each accepted token's event carries the verify row that produced it: the embedding rows are the
    one-token loop's bit for bit, the hidden rows (accept_hidden_layer) equal them up to float rounding."""
    thinker = plain.model.thinker
    prompts = [plain.family.chat_ids([{"role": "user", "content": text}]) for text in PROMPTS]

    def rows(speculation):
        run = ThinkerRun(thinker, prompts, accept_hidden_layer=plain.accept_hidden_layer,
                         eos_token_ids=plain.eos_token_ids, max_new_tokens=MAX_NEW_TOKENS, speculation=speculation)
        events = {0: [], 1: []}
        while not run.is_finished:
            for event in run.step():
                if event.token_id is not None:
                    events[event.index].append(event)
        return run, events

    plain_run, expected = rows(None)
    run, ours = rows(ThinkerSpeculation(RecomputingDraft(thinker, corrupt_rate=0.3), 3))
    assert run.output_ids == plain_run.output_ids
    worst = 0.0
    for index in (0, 1):
        assert [e.token_id for e in ours[index]] == [e.token_id for e in expected[index]]
        for a, b in zip(ours[index], expected[index], strict=True):
            assert a.embeds.shape == b.embeds.shape and torch.equal(a.embeds, b.embeds)
            worst = max(worst, (a.hidden - b.hidden).abs().max().item() / b.hidden.abs().max().item())
    assert worst < 1e-5, worst


def test_eos_and_a_request_budget_cut_an_accepted_run(plain):
    """EOS inside an accepted run ends the request there (the rest of the run is dropped), and a request of
    a cohort whose budget is below the run's stops at its own max_new_tokens, as plain decoding does."""
    thinker = plain.model.thinker
    prompts = [plain.family.chat_ids([{"role": "user", "content": text}]) for text in PROMPTS]

    def output_ids(speculation, eos_token_ids):
        run = ThinkerRun(thinker, prompts, accept_hidden_layer=plain.accept_hidden_layer, eos_token_ids=eos_token_ids,
                         max_new_tokens=MAX_NEW_TOKENS, speculation=speculation)
        while not run.is_finished:
            run.step()
        return run.output_ids, run.finish_reasons

    free, _ = output_ids(None, set())
    eos = {free[0][5], free[1][7]}  # tokens the plain replies reach mid-way
    expected = output_ids(None, eos)
    assert expected[1] == ["stop", "stop"] and max(len(ids) for ids in expected[0]) < MAX_NEW_TOKENS
    assert output_ids(ThinkerSpeculation(RecomputingDraft(thinker), 3), eos) == expected  # every draft accepted
    kwargs = dict(max_frames=MAX_FRAMES)
    reference = plain.generate(input_ids=prompts, max_new_tokens=5, **kwargs)
    pipe = _spec_pipe(plain, RecomputingDraft(thinker), 3)
    engine_prompts = [(prompts[0], 5), (prompts[1], 9)]  # one cohort, budgets 5 and 9: the run takes 9
    from omnimtp.engine.core import EngineCore
    from omnimtp.engine.request import Request

    core = EngineCore(pipe.family, pipe.config)
    for i, (ids, budget) in enumerate(engine_prompts):
        core.add(Request(i, ids, max_new_tokens=budget, max_frames=MAX_FRAMES, is_streamed=False))
    outputs = {}
    while core.has_work():
        for event in core.step():
            if event.is_finished:
                outputs[event.request.request_id] = core.output(event.request)
    assert outputs[0].text_ids == reference[0].text_ids and outputs[0].thinker_finish_reason == "length"
    assert outputs[1].text_ids == plain.generate(input_ids=prompts[1], max_new_tokens=9, **kwargs).text_ids


def test_audio_input_greedy_speculative_equals_plain(plain):
    ids, media = audio_case()
    kwargs = dict(input_ids=ids, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, **media)
    expected = plain.generate(**kwargs)
    for k in (1, 3):
        _assert_same_speech(
            _spec_pipe(plain, RecomputingDraft(plain.model.thinker, corrupt_rate=0.3), k).generate(**kwargs), expected
        )


def test_image_input_with_the_mtp_head_equals_plain(plain, checkpoint):
    """An image prompt (3-D M-RoPE ids in the prefill, which the head's first step reads) next to a text one."""
    image_ids, media = image_case()
    prompts = [image_ids, plain.family.chat_ids([{"role": "user", "content": PROMPTS[1]}])]
    kwargs = dict(input_ids=prompts, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, **media)
    expected = plain.generate(**kwargs)
    head = MTPHead.from_pretrained(checkpoint, plain.model.thinker)
    for ours, reference in zip(_spec_pipe(plain, head, 2).generate(**kwargs), expected, strict=True):
        _assert_same_speech(ours, reference)


# -- sampling -------------------------------------------------------------------------------------------

LAW_SAMPLING = SamplingParams(temperature=1.5, top_k=3)
LAW_PROMPT = [T["<|im_start|>"], T["user"], 10, 72, 105, T["<|im_end|>"], 10, T["<|im_start|>"], T["assistant"], 10]
NUM_LAW_ROWS = 3000


def _exact_law(thinker) -> tuple[torch.Tensor, dict[tuple[int, int, int], int]]:
    """The thinker's law of its first three tokens at LAW_SAMPLING, from transformers' forward on every
    prefix in the top-3 support → (law [27], the code of each supported triple of token ids)."""
    def step(prefixes):
        with torch.no_grad():
            logits = thinker(input_ids=torch.tensor([LAW_PROMPT + p for p in prefixes])).logits[:, -1].double()
        top = torch.topk(logits / LAW_SAMPLING.temperature, 3, dim=-1)
        return top.indices, top.values.softmax(dim=-1)  # [M, 3] each

    ids1, p1 = step([[]])
    pairs = [[int(a)] for a in ids1[0]]
    ids2, p2 = step(pairs)
    triples = [pair + [int(b)] for pair, row in zip(pairs, ids2, strict=True) for b in row]
    ids3, p3 = step(triples)
    law = (p1[0][:, None, None] * p2[:, :, None] * p3.view(3, 3, 3)).reshape(-1)
    codes = {}
    for n, (prefix, row) in enumerate(zip(triples, ids3, strict=True)):
        for c, token in enumerate(row):
            codes[tuple(prefix + [int(token)])] = 3 * n + c
    return law, codes


@pytest.mark.parametrize("drafter", ["sharp", "mtp"])
def test_sampled_thinker_tokens_follow_the_exact_law(plain, checkpoint, drafter):
    """3000 seeded rows of one prompt, k = 2: the first three tokens' joint law is the thinker's own
    (temperature → top-k), within the TV bound of 27 cells; the sharp drafter (the thinker at temperature
    0.3, unfiltered: a q far from p but often right) is mostly accepted, the random MTP head mostly not."""
    thinker = plain.model.thinker
    law, codes = _exact_law(thinker)
    if drafter == "sharp":
        proposer = RecomputingDraft(thinker, sampling=SamplingParams(temperature=0.3))
    else:
        proposer = MTPHead.from_pretrained(checkpoint, thinker)
    run = ThinkerRun(
        thinker, [LAW_PROMPT] * NUM_LAW_ROWS, accept_hidden_layer=plain.accept_hidden_layer, eos_token_ids=set(),
        max_new_tokens=3, sampling=[LAW_SAMPLING] * NUM_LAW_ROWS, generators=make_generators(list(range(NUM_LAW_ROWS))),
        decoder=plain.thinker_decoder, speculation=ThinkerSpeculation(proposer, 2),
    )
    while not run.is_finished:
        run.step()
    drawn = torch.tensor([codes[tuple(ids)] for ids in run.output_ids])
    observed = total_variation(empirical_law(drawn, law.numel()), law)
    assert observed <= tv_bound(NUM_LAW_ROWS, law.numel()), observed
    accepted = sum(s.num_accepted for s in run.spec_stats) / sum(s.num_drafted for s in run.spec_stats)
    assert (accepted > 0.3) if drafter == "sharp" else (accepted < 0.3), accepted


def test_seeded_sampled_requests_repeat_and_equal_themselves_alone(plain, checkpoint):
    pipe = _spec_pipe(plain, RecomputingDraft(plain.model.thinker, sampling=SamplingParams(temperature=0.5)), 3)
    prompts = ["Tell me a story", "Hi", "What is this?"]
    kwargs = dict(thinker_sampling=SAMPLED, max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES, seed=[5, 6, 7])
    batch = pipe.generate(prompts, **kwargs)
    again = pipe.generate(prompts, **kwargs)
    for i, prompt in enumerate(prompts):
        alone = pipe.generate(prompt, **{**kwargs, "seed": kwargs["seed"][i]})
        for other in (again[i], alone):
            assert other.text_ids == batch[i].text_ids and torch.equal(other.codes, batch[i].codes)
            assert_audio_equal(other.audio, batch[i].audio)
    assert sum(o.spec_stats.num_accepted for o in batch) > 0


def test_a_runs_plain_start_steps_draft_nothing_then_it_drafts(plain):
    """plain_start_steps=2: after the prefill two steps give one token a row; with exact drafts the next gives
    k + 1. The text is plain greedy's either way (and the engine's start steps are such plain steps)."""
    family = _spec_pipe(plain, RecomputingDraft(plain.model.thinker), 3).family
    prompts = [plain.family.chat_inputs([{"role": "user", "content": p}], plain.media_limits)[0] for p in PROMPTS]
    run = family.new_thinker(prompts, [None] * 2, [None] * 2, MAX_NEW_TOKENS, plain_start_steps=2)
    counts = []
    while not run.is_finished:
        run.step()
        counts.append([len(ids) for ids in run.output_ids])
    assert counts[:3] == [[1, 1], [2, 2], [3, 3]] and counts[3] == [7, 7]
    expected = plain.family.new_thinker(prompts, [None] * 2, [None] * 2, MAX_NEW_TOKENS)
    while not expected.is_finished:
        expected.step()
    assert run.output_ids == expected.output_ids
    always_plain = family.new_thinker(prompts, [None] * 2, [None] * 2, MAX_NEW_TOKENS, plain_start_steps=10**6)
    while not always_plain.is_finished:
        always_plain.step()
    assert always_plain.output_ids == expected.output_ids
    # a step of a finished run, speculative (drafting or in its plain steps) or not: no token, nothing changes
    for finished in (run, always_plain, expected):
        assert [event.token_id for event in finished.step()] == [None, None]
        assert finished.output_ids == expected.output_ids
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="plain_start_steps"):
            family.new_thinker(prompts, [None] * 2, [None] * 2, MAX_NEW_TOKENS, plain_start_steps=bad)


def test_a_runs_drafter_is_made_by_its_first_drafting_step_not_on_the_way_to_first_audio(plain):
    """A speculative run's start (its prefill and plain start steps: what a new request's first audio waits for)
    makes no proposer; its first drafting step makes one. A row that finished before then leaves the drafter's
    view without it, and the text stays plain greedy's."""
    made = []

    class Counting(RowDroppingRecomputingDraft):
        def reset(self):
            made.append(self)
            super().reset()

    family = _spec_pipe(plain, Counting(plain.model.thinker, corrupt_rate=0.3, seed=5), 3).family
    prompts = [plain.family.chat_inputs([{"role": "user", "content": p}], plain.media_limits)[0] for p in PROMPTS]
    expected = plain.family.new_thinker(prompts, [None] * 2, [None] * 2, MAX_NEW_TOKENS)
    while not expected.is_finished:
        expected.step()
    made.clear()
    run = family.new_thinker(prompts, [None] * 2, [None] * 2, MAX_NEW_TOKENS, plain_start_steps=2)
    for _ in range(3):
        run.step()
        assert run.proposer is None and not made
    run.step()
    assert len(made) == 1 and run.proposer is made[0] and max(len(ids) for ids in run.output_ids) > 4
    while not run.is_finished:
        run.step()
    assert run.output_ids == expected.output_ids and len(made) == 1
    # row 1 ends (its second token as EOS) in a plain start step, before the drafter exists
    eos = expected.output_ids[1][1]
    assert eos not in expected.output_ids[0][:2] and eos not in expected.output_ids[1][:1]
    cut = ThinkerRun(plain.model.thinker, prompts, accept_hidden_layer=plain.accept_hidden_layer,
                     eos_token_ids={eos}, max_new_tokens=MAX_NEW_TOKENS, decoder=plain.thinker_decoder,
                     speculation=ThinkerSpeculation(Counting(plain.model.thinker, corrupt_rate=0.3, seed=5), 3),
                     plain_start_steps=2)
    reference = ThinkerRun(plain.model.thinker, prompts, accept_hidden_layer=plain.accept_hidden_layer,
                           eos_token_ids={eos}, max_new_tokens=MAX_NEW_TOKENS, decoder=plain.thinker_decoder)
    for each in (cut, reference):
        while not each.is_finished:
            each.step()
    assert cut.output_ids == reference.output_ids and cut.output_ids[1] == expected.output_ids[1][:2]
    assert cut.spec_stats[0].num_drafted > 0


def test_speculative_logprobs_are_plain_greedys(plain):
    """Logprobs through speculative steps: each accepted token's comes from the verify row that produced it, so
    they are plain greedy's (within float32 rounding), with the same alternatives."""
    family = _spec_pipe(plain, RecomputingDraft(plain.model.thinker), 3).family
    prompts = [plain.family.chat_inputs([{"role": "user", "content": p}], plain.media_limits)[0] for p in PROMPTS]
    runs = [f.new_thinker(prompts, [None] * 2, [None] * 2, MAX_NEW_TOKENS, logprobs=[1, None])
            for f in (family, plain.family)]
    events = []
    for run in runs:
        events.append([])
        while not run.is_finished:
            events[-1] += [e for e in run.step() if e.token_id is not None]
    spec, greedy = ([e for e in run_events if e.index == 0] for run_events in events)
    assert [e.token_id for e in spec] == [e.token_id for e in greedy] and len(spec) > 3
    assert [e.logprob.top[0][0] for e in spec] == [e.logprob.top[0][0] for e in greedy]
    assert [e.logprob.logprob for e in spec] == pytest.approx([e.logprob.logprob for e in greedy], abs=1e-5)
    assert all(e.logprob is None for run_events in events for e in run_events if e.index == 1)


def _engine_request(pipe, request_id: str, text: str):
    """A chat request with audio for an `EngineCore` of the pipeline's family."""
    from omnimtp.engine.request import Request

    ids, _ = pipe.family.chat_inputs([{"role": "user", "content": text}], pipe.media_limits)
    return Request(request_id, ids, max_new_tokens=24, max_frames=MAX_FRAMES, speaker=pipe.family.default_speaker)


def _alone(pipe, text: str):
    """The output of `text` as the only request of an engine core."""
    from omnimtp.engine.core import EngineCore

    core = EngineCore(pipe.family, pipe.config)
    core.add(_engine_request(pipe, "x", text))
    while core.has_work():
        for event in core.step():
            if event.is_finished:
                return core.output(event.request)


@pytest.mark.parametrize("corrupt_rate, is_ahead", [(0.0, True), (1.0, False)])
def test_a_cohort_ahead_of_its_audio_skips_thinker_steps_while_a_newcomer_waits_for_first_audio(
    plain, corrupt_rate, is_ahead
):
    """With exact drafts a speculative cohort's thinker runs ahead of its talker. While a newcomer waits for its
    first audio the cohort takes no thinker step, and its frames keep coming from the reply rows its talker holds;
    afterwards it goes on. With drafts always rejected it keeps pace with its talker and so keeps thinking, asked
    for a plain step while the newcomer waits (which `auto` takes and a fixed k does not). The
    newcomer's first audio comes in its admission step, and every output is the one it gives alone."""
    from omnimtp.engine.core import EngineCore

    pipe = _spec_pipe(plain, RecomputingDraft(plain.model.thinker, corrupt_rate=corrupt_rate), 3)

    core = EngineCore(pipe.family, pipe.config)
    long = _engine_request(pipe, "long", "Tell me a story")
    core.add(long)
    outputs = {}

    def step() -> list:
        events = list(core.step())
        outputs.update({e.request.request_id: core.output(e.request) for e in events if e.is_finished})
        return events

    while not (long.audio and core._is_ahead(core.cohorts[0]) == is_ahead):
        step()
        assert core.cohorts and long.is_thinking, "the reply ended first"
    cohort = core.cohorts[0]
    thinker_steps = 0
    run_step = cohort.run.step
    asked_plain = []  # per thinker step of the cohort: whether the engine asked for a plain one

    def counted_step(**kwargs):
        nonlocal thinker_steps
        thinker_steps += 1
        asked_plain.append(kwargs.get("plain", False))
        return run_step(**kwargs)

    cohort.run.step = counted_step
    newcomer = _engine_request(pipe, "new", "Hi")
    core.add(newcomer)
    frames_before = len(long.frames)
    admission_events = step()
    assert any(e.audio is not None and e.request is newcomer for e in admission_events)
    assert thinker_steps == (0 if is_ahead else 1) and len(long.frames) == frames_before + 1
    assert asked_plain == ([] if is_ahead else [True])  # `auto` would take a plain step; this fixed k drafts
    while core.has_work():
        step()
    assert thinker_steps > 0, "the cohort went on thinking once the newcomer's audio had started"
    assert not asked_plain[-1], "no plain step asked for once the newcomer's audio had started"
    for request_id, text in (("long", "Tell me a story"), ("new", "Hi")):
        expected = _alone(pipe, text)
        assert outputs[request_id].text_ids == expected.text_ids
        assert torch.equal(outputs[request_id].codes, expected.codes)
        assert_audio_equal(outputs[request_id].audio, expected.audio)


def test_a_newcomer_that_comes_during_a_step_makes_the_later_cohorts_of_that_step_plain(plain):
    """A request that arrives while the engine runs one cohort's thinker step (a closed-loop client sends its
    next request as its last one's audio ends, so arrivals fall early in a step) waits for every cohort's
    thinker step before it is admitted. The cohorts after the one running when it came are asked for a plain
    step (the shortest, under `auto`), as if it had been there when the step began; it is admitted and
    speaks in that step, and every output is the one it gives alone."""
    from omnimtp.engine.core import EngineCore

    pipe = _spec_pipe(plain, RecomputingDraft(plain.model.thinker, corrupt_rate=1.0), 3)

    texts = {"first": "Tell me a story", "second": "Sing a song", "new": "Hi"}
    core = EngineCore(pipe.family, pipe.config)
    outputs = {}

    def step() -> list:
        events = list(core.step())
        outputs.update({e.request.request_id: core.output(e.request) for e in events if e.is_finished})
        return events

    first, second, newcomer = (_engine_request(pipe, name, text) for name, text in texts.items())
    core.add(first)
    while not first.audio:
        step()
    core.add(second)
    while not second.audio:
        step()
    assert len(core.cohorts) == 2 and all(r.is_thinking for r in (first, second)), "a reply ended first"
    asked_plain: dict[str, list[bool]] = {"first": [], "second": []}
    for name, cohort in zip(asked_plain, core.cohorts, strict=True):
        def asked(run_step=cohort.run.step, calls=asked_plain[name], arrives=name == "first", **kwargs):
            calls.append(kwargs.get("plain", False))
            if arrives and len(calls) == 1:
                core.add(newcomer)  # while this cohort's first wrapped thinker step runs
            return run_step(**kwargs)

        cohort.run.step = asked
    admission_events = step()
    assert asked_plain == {"first": [False], "second": [True]}  # `auto` would take a plain step; this fixed k drafts
    assert any(e.audio is not None and e.request is newcomer for e in admission_events)
    while core.has_work():
        step()
    for name, text in texts.items():
        expected = _alone(pipe, text)
        assert outputs[name].text_ids == expected.text_ids
        assert torch.equal(outputs[name].codes, expected.codes)
        assert_audio_equal(outputs[name].audio, expected.audio)


# -- server ---------------------------------------------------------------------------------------------


def test_server_with_spec_on_gives_byte_identical_replies_under_load_and_reports_acceptance(plain, checkpoint):
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.server.app import create_app
    from omnimtp.server.scheduler import Engine

    family = Qwen3OmniFamily(plain.model, plain.tokenizer, thinker_speculation=ThinkerSpeculation(
        RecomputingDraft(plain.model.thinker, sampling=SamplingParams(temperature=0.5)), 2))
    engine = Engine(family, max_frames=8, first_chunk_frames=2, chunk_frames=3, max_batch_size=8)
    bodies = [{
        "messages": [{"role": "user", "content": f"Question {i}"}], "modalities": ["text", "audio"],
        "audio": {"voice": "Ethan", "format": "pcm16"}, "seed": 100 + i, "max_tokens": 6,
        "temperature": 0.0 if i == 2 else 0.9,
    } for i in range(4)]
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        def send(body):
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            return message["content"], message["audio"]["data"]

        alone = [send(body) for body in bodies]
        together: list = [None] * len(bodies)
        barrier = threading.Barrier(len(bodies))

        def worker(i):
            barrier.wait()
            together[i] = send(bodies[i])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert together == alone
        metrics = http.get("/metrics").text
    counts = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines() if line and not line.startswith("#")}
    assert counts["omnimtp_thinker_mean_acceptance_length_count"] == 2 * len(bodies)
    drafted, accepted = counts["omnimtp_thinker_draft_tokens_total"], counts["omnimtp_thinker_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    assert counts['omnimtp_thinker_acceptance_rate_bucket{le="+Inf"}'] == 2 * len(bodies)


# -- CLIs -----------------------------------------------------------------------------------------------


def test_train_mtp_on_an_omni_checkpoint_then_speak_with_its_head(checkpoint, reference, tmp_path, capsys):
    """`omnimtp train-mtp --model <omni dir>` trains a head for the thinker (frozen teacher) and saves it;
    `omnimtp speak --model <omni dir> --thinker-mtp <head dir> -k 2` speaks with it, greedy text as plain's."""
    from omnimtp.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"f{i}.txt").write_text("".join(f"def f{j}(x): return x + {j}\n" for j in range(i, i + 30)))
    out = tmp_path / "head"
    assert main(["train-mtp", "--model", str(checkpoint), "--data", str(data), "--out", str(out), "-k", "2",
                 "--steps", "4", "--batch-size", "2", "--seq-len", "16", "--eval-every", "4", "--num-eval-windows", "2",
                 "--heldout-every", "3", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    pipe = OmniPipeline.from_pretrained(checkpoint, thinker_mtp=out, num_draft_tokens=2)
    assert (pipe.generate(PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS, max_frames=MAX_FRAMES).text_ids
            == reference[0].text_ids)
    wav = tmp_path / "a.wav"
    assert main(["speak", PROMPTS[0], "-o", str(wav), "--model", str(checkpoint), "--thinker-mtp", str(out), "-k", "2",
                 "--max-new-tokens", "6", "--max-frames", "8"]) == 0
    assert "thinker speculation: k=2" in capsys.readouterr().err and wav.stat().st_size > 0
    assert main(["speak", "Hi", "-o", str(wav), "-k", "2"]) == 2  # -k without a drafter
    assert "--num-draft-tokens" in capsys.readouterr().err



class _OutOfVocabDrafts:
    """A foreign Proposer whose drafts are past the thinker's vocabulary."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def reset(self):
        pass

    def propose(self, block, num_draft_tokens, sampling, generators):
        batch_size = block.input_ids.shape[0]
        return (torch.full((batch_size, num_draft_tokens), self.vocab + 5),
                torch.full((batch_size, num_draft_tokens, self.vocab), 1.0 / self.vocab))


def test_a_foreign_proposers_bad_drafts_are_a_value_error(plain):
    thinker = plain.model.thinker
    run = ThinkerRun(
        thinker, [LAW_PROMPT], accept_hidden_layer=plain.accept_hidden_layer, eos_token_ids=set(), max_new_tokens=4,
        decoder=plain.thinker_decoder,
        speculation=ThinkerSpeculation(_OutOfVocabDrafts(thinker.get_output_embeddings().weight.shape[0]), 2),
    )
    run.step()  # the prefill
    with pytest.raises(ValueError, match="proposer: draft_tokens"):
        run.step()
