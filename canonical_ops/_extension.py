"""Loads the compiled extension (canonical_ops._C) into torch.ops.canonical."""

from __future__ import annotations

import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _library_path() -> str:
    candidates = sorted(
        glob.glob(os.path.join(_HERE, "_C*.so")) + glob.glob(os.path.join(_HERE, "_C*.pyd"))
    )
    if not candidates:
        raise ImportError(
            "canonical_ops._C is not built: run `make install` (or "
            "`pip install --no-build-isolation -e .`) from the repository root"
        )
    return candidates[0]


def load() -> None:
    """Registers torch.ops.canonical.* once per process."""
    if not hasattr(torch.ops.canonical, "_built_with_cuda"):
        torch.ops.load_library(_library_path())


load()
BUILT_WITH_CUDA: bool = bool(torch.ops.canonical._built_with_cuda())
