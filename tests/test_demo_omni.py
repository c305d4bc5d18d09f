"""The shipped demo Qwen3-Omni (`OmniPipeline.demo()`, `scripts/train_demo_omni.py`): a trained byte-level
thinker with its trained MTP head."""

import pytest
import torch

from omnimtp.pipeline import OmniPipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_shipped_demo_drafts_well_and_decodes_exactly():
    """The demo Qwen3-Omni (trained thinker + trained head, `scripts/train_demo_omni.py`): greedy speculative
    text and frames equal plain decoding's on held-out prompts, with some drafts accepted."""
    from omnimtp.mtp.demo import demo_omni_prompts

    spec = OmniPipeline.demo(num_draft_tokens=3)
    plain_demo = OmniPipeline(spec.model, spec.tokenizer, processor=spec.processor)
    prompts = demo_omni_prompts()[:2]
    kwargs = dict(max_new_tokens=32, max_frames=12)
    for ours, expected in zip(spec.generate(prompts, **kwargs), plain_demo.generate(prompts, **kwargs), strict=True):
        assert ours.text_ids == expected.text_ids and torch.equal(ours.codes, expected.codes)
        assert ours.spec_stats.num_accepted > 0, ours.spec_stats.to_dict()
