"""rejection_sample: greedy rule, lossless sampling (absolute bounds, fixed seed), per-row determinism, errors."""

import math

import pytest
import torch

from omnimtp import SamplingParams, speculative_generate
from omnimtp.models.tiny_lm import TINY_LM_VOCAB_SIZE, tiny_lm
from omnimtp.spec_decode.rejection import rejection_sample


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of χ²(df) at p ≈ 1e-4 (Wilson–Hilferty; z = Φ⁻¹(1 − 1e-4))."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _random_dist(generator, vocab_size, sharpness=1.0):
    return (torch.randn(vocab_size, generator=generator, dtype=torch.float64) * sharpness).softmax(-1).float()


def test_greedy_accepts_matching_prefix_then_emits_target_argmax():
    vocab = 8
    argmaxes = torch.tensor([[3, 5, 1, 6], [3, 5, 1, 6], [3, 5, 1, 6]])  # [B, k+1]
    target_probs = torch.nn.functional.one_hot(argmaxes, vocab).float()
    draft_tokens = torch.tensor([[3, 5, 1], [3, 4, 1], [0, 5, 1]])
    tokens, num_emitted = rejection_sample(target_probs, draft_tokens, greedy=True)
    assert tokens.tolist() == [[3, 5, 1, 6], [3, 5, -1, -1], [3, -1, -1, -1]]
    assert num_emitted.tolist() == [4, 2, 1]


def test_greedy_rows_ignore_draft_probs_and_mix_with_sampled_rows():
    generator = torch.Generator().manual_seed(0)
    vocab, k = 16, 3
    p = torch.stack([_random_dist(generator, vocab) for _ in range(2 * (k + 1))]).view(2, k + 1, vocab)
    q = torch.stack([_random_dist(generator, vocab) for _ in range(2 * k)]).view(2, k, vocab)
    drafts = p[:, :k].argmax(-1)
    greedy = torch.tensor([True, False])
    tokens, num_emitted = rejection_sample(p, drafts, q, greedy=greedy, generators=None)
    assert num_emitted[0] == k + 1 and tokens[0].tolist() == p[0].argmax(-1).tolist()


def test_lossless_per_position_histograms_and_acceptance():
    """Context-free target p_i and drafter q_i (non-one-hot, q ≠ p): the token emitted at position i must be
    distributed as p_{i+1}, with an absolute TV bound and a χ² test; acceptance of draft i ≈ Σ min(p_i, q_i)."""
    vocab, k, num_trials = 16, 3, 200_000
    generator = torch.Generator().manual_seed(7)
    p = torch.stack([_random_dist(generator, vocab, 1.0) for _ in range(k + 1)])  # [k+1, V]
    q = torch.stack([_random_dist(generator, vocab, 1.0) for _ in range(k)])  # [k, V]
    q[1] = 0.5 * q[1] + 0.5 * p[1]  # one easier position
    torch.manual_seed(11)
    draft_tokens = torch.stack([torch.multinomial(q[i], num_trials, replacement=True) for i in range(k)], dim=1)
    tokens, num_emitted = rejection_sample(
        p.expand(num_trials, -1, -1), draft_tokens, q.expand(num_trials, -1, -1), greedy=False
    )
    for position in range(k + 1):
        reached = num_emitted > position
        n = int(reached.sum())
        counts = torch.bincount(tokens[reached, position], minlength=vocab).double()
        empirical = counts / n
        tv = 0.5 * (empirical - p[position].double()).abs().sum().item()
        assert tv <= 4 * math.sqrt(vocab / n), (position, tv, n)
        expected = p[position].double() * n
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 <= _chi2_critical(vocab - 1), (position, chi2)
        # The raw drafts are far from p: the same bound would catch an "accept everything" verifier.
        if position < k:
            draft_tv = 0.5 * (q[position] - p[position]).abs().sum().item()
            assert draft_tv > 10 * math.sqrt(vocab / n)
    reached = torch.ones(num_trials, dtype=torch.bool)
    for i in range(k):
        accepted = num_emitted > i + 1
        rate = (accepted & reached).sum().item() / reached.sum().item()
        expected_rate = torch.minimum(p[i], q[i]).sum().item()
        sigma = math.sqrt(expected_rate * (1 - expected_rate) / reached.sum().item())
        assert abs(rate - expected_rate) <= 5 * sigma, (i, rate, expected_rate)
        reached = accepted


def test_all_accepted_gives_bonus_from_last_position():
    vocab, k = 16, 2
    p = torch.zeros(1, k + 1, vocab)
    p[0, 0, 3] = p[0, 1, 4] = 1.0
    p[0, 2, 9] = 1.0
    q = torch.zeros(1, k, vocab)
    q[0, 0, 3] = q[0, 1, 4] = 1.0
    tokens, num_emitted = rejection_sample(p, torch.tensor([[3, 4]]), q, greedy=False)
    assert tokens.tolist() == [[3, 4, 9]] and num_emitted.tolist() == [3]


def test_zero_probability_draft_is_always_rejected_and_recovered_token_in_support():
    vocab = 16
    p = torch.zeros(64, 2, vocab)
    p[:, :, :4] = 0.25
    q = torch.full((64, 1, vocab), 1.0 / vocab)
    tokens, num_emitted = rejection_sample(p, torch.full((64, 1), 10), q, greedy=False)
    assert (num_emitted == 1).all()
    assert (tokens[:, 0] < 4).all() and (tokens[:, 1] == -1).all()


def test_per_row_generators_make_rows_independent_of_the_batch():
    generator = torch.Generator().manual_seed(3)
    vocab, k, batch = 16, 3, 6
    p = torch.stack([_random_dist(generator, vocab) for _ in range(batch * (k + 1))]).view(batch, k + 1, vocab)
    q = torch.stack([_random_dist(generator, vocab) for _ in range(batch * k)]).view(batch, k, vocab)
    drafts = torch.randint(0, vocab, (batch, k), generator=generator)
    seeds = [100 + row for row in range(batch)]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    tokens, num_emitted = rejection_sample(p, drafts, q, greedy=False, generators=gens)
    for row in range(batch):
        alone, alone_n = rejection_sample(
            p[row : row + 1], drafts[row : row + 1], q[row : row + 1], greedy=False,
            generators=[torch.Generator().manual_seed(seeds[row])],
        )
        assert torch.equal(alone[0], tokens[row]) and alone_n[0] == num_emitted[row]
    again, _ = rejection_sample(p, drafts, q, greedy=False,
                                generators=[torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(again, tokens)


def test_seeded_rows_follow_the_documented_draw_order():
    """A golden stream: each seeded row draws k float64 uniforms, then V float32 Exp(1) variables, from its
    generator, and nothing else. The expected tokens are computed here from that order on a clone of each
    generator (accept draft i while u_i·q_i(x_i) < p_i(x_i); the final token is argmax residual / noise,
    residual = max(p − q, 0) at the first rejection or p_{k+1} after k acceptances), so a change of the
    order, of the amount drawn or of the rule changes a seeded request's tokens and fails here."""
    generator = torch.Generator().manual_seed(9)
    vocab, k, batch = 16, 3, 12
    p = torch.stack([_random_dist(generator, vocab) for _ in range(batch * (k + 1))]).view(batch, k + 1, vocab)
    q = torch.stack([_random_dist(generator, vocab) for _ in range(batch * k)]).view(batch, k, vocab)
    q[: batch // 2] = 0.2 * q[: batch // 2] + 0.8 * p[: batch // 2, :k]  # rows that accept long runs
    drafts = torch.stack([torch.multinomial(q[row], 1, generator=generator)[:, 0] for row in range(batch)])  # [B, k]
    gens = [torch.Generator().manual_seed(200 + row) for row in range(batch)]
    expected_tokens, expected_emitted = [], []
    for row, g in enumerate(gens):
        clone = torch.Generator()
        clone.set_state(g.get_state())
        uniforms = torch.rand(k, dtype=torch.float64, generator=clone)
        noise = torch.empty(vocab).exponential_(generator=clone)
        num_accepted = 0
        while num_accepted < k:
            x = int(drafts[row, num_accepted])
            if not uniforms[num_accepted] * float(q[row, num_accepted, x]) < float(p[row, num_accepted, x]):
                break
            num_accepted += 1
        if num_accepted < k:
            residual = (p[row, num_accepted] - q[row, num_accepted]).clamp(min=0.0)
        else:
            residual = p[row, k]
        final = int((residual / noise).argmax())
        expected_tokens.append(drafts[row, :num_accepted].tolist() + [final] + [-1] * (k - num_accepted))
        expected_emitted.append(num_accepted + 1)
    assert len(set(expected_emitted)) >= 3  # rejections at several positions and full acceptances
    tokens, num_emitted = rejection_sample(p, drafts, q, greedy=False, generators=gens)
    assert tokens.tolist() == expected_tokens
    assert num_emitted.tolist() == expected_emitted
    for row, g in enumerate(gens):  # exactly k uniforms and V Exp(1) variables were drawn
        clone = torch.Generator().manual_seed(200 + row)
        torch.rand(k, dtype=torch.float64, generator=clone)
        torch.empty(vocab).exponential_(generator=clone)
        assert torch.equal(g.get_state(), clone.get_state()), row


def test_inputs_are_not_mutated():
    generator = torch.Generator().manual_seed(5)
    p = torch.stack([_random_dist(generator, 8) for _ in range(3)])[None]
    q = torch.stack([_random_dist(generator, 8) for _ in range(2)])[None]
    drafts = torch.tensor([[1, 2]])
    copies = (p.clone(), q.clone(), drafts.clone())
    rejection_sample(p, drafts, q, greedy=False)
    assert torch.equal(p, copies[0]) and torch.equal(q, copies[1]) and torch.equal(drafts, copies[2])


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda p, d, q: (p * 2, d, q), "target_probs"),
        (lambda p, d, q: (p, d, q * 0.5), "draft_probs"),
        (lambda p, d, q: (p, d, None), "draft_probs"),
        (lambda p, d, q: (p, d[:, :1], q), "draft_tokens"),
        (lambda p, d, q: (p, d + 100, q), "draft_tokens"),
        (lambda p, d, q: (p, d, q[:, :1]), "draft_probs"),
        (lambda p, d, q: (p[:, :1], d[:, :0], q[:, :0]), "target_probs"),
        (lambda p, d, q: (p[0], d, q), "target_probs"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(change, match):
    generator = torch.Generator().manual_seed(5)
    p = torch.stack([_random_dist(generator, 8) for _ in range(3)])[None]
    q = torch.stack([_random_dist(generator, 8) for _ in range(2)])[None]
    args = change(p, torch.tensor([[1, 2]]), q)
    with pytest.raises(ValueError, match=match):
        rejection_sample(*args, greedy=False)


def test_bad_greedy_and_generators_raise():
    p = torch.full((2, 2, 4), 0.25)
    q = torch.full((2, 1, 4), 0.25)
    d = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="greedy"):
        rejection_sample(p, d, q, greedy=torch.tensor([True]))
    with pytest.raises(ValueError, match="generators"):
        rejection_sample(p, d, q, greedy=False, generators=[torch.Generator()])


def test_check_values_false_skips_only_the_value_checks():
    generator = torch.Generator().manual_seed(6)
    p = torch.stack([_random_dist(generator, 8) for _ in range(3)])[None]
    q = torch.stack([_random_dist(generator, 8) for _ in range(2)])[None]
    drafts = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p * 2, drafts, q, greedy=False)
    rejection_sample(p * 2, drafts, q, greedy=False, check_values=False)  # the loops' own valid inputs: not read
    with pytest.raises(ValueError, match="draft_tokens"):  # shapes are still checked
        rejection_sample(p, drafts[:, :1], q, greedy=False, check_values=False)


class _OutOfVocabDrafts:
    """A foreign Proposer whose drafts are past the vocabulary."""

    def reset(self):
        pass

    def propose(self, block, num_draft_tokens, sampling, generators):
        vocab = TINY_LM_VOCAB_SIZE
        batch_size = block.input_ids.shape[0]
        tokens = torch.full((batch_size, num_draft_tokens), vocab + 5)
        return tokens, torch.full((batch_size, num_draft_tokens, vocab), 1.0 / vocab)


def test_a_foreign_proposers_bad_drafts_are_a_value_error():
    """A Proposer's out-of-vocabulary drafts are a ValueError naming it, not an index error in the verify
    forward (our own MTP drafts are not checked: they are argmaxes or draws over the vocabulary)."""
    target = tiny_lm("glm4_moe", seed=0)
    prompt = torch.arange(3, 9)[None]
    for sampling in (None, SamplingParams(temperature=1.0)):
        with pytest.raises(ValueError, match="proposer: draft_tokens"):
            speculative_generate(target, _OutOfVocabDrafts(), prompt, max_new_tokens=4, num_draft_tokens=2,
                                 sampling=sampling, seed=0)
