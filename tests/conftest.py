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
