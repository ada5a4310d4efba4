"""Fixtures of tests/sglang_plugin: canonical_ops.sglang against real SGLang 0.5.x (`make test-sglang`).

Where SGLang is not installed (the main venv, `make test`) tests/conftest.py reports every
module here skipped without importing it, so nothing here imports SGLang at the top.
Everything runs on CPU: SGLang's own host pools in host memory, its storage factory, its
page hashing (its native hash extension is compiled once by torch on first use).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def store_dir(tmp_path):
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def extra(tmp_path, store_dir):
    """The backend's extra_config: a fresh file store and staging directory per test."""
    return {"store": str(store_dir), "staging_dir": str(tmp_path / "staging")}
