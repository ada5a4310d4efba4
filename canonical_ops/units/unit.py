"""THE encoding of a persisted unit, on disk and on the wire (no I/O here).

A *unit* is one block's canonical pages of a contiguous layer range
``[first_layer, end_layer)``: the payload is those layers' canonical pages
concatenated in layer order, i.e. exactly one region row of a pipeline stage
that owns those layers (``pages_per_row=1``). A unit is a header followed
immediately by the payload; nothing precedes or follows it (a file, or a
Redis value, is exactly one unit).

Header (all integers little-endian, unsigned)
---------------------------------------------

======  ======  ==================  ===============================================
offset  size    field               meaning
======  ======  ==================  ===============================================
0       8       magic               ``b"CKVUNIT\\0"``
8       2       version             format version, 1
10      2       header_length       ``96 + key_length`` rounded up to a multiple
                                    of 8 (so at most 1120); the payload starts here
12      2       checksum_algorithm  1 = XXH3-128, seed 0
14      2       key_length          1 .. 1024
16      4       flags               0 (reserved: anything else is refused)
20      4       first_layer         first layer held
24      4       end_layer           one past the last layer held (> first_layer)
28      4       total_layers        layers of the model (the namespace's)
32      8       position            the block's index in its sequence (prefix
                                    position, for tail-first eviction), < 2**63
40      8       payload_length      bytes after the header; must equal the
                                    namespace's bytes of layers [first, end)
48      32      namespace_digest    ``StoreNamespace.digest`` (sha256)
80      16      checksum            XXH3-128 over the header with these 16 bytes
                                    zeroed, then the payload; stored as
                                    ``xxhash.xxh3_128().digest()`` (big-endian,
                                    xxHash's canonical form)
96      K       key                 the block key's bytes (see :func:`normalize_key`)
96+K    pad     padding             zero bytes up to ``header_length``
======  ======  ==================  ===============================================

A unit is ``header_length + payload_length`` bytes, exactly: a shorter buffer
is truncated and a longer one extended, and both are corrupt.

Keys
----
A key is bytes. For convenience :func:`normalize_key` also takes ``str``
(its UTF-8 bytes) and ``int`` (two's complement, big-endian, in the fewest
multiple of 8 bytes that holds it with its sign: an int64 block hash is 8
bytes). Keys are not tagged with their type, so ``"ab"`` and ``b"ab"`` are the
same key: a deployment uses one kind of key.

Trust
-----
Nothing read is trusted: :func:`decode_header` bounds every length against
the buffer and the namespace before any of it is used, so a forged header can
neither make a reader allocate nor read past its buffer, and the checksum
covers every header byte, including the padding. Same-size corruption (a bit
flip anywhere) is caught by the checksum; a unit of another namespace, key or
layer range is refused by field comparison before any payload is touched.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .namespace import StoreNamespace

__all__ = [
    "CHECKSUM_XXH3_128",
    "FIXED_HEADER_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_KEY_BYTES",
    "CorruptUnit",
    "PayloadVerifier",
    "UnitHeader",
    "as_byte_view",
    "begin_unit_check",
    "decode_and_verify",
    "decode_header",
    "encode_header",
    "encode_unit",
    "header_length",
    "normalize_key",
    "peek_header",
    "verify_payload",
]

MAGIC = b"CKVUNIT\x00"
FORMAT_VERSION = 1
CHECKSUM_XXH3_128 = 1
MAX_KEY_BYTES = 1024
_FIXED = struct.Struct("<8sHHHHIIIIQQ32s16s")
FIXED_HEADER_BYTES = _FIXED.size
assert FIXED_HEADER_BYTES == 96
MAX_HEADER_BYTES = FIXED_HEADER_BYTES + MAX_KEY_BYTES
_CHECKSUM_OFFSET, _CHECKSUM_BYTES = 80, 16
_MAX_POSITION = (1 << 63) - 1
_ZERO_CHECKSUM = bytes(_CHECKSUM_BYTES)


class CorruptUnit(Exception):
    """A unit that must not be used: damaged, forged, truncated, or someone else's.

    Attributes
    ----------
    reason : str
        What did not match, for logs and metrics.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def normalize_key(key: Any) -> bytes:
    """A block key as the bytes stored in the header (see the module docstring).

    Raises
    ------
    TypeError
        Not bytes-like, str or int (bools are refused).
    ValueError
        Empty or longer than 1024 bytes once encoded, or a str that is not
        encodable as UTF-8.
    """
    if type(key) is bytes and 1 <= len(key) <= MAX_KEY_BYTES:
        return key  # the common case (vLLM block hashes), without a copy
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
    elif isinstance(key, str):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"key: expected a str encodable as UTF-8, got {key!r}") from None
    elif isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        value = int(key)
        magnitude = value if value >= 0 else ~value  # two's complement: -2**63 fits 8 bytes
        words = max(1, (magnitude.bit_length() + 1 + 63) // 64)  # +1: room for the sign bit
        if 8 * words > MAX_KEY_BYTES:
            raise ValueError(f"key: expected an int of at most {MAX_KEY_BYTES} bytes, got {key!r}")
        raw = value.to_bytes(8 * words, "big", signed=True)
    else:
        raise TypeError(f"key: expected bytes, str or int, got {type(key).__name__}")
    if not 1 <= len(raw) <= MAX_KEY_BYTES:
        raise ValueError(f"key: expected 1 to {MAX_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def header_length(key: Any) -> int:
    """Header bytes of a unit with ``key`` (where its payload starts)."""
    return FIXED_HEADER_BYTES + _pad8(len(normalize_key(key)))


def as_byte_view(obj: Any, *, writable: bool = False, name: str = "buffer") -> memoryview:
    """A flat uint8 memoryview over ``obj``'s memory, without a copy.

    Parameters
    ----------
    obj : bytes-like, numpy array or CPU torch tensor
        Must be C-contiguous.
    writable : bool
        Refuse read-only memory.
    name : str
        Argument name for error messages.
    """
    if type(obj) is memoryview and obj.format == "B" and obj.ndim == 1 and obj.c_contiguous:
        if writable and obj.readonly:
            raise ValueError(f"{name}: expected writable memory, got a read-only buffer")
        return obj  # already flat bytes: the tiers pass views along
    if type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "untyped_storage"):
        torch = sys.modules["torch"]
        if obj.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got one on {obj.device}")
        if not obj.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
        obj = obj.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array")
        obj = obj.reshape(-1).view(np.uint8)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"{name}: expected a bytes-like object, numpy array or CPU torch tensor, "
            f"got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{name}: expected contiguous memory")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError(f"{name}: expected writable memory, got a read-only buffer")
    return view


@dataclass(frozen=True)
class UnitHeader:
    """A decoded unit header (see the module docstring for the fields).

    ``raw`` is the header exactly as stored (``header_length`` bytes).
    """

    version: int
    header_length: int
    checksum_algorithm: int
    flags: int
    key: bytes
    first_layer: int
    end_layer: int
    total_layers: int
    position: int
    payload_length: int
    namespace_digest: bytes
    checksum: bytes
    raw: bytes

    @property
    def total_length(self) -> int:
        """Bytes of the whole unit (header and payload)."""
        return self.header_length + self.payload_length

    def hashed_header(self) -> bytes:
        """The header as the checksum covers it (checksum field zeroed)."""
        raw = self.raw
        return raw[:_CHECKSUM_OFFSET] + _ZERO_CHECKSUM + raw[_CHECKSUM_OFFSET + _CHECKSUM_BYTES :]


def _check_layers(namespace: StoreNamespace, first: int, end: int, position: int) -> None:
    if not isinstance(namespace, StoreNamespace):
        raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
    namespace.layer_bytes(first, end)  # validates first/end against the model
    if isinstance(position, (bool, np.bool_)) or not isinstance(position, (int, np.integer)):
        raise TypeError(f"position: expected an int >= 0, got {position!r}")
    if not 0 <= position <= _MAX_POSITION:
        raise ValueError(f"position: expected an int in [0, 2**63), got {position!r}")


def encode_header(
    namespace: StoreNamespace,
    key: Any,
    first: int,
    end: int,
    position: int,
    payload: Any,
) -> bytes:
    """The header of a unit whose payload is ``payload`` (hashed in place, not copied).

    Parameters
    ----------
    namespace : StoreNamespace
    key : bytes | str | int
        Block key (see :func:`normalize_key`).
    first, end : int
        Layer range ``[first, end)`` of the payload.
    position : int
        The block's index in its sequence (0 = first block of the prompt).
    payload : buffer
        uint8 bytes of layers ``[first, end)``, ``namespace.layer_bytes(first, end)``
        long: a region row, a numpy array, a CPU tensor, bytes...

    Returns
    -------
    bytes
        ``header_length(key)`` bytes; write them, then ``payload``.
    """
    _check_layers(namespace, first, end, position)
    raw_key = normalize_key(key)
    view = as_byte_view(payload, name="payload")
    expected = namespace.layer_bytes(first, end)
    if len(view) != expected:
        raise ValueError(
            f"payload: expected {expected} bytes (layers [{first}, {end})), got {len(view)}"
        )
    length = FIXED_HEADER_BYTES + _pad8(len(raw_key))
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        length,
        CHECKSUM_XXH3_128,
        len(raw_key),
        0,
        int(first),
        int(end),
        namespace.num_layers,
        int(position),
        expected,
        namespace.digest,
        _ZERO_CHECKSUM,
    )
    unhashed = fixed + raw_key + bytes(length - FIXED_HEADER_BYTES - len(raw_key))
    hasher = xxhash.xxh3_128()
    hasher.update(unhashed)
    hasher.update(view)
    checksum = hasher.digest()
    return unhashed[:_CHECKSUM_OFFSET] + checksum + unhashed[_CHECKSUM_OFFSET + _CHECKSUM_BYTES :]


def encode_unit(
    namespace: StoreNamespace, key: Any, first: int, end: int, position: int, payload: Any
) -> bytes:
    """A whole unit (header + a copy of the payload) as one bytes object, e.g. a Redis value."""
    header = encode_header(namespace, key, first, end, position, payload)
    return header + as_byte_view(payload, name="payload").tobytes()


def peek_header(buffer: Any) -> UnitHeader:
    """Parse a header's structure WITHOUT checking namespace or checksum (tools only).

    Every length is bounded (the header must lie within ``buffer``), so the
    result is safe to look at, but it is NOT trusted: use
    :func:`decode_header` and a checksum before using a payload.

    Raises
    ------
    CorruptUnit
        Bad magic, version, algorithm, flags, lengths, padding or layer range.
    """
    view = as_byte_view(buffer)
    if len(view) < FIXED_HEADER_BYTES:
        raise CorruptUnit(f"truncated header: {len(view)} of {FIXED_HEADER_BYTES} bytes")
    (
        magic,
        version,
        length,
        algorithm,
        key_length,
        flags,
        first,
        end,
        total,
        position,
        payload_length,
        ns_digest,
        checksum,
    ) = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptUnit(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptUnit(f"unsupported format version {version} (expected {FORMAT_VERSION})")
    if algorithm != CHECKSUM_XXH3_128:
        raise CorruptUnit(f"unknown checksum algorithm {algorithm}")
    if flags:
        raise CorruptUnit(f"unknown flags {flags:#x}")
    if not 1 <= key_length <= MAX_KEY_BYTES:
        raise CorruptUnit(f"key length {key_length} outside [1, {MAX_KEY_BYTES}]")
    if length != FIXED_HEADER_BYTES + _pad8(key_length):
        raise CorruptUnit(f"header length {length} does not match key length {key_length}")
    if len(view) < length:
        raise CorruptUnit(f"truncated header: {len(view)} of {length} bytes")
    raw = bytes(view[:length])
    if any(raw[FIXED_HEADER_BYTES + key_length :]):
        raise CorruptUnit("non-zero header padding")
    if not first < end <= total:
        raise CorruptUnit(f"layer range [{first}, {end}) invalid for {total} layers")
    if position > _MAX_POSITION:
        raise CorruptUnit(f"position {position} out of range")
    return UnitHeader(
        version=version,
        header_length=length,
        checksum_algorithm=algorithm,
        flags=flags,
        key=raw[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + key_length],
        first_layer=first,
        end_layer=end,
        total_layers=total,
        position=position,
        payload_length=payload_length,
        namespace_digest=ns_digest,
        checksum=checksum,
        raw=raw,
    )


def decode_header(
    buffer: Any,
    *,
    namespace: StoreNamespace,
    key: Any = None,
    first: int | None = None,
    end: int | None = None,
) -> UnitHeader:
    """Parse and check a header at the start of ``buffer`` (the payload is NOT verified).

    ``buffer`` may be the header alone (at least ``header_length`` bytes, e.g.
    the first :data:`MAX_HEADER_BYTES` of a file) or the whole unit. Use
    :class:`PayloadVerifier` or :func:`verify_payload` on the payload before
    trusting any byte of it.

    Parameters
    ----------
    namespace : StoreNamespace
        The reader's namespace: digest, layer count and layer sizes must match.
    key, first, end : optional
        When given, the unit must be for exactly this key / layer range.

    Raises
    ------
    CorruptUnit
        Any mismatch (see :func:`peek_header` for the structural ones).
    """
    if not isinstance(namespace, StoreNamespace):
        raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
    header = peek_header(buffer)
    if header.namespace_digest != namespace.digest:
        raise CorruptUnit(
            f"namespace {header.namespace_digest.hex()[:16]}... is not the reader's "
            f"{namespace.hex[:16]}..."
        )
    if header.total_layers != namespace.num_layers:
        raise CorruptUnit(
            f"total layers {header.total_layers} != the namespace's {namespace.num_layers}"
        )
    expected = namespace.layer_bytes(header.first_layer, header.end_layer)
    if header.payload_length != expected:
        raise CorruptUnit(
            f"payload length {header.payload_length} != {expected} bytes of layers "
            f"[{header.first_layer}, {header.end_layer})"
        )
    if key is not None and header.key != normalize_key(key):
        raise CorruptUnit("unit is for another key")
    if first is not None and header.first_layer != first:
        raise CorruptUnit(f"unit starts at layer {header.first_layer}, expected {first}")
    if end is not None and header.end_layer != end:
        raise CorruptUnit(f"unit ends at layer {header.end_layer}, expected {end}")
    return header


def begin_unit_check(
    buffer: Any, *, namespace: StoreNamespace, key: Any, first: int, end: int
) -> tuple[xxhash.xxh3_128, bytes]:
    """Check the header of one expected unit, and start its checksum (a reader's fast path).

    A reader that knows exactly which unit it wants (its namespace, key and
    layer range) knows every header byte but the position and the checksum:
    the header is compared with those bytes at once, which accepts exactly
    the headers :func:`decode_header` accepts with the same ``key``,
    ``first`` and ``end`` (a mismatch is handed to it for the reason), without
    building a :class:`UnitHeader`.

    Parameters
    ----------
    buffer : buffer
        At least the unit's header (``header_length(key)`` bytes; more are ignored).
    namespace : StoreNamespace
    key : bytes | str | int
    first, end : int
        The unit's layer range (validated against ``namespace``).

    Returns
    -------
    (xxhash.xxh3_128, bytes)
        A hasher that has taken the header (checksum zeroed): feed it the
        payload, in pieces of any size, then compare its ``digest()`` with the
        second item, the stored checksum; a difference means :class:`CorruptUnit`.

    Raises
    ------
    CorruptUnit
        The header is not that of this unit (see :func:`decode_header`).
    """
    if not isinstance(namespace, StoreNamespace):
        raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
    raw_key = normalize_key(key)
    payload_length = namespace.layer_bytes(first, end)  # validates first / end
    length = FIXED_HEADER_BYTES + _pad8(len(raw_key))
    view = as_byte_view(buffer)
    if len(view) < length:
        raise CorruptUnit(f"truncated header: {len(view)} of {length} bytes")
    head = bytes(view[:length])
    expected = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        length,
        CHECKSUM_XXH3_128,
        len(raw_key),
        0,
        int(first),
        int(end),
        namespace.num_layers,
        0,
        payload_length,
        namespace.digest,
        _ZERO_CHECKSUM,
    )
    if (
        head[:32] != expected[:32]  # magic .. total layers
        or head[39] >= 0x80  # position < 2**63 (its top byte, little-endian)
        or head[40:_CHECKSUM_OFFSET] != expected[40:_CHECKSUM_OFFSET]  # payload length, digest
        or head[FIXED_HEADER_BYTES:] != raw_key + bytes(length - FIXED_HEADER_BYTES - len(raw_key))
    ):
        decode_header(head, namespace=namespace, key=raw_key, first=first, end=end)
        raise CorruptUnit("header does not match the unit's")  # pragma: no cover - defensive
    hasher = xxhash.xxh3_128()
    hasher.update(head[:_CHECKSUM_OFFSET])
    hasher.update(_ZERO_CHECKSUM)
    hasher.update(head[_CHECKSUM_OFFSET + _CHECKSUM_BYTES :])
    return hasher, head[_CHECKSUM_OFFSET : _CHECKSUM_OFFSET + _CHECKSUM_BYTES]


class PayloadVerifier:
    """Checksum a unit's payload as it arrives, in pieces (readv, Redis chunks).

    >>> verifier = PayloadVerifier(header)      # doctest: +SKIP
    >>> verifier.update(first_piece); verifier.update(second_piece)  # doctest: +SKIP
    >>> verifier.finish()                        # raises CorruptUnit  # doctest: +SKIP
    """

    def __init__(self, header: UnitHeader) -> None:
        if not isinstance(header, UnitHeader):
            raise TypeError(f"header: expected a UnitHeader, got {type(header).__name__}")
        self._header = header
        self._remaining = header.payload_length
        self._hasher = xxhash.xxh3_128()
        self._hasher.update(header.hashed_header())

    def update(self, piece: Any) -> None:
        """Hash the next ``piece`` of payload (any buffer; not copied)."""
        view = as_byte_view(piece, name="piece")
        if len(view) > self._remaining:
            raise CorruptUnit(
                f"payload longer than its header's {self._header.payload_length} bytes"
            )
        self._hasher.update(view)
        self._remaining -= len(view)

    def finish(self) -> None:
        """Raise :class:`CorruptUnit` unless the whole payload came and its checksum matches."""
        if self._remaining:
            raise CorruptUnit(
                f"truncated payload: {self._header.payload_length - self._remaining} of "
                f"{self._header.payload_length} bytes"
            )
        if self._hasher.digest() != self._header.checksum:
            raise CorruptUnit("checksum mismatch")


def verify_payload(header: UnitHeader, parts: Iterable[Any]) -> None:
    """Verify a payload given as consecutive ``parts`` (e.g. ``[row]`` or chunk list)."""
    verifier = PayloadVerifier(header)
    for part in parts:
        verifier.update(part)
    verifier.finish()


def decode_and_verify(
    buffer: Any,
    *,
    namespace: StoreNamespace,
    key: Any = None,
    first: int | None = None,
    end: int | None = None,
) -> tuple[UnitHeader, memoryview]:
    """Decode and fully verify a whole unit held in one buffer.

    Returns
    -------
    (UnitHeader, memoryview)
        The header and a read-only view of the payload inside ``buffer``.

    Raises
    ------
    CorruptUnit
        Anything wrong: see :func:`decode_header`, plus truncation, extra
        bytes and checksum.
    """
    view = as_byte_view(buffer)
    header = decode_header(view, namespace=namespace, key=key, first=first, end=end)
    if len(view) != header.total_length:
        what = "truncated" if len(view) < header.total_length else "extra bytes after"
        raise CorruptUnit(f"{what} unit: {len(view)} bytes, header says {header.total_length}")
    payload = view[header.header_length :].toreadonly()
    verify_payload(header, [payload])
    return header, payload
