"""The one place where test markers become skips (always with a reason), and shared fixtures.

Markers (declared in pyproject.toml):

``cuda``
    Needs a CUDA GPU and an extension built with its CUDA kernels; skipped, with which
    of the two is missing, otherwise.
``slow``
    Multi-process or long-running. Runs by default (CI runs everything); ``--skip-slow``
    skips them for a quick local loop.
``vllm`` (the folder ``tests/vllm_plugin``)
    Needs real vLLM 0.33 (``make test-vllm`` runs them in their own venv). Without vLLM
    every module there is reported skipped and is never imported (they import vLLM at
    the top).
``sglang`` (the folder ``tests/sglang_plugin``)
    Needs real SGLang 0.5.x (``make test-sglang`` runs them in their own venv). Without
    SGLang every module there is reported skipped and is never imported.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch

VLLM_TESTS = Path(__file__).resolve().parent / "vllm_plugin"
SGLANG_TESTS = Path(__file__).resolve().parent / "sglang_plugin"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-slow", action="store_true", help="skip tests marked slow (multi-process, long)"
    )


@cache
def cuda_skip_reason() -> str | None:
    """Why CUDA tests cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU available"
    from canonical_ops._extension import BUILT_WITH_CUDA

    return None if BUILT_WITH_CUDA else "the extension was built without its CUDA kernels"


@cache
def vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: `make test-vllm` runs tests/vllm_plugin in its own venv"
    return None


@cache
def sglang_skip_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return (
            "SGLang is not installed: `make test-sglang` runs tests/sglang_plugin in its own venv"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = config.getoption("--skip-slow")
    for item in items:
        if "cuda" in item.keywords and cuda_skip_reason():
            item.add_marker(pytest.mark.skip(reason=cuda_skip_reason()))
        if "slow" in item.keywords and skip_slow:
            item.add_marker(pytest.mark.skip(reason="--skip-slow"))
        if VLLM_TESTS in Path(item.path).parents:
            item.add_marker(pytest.mark.vllm)
        if SGLANG_TESTS in Path(item.path).parents:
            item.add_marker(pytest.mark.sglang)


class _NeedsVllm(pytest.Module):
    """A vLLM test module reported as skipped without importing it."""

    def collect(self):
        pytest.skip(vllm_skip_reason())


class _NeedsSglang(pytest.Module):
    """An SGLang test module reported as skipped without importing it."""

    def collect(self):
        pytest.skip(sglang_skip_reason())


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    if VLLM_TESTS in module_path.parents and vllm_skip_reason():
        return _NeedsVllm.from_parent(parent, path=module_path)
    if SGLANG_TESTS in module_path.parents and sglang_skip_reason():
        return _NeedsSglang.from_parent(parent, path=module_path)
    return None


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def forkserver() -> multiprocessing.context.BaseContext:
    """The forkserver context of every multi-process test: children start in milliseconds
    with torch, the ops core (extension loaded) and the frontend preloaded. One per session:
    Python has one forkserver per process, and the first preload list would win anyway."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        [
            "torch",
            "numpy",
            "canonical_ops.ops",
            "canonical_ops.engine.worker",
            "helpers.frontend_rank",
        ]
    )
    return context


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """torch's intra-op thread count set to 2 for the test, then restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """torch.compile caches reset before and after the test (no recompile limits hit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
