"""speculative_generate: greedy == target.generate (ragged batches, EOS, k ∈ {1,2,3,5}, random and always-agreeing
drafters), sampled tokens follow the target's distribution, seeded runs repeat, rows are batch-independent, errors."""

import pytest
import torch
from distribution_checks import tv_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_drafters import ragged_batch

from omnimtp import MTPHead, SamplingParams, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.spec_decode.generate import greedy_verify
from omnimtp.spec_decode.proposer import TargetProposer
from omnimtp.spec_decode.rejection import rejection_sample

FAMILIES = ["glm4_moe", "deepseek_v3"]
PAD = 0


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    target = tiny_lm(request.param, seed=0)
    torch.manual_seed(1)
    return target, MTPHead.from_config(target)


def _eos_mid_output(target, ids, mask, max_new_tokens):
    """An EOS id that some row emits early and another row doesn't, so rows finish at different times."""
    free = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    return int(free[0, ids.shape[1] + 3])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("drafter", ["mtp_head", "target"])
def test_greedy_identical_to_generate_ragged_batch_with_eos(models, k, drafter):
    target, head = models
    ids, mask = ragged_batch(lengths=(7, 5, 3, 6), pad_id=PAD, seed=k)
    eos = _eos_mid_output(target, ids, mask, 10)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    proposer = head if drafter == "mtp_head" else TargetProposer(target)
    ids_before = ids.clone()
    out = speculative_generate(target, proposer, ids, mask, max_new_tokens=10, num_draft_tokens=k, eos_token_id=eos)
    assert torch.equal(out.sequences, reference)
    assert torch.equal(ids, ids_before)
    assert (out.sequences[0, ids.shape[1]:] == eos).any()  # EOS really stopped a row
    if drafter == "target":  # every draft accepted: the bonus path runs every step
        assert out.stats.mean_acceptance_length == pytest.approx(k + 1)
        assert out.stats.acceptance_per_position == pytest.approx([1.0] * k)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_to_generate_batch_one(models, k):
    target, head = models
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(10 + k))
    reference = target.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=-1)
    for proposer in (head, TargetProposer(target)):
        out = speculative_generate(target, proposer, prompt, max_new_tokens=16, num_draft_tokens=k, eos_token_id=-1)
        assert torch.equal(out.sequences, reference)
        assert out.stats.num_generated_tokens == 16


def test_stats_are_consistent(models):
    target, head = models
    ids, mask = ragged_batch(lengths=(7, 5, 3, 6), pad_id=PAD, seed=3)
    out = speculative_generate(target, head, ids, mask, max_new_tokens=10, num_draft_tokens=3, eos_token_id=-1)
    stats = out.stats
    assert stats.mean_acceptance_length == pytest.approx(1 + sum(stats.acceptance_per_position))
    assert 1.0 <= stats.mean_acceptance_length <= 4.0
    assert stats.num_row_steps >= stats.num_steps >= 1
    assert stats.draft_time_s > 0 and stats.verify_time_s > 0


def test_sampled_tokens_follow_target_distribution(models):
    """N identical prompts, one seed each, the MTP head drafting: the first token and the first *verified*
    token (whose law is Σ_x p(x) p(· | x), computed exactly) match the target within the sample-size bound.
    A random head's drafts are rarely accepted, so this cannot tell the recovery rule apart;
    test_spec_distribution pins that with a drafter that is."""
    target, head = models
    sampling = SamplingParams(temperature=1.0, top_k=6)
    prompt = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    num_rows = 2000
    out = speculative_generate(
        target, head, prompt.expand(num_rows, -1), max_new_tokens=2, num_draft_tokens=2,
        sampling=sampling, seed=list(range(num_rows)), eos_token_id=-1,
    )
    from omnimtp.sampling import probs_from_logits

    with torch.no_grad():
        p1 = probs_from_logits(target(prompt).logits[0, -1], sampling)  # [V]
        support = p1.nonzero().squeeze(-1)
        extended = torch.cat([prompt.expand(len(support), -1), support[:, None]], 1)
        p2_given = probs_from_logits(target(extended).logits[:, -1], sampling)  # [S, V]
        p2 = (p1[support, None] * p2_given).sum(0)  # [V]
    for position, exact in ((5, p1), (6, p2)):
        empirical = torch.bincount(out.sequences[:, position], minlength=exact.numel()).double() / num_rows
        tv = 0.5 * (empirical - exact.double()).abs().sum().item()
        assert tv <= tv_bound(num_rows, int((exact > 0).sum())), (position, tv)


def test_seeded_runs_repeat_and_rows_are_batch_independent(models):
    target, head = models
    ids, mask = ragged_batch(lengths=(7, 5, 3, 6), pad_id=PAD, seed=5)
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    kwargs = dict(max_new_tokens=10, num_draft_tokens=3, sampling=sampling, eos_token_id=-1)
    seeds = [11, 12, 13, 14]
    first = speculative_generate(target, head, ids, mask, seed=seeds, **kwargs)
    again = speculative_generate(target, head, ids, mask, seed=seeds, **kwargs)
    assert torch.equal(first.sequences, again.sequences)
    row = 2
    start = int((mask[row] == 0).sum())
    alone = speculative_generate(target, head, ids[row:row + 1, start:], seed=[seeds[row]], **kwargs)
    assert torch.equal(alone.sequences[0], first.sequences[row, start:])


def test_bad_input_raises_value_error(models):
    target, head = models
    prompt = torch.randint(3, 64, (1, 4))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, head, prompt, max_new_tokens=4, num_draft_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, head, prompt, max_new_tokens=0, num_draft_tokens=2)
    with pytest.raises(ValueError, match="attention_mask"):
        speculative_generate(target, head, prompt, torch.tensor([[1, 1, 1, 0]]), max_new_tokens=4, num_draft_tokens=2)
    with pytest.raises(ValueError, match="seed"):
        speculative_generate(
            target, head, prompt, max_new_tokens=4, num_draft_tokens=2, sampling=SamplingParams(), seed=[1, 2]
        )
    other = tiny_lm("glm4_moe", seed=0, vocab_size=80)
    with pytest.raises(ValueError, match="head: vocab"):
        speculative_generate(other, MTPHead.from_config(tiny_lm("glm4_moe", seed=0)), prompt, max_new_tokens=4,
                             num_draft_tokens=2)
    wide = tiny_lm("glm4_moe", seed=0, hidden_size=96)
    with pytest.raises(ValueError, match="head: hidden"):
        speculative_generate(wide, head, prompt, max_new_tokens=4, num_draft_tokens=2)


@settings(max_examples=60, deadline=None)
@given(
    batch_size=st.integers(1, 4),
    k=st.integers(1, 5),
    vocab=st.integers(2, 6),
    seed=st.integers(0, 2**16),
)
def test_greedy_verify_equals_rejection_sample(batch_size, k, vocab, seed):
    """The greedy fast path of speculative_generate = rejection_sample on one-hot target probs."""
    g = torch.Generator().manual_seed(seed)
    target_argmax = torch.randint(0, vocab, (batch_size, k + 1), generator=g)
    # drafts agree with the target at random places, so every accepted count 0..k occurs
    draft_tokens = torch.where(
        torch.rand(batch_size, k, generator=g) < 0.7,
        target_argmax[:, :k],
        torch.randint(0, vocab, (batch_size, k), generator=g),
    )
    expected = rejection_sample(torch.nn.functional.one_hot(target_argmax, vocab).float(), draft_tokens, greedy=True)
    tokens, num_emitted = greedy_verify(target_argmax, draft_tokens)
    assert torch.equal(tokens, expected[0]) and torch.equal(num_emitted, expected[1])
