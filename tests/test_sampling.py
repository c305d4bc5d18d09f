"""Sampling: SamplingParams validation, filtering as transformers does it, and the code predictor's
sampled codes following the filtered distribution (fixed seed, absolute bound) inside its support."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

from omnimtp.models.tiny import tiny_code_predictor_config
from omnimtp.sampling import (
    MIN_SAMPLED_TEMPERATURE,
    QWEN3_OMNI_CODE_PREDICTOR_SAMPLING,
    SamplingParams,
    filter_logits,
    make_generators,
    probs_from_logits,
    sample,
)
from omnimtp.talker.code_predictor import CodePredictorRunner


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(temperature="1"), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p=None), "top_p"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, MIN_SAMPLED_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(temperature):
    """Dividing float32 logits by 1e-38 overflows them; below the threshold a request is greedy instead."""
    logits = torch.tensor([[3.0, 7.5, 7.0, -1.0], [0.5, -2.0, 9.0, 8.9]])
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy
    assert sample(logits, params, make_generators([0, 1])).tolist() == [1, 2]
    assert not SamplingParams(temperature=MIN_SAMPLED_TEMPERATURE).is_greedy


def test_sampled_probabilities_are_never_nan():
    """Scores that overflow to +inf keep only the infinite entries; an all -inf row falls back to the argmax of
    its raw logits. A finite row beside them keeps exactly its softmax."""
    params = SamplingParams(temperature=1e-4)
    logits = torch.tensor([[1e33, 2e35, 2e35, 0.0], [float("-inf")] * 4, [0.1, 0.4, 0.2, 0.3]])
    probs = probs_from_logits(logits, params)
    assert not torch.isnan(probs).any()
    assert probs[0].tolist() == [0.0, 0.5, 0.5, 0.0]
    assert probs[1].sum() == 1.0
    assert torch.equal(probs[2], (logits[2] / 1e-4).softmax(-1))


def test_qwen3_omni_predictor_sampling_is_top_k_50_top_p_0_8():
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 50, 0.8)
    assert SamplingParams.greedy().is_greedy and not params.is_greedy


@pytest.mark.parametrize(
    "params",
    [QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, SamplingParams(temperature=0.7, top_k=20), SamplingParams(top_p=0.5),
     SamplingParams(temperature=1.3)],
)
def test_filtered_distribution_equals_transformers_warpers(params):
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    expected = warpers(None, logits.clone()).softmax(dim=-1)
    torch.testing.assert_close(probs_from_logits(logits, params), expected, rtol=0, atol=1e-6)


def _make_cp(num_code_groups: int):
    config = tiny_code_predictor_config(num_code_groups=num_code_groups)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cp = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(config)
    return cp.eval()


@pytest.mark.parametrize(
    "params", [QWEN3_OMNI_CODE_PREDICTOR_SAMPLING, SamplingParams(temperature=1.5, top_k=10)], ids=["qwen3_omni", "tts"]
)
def test_first_residual_code_follows_the_filtered_softmax(params):
    """N draws of one frame (one row per draw) against transformers' filtered softmax of lm_head[0]."""
    num_draws = 20_000
    cp = _make_cp(num_code_groups=2)  # one residual code per frame
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, cp.config.hidden_size, generator=g) * 0.3
    cb0 = torch.randn(1, cp.config.hidden_size, generator=g) * 0.3
    with torch.no_grad():
        last = cp.model(inputs_embeds=torch.stack([hidden, cb0], dim=1)).last_hidden_state[:, -1]
        expected = probs_from_logits(cp.lm_head[0](last), params)[0]  # [V]
    support = int((expected > 0).sum())
    assert support >= 3, "the test needs a distribution with several outcomes"
    runner = CodePredictorRunner(cp, num_draws)
    torch.manual_seed(1234)
    codes = runner.run(hidden.expand(num_draws, -1), cb0.expand(num_draws, -1), params).codes[:, 0]
    observed = torch.bincount(codes, minlength=cp.config.vocab_size).float() / num_draws
    assert observed[expected == 0].sum().item() == 0.0
    total_variation = 0.5 * (observed - expected).abs().sum().item()
    assert total_variation <= math.sqrt(support / num_draws), (total_variation, support)


def test_sampled_codes_stay_in_the_top_k_top_p_support_at_every_step():
    """Teacher-force every sampled frame through transformers' predictor: at each step the sampled code
    must have nonzero probability under the filtered distribution given the codes before it."""
    cp = _make_cp(num_code_groups=16)
    params = QWEN3_OMNI_CODE_PREDICTOR_SAMPLING
    batch_size = 64
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(batch_size, cp.config.hidden_size, generator=g)
    cb0 = torch.randn(batch_size, cp.config.hidden_size, generator=g)
    codes = CodePredictorRunner(cp, batch_size).run(hidden, cb0, params, make_generators(range(batch_size))).codes
    with torch.no_grad():
        embeds = [cp.model.codec_embedding[j](codes[:, j]) for j in range(14)]
        seq = torch.stack([hidden, cb0] + embeds, dim=1)  # [B, G, H]
        states = cp.model(inputs_embeds=seq).last_hidden_state
        for j in range(15):
            scores = filter_logits(cp.lm_head[j](states[:, j + 1]), params)  # predicts code j+1
            picked = scores.gather(1, codes[:, j : j + 1])
            assert torch.isfinite(picked).all(), f"step {j}: a code outside the top-k/top-p support"
            kept = torch.isfinite(scores).sum(1)
            assert (kept <= 50).all()
    assert len(set(codes[:, 0].tolist())) > 1  # really sampled, not argmax


def test_row_seeds_is_the_one_seed_rule_of_batched_calls():
    from omnimtp.sampling import row_seeds

    assert row_seeds(None, 3) == [None, None, None]
    assert row_seeds(7, 3) == [7, 8, 9]
    assert row_seeds([1, None], 2) == [1, None]
    for bad in ([1], [1, 2.0], [True, 1], "12", 1.5):
        with pytest.raises(ValueError, match="seed"):
            row_seeds(bad, 2)
