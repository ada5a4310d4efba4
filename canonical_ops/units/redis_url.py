"""Redis tier URLs: parsed so that no password character can move the host, printed redacted.

Operators paste passwords with ``/``, ``#``, ``?`` or ``@`` unencoded; a plain
URL parser then takes part of the password for the host or the path and puts it
in error messages. Here the user:password part ends at the one ``@`` after
which a well-formed address follows; a URL where that is ambiguous is refused
with a message that names no part of it. Needs no redis-py (the demo and the
CLI redact without it).
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
    if not ends:
        return scheme, None, rest
    return scheme, rest[: ends[0]], rest[ends[0] + 1 :]


def _redact_query(rest: str) -> str:
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", rest)


def redact_url(url: Any) -> str:
    """``url`` safe to print: credentials and ``password=`` values replaced by ``***``.

    A string without ``://`` (e.g. a directory) is returned unchanged; anything
    before the last ``@`` of a URL whose credentials cannot be told apart is hidden.
    """
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
    """Check a Redis tier URL and take its credentials out (percent-decoded).

    Raises
    ------
    TypeError, ValueError
        Not a str, an unknown scheme, or credentials that cannot be told apart
        from the address; the message names ``url`` and never its password.
    """
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
    username = password = None
    if auth is not None:
        user, colon, secret = auth.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(secret) if colon else None
    return RedisURL(scheme, username, password, f"{scheme}://{rest}")
