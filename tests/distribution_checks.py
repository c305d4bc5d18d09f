"""Distribution checks that can fail: draws are compared with an exact law in total variation, within a
bound derived from the sample size, and every plausible wrong law is shown to lie beyond twice that bound."""

from __future__ import annotations

import math

import torch

FAILURE_PROBABILITY = 1e-6


def tv_bound(num_samples: int, num_cells: int, failure_probability: float = FAILURE_PROBABILITY) -> float:
    """A bound that the total variation between an empirical law of `num_samples` independent draws and
    the true law on `num_cells` possible outcomes exceeds with probability at most `failure_probability`.

    E[TV] <= ½ Σ_i √(p_i / n) <= ½ √(cells / n) (Cauchy–Schwarz), and TV moves by at most 1/n when one
    draw changes, so McDiarmid adds √(ln(1/δ) / 2n)."""
    return 0.5 * math.sqrt(num_cells / num_samples) + math.sqrt(math.log(1 / failure_probability) / (2 * num_samples))


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a.double() - b.double()).abs().sum().item()


def empirical_law(codes: torch.Tensor, num_cells: int) -> torch.Tensor:
    """Frequencies of integer outcome codes [N] over 0..num_cells-1."""
    return torch.bincount(codes, minlength=num_cells).double() / codes.numel()


def assert_law(codes: torch.Tensor, exact: torch.Tensor, wrong: dict[str, torch.Tensor]) -> None:
    """The draws `codes` follow `exact` within `tv_bound`, and every law in `wrong` is more than twice that
    bound away from `exact`: a sampler following one of them would land beyond the bound (up to the
    failure probability) and fail."""
    assert abs(exact.sum().item() - 1) < 1e-5  # float32 probabilities
    bound = tv_bound(codes.numel(), int((exact > 0).sum()))
    for name, law in wrong.items():
        assert abs(law.sum().item() - 1) < 1e-5, name
        distance = total_variation(law, exact)
        assert distance > 2 * bound, f"cannot tell the '{name}' rule apart: TV {distance:.4f}, bound {bound:.4f}"
    observed = total_variation(empirical_law(codes, exact.numel()), exact)
    assert observed <= bound, f"TV {observed:.4f} from the exact law exceeds {bound:.4f}"
