import os

import pytest
import torch

# Tests never depend on the machine's core count for their results; keep them from oversubscribing CI.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed_global_rng():
    """Every test starts from the same global RNG state, so failures reproduce."""
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny-model ops are too small to split across threads; on a shared CPU the threads only contend.

    Use per module with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)



# The fast subset, `python -m pytest -m "not slow"` (about 100 s of CPU): pure pieces, small parity
# checks and the README's commands. Every other file (servers, Ray, training, statistical checks, fuzzing,
# compiled kernels, full parity runs: tens of seconds each) is marked `slow`, a new file too until it is
# listed here.
FAST_FILES = {
    "test_codec_streaming.py",
    "test_demo_model.py",
    "test_exports.py",
    "test_handoff.py",
    "test_handoff_stream.py",
    "test_media.py",
    "test_packed_decoder.py",
    "test_qwen2_5_talker_inputs.py",
    "test_readme.py",
    "test_rejection.py",
    "test_runtime.py",
    "test_spec_cli.py",
    "test_tokenizer.py",
    "test_voice_store.py",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name not in FAST_FILES:
            item.add_marker(pytest.mark.slow)
