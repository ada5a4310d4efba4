"""Values of the Redis tier: a unit as one value, or chunked under a manifest.

Values and publication
----------------------
A unit of at most ``max_value_bytes`` (default 16 MiB: a Llama-3-8B block of
2 MiB or a DeepSeek-V3 block of 4.3 MiB is one value) is stored as one value
with ``SET key unit NX`` (``PX ttl`` with a TTL): the first writer wins, a
later writer's ``SET`` does nothing, and a reader sees a whole unit or
nothing. A larger unit is *chunked*: the writer draws a random 64-bit nonce,
writes chunk 0 = the unit's header and chunks 1..n = its payload in pieces of
``max_value_bytes`` (each with a pending expiry, ``chunk_pending_s``), then,
in the same pipeline (so after the chunks, on the same node), the *manifest*
``CKVMANI\\0`` + nonce + sizes with ``SET key manifest NX GET``. Only the
writer whose manifest landed keeps its chunks (``PERSIST``, or the TTL); a
loser deletes its own. Readers follow the manifest to that one writer's
chunks: two writers' chunks can never be joined (their nonces differ). A
writer that died before its manifest leaves only chunks that expire; one that
died after it, before keeping its chunks, leaves a manifest whose chunks
expire: a miss for the first reader, which removes it. The chunks
concatenated are byte for byte the unit a single value would hold. (A
manifest damaged in the server is a miss and is removed; the chunks it named
are left to their pending expiry, or to eviction once kept.)

Why 16 MiB: Redis refuses values over 512 MiB (``proto-max-bulk-len``), and
a server is single threaded, so one big value stalls every other client while
it is read and copied (milliseconds per ten MiB); 16 MiB keeps that stall
short and still stores realistic units whole (one round trip per load).
"""

from __future__ import annotations

import secrets
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .namespace import StoreNamespace
from .redis_index import _Keys
from .redis_records import _StoreReq
from .redis_wire import _Op, _Parts, _set
from .unit import (
    MAX_HEADER_BYTES,
    CorruptUnit,
    PayloadVerifier,
    decode_header,
    encode_header,
    header_length,
)

MANIFEST_MAGIC = b"CKVMANI\x00"
_MANIFEST_VERSION = 1
# magic, version, reserved, chunk_bytes, payload_chunks, unit_length, nonce
_MANIFEST = struct.Struct("<8sHHQIQ8s")
DEFAULT_MAX_VALUE_BYTES = 16 << 20
# Redis's own bulk limit (proto-max-bulk-len); chunks must also hold a whole header.
_MAX_VALUE_LIMIT = 512 << 20
_MIN_VALUE_BYTES = 4096
assert _MIN_VALUE_BYTES >= MAX_HEADER_BYTES
# A manifest may name at most this many payload chunks: a forged one cannot make
# a reader send an unbounded pipeline.
_MAX_CHUNKS = 1 << 16
# Per thread, a store batch's single values are assembled in a reused buffer of up
# to this size (a larger batch uses a fresh one, freed after its round trip).
_SCRATCH_RETAIN_BYTES = 128 << 20


class _Publish:
    """How one store request is published: where its replies start, its chunks."""

    __slots__ = ("at", "chunks", "manifest", "req", "sent")

    def __init__(self, req: _StoreReq, at: int) -> None:
        self.req, self.at = req, at
        self.chunks: list[str] = []
        self.manifest: bytes | None = None
        self.sent = 0


class _Manifest:
    __slots__ = ("chunk_bytes", "nonce", "payload_chunks")

    def __init__(self, nonce: bytes, chunk_bytes: int, payload_chunks: int) -> None:
        self.nonce, self.chunk_bytes, self.payload_chunks = nonce, chunk_bytes, payload_chunks


def scratch_buffer(tls: threading.local, nbytes: int) -> memoryview:
    """This thread's buffer for the single values of one batch (reused: no page faults).

    A value must be one bulk string, so header and payload are copied together
    once; into fresh memory that copy costs page faults worth half the SET
    itself, so each thread keeps its buffer (up to ``_SCRATCH_RETAIN_BYTES``).
    Only valid until the thread's next store call: the round trip is over then.
    """
    buffer = getattr(tls, "scratch", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = np.empty(nbytes, dtype=np.uint8)
        if nbytes <= _SCRATCH_RETAIN_BYTES:
            tls.scratch = buffer
    return memoryview(buffer)[:nbytes]


class _Header:
    """A unit's header, encoded when called (as its command is packed: see :class:`._Parts`)."""

    __slots__ = ("namespace", "nbytes", "req")

    def __init__(self, namespace: StoreNamespace, req: _StoreReq, nbytes: int) -> None:
        self.namespace, self.req, self.nbytes = namespace, req, nbytes

    def __len__(self) -> int:
        return self.nbytes

    def __call__(self) -> bytes:
        r = self.req
        header = encode_header(self.namespace, r.raw_key, r.first, r.end, r.position, r.payload)
        if len(header) != self.nbytes:  # the bulk string's length is already on the wire
            raise RuntimeError(f"header of {len(header)} bytes, expected {self.nbytes}")
        return header


def plan_values(
    req: _StoreReq,
    ops: list[_Op],
    *,
    namespace: StoreNamespace,
    keys: _Keys,
    max_value_bytes: int,
    zero_copy: bool,
    chunk_pending_s: float,
    ttl_ms: int | None,
    scratch: memoryview,
) -> tuple[_Publish, memoryview]:
    """Append the commands writing ``req``'s unit (one value, or chunks + manifest) to ``ops``.

    Returns the plan and what is left of ``scratch`` (the single value's bytes,
    when the value cannot go out in pieces: ``zero_copy`` False).
    """
    key = keys.unit(req.kd, req.first, req.end)
    head = header_length(req.raw_key)
    total = head + len(req.payload)
    plan = _Publish(req, len(ops))
    if total <= max_value_bytes and zero_copy:
        value = _Parts(_Header(namespace, req, head), req.payload)
        ops.append(_set(key, value, px=ttl_ms, nx=True, size=total))
        plan.sent = total
    elif total <= max_value_bytes:
        # Copy first, then hash the copy (still in cache): the checksum covers
        # exactly the bytes sent.
        value, scratch = scratch[:total], scratch[total:]
        value[head:] = req.payload
        value[:head] = encode_header(
            namespace, req.raw_key, req.first, req.end, req.position, value[head:]
        )
        ops.append(_set(key, value, px=ttl_ms, nx=True, size=total))
        plan.sent = total
    else:
        header = encode_header(
            namespace, req.raw_key, req.first, req.end, req.position, req.payload
        )
        # Chunk 0 is the header, then the payload in place (no copy): the chunks
        # concatenated are the unit. They wait with a pending expiry until the
        # manifest naming their nonce is known to be the one published.
        step = max_value_bytes
        pieces = [memoryview(header)]
        pieces += [req.payload[i : i + step] for i in range(0, len(req.payload), step)]
        nonce = secrets.token_bytes(8)
        plan.chunks = keys.chunks(req.kd, req.first, req.end, nonce, len(pieces))
        pending_ms = max(1, int(chunk_pending_s * 1000))
        if ttl_ms is not None:
            pending_ms = min(pending_ms, ttl_ms)
        for chunk_key, piece in zip(plan.chunks, pieces):
            ops.append(_set(chunk_key, piece, px=pending_ms, size=len(piece)))
        plan.manifest = _MANIFEST.pack(
            MANIFEST_MAGIC, _MANIFEST_VERSION, 0, step, len(pieces) - 1, total, nonce
        )
        size = len(plan.manifest)
        ops.append(_set(key, plan.manifest, px=ttl_ms, nx=True, get=True, size=size))
        plan.sent = total + size
    return plan, scratch


def parse_manifest(
    namespace: StoreNamespace, raw_key: bytes, rng: tuple[int, int], value: Any
) -> _Manifest:
    """A manifest's fields, each bounded by what the namespace says the unit must be."""
    if len(value) != _MANIFEST.size:
        raise CorruptUnit(f"manifest of {len(value)} bytes, expected {_MANIFEST.size}")
    _magic, version, reserved, chunk_bytes, chunks, unit_length, nonce = _MANIFEST.unpack(value)
    if version != _MANIFEST_VERSION or reserved:
        raise CorruptUnit(f"manifest version {version} / flags {reserved} unknown")
    payload = namespace.layer_bytes(*rng)
    if unit_length != header_length(raw_key) + payload:
        raise CorruptUnit(f"manifest unit length {unit_length} is not this unit's")
    if not _MIN_VALUE_BYTES <= chunk_bytes <= _MAX_VALUE_LIMIT:
        raise CorruptUnit(f"manifest chunk size {chunk_bytes} out of range")
    if chunks != -(-payload // chunk_bytes) or chunks > _MAX_CHUNKS:
        raise CorruptUnit(f"manifest names {chunks} chunks for {payload} payload bytes")
    return _Manifest(nonce, chunk_bytes, chunks)


def verify_chunks(
    namespace: StoreNamespace,
    raw_key: bytes,
    rng: tuple[int, int],
    manifest: _Manifest,
    values: list[Any],
) -> list[memoryview]:
    """Verify a chunked unit (header chunk + payload chunks); its payload pieces."""
    head = values[0]
    if len(head) != header_length(raw_key):
        raise CorruptUnit(f"header chunk of {len(head)} bytes")
    header = decode_header(head, namespace=namespace, key=raw_key, first=rng[0], end=rng[1])
    verifier = PayloadVerifier(header)
    parts = []
    remaining = header.payload_length
    for value in values[1:]:
        expected = min(manifest.chunk_bytes, remaining)
        if len(value) != expected:
            raise CorruptUnit(f"payload chunk of {len(value)} bytes, expected {expected}")
        view = memoryview(value)
        verifier.update(view)
        parts.append(view)
        remaining -= expected
    verifier.finish()
    return parts


def _copy_range(parts: Sequence[memoryview], start: int, stop: int, target: memoryview) -> None:
    """Copy bytes ``[start, stop)`` of the concatenation of ``parts`` into ``target``."""
    position = written = 0
    for part in parts:
        size = len(part)
        if position + size > start and position < stop:
            lo, hi = max(start - position, 0), min(stop - position, size)
            target[written : written + hi - lo] = part[lo:hi]
            written += hi - lo
        position += size
        if position >= stop:
            break
