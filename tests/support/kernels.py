"""The compiled kernels' test fixture body, shared by tests/models/test_qkernel.py and test_attnkernel.py."""

from __future__ import annotations

import os
import shutil

import pytest


def built_or_skip(load, needs: str, fallback: str):
    """``load()``'s module (a kernel's ``load``). Fails the test where the CPU has ``needs``, a C++
    compiler and ninja are there and the build failed anyway; skips (saying ``fallback`` runs) where
    it cannot be built."""
    m = load()
    from torch.utils.cpp_extension import is_ninja_available

    can_build = shutil.which("c++") and is_ninja_available() and not os.environ.get("SLOTSERVE_NO_KERNELS")
    if m is None and can_build:
        pytest.fail(f"a CPU with {needs}, a C++ compiler and ninja, but the kernel did not build (see the warning)")
    if m is None:
        pytest.skip(f"no C++ compiler or ninja here, or SLOTSERVE_NO_KERNELS: {fallback}")
    return m
