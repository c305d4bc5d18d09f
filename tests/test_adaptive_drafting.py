"""Adaptive drafting (`num_draft_tokens="auto"`): the controller's rule on hand-made histories; greedy output
== transformers' `generate` == `plain_generate` whatever k does (tiny ragged batches with EOS, the demo LM,
the demo omni thinker); the sampled joint law of three tokens is the target's with k moving between steps;
seeded runs repeat; bad settings are ValueErrors. Per batch size: k follows injected costs per batch-size
bucket, greedy output at batch 1/4/16 is plain's, a thinker cohort that shrinks switches k and keeps its
rows' tokens, and a server measures its buckets at start-up and reports them in /metrics. Calibrated costs
kept on disk: read back by the next process (and a second server start, reported as cached), measured
again when any part of their fingerprint changes or the entry is corrupt, measured every time where the
cache directory cannot be written."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from distribution_checks import assert_law
from spec_drafters import ragged_batch

from omnimtp import MTPHead, SamplingParams, plain_generate, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.spec_decode import adaptive
from omnimtp.spec_decode.adaptive import (
    DraftController,
    DraftCosts,
    DraftCostTable,
    acceptance_warning,
    batch_buckets,
    expected_tokens,
)
from omnimtp.spec_decode.cost_cache import cost_fingerprint
from omnimtp.spec_decode.generate import SpecStats, calibrate_draft_cost_table, calibrate_draft_costs
from omnimtp.spec_decode.proposer import TargetProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHEAP = DraftCosts((1.0, 1.1, 1.2, 1.3, 1.4))  # drafting pays at any acceptance above ~0.1
MIXED = DraftCosts((1.0, 1.5, 1.8, 2.1))  # pays only while acceptance is high: k moves with the history
DEAR = DraftCosts((1.0, 3.0, 5.0))  # plain steps only: no k pays at the prior 0.7, so no probes either
# what CPU measurements look like: a verify is nearly free for one row and compute-bound at 16 rows
PER_BATCH = DraftCostTable((
    (1, DraftCosts((1.0, 1.1, 1.2, 1.3))),  # at α 0.7: k = 3
    (4, DraftCosts((1.0, 1.5, 1.8, 2.1))),  # k = 2
    (16, DraftCosts((1.0, 3.0, 5.0, 7.0))),  # k = 0
))


# --- the controller --------------------------------------------------------------------------------------


def test_the_goodput_rule_on_the_worked_example():
    costs = DraftCosts((1.0, 1.6, 2.0, 2.4))
    assert [round(expected_tokens(0.9, k), 3) for k in range(4)] == [1, 1.9, 2.71, 3.439]
    high, low = DraftController(costs, 1, prior=0.9), DraftController(costs, 1, prior=0.3)
    assert high.choose([True]) == 3 and low.choose([True]) == 0


def test_the_prior_is_the_acceptance_the_costs_were_measured_with():
    """The omni demo thinker's 16-row costs: plain at the default prior 0.7, four drafts at the acceptance its
    drafter showed while they were measured."""
    at16 = (1.0, 1.92, 2.45, 2.97, 3.33)
    assert DraftController(DraftCosts(at16), 16).choose([True] * 16) == 0
    measured = DraftCostTable(((1, DraftCosts(CHEAP.step, acceptance=0.96)), (16, DraftCosts(at16, acceptance=0.98))))
    assert measured.acceptance == pytest.approx(0.97) and DraftCostTable.of(DraftCosts(at16)).acceptance == 0.7
    assert DraftController(measured, 16).choose([True] * 16) == 4
    assert DraftController(measured, 16, prior=0.7).choose([True] * 16) == 0
    for bad in (1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="acceptance"):
            DraftCosts((1.0, 2.0), acceptance=bad)


def test_a_goodput_tie_picks_the_fewer_drafts():
    """Every draft accepted: E_k = k + 1, and 2 / 1.5 == 3 / 2.25 exactly (both 4/3 rounded once)."""
    controller = DraftController(DraftCosts((1.0, 1.5, 2.25)), 1, prior=1.0)
    assert 2 / 1.5 == 3 / 2.25 > 1.0
    assert controller.choose([True]) == 1


def test_only_verified_drafts_move_the_estimate_and_probes_are_spaced_by_their_expected_loss():
    controller = DraftController(MIXED, 2, prior=0.7, smoothing=0.5, probe_interval=2)
    controller.update(3, [1, 3], [True, True])  # row 0: accepted, rejected (draft 3 unverified); row 1: 3 accepted
    assert controller.acceptance == pytest.approx([(0.7 + 1) / 2 / 2, 0.7 + 0.3 * 0.875])
    controller.update(2, [0, 0], [True, False])  # a finished row learns nothing
    assert controller.acceptance[1] == pytest.approx(0.7 + 0.3 * 0.875)
    # where drafting pays at the prior (MIXED at 0.7), a row whose estimate fell to 0.3 probes; a probe loses
    # c_1 - E_1 = 1.5 - 1.3 = 0.2 plain steps, so probes come 0.2 / probe_budget plain steps apart
    mixed = DraftController(MIXED, 1, probe_interval=2, probe_budget=0.05)
    mixed.acceptance = [0.3]
    assert [mixed.choose([True]) for _ in range(10)] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    often = DraftController(MIXED, 1, probe_interval=2, probe_budget=0.5)
    often.acceptance = [0.3]
    assert [often.choose([True]) for _ in range(6)] == [0, 0, 1, 0, 0, 1]  # 0.4 steps < probe_interval
    default = DraftController(MIXED, 1)
    default.acceptance = [0.3]
    assert [default.choose([True]) for _ in range(21)].index(1) == 20  # 0.2 / 1 %
    # where no k pays at the prior (DEAR at 0.7), no probes at all
    dear = DraftController(DEAR, 1, probe_interval=2, probe_budget=0.5)
    assert {dear.choose([True]) for _ in range(200)} == {0}
    near = DraftController(DraftCosts((1.0, 1.8, 2.6)), 1)  # at 0.7 one draft is 1.7 / 1.8 of paying: no probes
    assert {near.choose([True]) for _ in range(200)} == {0}
    mixed.acceptance = [0.95]
    assert mixed.choose([True]) == 3  # drafting pays again: the count starts over
    mixed.acceptance = [0.3]
    assert [mixed.choose([True]) for _ in range(5)] == [0, 0, 0, 0, 1]

    assert DraftController(MIXED, 1).choose([False]) == 0


def test_a_probe_drafts_the_k_of_best_goodput_on_a_worked_example():
    """c = (1, 1.4, 1.455, 1.6) at α 0.3: E = 1, 1.3, 1.39, 1.417 and E/c = 1, 0.929, 0.955, 0.886, so plain
    steps; drafting pays at the prior 0.7 (E_2 = 2.19 > 1.455), so probes run, each drafting k = 2 (the best
    goodput among k >= 1, neither the fewest drafts nor the most) and losing c_2 - E_2 = 0.065 plain steps:
    0.065 / 1 % → a probe after every 7 plain steps."""
    controller = DraftController(DraftCosts((1.0, 1.4, 1.455, 1.6)), 1)
    assert controller.prior == 0.7
    controller.acceptance = [0.3]
    assert [controller.choose([True]) for _ in range(16)] == ([0] * 7 + [2]) * 2


def test_k_follows_the_costs_of_the_rows_a_step_runs():
    assert batch_buckets(1) == (1,) and batch_buckets(12) == (1, 2, 4, 8, 16) and batch_buckets(16)[-1] == 16
    controller = DraftController(PER_BATCH, 16, prior=0.7)
    assert controller.choose([True] * 16) == 0
    assert controller.choose([True] * 3 + [False] * 13) == 2  # 3 rows: the bucket of 4
    assert controller.choose([True] + [False] * 15) == 3
    assert controller.choose([True] + [False] * 15, 16) == 0  # finished rows that ride along still cost
    assert controller.choose([True] * 16, 40) == 0  # past the largest bucket: the largest
    assert PER_BATCH.for_batch(2) is PER_BATCH.by_batch[1][1] and PER_BATCH.to_dict()[16] == (1.0, 3.0, 5.0, 7.0)
    assert DraftCostTable.of(CHEAP).for_batch(64) is CHEAP
    assert DraftCostTable.of({4: MIXED, 1: MIXED}).by_batch[0][0] == 1
    for bad in [(), ((0, MIXED),), ((2, MIXED), (1, MIXED)), ((1, MIXED), (2, CHEAP)), ((1, (1.0, 2.0)),)]:
        with pytest.raises(ValueError, match="draft_costs"):
            DraftCostTable(bad)
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_buckets(0)


def test_costs_are_checked_and_measured_costs_never_fall_with_k():
    for bad in [(1.0,), (2.0, 3.0), (1.0, -1.0), (1.0, float("inf")), (1.0, True)]:
        with pytest.raises(ValueError, match="draft_costs"):
            DraftCosts(bad)
    assert DraftCosts.from_seconds([0.01, 0.015, 0.012, 0.02]).step == pytest.approx((1.0, 1.5, 1.5, 2.0))


def test_the_warning_names_tau_and_what_to_do():
    weak = SpecStats(num_draft_tokens=3, num_row_steps=10, num_accepted=2, num_steps=10)
    assert "τ 1.20" in acceptance_warning(weak) and "-k auto" in acceptance_warning(weak)
    assert acceptance_warning(SpecStats(num_draft_tokens=3, num_row_steps=10, num_accepted=20, num_steps=10)) is None
    fell_back = SpecStats(
        num_draft_tokens=4, num_row_steps=10, num_steps=10, draft_costs=DEAR.step, draft_histogram={0: 8, 1: 2}
    )
    assert "80% of steps" in acceptance_warning(fell_back)


# --- greedy: the plain loop's tokens, whatever k does ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    target = tiny_lm("glm4_moe", seed=0)
    torch.manual_seed(1)
    return target, MTPHead.from_config(target)


@pytest.mark.parametrize("costs", [CHEAP, MIXED, DEAR], ids=["cheap", "mixed", "dear"])
@pytest.mark.parametrize("drafter", ["mtp_head", "target"])
def test_greedy_auto_equals_generate_ragged_batch_with_eos(tiny, costs, drafter):
    target, head = tiny
    ids, mask = ragged_batch(lengths=(7, 5, 3, 6), pad_id=0, seed=4)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=-1)
    eos = int(free[0, ids.shape[1] + 5])
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos)
    proposer = head if drafter == "mtp_head" else TargetProposer(target)
    out = speculative_generate(target, proposer, ids, mask, max_new_tokens=14, num_draft_tokens="auto",
                               draft_costs=costs, eos_token_id=eos)
    assert torch.equal(out.sequences, reference)
    assert torch.equal(plain_generate(target, ids, mask, max_new_tokens=14, eos_token_id=eos), reference)
    stats = out.stats
    assert stats.draft_costs == costs.step and sum(stats.draft_histogram.values()) == stats.num_steps
    if costs is DEAR:  # plain steps only: no k pays at the prior, so no probes either
        assert set(stats.draft_histogram) == {0}
    if drafter == "target" and costs is CHEAP:  # every draft accepted: the most drafts every step
        assert set(stats.draft_histogram) == {4}


def test_calibrated_costs_are_measured_once_and_reused(tiny):
    target, head = tiny
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    costs = calibrate_draft_costs(target, head, max_draft_tokens=2)
    assert costs is calibrate_draft_costs(target, head, max_draft_tokens=2)  # frozen per model and key
    assert costs.step[0] == 1.0 and len(costs.step) == 3 and 0.0 <= costs.acceptance <= 1.0
    exact = calibrate_draft_costs(target, TargetProposer(target), max_draft_tokens=2)
    assert exact.acceptance == 1.0  # the target drafting for itself: every greedy draft accepted
    table = calibrate_draft_cost_table(target, head, max_batch_size=3, max_draft_tokens=2)
    assert [rows for rows, _ in table.by_batch] == [1, 2, 4] and table.for_batch(1) is costs
    assert table.for_batch(3) is calibrate_draft_costs(target, head, batch_size=4, max_draft_tokens=2)
    # every draft accepted, 12 a step: a cycle's rows never run out of tokens
    many = calibrate_draft_costs(target, TargetProposer(target), max_draft_tokens=12)
    assert len(many.step) == 13 and list(many.step) == sorted(many.step) and many.acceptance == 1.0
    out = speculative_generate(target, head, prompt, max_new_tokens=12, num_draft_tokens="auto", eos_token_id=-1)
    assert out.stats.draft_costs is not None and len(out.stats.draft_costs) == adaptive.DEFAULT_MAX_DRAFT_TOKENS + 1
    assert out.stats.to_dict()["draft_costs_by_batch"] == {1: out.stats.draft_costs}
    assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=-1))


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_greedy_auto_with_costs_per_batch_size_equals_plain(tiny, batch_size):
    """The same table at three batch sizes: 1 row drafts 3 every step (exact drafts), 16 rows take plain
    steps (and probes); the tokens are plain greedy's at each."""
    target, _ = tiny
    prompts = torch.randint(3, 64, (batch_size, 6), generator=torch.Generator().manual_seed(batch_size))
    out = speculative_generate(target, TargetProposer(target), prompts, max_new_tokens=12, num_draft_tokens="auto",
                               draft_costs=PER_BATCH, eos_token_id=-1)
    assert torch.equal(out.sequences, plain_generate(target, prompts, max_new_tokens=12, eos_token_id=-1))
    histogram = out.stats.draft_histogram
    assert out.stats.draft_costs == PER_BATCH.for_batch(batch_size).step
    if batch_size == 1:
        assert set(histogram) == {3}
    if batch_size == 16:
        assert set(histogram) <= {0, 1} and histogram[0] > histogram.get(1, 0)


def test_greedy_auto_on_the_demo_lm_equals_plain_and_generate():
    from transformers import AutoTokenizer

    from omnimtp.mtp.demo import demo_model_dir
    from omnimtp.mtp.load import load_target_and_head

    target, head = load_target_and_head(demo_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir())
    text = json.loads((demo_model_dir() / "heldout_prompts.json").read_text())[0]
    prompt = tokenizer(text, return_tensors="pt").input_ids
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=-1)
    assert torch.equal(plain_generate(target, prompt, max_new_tokens=40, eos_token_id=-1), reference)
    for costs in (CHEAP, MIXED):
        out = speculative_generate(target, head, prompt, max_new_tokens=40, num_draft_tokens="auto", draft_costs=costs,
                                   eos_token_id=-1)
        assert torch.equal(out.sequences, reference)
        assert out.stats.num_accepted > 0


def test_greedy_auto_on_the_demo_omni_thinker_equals_plain():
    from omnimtp.mtp.demo import demo_omni_dir, demo_omni_prompts
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
    from omnimtp.thinker import ThinkerRun

    pipe = OmniPipeline.demo(thinker_mtp=None)
    head = MTPHead.from_pretrained(demo_omni_dir(), pipe.model.thinker).eval()
    prompts = [pipe.family.chat_ids([{"role": "user", "content": t}]) for t in demo_omni_prompts()[:2]]

    def run(speculation):
        thinker_run = ThinkerRun(pipe.model.thinker, prompts, accept_hidden_layer=pipe.accept_hidden_layer,
                                 eos_token_ids=pipe.eos_token_ids, max_new_tokens=32, decoder=pipe.thinker_decoder,
                                 speculation=speculation)
        with torch.inference_mode():
            while not thinker_run.is_finished:
                thinker_run.step()
        return thinker_run

    plain = run(None).output_ids
    for costs in (CHEAP, MIXED, DEAR):
        spec = run(ThinkerSpeculation(head, "auto", draft_costs=costs))
        assert spec.output_ids == plain
        if costs is DEAR:  # no k pays at the prior: plain steps only
            assert all(set(s.draft_histogram) == {0} for s in spec.spec_stats)
        else:
            assert sum(s.num_accepted for s in spec.spec_stats) > 0
    with pytest.raises(ValueError, match="draft_costs"):
        ThinkerSpeculation(head, 3, draft_costs=CHEAP)


def test_a_thinker_step_asked_to_be_plain_drafts_nothing_under_auto_and_a_fixed_k_drafts_as_always():
    """While a request waits for its first audio the engine asks its cohorts for plain steps: with `auto` such a
    step drafts nothing (the greedy text stays plain greedy's, steps asked and not asked mixed), and a fixed k
    drafts as always, so its seeded requests do not depend on when others arrive."""
    from omnimtp.mtp.demo import demo_omni_dir, demo_omni_prompts
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
    from omnimtp.thinker import ThinkerRun

    pipe = OmniPipeline.demo(thinker_mtp=None)
    head = MTPHead.from_pretrained(demo_omni_dir(), pipe.model.thinker).eval()
    prompts = [pipe.family.chat_ids([{"role": "user", "content": t}]) for t in demo_omni_prompts()[:2]]

    def run(speculation, plain_steps):
        thinker_run = ThinkerRun(pipe.model.thinker, prompts, accept_hidden_layer=pipe.accept_hidden_layer,
                                 eos_token_ids=pipe.eos_token_ids, max_new_tokens=24, decoder=pipe.thinker_decoder,
                                 speculation=speculation)
        with torch.inference_mode():
            step = 0
            while not thinker_run.is_finished:
                thinker_run.step(plain=plain_steps(step))
                step += 1
        return thinker_run

    plain = run(None, lambda step: False).output_ids
    always = run(ThinkerSpeculation(head, "auto", draft_costs=CHEAP), lambda step: True)
    assert always.output_ids == plain and all(set(s.draft_histogram) == {0} for s in always.spec_stats)
    mixed = run(ThinkerSpeculation(head, "auto", draft_costs=CHEAP), lambda step: step % 3 == 1)
    assert mixed.output_ids == plain and sum(s.num_accepted for s in mixed.spec_stats) > 0
    assert all(0 in s.draft_histogram for s in mixed.spec_stats)
    fixed = run(ThinkerSpeculation(head, 3), lambda step: True)
    assert fixed.output_ids == plain and sum(s.num_accepted for s in fixed.spec_stats) > 0


# --- sampled: the target's law, repeatable -------------------------------------------------------------


SAMPLING = SamplingParams(temperature=0.8, top_k=10, top_p=0.7)
NUM_ROWS = 8000


class SharpDraft:
    """The target drafting for itself at temperature 0.3 (accepted often, not always; q is not one-hot)."""

    def __init__(self, target):
        self.inner = TargetProposer(target)

    def reset(self):
        self.inner.reset()

    def propose(self, block, num_draft_tokens, sampling, generators):
        return self.inner.propose(block, num_draft_tokens, SamplingParams(temperature=0.3), generators)


def _plain_law(target, prompt, num_tokens: int) -> torch.Tensor:
    """The exact law [V^n] of the first num_tokens sampled tokens (outcome code Σ t_i V^(n-1-i)), enumerated
    with the target's own forward over every prefix in the filtered support."""
    from omnimtp.sampling import probs_from_logits

    vocab = target.config.vocab_size
    law, codes, prefixes = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.long), prompt
    for _ in range(num_tokens):
        with torch.no_grad():
            probs = probs_from_logits(target(prefixes).logits[:, -1].float(), SAMPLING).double()  # [N, V]
        law, codes = (law[:, None] * probs).flatten(), (codes[:, None] * vocab + torch.arange(vocab)).flatten()
        prefixes = torch.cat(
            [prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], 1
        )
        keep = law > 0
        law, codes, prefixes = law[keep], codes[keep], prefixes[keep]
    exact = torch.zeros(vocab**num_tokens, dtype=torch.float64)
    exact[codes] = law
    return exact.float()


def test_sampled_auto_follows_the_target_law(tiny):
    """k = 2 at the prior, then whatever the batch's acceptance pays for (MIXED costs, at most 2 drafts): the
    first two tokens and the first three follow the target's law within the sample-size bound."""
    target, _ = tiny
    prompt = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    vocab = target.config.vocab_size
    costs = DraftCosts(MIXED.step[:3])
    out = speculative_generate(target, SharpDraft(target), prompt.expand(NUM_ROWS, -1), max_new_tokens=3,
                               num_draft_tokens="auto", draft_costs=costs, sampling=SAMPLING,
                               seed=list(range(NUM_ROWS)), eos_token_id=-1)
    assert 0.5 < out.stats.acceptance_rate < 0.98
    new = out.sequences[:, prompt.shape[1]:]
    for n in (2, 3):
        assert_law((new[:, :n] * vocab ** torch.arange(n - 1, -1, -1)).sum(1), _plain_law(target, prompt, n), {})


def test_seeded_auto_request_repeats(tiny):
    target, head = tiny
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    runs = [speculative_generate(target, head, prompt, max_new_tokens=24, num_draft_tokens="auto", draft_costs=MIXED,
                                 sampling=SAMPLING, seed=11, eos_token_id=-1) for _ in range(2)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.draft_histogram == runs[1].stats.draft_histogram
    assert len(runs[0].stats.draft_histogram) > 1  # k moved during the run


def test_seeded_auto_rows_with_costs_per_batch_size_repeat_and_match_alone_when_k_agrees(tiny):
    """Per-batch costs move k during a sampled run and a seeded batch repeats. A row draws only from its own
    generator, so where alone and batched take the same k (drafting pays at both sizes) it is the same row;
    where the costs give the two sizes different k it is a different, equally distributed, sample."""
    target, head = tiny
    prompts = torch.randint(3, 64, (4, 6), generator=torch.Generator().manual_seed(7))
    seeds = [21, 22, 23, 24]

    def run(ids, costs, row_seeds, drafter=head):
        return speculative_generate(target, drafter, ids, max_new_tokens=16, num_draft_tokens="auto", draft_costs=costs,
                                    sampling=SAMPLING, seed=row_seeds, eos_token_id=-1)

    first, again = run(prompts, PER_BATCH, seeds), run(prompts, PER_BATCH, seeds)
    assert torch.equal(first.sequences, again.sequences) and first.stats.draft_histogram == again.stats.draft_histogram
    assert len(first.stats.draft_histogram) > 1
    drafts_pay = DraftCostTable(((1, DraftCosts((1.0, 1.05, 1.1))), (4, DraftCosts((1.0, 1.1, 1.2)))))
    exact = TargetProposer(target)
    batched = run(prompts, drafts_pay, seeds, exact)
    assert set(batched.stats.draft_histogram) == {2}
    for row, seed in enumerate(seeds):
        alone = run(prompts[row : row + 1], drafts_pay, [seed], exact)
        assert set(alone.stats.draft_histogram) == {2}
        assert torch.equal(alone.sequences[0], batched.sequences[row])


def test_a_thinker_cohort_that_shrinks_switches_k_and_keeps_its_tokens():
    """Two requests, plain steps while both run (drafting is dear at 2 rows), drafts once one finished
    (cheap at 1 row): the surviving request switches k mid-run and both replies are plain greedy's."""
    from spec_drafters import RecomputingDraft

    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
    from omnimtp.thinker import ThinkerRun

    family = Qwen3OmniFamily.tiny(0)
    prompts = [family.chat_ids([{"role": "user", "content": t}]) for t in ("Hello there", "What is two plus two?")]

    def run(speculation, eos):
        thinker_run = ThinkerRun(family.model.thinker, prompts, accept_hidden_layer=family.accept_hidden_layer,
                                 eos_token_ids=eos, max_new_tokens=40, decoder=family.thinker_decoder,
                                 speculation=speculation)
        with torch.inference_mode():
            while not thinker_run.is_finished:
                thinker_run.step()
        return thinker_run

    free = run(None, set()).output_ids
    # an "EOS" that ends request 0 early and request 1 late
    eos = next(t for j, t in enumerate(free[0][3:12], 3) if t not in free[1][: j + 16])
    plain = run(None, {eos}).output_ids
    assert len(plain[0]) + 10 <= len(plain[1])
    cheap_alone, dear_in_two = DraftCosts((1.0, 1.01, 1.02, 1.03, 1.04)), DraftCosts((1.0, 3.0, 5.0, 7.0, 9.0))
    shrinking = DraftCostTable(((1, cheap_alone), (2, dear_in_two)))
    drafter = RecomputingDraft(family.model.thinker, corrupt_rate=0.2, seed=1)
    spec = run(ThinkerSpeculation(drafter, "auto", draft_costs=shrinking), {eos})
    assert spec.output_ids == plain
    early, late = (stats.draft_histogram for stats in spec.spec_stats)
    assert set(early) <= {0, 1}  # plain steps and probes only
    assert 0 in late and max(late) >= 2  # more than the one draft of a probe at two rows: alone, drafting paid
    assert spec.spec_stats[1].draft_costs_by_batch == shrinking.to_dict()


def test_a_server_measures_its_buckets_at_start_up_and_reports_them():
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.server.metrics import ServerMetrics
    from omnimtp.server.scheduler import Engine
    from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation

    family = Qwen3OmniFamily.tiny(0)
    torch.manual_seed(0)
    family.thinker_speculation = ThinkerSpeculation(MTPHead.from_config(family.model.thinker), "auto")
    engine = Engine(family, max_batch_size=2, max_frames=8)
    metrics = ServerMetrics()
    engine.start(metrics=metrics)
    try:
        tables = engine.draft_costs
    finally:
        engine.shutdown()
    assert set(tables) == {"greedy", "sampled"}
    assert all([rows for rows, _ in table.by_batch] == [1, 2] for table in tables.values())
    assert all(0.0 <= costs.acceptance <= 1.0 for table in tables.values() for _, costs in table.by_batch)
    assert family.calibrate_speculation(2) == tables  # measured once, then reused
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    for name, table in tables.items():
        cost = table.for_batch(2).step[3]
        assert f'omnimtp_thinker_draft_step_cost{{batch_size="2",k="3",sampling="{name}"}} {cost}' in text


def test_bad_settings_raise_value_errors(tiny):
    target, head = tiny
    prompt = torch.ones(1, 3, dtype=torch.long)
    for k in ("fast", 0, 2.5, True):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            speculative_generate(target, head, prompt, max_new_tokens=4, num_draft_tokens=k)
    with pytest.raises(ValueError, match="draft_costs"):
        speculative_generate(target, head, prompt, max_new_tokens=4, num_draft_tokens=3, draft_costs=CHEAP)
    with pytest.raises(ValueError, match="draft_costs"):
        speculative_generate(target, head, prompt, max_new_tokens=4, num_draft_tokens="auto", draft_costs=(1.0, 2.0))


# --- a plain step of a speculative run is a plain step ---------------------------------------------------


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops run under it (what a step costs on a small CPU model: per-op overhead)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(run) -> float:
    """run(n) decodes n steps after the prefill → aten ops of one step (the difference of two lengths),
    after a warm-up run (which fills caches shared between runs, e.g. the decoder's RoPE rows)."""
    run(12)
    counts = []
    for num_steps in (4, 12):
        with _CountOps() as ops:
            run(num_steps)
        counts.append(ops.count)
    return (counts[1] - counts[0]) / 8


@pytest.mark.parametrize("sampling", [None, SAMPLING], ids=["greedy", "sampled"])
def test_a_plain_step_of_an_auto_run_costs_what_a_plain_loop_step_costs(tiny, sampling):
    """k = 0 steps run the plain loop's step (`plain_generate`'s, `ThinkerRun`'s) plus at most a few ops of
    bookkeeping: the drafter's catch-up waits for the next step that drafts."""
    from omnimtp.spec_decode.adaptive import FixedDrafts
    from omnimtp.spec_decode.generate import _speculative_generate

    target, head = tiny
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(3))

    def plain(n):
        plain_generate(target, prompt, max_new_tokens=n + 1, sampling=sampling, seed=0, eos_token_id=-1)

    def spec(n):
        with torch.inference_mode():
            _speculative_generate(target, head, prompt, None, FixedDrafts(0), max_new_tokens=64,
                                  sampling=sampling or SamplingParams.greedy(), seed=0, eos_token_id=[],
                                  target_backend="auto", max_steps=n)

    assert _ops_per_step(spec) <= _ops_per_step(plain) + 2


def test_a_plain_step_of_an_auto_thinker_run_costs_what_a_plain_thinker_step_costs():
    from omnimtp.mtp.demo import demo_omni_dir
    from omnimtp.pipeline import OmniPipeline
    from omnimtp.sampling import make_generators
    from omnimtp.spec_decode.adaptive import FixedDrafts
    from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
    from omnimtp.thinker import ThinkerRun

    pipe = OmniPipeline.demo(thinker_mtp=None)
    head = MTPHead.from_pretrained(demo_omni_dir(), pipe.model.thinker).eval()
    prompt = pipe.family.chat_ids([{"role": "user", "content": "def f(x):\n"}])

    def runner(speculation):
        def run(n):
            thinker_run = ThinkerRun(pipe.model.thinker, [prompt], accept_hidden_layer=pipe.accept_hidden_layer,
                                     eos_token_ids=set(), max_new_tokens=64, decoder=pipe.thinker_decoder,
                                     speculation=speculation, sampling=[SAMPLING], generators=make_generators([0]))
            if speculation is not None:
                thinker_run.controller = FixedDrafts(0)
            with torch.inference_mode():
                for _ in range(n + 1):
                    thinker_run.step()
        return run

    assert _ops_per_step(runner(ThinkerSpeculation(head, 1))) <= _ops_per_step(runner(None)) + 2


# --- calibrated costs kept on disk ------------------------------------------------------------------------


@pytest.fixture
def cost_cache_dir(tmp_path, monkeypatch):
    """A private cache directory, turned on, and no costs kept in this process (as in a fresh one)."""
    monkeypatch.setenv("OMNIMTP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OMNIMTP_DRAFT_COST_CACHE", raising=False)
    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
    return tmp_path / "draft_costs"


def _counting_calibration(model, fingerprint, seconds=(1.0, 1.5, 1.7)):
    """k = 1 steps accept 3 of 4 verified drafts, k = 2 steps 1 of 4: acceptance 4 / 8 over every cycle (the
    untimed first step of one draft, which accepts all 4 and takes 100 s, counts for neither)."""
    cycles = []

    def time_cycle(ks):
        cycles.append(list(ks))
        steps = [(seconds[k], (0, 3, 1)[k], (0, 4, 4)[k]) for k in ks]
        steps[2] = (100.0, 4, 4)
        return steps

    costs = adaptive.calibrate(model, ("key",), time_cycle, len(seconds) - 1, lambda: fingerprint)
    return costs, cycles


def test_calibration_times_every_k_step_by_step_and_a_drift_moves_every_k_alike():
    """Each cycle runs two plain steps, an untimed step of one draft (it reads the plain steps' slots), then
    one step of each k; a machine twice as slow in half the cycles leaves the costs as they are."""
    assert adaptive.calibration_cycle(3) == ([0, 0, 1, 1, 2, 3], [True, True, False, True, True, True])
    cycles = []

    def time_cycle(ks):
        slow = 2.0 if len(cycles) % 2 else 1.0
        cycles.append(ks)
        return [(slow * (1.0, 1.2, 1.5, 2.0)[k] * (50.0 if i == 2 else 1.0), k, k + 1) for i, k in enumerate(ks)]

    costs = adaptive.calibrate(torch.nn.Linear(2, 2), ("drift",), time_cycle, 3)
    assert len(cycles) == adaptive.CALIBRATION_CYCLES and costs.source == "measured"
    assert costs.step == pytest.approx((1.0, 1.2, 1.5, 2.0))
    assert costs.acceptance == pytest.approx((1 + 2 + 3) / (2 + 3 + 4))  # the timed steps' drafts only


def test_a_second_process_reads_the_costs_back_and_a_changed_setting_measures_again(cost_cache_dir, monkeypatch):
    model, drafter = torch.nn.Linear(4, 4), torch.nn.Linear(8, 4)
    fingerprint = cost_fingerprint(model, drafter, key={"batch_size": 4})
    costs, measured = _counting_calibration(model, fingerprint)
    assert costs.step == (1.0, 1.5, 1.7) and costs.source == "measured" and len(measured) == adaptive.CALIBRATION_CYCLES
    assert costs.acceptance == 0.5
    assert len(list(cost_cache_dir.glob("*.json"))) == 1

    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())  # the next process
    again, measured = _counting_calibration(model, cost_fingerprint(model, drafter, key={"batch_size": 4}))
    assert again == costs and again.source == "cached" and measured == []
    assert again.acceptance == 0.5  # the prior comes back with the costs

    # any part a step's time depends on names another entry: measured again
    changed = [
        cost_fingerprint(model, drafter, key={"batch_size": 8}),
        cost_fingerprint(model, torch.nn.Linear(8, 5), key={"batch_size": 4}),
        cost_fingerprint(model, drafter, key={"batch_size": 4}, device="meta"),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        changed.append(cost_fingerprint(model, drafter, key={"batch_size": 4}))
    finally:
        torch.set_num_threads(threads)
    for other in changed:
        monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
        costs, measured = _counting_calibration(model, other, seconds=(2.0, 2.2, 2.6))
        assert costs.step == (1.0, 1.1, 1.3) and costs.source == "measured" and measured, other


def test_the_fingerprint_changes_with_the_kernel_build(monkeypatch):
    """Another build of omnimtp's kernel (its ISA, tiling or source: `small_batch_linear.build_id`) times steps
    differently: the costs measured with one are not read back for the other."""
    from omnimtp.runtime.kernels import small_batch_linear

    model = torch.nn.Linear(4, 4)
    fingerprints = []
    for build in ("AVX2 6x64 1f0c2a9b", "AVX512 4x64 1f0c2a9b", "AVX2 6x64 77aa0b3c"):
        monkeypatch.setattr(small_batch_linear, "build_id", lambda build=build: build)
        fingerprints.append(json.dumps(cost_fingerprint(model, model, key={}), sort_keys=True))
    assert len(set(fingerprints)) == 3


def test_a_model_directory_whose_files_change_is_measured_again(cost_cache_dir, monkeypatch, tmp_path):
    (tmp_path / "model").mkdir()
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(b"0" * 16)
    model, drafter = torch.nn.Linear(4, 4), torch.nn.Linear(8, 4)
    _counting_calibration(model, cost_fingerprint(model, drafter, key={}, model_path=tmp_path / "model"))
    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
    weights.write_bytes(b"1" * 32)  # new weights
    fingerprint = cost_fingerprint(model, drafter, key={}, model_path=tmp_path / "model")
    costs, measured = _counting_calibration(model, fingerprint)
    assert costs.source == "measured" and measured


@pytest.mark.parametrize("corrupt", [
    lambda entry: "{not json",
    lambda entry: json.dumps({**entry, "step": [1.0, 1.5]}),  # too few
    lambda entry: json.dumps({**entry, "step": [1.0, 1.9, 1.2]}),  # falls with k
    lambda entry: json.dumps({**entry, "step": [2.0, 2.5, 3.0]}),  # c_0 != 1
    lambda entry: json.dumps({**entry, "step": [1.0, "1.5", 2.0]}),
    lambda entry: json.dumps({**entry, "fingerprint": {**entry["fingerprint"], "device": "cuda"}}),
    lambda entry: json.dumps([entry]),
    lambda entry: json.dumps({**entry, "acceptance": 1.5}),
], ids=["not-json", "short", "falling", "c0", "string", "other-fingerprint", "list", "acceptance"])
def test_a_corrupt_entry_is_ignored_and_replaced_by_a_measurement(cost_cache_dir, monkeypatch, corrupt):
    model, drafter = torch.nn.Linear(4, 4), torch.nn.Linear(8, 4)
    fingerprint = cost_fingerprint(model, drafter, key={})
    _counting_calibration(model, fingerprint)
    (path,) = cost_cache_dir.glob("*.json")
    path.write_text(corrupt(json.loads(path.read_text())))
    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
    costs, measured = _counting_calibration(model, fingerprint)
    assert costs.step == (1.0, 1.5, 1.7) and costs.source == "measured" and measured
    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
    assert _counting_calibration(model, fingerprint)[0].source == "cached"  # the measurement replaced it


def test_the_cache_turned_off_reads_and_writes_nothing(cost_cache_dir, monkeypatch):
    model = torch.nn.Linear(4, 4)
    fingerprint = cost_fingerprint(model, model, key={})
    _counting_calibration(model, fingerprint)
    monkeypatch.setenv("OMNIMTP_DRAFT_COST_CACHE", "0")
    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
    costs, measured = _counting_calibration(model, fingerprint, seconds=(2.0, 2.2, 2.6))
    assert costs.step == (1.0, 1.1, 1.3) and costs.source == "measured" and measured
    monkeypatch.delenv("OMNIMTP_DRAFT_COST_CACHE")
    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
    assert _counting_calibration(model, fingerprint)[0].step == (1.0, 1.5, 1.7)  # the first entry, not rewritten


def test_a_cache_directory_that_cannot_be_written_leaves_the_costs_measured(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OMNIMTP_CACHE_DIR", str(blocker))  # a file: no directory can be made under it
    monkeypatch.delenv("OMNIMTP_DRAFT_COST_CACHE", raising=False)
    monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())
    model = torch.nn.Linear(4, 4)
    costs, measured = _counting_calibration(model, cost_fingerprint(model, model, key={}))
    assert costs.source == "measured" and measured


def test_a_second_server_start_reads_its_costs_back_and_reports_them(cost_cache_dir, monkeypatch):
    from prometheus_client import generate_latest

    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.server.metrics import ServerMetrics
    from omnimtp.server.scheduler import Engine
    from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation

    family = Qwen3OmniFamily.tiny(0)
    torch.manual_seed(0)
    family.thinker_speculation = ThinkerSpeculation(MTPHead.from_config(family.model.thinker), "auto")
    started = []
    for _ in range(2):
        monkeypatch.setattr(adaptive, "_CALIBRATED", weakref.WeakKeyDictionary())  # a new process
        engine, metrics = Engine(family, max_batch_size=2, max_frames=8), ServerMetrics()
        engine.start(metrics=metrics)
        engine.shutdown()
        started.append((engine.draft_costs, generate_latest(metrics.registry).decode()))
    (first, first_text), (second, second_text) = started
    assert second == first
    assert {s for table in first.values() for s in table.sources().values()} == {"measured"}
    assert {s for table in second.values() for s in table.sources().values()} == {"cached"}
    assert 'omnimtp_thinker_draft_costs_cached{batch_size="2",sampling="greedy"} 0.0' in first_text
    assert 'omnimtp_thinker_draft_costs_cached{batch_size="2",sampling="greedy"} 1.0' in second_text


def test_a_static_batch_drops_its_finished_rows_and_drafts_by_the_rows_left(tiny):
    """A 3-row batch where drafting is dear at its size (plain steps only) whose EOS ends two rows early: the
    finished rows leave the batch, the steps after run fewer rows and draft by the smaller buckets' costs,
    and every row is plain greedy's (`generate`'s)."""
    target, _ = tiny
    ids = torch.randint(3, 64, (3, 6), generator=torch.Generator().manual_seed(0))
    free = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=-1)[:, 6:]
    eos, ends = _eos_ending_all_rows_but_one_early(free)
    reference = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=eos)
    assert torch.equal(plain_generate(target, ids, max_new_tokens=24, eos_token_id=eos), reference)
    dear_at_three = DraftCostTable((
        (1, DraftCosts((1.0, 1.1, 1.2, 1.3))),
        (2, DraftCosts((1.0, 1.5, 1.8, 2.1))),
        (4, DraftCosts((1.0, 3.0, 5.0, 7.0))),
    ))
    rows_drafted_for = []

    class Recording(TargetProposer):
        def propose(self, block, num_draft_tokens, sampling, generators):
            rows_drafted_for.append(block.input_ids.shape[0])
            return super().propose(block, num_draft_tokens, sampling, generators)

    out = speculative_generate(target, Recording(target), ids, max_new_tokens=24, num_draft_tokens="auto",
                               draft_costs=dear_at_three, eos_token_id=eos)
    assert torch.equal(out.sequences, reference)
    histogram = out.stats.draft_histogram
    assert histogram.get(0, 0) >= min(end for end in ends if end is not None)  # 3 rows: plain steps
    assert max(histogram) >= 2  # drafting once rows left
    assert rows_drafted_for and max(rows_drafted_for) <= 2 and rows_drafted_for[-1] == 1
    assert rows_drafted_for == sorted(rows_drafted_for, reverse=True)


def _eos_ending_all_rows_but_one_early(free: torch.Tensor) -> tuple[int, list[int | None]]:
    """A token of the rows' free greedy continuations [B, N] that ends all rows but one between their 3rd and
    12th token and never appears in that one → (the token, each row's end step or None)."""
    for token in free[:, :12].unique().tolist():
        ends = [(row == token).nonzero()[0, 0].item() if (row == token).any() else None for row in free]
        early = [end for end in ends if end is not None and 2 <= end < 12]
        if len(early) == free.shape[0] - 1 and ends.count(None) == 1:
            return token, ends
    raise AssertionError("no token ends all rows but one early")


def test_a_row_left_alone_decides_with_its_own_acceptance():
    """Two rows, one whose drafts are always right and one whose drafts are always wrong: the first ends
    early (4 tokens a step), and the row left alone decides by its own estimate (low: plain steps and a few
    probes), not by the finished row's."""
    target = tiny_lm("glm4_moe", seed=0)
    vocab = target.get_output_embeddings().weight.shape[0]

    class OneRowWrong(TargetProposer):
        def reset(self):
            super().reset()
            self.rows, self.calls = [0, 1], []

        def keep_rows(self, rows):
            super().keep_rows(rows)
            self.rows = [self.rows[i] for i in rows]

        def propose(self, block, num_draft_tokens, sampling, generators):
            tokens, _ = super().propose(block, num_draft_tokens, sampling, generators)
            self.calls.append(tokens.shape[0])
            wrong = torch.tensor([row == 1 for row in self.rows])[:, None]
            tokens = torch.where(wrong, (tokens + 1) % vocab, tokens)
            return tokens, torch.nn.functional.one_hot(tokens, vocab).float()

    costs = DraftCostTable(((1, DraftCosts((1.0, 1.5, 1.8, 2.1))), (2, DraftCosts((1.0, 1.1, 1.2, 1.3)))))
    prompts = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    drafter = OneRowWrong(target)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=40, num_draft_tokens="auto",
                               draft_costs=costs, eos_token_id=-1)
    assert torch.equal(out.sequences, plain_generate(target, prompts, max_new_tokens=40, eos_token_id=-1))
    alone = drafter.calls.count(1)
    assert drafter.calls[0] == 2 and out.stats.num_steps - len(drafter.calls) >= 15  # plain steps, alone
    assert alone <= 5, drafter.calls  # probes only (with the finished row's estimate: a draft every step)
