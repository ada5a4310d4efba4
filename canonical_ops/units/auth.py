"""The secret of an authenticated store: units MAC-ed with a key the engines share.

With a :class:`StoreSecret`, units carry HMAC-SHA256-128 over the bytes XXH3 covers (unit
``checksum_algorithm`` 2) and one without a valid tag is a miss. The namespace carries the
key's id (never the key): plain stores and stores of other keys never share a unit.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Mapping

__all__ = ["ENV_SECRET", "ENV_SECRET_FILE", "StoreSecret"]

ENV_SECRET = "CANONICAL_KV_STORE_SECRET"
ENV_SECRET_FILE = "CANONICAL_KV_STORE_SECRET_FILE"
_MIN_KEY_BYTES = 16
_MAX_KEY_BYTES = 4096


class _Tag:
    """HMAC-SHA256 truncated to 16 bytes, shaped like an XXH3-128 hasher."""

    __slots__ = ("_mac", "update")

    def __init__(self, mac: hmac.HMAC) -> None:
        self._mac, self.update = mac, mac.update

    def digest(self) -> bytes:
        return self._mac.digest()[:16]


class StoreSecret:
    """A MAC key (at least 16 bytes); its repr and errors show only :attr:`key_id`."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes | str) -> None:
        if isinstance(key, str):
            key = key.encode()
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key: expected bytes or str, got {type(key).__name__}")
        if not _MIN_KEY_BYTES <= len(key) <= _MAX_KEY_BYTES:
            raise ValueError(
                f"key: expected {_MIN_KEY_BYTES} to {_MAX_KEY_BYTES} bytes, got {len(key)}"
            )
        self._key = bytes(key)
        self.key_id = hmac.digest(self._key, b"canonical-kv.store-key-id.v1", "sha256")[:16].hex()

    def mac(self) -> _Tag:
        """A fresh HMAC-SHA256-128 hasher: ``update(data)``, ``digest()`` (16 bytes)."""
        return _Tag(hmac.new(self._key, digestmod=hashlib.sha256))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> StoreSecret:
        """The key in ``path``: a regular file of this user, not a symlink, mode 0600 or
        stricter (a trailing newline is dropped)."""
        name = os.fspath(path)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(name, flags)
        except OSError as error:
            raise ValueError(f"{ENV_SECRET_FILE}: cannot open {name!r}: {error.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{ENV_SECRET_FILE}: expected a regular file, {name!r} is not")
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ValueError(
                    f"{ENV_SECRET_FILE}: expected a file owned by uid {os.geteuid()} with mode "
                    f"0600 or stricter, {name!r} is uid {st.st_uid} mode "
                    f"{stat.S_IMODE(st.st_mode):04o}"
                )
            key = os.read(fd, _MAX_KEY_BYTES + 1).rstrip(b"\r\n")
        finally:
            os.close(fd)
        try:
            return cls(key)
        except ValueError as error:
            raise ValueError(f"{ENV_SECRET_FILE}: {name!r}: {error}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreSecret | None:
        """The secret named by ``CANONICAL_KV_STORE_SECRET`` (the key itself) or
        ``CANONICAL_KV_STORE_SECRET_FILE`` (a key file); None when neither is set."""
        env = os.environ if environ is None else environ
        value, path = env.get(ENV_SECRET), env.get(ENV_SECRET_FILE)
        if value and path:
            raise ValueError(f"{ENV_SECRET}, {ENV_SECRET_FILE}: expected one of them, got both")
        if path:
            return cls.from_file(path)
        if not value:
            return None
        try:
            return cls(value)
        except ValueError as error:
            raise ValueError(f"{ENV_SECRET}: {error}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.key_id)

    def __repr__(self) -> str:
        return f"StoreSecret(key_id={self.key_id!r})"
