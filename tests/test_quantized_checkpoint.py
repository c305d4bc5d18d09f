"""Quantized checkpoints on disk (`omnimtp quantize`, `omnimtp.quantized_checkpoint`): a pipeline loaded from one
gives the greedy text, codes and audio of quantizing the float checkpoint at load, holds no float copy of what it
quantized, and the converter's memory stays far below the checkpoint's size; refusals name what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import assert_audible
from safetensors import safe_open

from omnimtp import OmniPipeline
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.quantized_checkpoint import (
    CONFIG_KEY,
    load_quantized_model,
    quantize_checkpoint,
    random_quantized_checkpoint,
)
from omnimtp.runtime.kernels import small_batch_linear as sbl

pytestmark = pytest.mark.skipif(not sbl.available(), reason=f"kernel unavailable: {sbl.unavailable_reason()}")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The tiny Qwen3-Omni and Qwen2.5-Omni saved as float checkpoints (tokenizer and processor included)."""
    root = tmp_path_factory.mktemp("src")
    paths = {}
    for family in ("qwen3", "qwen2_5"):
        paths[family] = root / family
        OmniPipeline.tiny(family=family).save_pretrained(paths[family])
    return paths


def _same_output(a: OmniPipeline, b: OmniPipeline, speaker: str) -> None:
    outputs = []
    for pipe in (a, b):
        torch.manual_seed(0)  # Qwen2.5-Omni's token2wav draws its noise from the global RNG
        outputs.append(pipe.generate("Hello", speaker=speaker))
    first, second = outputs
    assert first.text == second.text and first.codes.shape[-1] > 0
    assert torch.equal(first.codes, second.codes)
    assert_audible(first.audio)  # loud enough that a wrong sample shows
    audio = torch.as_tensor(first.audio), torch.as_tensor(second.audio)
    if isinstance(a.family, Qwen3OmniFamily):
        assert torch.equal(*audio)
    else:  # token2wav's streamed chunks follow the engine's pace, and their seams round differently: not bit for bit
        torch.testing.assert_close(*audio, rtol=0, atol=1e-5 * audio[0].abs().max().item())


@pytest.mark.parametrize(("family", "mode"), [("qwen3", "int8"), ("qwen3", "int4"), ("qwen3", "w4a8"),
                                              ("qwen2_5", "w4a8")])
def test_a_quantized_checkpoint_speaks_as_quantizing_at_load(sources, tmp_path, family, mode):
    summary = quantize_checkpoint(sources[family], tmp_path / "q", mode)
    assert summary["mode"] == mode and all(count == 2 for count in summary["decoders"].values())
    loaded = OmniPipeline.from_pretrained(tmp_path / "q")
    assert loaded.family.quantize == mode
    at_load = OmniPipeline.from_pretrained(sources[family], quantize=mode)
    speaker = "ethan" if family == "qwen3" else next(iter(loaded.model.speaker_map))
    _same_output(loaded, at_load, speaker)
    # the float weights the stored matrices replace are placeholders without data
    for prefix in summary["decoders"]:
        layer = loaded.model.get_submodule(prefix).layers[0]
        assert layer.self_attn.q_proj.weight.stride() == (0, 0)
    # tokenizer, processor and caps came along; the weights are as readable as they are
    assert {"tokenizer.json", "processor_config.json", "omnimtp_caps.json"} <= set(os.listdir(tmp_path / "q"))
    mode = (tmp_path / "q" / "tokenizer.json").stat().st_mode & 0o777
    assert all((tmp_path / "q" / name).stat().st_mode & 0o777 == mode for name in summary["files"])
    with pytest.raises(ValueError, match="quantized checkpoint"):
        loaded.save_pretrained(tmp_path / "again")


@pytest.mark.parametrize(("kind", "mode"), [("custom_voice", "int8"), ("custom_voice", "w4a8"), ("base", "int4")])
def test_a_quantized_qwen3_tts_checkpoint_speaks_as_quantizing_at_load(tmp_path, kind, mode):
    source = tmp_path / "src"
    OmniPipeline.tiny(family="qwen3_tts", tts_model_type=kind).save_pretrained(source)
    summary = quantize_checkpoint(source, tmp_path / "q", mode)
    assert summary["decoders"] == {"talker.model": 2, "talker.code_predictor.model": 2}
    loaded = OmniPipeline.from_pretrained(tmp_path / "q")
    at_load = OmniPipeline.from_pretrained(source, quantize=mode)
    assert loaded.family.quantize == at_load.family.quantize == mode
    outputs = []
    for pipe in (loaded, at_load):
        if kind == "base":  # an in-context clone: the speaker encoder's and the speech tokenizer's floats read too
            voice = pipe.create_voice((np.sin(np.arange(24_000) / 9.0).astype(np.float32) * 0.3, 24_000), "Hi")
        else:
            voice = pipe.family.default_speaker
        outputs.append(pipe.speech("Hello there", voice=voice, max_frames=16))
    first, second = outputs
    assert first.codes.shape[-1] > 0 and torch.equal(first.codes, second.codes)
    assert_audible(first.audio)
    assert torch.equal(torch.as_tensor(first.audio), torch.as_tensor(second.audio))
    # the float matrices the stored ones replace are placeholders without data, the code predictor's float heads too
    model = loaded.family.model
    for prefix in summary["decoders"]:
        assert model.get_submodule(prefix).layers[0].mlp.down_proj.weight.stride() == (0, 0)
    assert all(head.weight.stride() == (0, 0) for head in model.talker.code_predictor.lm_head)
    weights = loaded.family.predictor(1).weights
    assert all(head.stride() == (0, 0) for head in weights.lm_heads) and weights.quantized_lm_heads is not None
    assert {"speech_tokenizer", "tokenizer.json"} <= set(os.listdir(tmp_path / "q"))
    other = "int4" if mode != "int4" else "int8"
    with pytest.raises(ValueError, match=f"quantize='{other}'"):
        OmniPipeline.from_pretrained(tmp_path / "q", quantize=other)
    with pytest.raises(ValueError, match="quantized checkpoint"):
        loaded.save_pretrained(tmp_path / "again")


@pytest.mark.parametrize("mode", ["int8", "w4a8"])
def test_a_quantized_qwen3_asr_checkpoint_transcribes_as_quantizing_at_load(tmp_path, mode):
    from omnimtp.families.qwen3_aligner import Qwen3ForcedAligner

    source = tmp_path / "src"
    OmniPipeline.from_pretrained("tiny-asr").save_pretrained(source)
    summary = quantize_checkpoint(source, tmp_path / "q", mode)
    assert summary["decoders"] == {"thinker.model": 2}
    loaded = OmniPipeline.from_pretrained(tmp_path / "q")
    at_load = OmniPipeline.from_pretrained(source, quantize=mode)
    audio = (np.sin(np.arange(16_000) / 7.0) * 0.3).astype(np.float32), 16_000
    first, second = (pipe.transcribe(audio) for pipe in (loaded, at_load))
    assert first.text and first.text == second.text and loaded.family.quantize == mode
    thinker = loaded.family.model.thinker  # the tied head is stored once and tied again
    assert thinker.lm_head.weight is thinker.model.embed_tokens.weight
    assert thinker.model.layers[0].self_attn.q_proj.weight.stride() == (0, 0)
    aligner = Qwen3ForcedAligner.tiny()
    aligner.model.save_pretrained(tmp_path / "aligner")
    with pytest.raises(ValueError, match="src.*ForcedAligner"):
        quantize_checkpoint(tmp_path / "aligner", tmp_path / "aligner-q", mode)


def test_a_random_checkpoint_is_written_straight_in_the_quantized_format(sources, tmp_path):
    """What omni_realsize.py builds the released sizes with: no float model, a checkpoint that loads and speaks."""
    config = json.loads((sources["qwen3"] / "config.json").read_text())
    summary = random_quantized_checkpoint(config, tmp_path / "r", "w4a8", seed=3)
    assert summary["mode"] == "w4a8" and set(summary["decoders"]) == {"thinker.model.language_model", "talker.model"}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "r" / name).write_bytes((sources["qwen3"] / name).read_bytes())
    pipe = OmniPipeline.from_pretrained(tmp_path / "r")
    out = pipe.generate("Hello", max_new_tokens=4, max_frames=6)
    assert len(out.text_ids) == 4 and out.codes.shape[0] == 16 and torch.isfinite(torch.as_tensor(out.audio)).all()
    again = random_quantized_checkpoint(config, tmp_path / "r2", "w4a8", seed=3)  # seeded: the same tensors
    assert again["files"] == summary["files"]
    for name in summary["files"]:
        with safe_open(tmp_path / "r" / name, "pt") as first, safe_open(tmp_path / "r2" / name, "pt") as second:
            assert set(first.keys()) == set(second.keys())
            assert all(torch.equal(first.get_tensor(key), second.get_tensor(key)) for key in first.keys())


def test_a_random_qwen2_5_omni_checkpoint_holds_its_speakers_eos_and_a_float32_token2wav(sources, tmp_path):
    """A Qwen2.5-Omni keeps its speakers in spk_dict.pt and its thinker EOS in generation_config.json (loaded with
    the quantized checkpoint, as transformers loads it with a float one); token2wav computes in float32 only, so
    it is stored in float32 beside the bf16 rest; the talker's codec head scores more ids than token2wav reads,
    and those rows are zeros, so a random talker emits only codes token2wav takes."""
    config = json.loads((sources["qwen2_5"] / "config.json").read_text())
    config["talker_config"]["vocab_size"] = 96  # ids 66.. are past the DiT's 65 + 1 codes
    summary = random_quantized_checkpoint(config, tmp_path / "r", "int8", seed=3)
    assert set(summary["decoders"]) == {"thinker.model.language_model", "talker.model"}
    dtypes = {}
    for name in summary["files"]:
        with safe_open(tmp_path / "r" / name, "pt") as handle:
            dtypes.update({key: handle.get_slice(key).get_dtype() for key in handle.keys()})
    assert {dtype for key, dtype in dtypes.items() if key.startswith("token2wav.")} == {"F32"}
    assert dtypes["thinker.model.language_model.embed_tokens.weight"] == "BF16"
    speakers = torch.load(tmp_path / "r" / "spk_dict.pt", weights_only=True)
    assert set(speakers) == {"Chelsie", "Ethan"}
    pipe = OmniPipeline.from_pretrained(tmp_path / "r")  # no tokenizer: its EOS from generation_config.json
    assert pipe.family.eos_token_ids == {config["thinker_config"]["text_config"]["vocab_size"] - 1}
    out = pipe.generate(input_ids=[256, 262, 10, 72, 105, 257, 10, 256, 263, 10], max_new_tokens=3, max_frames=5,
                        speaker="Ethan")
    assert len(out.text_ids) <= 3 and out.codes.shape == (1, 5) and len(out.audio) == 5 * 480
    assert np.isfinite(out.audio).all() and int(out.codes.max()) < 66
    head = pipe.model.talker.codec_head.weight
    assert not head[66:].any() and head[:66].abs().min() > 0


def test_refusals_name_what_is_wrong(sources, tmp_path):
    dst = tmp_path / "q"
    quantize_checkpoint(sources["qwen3"], dst, "int4")
    with pytest.raises(ValueError, match="quantize='w4a8'.*'int4'"):
        OmniPipeline.from_pretrained(dst, quantize="w4a8")
    OmniPipeline.from_pretrained(dst, quantize="int4")  # its own mode: fine
    with pytest.raises(ValueError, match="dst"):
        quantize_checkpoint(sources["qwen3"], dst, "int4")  # not empty
    with pytest.raises(ValueError, match="src.*already quantized"):
        quantize_checkpoint(dst, tmp_path / "twice", "int8")
    with pytest.raises(ValueError, match="quantize"):
        quantize_checkpoint(sources["qwen3"], tmp_path / "bad", "int3")
    with pytest.raises(ValueError, match="src: 'tiny' is a built-in model"):
        quantize_checkpoint("tiny", tmp_path / "tiny-q", "int8")
    config = json.loads((dst / "config.json").read_text())
    quantized_file = next(name for name in config[CONFIG_KEY]["files"] if name.startswith("quantized-"))
    path = dst / quantized_file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match=quantized_file):
        load_quantized_model(dst)
    path.write_bytes(b"\x07" * len(data))  # foreign bytes of the right size
    with pytest.raises(ValueError, match=quantized_file):
        load_quantized_model(dst)
    path.unlink()
    with pytest.raises(ValueError, match=quantized_file):
        OmniPipeline.from_pretrained(dst)


def test_the_cli_writes_one_that_speak_loads(sources, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-m", "omnimtp.cli", "quantize", str(sources["qwen3"]), str(tmp_path / "q"),
                          "--quantize", "w4a8", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["mode"] == "w4a8" and report["bytes"] > 0
    run = subprocess.run([sys.executable, "-m", "omnimtp.cli", "speak", "Hi", "--model", str(tmp_path / "q"), "-o",
                          str(tmp_path / "hi.wav")], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "hi.wav").stat().st_size > 1000


# The peak RSS of a fresh process above what it holds after its imports (Linux: /proc/self/clear_refs 5 resets
# VmHWM), for the command the snippet runs.
_PEAK = textwrap.dedent("""
    import json, sys, torch, transformers
    from omnimtp import OmniPipeline
    from omnimtp.quantized_checkpoint import quantize_checkpoint
    def rss(field):
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) * 1024
    open("/proc/self/clear_refs", "w").write("5")
    base = rss("VmRSS:")
    {command}
    print(json.dumps({{"peak_above_base": rss("VmHWM:") - base}}))
""")


def _peak(command: str) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-c", _PEAK.format(command=command)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["peak_above_base"]


def test_converting_and_loading_stay_far_below_the_checkpoints_size(tmp_path):
    """A checkpoint of about 420 MB (a Qwen3-Omni whose thinker has 6 MoE layers of 32 experts at hidden 512): the
    converter never holds the float model, and loading its int4 copy peaks far below quantizing at load."""
    from omnimtp.models.tiny import tiny_qwen3_omni

    src = tmp_path / "src"
    text = {"hidden_size": 512, "num_hidden_layers": 6, "num_experts": 32, "moe_intermediate_size": 512}
    tiny_qwen3_omni(0, thinker_text=text).save_pretrained(src)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert size > 350e6
    converting = _peak(f"quantize_checkpoint({str(src)!r}, {str(tmp_path / 'q')!r}, 'int4')")
    assert converting < 0.4 * size, (converting, size)
    loading = _peak(f"OmniPipeline.from_pretrained({str(tmp_path / 'q')!r})")
    at_load = _peak(f"OmniPipeline.from_pretrained({str(src)!r}, quantize='int4')")
    assert at_load > size  # the float model, then its quantized copy
    assert loading < 0.4 * at_load, (loading, at_load)
