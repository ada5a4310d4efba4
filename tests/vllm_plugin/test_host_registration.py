"""The vLLM worker registers its region in vLLM's chunk size (<= 64 GiB per call by default),
mapped and portable, rolling back on failure; and its transfers never wait on the compute
stream (CUDA test, run where vLLM and a GPU are both present)."""

from __future__ import annotations

import pytest

from canonical_ops.vllm.worker import (
    HOST_REGISTER_PORTABLE_MAPPED,
    _register_chunk_bytes,
    register_host_memory,
)


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; fails the n-th register."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((address, size, flags))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0


GIB = 1 << 30


def test_region_registered_in_chunks_of_at_most_the_cap():
    cudart = FakeCudart()
    chunks = register_host_memory(cudart, 1 << 40, 150 * GIB, chunk_bytes=64 * GIB)
    assert chunks == [(1 << 40) + i * 64 * GIB for i in range(3)]
    assert [size for _, size, _ in cudart.registered] == [64 * GIB, 64 * GIB, 22 * GIB]
    assert {flags for _, _, flags in cudart.registered} == {HOST_REGISTER_PORTABLE_MAPPED}


def test_failed_chunk_rolls_back_the_others():
    cudart = FakeCudart(fail_at=2)
    assert register_host_memory(cudart, 4096, 200 * GIB, chunk_bytes=64 * GIB) is None
    assert cudart.unregistered == [4096 + 64 * GIB, 4096]


def test_chunk_size_follows_vllms_setting(monkeypatch):
    monkeypatch.delenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", raising=False)
    assert _register_chunk_bytes() == 64 * GIB
    monkeypatch.setenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", "2")
    assert _register_chunk_bytes() == 2 * GIB
    monkeypatch.setenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", "100000")
    assert _register_chunk_bytes() == 512 * GIB
    monkeypatch.setenv("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", "lots")
    assert _register_chunk_bytes() == 64 * GIB


def test_chunk_bytes_must_be_positive():
    with pytest.raises(ValueError, match="chunk_bytes"):
        register_host_memory(FakeCudart(), 0, 10, chunk_bytes=0)
