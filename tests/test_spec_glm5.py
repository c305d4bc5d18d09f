"""GLM-5 (`glm_moe_dsa`, DSA sparse attention): `dsa_layer` equals transformers' layer; greedy speculative decoding
== `generate` with index_topk below and above the sequence length, IndexShare on and off, k = 1..4, batch 1 and a
ragged batch of 3; a one-forward verify would not be; IndexShare reuses draft step 1's selection; rollback drops
the indexer's keys; the MTP head's checkpoint layout (`model.layers.{N}.*`, extra shared copies read past)."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_checkpoints import train_save_load_and_spec
from spec_drafters import RecomputingDraft, RowDroppingRecomputingDraft, ragged_batch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from omnimtp import MTPHead, speculative_generate
from omnimtp.models.tiny_lm import tiny_lm
from omnimtp.mtp.dsa import dsa_layer
from omnimtp.sampling import SamplingParams
from omnimtp.spec_decode.dsa_target import dsa_verify_forward
from omnimtp.spec_decode.hybrid import crop_attention
from omnimtp.spec_decode.proposer import DraftInput, MTPProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [(4, True), (4, False), (64, True), (64, False)]  # (index_topk, index_share_for_mtp_iteration)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"topk{c[0]}-share{c[1]}")
def target(request):
    index_topk, share = request.param
    return tiny_lm("glm_moe_dsa", seed=0, index_topk=index_topk, index_share_for_mtp_iteration=share)


def test_dsa_layer_equals_transformers_layer(target):
    decoder = target.get_decoder()
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = decoder.embed_tokens(ids)
        positions = torch.arange(9)[None].expand(2, -1)
        position_embeddings = decoder.rotary_emb(hidden, positions)
        reference_cache, cache = DynamicCache(config=target.config), DynamicCache(config=target.config)
        mask = create_causal_mask(config=target.config, inputs_embeds=hidden, attention_mask=None,
                                  cache=reference_cache, position_ids=positions, allow_is_causal_skip=False)
        expected, _ = decoder.layers[1](hidden, attention_mask=mask, position_embeddings=position_embeddings,
                                        position_ids=positions, cache=reference_cache)
        allowed = torch.ones(9, 9, dtype=torch.bool).tril()[None].expand(2, -1, -1)
        ours, selected = dsa_layer(decoder.layers[1], hidden, position_embeddings, cache, allowed)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert (selected.sum(-1) == torch.arange(1, 10).clamp(max=target.config.index_topk)).all()
    assert torch.equal(cache.layers[1].indexer_keys, reference_cache.layers[1].indexer_keys)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_identical_to_generate(target, k):
    torch.manual_seed(1)
    head = MTPHead.from_config(target)
    for ids, mask in (ragged_batch(seed=k),
                      (torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(k)), None)):
        reference = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=-1)
        for drafter in (RecomputingDraft(target, corrupt_rate=0.3, seed=k), head):
            out = speculative_generate(target, drafter, ids, mask, max_new_tokens=14, num_draft_tokens=k,
                                       eos_token_id=-1)
            assert torch.equal(out.sequences, reference), (type(drafter).__name__, ids.shape)


def test_a_one_forward_verify_would_not_be_exact():
    """The pitfall the verify avoids: with index_topk below the length, a sequence's one forward gives other
    argmaxes than its own generate (top-k ties at ReLU's exact zeros); `dsa_verify_forward` gives generate's."""
    target = tiny_lm("glm_moe_dsa", seed=0, index_topk=4)
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    sequence = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=-1)
    with torch.no_grad():
        one_forward = target(sequence).logits[0, 5:-1].argmax(-1)
        assert not torch.equal(one_forward, sequence[0, 6:])
        cache = DynamicCache(config=target.config)
        target.get_decoder()(input_ids=sequence[:, :6], cache=cache, use_cache=True)
        block = sequence[:, 6:]
        hidden = dsa_verify_forward(target, block, torch.arange(6, 18)[None], torch.ones(1, 18, dtype=torch.long),
                                    cache, 6)
        assert torch.equal(target.lm_head(hidden)[0, :-1].argmax(-1), sequence[0, 7:])
        # rollback drops the indexer's keys with the latents
        crop_attention(cache, 5)
        for layer in cache.layers:
            assert layer.indexer_keys.shape[1] == layer.keys.shape[-2] == 13


def test_index_share_reuses_the_first_steps_selection(target):
    """With IndexShare the head's steps 2..k attend to step 1's selection (+ the chain's keys): with
    index_topk ≥ the length that is every key, so on and off draft alike; below it they differ after step 1."""
    torch.manual_seed(3)
    head = MTPHead.from_config(target)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    hidden = target.get_decoder()(input_ids=ids).last_hidden_state
    block = DraftInput(input_ids=ids, next_ids=torch.cat([ids[:, 1:], ids[:, :1]], 1), hidden=hidden,
                       position_ids=torch.arange(9)[None].expand(2, -1), kv_mask=torch.ones(2, 9, dtype=torch.long),
                       last_index=torch.tensor([8, 8]))
    sampling = SamplingParams(temperature=1.0)
    probs = {}
    for share in (True, False):
        head.index_share = share
        generators = [torch.Generator().manual_seed(row) for row in range(2)]  # the same drafts unless probs differ
        _, probs[share] = MTPProposer(head).propose(block, 3, sampling, generators)
    head.index_share = target.config.index_share_for_mtp_iteration
    torch.testing.assert_close(probs[True][:, 0], probs[False][:, 0])
    if target.config.index_topk >= 12:
        torch.testing.assert_close(probs[True], probs[False])
    else:
        assert not torch.allclose(probs[True][:, 1:], probs[False][:, 1:])


def test_head_layout_reads_past_shared_copies(target, tmp_path):
    torch.manual_seed(2)
    head = MTPHead.from_config(target)
    assert head.block.self_attn.indexer is not None and hasattr(head.block.mlp, "experts")
    n = target.config.num_hidden_layers
    target.save_pretrained(tmp_path)
    path = head.save_pretrained(tmp_path)
    tensors = load_file(path)
    assert (f"model.layers.{n}.self_attn.indexer.wq_b.weight" in tensors
            and f"model.layers.{n}.eh_proj.weight" in tensors)
    tensors[f"model.layers.{n}.shared_head.head.weight"] = target.lm_head.weight.detach().clone()
    tensors[f"model.layers.{n}.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = MTPHead.from_pretrained(tmp_path, target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(3, 64, (1, 6))
    prev = torch.randn(1, 6, target.config.hidden_size)
    torch.testing.assert_close(loaded(ids, prev).logits, head(ids, prev).logits, rtol=0, atol=0)


@pytest.mark.parametrize("case", [0])
def test_train_mtp_cli_save_load_and_spec_cli(target, tmp_path, capsys, case):
    if target.config.index_topk != 4 or not target.config.index_share_for_mtp_iteration:
        pytest.skip("one GLM-5 case end to end")
    train_save_load_and_spec(target, tmp_path, capsys)


@pytest.mark.parametrize("seed", range(6))
def test_decode_selection_sorts_each_querys_own_array(seed):
    """`decode_selection` against its definition, one top-k per row and query on the array one-token
    decoding sorts (the prompt's slots, then the query's allowed later slots in order), on scores with the
    indexer's many exact ties (ReLU zeros) and ragged holes: rows without holes go through one batched top-k."""
    from omnimtp.mtp.dsa import decode_selection

    g = torch.Generator().manual_seed(seed)
    batch_size, num_tokens, num_prompt_slots, num_slots, index_topk = 6, 4, 9, 30, 7
    scores = torch.relu(torch.randn(batch_size, num_tokens, num_slots, generator=g)).round(decimals=1)
    real = torch.ones(batch_size, num_slots, dtype=torch.bool)
    real[:, :3] = torch.rand(batch_size, 3, generator=g) < 0.5  # left padding
    holes = torch.rand(batch_size, num_slots, generator=g) < 0.15
    holes[: batch_size // 2] = False  # half the rows have no hole
    real[:, num_prompt_slots : num_slots - num_tokens] &= ~holes[:, num_prompt_slots : num_slots - num_tokens]
    query = num_slots - num_tokens + torch.arange(num_tokens)
    allowed = real[:, None, :] & (torch.arange(num_slots)[None, :] <= query[:, None])[None]  # [B, T, S]
    expected = torch.zeros_like(allowed)
    for row in range(batch_size):
        for t in range(num_tokens):
            columns = [s for s in range(num_slots) if s < num_prompt_slots or allowed[row, t, s]]
            values = scores[row, t, columns].masked_fill(~allowed[row, t, columns], float("-inf"))
            for i in values.topk(min(index_topk, len(columns))).indices.tolist():
                expected[row, t, columns[i]] = True
    expected &= allowed
    assert torch.equal(decode_selection(scores, allowed, index_topk, num_prompt_slots), expected)
    assert (scores == 0).sum() > scores.numel() // 3  # ties: the order of the sorted array matters


def test_greedy_auto_with_plain_steps_before_and_after_holes_equals_generate(target):
    """`auto` on a 3-row ragged batch whose rows finish one after another, its costs dear at 3 rows and at 1
    and cheap at 2: plain steps first (no hole yet: `generate`'s own forward), drafts at 2 rows (rejected
    drafts leave holes), plain steps again at 1 row (the selection-exact forward); every row is
    `generate`'s."""
    from omnimtp.spec_decode.adaptive import DraftCosts, DraftCostTable

    dear, cheap = DraftCosts((1.0, 3.0, 5.0, 7.0)), DraftCosts((1.0, 1.1, 1.2, 1.3))
    costs = DraftCostTable(((1, dear), (2, cheap), (4, dear)))
    for seed in range(40):
        ids, mask = ragged_batch(seed=seed, lengths=(9, 6, 8))
        free = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=-1)
        eos = _eos_ending_rows_in_turn(free[:, ids.shape[1] :])
        if eos is not None:
            break
    else:
        raise AssertionError("no EOS ends the rows one after another")
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    drafter = RowDroppingRecomputingDraft(target, corrupt_rate=0.3, seed=3)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=16, num_draft_tokens="auto",
                               draft_costs=costs, eos_token_id=eos)
    assert torch.equal(out.sequences, reference)
    assert out.stats.draft_histogram.get(0, 0) >= 3 and max(out.stats.draft_histogram) >= 2


def _eos_ending_rows_in_turn(free: torch.Tensor) -> int | None:
    """A token of 3 rows' free continuations [3, N] that ends one row at its 3rd-5th token, another at least
    4 tokens later and not before its 9th, and never appears in the third."""
    for token in free.unique().tolist():
        ends = sorted((row == token).nonzero()[0, 0].item() if (row == token).any() else 99 for row in free)
        if 2 <= ends[0] <= 4 and ends[1] >= max(ends[0] + 4, 8) and ends[1] < 12 and ends[2] == 99:
            return token
    return None
