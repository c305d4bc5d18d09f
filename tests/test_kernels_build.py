"""Every C kernel of omnimtp builds where a compiler is found: a kernel that does not compile makes its tests skip
(they cannot run without it), so a source that stopped compiling would pass them all unnoticed; here it fails,
naming the compiler's error. A CPU without a kernel's instructions, or no compiler at all, is a skip."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import omnimtp.runtime.kernels as kernels

KERNEL_MODULES = sorted(
    info.name for info in pkgutil.iter_modules(kernels.__path__)
    if hasattr(importlib.import_module(f"omnimtp.runtime.kernels.{info.name}"), "unavailable_reason")
)


def test_every_kernel_module_is_found():
    assert "small_batch_linear" in KERNEL_MODULES and "bf16_attention" in KERNEL_MODULES


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_the_kernel_compiles_where_a_compiler_is_found(name):
    reason = importlib.import_module(f"omnimtp.runtime.kernels.{name}").unavailable_reason()
    if reason is None:
        return
    assert "could not build" not in reason, reason
    pytest.skip(f"{name}: {reason}")
