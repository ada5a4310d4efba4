"""The vLLM worker registers its region in vLLM's chunk size (VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB,
<= 64 GiB per call by default) through canonical_ops.transfer.register_host_memory (pieces,
roll back, flags: tested in tests/test_ops_transfer.py)."""

from __future__ import annotations

from canonical_ops.vllm.worker import _register_chunk_bytes

GIB = 1 << 30


def test_chunk_size_follows_vllms_setting(monkeypatch):
    monkeypatch.delenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", raising=False)
    assert _register_chunk_bytes() == 64 * GIB
    monkeypatch.setenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", "2")
    assert _register_chunk_bytes() == 2 * GIB
    monkeypatch.setenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", "100000")
    assert _register_chunk_bytes() == 512 * GIB
    monkeypatch.setenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", "lots")
    assert _register_chunk_bytes() == 64 * GIB
