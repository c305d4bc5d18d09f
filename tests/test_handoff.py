"""Pure handoff functions: the seed's worked examples, its pitfalls, and properties over random shapes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnimtp.handoff import TalkerInputs, build_talker_prefill, talker_decode_input, trim_thinker_hidden


def numbered_rows(num_rows: int, dim: int = 2) -> torch.Tensor:
    """Row i is filled with i, so a row's origin is readable from its value."""
    return torch.arange(num_rows, dtype=torch.float32).unsqueeze(1).repeat(1, dim)


# --- seed worked examples -------------------------------------------------------------------------

def test_example_1_stop_drops_the_stop_row_and_id():
    hidden = numbered_rows(7)
    prefill, decode, output_ids = trim_thinker_hidden(hidden, [1, 2, 3, 4], [21, 22, 151645], "stop")
    assert torch.equal(prefill, hidden[:4])
    assert torch.equal(decode, hidden[4:6])  # row 6 belongs to the stop token
    assert output_ids == [21, 22]


def test_example_2_length_keeps_every_generated_row():
    hidden = numbered_rows(5)
    prefill, decode, output_ids = trim_thinker_hidden(hidden, [11, 12], [5, 6], "length")
    assert torch.equal(prefill, hidden[:2]) and torch.equal(decode, hidden[2:4])  # row 4 is beyond the target
    assert output_ids == [5, 6]


def test_example_2_fewer_rows_than_prompt_raises():
    with pytest.raises(ValueError, match="hidden"):
        trim_thinker_hidden(numbered_rows(3), [1, 2, 3, 4], [], "length")


def test_shape_trace_extra_captured_row():
    hidden = numbered_rows(8)
    prefill, decode, output_ids = trim_thinker_hidden(hidden, [1, 2, 3], [7, 8, 9, 0], "stop")
    assert prefill.shape == (3, 2) and decode.shape == (3, 2)
    assert decode[:, 0].tolist() == [3, 4, 5]  # rows 6 (stop) and 7 (extra) both cut
    assert output_ids == [7, 8, 9]


def test_example_3_prefill_layout():
    ids, embeds = build_talker_prefill(
        prompt_embeds=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        first_reply=torch.tensor([0.5, 0.5]),
        spk_embed=torch.tensor([10.0, 20.0]),
        codec_pad_embed=torch.tensor([1.0, 1.0]),
        codec_bos_embed=torch.tensor([100.0, 200.0]),
        mask_id=7, pad_id=5, start_id=6,
    )
    assert ids == [7, 7, 5, 6]
    assert torch.equal(embeds, torch.tensor([[1.0, 2.0], [3.0, 4.0], [11.0, 21.0], [100.5, 200.5]]))


def test_example_3_decode_consumes_one_row_then_fallback():
    queue = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    fallback = torch.tensor([-9.0, -9.0])
    steps = [([0.1, 0.2], [1.1, 1.2], 1), ([0.3, 0.4], [2.3, 2.4], 0),
             ([0.5, 0.6], [-8.5, -8.4], 0), ([0.7, 0.8], [-8.3, -8.2], 0)]
    for last_codec, expected, remaining in steps:
        step_input, queue = talker_decode_input(queue, torch.tensor(last_codec), fallback)
        torch.testing.assert_close(step_input, torch.tensor(expected))
        assert queue.shape == (remaining, 2)


# --- seed pitfalls, each caught -------------------------------------------------------------------

def test_pitfall_hidden_minus_one_row_keeps_stop_row_when_extra_rows_exist():
    hidden = numbered_rows(7)  # P = 2, output [a, b, stop]: rows 2, 3 are a, b; row 4 is the stop; 5, 6 extra
    _, decode, _ = trim_thinker_hidden(hidden, [1, 2], [3, 4, 5], "stop")
    assert decode[:, 0].tolist() == [2, 3]  # hidden[:-1] would give rows 2..5, keeping the stop row 4


def test_pitfall_length_keeps_last_real_token():
    hidden = numbered_rows(5)
    _, decode, output_ids = trim_thinker_hidden(hidden, [1, 2], [3, 4, 5], "length")
    assert decode[:, 0].tolist() == [2, 3, 4] and output_ids == [3, 4, 5]


def test_pitfall_stop_with_empty_output_drops_nothing():
    hidden = numbered_rows(3)
    prefill, decode, output_ids = trim_thinker_hidden(hidden, [1, 2, 3], [], "stop")
    assert torch.equal(prefill, hidden) and decode.shape == (0, 2) and output_ids == []


def test_pitfall_check_before_slicing():
    # slicing hidden[:target] silently returns a short tensor; R < P must raise whatever else is wrong
    with pytest.raises(ValueError, match="hidden"):
        trim_thinker_hidden(numbered_rows(1), [1, 2], [3, 4], "stop")
    with pytest.raises(ValueError, match="hidden"):
        trim_thinker_hidden(numbered_rows(1), [1, 2], [3], "not-a-reason")  # R < P is checked first


def test_pitfall_caller_output_ids_untouched_and_new_list_returned():
    output = [3, 4, 5]
    hidden = numbered_rows(6)
    before = hidden.clone()
    _, decode, kept = trim_thinker_hidden(hidden, [1, 2], output, "stop")
    assert output == [3, 4, 5] and kept == [3, 4] and kept is not output
    assert torch.equal(hidden, before)
    kept.append(9)
    assert output == [3, 4, 5]


def test_pitfall_one_d_rows_are_concatenated_as_rows_and_order_is_ids_then_embeds():
    ids, embeds = build_talker_prefill(
        torch.zeros(3, 4), torch.ones(4), torch.ones(4), torch.ones(4), torch.ones(4), 1, 2, 3
    )
    assert isinstance(ids, list) and embeds.shape == (5, 4)
    with pytest.raises(ValueError, match="spk_embed"):
        build_talker_prefill(torch.zeros(3, 4), torch.ones(4), torch.ones(1, 4), torch.ones(4), torch.ones(4), 1, 2, 3)


def test_pitfall_empty_queue_returned_not_none():
    empty = torch.zeros(0, 3)
    step_input, remaining = talker_decode_input(empty, torch.ones(3), torch.full((3,), 2.0))
    assert remaining is empty and remaining.shape == (0, 3)
    assert torch.equal(step_input, torch.full((3,), 3.0))


# --- validation ------------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="hidden"):
        trim_thinker_hidden(torch.zeros(5), [1], [2], "stop")
    with pytest.raises(ValueError, match="finish_reason"):
        trim_thinker_hidden(numbered_rows(4), [1], [2], "abort")
    with pytest.raises(ValueError, match="prompt_embeds"):
        build_talker_prefill(torch.zeros(2), torch.ones(2), torch.ones(2), torch.ones(2), torch.ones(2), 1, 2, 3)
    with pytest.raises(ValueError, match="first_reply"):
        build_talker_prefill(torch.zeros(2, 2), torch.ones(3), torch.ones(2), torch.ones(2), torch.ones(2), 1, 2, 3)
    with pytest.raises(ValueError, match="reply_queue"):
        talker_decode_input(torch.zeros(2), torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="last_codec_embed"):
        talker_decode_input(torch.zeros(2, 2), torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="fallback"):
        talker_decode_input(torch.zeros(2, 2), torch.ones(2), torch.ones(2, 1))
    with pytest.raises(ValueError, match="prefill_ids"):
        TalkerInputs(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), torch.zeros(1, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="trailing_text"):
        TalkerInputs(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), torch.zeros(1, 5), torch.zeros(2))


# --- properties ------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(
    num_prompt=st.integers(0, 6),
    num_output=st.integers(0, 6),
    row_delta=st.integers(-4, 3),
    finish_reason=st.sampled_from(["stop", "length"]),
    dim=st.integers(1, 3),
)
def test_trim_properties(num_prompt, num_output, row_delta, finish_reason, dim):
    prompt_ids = list(range(100, 100 + num_prompt))
    output_ids = list(range(200, 200 + num_output))
    num_rows = max(num_prompt + num_output + row_delta, 0)
    hidden = numbered_rows(num_rows, dim)
    prompt_before, output_before, hidden_before = list(prompt_ids), list(output_ids), hidden.clone()
    if num_rows < num_prompt:
        with pytest.raises(ValueError, match="hidden"):
            trim_thinker_hidden(hidden, prompt_ids, output_ids, finish_reason)
        return
    prefill, decode, kept = trim_thinker_hidden(hidden, prompt_ids, output_ids, finish_reason)
    drop = 1 if finish_reason == "stop" and num_output > 0 else 0
    assert kept == output_ids[: num_output - drop]
    assert torch.equal(prefill, hidden[:num_prompt])
    assert decode.shape[0] == min(len(kept), num_rows - num_prompt)  # == len(kept) when enough rows exist
    assert torch.equal(decode, hidden[num_prompt : num_prompt + decode.shape[0]])
    assert prompt_ids == prompt_before and output_ids == output_before and torch.equal(hidden, hidden_before)


@settings(max_examples=100, deadline=None)
@given(num_rows=st.integers(0, 5), num_steps=st.integers(0, 8), dim=st.integers(1, 3))
def test_decode_consumes_queue_in_order_then_fallback(num_rows, num_steps, dim):
    queue = numbered_rows(num_rows, dim) + 1
    fallback = torch.full((dim,), -1.0)
    for step in range(num_steps):
        step_input, queue = talker_decode_input(queue, torch.zeros(dim), fallback)
        expected = torch.full((dim,), float(step + 1)) if step < num_rows else fallback
        assert torch.equal(step_input, expected)
        assert queue.shape == (max(num_rows - step - 1, 0), dim)
