"""`OmniPipeline.from_pretrained` on checkpoints without tokenizer files: the thinker's EOS comes from the
checkpoint's generation_config.json (which loading puts on the top-level model), for both families."""

from __future__ import annotations

import json
import os

import pytest

from omnimtp.models.tiny_qwen2_5_omni import save_tiny_qwen2_5_omni
from omnimtp.pipeline import OmniPipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IM_END = 257  # both tiny tokenizers' <|im_end|>
_TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json",
               "preprocessor_config.json", "special_tokens_map.json")


def _without_text_files(path, eos_token_id) -> None:
    for name in _TEXT_FILES:
        if (path / name).exists():
            (path / name).unlink()
    generation = {} if eos_token_id is None else {"eos_token_id": eos_token_id, "bos_token_id": 256}
    (path / "generation_config.json").write_text(json.dumps(generation))
    assert not any(name.startswith("tokenizer") for name in os.listdir(path))


def test_qwen2_5_without_a_tokenizer_takes_the_eos_of_its_generation_config(tmp_path):
    save_tiny_qwen2_5_omni(tmp_path)
    _without_text_files(tmp_path, [IM_END])
    pipe = OmniPipeline.from_pretrained(tmp_path)
    assert pipe.tokenizer is None and pipe.family.eos_token_ids == {IM_END}
    output = pipe.generate(input_ids=[256, 262, 10, 72, 105, 257, 10, 256, 263, 10], max_new_tokens=3, max_frames=2)
    assert len(output.text_ids) <= 3
    _without_text_files(tmp_path, None)  # nothing names an EOS: still refused, by name
    with pytest.raises(ValueError, match="no thinker EOS id"):
        OmniPipeline.from_pretrained(tmp_path)


def test_qwen3_without_a_tokenizer_loads_with_its_eos(tmp_path):
    OmniPipeline.tiny().save_pretrained(tmp_path)
    _without_text_files(tmp_path, [IM_END])
    pipe = OmniPipeline.from_pretrained(tmp_path)
    assert pipe.tokenizer is None and pipe.family.eos_token_ids == {IM_END}
    assert pipe.model.generation_config.eos_token_id == [IM_END]
