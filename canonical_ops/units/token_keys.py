"""Store keys of token blocks: the one key scheme every engine computes for the same tokens.

Version 2 (:class:`TokenKeyScheme`) is vLLM's own prefix-cache block hash, computed from token
ids by this module (the definition, not vLLM's code), so a unit vLLM's tiers store under its
offload key is found by SGLang and the standalone engine, and the reverse. For hash blocks of
``B_h`` ids (vLLM's block size) and ``seed`` (``PYTHONHASHSEED`` when set, else
``"vllm-none-hash"``, vLLM's rule for its cryptographic algorithms)::

    none_hash = H(seed)                              # the parent of a sequence's first block
    hash[i]   = H((hash[i-1], tuple(t[i*B_h : (i+1)*B_h]), None))

``H`` is ``"sha256"``: SHA-256 of the stdlib pickle (protocol 5) of its argument, or
``"sha256_cbor"``: SHA-256 of its canonical CBOR (:func:`cbor_encode`). The ``None`` is vLLM's
``extra_keys`` of a block without LoRA, multimodal input, cache salt or prompt embeddings (with
any of them vLLM's hashes differ: a miss, never a wrong load). A unit of ``U = m * B_h``
tokens (``U``: the namespace's tokens per page) is named by vLLM's offload key of its LAST
hash block, group 0, ``hash + (0).to_bytes(4, "big")``, padded by :func:`store_key` as the
vLLM tiers store it. Test vectors: :data:`TEST_VECTORS_V2` (pinned against vLLM 0.33's own
functions in ``tests/vllm_plugin/test_shared_prefix.py`` and re-derived without vLLM in
``tests/test_token_keys_v2.py``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int

__all__ = ["DEFAULT_SEED", "HASH_ALGORITHMS", "KEY_SCHEME_V2", "TEST_VECTORS_V2", "TokenKeyScheme"]
__all__ += ["cbor_encode", "offload_key_of", "store_key"]

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


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


KEY_SCHEME_V2 = "vllm-block-hash.v1"  # the scheme's name in a namespace (with H and B_h)
HASH_ALGORITHMS = ("sha256", "sha256_cbor")  # vLLM's reproducible (cryptographic) ones
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed of NONE_HASH without PYTHONHASHSEED
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL of the Pythons vLLM 0.33 runs on
_STORE_KEY_BYTES = 96  # a unit's header is then 192 bytes: its payload starts on a cache line
_GROUP_0 = (0).to_bytes(4, "big")

# (algorithm, B_h, seed, token ids, hex of the last whole block's hash): what vLLM 0.33's
# hash_block_tokens gives (checked against it in tests/vllm_plugin/test_shared_prefix.py).
TEST_VECTORS_V2 = (
    (
        "sha256",
        2,
        DEFAULT_SEED,
        (1, 2, 3, 4),
        "15b2160580ca3cdf7f42fb9f5651e2bed7fb1014f46e7e9c86c305f088ecb635",
    ),
    (
        "sha256_cbor",
        2,
        DEFAULT_SEED,
        (1, 2, 3, 4),
        "9ddf6cae9c4b53339646052ea592dabccb20f38eb4bb35a61b5caad749f40286",
    ),
    (
        "sha256",
        4,
        "0",
        (0, 23, 2**31, 2**40 + 7, 128255, 1, 5, 9),
        "c0d6a9f7900afc522bf551eeba19abf7c08441a5b23722d088e25bd5b2a9b2ab",
    ),
    (
        "sha256_cbor",
        4,
        "0",
        (0, 23, 24, 255, 256, 65535, 65536, 2**32),
        "a53a10d5f2a9f1e5d9666875e897a37d81571b13a94e1f219a23973a075a5645",
    ),
)


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, value)
    raise ValueError(f"value: expected an integer below 2**64 for CBOR, got {value}")


def _cbor_uint_items(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Canonical CBOR of each non-negative int64 of ``values``, concatenated, and where each
    ends: :func:`cbor_encode` of them one by one, in one vectorised pass."""
    v = values.astype(np.uint64)
    widths = np.select([v < 24, v < 1 << 8, v < 1 << 16, v < 1 << 32], [0, 1, 2, 4], 8)
    ends = np.cumsum(widths + 1)
    out = np.zeros(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    starts = ends - widths - 1
    firsts = {0: 0, 1: 24, 2: 25, 4: 26, 8: 27}
    for width, extra in firsts.items():
        at = np.nonzero(widths == width)[0]
        if not len(at):
            continue
        if width == 0:
            out[starts[at]] = v[at].astype(np.uint8)
            continue
        out[starts[at]] = extra
        big = v[at].astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - width :]
        out[(starts[at] + 1)[:, None] + np.arange(width)] = big
    return out.tobytes(), ends


def cbor_encode(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of None, int, bytes, str and
    tuples / lists of them: what ``sha256_cbor`` hashes."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("value: bool is not a token id or hash")
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, (bytes, bytearray)):
        return _cbor_head(2, len(value)) + bytes(value)
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(cbor_encode(item) for item in value)
    raise TypeError(f"value: expected None, int, bytes, str or a tuple, got {type(value).__name__}")


def _hash_sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


def _hash_sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor_encode(value)).digest()


_HASHES = {"sha256": _hash_sha256, "sha256_cbor": _hash_sha256_cbor}


def store_key(offload_key: bytes) -> bytes:
    """The store's key of a unit named by vLLM offload key ``offload_key``: padded to 96 bytes,
    its length in the last byte (a longer key gets one 0 byte appended), so a unit's payload
    starts on a cache line (warm loads 5-7% faster)."""
    n = len(offload_key)
    if n < _STORE_KEY_BYTES:
        return offload_key + bytes(_STORE_KEY_BYTES - 1 - n) + bytes([n])
    return offload_key + b"\0"


def offload_key_of(key: bytes) -> bytes:
    """The offload key a :func:`store_key` was made from."""
    return key[: key[-1]] if len(key) == _STORE_KEY_BYTES else key[:-1]


def _env_seed() -> str:
    seed = os.getenv("PYTHONHASHSEED")
    return DEFAULT_SEED if seed is None else seed


@dataclass(frozen=True)
class TokenKeyScheme:
    """Key scheme version 2 (module docstring): ``algorithm`` (:data:`HASH_ALGORITHMS`),
    ``hash_block_tokens`` ``B_h`` (vLLM's block size) and ``seed`` (default: vLLM's rule,
    ``PYTHONHASHSEED`` when set, else :data:`DEFAULT_SEED`; read once, at construction)."""

    algorithm: str = "sha256"
    hash_block_tokens: int = 16
    seed: str = field(default_factory=_env_seed, repr=False)

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"algorithm: expected one of {HASH_ALGORITHMS} (vLLM's reproducible "
                f"prefix_caching_hash_algo), got {self.algorithm!r}"
            )
        object.__setattr__(
            self,
            "hash_block_tokens",
            check_int("hash_block_tokens", self.hash_block_tokens, minimum=1),
        )
        if not isinstance(self.seed, str):
            raise TypeError(f"seed: expected a str (PYTHONHASHSEED's value), got {self.seed!r}")
        object.__setattr__(self, "_hash", _HASHES[self.algorithm])
        object.__setattr__(self, "_none_hash", self._hash(self.seed))

    def describe(self) -> str:
        """The scheme as a namespace records it: name, algorithm, ``B_h`` (never the seed: the
        keys themselves differ with it)."""
        return f"{KEY_SCHEME_V2}/{self.algorithm}/{self.hash_block_tokens}"

    @classmethod
    def described(cls, text: str) -> TokenKeyScheme:
        """The scheme :meth:`describe` gave ``text`` (the seed: vLLM's rule, as by default);
        ValueError for any other text."""
        name, _, rest = str(text).partition("/")
        algorithm, _, block = rest.partition("/")
        if name != KEY_SCHEME_V2 or not block.isdigit() or block != str(int(block)):
            raise ValueError(
                f"key_scheme: expected '{KEY_SCHEME_V2}/<algorithm>/<hash block tokens>', "
                f"got {text!r:.80}"
            )
        return cls(algorithm, int(block))

    @property
    def none_hash(self) -> bytes:
        """vLLM's ``NONE_HASH``: the parent of a sequence's first hash block."""
        return self._none_hash

    def block_hashes(self, token_ids: Any, parent: bytes | None = None) -> list[bytes]:
        """vLLM's block hash of each whole hash block of ``token_ids`` (sequence or integer
        array; a trailing partial block has none), chained after ``parent`` (None: the
        sequence's start)."""
        if parent is None:
            parent = self._none_hash
        elif not isinstance(parent, (bytes, bytearray)) or not parent:
            raise ValueError(f"parent: expected a block hash (bytes) or None, got {parent!r:.80}")
        tokens = _token_array(token_ids)
        step, out, parent = self.hash_block_tokens, [], bytes(parent)
        blocks = len(tokens) // step
        fast = blocks and 24 <= len(parent) < 256 and int(tokens.min()) >= 0
        if self.algorithm == "sha256_cbor" and fast:
            # The bytes of cbor_encode((parent, block, None)), every token encoded at once.
            data, ends = _cbor_uint_items(tokens[: blocks * step])
            array = _cbor_head(4, step)
            for b in range(blocks):
                lo, hi = ends[b * step - 1] if b else 0, ends[(b + 1) * step - 1]
                head = b"\x83\x58" + bytes([len(parent)])  # array(3), bytes(len): the parent
                parent = hashlib.sha256(head + parent + array + data[lo:hi] + b"\xf6").digest()
                out.append(parent)
            return out
        ids = tokens.tolist()  # Python ints: what vLLM hashes
        for at in range(0, blocks * step, step):
            parent = self._hash((parent, tuple(ids[at : at + step]), None))
            out.append(parent)
        return out

    def check_unit_tokens(self, unit_tokens: Any) -> int:
        """``unit_tokens`` when it is a whole number of hash blocks; ValueError otherwise."""
        unit_tokens = check_int("unit_tokens", unit_tokens, minimum=1)
        if unit_tokens % self.hash_block_tokens:
            raise ValueError(
                f"unit_tokens: expected a multiple of the key scheme's hash_block_tokens "
                f"{self.hash_block_tokens}, got {unit_tokens}"
            )
        return unit_tokens

    def unit_key(self, last_block_hash: bytes) -> bytes:
        """The store key of the unit whose last hash block has ``last_block_hash``."""
        return store_key(bytes(last_block_hash) + _GROUP_0)

    def unit_keys(self, token_ids: Any, unit_tokens: int) -> list[bytes]:
        """Store keys of the whole units of ``unit_tokens`` tokens of ``token_ids``, first
        first: ``unit_keys(t, U)[j]`` names the prefix ``t[: (j + 1) * U]``."""
        per_unit = self.check_unit_tokens(unit_tokens) // self.hash_block_tokens
        hashes = self.block_hashes(token_ids)
        return [self.unit_key(h) for h in hashes[per_unit - 1 :: per_unit]]
