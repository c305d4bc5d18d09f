"""`omnimtp`'s public names: what a user calls, each resolving lazily to the object of its module, and
`import omnimtp` that loads neither torch nor transformers."""

import importlib
import subprocess
import sys
from pathlib import Path

import omnimtp

REPO_ROOT = Path(__file__).resolve().parent.parent

USER_NAMES = {
    # speech
    "OmniPipeline", "OmniOutput", "OmniEvent", "SamplingParams", "MediaLimits", "Voice",
    # speculative decoding
    "speculative_generate", "plain_generate", "SpecOutput", "SpecStats", "load_target_and_head", "MTPHead",
    "Proposer", "DraftInput",
    # training a head
    "train_mtp_head", "generate_distill_rows", "MTPTrainConfig", "MTPTrainResult",
    # the shipped demos
    "demo_model_dir", "demo_omni_dir",
}


def test_the_exports_are_the_user_names_and_resolve_to_their_modules():
    assert set(omnimtp.__all__) == USER_NAMES
    for name in omnimtp.__all__:
        module = importlib.import_module(omnimtp._EXPORTS[name])
        assert getattr(omnimtp, name) is getattr(module, name), name
    assert set(dir(omnimtp)) >= USER_NAMES


def test_internals_stay_in_their_modules():
    from omnimtp.engine.core import EngineCore
    from omnimtp.models.tiny_lm import tiny_lm
    from omnimtp.talker.code_predictor import CodePredictorRunner

    for name, value in [("EngineCore", EngineCore), ("tiny_lm", tiny_lm), ("CodePredictorRunner", CodePredictorRunner)]:
        assert callable(value)
        try:
            getattr(omnimtp, name)
        except AttributeError as error:
            assert name in str(error)
        else:
            raise AssertionError(f"omnimtp.{name} is exported")


def test_the_docstrings_start_here_runs():
    """The package docstring's example, as written (with smaller caps)."""
    code = "\n".join(line[4:] for line in omnimtp.__doc__.splitlines() if line.startswith("    "))
    code = code.replace('pipe.generate("Hello")', 'pipe.generate("Hello", max_new_tokens=3, max_frames=4)')
    code = code.replace('pipe.stream("Hello")', 'pipe.stream("Hello", max_new_tokens=3, max_frames=4)')
    code = code.replace("max_new_tokens=64", "max_new_tokens=8")
    namespace = {}
    exec(compile(code, "omnimtp.__doc__", "exec"), namespace)
    assert namespace["out"].audio.size > 0 and namespace["event"].output is not None
    assert namespace["spec"].sequences.shape[0] == 1 and namespace["spec"].sequences.shape[1] > 3


def test_import_omnimtp_loads_neither_torch_nor_transformers():
    probe = "import sys, omnimtp; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
