"""The built-in tiny models by name: `from_pretrained`, `--model` and the server take them, each with its caps,
and a saved tiny model keeps its caps."""

from __future__ import annotations

import pytest
import torch

from omnimtp.checkpoint import TINY_MODELS, omni_model_type
from omnimtp.limits import TINY_MAX_FRAMES, TINY_MAX_NEW_TOKENS
from omnimtp.pipeline import OmniPipeline
from omnimtp.server.build import build_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = {"tiny": ("Qwen3OmniFamily", None), "tiny-qwen2.5-omni": ("Qwen2_5OmniFamily", None),
            "tiny-tts": ("Qwen3TTSFamily", "custom_voice"), "tiny-tts-design": ("Qwen3TTSFamily", "voice_design"),
            "tiny-tts-base": ("Qwen3TTSFamily", "base"), "tiny-asr": ("Qwen3ASRFamily", None)}


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_a_tiny_model_by_name_is_its_family_with_the_tiny_caps(name):
    pipe = OmniPipeline.from_pretrained(name)
    assert (type(pipe.family).__name__, getattr(pipe.family, "tts_model_type", None)) == FAMILIES[name]
    assert (pipe.config.max_frames, pipe.config.max_new_tokens) == (TINY_MAX_FRAMES, TINY_MAX_NEW_TOKENS)
    assert omni_model_type(name) == TINY_MODELS[name][0]


def test_a_saved_tiny_model_keeps_its_caps_and_a_bad_name_lists_the_built_in_ones(tmp_path):
    OmniPipeline.from_pretrained("tiny-tts", max_frames=7).save_pretrained(tmp_path)
    loaded = OmniPipeline.from_pretrained(tmp_path)
    assert (loaded.config.max_frames, loaded.config.max_new_tokens) == (7, TINY_MAX_NEW_TOKENS)
    assert OmniPipeline.from_pretrained(tmp_path, max_frames=9).config.max_frames == 9  # an argument wins
    engine = build_engine(str(tmp_path), max_batch_size=1, max_frames=None)
    assert engine.config.max_frames == 7 and engine.model_id == tmp_path.name
    with pytest.raises(ValueError, match="'tiny-ttz' does not exist .nor is it a built-in model: tiny, "):
        omni_model_type("tiny-ttz", "--model")


def test_the_server_serves_a_tiny_model_by_its_name():
    engine = build_engine("tiny-tts-design", max_batch_size=1, max_frames=None)
    assert engine.model_id == "tiny-tts-design" and engine.config.max_frames == TINY_MAX_FRAMES


def test_one_thread_rule_for_a_small_model_unless_told():
    torch.set_num_threads(2)
    OmniPipeline.from_pretrained("tiny-tts")
    assert torch.get_num_threads() == 1  # a small model's ops are too small to split
    OmniPipeline.tiny(torch_threads=2)
    assert torch.get_num_threads() == 2
    build_engine("tiny", max_batch_size=1, max_frames=None)
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="torch_threads must be an integer >= 1, got 0"):
        OmniPipeline.tiny(torch_threads=0)


def test_a_tiny_model_is_built_on_one_thread(monkeypatch):
    """Building a tiny model (its weights drawn, its codec calibrated on random codes, its decoders packed) runs
    on the one thread the rule gives it, not on every core, and leaves the caller's thread count as it was."""
    from omnimtp.families.qwen2_5_omni import Qwen2_5OmniFamily
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily
    from omnimtp.families.qwen3_tts import Qwen3TTSFamily
    from omnimtp.models import qwen3_tts, tiny, tiny_qwen2_5_omni

    seen = []

    def recording(build):
        def wrapped(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return build(*args, **kwargs)
        return wrapped

    for module, name in ((tiny, "tiny_qwen3_omni"), (tiny_qwen2_5_omni, "tiny_qwen2_5_omni"),
                         (qwen3_tts, "tiny_qwen3_tts")):
        monkeypatch.setattr(module, name, recording(getattr(module, name)))
    torch.set_num_threads(2)
    for family in (Qwen3OmniFamily, Qwen2_5OmniFamily, Qwen3TTSFamily):
        family.tiny()
        assert torch.get_num_threads() == 2, family
    assert seen == [1, 1, 1]


def test_a_small_checkpoint_is_packed_on_the_rules_one_thread(monkeypatch):
    """A checkpoint loaded from disk: the rule is applied once its weights are known, before the family packs
    them (the shipped demo Qwen3-Omni, 2.6 M weights)."""
    from omnimtp.families.qwen3_omni import Qwen3OmniFamily

    seen, init = [], Qwen3OmniFamily.__init__

    def recording(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        init(self, *args, **kwargs)

    monkeypatch.setattr(Qwen3OmniFamily, "__init__", recording)
    torch.set_num_threads(2)
    OmniPipeline.demo()
    assert seen == [1] and torch.get_num_threads() == 1


def test_threads_beyond_what_the_model_can_use_warn(caplog):
    from omnimtp.runtime.device import available_cores, too_many_threads

    with caplog.at_level("WARNING", logger="omnimtp.runtime.device"):
        OmniPipeline.tiny(torch_threads=1)
        assert not caplog.records
        OmniPipeline.tiny(torch_threads=2)
    assert torch.get_num_threads() == 2  # done as asked, with the warning
    [record] = caplog.records
    message = record.getMessage()
    assert message.startswith("threads: 2 asked for a small model (") and "slows it down" in message

    assert too_many_threads(available_cores(), 10**9) is None  # a real model on every core: no warning
    assert "this process may run on" in too_many_threads(available_cores() + 1, 10**9)
