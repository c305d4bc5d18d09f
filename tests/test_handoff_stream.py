"""ThinkerToTalkerStream == the full-payload path, for every way rows and tokens can arrive.

A small arithmetic builder keeps the properties fast; the model builders are checked against it in
test_qwen3_talker_inputs.py / test_qwen2_5_talker_inputs.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnimtp.handoff import (
    ThinkerToTalkerStream,
    assemble_talker_chunks,
    talker_inputs_from_rows,
    trim_thinker_hidden,
)


class ArithmeticBuilder:
    """prefill = prompt rows + first reply row * 10; trailing row = embed + 2 * hidden; end row = -1."""

    def __init__(self, num_prompt: int, dim: int = 2):
        self.num_prompt_rows = num_prompt
        self.num_prefill_rows = num_prompt + 1
        self.end_rows = torch.full((1, dim), -1.0)
        self.tts_pad_embed = torch.full((dim,), -2.0)

    def build_prefill(self, embeds, hidden):
        assert embeds.shape[0] == self.num_prefill_rows
        prefill = torch.cat([embeds[:-1], embeds[-1:] * 10], dim=0)
        return prefill, torch.arange(prefill.shape[0])

    def build_trailing(self, embeds, hidden):
        return embeds + 2 * hidden


def full_payload(builder, prompt_ids, output_ids, embeds, hidden, finish):
    embeds_prefill, embeds_decode, _ = trim_thinker_hidden(embeds, prompt_ids, output_ids, finish)
    hidden_prefill, hidden_decode, _ = trim_thinker_hidden(hidden, prompt_ids, output_ids, finish)
    return talker_inputs_from_rows(
        builder, torch.cat([embeds_prefill, embeds_decode]), torch.cat([hidden_prefill, hidden_decode])
    )


@st.composite
def deliveries(draw):
    """A request and an order of arrival: rows and tokens interleaved at random, rows in order, tokens in order,
    and never more rows than P + tokens sampled so far (+ extra rows only after the last token)."""
    num_prompt = draw(st.integers(1, 4))
    num_output = draw(st.integers(1, 7))
    finish = draw(st.sampled_from(["stop", "length"]))
    extra_rows = draw(st.integers(-1, 3))  # -1: the last token never forwarded (transformers)
    num_rows = num_prompt + num_output + extra_rows
    events = []  # ("rows", k) / ("token", 1)
    rows_sent, tokens_sent = 0, 0
    while rows_sent < num_rows or tokens_sent < num_output:
        can_row = rows_sent < num_rows and (rows_sent < num_prompt + tokens_sent or tokens_sent == num_output)
        can_token = tokens_sent < num_output and rows_sent >= num_prompt
        choice = draw(st.sampled_from([c for c, ok in (("rows", can_row), ("token", can_token)) if ok]))
        if choice == "rows":
            limit = num_rows - rows_sent if tokens_sent == num_output else num_prompt + tokens_sent - rows_sent
            count = draw(st.integers(1, limit))
            events.append(("rows", count))
            rows_sent += count
        else:
            events.append(("token", 1))
            tokens_sent += 1
    return num_prompt, num_output, finish, num_rows, events


@settings(max_examples=300, deadline=None)
@given(deliveries())
def test_streamed_equals_full_payload(delivery):
    num_prompt, num_output, finish, num_rows, events = delivery
    embeds = torch.arange(num_rows * 2, dtype=torch.float32).reshape(num_rows, 2)
    hidden = -embeds / 7
    prompt_ids, output_ids = list(range(num_prompt)), list(range(50, 50 + num_output))
    builder = ArithmeticBuilder(num_prompt)
    kept_rows = min(num_rows, num_prompt + num_output - (finish == "stop"))
    if kept_rows < builder.num_prefill_rows:
        with pytest.raises(ValueError, match="output_ids"):
            full_payload(builder, prompt_ids, output_ids, embeds, hidden, finish)
        return
    full = full_payload(builder, prompt_ids, output_ids, embeds, hidden, finish)

    stream = ThinkerToTalkerStream(builder)
    chunks, rows_sent, tokens_sent, released = [], 0, 0, 0
    for kind, count in events:
        if kind == "rows":
            new = stream.push(embeds[rows_sent : rows_sent + count], hidden[rows_sent : rows_sent + count])
            rows_sent += count
        else:
            new = stream.push(embeds[:0], hidden[:0], output_ids[tokens_sent : tokens_sent + 1])
            tokens_sent += 1
        chunks += new
        released += sum(chunk.trailing_text.shape[0] for chunk in new)
        # never released: a row that the stop trim might still remove
        released_rows = (builder.num_prefill_rows if chunks else 0) + released
        assert released_rows <= num_prompt + max(tokens_sent - 1, 0)
    chunks += stream.finish(finish)
    assert [chunk.index for chunk in chunks] == list(range(len(chunks)))
    assert chunks[-1].is_finished and chunks[-1].finish_reason == finish
    assert not any(chunk.is_finished for chunk in chunks[:-1])
    streamed = assemble_talker_chunks(chunks)
    for name in ("prefill_embeds", "prefill_ids", "trailing_text", "tts_pad_embed"):
        assert torch.equal(getattr(streamed, name), getattr(full, name)), name


def test_row_of_newest_token_is_held_until_finish():
    """Rows arriving with their own token (an engine that forwards the stop token): one row of lag."""
    builder = ArithmeticBuilder(num_prompt=2)
    embeds = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    stream = ThinkerToTalkerStream(builder)
    assert stream.push(embeds[:2], embeds[:2]) == []
    assert stream.push(embeds[2:3], embeds[2:3], [7]) == []  # g0's row: held (g0 might be the stop)
    (chunk0,) = stream.push(embeds[3:4], embeds[3:4], [8])  # g1 arrived, so g0 was not the stop
    assert chunk0.index == 0 and chunk0.prefill_embeds.shape == (3, 2) and chunk0.trailing_text.shape == (0, 2)
    (chunk1,) = stream.push(embeds[4:5], embeds[4:5], [9])
    assert chunk1.trailing_text.shape == (1, 2)
    (last,) = stream.finish("stop")  # row 4 belongs to the stop token 9: dropped, only the end row goes out
    assert last.is_finished and torch.equal(last.trailing_text, builder.end_rows)


def test_length_finish_releases_the_held_row():
    builder = ArithmeticBuilder(num_prompt=1)
    embeds = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    stream = ThinkerToTalkerStream(builder)
    stream.push(embeds[:1], embeds[:1])
    stream.push(embeds[1:2], embeds[1:2], [5])
    stream.push(embeds[2:3], embeds[2:3], [6])
    (last,) = stream.finish("length")
    assert last.trailing_text.shape == (2, 2)  # g1's row, then the end row


def test_misuse_raises():
    stream = ThinkerToTalkerStream(ArithmeticBuilder(num_prompt=1))
    with pytest.raises(ValueError, match="embeds"):
        stream.push(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="hidden"):
        stream.push(torch.zeros(2, 2), torch.zeros(1, 2))
    stream.push(torch.zeros(2, 2), torch.zeros(2, 2), [1])
    with pytest.raises(ValueError, match="embeds"):
        stream.push(torch.zeros(1, 3), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="finish_reason"):
        stream.finish("cancelled")
    stream.finish("length")
    with pytest.raises(ValueError, match="finished"):
        stream.push(torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="finished"):
        stream.finish("length")
