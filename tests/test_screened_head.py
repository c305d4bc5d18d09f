"""The screened head (`omnimtp.runtime.screened_head`): a greedy step's token is the int8 head's argmax, ties to the
lowest id, from an int4 screen of the vocabulary and the candidates' exact int8 scores; Qwen3-ASR's quantized greedy
transcripts take their tokens from it and equal those of the full int8 head; steps that need logits do not use it."""

from __future__ import annotations

import pytest
import torch

from omnimtp.runtime.kernels import small_batch_linear
from omnimtp.runtime.ops import linear, quantize_weight
from omnimtp.runtime.screened_head import ScreenedHead

pytestmark = pytest.mark.skipif(not small_batch_linear.available(), reason="omnimtp's CPU kernel does not build here")


def _rows(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows as a final RMSNorm leaves them."""
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.rms_norm(torch.randn(num_rows, width, generator=generator), (width,))


def _int8_argmax(head: ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    return linear(x, None, packed=head.exact).argmax(dim=-1)


def test_greedy_is_the_int8_heads_argmax_on_flat_random_logits():
    """Random weights give flat logits (the int4 error is ~12 % of their spread): every row's token, alone and in a
    batch, is still the int8 head's."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40_000, 512, generator=generator) * 0.02
    head = ScreenedHead.from_weight(weight)
    x = _rows(256, 512, 1)
    expected = _int8_argmax(head, x)
    assert torch.equal(torch.cat([head.greedy(x[i : i + 1]) for i in range(len(x))]), expected)
    assert torch.equal(head.greedy(x[:7]), expected[:7])
    # the int4 screen alone picks another token for some of these rows: the exact rescoring is what makes them equal
    assert not torch.equal(linear(x, None, packed=head.screen).argmax(dim=-1), expected)


def test_candidates_are_scored_with_the_int8_heads_bits_and_ties_go_to_the_lowest_id():
    """With every row a candidate the token is the int8 argmax for any input, ties included: rows duplicated in the
    head score the same bits, and the lowest id wins, as the full argmax's."""
    generator = torch.Generator().manual_seed(2)
    base = torch.randn(300, 64, generator=generator) * 0.02
    weight = torch.cat([base, base[:37]])  # ids 300.. repeat ids 0..36
    x = _rows(64, 64, 3)
    head = ScreenedHead.from_weight(weight, candidates=weight.shape[0])
    expected = _int8_argmax(head, x)
    assert torch.equal(head.greedy(x), expected)
    tied = x[None, 0] @ weight[:37].T  # a row that favours one of the duplicated ids
    favoured = base[int(tied.argmax())]
    y = torch.nn.functional.rms_norm(favoured[None] * 50, (64,))
    assert int(head.greedy(y)) == int(_int8_argmax(head, y)) < 37


def test_the_exact_form_may_be_shared_and_bad_arguments_are_named():
    weight = torch.randn(100, 64) * 0.02
    exact = quantize_weight(weight, "int8")
    head = ScreenedHead.from_weight(weight, exact=exact)
    assert head.exact is exact
    for bad in (0, 101, 2.5, True):
        with pytest.raises(ValueError, match="candidates"):
            ScreenedHead.from_weight(weight, candidates=bad)
    assert ScreenedHead.from_weight(weight[:10]).candidates == 10  # a vocabulary under the default: every row
    with pytest.raises(ValueError, match="exact"):
        ScreenedHead.from_weight(weight, exact=quantize_weight(weight, "int4"))
    with pytest.raises(ValueError, match="exact"):
        ScreenedHead.from_weight(weight[:50], exact=exact)


@pytest.fixture(scope="module")
def family():
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily

    return Qwen3ASRFamily.tiny(0)


def test_quantized_asr_greedy_steps_take_the_screened_heads_tokens(family, monkeypatch):
    """Qwen3-ASR quantized holds a screened head; its greedy transcripts equal those of the same decoder with the
    full int8 head, and every decode step of them took its tokens from the screen."""
    from dataclasses import replace

    from omnimtp.engine.request import Request
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from tests.asr_checks import run_requests, speechlike

    quantized = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8")
    assert quantized.thinker_decoder.screened_lm_head is not None
    inputs = [family.transcription_inputs(samples, None, "") for samples in (speechlike(1.2, 8), speechlike(2.0, 9))]

    def requests():
        return [Request(i, ids, max_new_tokens=8, max_frames=1, speaker=None, media=media)
                for i, (ids, media) in enumerate(inputs)]

    calls = []
    greedy = ScreenedHead.greedy
    monkeypatch.setattr(ScreenedHead, "greedy", lambda self, x: calls.append(len(x)) or greedy(self, x))
    screened = run_requests(quantized, requests())
    assert calls  # the steps after the prefill took their tokens from the screen
    full_head = replace(quantized.thinker_decoder, screened_lm_head=None)
    monkeypatch.setattr(quantized, "thinker_decoder", full_head)
    calls.clear()
    assert run_requests(quantized, requests()) == screened
    assert not calls


def test_steps_that_need_logits_do_not_use_the_screen(family, monkeypatch):
    """A step with a request asking for log-probabilities, or sampling, needs the logits: it runs the int8 head
    (a greedy request beside it too)."""
    from omnimtp.engine.request import Request
    from omnimtp.families.qwen3_asr import Qwen3ASRFamily
    from omnimtp.sampling import SamplingParams
    from tests.asr_checks import run_requests, speechlike

    quantized = Qwen3ASRFamily(family.model, family.tokenizer, quantize="w4a8")
    ids, media = family.transcription_inputs(speechlike(1.2, 8), None, "")
    calls = []
    greedy = ScreenedHead.greedy
    monkeypatch.setattr(ScreenedHead, "greedy", lambda self, x: calls.append(len(x)) or greedy(self, x))
    for options in ({"logprobs": 2}, {"thinker_sampling": SamplingParams(temperature=1.0), "seed": 3}):
        requests = [Request(0, ids, max_new_tokens=6, max_frames=1, speaker=None, media=media, **options),
                    Request(1, ids, max_new_tokens=6, max_frames=1, speaker=None, media=media)]
        assert all(run_requests(quantized, requests))
        assert not calls
