"""Redis tier URLs: parsed so that no password character can move the host, printed redacted.

The user:password part ends at the one ``@`` followed by a well-formed address; an ambiguous
URL is refused by a message naming no part of it. No redis-py needed (demo and CLI use it).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REDIS_SCHEMES", "RedisURL", "parse_url", "redact_url"]

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
# What may follow the credentials: host[:port][/db][?query][#fragment], or a socket path.
_TCP = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::\d{1,5})?(?:/\d*)?(?:[?#].*)?", re.S)
_UNIX = re.compile(r"/[^?#]*(?:[?#].*)?", re.S)
_ENCODE_HINT = (
    "percent-encode '@', '/', '?' and '#' in the password (urllib.parse.quote(password, "
    "safe='')) or pass password=... instead"
)


@dataclass(frozen=True)
class RedisURL:
    """A checked Redis tier URL: ``address`` is the URL without its credentials."""

    scheme: str
    username: str | None
    password: str | None = field(repr=False)
    address: str

    @property
    def cluster(self) -> bool:
        return self.scheme.endswith("+cluster")


def _split(url: str) -> tuple[str, str | None, str] | None:
    """(scheme, user:password part or None, rest), or None when the ``@`` is ambiguous."""
    scheme, _, rest = url.partition("://")
    shape = _UNIX if scheme.lower() == "unix" else _TCP
    ends = [i for i, c in enumerate(rest) if c == "@" and shape.fullmatch(rest, i + 1)]
    if len(ends) > 1 or ("@" in rest and not ends):
        return None
    return (scheme, rest[: ends[0]], rest[ends[0] + 1 :]) if ends else (scheme, None, rest)


def _redact_query(rest: str) -> str:
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", rest)


def redact_url(url: Any) -> str:
    """``url`` safe to print: credentials and ``password=`` values replaced by ``***``; a
    string without ``://`` (a directory) unchanged; if the credentials cannot be told apart,
    all before the last ``@`` hidden."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    if "://" not in url:
        return url
    split = _split(url)
    if split is None:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{_redact_query(rest.rpartition('@')[2])}"
    scheme, auth, rest = split
    if auth is None:
        return f"{scheme}://{_redact_query(rest)}"
    user, colon, _ = auth.partition(":")
    shown = f"{user}:***" if colon and user else "***"
    return f"{scheme}://{shown}@{_redact_query(rest)}"


def parse_url(url: Any) -> RedisURL:
    """Check a Redis tier URL and take its credentials out (percent-decoded). TypeError /
    ValueError (naming ``url``, never its password): not a str, an unknown scheme, or
    credentials that cannot be told apart from the address."""
    if not isinstance(url, str):
        raise TypeError(
            f"url: expected a redis://, rediss:// or unix:// URL str, got {type(url).__name__}"
        )
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"url: expected a URL with scheme {', '.join(s + '://' for s in REDIS_SCHEMES)}; "
            f"got {redact_url(url)!r}"
        )
    split = _split(url)
    if split is None:
        raise ValueError(
            f"url: cannot tell where the user:password part of a {scheme}:// URL ends (an '@' "
            f"that is not followed by a host[:port][/db] or a socket path); {_ENCODE_HINT}"
        )
    _, auth, rest = split
    user, colon, secret = (auth or "").partition(":")
    username = urllib.parse.unquote(user) or None
    password = urllib.parse.unquote(secret) if colon else None
    return RedisURL(scheme, username, password, f"{scheme}://{rest}")
