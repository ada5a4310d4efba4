"""Store keys of token blocks: one engine-independent chained hash over token ids.

Every engine names a block by its own prefix hash; a store shared by engines needs a key
each can compute from what they all have, the token ids. Version 1, for whole blocks of
``B`` ids (the namespace's tokens per page), with ``LE64(t)`` a token id as 8 bytes::

    root    = SHA-256(b"canonical-kv.token-keys.v1")
    key[-1] = root, or SHA-256(root || b"salt" || salt) for a tenant's salt (bytes)
    key[i]  = SHA-256(key[i-1] || LE64(t[i*B]) || ... || LE64(t[i*B + B - 1]))

``key[i]`` (32 bytes) names the prefix ``t[: (i + 1) * B]``. The block size is not hashed:
the namespace fixes it. Test vector: ``block_keys([1, 2, 3, 4], 2)[1].hex() ==
TEST_VECTOR_HEX`` (pinned by ``tests/sglang_plugin/test_token_keys.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..checks import check_int

__all__ = ["KEY_BYTES", "ROOT_KEY", "TEST_VECTOR_HEX", "block_keys", "chain_keys", "root_key"]

KEY_BYTES = 32
ROOT_KEY = hashlib.sha256(b"canonical-kv.token-keys.v1").digest()
TEST_VECTOR_HEX = "31bc5c5196c0f882fbc31f3209a9d8d57ad285dcea07cd6a945f8f05a9ac2f27"

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def root_key(salt: bytes | None = None) -> bytes:
    """``key[-1]``, the parent of a sequence's first block: unsalted (shared) or salted."""
    if salt is None:
        return ROOT_KEY
    if not isinstance(salt, (bytes, bytearray)):
        raise TypeError(f"salt: expected bytes or None, got {type(salt).__name__}")
    return hashlib.sha256(ROOT_KEY + b"salt" + bytes(salt)).digest()


def _token_array(token_ids: Any) -> np.ndarray:
    """``token_ids`` as little-endian int64, refusing anything that is not an integer id."""
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise TypeError("token_ids: expected a sequence of int token ids, got a str/bytes")
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
            raise TypeError(
                f"token_ids: expected a 1-D integer array, got {token_ids.dtype} "
                f"with shape {token_ids.shape}"
            )
        if token_ids.dtype == np.uint64 and token_ids.size and int(token_ids.max()) > _INT64_MAX:
            raise ValueError("token_ids: expected ids below 2**63")
        return token_ids.astype("<i8", copy=False)
    if not isinstance(token_ids, Sequence):
        raise TypeError(
            f"token_ids: expected a sequence of int token ids, got {type(token_ids).__name__}"
        )
    out = np.empty(len(token_ids), dtype="<i8")
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token_ids[{i}]: expected an int token id, got {t!r}")
        if not _INT64_MIN <= int(t) <= _INT64_MAX:
            raise ValueError(f"token_ids[{i}]: expected an int64 token id, got {t!r}")
        out[i] = int(t)
    return out


def chain_keys(parent: bytes, token_ids: Any, block_tokens: int) -> list[bytes]:
    """Keys of the whole blocks of ``token_ids`` (sequence or integer array; a trailing
    partial block has none) following the block whose key is ``parent`` (32 bytes, or
    :func:`root_key` at a sequence's start), one per block of ``block_tokens`` ids."""
    if not isinstance(parent, (bytes, bytearray)) or len(parent) != KEY_BYTES:
        raise ValueError(f"parent: expected {KEY_BYTES} bytes, got {parent!r:.80}")
    block_tokens = check_int("block_tokens", block_tokens, minimum=1)
    tokens = _token_array(token_ids)
    raw = tokens[: len(tokens) // block_tokens * block_tokens].tobytes()
    keys, key, step = [], bytes(parent), block_tokens * 8
    for at in range(0, len(raw), step):
        key = hashlib.sha256(key + raw[at : at + step]).digest()
        keys.append(key)
    return keys


def block_keys(token_ids: Any, block_tokens: int, *, salt: bytes | None = None) -> list[bytes]:
    """Store keys of a sequence's whole blocks, first block first: ``block_keys(t, B)[i]``
    names the prefix ``t[: (i + 1) * B]`` (defined in the module docstring)."""
    return chain_keys(root_key(salt), token_ids, block_tokens)
