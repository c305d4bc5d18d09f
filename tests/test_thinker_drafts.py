"""What the thinker's drafter is given in a speculative run, on the tiny Qwen3-Omni with a seeded random MTP
head: the RoPE positions of every block it reads (an image prompt's continue from its M-RoPE maximum + 1,
as the thinker decodes), and each row's own sampling (a greedy row next to a sampled one). Greedy output
stays lossless whatever the drafter is given, so the equality tests cannot see either."""

from __future__ import annotations

import pytest
import torch
from test_media_input import _user_turn, image_case

from omnimtp.media import MediaInputs
from omnimtp.mtp.head import MTPHead
from omnimtp.pipeline import OmniPipeline
from omnimtp.sampling import SamplingParams
from omnimtp.spec_decode.proposer import MTPProposer
from omnimtp.spec_decode.thinker_spec import ThinkerSpeculation
from omnimtp.thinker import ThinkerRun

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def pipe():
    return OmniPipeline.tiny(seed=0)


@pytest.fixture(scope="module")
def head(pipe):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return MTPHead.from_config(pipe.model.thinker).eval()


class RecordingProposer:
    """The MTP head's proposer, keeping every block it is given (a Proposer; its copies share `blocks`)."""

    def __init__(self, head):
        self.inner = MTPProposer(head)
        self.blocks = []

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, block, num_draft_tokens, sampling, generators):
        self.blocks.append(block)
        return self.inner.propose(block, num_draft_tokens, sampling, generators)


def _run(pipe, prompts, speculation, media=None, sampling=None, generators=None):
    """A ThinkerRun to the end → (the run, each row's output length before each step)."""
    run = ThinkerRun(
        pipe.model.thinker, prompts, accept_hidden_layer=pipe.accept_hidden_layer, eos_token_ids=set(),
        max_new_tokens=MAX_NEW_TOKENS, sampling=sampling, generators=generators, decoder=pipe.thinker_decoder,
        media=media, speculation=speculation,
    )
    lengths = []
    while not run.is_finished:
        lengths.append([len(ids) for ids in run.output_ids])
        run.step()
    return run, lengths


def test_the_drafter_reads_each_block_at_the_thinkers_rope_positions(pipe, head):
    """An image prompt (M-RoPE offset δ < 0) next to a text prompt (δ = 0), k = 2. The prefill block: prompt
    position j at j + δ (δ from transformers' get_rope_index), the M-RoPE ids of each next token; every
    later block: the token at output index m at P + δ + m, step after step (a random head is mostly
    rejected, so rows advance by different amounts)."""
    image_ids, media = image_case()
    prompts = [image_ids, _user_turn([], b"Hi")]
    thinker = pipe.model.thinker
    rope, deltas = [], []
    for ids, grid in ((image_ids, media["image_grid_thw"]), (prompts[1], None)):
        tensor = torch.tensor([ids])
        positions, delta = thinker.get_rope_index(tensor, grid, None, torch.ones_like(tensor), False, None, None)
        rope.append(positions[:, 0])  # [3, P]
        deltas.append(int(delta.reshape(-1)[0]))
    assert deltas[0] < 0 and deltas[1] == 0
    proposer = RecordingProposer(head)
    run, lengths = _run(pipe, prompts, ThinkerSpeculation(proposer, 2), media=[MediaInputs(**media), None])
    blocks = proposer.blocks
    assert len(blocks) == len(lengths) - 1 >= 4  # one block per speculative step

    prefill, width = blocks[0], max(len(p) for p in prompts)
    for b, prompt in enumerate(prompts):
        pad = width - len(prompt)
        assert prefill.position_ids[b, pad:].tolist() == [j + deltas[b] for j in range(len(prompt))]
    assert torch.equal(prefill.next_position_ids[:, 0, :-1], rope[0][:, 1:])  # the image prompt's own M-RoPE ids
    assert prefill.next_position_ids[:, 0, -1].tolist() == [len(prompts[0]) + deltas[0]] * 3  # the first token
    assert prefill.next_position_ids[:, 1, -1].tolist() == [len(prompts[1])] * 3

    num_checked = 0
    for j, block in enumerate(blocks[1:], start=1):
        before = lengths[j]  # the verify that made block j ran in step j + 1 (0-based step j)
        block_width = block.input_ids.shape[1]
        valid = block.kv_mask[:, -block_width:]
        for b, prompt in enumerate(prompts):
            if before[b] >= MAX_NEW_TOKENS:
                continue  # a finished row rides along unread
            first = len(prompt) + deltas[b] + before[b] - 1  # the pending token, output index before[b] - 1
            columns = [c for c in range(block_width) if valid[b, c]]
            assert columns and [int(block.position_ids[b, c]) for c in columns] == [first + c for c in columns], (j, b)
            num_checked += 1
    assert num_checked >= 6


def test_a_sampled_row_next_to_a_greedy_row_drafts_with_its_own_sampling(pipe, head):
    """A greedy row and a seeded sampled row in one speculative run: the sampled row's tokens are its tokens
    alone (its drafts drawn with its own sampling from its own generator), the greedy row's its greedy
    tokens alone."""
    prompts = [_user_turn([], b"Hello there"), _user_turn([], b"Tell me a story")]
    sampled = SamplingParams(temperature=0.9, top_k=20)
    speculation = ThinkerSpeculation(head, 2)

    def generator():
        return torch.Generator().manual_seed(5)

    batch, _ = _run(pipe, prompts, speculation, sampling=[None, sampled], generators=[None, generator()])
    alone, _ = _run(pipe, prompts[1:], speculation, sampling=[sampled], generators=[generator()])
    greedy, _ = _run(pipe, prompts[:1], speculation)
    assert batch.output_ids[1] == alone.output_ids[0]
    assert batch.output_ids[0] == greedy.output_ids[0]
    assert sum(s.num_accepted for s in batch.spec_stats) < sum(s.num_drafted for s in batch.spec_stats)
