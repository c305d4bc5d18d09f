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
