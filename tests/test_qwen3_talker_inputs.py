"""Qwen3-Omni talker inputs against what transformers' own `generate` passes to `talker.generate`.

The reference inputs are captured by wrapping `model.talker.generate` on the instance (it records its
arguments and aborts, so no audio is generated) and `model.thinker.generate` (to record the thinker rows
the reference produced). Everything is compared with `torch.equal` (bit-identical)."""

import pytest
import torch

from omnimtp.handoff import ThinkerToTalkerStream, assemble_talker_chunks, trim_thinker_hidden
from omnimtp.models.tiny import THINKER_SPECIAL_TOKENS as S
from omnimtp.models.tiny import tiny_qwen3_omni
from omnimtp.talker.qwen3_inputs import Qwen3TalkerInputBuilder, build_qwen3_talker_inputs

MAX_NEW = 10
NEVER_EMITTED = 319


def chat_prompt(system: bytes, user: bytes) -> list[int]:
    return (
        [S["<|im_start|>"], S["system"], 10, *system, S["<|im_end|>"], 10]
        + [S["<|im_start|>"], S["user"], 10, *user, S["<|im_end|>"], 10]
        + [S["<|im_start|>"], S["assistant"], 10]
    )


# greedy replies of tiny_qwen3_omni(0) (checked in test_reference_replies):
# [135, 135, 223, 223, 223, 223, 299, 223, 299, 223] / [130, 98, 164, 164, ...] /
# [74, 80, 51, 158, 283, 135, 135, 217, 164, 164]
PROMPTS = [
    chat_prompt(b"be brief", b"hello"),
    chat_prompt(b"s", b"tell me a story please"),
    chat_prompt(b"you are a helpful voice", b"hi"),
]


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_omni(0)


def reference_run(model, prompt, eos, speaker="Ethan", max_new=MAX_NEW, **generate_kwargs):
    """Run transformers' generate; return (thinker result, talker.generate kwargs)."""
    captured = {}
    thinker_generate = model.thinker.generate

    def record_thinker(*args, **kwargs):
        captured["thinker"] = thinker_generate(*args, **kwargs)
        return captured["thinker"]

    def record_talker(**kwargs):
        captured["talker"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
        raise _Captured

    model.thinker.generate = record_thinker
    model.talker.generate = record_talker
    try:
        with pytest.raises(_Captured):
            model.generate(
                torch.tensor([prompt]), speaker=speaker, thinker_max_new_tokens=max_new, thinker_eos_token_id=eos,
                thinker_do_sample=False, talker_max_new_tokens=3, **generate_kwargs,
            )
    finally:
        del model.thinker.generate
        del model.talker.generate
    return captured["thinker"], captured["talker"]


def thinker_rows(model, result, row=0):
    layer = model.config.talker_config.accept_hidden_layer
    embeds = torch.cat([step[0][row] for step in result.hidden_states], dim=0)  # [R, D]
    hidden = torch.cat([step[layer][row] for step in result.hidden_states], dim=0)
    return embeds, hidden


def assert_matches_reference(ours, talker_kwargs):
    assert torch.equal(ours.prefill_embeds, talker_kwargs["inputs_embeds"][0])
    assert torch.equal(ours.prefill_ids, talker_kwargs["talker_input_ids"][0])
    assert torch.equal(ours.trailing_text, talker_kwargs["trailing_text_hidden"][0])
    assert torch.equal(ours.tts_pad_embed, talker_kwargs["tts_pad_embed"][0, 0])
    assert bool(talker_kwargs["attention_mask"].all())


def assert_stream_equals(model, prompt, output_ids, embeds, hidden, finish, speaker="Ethan"):
    """Stream the rows as transformers' thinker makes them (row P+k arrives with token k+1)."""
    full = build_qwen3_talker_inputs(model, prompt, output_ids, embeds, hidden, finish, speaker, projection="per_row")
    stream = ThinkerToTalkerStream(Qwen3TalkerInputBuilder(model, prompt, speaker))
    num_prompt = len(prompt)
    chunks = stream.push(embeds[:num_prompt], hidden[:num_prompt], output_ids[:1])
    for k in range(1, len(output_ids)):
        row = slice(num_prompt + k - 1, num_prompt + k)
        chunks += stream.push(embeds[row], hidden[row], output_ids[k : k + 1])
    chunks += stream.finish(finish)
    streamed = assemble_talker_chunks(chunks)
    for name in ("prefill_embeds", "prefill_ids", "trailing_text", "tts_pad_embed"):
        assert torch.equal(getattr(streamed, name), getattr(full, name)), name
    # per-row numerics differ from the reference's one-call projection only in float rounding
    reference = build_qwen3_talker_inputs(model, prompt, output_ids, embeds, hidden, finish, speaker)
    assert torch.equal(full.prefill_ids, reference.prefill_ids)
    torch.testing.assert_close(full.prefill_embeds, reference.prefill_embeds, rtol=0, atol=1e-5)
    torch.testing.assert_close(full.trailing_text, reference.trailing_text, rtol=0, atol=1e-5)
    return chunks


def test_reference_replies(model):
    expected = [135, 135, 223], [130, 98, 164], [74, 80, 51]
    for prompt, head in zip(PROMPTS, expected, strict=True):
        out = model.thinker.generate(input_ids=torch.tensor([prompt]), max_new_tokens=3, do_sample=False,
                                     eos_token_id=None)
        assert out[0, len(prompt):].tolist() == list(head)


@pytest.mark.parametrize(
    "prompt_index, eos, finish, num_output",
    [
        (0, NEVER_EMITTED, "length", MAX_NEW),
        (0, 299, "stop", 7),
        (1, 98, "stop", 2),  # shortest reply the reference accepts: trailing text is just tts_eos
        (2, 164, "stop", 9),
    ],
)
def test_single_request_bit_identical_to_reference(model, prompt_index, eos, finish, num_output):
    prompt = PROMPTS[prompt_index]
    result, talker_kwargs = reference_run(model, prompt, eos)
    output_ids = result.sequences[0, len(prompt):].tolist()
    assert len(output_ids) == num_output and (output_ids[-1] == eos) == (finish == "stop")
    embeds, hidden = thinker_rows(model, result)
    assert embeds.shape[0] == len(prompt) + num_output - 1  # the reference never forwards its last token
    embeds_before, hidden_before, output_before = embeds.clone(), hidden.clone(), list(output_ids)

    ours = build_qwen3_talker_inputs(model, prompt, output_ids, embeds, hidden, finish, "Ethan")
    assert_matches_reference(ours, talker_kwargs)
    # user turn: "<|im_start|>user\n" + text + "<|im_end|>\n" (10 ids for b"hello"), then 9 tts_pad ids
    user_len = 3 + len(b"hello" if prompt_index == 0 else prompt) + 2
    if prompt_index == 0:
        assert ours.prefill_ids.tolist()[:user_len] == prompt[prompt.index(S["user"]) - 1 :][:user_len]
    assert ours.prefill_ids.tolist()[-9:] == [S["<|tts_pad|>"]] * 9
    assert ours.trailing_text.shape[0] == num_output - 1  # g1 .. g_{N-2}, tts_eos
    assert torch.equal(embeds, embeds_before) and torch.equal(hidden, hidden_before) and output_ids == output_before

    assert_stream_equals(model, prompt, output_ids, embeds, hidden, finish)


def test_stop_row_is_never_spoken_when_it_was_forwarded(model):
    """An engine that also forwards the stop token hands over one row more; the trim removes it."""
    prompt = PROMPTS[0]
    result, talker_kwargs = reference_run(model, prompt, 299)
    output_ids = result.sequences[0, len(prompt):].tolist()
    embeds, hidden = thinker_rows(model, result)
    # the stop token's own row, as a forward of it would produce (layer 0 = its input embedding)
    stop_embed = model.thinker.get_input_embeddings()(torch.tensor([299]))
    with_stop_embeds = torch.cat([embeds, stop_embed, torch.randn(2, embeds.shape[1])])
    with_stop_hidden = torch.cat([hidden, torch.randn(3, hidden.shape[1])])
    ours = build_qwen3_talker_inputs(model, prompt, output_ids, with_stop_embeds, with_stop_hidden, "stop", "ethan")
    assert_matches_reference(ours, talker_kwargs)
    # the naive hidden[:-1] keeps the stop row (and an extra) and differs from the reference
    naive = build_qwen3_talker_inputs(
        model, prompt, output_ids, with_stop_embeds[:-1], with_stop_hidden[:-1], "length", "ethan"
    )
    assert naive.trailing_text.shape[0] > ours.trailing_text.shape[0]


def test_speakers_case_insensitive_and_unknown(model):
    prompt = PROMPTS[1]
    result, talker_kwargs = reference_run(model, prompt, 98, speaker="aiden")
    output_ids = result.sequences[0, len(prompt):].tolist()
    embeds, hidden = thinker_rows(model, result)
    assert_matches_reference(
        build_qwen3_talker_inputs(model, prompt, output_ids, embeds, hidden, "stop", "AIDEN"), talker_kwargs
    )
    ethan = build_qwen3_talker_inputs(model, prompt, output_ids, embeds, hidden, "stop", "Ethan")
    assert not torch.equal(ethan.prefill_embeds, talker_kwargs["inputs_embeds"][0])  # the speaker row matters
    with pytest.raises(ValueError, match=r"speaker.*'nobody'.*aiden.*chelsie.*ethan"):
        build_qwen3_talker_inputs(model, prompt, output_ids, embeds, hidden, "stop", "nobody")


def test_ragged_batch_rows_match_their_own_single_reference(model):
    """A left-padded batch of 3 prompts of different lengths; row 1 stops after 3 tokens and keeps being
    forwarded with pad tokens (extra rows, including its stop row), row 2 stops at 9, row 0 hits the length."""
    eos = 164
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    batch = model.thinker.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
        output_hidden_states=True, return_dict_in_generate=True,
    )
    finishes = []
    for row, prompt in enumerate(PROMPTS):
        pad = width - len(prompt)
        generated = batch.sequences[row, width:].tolist()
        output_ids = generated[: generated.index(eos) + 1] if eos in generated else generated
        finish = "stop" if eos in generated else "length"
        finishes.append(finish)
        embeds, hidden = thinker_rows(model, batch, row)
        embeds, hidden = embeds[pad:], hidden[pad:]  # [P + num_steps, D]: the row's own positions

        result, talker_kwargs = reference_run(model, prompt, eos)
        assert result.sequences[0, len(prompt):].tolist() == output_ids
        ours = build_qwen3_talker_inputs(model, prompt, output_ids, embeds, hidden, finish, "Ethan")
        assert_matches_reference(ours, talker_kwargs)

        # the stream, fed the batch's rows (extra rows after the stop included, no tokens after it)
        full = build_qwen3_talker_inputs(
            model, prompt, output_ids, embeds, hidden, finish, "Ethan", projection="per_row"
        )
        stream = ThinkerToTalkerStream(Qwen3TalkerInputBuilder(model, prompt, "Ethan"))
        num_prompt = len(prompt)
        chunks = stream.push(embeds[:num_prompt], hidden[:num_prompt], output_ids[:1])
        for k in range(1, embeds.shape[0] - num_prompt + 1):
            row_slice = slice(num_prompt + k - 1, num_prompt + k)
            chunks += stream.push(embeds[row_slice], hidden[row_slice], output_ids[k : k + 1])
        chunks += stream.finish(finish)
        streamed = assemble_talker_chunks(chunks)
        assert torch.equal(streamed.prefill_embeds, full.prefill_embeds)
        assert torch.equal(streamed.trailing_text, full.trailing_text)
    assert finishes == ["length", "stop", "stop"]


def test_stream_releases_chunk0_with_first_generated_row(model):
    prompt = PROMPTS[2]
    result, _ = reference_run(model, prompt, 164)
    output_ids = result.sequences[0, len(prompt):].tolist()
    embeds, hidden = thinker_rows(model, result)
    stream = ThinkerToTalkerStream(Qwen3TalkerInputBuilder(model, prompt, "Ethan"))
    num_prompt = len(prompt)
    assert stream.push(embeds[:num_prompt], hidden[:num_prompt], output_ids[:1]) == []  # g0 has no row yet
    first = stream.push(embeds[num_prompt : num_prompt + 1], hidden[num_prompt : num_prompt + 1], output_ids[1:2])
    assert len(first) == 1 and first[0].index == 0 and first[0].prefill_embeds is not None
    assert first[0].trailing_text.shape[0] == 0
    for k in range(2, len(output_ids)):
        row = slice(num_prompt + k - 1, num_prompt + k)
        (chunk,) = stream.push(embeds[row], hidden[row], output_ids[k : k + 1])
        assert chunk.index == k - 1 and chunk.trailing_text.shape[0] == 1 and not chunk.is_finished
    (last,) = stream.finish("stop")
    assert last.is_finished and last.finish_reason == "stop" and last.trailing_text.shape[0] == 1  # tts_eos


def test_bad_inputs(model):
    prompt = PROMPTS[1]
    result, _ = reference_run(model, prompt, 98)
    output_ids = result.sequences[0, len(prompt):].tolist()
    embeds, hidden = thinker_rows(model, result)
    build = build_qwen3_talker_inputs
    with pytest.raises(ValueError, match="thinker_embeds"):
        build(model, prompt, output_ids, embeds[None], hidden, "stop", "Ethan")
    with pytest.raises(ValueError, match="thinker_hidden"):
        build(model, prompt, output_ids, embeds, hidden[:, :5], "stop", "Ethan")
    with pytest.raises(ValueError, match="thinker_embeds"):
        build(model, prompt, output_ids, embeds[:5], hidden[:5], "stop", "Ethan")
    with pytest.raises(ValueError, match="finish_reason"):
        build(model, prompt, output_ids, embeds, hidden, "abort", "Ethan")
    with pytest.raises(ValueError, match="projection"):
        build(model, prompt, output_ids, embeds, hidden, "stop", "Ethan", projection="fast")
    with pytest.raises(ValueError, match="prompt_ids"):
        build(model, prompt[:-3], output_ids, embeds, hidden, "stop", "Ethan")
    # a reply of just the stop token leaves nothing to speak (the reference crashes on it)
    num_prompt = len(prompt)
    with pytest.raises(ValueError, match="output_ids"):
        build(model, prompt, [98], embeds[:num_prompt], hidden[:num_prompt], "stop", "Ethan")
    stream = ThinkerToTalkerStream(Qwen3TalkerInputBuilder(model, prompt, "Ethan"))
    stream.push(embeds[:num_prompt], hidden[:num_prompt], [98])
    with pytest.raises(ValueError, match="output_ids"):
        stream.finish("stop")


def test_trim_agrees_with_reference_row_counts(model):
    """trim_thinker_hidden on the reference's rows keeps all of them for stop and length runs."""
    for eos, finish in ((299, "stop"), (NEVER_EMITTED, "length")):
        result, _ = reference_run(model, PROMPTS[0], eos)
        output_ids = result.sequences[0, len(PROMPTS[0]):].tolist()
        embeds, _ = thinker_rows(model, result)
        prefill, decode, kept = trim_thinker_hidden(embeds, PROMPTS[0], output_ids, finish)
        assert prefill.shape[0] + decode.shape[0] == embeds.shape[0]
        assert kept == (output_ids[:-1] if finish == "stop" else output_ids)
