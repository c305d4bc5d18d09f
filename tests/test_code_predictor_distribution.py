"""The code predictor's sampled residual codes, jointly: with two residual codebooks the exact law of
(code 1, code 2) — code 2 drawn given code 1's embedding — is enumerated from transformers' module and the
runner's seeded draws must match it within the sample-size bound. The test computes the laws a wrong
lm_head or codec_embedding index would give, and the point mass that rows sharing one noise draw give,
and checks that each is more than twice the bound away."""

from __future__ import annotations

import pytest
import torch
from distribution_checks import assert_law
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

from omnimtp.models.tiny import tiny_code_predictor_config
from omnimtp.sampling import QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, make_generators, probs_from_logits
from omnimtp.talker.code_predictor import CodePredictorRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_ROWS = 20_000
SAMPLING = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING  # what the talker samples residual codes with


@pytest.fixture(scope="module")
def cp():
    config = tiny_code_predictor_config(num_code_groups=3)  # two residual codes per frame
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(config).eval()


def _frame_inputs(cp) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, cp.config.hidden_size, generator=g) * 0.3
    cb0 = torch.randn(1, cp.config.hidden_size, generator=g) * 0.3
    return hidden, cb0


def _joint_law(cp, hidden, cb0, heads=(0, 1), table: int = 0) -> torch.Tensor:
    """Law of (code 1, code 2) over [V²] (index c1·V + c2) when step j uses lm_head[heads[j]] and code 1
    is embedded with codec_embedding[table] (correct: heads (0, 1), table 0)."""
    vocab = cp.config.vocab_size
    with torch.no_grad():
        prefix = torch.stack([hidden, cb0], dim=1)  # [1, 2, H]
        last = cp.model(inputs_embeds=prefix).last_hidden_state[:, -1]
        p1 = probs_from_logits(cp.lm_head[heads[0]](last), SAMPLING)[0].double()  # [V]
        embedded = cp.model.codec_embedding[table](torch.arange(vocab))[:, None]  # [V, 1, H]
        seq = torch.cat([prefix.expand(vocab, -1, -1), embedded], dim=1)  # [V, 3, H]: one row per code 1
        last = cp.model(inputs_embeds=seq).last_hidden_state[:, -1]
        p2 = probs_from_logits(cp.lm_head[heads[1]](last), SAMPLING).double()  # [V, V]
    return (p1[:, None] * p2).flatten()


def test_seeded_residual_codes_follow_the_exact_joint_law(cp):
    hidden, cb0 = _frame_inputs(cp)
    vocab = cp.config.vocab_size
    exact = _joint_law(cp, hidden, cb0)
    assert int((exact > 0).sum()) > 50, "the test needs a joint law with many outcomes"
    # Rows that share one noise draw emit one outcome, whichever: the closest point mass to the exact law.
    best_point_mass = torch.nn.functional.one_hot(exact.argmax(), exact.numel()).double()
    wrong = {
        "lm_head[j+1]": _joint_law(cp, hidden, cb0, heads=(1, 1)),
        "codec_embedding[j-1]": _joint_law(cp, hidden, cb0, table=1),
        "one noise draw for every row": best_point_mass,
    }
    runner = CodePredictorRunner(cp, NUM_ROWS)
    codes = runner.run(
        hidden.expand(NUM_ROWS, -1), cb0.expand(NUM_ROWS, -1), SAMPLING, make_generators(range(NUM_ROWS))
    ).codes  # [N, 2]
    assert_law(codes[:, 0] * vocab + codes[:, 1], exact, wrong)
