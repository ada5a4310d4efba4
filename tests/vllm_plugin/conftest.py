"""Fixtures of tests/vllm_plugin: canonical_ops.vllm against real vLLM 0.33 (`make test-vllm`).

Where vLLM is not installed (the main venv, `make test`) tests/conftest.py reports every
module here skipped without importing it. Everything runs on CPU: KV tensors in host memory, vLLM's
SharedOffloadRegion in /dev/shm, VllmConfig from tiny local config.json files
(nothing is downloaded).
"""

from __future__ import annotations

import contextlib
import glob
import os

import pytest

ENGINE_PREFIX = "ckv-"


@pytest.fixture(scope="session", autouse=True)
def _clean_shared_regions():
    """Remove region files a failed test may have left in /dev/shm (ours only)."""
    yield
    for path in glob.glob(f"/dev/shm/vllm_offload_{ENGINE_PREFIX}*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """ModelConfigs of tiny local Llama configs: 8 KV heads (TP 1/2/4) and 2 (replicated GQA)."""
    from helpers.vllm_harness import model_config, write_tiny_llama

    root = tmp_path_factory.mktemp("models")
    return {
        "llama8": model_config(write_tiny_llama(root / "llama8", num_kv_heads=8, num_layers=6)),
        "llama2": model_config(write_tiny_llama(root / "llama2", num_kv_heads=2, num_layers=2)),
    }


@pytest.fixture(scope="session")
def vllm_configs(models):
    """Cached VllmConfig per (model, tp, pp); tests set parallel_config.rank per rank."""
    from helpers.vllm_harness import make_vllm_config

    cache = {}

    def get(model: str, tp: int, pp: int = 1):
        key = (model, tp, pp)
        if key not in cache:
            cache[key] = make_vllm_config(models[model], tp, pp=pp)
        return cache[key]

    return get


PLUGIN = "canonical_ops.vllm:register"


@pytest.fixture(scope="session")
def plugin_registered():
    """CanonicalOffloadingSpec registered the way vLLM does it: its general-plugin loader."""
    from importlib.metadata import entry_points

    import vllm.plugins
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == PLUGIN]
    assert found, (
        f"no vllm.general_plugins entry point {PLUGIN!r}: install canonical-kv (setup.py's "
        "entry_points) into this environment, as `make test-vllm` does"
    )
    vllm.plugins.load_general_plugins()
    assert "CanonicalOffloadingSpec" in OffloadingSpecFactory._registry
    return found[0]
