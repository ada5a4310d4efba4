"""The store key of token blocks: its documented definition, pinned by a test vector."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from canonical_ops.units.token_keys import (
    ROOT_KEY,
    TEST_VECTOR_HEX,
    block_keys,
    chain_keys,
    root_key,
)


def test_test_vector_is_the_documented_definition():
    # Re-derived from the module docstring with hashlib and struct alone.
    root = hashlib.sha256(b"canonical-kv.token-keys.v1").digest()
    k0 = hashlib.sha256(root + struct.pack("<2q", 1, 2)).digest()
    k1 = hashlib.sha256(k0 + struct.pack("<2q", 3, 4)).digest()
    assert root == ROOT_KEY
    assert (
        k1.hex()
        == TEST_VECTOR_HEX
        == "31bc5c5196c0f882fbc31f3209a9d8d57ad285dcea07cd6a945f8f05a9ac2f27"
    )
    assert block_keys([1, 2, 3, 4], 2) == [k0, k1]
    assert block_keys(np.array([1, 2, 3, 4], dtype=np.int32), 2) == [k0, k1]


def test_chain_continues_and_partial_blocks_have_no_key():
    tokens = list(range(50, 61))  # 11 tokens: 2 whole blocks of 4, a partial one
    keys = block_keys(tokens, 4)
    assert len(keys) == 2
    assert chain_keys(keys[0], tokens[4:], 4) == keys[1:]
    negative = block_keys([-1, 2**63 - 1], 2)[0]
    expected = hashlib.sha256(ROOT_KEY + struct.pack("<2q", -1, 2**63 - 1)).digest()
    assert negative == expected


def test_salt_separates_chains():
    salted = block_keys([1, 2], 2, salt=b"tenant-a")
    expected_root = hashlib.sha256(ROOT_KEY + b"salt" + b"tenant-a").digest()
    assert root_key(b"tenant-a") == expected_root
    assert salted == [hashlib.sha256(expected_root + struct.pack("<2q", 1, 2)).digest()]
    assert salted != block_keys([1, 2], 2) != block_keys([1, 2], 2, salt=b"tenant-b")


@pytest.mark.parametrize(
    ("tokens", "error", "match"),
    [
        ([1, 2.0], TypeError, r"token_ids\[1\]"),
        ([True, 2], TypeError, r"token_ids\[0\]"),
        ([1, 2**63], ValueError, r"token_ids\[1\]: expected an int64"),
        ("12", TypeError, "token_ids"),
        (np.zeros(4, dtype=np.float32), TypeError, "integer array"),
    ],
)
def test_bad_token_ids_are_refused(tokens, error, match):
    with pytest.raises(error, match=match):
        block_keys(tokens, 2)


def test_bad_parent_and_block_size_are_refused():
    with pytest.raises(ValueError, match="parent: expected 32 bytes"):
        chain_keys(b"short", [1, 2], 2)
    with pytest.raises(ValueError, match="block_tokens"):
        block_keys([1, 2], 0)
    with pytest.raises(TypeError, match="salt"):
        root_key("text")
