"""Qwen2.5-Omni talker inputs against transformers' `Qwen2_5OmniForConditionalGeneration.generate`.

What the reference does (transformers 5.24), and where the layouts differ:
- `generate` passes the talker `inputs_embeds` whose last two prefill rows are the speaker's bos embedding and
  the first reply row WITHOUT the codec pad / bos embeddings; the talker's forward adds them in place, but
  only when it receives an attention mask.
- Whether it does depends on the talker EOS ids. The talker's generate infers a mask (`input_ids != pad`)
  only when codec_pad is not an EOS id: with talker_eos_token_id=[codec_end] its first forward sees the
  seed's intended prefill (both additions: our layout="seed"); with the config's [codec_end, codec_pad] (what
  the real default [8292, 8294] is) no mask is inferred and it sees no codec rows (our layout="generate",
  what the engine runs by default and matches end to end in test_qwen2_5_omni.py).
- Called WITH an all-ones attention mask (what a processor returns for an unpadded prompt), the talker's
  generate drops it, the forward skips both additions, and the prefill differs from the intended one.
- Decode: the reference's reply part is [g1, ..., text_eos, text_pad] and it reuses the last row forever; ours
  is trailing_text = [g1, ..., text_eos] with tts_pad_embed as the fallback: the same sequence of rows.
- The talker EOS defaults to hard-coded ids outside a tiny codec vocab, so we pass `talker_eos_token_id`.
"""

import pytest
import torch

from omnimtp.handoff import ThinkerToTalkerStream, assemble_talker_chunks
from omnimtp.models.tiny_qwen2_5_omni import QWEN2_5_THINKER_SPECIAL_TOKENS as S
from omnimtp.models.tiny_qwen2_5_omni import TINY_QWEN2_5_CODEC, tiny_qwen2_5_omni
from omnimtp.talker.qwen2_5_inputs import Qwen2_5TalkerInputBuilder, build_qwen2_5_talker_inputs

MAX_NEW = 8
NEVER_EMITTED = 319
PROMPT = (
    [S["<|im_start|>"], S["system"], 10, *b"be brief", S["<|im_end|>"], 10]
    + [S["<|im_start|>"], S["user"], 10, *b"hello", S["<|im_end|>"], 10]
    + [S["<|im_start|>"], S["assistant"], 10]
)


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2_5_omni(0)


def reference_run(model, eos, run_talker=False, speaker="Chelsie", talker_eos=(TINY_QWEN2_5_CODEC["eos"],),
                  **generate_kwargs):
    """transformers' generate; returns (thinker result, talker.generate kwargs, first thinker_to_talker_proj input)."""
    captured = {"proj": []}
    thinker_generate, talker_generate = model.thinker.generate, model.talker.generate

    def record_thinker(*args, **kwargs):
        captured["thinker"] = thinker_generate(*args, **kwargs)
        return captured["thinker"]

    def record_talker(**kwargs):
        captured["talker"] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
        if not run_talker:
            raise _Captured
        talker_generate(**kwargs)
        raise _Captured  # skip token2wav

    hook = model.talker.thinker_to_talker_proj.register_forward_pre_hook(
        lambda module, args: captured["proj"].append(args[0].clone())
    )
    model.thinker.generate, model.talker.generate = record_thinker, record_talker
    try:
        with pytest.raises(_Captured):
            model.generate(
                torch.tensor([PROMPT]), speaker=speaker, thinker_max_new_tokens=MAX_NEW, thinker_eos_token_id=eos,
                thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=2,
                talker_eos_token_id=list(talker_eos), **generate_kwargs,
            )
    finally:
        hook.remove()
        del model.thinker.generate, model.talker.generate
    first_forward = captured["proj"][0][0] if captured["proj"] else None
    return captured["thinker"], captured["talker"], first_forward


def thinker_rows(result):
    embeds = torch.cat([step[0][0] for step in result.hidden_states], dim=0)
    hidden = torch.cat([step[-1][0] for step in result.hidden_states], dim=0)
    return embeds, hidden


def reference_stop_token(model):
    out = model.thinker.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=None)
    generated = out[0, len(PROMPT):].tolist()
    index = next(i for i in range(2, len(generated)) if generated[i] not in generated[:i])
    return generated[index], index + 1


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_matches_intended_reference_construction(model, finish):
    eos, stop_len = reference_stop_token(model) if finish == "stop" else (NEVER_EMITTED, MAX_NEW)
    result, talker_kwargs, first_forward = reference_run(model, eos, run_talker=True)
    output_ids = result.sequences[0, len(PROMPT):].tolist()
    assert len(output_ids) == stop_len
    embeds, hidden = thinker_rows(result)
    ours = build_qwen2_5_talker_inputs(model, PROMPT, output_ids, embeds, hidden, finish, "chelsie")

    num_prompt = len(PROMPT)
    assert ours.prefill_ids.tolist() == talker_kwargs["input_ids"][0].tolist()
    assert ours.prefill_ids.tolist() == (
        [TINY_QWEN2_5_CODEC["mask"]] * num_prompt + [TINY_QWEN2_5_CODEC["pad"], TINY_QWEN2_5_CODEC["bos"]]
    )
    passed = talker_kwargs["inputs_embeds"][0]  # as handed to talker.generate: no codec additions yet
    codec = model.talker.get_input_embeddings().weight
    assert torch.equal(ours.prefill_embeds[:num_prompt], passed[:num_prompt])
    assert torch.equal(ours.prefill_embeds[num_prompt], passed[num_prompt] + codec[TINY_QWEN2_5_CODEC["pad"]])
    assert torch.equal(ours.prefill_embeds[num_prompt + 1], passed[num_prompt + 1] + codec[TINY_QWEN2_5_CODEC["bos"]])
    # ...which is exactly what the talker's first forward projects when its generate infers a mask (pad ∉ EOS)
    assert torch.equal(ours.prefill_embeds, first_forward)
    reply = talker_kwargs["thinker_reply_part"][0]  # [g1 .. g_{N-2}, text_eos, text_pad]
    assert torch.equal(ours.trailing_text, reply[:-1]) and torch.equal(ours.tts_pad_embed, reply[-1])
    assert ours.trailing_text.shape[0] == len(output_ids) - 1

    # streamed == full payload (row P+k arrives with token k+1, as the reference's thinker makes them)
    stream = ThinkerToTalkerStream(Qwen2_5TalkerInputBuilder(model, PROMPT, "Chelsie"))
    chunks = stream.push(embeds[:num_prompt], hidden[:num_prompt], output_ids[:1])
    for k in range(1, len(output_ids)):
        rows = slice(num_prompt + k - 1, num_prompt + k)
        chunks += stream.push(embeds[rows], hidden[rows], output_ids[k : k + 1])
    chunks += stream.finish(finish)
    streamed = assemble_talker_chunks(chunks)
    for name in ("prefill_embeds", "prefill_ids", "trailing_text", "tts_pad_embed"):
        assert torch.equal(getattr(streamed, name), getattr(ours, name)), name


def test_generate_layout_is_what_the_talker_sees_with_the_config_eos_ids(model):
    """With talker EOS = the config's codec end and pad ids, the talker's first forward projects the prefill
    without the codec rows: exactly our layout="generate"; layout="seed" adds the two codec embeddings."""
    config_eos = (TINY_QWEN2_5_CODEC["eos"], TINY_QWEN2_5_CODEC["pad"])
    result, _, first_forward = reference_run(model, NEVER_EMITTED, run_talker=True, talker_eos=config_eos)
    output_ids = result.sequences[0, len(PROMPT):].tolist()
    embeds, hidden = thinker_rows(result)
    generate = build_qwen2_5_talker_inputs(model, PROMPT, output_ids, embeds, hidden, "length", "Chelsie", "generate")
    seed = build_qwen2_5_talker_inputs(model, PROMPT, output_ids, embeds, hidden, "length", "Chelsie", "seed")
    assert torch.equal(generate.prefill_embeds, first_forward)
    codec = model.talker.get_input_embeddings().weight
    num_prompt = len(PROMPT)
    assert torch.equal(seed.prefill_embeds[:num_prompt], generate.prefill_embeds[:num_prompt])
    assert torch.equal(seed.prefill_embeds[num_prompt],
                       generate.prefill_embeds[num_prompt] + codec[TINY_QWEN2_5_CODEC["pad"]])
    assert torch.equal(seed.prefill_embeds[-1], generate.prefill_embeds[-1] + codec[TINY_QWEN2_5_CODEC["bos"]])
    for name in ("prefill_ids", "trailing_text", "tts_pad_embed"):
        assert torch.equal(getattr(seed, name), getattr(generate, name)), name
    with pytest.raises(ValueError, match="layout"):
        build_qwen2_5_talker_inputs(model, PROMPT, output_ids, embeds, hidden, "length", "Chelsie", "vllm")


def test_all_ones_mask_trap_reference_skips_codec_rows(model):
    result, _, first_forward = reference_run(
        model, NEVER_EMITTED, run_talker=True, attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long)
    )
    output_ids = result.sequences[0, len(PROMPT):].tolist()
    embeds, hidden = thinker_rows(result)
    ours = build_qwen2_5_talker_inputs(model, PROMPT, output_ids, embeds, hidden, "length", "Chelsie")
    num_prompt = len(PROMPT)
    assert torch.equal(ours.prefill_embeds[:num_prompt], first_forward[:num_prompt])
    assert not torch.equal(ours.prefill_embeds[num_prompt:], first_forward[num_prompt:])  # the reference's trap


def test_bad_inputs(model):
    result, _, _ = reference_run(model, NEVER_EMITTED)
    output_ids = result.sequences[0, len(PROMPT):].tolist()
    embeds, hidden = thinker_rows(result)
    build = build_qwen2_5_talker_inputs
    with pytest.raises(ValueError, match="speaker.*'Nobody'.*Chelsie.*Ethan"):
        build(model, PROMPT, output_ids, embeds, hidden, "length", "Nobody")
    with pytest.raises(ValueError, match="thinker_hidden"):
        build(model, PROMPT, output_ids, embeds, hidden[:, :3], "length", "Chelsie")
    with pytest.raises(ValueError, match="thinker_embeds"):
        build(model, PROMPT, output_ids, embeds[:3], hidden[:3], "length", "Chelsie")
    with pytest.raises(ValueError, match="finish_reason"):
        build(model, PROMPT, output_ids, embeds, hidden, "eos", "Chelsie")
