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


# Files that take tens of seconds each on 2 cores (servers, Ray, training, statistical checks, fuzzing,
# compiled kernels, full parity runs). `python -m pytest -m "not slow"` leaves them out: about a minute.
SLOW_FILES = {
    "test_code_predictor.py",
    "test_code_predictor_distribution.py",
    "test_compare_trees.py",
    "test_demo_omni.py",
    "test_device.py",
    "test_media_input.py",
    "test_qwen2_5_omni.py",
    "test_ray.py",
    "test_rejection_distribution.py",
    "test_self_distill.py",
    "test_server.py",
    "test_server_fuzz.py",
    "test_server_media.py",
    "test_server_robustness.py",
    "test_server_scheduling.py",
    "test_small_batch_linear.py",
    "test_spec_distribution.py",
    "test_spec_glm5.py",
    "test_spec_hybrid.py",
    "test_thinker_spec.py",
    "test_token2wav.py",
    "test_train_mtp.py",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
