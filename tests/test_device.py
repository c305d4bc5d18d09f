"""Where the model runs: device names checked before weights move, requests' generators on the model's
device, and (on a machine with CUDA) the pipeline on the GPU against transformers on the GPU."""

import os
import subprocess
import sys

import pytest
import torch
from reference_omni import reference_generate

from omnimtp.engine.core import EngineCore
from omnimtp.engine.request import Request
from omnimtp.families.qwen3_omni import Qwen3OmniFamily
from omnimtp.pipeline import OmniPipeline
from omnimtp.runtime.device import resolve_device
from omnimtp.sampling import SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_resolve_device_checks_the_name_and_that_it_exists():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    bad = ["gpu", "cuda:x", 3.5, "meta", "xpu"] + ([] if HAS_CUDA else ["cuda", "cuda:0"])
    if HAS_CUDA:
        bad.append(f"cuda:{torch.cuda.device_count()}")
    for name in bad:
        with pytest.raises(ValueError, match="--device"):
            resolve_device(name, "--device")


def test_requests_generators_follow_the_models_device():
    """The core remakes a request's generators on the family's device from the same seeds: the same
    draws as generators made there directly."""
    request = Request(0, [1, 2, 3], max_new_tokens=2, max_frames=2, seed=5)
    before = request.thinker_generator
    request.place_generators("cpu")
    assert request.thinker_generator is before  # already there: untouched
    family = Qwen3OmniFamily.tiny()
    core = EngineCore(family)
    core.add(request)
    assert request.thinker_generator.device == family.device == torch.device("cpu")
    if HAS_CUDA:
        moved = Request(1, [1, 2, 3], max_new_tokens=2, max_frames=2, seed=5)
        moved.place_generators("cuda")
        direct = torch.Generator(device="cuda").manual_seed(moved.generator_seeds[0] % 2**64)
        assert torch.equal(torch.rand(4, device="cuda", generator=moved.thinker_generator),
                           torch.rand(4, device="cuda", generator=direct))


def test_a_device_the_machine_lacks_is_refused_before_the_model_loads(tmp_path, capsys):
    from omnimtp.cli import main

    missing = "cuda:99" if HAS_CUDA else "cuda"
    assert main(["speak", "Hi", "-o", str(tmp_path / "a.wav"), "--device", missing]) == 2
    assert "--device" in capsys.readouterr().err
    assert not (tmp_path / "a.wav").exists()
    assert main(["spec", "--prompt", "import os", "--device", missing]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omnimtp spec: error: --device") and "Traceback" not in err
    out_dir = tmp_path / "head"
    assert main(["train-mtp", "--model", str(tmp_path), "--data", str(tmp_path), "--out", str(out_dir),
                 "--device", missing]) == 2
    assert "--device" in capsys.readouterr().err and not out_dir.exists()
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    done = subprocess.run([sys.executable, "-m", "omnimtp.cli", "serve", "--port", "1", "--device", "tpu"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--device" in done.stderr and "serving" not in done.stdout


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_greedy_equals_transformers_on_cuda_and_seeded_rows_are_batch_invariant(monkeypatch):
    pipe = OmniPipeline.tiny(device="cuda")
    assert pipe.family.device.type == "cuda" and pipe.thinker_decoder.device.type == "cuda"
    prompt = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                                add_generation_prompt=True, return_dict=False)
    ours = pipe.generate(input_ids=prompt, max_new_tokens=8, max_frames=12)
    ref_ids, ref_codes, _ = reference_generate(pipe.model, prompt, 8, 12, monkeypatch)
    assert ours.text_ids == ref_ids and torch.equal(ours.codes, ref_codes.cpu())
    sampled = dict(thinker_sampling=SamplingParams(temperature=0.9), talker_sampling=SamplingParams(temperature=0.9),
                   max_new_tokens=8, max_frames=12)
    alone = pipe.generate("Hello", seed=3, **sampled)
    batch = pipe.generate(["Something else", "Hello"], seed=[9, 3], **sampled)
    assert alone.text_ids == batch[1].text_ids and torch.equal(alone.codes, batch[1].codes)
