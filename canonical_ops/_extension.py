"""Loads the compiled extension ``canonical_ops._C`` (registers ``torch.ops.canonical``) as a
real module import: Python picks the one build whose ABI tag matches this interpreter."""

from __future__ import annotations

import torch

try:
    import canonical_ops._C  # noqa: F401  (static initialisers register torch.ops.canonical.*)
except ImportError as error:  # pragma: no cover - depends on the build
    raise ImportError(
        "canonical_ops._C is not built for this Python: run `make install` (or "
        "`pip install --no-build-isolation -e .`) from the repository root"
    ) from error

BUILT_WITH_CUDA: bool = bool(torch.ops.canonical._built_with_cuda())
"""Whether the extension has its CUDA kernels (nvcc and a CUDA torch were present at build)."""
